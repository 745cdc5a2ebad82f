"""The paged KV cache: its memory, the block pool and block tables, the prefix cache, the shared segment."""
