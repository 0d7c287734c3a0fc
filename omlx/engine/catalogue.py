"""The catalogue of models on this machine: omlx's models folder and the Hugging Face hub cache.

Owns: one `CatalogueEntry` per servable model, with what ``omlx models list`` and ``omlx doctor``
show about it, read from its files without loading weights: where it comes from, bytes on disk,
quantization (config.json's ``quantization``: bits, group size), architecture, context length,
and whether the prefix cache applies (`prefix_cache_of`, mlx-lm's lazy load); the tool-call dialect
its chat template speaks (`tool_dialect_of`).
`listing` gives the rows ``omlx models list --json`` prints and ``GET /v1/admin/models`` serves.
Must not: download, delete, or speak HTTP (``omlx.engine.hub`` owns the hub cache's writes).
"""

from __future__ import annotations

import functools
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Where a model comes from, as ``omlx models list`` names it.
HUB_CACHE, OMLX_HOME, GGUF_IMPORT = "hub cache", "omlx home", "GGUF import"

_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    """One servable model.

    Attributes:
        model_id: its served id (a folder name, or ``ORG/NAME[@REVISION]`` for the hub cache).
        source: `HUB_CACHE`, `OMLX_HOME` or `GGUF_IMPORT` (an omlx-home folder made from a GGUF).
        path: its folder (a snapshot folder, for the hub cache).
        size_bytes: bytes on disk of its files (a snapshot's blobs, for the hub cache).
        architecture: config.json's ``model_type`` (None: not named).
        context_length: most tokens it accepts, per its config (None: not named).
        bits, group_size: its weights' quantization (None: not quantized, or mixed for ``bits``).
        quantization: that as text: "4-bit, group 64", "mixed 4/8-bit", or the weights' dtype.
    """

    model_id: str
    source: str
    path: Path
    size_bytes: int
    architecture: str | None
    context_length: int | None
    bits: int | None
    group_size: int | None
    quantization: str


def local_models(models_dir: Path, hub_cache: Path) -> list[CatalogueEntry]:
    """Every model in ``models_dir`` (dot-folders skipped) and every servable model in the hub cache."""
    from omlx.engine import hub
    from omlx.engine.gguf_import import IMPORT_MARKER

    out: list[CatalogueEntry] = []
    if models_dir.is_dir():
        for p in sorted(models_dir.iterdir()):
            if p.name.startswith(".") or not (p / "config.json").is_file():
                continue
            source = GGUF_IMPORT if (p / IMPORT_MARKER).is_file() else OMLX_HOME
            out.append(describe(p.name, source, p, hub.snapshot_bytes(p)))
    for m in hub.list_cached(hub_cache):
        out.append(describe(m.model_id, HUB_CACHE, m.path, m.size_bytes))
    return out


def listing(models_dir: Path, hub_cache: Path, *, kv_bits: int | None = None, kv_group_size: int = 64,
            cache_enabled: bool = True) -> list[dict[str, Any]]:
    """One JSON-ready row per `local_models` entry: ``id``, ``source``, ``size_bytes``, ``quantization``,
    ``bits``, ``group_size``, ``architecture``, ``context_length``, ``prefix_cache`` (`prefix_cache_label`)
    and ``path``. Reads config files and safetensors headers, no weights; the prefix cache check builds
    each model lazily once (remembered per folder)."""
    rows = []
    for e in local_models(models_dir, hub_cache):
        rows.append({"id": e.model_id, "source": e.source, "size_bytes": e.size_bytes, "quantization": e.quantization,
                     "bits": e.bits, "group_size": e.group_size, "architecture": e.architecture,
                     "context_length": e.context_length,
                     "prefix_cache": prefix_cache_label(e.path, kv_bits, kv_group_size, cache_enabled),
                     "path": str(e.path)})
    return rows


def prefix_cache_label(path: Path, kv_bits: int | None, kv_group_size: int, cache_enabled: bool) -> str:
    """Whether the prefix cache is on for a model folder, as ``omlx models list`` says it: "on",
    "off: <why>", "off (disabled in config)", or "n/a (encoder)" for a model omlx's encoders serve."""
    try:
        mtime_ns = (path / "config.json").stat().st_mtime_ns
    except OSError:
        mtime_ns = 0
    layout, ok = _prefix_cache_memo(str(path), mtime_ns, kv_bits, kv_group_size)
    if ok is None:
        return "n/a (encoder)" if "not an mlx-lm" in layout else "off"
    if not cache_enabled:
        return "off (disabled in config)"
    return "on" if ok else f"off: {layout}"


