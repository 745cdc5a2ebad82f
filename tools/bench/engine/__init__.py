"""Engine benchmarks: gpu_worker's Engine in this process, no HTTP; and the random-weight checkpoints they serve."""
