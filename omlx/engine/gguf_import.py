"""Convert a GGUF file into a folder that `mlx_lm.load` can open.

Owns: reading GGUF metadata and tensors, dequantizing them to float32 (or, asked to, keeping
the exactly convertible quantized ones quantized: `omlx.engine.gguf_quant`), undoing llama.cpp's
q/k row permutation and Gemma's norm offset, writing `config.json`, `model.safetensors` and the
tokenizer files (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`, built by
`gguf_tokenizer`) into a temp folder that is renamed into place in one step.
Must not: import torch or transformers' GGUF code (it needs torch), pick where models live
(callers pass the output folder), or print (logging and an optional rich progress bar only).

Architectures (`ARCHITECTURES`; others raise): `llama` (SmolLM2, Llama 3.0; not 3.1+ rope
scaling), `qwen2` (Qwen2/2.5) and `gemma3` (Gemma 3 text models, written as mlx-lm's
`gemma3_text`; no logit soft-capping). Tokenizers: see `gguf_tokenizer` (byte-level BPE for all,
SentencePiece for gemma3).

Formats followed, and where each conversion fact comes from:
- GGUF: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (metadata key names such as
  `llama.rope.freq_base`, `tokenizer.ggml.tokens`, tensor names such as `blk.N.attn_q.weight`);
  per-architecture tensor names: gguf-py's `constants.py` / `tensor_mapping.py` in llama.cpp.
- The q/k permutation: `LlamaModel.permute` in llama.cpp's `convert_hf_to_gguf.py`, applied to
  llama only; qwen2 and gemma3 use NEOX (rotate-half) rope in llama.cpp
  (`llama_model_rope_type`), so their converters permute nothing.
- Gemma's norms: llama.cpp's `Gemma3Model.modify_tensors` adds 1 to every tensor whose HF name
  ends in `norm.weight` (the four block norms, q/k norms and the final norm); mlx-lm's
  `gemma3_text.RMSNorm` computes with `1 + weight`, so the importer subtracts 1 again (as
  transformers' `Gemma2TensorProcessor` does for gemma3).
- Gemma 3's config: the file carries `gemma3.rope.freq_base` (global layers) and
  `gemma3.attention.sliding_window`; the sliding pattern (6), the local rope base (10000) and the
  attention scale are llama.cpp constants (`llama-model.cpp`, LLM_ARCH_GEMMA3), see
  `_gemma3_config`. Keys and defaults: mlx-lm 0.32 `mlx_lm/models/gemma3_text.py::ModelArgs`.
- Dequantization: the `gguf` package (`gguf.quants.dequantize`), llama.cpp's own numpy port of
  ggml's block formats; it covers every type (Q4_0 … Q8_0, the K-quants, BF16), where
  `mx.load` keeps only Q4_0/Q4_1/Q8_0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omlx.engine.gguf_tokenizer import build_tokenizer, build_tokenizer_config
from omlx.errors import ModelImportError

logger = logging.getLogger(__name__)

#: Written last into every imported folder; its presence means the import finished.
IMPORT_MARKER = "omlx_import.json"
#: Bumped when the output of `import_gguf` changes for the same input file.
IMPORT_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one GGUF `general.architecture` maps onto an mlx-lm model.

    Attributes:
        model_type: mlx-lm's `model_type` (the module under `mlx_lm/models/`).
        hf_architecture: the `architectures` entry HF configs carry.
        permute_qk: llama.cpp permuted q/k rows when writing the file (llama family only).
        layer_tensors: GGUF per-layer tensor stem -> HF module path under `model.layers.N.`.
        norm_offset: subtracted from every tensor whose HF name ends in `norm.weight`: llama.cpp
            stores Gemma's RMSNorm weights as `1 + w` (the scale they multiply by), while HF
            checkpoints and mlx-lm's Gemma `RMSNorm` keep `w` and compute with `1 + w`.
    """

    model_type: str
    hf_architecture: str
    permute_qk: bool
    layer_tensors: Mapping[str, str] = field(default_factory=dict)
    norm_offset: float = 0.0


