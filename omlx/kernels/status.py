"""`native_kernel_status()`: per native kernel, whether it can run, which path runs, and why.

Owns the decision of which path each kernel of `omlx.kernels.kv_blocks` takes in this process.
A kernel runs natively only on a backend where it was measured at >= 2x over the reference
(`KernelInfo.ships_on`, figures in metal/README.md) and, there, passes a probe (compile, run on
small blocks, compare with the reference bit for bit). When a kernel that ships for this
backend does not run (source missing, probe failed, disabled), that is a slow path and the
status says so with the fix (DESIGN.md, "No silent slow paths"). It reads no environment: the
disabled set comes from the config (``disable_kernels`` / ``OMLX_DISABLE_KERNELS``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection
from dataclasses import asdict, dataclass

from omlx.kernels import sources

logger = logging.getLogger(__name__)

SPEEDUP_BAR = 2.0


@dataclass(frozen=True, slots=True)
class KernelInfo:
    """What omlx knows about one kernel.

    Attributes:
        name: file stem in ``metal/``.
        description: the operation it replaces.
        ships_on: backends where it was measured at >= `SPEEDUP_BAR` over the reference and
            therefore runs by default.
        measured: the measurements behind that choice, one line (details in metal/README.md).
    """

    name: str
    description: str
    ships_on: frozenset[str]
    measured: str


KERNEL_INFO = {
    "kv_gather": KernelInfo(
        "kv_gather",
        "join cached KV blocks into a request's cache at admission",
        frozenset(),
        "0.81-2.01x (median 0.97x) over the reference on an NVIDIA H200 (CUDA, 2026-12-01; MLX's per-array "
        "overhead dominates, not the copy); not yet measured on Apple silicon",
    ),
}


@dataclass(frozen=True, slots=True)
class KernelStatus:
    """The state of one native kernel in this process.

    Attributes:
        name: kernel name (a file stem in ``metal/``).
        description: the operation it speeds up.
        available: True when a native path could run here (source present and
            ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` usable; probed when it ships).
        path: "metal", "cuda" or "reference": what runs.
        backend: the GPU backend of this machine ("metal", "cuda") or "cpu".
        ships: True when measurement says this kernel should run on this backend.
        native_build: the manifest of the ``--with-custom-kernel`` build, if any.
        reason: why the native path does not run ('' when it does).
        slow: True when the reference runs although the kernel should (a slow path).
        warning: a line for the log and /health ('' when there is nothing to say).
        fix: what to do about it ('' when nothing is needed).
    """

    name: str
    description: str
    available: bool
    path: str
    backend: str
    ships: bool
    native_build: str | None
    reason: str
    slow: bool
    warning: str
    fix: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def gpu_backend() -> str:
    """"metal", "cuda" or "cpu": where MLX runs arrays by default in this process."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return "cpu"
    if sys.platform == "darwin" and mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def _jit_usable(backend: str) -> bool:
    import mlx.core as mx

    return hasattr(mx.fast, "metal_kernel" if backend == "metal" else "cuda_kernel")


_cache: dict[tuple[str, ...], dict[str, KernelStatus]] = {}


def native_kernel_status(disabled: Collection[str] = (), *, probe: bool = True,
                         refresh: bool = False) -> dict[str, KernelStatus]:
    """Decide and report the path of every native kernel (cached per arguments).

    Args:
        disabled: kernel names to keep off, or ``"all"``; the config's ``disable_kernels``.
            A disabled kernel always gets a warning line; it is a slow path only where the
            kernel ships.
        probe: compile and check the kernels that ship for this backend (a second or two on
            the first start of a GPU process); False reports without running anything.
        refresh: recompute instead of returning the cached answer.

    Returns:
        Kernel name -> `KernelStatus`. Side effect: the chosen paths are installed in
        `omlx.kernels.kv_blocks` (only kernels that ship and passed the probe run natively).
    """
    from omlx.kernels import kv_blocks

    key = (*sorted(disabled), "probe" if probe else "")
    if key in _cache and not refresh:
        return _cache[key]
    backend = gpu_backend()
    src_dir = sources.find_source_dir()
    build = sources.native_build(src_dir)
    build_note = None
    if build is not None:
        build_note = str(build.manifest) + ("" if build.current else " (stale: sources changed since the build)")
    out = {name: _one(KERNEL_INFO[name], backend, src_dir, build_note, "all" in disabled or name in disabled, probe)
           for name in kv_blocks.KERNELS}
    kv_blocks.set_active_paths({n: s.path for n, s in out.items()})
    _cache[key] = out
    return out


def _one(info: KernelInfo, backend: str, src_dir, build_note: str | None, off: bool, probe: bool) -> KernelStatus:
    ships = backend in info.ships_on
    has_source = src_dir is not None and backend != "cpu" and sources.load_source(info.name, backend, src_dir) is not None
    available = has_source and _jit_usable(backend)
    path, reason, fix = "reference", "", ""
    if backend == "cpu":
        reason = "MLX runs on the CPU here: no GPU kernel applies; the reference path is the fast path"
    elif not has_source:
        looked = ", ".join(str(d) for d in sources.source_dirs())
        reason = f"no {backend} source for {info.name} (looked in {looked})"
        fix = "reinstall omlx with its kernel sources (brew reinstall omlx, or run from a checkout)"
    elif not available:
        reason = f"this MLX has no mx.fast.{'metal' if backend == 'metal' else 'cuda'}_kernel"
        fix = "upgrade MLX to the version omlx pins"
    elif not ships:
        reason = f"kept off on {backend}: measured {info.measured}; below the {SPEEDUP_BAR:g}x bar (metal/README.md)"
    elif off:
        pass
    else:
        err = _probe(info.name, backend) if probe else "not probed"
        if err:
            reason = f"the {backend} kernel did not pass its self-test: {err}"
            fix = "report this with `omlx doctor --json`; omlx runs the reference path meanwhile"
        else:
            path = backend
    slow = ships and path == "reference"
    head = f"native kernel {info.name} ({info.description})"
    warning = ""
    if off:
        # Said even where it changes nothing, so a forgotten switch is never silent.
        effect = ("this machine would run it natively: the reference path runs instead, a slow path" if slow and available
                  else f"without the switch the reference path would run too ({reason})")
        reason = "disabled by configuration (disable_kernels / OMLX_DISABLE_KERNELS)"
        fix = "remove it from disable_kernels (or unset OMLX_DISABLE_KERNELS) and restart"
        warning = f"{head} is disabled by configuration (OMLX_DISABLE_KERNELS); {effect}"
    elif slow:
        warning = f"{head} does not run: {reason}; the reference path runs instead" + (f". Fix: {fix}" if fix else "")
    return KernelStatus(info.name, info.description, available, path, backend, ships, build_note, reason,
                        slow, warning, fix if warning else "")


def _probe(name: str, backend: str) -> str:
    """Run one kernel on small blocks against the reference; '' when equal, else the error."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from omlx.kernels import kv_blocks

    try:
        shape = (1, 2, 16, 64)
        size = 2 * 16 * 64
        # Distinct, exactly representable values per array (bfloat16 holds integers < 256).
        blocks = [tuple(tuple(((mx.arange(size) + 7 * (6 * b + 2 * layer + j)) % 251).reshape(shape).astype(mx.bfloat16)
                              for j in (0, 1)) for layer in range(3)) for b in range(3)]
        takes = [16, 16, 5]
        got = kv_blocks.gather_kv_blocks(blocks, takes, path=backend)
        want = kv_blocks.gather_reference(blocks, takes)
        mx.eval(got, want)
        flat_got, flat_want = tree_flatten(got), tree_flatten(want)
        same = len(flat_got) == len(flat_want) and all(
            a.shape == b.shape and mx.array_equal(a, b).item() for (_, a), (_, b) in zip(flat_got, flat_want))
        return "" if same else "its output differs from the reference"
    except Exception as e:  # a compile or launch error must not stop the server: report it
        logger.debug("kernel probe %s on %s failed", name, backend, exc_info=True)
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {first}"


def slow_path_messages(status: dict[str, KernelStatus]) -> list[str]:
    """The warning lines of `native_kernel_status` (for the log and /health)."""
    return [s.warning for s in status.values() if s.warning]
