"""Serving benchmarks: load through a server's HTTP API, from a server started here or one running elsewhere."""
