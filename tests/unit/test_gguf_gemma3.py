"""GGUF import of gemma3 without the real model: a tiny random gemma3_text written as llama.cpp does.

The tiny model is built with mlx-lm's own `gemma3_text.ModelArgs`, written to GGUF the way
llama.cpp's `convert_hf_to_gguf.py` (`Gemma3Model`) writes one: norm weights stored as `1 + w`,
q/k not permuted, no `output.weight` (tied), a SentencePiece vocabulary without merges, and only
the metadata keys that converter writes (the sliding pattern and local rope base are llama.cpp
constants). It is imported, loaded back with mlx-lm and compared logit for logit with the
original, over more tokens than its sliding window. The real model is checked against
transformers in tests/integration/test_gemma3_import.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from omlx.engine.gguf_import import GGUFContents, build_config, import_gguf
from omlx.engine.gguf_tokenizer import build_tokenizer, build_tokenizer_config, sentencepiece_merges
from omlx.errors import ModelImportError

# --------------------------------------------------------------------------- tiny vocabulary

CONTROL, USER, NORMAL, BYTE = 3, 4, 1, 6
# (token, type): Gemma's layout in miniature. "  " is a whitespace token spelled with real spaces,
# as Gemma's files have it; "\n" a user-defined token; then bytes, then normal pieces by rank.
VOCAB = (
    [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL), ("<start_of_turn>", CONTROL)]
    + [("\n", USER), ("  ", USER)]
    + [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    + [(t, NORMAL) for t in ["▁", "t", "h", "e", "a", "he", "▁t", "the", "▁the", "▁a"]]
)
TOKENS = [t for t, _ in VOCAB]
ID = {t: i for i, t in enumerate(TOKENS)}
BYTE0 = ID["<0x00>"]


def _spm_metadata(**overrides: object) -> dict:
    metadata = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        # Gemma's scores: -1000 for control/user-defined, 0 for bytes, falling by 1 per normal token.
        "tokenizer.ggml.scores": [-1000.0 if k in (CONTROL, USER) else 0.0 if k == BYTE else -float(i) for i, (_, k) in enumerate(VOCAB)],
        "tokenizer.ggml.token_type": [k for _, k in VOCAB],
        "tokenizer.ggml.bos_token_id": ID["<bos>"],
        "tokenizer.ggml.eos_token_id": ID["<eos>"],
        "tokenizer.ggml.unknown_token_id": ID["<unk>"],
        "tokenizer.ggml.padding_token_id": ID["<pad>"],
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    metadata.update(overrides)
    return {k: v for k, v in metadata.items() if v is not None}


def test_merges_follow_vocabulary_order_longest_left_first() -> None:
    merges = sentencepiece_merges(["▁▁" if t == "  " else t for t in TOKENS])
    assert merges[0] == ("▁", "▁")  # the respelled "  " ranks by its position, as in transformers
    assert merges[1:] == [("h", "e"), ("▁", "t"), ("t", "he"), ("▁t", "he"), ("▁", "the"), ("▁", "a")]


def test_sentencepiece_encoding() -> None:
    tok = build_tokenizer(_spm_metadata())
    enc = tok.encode("the the")
    assert enc.tokens == ["<bos>", "the", "▁the"]
    # Runs of spaces reach the whitespace token through merges; "\n" and control tokens match whole.
    assert tok.encode("a  a\n").ids == [ID["<bos>"], ID["a"], ID["  "], ID["a"], ID["\n"]]
    assert tok.encode("<start_of_turn>the").ids == [ID["<bos>"], ID["<start_of_turn>"], ID["the"]]


def test_byte_fallback_and_round_trip() -> None:
    tok = build_tokenizer(_spm_metadata())
    ids = tok.encode("é the").ids  # é is not in the vocabulary: its UTF-8 bytes C3 A9
    assert ids == [ID["<bos>"], BYTE0 + 0xC3, BYTE0 + 0xA9, ID["▁the"]]
    assert tok.decode(ids, skip_special_tokens=True) == "é the"
    for text in ["the  a\nthe", " leading space", "trailing  ", "naïve 東京 🚲"]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_bos_default_and_flag() -> None:
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    assert build_tokenizer(_spm_metadata(**{"tokenizer.ggml.add_bos_token": None})).encode("a").ids[0] == ID["<bos>"]
    assert build_tokenizer(_spm_metadata(**{"tokenizer.ggml.add_bos_token": False})).encode("a").ids == [ID["a"]]
    config, special = build_tokenizer_config(_spm_metadata())
    assert (config["add_bos_token"], config["bos_token"], config["unk_token"], config["pad_token"]) == (
        True, "<bos>", "<unk>", "<pad>"
    )
    assert special["additional_special_tokens"] == ["<start_of_turn>"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"tokenizer.ggml.add_space_prefix": True}, "add_space_prefix"),
        ({"tokenizer.ggml.add_space_prefix": None}, "add_space_prefix"),  # llama.cpp's default is true
        ({"tokenizer.ggml.model": "gpt2"}, "'gpt2' for gemma3"),
        ({"tokenizer.ggml.tokens": [t for t in TOKENS if t != "<0x41>"]}, "byte tokens"),
        ({"general.architecture": "llama"}, "SentencePiece only for"),
    ],
)
def test_unsupported_sentencepiece_files_raise(overrides: dict, match: str) -> None:
    with pytest.raises(ModelImportError, match=match):
        build_tokenizer(_spm_metadata(**overrides))


# --------------------------------------------------------------------------- tiny model

# HF module path -> llama.cpp GGUF tensor stem for Gemma 3 (gguf-py tensor_mapping.py).
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
WINDOW = 8


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def _tiny_gemma3():
    from mlx_lm.models import gemma3_text

    # Sizes, window and query scale unlike mlx-lm's defaults, so a key the importer dropped would show.
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, vocab_size=len(TOKENS),
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=16, sliding_window=WINDOW,
        sliding_window_pattern=6, max_position_embeddings=512,
    )
    mx.random.seed(0)
    model = gemma3_text.Model(args)
    model.sanitize({})  # tied: drops lm_head, as loading a file without output.weight does
    # Norm weights start at ones (scale 2); random ones make every norm and its offset matter.
    norms = [(k, mx.random.normal(v.shape) * 0.5) for k, v in tree_flatten(model.parameters()) if k.endswith("norm.weight")]
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())
    return model, args


def _write_gemma3_gguf(path: Path, model, args, **metadata: object) -> None:
    """As llama.cpp's Gemma3Model converter: norm weights + 1, no permutation, no output.weight."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    w.add_block_count(args.num_hidden_layers)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_theta)
    w.add_sliding_window(args.sliding_window)
    w.add_head_count_kv(args.num_key_value_heads)
    if "final_logit_softcapping" in metadata:
        w.add_final_logit_softcapping(metadata["final_logit_softcapping"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    spm = _spm_metadata()
    w.add_token_list(TOKENS)
    w.add_token_scores(spm["tokenizer.ggml.scores"])
    w.add_token_types(spm["tokenizer.ggml.token_type"])
    w.add_bos_token_id(ID["<bos>"])
    w.add_eos_token_id(ID["<eos>"])
    w.add_unk_token_id(ID["<unk>"])
    w.add_pad_token_id(ID["<pad>"])
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for hf, value in tree_flatten(model.parameters()):
        a = np.array(value.astype(mx.float32))
        if hf.endswith("norm.weight"):
            a = a + 1.0
        w.add_tensor(_gguf_name(hf), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_tiny_gemma3_round_trip_matches_logits(tmp_path: Path) -> None:
    from mlx_lm.models import gemma3_text
    from mlx_lm.utils import load_model

    model, args = _tiny_gemma3()
    src = tmp_path / "tiny-gemma3.gguf"
    _write_gemma3_gguf(src, model, args)
    out = import_gguf(src, tmp_path / "models" / "tiny-gemma3", progress=False)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    # Every key mlx-lm's gemma3_text reads is written: none falls back to a silent default.
    read = {f.name for f in dataclasses.fields(gemma3_text.ModelArgs)} - {"rope_scaling"}
    assert read <= set(config), read - set(config)
    assert config["sliding_window"] == WINDOW
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["rope_theta"], config["rope_local_base_freq"], config["query_pre_attn_scalar"]) == (1e6, 1e4, 16)
    assert config["tie_word_embeddings"] is True
    loaded, _ = load_model(out)
    assert "lm_head" not in dict(tree_flatten(loaded.parameters())) and loaded.tie_word_embeddings
    ids = [ID["<bos>"]] + [ID[t] for t in ["the", "▁a", "▁t", "h", "e", "▁the"] * 4]  # 25 tokens > window
    np.testing.assert_allclose(_logits(loaded, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


def test_tiny_gemma3_without_norm_offset_differs(tmp_path: Path) -> None:
    # The round trip above would fail if the +1 were left in: the check can see that mistake.
    from mlx_lm.utils import load_model

    model, args = _tiny_gemma3()
    src = tmp_path / "tiny-gemma3.gguf"
    _write_gemma3_gguf(src, model, args)
    out = import_gguf(src, tmp_path / "tiny-gemma3", progress=False)
    loaded, _ = load_model(out)
    shifted = [(k, v + 1.0) for k, v in tree_flatten(loaded.parameters()) if k.endswith("norm.weight")]
    loaded.load_weights(shifted, strict=False)
    ids = [ID["<bos>"], ID["the"], ID["▁a"]]
    assert np.abs(_logits(loaded, ids) - _logits(model, ids)).max() > 1e-2


def test_imported_gemma3_tokenizer_loads_in_mlx_lm(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model, args = _tiny_gemma3()
    src = tmp_path / "tiny-gemma3.gguf"
    _write_gemma3_gguf(src, model, args)
    out = import_gguf(src, tmp_path / "tiny-gemma3", progress=False)
    tok = load_tokenizer(out)
    assert tok.encode("the the") == [ID["<bos>"], ID["the"], ID["▁the"]]  # one BOS, not two
    assert tok.eos_token_id == ID["<eos>"]
    detok = tok.detokenizer
    assert isinstance(detok, SPMStreamingDetokenizer)
    for i in tok.encode("é the  a", add_special_tokens=False):
        detok.add_token(i)
    detok.finalize()
    assert detok.text == "é the  a"


def test_gemma3_logit_softcapping_is_refused(tmp_path: Path) -> None:
    model, args = _tiny_gemma3()
    src = tmp_path / "capped.gguf"
    _write_gemma3_gguf(src, model, args, final_logit_softcapping=30.0)
    with pytest.raises(ModelImportError, match="final_logit_softcapping"):
        import_gguf(src, tmp_path / "capped", progress=False)
    assert not (tmp_path / "capped").exists()


# --------------------------------------------------------------------------- config rules


def _contents(**keys: object) -> GGUFContents:
    metadata = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 512,
        "gemma3.context_length": 32768,
        "tokenizer.ggml.tokens": TOKENS,
    }
    metadata.update({f"gemma3.{k.replace('__', '.')}": v for k, v in keys.items()})
    return GGUFContents(metadata={k: v for k, v in metadata.items() if v is not None}, tensor_names=[], reader=None)


def test_gemma3_config_rules() -> None:
    config = build_config(_contents())
    assert (config["sliding_window"], config["sliding_window_pattern"], config["query_pre_attn_scalar"]) == (512, 6, 256)
    assert config["layer_types"].count("full_attention") == 3 and config["layer_types"][5] == "full_attention"
    # 27B (62 layers): llama.cpp scales queries by hidden_size / heads, not head_dim.
    big = build_config(_contents(block_count=62, embedding_length=5376, attention__head_count=32, attention__key_length=128,
                                 attention__value_length=128))
    assert big["query_pre_attn_scalar"] == 168
    # No sliding window in the file: every layer global (llama.cpp LLAMA_SWA_TYPE_NONE).
    dense = build_config(_contents(attention__sliding_window=None))
    assert dense["sliding_window_pattern"] == 1 and set(dense["layer_types"]) == {"full_attention"}
    scaled = build_config(_contents(rope__scaling__type="linear", rope__scaling__factor=8.0))
    assert scaled["rope_scaling"]["factor"] == 8.0


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"rope__freq_base": None}, "lacks gemma3.rope.freq_base"),
        ({"attention__value_length": 128}, "value head size"),
        ({"attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"block_count": 4}, "no global layer"),
        ({"attention__head_count_kv": [1, 1]}, "per-layer list"),
    ],
)
def test_gemma3_config_refusals(keys: dict, match: str) -> None:
    with pytest.raises(ModelImportError, match=match):
        build_config(_contents(**keys))
