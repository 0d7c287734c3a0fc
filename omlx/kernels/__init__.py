"""Native kernels and the status of every fast path (BLAS, kernels): never a silent slow path."""
