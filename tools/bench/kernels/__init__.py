"""Kernel benchmarks: one kernel, layer or grammar engine at a time, against its reference or the machine's peak."""
