"""Scheduling: which sequences run in a step, under a token budget, a KV block pool and a latency target."""
