"""The worker: weights, paged KV cache, scheduling and sampling. Its Engine is usable in-process."""
