"""Quantized KV (``--kv-bits``): omlx's batched quantized cache and its prefix cache, exact.

Differential, on a tiny random llama whose head dim (32) admits every group size: greedy
tokens of omlx's batched step loop over `QuantKVCache` / `BatchQuantKVCache` equal mlx-lm's own
``generate_step`` over mlx-lm's ``QuantizedKVCache`` (quantized from the first token), whatever
else is in the batch; prefix hits (hot, and after a restart from the SSD tier) restore blocks
of packed values, scales and biases that give the same tokens again, at 8 and 4 bits.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from omlx.engine.cache_spec import CacheSpec, spec_of_model
from omlx.engine.quant_cache import BatchQuantKVCache, QuantKVCache
from omlx.engine.runner import BatchRunner
from tests.unit.engine.archs import VOCAB, randomize
from tests.unit.engine.test_cache_kinds import make_engine, rand_prompts
from tests.unit.engine.test_runner import _run_all, _tokens, _usage, drive

BITS = [8, 4]


def tiny_llama_hd32(seed: int = 5):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=True)
    return randomize(llama.Model(args), seed)


@pytest.fixture(scope="module")
def qmodel():
    return tiny_llama_hd32()


def qspec(model, bits: int, group: int = 32) -> CacheSpec:
    return spec_of_model(model).with_kv_bits(bits, group)


def qreference(model, spec: CacheSpec, prompt: list[int], n: int, eos: frozenset[int] = frozenset()) -> list[int]:
    """mlx-lm's greedy tokens over its own ``QuantizedKVCache`` from token 0 (at most ``n``)."""
    cache = [QuantizedKVCache(s.group_size, s.bits) for s in spec.layers]
    out: list[int] = []
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache), range(n)):
        if tok in eos:
            break
        out.append(tok)
    return out


def test_the_layout_names_its_quantization(qmodel):
    spec = qspec(qmodel, 4, 64)
    assert spec.describe() == "Q4g64*2" and spec.kv_quantization == (4, 64)
    assert all(type(c) is QuantKVCache and c.bits == 4 and c.group_size == 64 for c in spec.make_cache())
    assert spec_of_model(qmodel).kv_quantization is None


@pytest.mark.parametrize("bits", BITS)
def test_a_batch_with_late_arrivals_and_a_removal_matches_mlx_lm_quantized(qmodel, bits):
    spec = qspec(qmodel, bits)
    p = rand_prompts([3, 9, 70, 150, 41], seed=bits)
    runner = BatchRunner(qmodel, stop_tokens=[], prefill_step_size=64, mixed_step_size=16, block_size=16,
                         make_cache=spec.make_cache)
    schedule = {0: [("a", p[0]), ("b", p[1])], 2: [("c", p[2])], 6: [("d", p[3])], 20: [("e", p[4])]}
    got = drive(runner, schedule, max_tokens=20, remove_at={9: "b"})
    for name, prompt in zip("acde", [p[0], p[2], p[3], p[4]]):
        assert got[name] == qreference(qmodel, spec, prompt, 20), (bits, name)
    ref_b = qreference(qmodel, spec, p[1], 20)
    assert 0 < len(got["b"]) < 20 and got["b"] == ref_b[: len(got["b"])]


def test_merge_extend_filter_extract_keep_each_rows_tokens(qmodel):
    """A row taken out of a batch holds exactly the quantized KV its own cache had."""
    spec = qspec(qmodel, 8)
    seqs = []
    for n in (5, 12, 3):
        caches = spec.make_cache()
        qmodel(mx.array(rand_prompts([n], seed=n)), cache=caches)
        seqs.append(caches[0])
    batch = BatchQuantKVCache.merge(seqs[:2])
    batch.extend(BatchQuantKVCache.merge(seqs[2:]))
    assert batch.size() == 12 and batch.left_padding.tolist() == [7, 0, 9]
    for row, own in enumerate(seqs):
        got = batch.extract(row)
        assert got.offset == own.offset
        for a, b in zip((*got.keys, *got.values), (*own.keys, *own.values)):
            assert mx.array_equal(a, b[..., : own.offset, :])
    batch.filter([0, 2])  # the longest row leaves: the padding every row has is dropped
    assert batch.size() == 5 and batch.left_padding.tolist() == [0, 2]
    view = batch.row_view(1, 2)
    assert view.offset == 3 and mx.array_equal(view.keys[0], seqs[2].keys[0][..., :3, :])


