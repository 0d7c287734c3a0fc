"""Which BLAS MLX's CPU backend runs on, and where a faster one is.

mlx[cpu] wheels for Linux link a reference (Netlib) BLAS, ~15x slower at float32 prefill than
OpenBLAS (measured: ../shared/MODELS.md). `omlx serve` re-executes itself with Debian's
OpenBLAS in ``LD_PRELOAD`` when it is installed; this module detects what is actually loaded so
the server can report it at startup, in ``/health`` and in ``omlx doctor``.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """The BLAS in use.

    Attributes:
        name: "accelerate", "openblas", "reference" or "unknown".
        path: the shared library file, when known.
        fast: False when omlx knows a much faster BLAS exists for this machine.
        advice: what to do about a slow BLAS ('' when fast).
    """

    name: str
    path: str | None
    fast: bool
    advice: str

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "path": self.path, "fast": self.fast, "advice": self.advice}


def find_openblas() -> str | None:
    """Path of an installed OpenBLAS shared library, or None."""
    for p in OPENBLAS_CANDIDATES:
        if Path(p).exists():
            return p
    return None


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if ".so" in line})
    except OSError:
        return []


def detect_blas() -> BlasStatus:
    """Inspect the running process (call after ``import mlx.core``)."""
    if sys.platform == "darwin":
        return BlasStatus("accelerate", None, True, "")
    libs = _loaded_libraries()
    for lib in libs:
        # numpy's bundled scipy-openblas exports suffixed (64_) symbols: it never serves MLX.
        if "openblas" in os.path.basename(lib) and "numpy.libs" not in lib and "scipy_openblas" not in lib:
            return BlasStatus("openblas", lib, True, "")
    for lib in libs:
        base = os.path.basename(lib)
        if base.startswith("libblas") or "mlx_cpu.libs/libblas" in lib:
            fix = (
                f"restart omlx with LD_PRELOAD={find_openblas()}"
                if find_openblas()
                else "install OpenBLAS (apt-get install libopenblas0-pthread) and restart omlx"
            )
            return BlasStatus("reference", lib, False, f"MLX runs on a reference BLAS (~15x slower prefill); {fix}")
    if platform.system() == "Linux" and "mlx.core" in sys.modules:
        return BlasStatus("unknown", None, True, "")
    return BlasStatus("unknown", None, True, "")


def preload_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-exec with OpenBLAS preloaded, or None when not needed/possible.

    Linux only; None when OpenBLAS is missing, already preloaded, or ``OMLX_PRELOAD_BLAS=0``.
    """
    if sys.platform != "linux":
        return None
    lib = find_openblas()
    if lib is None or "openblas" in env.get("LD_PRELOAD", ""):
        return None
    new = dict(env)
    new["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
    return new
