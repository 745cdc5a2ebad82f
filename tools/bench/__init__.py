"""The benchmarks, by level: serving/ (through HTTP), engine/ (the Engine in process), kernels/ (one kernel or layer)."""
