"""The worker's native side: the compiled C kernels' loader, the compute threads, the row counts kernels compute on."""