@functools.lru_cache(maxsize=256)
def _prefix_cache_memo(path: str, mtime_ns: int, kv_bits: int | None, kv_group_size: int) -> tuple[str, bool | None]:
    """`prefix_cache_of`, remembered per folder and config.json mtime: the dashboard asks again every
    few seconds, and building a model lazily costs tens of ms."""
    return prefix_cache_of(Path(path), kv_bits, kv_group_size)


def describe(model_id: str, source: str, path: Path, size_bytes: int) -> CatalogueEntry:
    """A `CatalogueEntry` for a model folder, from its config.json and safetensors header."""
    from omlx.engine.loader import config_context_length

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    bits, group_size, text = quantization_of(config)
    if text is None:
        text = weights_dtype(path) or "unknown dtype"
    ctx = config_context_length(config, default=0) or None
    arch = config.get("model_type")
    return CatalogueEntry(model_id, source, path, size_bytes, arch if isinstance(arch, str) else None, ctx,
                          bits, group_size, text)


def quantization_of(config: dict[str, Any]) -> tuple[int | None, int | None, str | None]:
    """(bits, group size, text) of mlx-lm's ``quantization`` entry in a config.json; per-layer
    entries (mixed quantization, e.g. mlx-community's "mixed_3_6") give bits None and their range.
    (None, None, None) when the weights are not quantized."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict):
        return None, None, None
    if "bits" not in q and "quant_method" in q:  # a Hugging Face quantization (e.g. compressed-tensors)
        return None, None, str(q["quant_method"])
    bits, group = q.get("bits"), q.get("group_size")
    layer_bits = {v.get("bits") for v in q.values() if isinstance(v, dict) and v.get("bits")}
    mode = q.get("mode")
    suffix = f" {mode}" if isinstance(mode, str) and mode != "affine" else ""
    if layer_bits - {bits}:
        span = sorted(int(b) for b in layer_bits | ({bits} if bits else set()))
        return None, group, f"mixed {'/'.join(map(str, span))}-bit{suffix}"
    if not isinstance(bits, int):
        return None, None, None
    return bits, group, f"{bits}-bit, group {group}{suffix}" if group else f"{bits}-bit{suffix}"


def weights_dtype(path: Path) -> str | None:
    """The dtype of the first tensor in the folder's first safetensors file (read from its JSON
    header: 8-byte little-endian length, then the header; safetensors format spec)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    try:
        with open(files[0], "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(n, 100_000_000)))
    except (OSError, ValueError, struct.error):
        return None
    for name, meta in header.items():
        if name != "__metadata__" and isinstance(meta, dict):
            return _DTYPES.get(meta.get("dtype"), meta.get("dtype"))
    return None


def tool_dialect_of(path: Path) -> str | None:
    """The tool-call dialect a model folder's chat template (else its vocabulary) names, as
    ``omlx serve`` detects it at load (`omlx.tool_parsers.detect_dialect`), from its tokenizer
    files without building the tokenizer: ``chat_template.jinja`` or tokenizer_config.json's
    ``chat_template`` (the ``default`` or ``tool_use`` one of a list), and tokenizer.json's
    vocabulary and added tokens. None: no tool format (or unreadable files)."""
    from omlx.tool_parsers import detect_dialect

    template: Any = None
    template_type: Any = None
    try:
        config = (json.loads((path / "tokenizer_config.json").read_text())
                  if (path / "tokenizer_config.json").is_file() else {})
        template_type = config.get("chat_template_type")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: [{"name", "template"}, ...]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("tool_use") or named.get("default")
        vocab: set[str] = set()
        if (path / "tokenizer.json").is_file():
            tok = json.loads((path / "tokenizer.json").read_text())
            vocab.update(t["content"] for t in tok.get("added_tokens") or () if isinstance(t, dict) and "content" in t)
            v = (tok.get("model") or {}).get("vocab")
            vocab.update(v if isinstance(v, dict) else (e[0] for e in v or () if isinstance(e, list) and e))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        logger.debug("cannot read the tokenizer files of %s: %s", path, e)
        return None
    return detect_dialect(template if isinstance(template, str) else None, vocab or None,
                          template_type if isinstance(template_type, str) else None)


def prefix_cache_of(path: Path, kv_bits: int | None = None, kv_group_size: int = 64) -> tuple[str, bool | None]:
    """(cache layout or why there is none, whether the prefix cache can be on) of a model folder,
    as ``--kv-bits`` would serve it, without reading its weights; None for a model mlx-lm does not
    build as a language model (an embedding model omlx serves with its own encoder)."""
    from omlx.engine.cache_spec import describe_model_cache

    try:
        return describe_model_cache(path, kv_bits, kv_group_size)
    except Exception as e:  # not an mlx-lm language model: no prefix cache applies
        return f"not an mlx-lm language model ({type(e).__name__}: {e})", None
