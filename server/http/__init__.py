"""The HTTP/1.1 layer: sockets, connections, request parsing, responses, SSE and the OpenAI error body.

Knows bytes on the wire and nothing of routes, JSON payloads or the engine;
everything above it (api/, generation/) speaks to a client through a Responder.
"""
