"""Text in, text out around the engine: tokenizing, chat templates, detokenizing, stop strings, and one choice's run.

Used by both APIs (api/completions, api/responses); knows the engine client
and the Responder it streams through, and nothing of either API's JSON shape.
"""
