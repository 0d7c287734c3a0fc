"""Native kernels and the status of every fast path (BLAS, kernels): never a silent slow path.

`native_kernel_status()` (omlx.kernels.status) says per kernel whether it can run, which path
runs (metal / cuda / reference) and why; importing this package imports no mlx.
"""

from omlx.kernels.status import KernelStatus, native_kernel_status

__all__ = ["KernelStatus", "native_kernel_status"]
