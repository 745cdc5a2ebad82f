"""/v1/completions and /v1/chat/completions: params.py parses, handlers.py runs, format.py shapes the JSON and SSE chunks."""
