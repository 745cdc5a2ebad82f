"""The worker process around the engine: its loop between two sockets, memory report, profiler, priority, fault injection."""
