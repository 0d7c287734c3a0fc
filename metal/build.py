#!/usr/bin/env python3
"""Build omlx's Metal kernels ahead of time (``brew install omlx --with-custom-kernel``).

For every kernel source in this folder (``*.metal``), write one Metal translation unit with
the kernel instantiated for every configuration omlx launches on Metal (blocks per launch,
KV dtype, 16-byte moves or not), with the signature ``mx.fast.metal_kernel`` generates; then
compile it with ``xcrun metal`` and link ``omlx_kernels.metallib``. Last, write
``manifest.json`` (sha256 of every source, the compiler's version, the outputs), which
``omlx.kernels.sources.native_build`` reads and ``native_kernel_status()`` reports.

MLX 0.32 has no Python entry point that launches a kernel from a metallib, so at run time
omlx still hands the same source to ``mx.fast.metal_kernel`` (Metal's run-time compiler ships
with macOS). The build proves, at install time, that the sources compile with this Mac's
toolchain, and records exactly which sources were built (a later edit shows as "stale").

Usage:
    python metal/build.py [--sources DIR] [--out DIR]      # needs the Metal toolchain
    python metal/build.py --emit-only --out DIR             # write the .metal units only (any OS)
Exit status: 0 built, 2 no Metal toolchain (the message says how to get it), 1 compile error.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from omlx.kernels import sources  # noqa: E402

# What omlx launches on Metal (omlx/kernels/kv_blocks.py: G = 1 layer, NB <= 8 blocks).
GROUPS = (1,)
BLOCKS = (1, 2, 4, 8)
DTYPES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16_t"}
PRELUDE = """#include <metal_stdlib>
using namespace metal;
typedef bfloat bfloat16_t;
"""
TOOLCHAIN_HELP = (
    "the Metal toolchain is missing: `xcrun -f metal` found no Metal compiler. omlx's "
    "--with-custom-kernel build needs it. Install Xcode (the Command Line Tools alone lack it), "
    "then run `xcodebuild -downloadComponent MetalToolchain` (Xcode 26 and later) and build again; "
    "or install without --with-custom-kernel (MLX then compiles the kernels at run time)."
)


def translation_unit(kernel: str, src: sources.KernelSource) -> str:
    """One .metal file holding ``kernel`` for every (group, blocks, dtype, VEC) omlx launches."""
    parts = [PRELUDE, src.header]
    for g in GROUPS:
        for nb in BLOCKS:
            n_in, n_out = 2 * g * nb, 2 * g
            body = src.body.replace(sources.SELECT, sources.select_code(n_in, n_out))
            for dname, mtype in DTYPES.items():
                for vec in (True, False):
                    args = ["const device int* meta [[buffer(0)]]"]
                    args += [f"const device {mtype}* s{i} [[buffer({i + 1})]]" for i in range(n_in)]
                    args += [f"device {mtype}* o{i} [[buffer({n_in + 1 + i})]]" for i in range(n_out)]
                    args += ["uint3 thread_position_in_grid [[thread_position_in_grid]]",
                             "uint3 threads_per_grid [[threads_per_grid]]"]
                    name = f"omlx_{kernel}_g{g}_n{nb}_{dname}{'_vec' if vec else ''}"
                    sig = ",\n    ".join(args)
                    parts.append(f"[[kernel]] void {name}(\n    {sig}) {{\n  using T = {mtype};\n"
                                 f"  constexpr bool VEC = {'true' if vec else 'false'};\n{body}}}\n")
    return "\n".join(parts)


def find_toolchain() -> dict[str, str] | None:
    """Paths of ``metal`` and ``metallib`` (via xcrun), or None when either is missing."""
    if shutil.which("xcrun") is None:
        return None
    found = {}
    for tool in ("metal", "metallib"):
        r = subprocess.run(["xcrun", "-sdk", "macosx", "-f", tool], capture_output=True, text=True)
        if r.returncode != 0 or not r.stdout.strip():
            return None
        found[tool] = r.stdout.strip()
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=Path, default=HERE, help="folder of the kernel sources (default: this one)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: <sources>/build)")
    ap.add_argument("--emit-only", action="store_true", help="write the .metal units and stop (no toolchain needed)")
    args = ap.parse_args(argv)
    src_dir = args.sources.resolve()
    out = (args.out or src_dir / "build").resolve()
    kernels = sorted(p.stem for p in src_dir.glob("*.metal"))
    if not kernels:
        print(f"omlx metal build: no *.metal sources in {src_dir}", file=sys.stderr)
        return 1
    tools = None
    if not args.emit_only:
        tools = find_toolchain()
        if tools is None:
            print(f"omlx metal build: {TOOLCHAIN_HELP}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    units = []
    for k in kernels:
        src = sources.load_source(k, "metal", src_dir)
        assert src is not None
        unit = out / f"{k}.gen.metal"
        unit.write_text(translation_unit(k, src))
        units.append(unit)
    if args.emit_only:
        print("\n".join(str(u) for u in units))
        return 0
    assert tools is not None
    airs = []
    for unit in units:
        air = unit.with_suffix(".air")
        r = subprocess.run(["xcrun", "-sdk", "macosx", "metal", "-std=metal3.1", "-O2", "-c", str(unit), "-o", str(air)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"omlx metal build: {unit.name} does not compile:\n{r.stderr}", file=sys.stderr)
            return 1
        airs.append(air)
    lib = out / sources.METALLIB
    r = subprocess.run(["xcrun", "-sdk", "macosx", "metallib", *map(str, airs), "-o", str(lib)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"omlx metal build: metallib failed:\n{r.stderr}", file=sys.stderr)
        return 1
    version = subprocess.run(["xcrun", "-sdk", "macosx", "metal", "--version"], capture_output=True, text=True).stdout
    manifest = {
        "format": 1,
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "sources_dir": str(src_dir),
        "sources": sources.source_hashes(src_dir),
        "kernels": kernels,
        "metallib": lib.name,
        "metallib_sha256": hashlib.sha256(lib.read_bytes()).hexdigest(),
        "metal_compiler": tools["metal"],
        "metal_version": version.strip().splitlines()[0] if version.strip() else "",
    }
    (out / sources.MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"omlx metal build: {lib} ({', '.join(kernels)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
