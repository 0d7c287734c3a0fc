"""Tiny random models of real architectures for in-process engine tests (no server, no weights).

Weights are drawn with a larger spread than an initializer's (std 3/sqrt(fan_in)) so greedy
decoding wanders over the vocabulary instead of repeating one token: a differential test
against mlx-lm then compares many different tokens, not one.
"""

from __future__ import annotations

import pytest

from tests.unit.engine.archs import randomize


def tiny_llama(vocab_size: int = 49152, seed: int = 3):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=vocab_size, rope_theta=10000.0, tie_word_embeddings=True)
    return randomize(llama.Model(args), seed)


def looping_llama(seed: int = 3):
    """A tiny random llama (vocab 512, weights std 1/sqrt(fan_in)) whose greedy output falls into
    loops of many tokens, which prompt lookup partly predicts (speculation tests)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True)
    m = llama.Model(args)
    mx.random.seed(seed)
    m.update(tree_unflatten([(k, mx.random.normal(v.shape) / v.shape[-1] ** 0.5 if v.ndim > 1 else v)
                             for k, v in tree_flatten(m.parameters())]))
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's real tokenizer (vocab 49152, ChatML EOS ids), imported once."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from tests.helpers import default_model_dir

    return load_tokenizer(default_model_dir())
