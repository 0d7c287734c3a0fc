"""The checks of `omlx doctor`: is this machine set up to serve at full speed, and if not, why.

Owns the checks and their verdicts (a `Finding` per check, each with its fix); prints nothing
and knows no command line (``omlx/cli/doctor.py`` renders the report). Facts that belong to
higher layers (the memory ceiling the enforcer would use, whether ``omlx serve`` could bind its
address) are measured by the caller and passed in as `Facts`, so the import contract holds.

The BLAS reported is the one ``omlx serve`` will use, not necessarily this process's: on Linux
``omlx serve`` re-executes itself with OpenBLAS preloaded, ``omlx doctor`` does not.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omlx.config import ServerConfig
from omlx.units import format_bytes

SCHEMA_VERSION = 1
LEVELS = ("ok", "info", "warning", "error")
CHECKS = ("platform", "mlx", "backend", "blas", "kernels", "metal_toolchain", "memory", "directories",
          "disk", "port", "models")
MIN_FREE_BYTES = 1 * 10**9
LOW_FREE_BYTES = 10 * 10**9


@dataclass(frozen=True, slots=True)
class Finding:
    """The verdict of one check.

    Attributes:
        check: one of `CHECKS`.
        level: "ok", "info", "warning" (runs, but slower or degraded) or "error" (will not run).
        summary: one line for a person.
        fix: what to do ('' for ok/info).
        detail: machine-readable facts (JSON-safe).
    """

    check: str
    level: str
    summary: str
    fix: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Facts:
    """What the caller measured with modules above this layer.

    Attributes:
        memory_ceiling_bytes: the ceiling ``omlx serve`` would enforce (``omlx.memory``).
        bind_problem: why ``omlx serve`` could not bind host:port, or None when it could.
        model_caches: per model folder name, (cache layout or why the prefix cache cannot
            hold it, whether it can; None for a folder that is no mlx-lm language model)
            (``omlx.engine.cache_spec.describe_model_cache``).
        model_dialects: per model, the tool-call dialect ``omlx serve`` would use (a config's
            ``tool_dialect``, else the one its chat template names), None for none.
    """

    memory_ceiling_bytes: int | None
    bind_problem: str | None
    model_caches: dict[str, tuple[str, bool | None]] = field(default_factory=dict)
    model_dialects: dict[str, str | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DoctorReport:
    """All findings; `exit_code` is 1 when any is an error."""

    findings: tuple[Finding, ...]

    @property
    def num_errors(self) -> int:
        return sum(f.level == "error" for f in self.findings)

    @property
    def num_warnings(self) -> int:
        return sum(f.level == "warning" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.num_errors else 0

    def as_dict(self) -> dict[str, Any]:
        from omlx import __version__

        return {"schema_version": SCHEMA_VERSION, "omlx": __version__, "ok": self.num_errors == 0,
                "num_errors": self.num_errors, "num_warnings": self.num_warnings,
                "findings": [asdict(f) for f in self.findings]}


def run_checks(cfg: ServerConfig, facts: Facts) -> DoctorReport:
    """Run every check in `CHECKS` order; a check that crashes becomes an error finding."""
    out = []
    for name in CHECKS:
        try:
            out.append(_CHECKS[name](cfg, facts))
        except Exception as e:  # one broken probe must not hide the other findings
            out.append(Finding(name, "error", f"the {name} check failed: {type(e).__name__}: {e}",
                               "report this with `omlx doctor --json`"))
    return DoctorReport(tuple(out))


# ---------------------------------------------------------------- checks


def check_platform(cfg: ServerConfig, facts: Facts) -> Finding:
    detail = {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
              "python": platform.python_version()}
    if sys.platform == "darwin" and platform.machine() != "arm64":
        return Finding("platform", "error", "macOS on Intel: MLX needs Apple silicon (M1 or later)",
                       "run omlx on an Apple-silicon Mac, or on Linux", detail)
    if sys.platform not in ("darwin", "linux"):
        return Finding("platform", "error", f"{sys.platform} is not supported (macOS or Linux only)",
                       "run omlx on macOS (Apple silicon) or Linux", detail)
    return Finding("platform", "ok", f"{detail['system']} {detail['release']} {detail['machine']}, "
                   f"Python {detail['python']}", "", detail)


def _pinned(name: str) -> str | None:
    """The exact version omlx's metadata pins for ``name`` on this platform, if any."""
    try:
        reqs = importlib.metadata.requires("omlx") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for r in reqs:
        head, _, marker = r.partition(";")
        if "extra ==" in marker:
            continue
        if marker.strip() and sys.platform not in marker and "sys_platform" in marker:
            continue
        base = head.split("[")[0].split("==")[0].strip().lower()
        if base == name and "==" in head:
            return head.split("==")[1].strip()
    return None


