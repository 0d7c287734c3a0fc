"""Where the native kernel sources live, how they are split for MLX, and the native build.

Owns reading ``metal/`` (Metal sources and their CUDA twins) and the manifest written by
``metal/build.py`` (the Homebrew formula's ``--with-custom-kernel``). It launches nothing and
imports no mlx: `omlx.kernels.kv_blocks` compiles and runs the kernels.

A source file holds one kernel: a comment block, then ``// @@header`` (helpers placed before the
generated function) and ``// @@body`` (the function body; MLX generates the signature from
the input and output names). ``/*@@select*/`` in the body is replaced by the generated code that
picks this thread's input and output pointers.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# The formula's option and the build script it runs; tests/unit/test_formula.py checks both.
BUILD_OPTION = "with-custom-kernel"
BUILD_SCRIPT = "metal/build.py"
MANIFEST = "manifest.json"
METALLIB = "omlx_kernels.metallib"

_HEADER = "// @@header"
_BODY = "// @@body"
SELECT = "/*@@select*/"


@dataclass(frozen=True, slots=True)
class KernelSource:
    """One kernel's source for one backend.

    Attributes:
        path: the file.
        header: code placed before the generated function (helpers).
        body: the function body, with ``/*@@select*/`` where pointers are chosen.
    """

    path: Path
    header: str
    body: str


@dataclass(frozen=True, slots=True)
class NativeBuild:
    """The result of ``metal/build.py`` (``brew install omlx --with-custom-kernel``).

    Attributes:
        manifest: the manifest file.
        metallib: the compiled library, when it exists.
        current: True when the manifest's source hashes match the sources in use.
    """

    manifest: Path
    metallib: Path | None
    current: bool


def source_dirs() -> list[Path]:
    """Folders searched for kernel sources, first match wins.

    A checkout (or editable install) has ``metal/`` beside the package; the Homebrew formula
    installs it to ``<venv>/share/omlx/metal`` (``sys.prefix`` of its virtualenv).
    """
    here = Path(__file__).resolve().parents[2] / "metal"
    return [here, Path(sys.prefix) / "share" / "omlx" / "metal"]


def find_source_dir() -> Path | None:
    """The first folder of `source_dirs` holding kernel sources, or None."""
    for d in source_dirs():
        if any(d.glob("*.cu")) or any(d.glob("*.metal")):
            return d
    return None


def parse_source(text: str, path: Path) -> KernelSource:
    """Split a kernel file at its markers.

    Raises:
        ValueError: a marker is missing or the body has no ``/*@@select*/``.
    """
    if _HEADER not in text or _BODY not in text:
        raise ValueError(f"{path}: needs '{_HEADER}' and '{_BODY}' markers")
    head, _, rest = text.partition(_HEADER)
    header, _, body = rest.partition(_BODY)
    if SELECT not in body:
        raise ValueError(f"{path}: the body needs a '{SELECT}' marker")
    return KernelSource(path, header.strip("\n") + "\n", body.strip("\n") + "\n")


def load_source(kernel: str, backend: str, directory: Path | None = None) -> KernelSource | None:
    """The source of ``kernel`` for ``backend`` ("metal" or "cuda"), or None when absent.

    Raises:
        ValueError: the file exists but is malformed.
    """
    directory = directory or find_source_dir()
    if directory is None:
        return None
    path = directory / f"{kernel}.{'metal' if backend == 'metal' else 'cu'}"
    if not path.is_file():
        return None
    return parse_source(path.read_text(), path)


def select_code(num_inputs: int, num_outputs: int, src_index: str = "m", dst_index: str = "q") -> str:
    """The code replacing ``/*@@select*/``: pick input ``s<i>`` and output ``o<j>`` by index.

    MLX generates one parameter per input array, so the pointer is chosen with a ``switch``
    (a jump table); an index out of range returns from the kernel.
    """
    def switch(var: str, target: str, prefix: str, n: int) -> str:
        cases = " ".join(f"case {i}: {target} = {prefix}{i}; break;" for i in range(n))
        return f"switch ({var}) {{ {cases} default: return; }}"

    return switch(src_index, "src", "s", num_inputs) + "\n  " + switch(dst_index, "dst", "o", num_outputs)


def source_hashes(directory: Path) -> dict[str, str]:
    """sha256 of every kernel source file in ``directory`` (name -> hex digest)."""
    out = {}
    for p in sorted([*directory.glob("*.metal"), *directory.glob("*.cu")]):
        out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def native_build(directory: Path | None = None) -> NativeBuild | None:
    """The native build next to the sources (``<dir>/build/manifest.json``), or None."""
    directory = directory or find_source_dir()
    if directory is None:
        return None
    manifest = directory / "build" / MANIFEST
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return NativeBuild(manifest, None, False)
    lib = directory / "build" / METALLIB
    current = data.get("sources") == source_hashes(directory)
    return NativeBuild(manifest, lib if lib.is_file() else None, current)
