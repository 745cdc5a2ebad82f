"""The frontend process: HTTP/SSE, the OpenAI API, the engine client and the supervisor. Never imports torch."""