def check_mlx(cfg: ServerConfig, facts: Facts) -> Finding:
    try:
        import mlx.core as mx
    except ImportError as e:
        extra = "mlx[cuda13]" if shutil.which("nvidia-smi") else ("mlx" if sys.platform == "darwin" else "mlx[cpu]")
        return Finding("mlx", "error", f"MLX cannot be imported: {e}", f"pip install '{extra}' (the version omlx pins)")
    try:
        lm_version = importlib.metadata.version("mlx-lm")
    except importlib.metadata.PackageNotFoundError:
        lm_version = None
    detail = {"mlx": mx.__version__, "mlx_lm": lm_version, "pinned_mlx": _pinned("mlx"), "pinned_mlx_lm": _pinned("mlx-lm")}
    if lm_version is None:
        return Finding("mlx", "error", "mlx-lm is not installed", "pip install omlx again (it pins mlx-lm)", detail)
    off = [f"{n} {detail[n]} (omlx pins {detail['pinned_' + n]})" for n in ("mlx", "mlx_lm")
           if detail["pinned_" + n] and detail[n] != detail["pinned_" + n]]
    if off:
        return Finding("mlx", "warning", "versions differ from omlx's pins: " + ", ".join(off),
                       "reinstall omlx so pip installs the pinned versions", detail)
    return Finding("mlx", "ok", f"MLX {mx.__version__}, mlx-lm {lm_version}", "", detail)


def check_backend(cfg: ServerConfig, facts: Facts) -> Finding:
    import mlx.core as mx

    from omlx.kernels.status import gpu_backend

    backend = gpu_backend()
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:
        info = {}
    detail = {"backend": backend, "device": str(mx.default_device()), "device_info": info}
    name = info.get("device_name", "")
    if backend == "cpu":
        if sys.platform == "darwin":
            return Finding("backend", "warning", "MLX runs on the CPU: Metal is not available",
                           "use an Apple-silicon Mac with macOS 14 or later; reinstall mlx", detail)
        if shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists():
            return Finding("backend", "warning", "an NVIDIA GPU is present but MLX runs on the CPU",
                           "pip install 'mlx[cuda13]' (same version) in omlx's environment", detail)
        return Finding("backend", "info", f"MLX runs on the CPU ({name or platform.processor() or 'cpu'}): "
                       "no GPU backend on this machine", "", detail)
    return Finding("backend", "ok", f"MLX runs on {backend} ({name})", "", detail)


def serve_blas(preload_blas: bool) -> dict[str, Any]:
    """The BLAS ``omlx serve`` would run on: ``{name, path, fast, advice, this_process}``."""
    from omlx.kernels.blas import detect_blas, find_openblas

    here = detect_blas()
    out: dict[str, Any] = {"this_process": here.as_dict()}
    if sys.platform == "darwin" or here.name == "openblas":
        return {**here.as_dict(), **out}
    lib = find_openblas()
    if here.name == "reference" and preload_blas and lib:
        return {"name": "openblas", "path": lib, "fast": True, "advice": "", "preloaded_by_serve": True, **out}
    if here.name == "reference" and lib and not preload_blas:
        return {**here.as_dict(), "advice": f"preload_blas is off: set OMLX_PRELOAD_BLAS=1 (serve preloads {lib})", **out}
    return {**here.as_dict(), **out}


def check_blas(cfg: ServerConfig, facts: Facts) -> Finding:
    from omlx.kernels.status import gpu_backend

    b = serve_blas(cfg.preload_blas)
    where = f" ({b['path']})" if b.get("path") else ""
    if b["fast"]:
        how = ", preloaded by `omlx serve`" if b.get("preloaded_by_serve") else ""
        return Finding("blas", "ok", f"BLAS {b['name']}{where}{how}", "", b)
    # MLX on a GPU does its matmuls there; the CPU BLAS then only matters for CPU streams.
    level = "info" if gpu_backend() != "cpu" else "warning"
    return Finding("blas", level, f"BLAS {b['name']}{where}: ~15x slower prefill on the CPU", b["advice"], b)


