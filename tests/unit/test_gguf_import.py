"""GGUF import without the real model: tiny random llama/qwen2 models written as GGUF files.

Each tiny model is built with mlx-lm's own `ModelArgs`, written to GGUF the way llama.cpp's
`convert_hf_to_gguf.py` does (q/k rows permuted for llama), imported, loaded back with mlx-lm and
compared logit for logit with the original. Also covers `omlx.engine.embedded`'s pure parts.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from omlx.engine import embedded
from omlx.engine.gguf_import import (
    IMPORT_MARKER,
    build_tokenizer,
    dequantize_tensor,
    import_gguf,
    read_gguf,
    unpermute_qk,
)
from omlx.errors import ModelImportError


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Copied verbatim from llama.cpp convert_hf_to_gguf.py, LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# --------------------------------------------------------------------------- permutation


def test_permute_layout_on_one_head() -> None:
    # HF rotate-half rows [x0, x1, y0, y1] are stored by llama.cpp as pairs [x0, y0, x1, y1].
    hf = np.array([10, 11, 20, 21])
    gguf_rows = llama_cpp_permute(hf, 1, None)
    assert gguf_rows.tolist() == [10, 20, 11, 21]
    assert unpermute_qk(gguf_rows, 1).tolist() == [10, 11, 20, 21]


@pytest.mark.parametrize(
    ("n_head", "n_head_kv", "head_dim", "cols"),
    [(9, 3, 64, 5), (4, 4, 8, 3), (14, 2, 64, 1), (2, 1, 4, 7)],
)
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_head_kv: int, head_dim: int, cols: int) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    k = rng.standard_normal((n_head_kv * head_dim, cols)).astype(np.float32)
    q_bias = rng.standard_normal(n_head * head_dim).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(q, n_head, n_head), n_head), q)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(k, n_head, n_head_kv), n_head_kv), k)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(q_bias, n_head, None), n_head), q_bias)
    # Not the identity: a converter that forgot to undo it would be caught.
    assert not np.array_equal(llama_cpp_permute(q, n_head, n_head), q)


def test_unpermute_rejects_odd_rows() -> None:
    with pytest.raises(ModelImportError, match="multiple of 2"):
        unpermute_qk(np.zeros((6, 2)), 2)


# --------------------------------------------------------------------------- tiny GGUF writer


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode() values, in byte order (256 single-character tokens)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def _write_tiny_gguf(path: Path, arch: str, model, args, *, quantize_q8: bool = False, add_bos: bool = False) -> None:
    """Write `model` as llama.cpp would: permuted q/k for llama, F32 (or Q8_0 matrices)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(512)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_dimension_count(args.hidden_size // args.num_attention_heads)
    w.add_vocab_size(args.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, value in tree_flatten(model.parameters()):
        a = np.array(value.astype(mx.float32))
        if arch == "llama" and ".q_proj." in hf:
            a = llama_cpp_permute(a, args.num_attention_heads, args.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            a = llama_cpp_permute(a, args.num_attention_heads, args.num_key_value_heads)
        if quantize_q8 and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(hf), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(hf), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str, tie: bool):
    from mlx_lm.models import llama, qwen2

    module = {"llama": llama, "qwen2": qwen2}[arch]
    args = module.ModelArgs(
        model_type=arch, hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=len(TOKENS), rope_theta=100000.0,
        tie_word_embeddings=tie,
    )
    mx.random.seed(0)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model, args


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


IDS = [5, 77, 100, 3, 260, 261, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]


@pytest.mark.parametrize(("arch", "tie"), [("llama", True), ("llama", False), ("qwen2", False)])
def test_tiny_model_round_trip_matches_logits(tmp_path: Path, arch: str, tie: bool) -> None:
    from mlx_lm.utils import load_model

    model, args = _tiny(arch, tie)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, arch, model, args)
    out = import_gguf(src, tmp_path / "models" / "tiny", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is tie
    assert config["rms_norm_eps"] == 1e-5
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    loaded, _ = load_model(out)
    # F32 in, F32 out: only summation order can differ.
    np.testing.assert_allclose(_logits(loaded, IDS), _logits(model, IDS), rtol=1e-4, atol=1e-4)


def test_import_writes_marker_and_no_leftovers(tmp_path: Path) -> None:
    model, args = _tiny("llama", True)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "llama", model, args)
    models = tmp_path / "models"
    out = import_gguf(src, models / "tiny", progress=True)
    marker = json.loads((out / IMPORT_MARKER).read_text())
    assert marker["source_sha256"] == embedded.file_sha256(src)
    assert marker["dtype"] == "float32"
    assert sorted(p.name for p in models.iterdir()) == ["tiny"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file(), name
    with pytest.raises(ModelImportError, match="already exists"):
        import_gguf(src, out, progress=False)


def test_q8_0_dequantized_like_mlx(tmp_path: Path) -> None:
    # Two independent dequantizers (gguf's numpy port and MLX's GGUF reader + mx.dequantize with
    # float32 scales) must agree bit for bit.
    model, args = _tiny("llama", True)
    src = tmp_path / "tiny_q8.gguf"
    _write_tiny_gguf(src, "llama", model, args, quantize_q8=True)
    contents = read_gguf(src)
    raw = mx.load(str(src))
    for tensor in contents.reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        stem = tensor.name[: -len(".weight")]
        ref = mx.dequantize(
            raw[tensor.name], raw[stem + ".scales"].astype(mx.float32), raw[stem + ".biases"].astype(mx.float32),
            group_size=32, bits=8,
        )
        np.testing.assert_array_equal(dequantize_tensor(tensor), np.array(ref))


def test_failed_import_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(src), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    models = tmp_path / "models"
    with pytest.raises(ModelImportError, match="'mamba' is not supported"):
        import_gguf(src, models / "m", progress=False)
    assert list(models.iterdir()) == []


def test_not_a_gguf(tmp_path: Path) -> None:
    src = tmp_path / "x.gguf"
    src.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelImportError, match="not a readable GGUF"):
        import_gguf(src, tmp_path / "out", progress=False)


# --------------------------------------------------------------------------- tokenizer


def _tok_metadata(add_bos: bool = False) -> dict:
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": add_bos,
    }


