"""The OpenAI-compatible API: the router, admission, and one sub-package per API family.

router.py maps paths to handlers; completions/ serves /v1/completions and
/v1/chat/completions, responses/ serves /v1/responses. Each family has its
params (request parsing), handlers and format (the JSON it answers with).
"""