def check_kernels(cfg: ServerConfig, facts: Facts) -> Finding:
    from omlx.kernels import sources
    from omlx.kernels.status import native_kernel_status

    status = native_kernel_status(cfg.disable_kernels)
    src = sources.find_source_dir()
    build = sources.native_build(src)
    detail: dict[str, Any] = {"kernels": {n: s.as_dict() for n, s in status.items()},
                              "source_dir": str(src) if src else None,
                              "native_build": str(build.manifest) if build else None,
                              "native_build_current": build.current if build else None}
    slow = [s for s in status.values() if s.slow]
    warned = [s for s in status.values() if s.warning]
    if slow:
        return Finding("kernels", "warning", "; ".join(s.warning for s in slow), "; ".join(s.fix for s in slow), detail)
    if build is not None and not build.current:
        return Finding("kernels", "warning", "the --with-custom-kernel build is stale (kernel sources changed since)",
                       "brew reinstall omlx --with-custom-kernel", detail)
    summary = ", ".join(f"{s.name}: {s.path}" + (f" ({s.reason})" if s.path == "reference" else "")
                        for s in status.values())
    if warned:
        return Finding("kernels", "info", "; ".join(s.warning for s in warned), "; ".join(s.fix for s in warned), detail)
    return Finding("kernels", "ok", summary, "", detail)


def check_metal_toolchain(cfg: ServerConfig, facts: Facts) -> Finding:
    if sys.platform != "darwin":
        return Finding("metal_toolchain", "info", "not applicable (not macOS)", "", {"applicable": False})
    try:
        r = subprocess.run(["xcrun", "-f", "metal"], capture_output=True, text=True, timeout=30)
        path = r.stdout.strip() if r.returncode == 0 else ""
        err = r.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        path, err = "", str(e)
    detail = {"applicable": True, "metal": path or None, "error": err or None}
    if path:
        return Finding("metal_toolchain", "ok", f"Metal compiler {path}", "", detail)
    # Only the --with-custom-kernel build needs it: at run time MLX compiles kernels itself.
    return Finding("metal_toolchain", "info", "no Metal compiler (`xcrun -f metal` failed); needed only to build "
                   "`brew install omlx --with-custom-kernel`",
                   "install Xcode, then `xcodebuild -downloadComponent MetalToolchain` (Xcode 26+)", detail)


def _gb(num_bytes: float) -> str:
    # One unit for RAM, ceiling and disk figures, so they compare at a glance.
    return format_bytes(num_bytes, "GB", 1)


def check_memory(cfg: ServerConfig, facts: Facts) -> Finding:
    import psutil

    total = psutil.virtual_memory().total
    avail = psutil.virtual_memory().available
    detail = {"total_bytes": total, "available_bytes": avail, "ceiling_bytes": facts.memory_ceiling_bytes}
    ceiling = facts.memory_ceiling_bytes
    if ceiling is None:
        return Finding("memory", "info", f"{_gb(total)} RAM; ceiling unknown", "", detail)
    if ceiling > total:
        return Finding("memory", "warning", f"memory ceiling {_gb(ceiling)} is above the RAM "
                       f"({_gb(total)}): the OS will swap before omlx reacts",
                       "lower [memory] ceiling (or OMLX_MEMORY_CEILING) below the RAM", detail)
    if ceiling < 2 * 10**9:
        return Finding("memory", "warning", f"memory ceiling {_gb(ceiling)} leaves little room for a model",
                       "raise [memory] ceiling (or OMLX_MEMORY_CEILING)", detail)
    return Finding("memory", "ok", f"ceiling {_gb(ceiling)} of {_gb(total)} RAM "
                   f"({_gb(avail)} available now)", "", detail)