def test_blocks_hold_packed_values_scales_and_biases_and_restore_exactly(qmodel):
    spec = qspec(qmodel, 4)
    caches = spec.make_cache()
    qmodel(mx.array(rand_prompts([40], seed=2)), cache=caches)
    payload = spec.payload_fn(caches, None)
    parts = [payload(0, 16), payload(16, 32), payload(32, 40)]
    assert sorted(parts[0]) == ["kv.biases", "kv.q", "kv.scales"]
    assert parts[0]["kv.q"].dtype == mx.uint32 and parts[0]["kv.q"].shape == (2, 2, 2, 16, 32 * 4 // 32)
    assert parts[0]["kv.scales"].shape == (2, 2, 2, 16, 1) and parts[0]["kv.scales"].dtype == mx.float32
    back = spec.materialize([(p, p["kv.q"].shape[-2]) for p in parts])
    for got, own in zip(back, caches):
        assert got.offset == own.offset == 40
        for a, b in zip((*got.keys, *got.values), (*own.keys, *own.values)):
            assert mx.array_equal(a[..., :40, :], b[..., :40, :])


@pytest.mark.parametrize("bits", BITS)
def test_every_kind_of_hit_is_exact_hot_concurrent_and_after_a_restart(qmodel, tokenizer, tmp_path, bits):
    from omlx.request import Request, SamplingParams

    spec = qspec(qmodel, bits)
    eos = frozenset(tokenizer.eos_token_ids)
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    base, tail1, tail2, tail3, *suffixes = rand_prompts([90, 21, 9, 30] + [4 + 3 * i for i in range(8)], seed=11)
    ref = lambda prompt, n=10: qreference(qmodel, spec, prompt, n, eos)  # noqa: E731
    eng, pc = make_engine(qmodel, tokenizer, tmp_path, spec)
    try:
        out1 = _tokens(_run_all(eng, [Request("tiny", base, sp)])[0])
        assert out1 == ref(base)
        turn2 = base + out1 + tail2
        evs = _run_all(eng, [Request("tiny", base + tail1, sp), Request("tiny", base, sp), Request("tiny", turn2, sp)])
        for ev, prompt in zip(evs, [base + tail1, base, turn2]):
            assert _tokens(ev) == ref(prompt), len(prompt)
        cached = [_usage(ev).num_cached_tokens for ev in evs]
        assert cached[0] >= 80 and cached[1] >= 80 and cached[2] >= len(base) + len(out1) - 16, cached
        evs = _run_all(eng, [Request("tiny", base + s, SamplingParams(max_tokens=6, temperature=0.0))
                             for s in suffixes])
        for ev, s in zip(evs, suffixes):
            assert _tokens(ev) == ref(base + s, 6)
        assert all(_usage(ev).num_cached_tokens >= 80 for ev in evs)
        assert pc.stats()["cache_layout"] == f"Q{bits}g32*2"
    finally:
        eng.stop()
        assert pc.close(30)
    eng, pc = make_engine(qmodel, tokenizer, tmp_path, spec)  # a restart: blocks come from the SSD tier
    try:
        ev = _run_all(eng, [Request("tiny", base + tail3, sp)])[0]
        assert _tokens(ev) == ref(base + tail3)
        assert _usage(ev).num_cached_tokens_cold >= 80, _usage(ev)
    finally:
        eng.stop()
        pc.close(30)


def test_a_model_that_cannot_attend_over_quantized_kv_is_refused_at_load():
    """The load fails, naming why: a head dim the group size does not divide, and GPT-OSS's
    attention sinks (mlx-lm's quantized attention has none)."""
    from types import SimpleNamespace

    from mlx_lm.utils import _get_classes

    from omlx.config import ServerConfig
    from omlx.engine.factory import model_cache_spec
    from omlx.errors import ModelImportError
    from tests.unit.engine.archs import CONFIGS, tiny

    loaded = SimpleNamespace(model=tiny("gpt_oss"), model_id="tiny-gpt-oss", cache_classes=[])  # head dim 16
    with pytest.raises(ModelImportError, match="cannot attend over a quantized KV cache.*group size 32"):
        model_cache_spec(loaded, ServerConfig(kv_bits=8, kv_group_size=32))
    spec, note = model_cache_spec(loaded, ServerConfig())
    assert spec is not None and spec.kv_quantization is None and note == ""
    cfg = dict(CONFIGS["gpt_oss"], head_dim=32)
    model_cls, args_cls = _get_classes(cfg)
    loaded.model = randomize(model_cls(args_cls.from_dict(cfg)), 1)
    with pytest.raises(ModelImportError, match="cannot attend over a quantized KV cache.*sinks"):
        model_cache_spec(loaded, ServerConfig(kv_bits=8, kv_group_size=32))
