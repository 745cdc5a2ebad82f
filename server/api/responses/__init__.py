"""/v1/responses: params.py parses, handlers.py runs and stores, format.py shapes the Response object and its events."""