def _existing_ancestor(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_directories(cfg: ServerConfig, facts: Facts) -> Finding:
    dirs = {"base": cfg.base_dir, "models": cfg.models_dir, "ssd_cache": cfg.ssd_cache_dir}
    detail: dict[str, Any] = {}
    bad = []
    for label, d in dirs.items():
        anchor = _existing_ancestor(d)
        writable = os.access(anchor, os.W_OK | os.X_OK) and anchor.is_dir()
        detail[label] = {"path": str(d), "exists": d.exists(), "writable": writable}
        if not writable:
            bad.append(f"{d} ({'not writable' if anchor == d else f'cannot be created in {anchor}'})")
    if bad:
        return Finding("directories", "error", "cannot write " + ", ".join(bad),
                       "fix the permissions, or choose another --base-path / ssd_cache_dir", detail)
    return Finding("directories", "ok", ", ".join(f"{k} {v}" for k, v in dirs.items()), "", detail)


def check_disk(cfg: ServerConfig, facts: Facts) -> Finding:
    detail: dict[str, Any] = {}
    worst: tuple[int, str] | None = None
    for label, d in {"models": cfg.models_dir, "ssd_cache": cfg.ssd_cache_dir}.items():
        anchor = _existing_ancestor(d)
        free = shutil.disk_usage(anchor).free
        detail[label] = {"path": str(d), "free_bytes": free}
        if worst is None or free < worst[0]:
            worst = (free, str(d))
    assert worst is not None
    free, where = worst
    want = cfg.cache.ssd_cache_max_bytes
    detail["ssd_cache_max_bytes"] = want
    if free < MIN_FREE_BYTES:
        return Finding("disk", "error", f"{format_bytes(free, 'GB')} free for {where}: models and the SSD cache need more",
                       "free disk space or move --base-path / ssd_cache_dir to a larger disk", detail)
    if free < LOW_FREE_BYTES or (want and free < want):
        return Finding("disk", "warning", f"{_gb(free)} free for {where}"
                       + (f" (below ssd_cache_max_size {_gb(want)})" if want and free < want else ""),
                       "free disk space, or lower ssd_cache_max_size", detail)
    return Finding("disk", "ok", f"{_gb(free)} free", "", detail)


def _omlx_answers(host: str, port: int) -> bool:
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            body = json.loads(r.read(65536) or b"{}")
    except Exception:
        return False
    return isinstance(body, dict) and "slow_paths" in body and "models" in body


def check_port(cfg: ServerConfig, facts: Facts) -> Finding:
    detail = {"host": cfg.host, "port": cfg.port, "problem": facts.bind_problem}
    if facts.bind_problem is None:
        return Finding("port", "ok", f"{cfg.host}:{cfg.port} is free", "", detail)
    if "already in use" in facts.bind_problem and _omlx_answers(cfg.host, cfg.port):
        return Finding("port", "info", f"omlx is already running on {cfg.host}:{cfg.port}", "",
                       {**detail, "omlx_running": True})
    return Finding("port", "error", facts.bind_problem,
                   "use --port / --host (or OMLX_PORT), stop the program using the port, or set an API key", detail)


def check_models(cfg: ServerConfig, facts: Facts) -> Finding:
    d = cfg.models_dir
    present = sorted(p.name for p in d.iterdir() if (p / "config.json").is_file()) if d.is_dir() else []
    present += sorted(set(facts.model_caches) - set(present))  # models in the Hugging Face hub cache
    missing = []
    for spec in cfg.models:
        p = Path(spec).expanduser()
        if spec in present or spec in facts.model_caches or (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf"):
            continue
        missing.append(spec)
    caches = {name: {"layout": text, "prefix_cache": ok} for name, (text, ok) in facts.model_caches.items()}
    detail = {"models_dir": str(d), "present": present, "configured": list(cfg.models), "missing": missing,
              "caches": caches, "tool_dialects": dict(facts.model_dialects)}
    if missing:
        return Finding("models", "error", f"configured model(s) not found: {', '.join(missing)}",
                       f"`omlx models import PATH`, `omlx models pull ORG/NAME` for a Hugging Face repo, "
                       f"or fix the model setting (present in {d} and the hub cache: "
                       f"{', '.join(present) or 'none'})", detail)
    if not present:
        return Finding("models", "info", f"no models in {d} yet; `omlx serve` imports the default "
                       "SmolLM2-135M-Instruct on its first start", "", detail)
    def named(name: str) -> str:
        dialect = facts.model_dialects.get(name)
        if name not in facts.model_caches or facts.model_caches[name][1] is None:
            return f"{name} (tool calls: {dialect})" if dialect else name
        # A chat model says whether its tool calls are parsed (serve's load log warns when not).
        tools = f"; tool calls: {dialect or 'none detected'}"
        text, ok = facts.model_caches[name]
        return f"{name} (cache {text}; prefix cache on{tools})" if ok else f"{name} (prefix cache off: {text}{tools})"

    off = [n for n, (_, ok) in facts.model_caches.items() if ok is False]
    summary = f"{len(present)} model(s): {', '.join(named(n) for n in present)}"
    if off:
        return Finding("models", "warning", summary, "these models serve without prefix reuse: every prompt "
                       "is prefilled in full", detail)
    return Finding("models", "ok", summary, "", detail)


_CHECKS = {
    "platform": check_platform, "mlx": check_mlx, "backend": check_backend, "blas": check_blas,
    "kernels": check_kernels, "metal_toolchain": check_metal_toolchain, "memory": check_memory,
    "directories": check_directories, "disk": check_disk, "port": check_port, "models": check_models,
}
