"""The hub id form, what counts as a servable model folder, and the quantization a config.json
names (omlx.engine.hub, omlx.engine.catalogue); no network, no weights loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx.engine.catalogue import quantization_of, weights_dtype
from omlx.engine.hub import HubRef, allow_patterns, parse_hub_id, unservable_reason


@pytest.mark.parametrize("spec, ref", [
    ("mlx-community/Qwen3-4B-4bit", HubRef("mlx-community/Qwen3-4B-4bit")),
    ("org/name@v1.2", HubRef("org/name", "v1.2")),
    ("org/name@refs/pr/3", HubRef("org/name", "refs/pr/3")),
    ("org/name@0123456789abcdef0123456789abcdef01234567", HubRef("org/name", "0123456789abcdef0123456789abcdef01234567")),
])
def test_hub_ids_parse(spec, ref):
    assert parse_hub_id(spec) == ref


@pytest.mark.parametrize("spec", ["SmolLM2-135M-Instruct", "/abs/path", "./rel/path", "a/b/c", "org/../x", "org/",
                                  "/org/name", "org/name@", "~/models/x", "org/name.gguf/x",
                                  # names the hub refuses (huggingface_hub.utils.validate_repo_id)
                                  "0-/NW", "org/name-", "org--x/name", "org/name.git"])
def test_other_specs_are_not_hub_ids(spec):
    assert parse_hub_id(spec) is None


def test_served_ids_keep_the_revision_except_main():
    assert HubRef("o/n").model_id == "o/n" and HubRef("o/n", "main").model_id == "o/n"
    assert HubRef("o/n", "v1").model_id == "o/n@v1"


def test_allow_patterns_are_mlx_lms_and_take_weights_config_tokenizer_and_template():
    from huggingface_hub.utils import filter_repo_objects

    files = ["config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.model", "README.md",
             ".gitattributes", "pytorch_model.bin", "model.gguf", "images/logo.png"]
    kept = set(filter_repo_objects(files, allow_patterns=allow_patterns()))
    assert kept == {"config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "tokenizer.model"}


def _folder(tmp_path: Path, config: dict | None, files: tuple[str, ...] = ("model.safetensors", "tokenizer.json")) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    for f in files:
        (d / f).write_bytes(b"")
    return d


@pytest.mark.parametrize("config, files, why", [
    ({"model_type": "llama"}, ("model.safetensors", "tokenizer.json"), None),
    ({"model_type": "bert", "architectures": ["BertModel"]}, ("model.safetensors", "vocab.txt"), None),  # omlx's encoder
    (None, ("model.safetensors", "tokenizer.json"), "no readable config.json"),
    ({"model_type": "llama"}, ("tokenizer.json",), "no *.safetensors weights"),
    ({"model_type": "llama"}, ("model.safetensors",), "no tokenizer"),
    ({"model_type": "whisperish"}, ("model.safetensors", "tokenizer.json"), "model_type 'whisperish' is not implemented by mlx-lm"),
    ({}, ("model.safetensors", "tokenizer.json"), "config.json names no model_type"),
])
def test_what_counts_as_a_servable_folder(tmp_path, config, files, why):
    reason = unservable_reason(_folder(tmp_path, config, files))
    assert (reason is None) if why is None else (why in reason), reason


@pytest.mark.parametrize("config, expected", [
    ({"quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}, (4, 64, "4-bit, group 64")),
    ({"quantization": {"group_size": 32, "bits": 8}}, (8, 32, "8-bit, group 32")),
    ({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, (4, 32, "4-bit, group 32 mxfp4")),
    ({"quantization": {"group_size": 64, "bits": 3, "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 6}}},
     (None, 64, "mixed 3/6-bit")),
    ({"quantization_config": {"quant_method": "compressed-tensors"}}, (None, None, "compressed-tensors")),
    ({"model_type": "llama"}, (None, None, None)),
])
def test_quantization_is_read_from_config_json(config, expected):
    assert quantization_of(config) == expected


def test_weights_dtype_comes_from_the_safetensors_header(tmp_path):
    import mlx.core as mx

    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": mx.zeros((2, 2), dtype=mx.bfloat16)})
    assert weights_dtype(tmp_path) == "bfloat16"
    assert weights_dtype(tmp_path / "nothing") is None
