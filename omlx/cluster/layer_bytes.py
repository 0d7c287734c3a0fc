"""Per-layer weight bytes of a model folder, read from safetensors headers without loading tensors.

Owns turning a local model folder (``config.json`` + ``model.safetensors`` or
``model.safetensors.index.json`` + shards, as mlx-lm and Hugging Face write them) into the
``ModelLayout`` the planner takes. It reads only the JSON header at the start of each file
(format: https://github.com/huggingface/safetensors#format), so it is cheap on any model size.
Must not import mlx or numpy, and must not read tensor data.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from pathlib import Path
from typing import Any

from omlx.cluster.plan import ModelLayout

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors library itself enforces
# `model.layers.N.` anywhere in the name, so `language_model.model.layers.N.` (VLMs) counts too,
# while vision towers (`vision_model.encoder.layers.N.`) do not.
_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
_FINAL_NORM = re.compile(r"(?:^|\.)model\.norm\.")

_DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float": 4,
    "half": 2,
    "float64": 8,
}


def read_safetensors_header(path: Path) -> dict[str, int]:
    """Tensor name -> size in bytes, from one safetensors file's header (no tensor data read).

    Sizes are ``data_offsets[1] - data_offsets[0]``, so packed quantized weights, scales and biases
    count at their stored size.

    Raises:
        ValueError: The file is not a valid safetensors file.
        OSError: It cannot be read.
    """
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES:
            raise ValueError(
                f"{path}: safetensors header of {header_len} bytes is implausibly large"
            )
        raw = f.read(header_len)
    if len(raw) != header_len:
        raise ValueError(f"{path}: safetensors header is truncated")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    sizes: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets") from e
        sizes[name] = int(end) - int(begin)
    return sizes


def weight_files(model_path: Path) -> list[Path]:
    """The safetensors files of a model folder, in a stable order.

    ``model.safetensors.index.json`` (its ``weight_map`` shards) first, then ``model.safetensors``,
    then ``model*.safetensors`` as mlx-lm's loader globs them.

    Raises:
        FileNotFoundError: No weights found.
    """
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    shards = sorted(model_path.glob("model*.safetensors"))
    if shards:
        return shards
    raise FileNotFoundError(
        f"no model.safetensors, model.safetensors.index.json or model*.safetensors in {model_path}"
    )


def read_config(model_path: Path) -> dict[str, Any]:
    """``config.json`` of the language model (``text_config`` when the model nests one).

    Raises:
        FileNotFoundError: No ``config.json``.
    """
    config: dict[str, Any] = json.loads((model_path / "config.json").read_text())
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        # Keep top-level keys (e.g. tie_word_embeddings) the text config leaves out.
        return {**config, **text}
    return config


def _dtype_bytes(config: dict[str, Any]) -> int:
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)


def kv_bytes_per_token_per_layer(config: dict[str, Any], dtype_bytes: int | None = None) -> int:
    """``2 * num_key_value_heads * head_dim * dtype_bytes`` (K and V of one token in one layer).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` and ``num_key_value_heads`` to
    ``num_attention_heads``, as in Hugging Face configs; ``dtype_bytes`` to the config's dtype
    (2 when it names none), the dtype mlx-lm keeps the KV cache in.
    """
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    return 2 * num_kv_heads * head_dim * (dtype_bytes or _dtype_bytes(config))


def activation_bytes_per_token(model_path: str | Path) -> int:
    """``hidden_size * dtype_bytes``: what one token's hidden state costs on a pipeline hop."""
    config = read_config(Path(model_path))
    return int(config["hidden_size"]) * _dtype_bytes(config)


def read_layout(model_path: str | Path, *, kv_dtype_bytes: int | None = None) -> ModelLayout:
    """Build the planner's ModelLayout from a model folder, reading headers only.

    Tensors are grouped by name: ``model.layers.N.`` -> layer N, ``embed_tokens`` -> embeddings,
    ``model.norm.`` -> final norm, ``lm_head.`` -> head. Embeddings count as tied when
    ``config.json`` says ``tie_word_embeddings`` or there is no ``lm_head``; then ``head_bytes`` is
    0
    and a stored ``lm_head`` is ignored, as mlx-lm's ``sanitize`` drops it. Layers at or above
    ``num_hidden_layers`` (e.g. multi-token-prediction layers) and other tensors (vision towers)
    are left out and logged.

    Args:
        model_path: Folder with ``config.json`` and safetensors weights.
        kv_dtype_bytes: Bytes per KV element; None = the config's dtype.

    Raises:
        FileNotFoundError: No ``config.json`` or no weights.
        ValueError: A header is invalid, or a layer below ``num_hidden_layers`` has no tensors.
    """
    path = Path(model_path)
    config = read_config(path)
    num_layers = int(config["num_hidden_layers"])
    layer_bytes = [0] * num_layers
    seen_layers: set[int] = set()
    embed = head = norm = other = 0
    has_lm_head = False
    for file in weight_files(path):
        for name, size in read_safetensors_header(file).items():
            if (m := _LAYER.search(name)) is not None and int(m.group(1)) < num_layers:
                layer_bytes[int(m.group(1))] += size
                seen_layers.add(int(m.group(1)))
            elif "embed_tokens" in name:
                embed += size
            elif name.startswith("lm_head.") or ".lm_head." in name:
                head += size
                has_lm_head = True
            elif _FINAL_NORM.search(name) is not None:
                norm += size
            else:
                other += size
    missing = sorted(set(range(num_layers)) - seen_layers)
    if missing:
        raise ValueError(
            f"{path}: config.json has {num_layers} layers but no tensors for layers {missing[:8]}"
        )
    tied = bool(config.get("tie_word_embeddings", False)) or not has_lm_head
    if tied and head:
        logger.info("%s: ignoring %d bytes of lm_head: the embeddings are tied", path, head)
        head = 0
    if other:
        logger.info(
            "%s: %d bytes of weights outside layers/embeddings/norm/head are not planned",
            path,
            other,
        )
    return ModelLayout(
        layer_bytes=layer_bytes,
        embed_bytes=embed,
        head_bytes=head,
        norm_bytes=norm,
        tied_embeddings=tied,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer(config, kv_dtype_bytes),
    )