def test_tokenizer_merges_specials_and_digits() -> None:
    tok = build_tokenizer(_tok_metadata())
    enc = tok.encode("<|im_start|> the 42<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "Ġthe", "Ġ", "4", "2", "<|im_end|>"]
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert tok.decode(enc.ids, skip_special_tokens=True) == " the 42"


def test_tokenizer_bos_only_when_gguf_asks() -> None:
    assert build_tokenizer(_tok_metadata(add_bos=False)).encode("the").ids[0] != 1
    assert build_tokenizer(_tok_metadata(add_bos=True)).encode("the").ids[0] == 1


def test_sentencepiece_tokenizer_is_refused() -> None:
    with pytest.raises(ModelImportError, match="not supported"):
        build_tokenizer({**_tok_metadata(), "tokenizer.ggml.model": "llama"})


def test_imported_tokenizer_loads_in_mlx_lm(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model, args = _tiny("llama", True)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "llama", model, args)
    out = import_gguf(src, tmp_path / "tiny", progress=False)
    tok = load_tokenizer(out)
    assert tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False)
    assert prompt == "<|im_start|>user\nthe<|im_end|>\n"


# --------------------------------------------------------------------------- embedded.py


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "qwen2.5-coder_0.5b", "a"])
def test_valid_model_names(name: str) -> None:
    assert embedded.validate_model_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "../x", "a..b", ".hidden", "m:fast", "x" * 129, "-rf"])
def test_unsafe_model_names(name: str) -> None:
    with pytest.raises(ModelImportError):
        embedded.validate_model_name(name)


def test_import_model_copies_folder(tmp_path: Path) -> None:
    model, args = _tiny("llama", True)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, "llama", model, args)
    folder = embedded.import_model(src, tmp_path / "staging", progress=False)
    assert folder.name == "tiny"
    copied = embedded.import_model(folder, tmp_path / "models", "tiny-copy")
    assert copied == tmp_path / "models" / "tiny-copy"
    assert (copied / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    with pytest.raises(ModelImportError, match="already exists"):
        embedded.import_model(folder, tmp_path / "models", "tiny-copy")
    with pytest.raises(ModelImportError, match="not an mlx-lm model folder"):
        embedded.import_model(tmp_path / "models", tmp_path / "other")
    with pytest.raises(ModelImportError, match="invalid model name"):
        embedded.import_model(src, tmp_path / "models", "../escape")


def test_ensure_default_model_reuses_finished_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / embedded.DEFAULT_MODEL_ID
    target.mkdir()
    (target / IMPORT_MARKER).write_text(json.dumps({"source_sha256": embedded.DEFAULT_MODEL_SHA256}))

    def no_source(cache_dir: Path, **kwargs: object) -> Path:
        raise AssertionError("must not look for the GGUF when the import is finished")

    monkeypatch.setattr(embedded, "default_model_gguf", no_source)
    assert embedded.ensure_default_model(tmp_path, progress=False) == target


def test_ensure_default_model_refuses_foreign_folder(tmp_path: Path) -> None:
    (tmp_path / embedded.DEFAULT_MODEL_ID).mkdir()
    with pytest.raises(ModelImportError, match="not a finished import"):
        embedded.ensure_default_model(tmp_path, progress=False)


def test_checksum_mismatch_raises(tmp_path: Path) -> None:
    bogus = tmp_path / embedded.DEFAULT_MODEL_FILE
    bogus.write_bytes(b"x")
    with pytest.raises(ModelImportError, match="sha256"):
        embedded._check_sha256(bogus, embedded.DEFAULT_MODEL_SHA256)