_COMMON_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Gemma 3 has four norms per block; llama.cpp's `ffn_norm` is its pre-feedforward norm, not the
# post-attention one (gguf-py `tensor_mapping.py`, MODEL_ARCH.GEMMA3 in `constants.py`).
_GEMMA3_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", permute_qk=True, layer_tensors=_COMMON_LAYER_TENSORS),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", permute_qk=False, layer_tensors=_COMMON_LAYER_TENSORS),
    # Gemma's rope is NEOX-style (rotate-half) in llama.cpp too, so nothing was permuted.
    "gemma3": ArchSpec(
        "gemma3_text", "Gemma3ForCausalLM", permute_qk=False, layer_tensors=_GEMMA3_LAYER_TENSORS, norm_offset=1.0
    ),
}

# llama.cpp's constants for gemma3 that its GGUF files do not carry (llama-model.cpp, LLM_ARCH_GEMMA3:
# `set_swa_pattern(6)`, `rope_freq_base_train_swa = 10000.0f`).
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_ROPE_LOCAL_BASE = 10000.0


# --------------------------------------------------------------------------- permutation


def permute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's q/k row permutation, HF layout -> GGUF layout.

    A verbatim port of `LlamaModel.permute` in llama.cpp's `convert_hf_to_gguf.py`: within each
    head, rows `[x0..x_{d/2-1}, y0..y_{d/2-1}]` (HF's rotate-half rope) become interleaved pairs
    `[x0, y0, x1, y1, ...]` (ggml's adjacent-pair rope). Kept here as the reference the inverse is
    tested against.

    Args:
        w: `(n_head * head_dim, ...)` weight or bias, any dtype.
        n_head: attention heads of the model.
        n_head_kv: KV heads; when given and different from `n_head` it replaces it (k_proj).

    Returns:
        An array of the same shape and dtype.
    """
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo `permute_qk`: GGUF interleaved-pair rows -> HF rotate-half rows.

    Args:
        w: `(n_head * head_dim, ...)` q or k projection weight (or bias) as stored in the GGUF.
        n_head: heads of that projection: attention heads for q, KV heads for k.

    Returns:
        An array of the same shape and dtype with `unpermute_qk(permute_qk(x, h), h) == x`.

    Raises:
        ModelImportError: the row count is not a multiple of `2 * n_head`.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelImportError(f"cannot unpermute {rows} rows over {n_head} heads: rows must be a multiple of 2*heads")
    # (n_head, head_dim/2, 2, ...) -> (n_head, 2, head_dim/2, ...): pairs back to halves.
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- reading


@dataclass(slots=True)
class GGUFContents:
    """What `read_gguf` found: metadata and lazily dequantizable tensors.

    Attributes:
        metadata: every key/value pair, values as Python scalars, strings or lists.
        tensor_names: GGUF tensor names in file order.
        reader: the open `gguf.GGUFReader` (memory-maps the file).
    """

    metadata: dict[str, Any]
    tensor_names: list[str]
    reader: Any

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`metadata["<architecture>.<key>"]`, or `default`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf(gguf_path: Path) -> GGUFContents:
    """Open a GGUF file and read all of its metadata (tensors stay memory-mapped).

    Raises:
        ModelImportError: the file is missing or not a GGUF the `gguf` package can parse.
    """
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a dependency
        raise ModelImportError("importing GGUF files needs the `gguf` package: pip install gguf") from e
    if not gguf_path.is_file():
        raise ModelImportError(f"no such GGUF file: {gguf_path}")
    try:
        reader = GGUFReader(gguf_path, "r")
    except Exception as e:  # the reader raises ValueError/struct.error/... on bad files
        raise ModelImportError(f"{gguf_path} is not a readable GGUF file: {e}") from e
    metadata = {name: f.contents() for name, f in reader.fields.items()}
    return GGUFContents(metadata=metadata, tensor_names=[t.name for t in reader.tensors], reader=reader)


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """Dequantize one `gguf.ReaderTensor` to float32 in HF layout.

    Returns:
        `(rows, cols)` (or `(n,)`) float32; GGUF lists dims innermost first, numpy outermost first.
    """
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


# --------------------------------------------------------------------------- config


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def build_config(contents: GGUFContents) -> dict[str, Any]:
    """The HF-style `config.json` mlx-lm needs, from GGUF metadata.

    `rope_theta` comes from `<arch>.rope.freq_base` and is always written: mlx-lm's llama falls
    back to 10000 silently, and SmolLM2 needs 100000. `tie_word_embeddings` is true exactly when
    the file has no `output.weight`. Gemma 3 adds the keys of `_gemma3_config`.

    Raises:
        ModelImportError: unknown architecture, a missing required key, or rope scaling this
            importer cannot express (a `rope_freqs.weight` tensor, Llama-3.1 style).
    """
    arch = contents.architecture
    spec = ARCHITECTURES.get(arch)
    if spec is None:
        raise ModelImportError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}. "
            "Convert it with mlx_lm.convert from the original weights instead."
        )
    if "rope_freqs.weight" in contents.tensor_names:
        raise ModelImportError("this GGUF carries rope_freqs.weight (Llama-3.1-style rope scaling), which is not supported")

    def need(key: str) -> Any:
        value = contents.arch_key(key)
        if value is None:
            raise ModelImportError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ModelImportError(f"GGUF metadata {arch}.{key} is a per-layer list, which is not supported")
        return value

    hidden_size = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    has_kv_heads = contents.arch_key("attention.head_count_kv") is not None
    n_kv_heads = int(need("attention.head_count_kv")) if has_kv_heads else n_heads
    head_dim = int(contents.arch_key("attention.key_length", hidden_size // n_heads))
    tokens = contents.metadata.get("tokenizer.ggml.tokens")
    vocab_size = int(contents.arch_key("vocab_size", len(tokens) if tokens else 0))
    if not vocab_size:
        raise ModelImportError(f"GGUF metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)")
    # llama.cpp's default when the key is absent is 10000, so this matches llama.cpp; gemma3
    # files always carry it (transformers would assume 1e6 there), so there it is required.
    if spec.model_type == "gemma3_text":
        rope_theta = need("rope.freq_base")
    else:
        rope_theta = contents.arch_key("rope.freq_base", 10000.0)
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(rope_theta),
        "max_position_embeddings": int(contents.arch_key("context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in contents.tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    rope_dims = contents.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelImportError(f"partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    scaling_type = contents.arch_key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = contents.arch_key("rope.scaling.factor")
        if scaling_type != "linear" or factor is None:
            raise ModelImportError(f"rope scaling {scaling_type!r} is not supported by this importer")
        # gemma3_text applies it to the global layers only, as llama.cpp does (rope_freq_scale_train_swa = 1).
        config["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": _f32(factor)}
    if spec.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in contents.tensor_names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in contents.tensor_names
    if spec.model_type == "gemma3_text":
        del config["hidden_act"]
        config.update(_gemma3_config(contents, config))
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = contents.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[name] = int(value)
    return config


def _gemma3_config(contents: GGUFContents, config: Mapping[str, Any]) -> dict[str, Any]:
    """The gemma3_text keys a GGUF does not state outright, as llama.cpp derives them.

    Each is written explicitly, because mlx-lm's `gemma3_text.ModelArgs` has a default for every
    one (those of a 1B model) and uses it silently when the key is missing:
    - `sliding_window` <- `gemma3.attention.sliding_window`; absent or 0 means no sliding layers
      (llama.cpp: LLAMA_SWA_TYPE_NONE), written as `sliding_window_pattern = 1`.
    - `sliding_window_pattern` = 6: layer i slides unless `(i + 1) % 6 == 0` (llama.cpp's
      `set_swa_pattern(6)`, the same rule as mlx-lm's and HF's `layer_types`, also written).
    - `rope_local_base_freq` = 10000 for the sliding layers (llama.cpp's constant; the file's
      `rope.freq_base` is the global layers' `rope_theta`).
    - `query_pre_attn_scalar` = head_dim, except hidden_size / heads for the 62-layer (27B) model
      (llama.cpp's `f_attention_scale`, after gemma_pytorch's config).
    - `hidden_activation` = gelu_pytorch_tanh (mlx-lm hard-codes `gelu_approx`; HF reads this).

    Raises:
        ModelImportError: value and key head sizes differ, or the file asks for logit
            soft-capping, which mlx-lm's gemma3_text does not implement.
    """
    value_length = contents.arch_key("attention.value_length")
    if value_length is not None and int(value_length) != config["head_dim"]:
        raise ModelImportError(f"gemma3 value head size {value_length} != key head size {config['head_dim']}; not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if contents.arch_key(key):
            raise ModelImportError(
                f"GGUF sets gemma3.{key} = {contents.arch_key(key)}; mlx-lm's gemma3_text has no logit "
                "soft-capping, so this model would compute wrong logits"
            )
    n_layers = config["num_hidden_layers"]
    window = int(contents.arch_key("attention.sliding_window", 0) or 0)
    pattern = _GEMMA3_SWA_PATTERN if window > 0 else 1
    if pattern > n_layers:
        raise ModelImportError(f"gemma3 with {n_layers} layers has no global layer (every 6th); not supported")
    n_heads = config["num_attention_heads"]
    scalar = config["hidden_size"] // n_heads if n_layers == 62 else config["head_dim"]
    return {
        "sliding_window": window if window > 0 else config["max_position_embeddings"],
        "sliding_window_pattern": pattern,
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ],
        "rope_local_base_freq": _GEMMA3_ROPE_LOCAL_BASE,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


# --------------------------------------------------------------------------- weights


def hf_tensor_name(gguf_name: str, spec: ArchSpec) -> str:
    """GGUF tensor name -> HF/mlx-lm parameter name.

    Raises:
        ModelImportError: a tensor this architecture does not know (never dropped silently).
    """
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in spec.layer_tensors:
        return f"model.layers.{parts[1]}.{spec.layer_tensors[parts[2]]}.{parts[3]}"
    raise ModelImportError(f"unexpected tensor {gguf_name!r} for architecture {spec.model_type!r}")


def iter_hf_tensors(contents: GGUFContents, config: Mapping[str, Any], *,
                    keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` for every tensor, dequantized, un-permuted and with the
    norm offset removed (`ArchSpec.norm_offset`: Gemma's `1 + w` back to `w`).

    With ``keep_quantized``, a 2-D weight of a type MLX holds exactly (`gguf_quant.EXACT_TYPES`)
    is yielded as its MLX affine triplet instead: ``<name>.weight`` (uint32), ``<name>.scales``
    and ``<name>.biases`` (float32), rows un-permuted alike, and ``config["quantization"]`` gets
    its bits (the most common as the default, the others per layer, as mlx-lm reads them).

    Side effects: none but that entry in ``config``; each tensor is converted when reached.
    """
    from omlx.engine import gguf_quant

    spec = ARCHITECTURES[contents.architecture]
    layer_bits: dict[str, int] = {}
    for tensor in contents.reader.tensors:
        name = hf_tensor_name(tensor.name, spec)
        stem = tensor.name.split(".")[-2]
        heads = (config["num_attention_heads"] if stem == "attn_q" else config["num_key_value_heads"]
                 if stem == "attn_k" else None) if spec.permute_qk else None
        if keep_quantized and name.endswith(".weight") and not name.endswith("norm.weight") and gguf_quant.is_exact(tensor):
            w, scales, biases, bits = gguf_quant.to_mlx_affine(tensor)
            base = name[: -len(".weight")]
            layer_bits[base] = bits
            for suffix, a in ((".weight", w), (".scales", scales), (".biases", biases)):
                yield base + suffix, unpermute_qk(a, heads) if heads else a
            continue
        w = dequantize_tensor(tensor)
        if heads:
            w = unpermute_qk(w, heads)
        if spec.norm_offset and name.endswith("norm.weight"):
            # The same test llama.cpp's converter adds the offset under (HF names ending in norm.weight).
            w = w - np.float32(spec.norm_offset)
        yield name, w
    if layer_bits:
        bits_counts: dict[int, int] = {}
        for b in layer_bits.values():
            bits_counts[b] = bits_counts.get(b, 0) + 1
        default = max(bits_counts, key=lambda b: bits_counts[b])
        quant: dict[str, Any] = {"group_size": gguf_quant.GROUP_SIZE, "bits": default}
        quant.update({base: {"group_size": gguf_quant.GROUP_SIZE, "bits": b} for base, b in layer_bits.items() if b != default})
        config["quantization"] = quant  # type: ignore[index]


# --------------------------------------------------------------------------- writing


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in `chunk_bytes` pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Callable[..., Any]]:
    """Yields `step(description, total=None) -> advance()`; a no-op when disabled."""
    if not enabled:
        yield lambda description, total=None: (lambda n=1: None)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        transient=False,
    ) as bar:
        state: dict[str, Any] = {"task": None}

        def step(description: str, total: int | None = None) -> Callable[[int], None]:
            if state["task"] is not None:
                task = bar.tasks[-1]
                bar.update(state["task"], completed=task.total or 1, total=task.total or 1)
            state["task"] = bar.add_task(description, total=total)
            return lambda n=1: bar.advance(state["task"], n)

        yield step
        if state["task"] is not None:
            task = bar.tasks[-1]
            bar.update(state["task"], completed=task.total or 1, total=task.total or 1)


def import_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True, keep_quantized: bool = False) -> Path:
    """Convert a GGUF (architectures in `ARCHITECTURES`) into an mlx-lm folder at `out_dir`.

    With ``keep_quantized``, Q4_0/Q4_1/Q8_0 weights stay quantized, converted exactly to MLX's
    affine format (group size 32; `omlx.engine.gguf_quant`), and the rest is dequantized as below.

    The folder gets `config.json`, `model.safetensors` (every tensor float32: the fastest dtype
    for MLX on CPU; about 4 bytes per parameter, 0.54 GB for SmolLM2-135M), `tokenizer.json`,
    `tokenizer_config.json` (with the GGUF's chat template), `special_tokens_map.json`,
    `generation_config.json`, and last `omlx_import.json` (source sha256 and format version;
    its presence means the import is complete). Everything is written into a temp folder beside
    `out_dir`, fsynced and renamed into place in one step, so `out_dir` is never half-written.

    Args:
        gguf_path: the `.gguf` file.
        out_dir: the folder to create; must not exist yet.
        progress: show a rich progress bar on the console.
        keep_quantized: keep the exactly convertible quantized weights quantized.

    Returns:
        `out_dir`.

    Raises:
        ModelImportError: `out_dir` exists, the file is not a GGUF, or it describes an
            architecture, tensor, rope scaling or tokenizer this importer does not support.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise ModelImportError(f"{out_dir} already exists; remove it or import under another name")
    started = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        with _progress_bar(progress) as step:
            step(f"reading {gguf_path.name}")
            source_sha256 = file_sha256(gguf_path)
            contents = read_gguf(gguf_path)
            config = build_config(contents)
            logger.info(
                "importing %s: %s, %d layers, %d tensors, rope_theta=%s",
                gguf_path, contents.architecture, config["num_hidden_layers"], len(contents.tensor_names),
                config["rope_theta"],
            )
            advance = step("dequantizing tensors", total=len(contents.tensor_names))
            tensors: dict[str, np.ndarray] = {}
            for name, w in iter_hf_tensors(contents, config, keep_quantized=keep_quantized):
                tensors[name] = w
                if not name.endswith((".scales", ".biases")):
                    advance(1)
            embed = tensors["model.embed_tokens.weight"]
            if embed.shape[0] != config["vocab_size"]:
                logger.warning("vocab_size %d != embedding rows %d; using the rows", config["vocab_size"], embed.shape[0])
                config["vocab_size"] = int(embed.shape[0])

            step("writing model.safetensors")
            from safetensors.numpy import save_file

            num_params = sum(int(t.n_elements) for t in contents.reader.tensors)
            save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "mlx"})
            _fsync_path(tmp_dir / "model.safetensors")
            del tensors

            step("writing tokenizer")
            tokenizer = build_tokenizer(contents.metadata)
            tokenizer.save(str(tmp_dir / "tokenizer.json"))
            _fsync_path(tmp_dir / "tokenizer.json")
            tokenizer_config, special_map = build_tokenizer_config(contents.metadata)
            _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config)
            _write_json(tmp_dir / "special_tokens_map.json", special_map)
            _write_json(tmp_dir / "config.json", config)
            generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
            _write_json(tmp_dir / "generation_config.json", generation)
            _write_json(
                tmp_dir / IMPORT_MARKER,
                {
                    "format_version": IMPORT_FORMAT_VERSION,
                    "source": gguf_path.name,
                    "source_sha256": source_sha256,
                    "architecture": contents.architecture,
                    "dtype": "gguf-quantized" if "quantization" in config else "float32",
                    "num_params": num_params,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
            )
            # mkdtemp makes the folder 0700 (and safetensors files 0600); models are shared reads.
            for child in tmp_dir.iterdir():
                os.chmod(child, 0o644)
            os.chmod(tmp_dir, 0o755)
            _fsync_path(tmp_dir)
            os.rename(tmp_dir, out_dir)
            _fsync_path(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("imported %s -> %s in %.1f s", gguf_path.name, out_dir, time.perf_counter() - started)
    return out_dir
