"""omlx.cluster.layer_bytes against tiny safetensors folders written by the tests themselves."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from omlx.cluster.layer_bytes import (
    activation_bytes_per_token,
    read_layout,
    read_safetensors_header,
)
from omlx.cluster.plan import PlanRequest, parse_nodes_spec, plan_pipeline

HIDDEN, HEADS, KV_HEADS, VOCAB, NUM_LAYERS = 8, 4, 2, 16, 3


def tensors(*, tied: bool, extra_layer: bool = False) -> dict[str, np.ndarray]:
    """A Llama-shaped checkpoint; layer i's MLP is (i + 1) times wider so layer sizes differ."""
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": np.zeros((VOCAB, HIDDEN), np.float16)}
    for i in range(NUM_LAYERS + int(extra_layer)):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = np.zeros((HIDDEN, HIDDEN), np.float16)
        t[p + "self_attn.k_proj.weight"] = np.zeros((HIDDEN // 2, HIDDEN), np.float16)
        t[p + "mlp.up_proj.weight"] = np.zeros((HIDDEN * (i + 1), HIDDEN), np.float16)
        t[p + "mlp.up_proj.scales"] = np.zeros((HIDDEN * (i + 1), 1), np.float32)
        t[p + "input_layernorm.weight"] = np.zeros((HIDDEN,), np.float16)
    t["model.norm.weight"] = np.zeros((HIDDEN,), np.float16)
    if not tied:
        t["lm_head.weight"] = np.zeros((VOCAB, HIDDEN), np.float16)
    return t


def expected_layer_bytes(t: dict[str, np.ndarray]) -> list[int]:
    return [
        sum(a.nbytes for k, a in t.items() if k.startswith(f"model.layers.{i}."))
        for i in range(NUM_LAYERS)
    ]


def write_config(path: Path, **extra: object) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "torch_dtype": "float16",
        **extra,
    }
    (path / "config.json").write_text(json.dumps(config))


def test_single_file_untied(tmp_path: Path) -> None:
    t = tensors(tied=False)
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "mlx"})
    write_config(tmp_path, tie_word_embeddings=False)
    layout = read_layout(tmp_path)
    assert layout.layer_bytes == expected_layer_bytes(t)
    assert len(set(layout.layer_bytes)) == NUM_LAYERS  # the sizes really differ
    assert layout.embed_bytes == VOCAB * HIDDEN * 2
    assert layout.head_bytes == VOCAB * HIDDEN * 2
    assert layout.norm_bytes == HIDDEN * 2
    assert layout.tied_embeddings is False
    # 2 (K and V) * kv heads * head_dim (8 / 4) * float16
    assert layout.kv_bytes_per_token_per_layer == 2 * KV_HEADS * (HIDDEN // HEADS) * 2
    assert activation_bytes_per_token(tmp_path) == HIDDEN * 2
    total = sum(a.nbytes for a in t.values())
    assert (
        sum(layout.layer_bytes) + layout.embed_bytes + layout.head_bytes + layout.norm_bytes
        == total
    )


def test_sharded_tied_with_extra_layer_and_vision(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = tensors(tied=True, extra_layer=True)  # layer NUM_LAYERS stands for an MTP layer
    t["vision_tower.encoder.layers.0.weight"] = np.zeros((4, 4), np.float32)
    names = sorted(t)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: t[k] for k in keys}, str(tmp_path / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    write_config(tmp_path, head_dim=6, torch_dtype="bfloat16")  # no tie key, no lm_head -> tied
    with caplog.at_level(logging.INFO, logger="omlx.cluster.layer_bytes"):
        layout = read_layout(tmp_path)
    assert layout.layer_bytes == expected_layer_bytes(t)
    assert layout.tied_embeddings is True and layout.head_bytes == 0
    assert layout.kv_bytes_per_token_per_layer == 2 * KV_HEADS * 6 * 2
    extra = sum(
        a.nbytes
        for k, a in t.items()
        if k.startswith((f"model.layers.{NUM_LAYERS}.", "vision_tower."))
    )
    assert f"{extra} bytes of weights outside" in caplog.text


def test_header_sizes_match_numpy(tmp_path: Path) -> None:
    t = {"a": np.zeros((3, 5), np.int8), "b": np.zeros((2,), np.float64)}
    save_file(t, str(tmp_path / "x.safetensors"))
    assert read_safetensors_header(tmp_path / "x.safetensors") == {"a": 15, "b": 16}
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError):
        read_safetensors_header(tmp_path / "bad.safetensors")


def test_missing_layer_and_missing_weights_raise(tmp_path: Path) -> None:
    write_config(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_layout(tmp_path)
    t = {k: v for k, v in tensors(tied=True).items() if not k.startswith("model.layers.1.")}
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensors for layers"):
        read_layout(tmp_path)


def test_layout_feeds_the_planner(tmp_path: Path) -> None:
    save_file(tensors(tied=False), str(tmp_path / "model.safetensors"))
    write_config(tmp_path, tie_word_embeddings=False)
    layout = read_layout(tmp_path)
    nodes = parse_nodes_spec("a:4KB:100GB/s,b:4KB:50GB/s", headroom_bytes=0)
    plan = plan_pipeline(layout, nodes, PlanRequest(16, 2, activation_bytes_per_token(tmp_path)))
    assert sum(s.num_layers for s in plan.stages) == NUM_LAYERS and plan.fits
