"""The engine: requests in, tokens out, one step at a time; in-process generation and its command line."""
