"""Building a running engine for a model folder: chat models and encoders.

Owns: the entry types the pool hands to routes (`PoolEntry` for chat, `EncoderEntry` for
embeddings and rerank), loading a folder into one (weights, tokenizer, KV cache tiers, tool
dialect, warm-up) and starting its engine thread. Must not: decide when to load or unload
(`omlx.pool`), or speak HTTP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from omlx.config import ModelSettings, ServerConfig
from omlx.engine.encoder import EncoderEngine, LoadedEncoder
from omlx.engine.engine import Engine
from omlx.engine.loader import LoadedModel
from omlx.kernels.status import gpu_backend

if TYPE_CHECKING:
    from omlx.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolEntry:
    """A loaded chat model and its engine, as a route sees it.

    Attributes:
        settings: the model's settings with the request's profile laid over them.
        profile: that profile's name, or None.
    """

    loaded: LoadedModel
    engine: Engine
    cache_note: str = ""
    tool_dialect: str | None = None
    think: tuple[str, str] | None = None
    settings: ModelSettings = field(default_factory=ModelSettings)
    profile: str | None = None


@dataclass(slots=True)
class EncoderEntry:
    """A loaded embedding model or cross-encoder and its engine."""

    engine: EncoderEngine
    settings: ModelSettings = field(default_factory=ModelSettings)

    @property
    def loaded(self) -> LoadedEncoder:
        return self.engine.loaded

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def task(self) -> str:
        return self.engine.loaded.task


Entry = PoolEntry | EncoderEntry


def load_model(model_id: str, path: Path, task: str, settings: ModelSettings, config: ServerConfig,
               *, warmup: bool = False) -> Entry:
    """Load and start one model: a chat engine, or an encoder engine for embeddings/rerank.

    Raises:
        ModelImportError: the folder cannot be read as that kind of model.
    """
    if task in ("embeddings", "rerank"):
        from omlx.engine.encoder import load_encoder

        t0 = time.monotonic()
        enc = EncoderEngine(load_encoder(model_id, path, task))
        enc.start()
        logger.info("loaded %s model %s from %s in %.1f s", task, model_id, path, time.monotonic() - t0)
        return EncoderEntry(enc, settings)
    return load_chat_model(model_id, path, settings, config, warmup=warmup)


def load_chat_model(model_id: str, path: Path, settings: ModelSettings, config: ServerConfig,
                    *, warmup: bool = True) -> PoolEntry:
    """Load, start and (optionally) warm up one chat model.

    The warm-up runs a short chat through the engine so the first client request is as fast
    as the tenth (kernels compiled, buffers allocated); loads on demand skip it, since a
    client is already waiting and its own request warms the model up.

    Raises:
        ModelImportError: the model cannot be read.
    """
    from omlx.engine.chat import render_prompt
    from omlx.engine.faults import inject, parse_fault_spec
    from omlx.engine.loader import load
    from omlx.engine.sampling import make_processors
    from omlx.request import Failed, Request, SamplingParams
    from omlx.scheduler import Scheduler

    t0 = time.monotonic()
    loaded = load(model_id, path)
    if settings.context_length:
        loaded.context_length = settings.context_length
    logger.info("loaded %s from %s in %.1f s", model_id, path, time.monotonic() - t0)
    scheduler = Scheduler(config.max_concurrent_requests, config.max_queued_requests)
    spec, note = model_cache_spec(loaded, config)
    prefix_cache, note = build_prefix_cache(loaded, config, spec, note)
    fault_plan = parse_fault_spec(config.test_fault)
    parts: dict[str, Any] = {}
    model = loaded.model
    if fault_plan is not None:  # test-only: the faults come in through the engine's own factories
        logger.warning("TEST FAULT INJECTION is on (OMLX_TEST_FAULT=%s): generation will fail on purpose", config.test_fault)
        injected = inject(fault_plan, model, loaded.tokenizer, make_processors)
        model = injected.model
        parts = {"make_processors": injected.make_processors, "make_detokenizer": injected.make_detokenizer}
    engine = Engine(model_id, model, loaded.tokenizer, scheduler=scheduler, **parts,
                    prefix_cache=prefix_cache, block_size=config.cache.block_size,
                    measure_steps=config.prefill_step_size is None,
                    prefill_step_size=config.prefill_step_size or 2048,
                    max_tpot_slowdown=config.max_tpot_slowdown,
                    pad_shapes=gpu_backend() == "cuda",
                    num_draft_tokens=config.lookup_draft_tokens,
                    make_cache=spec.make_cache if spec and spec.kv_quantization else None)
    if config.prefill_step_size:
        logger.info("%s: prefill chunk %d tokens (configured, not measured)", model_id, config.prefill_step_size)
    blocker = None
    if config.lookup_draft_tokens:
        from mlx_lm.models.cache import make_prompt_cache

        from omlx.engine.runner import drafting_blocker

        blocker = drafting_blocker(spec.make_cache() if spec and spec.kv_quantization else make_prompt_cache(loaded.model))
    if blocker:
        logger.warning("%s: prompt-lookup drafting (--lookup-draft-tokens) never runs for this model: %s",
                       model_id, blocker)
    elif config.lookup_draft_tokens:
        logger.info("%s: prompt-lookup drafting on (experimental): up to %d tokens per verify step for each "
                    "request without penalties or structured output", model_id, config.lookup_draft_tokens)
        if mx.default_device() == mx.cpu:
            logger.warning("%s: prompt-lookup drafting makes decode slower on a CPU device (an MLX CPU forward "
                           "costs about linearly in its query length; 0.77x measured, benchmarks/bench_lookup.py)",
                           model_id)
    engine.start()
    entry = PoolEntry(loaded, engine, note, *model_formats(loaded, config), settings=settings)
    logger.info("%s: tool dialect %s, reasoning markers %s", model_id, entry.tool_dialect or "none", entry.think or "none")
    if entry.tool_dialect is None:
        logger.warning("%s: no tool-call format detected in its chat template (set tool_dialect in [models.\"%s\"] "
                       "if it has one): with tool_choice auto its answers are text; a forced tool call (required, a "
                       "named tool, Anthropic any/tool) is written as a JSON call by constrained decoding",
                       model_id, model_id)
    if warmup:
        t0 = time.monotonic()
        msgs = [{"role": "user", "content": "Warm-up: say hello in one short sentence, please."}]
        ids = render_prompt(loaded.tokenizer, msgs).token_ids
        reqs = [Request(model_id, ids, SamplingParams(max_tokens=4, temperature=0.0))]
        if mx.default_device() != mx.cpu:
            reqs += warmup_batch(model_id, ids, min(config.max_concurrent_requests, 8),
                                 config.cache.block_size if prefix_cache is not None else 0)
        for evs in engine.run_all(reqs, 300):
            if isinstance(evs[-1], Failed):
                engine.stop()
                raise evs[-1].error
        if prefix_cache is not None:
            prefix_cache.clear()
        logger.info("warmed up %s in %.2f s (%d requests%s)", model_id, time.monotonic() - t0, len(reqs),
                    ", batched: the first start on a machine compiles its GPU kernels" if len(reqs) > 1 else "")
    return entry


def warmup_batch(model_id: str, ids: list[int], n: int, block_size: int = 0) -> list[Request]:
    """``n`` greedy requests of different prompt and output lengths, run together at load on
    a GPU; with ``block_size`` (prefix cache on), the last one's prompt ends 2 tokens before a
    block boundary, so its decode fills a block while other rows decode.

    A single short warm-up request leaves kernels of the batch path unbuilt (gathers of merging
    rows into a decode batch and dropping finished ones, and of caching a block decode filled);
    MLX CUDA compiles each on first use, 3-6 s apiece on an H200, on the engine thread, which
    stalled every stream. Measured with ``benchmarks/diag_engine_cache.py --streams 8`` and an
    empty ``MLX_PTX_CACHE_DIR`` (2026-12-03): 172 tok/s in the first wave, one gap of 3.2 s,
    701 tok/s in the second; the last kernel compiled when decode filled the first block. The
    compiled kernels are kept on disk, so later starts on the machine pay little for this.
    """
    from omlx.request import Request, SamplingParams

    if n < 2:
        return []
    reqs = [Request(model_id, ids[: max(1, len(ids) - i)], SamplingParams(max_tokens=2 + i, temperature=0.0))
            for i in range(n - 1)]
    long = ids[: max(1, len(ids) - n + 1)]
    if block_size > 2:
        long = (ids * (block_size // max(1, len(ids)) + 1))[: block_size - 2]
    return reqs + [Request(model_id, long, SamplingParams(max_tokens=6, temperature=0.0))]


def model_cache_spec(loaded: LoadedModel, config: ServerConfig):
    """(the model's cache layout, "") with ``--kv-bits`` applied, or (None, why the prefix cache
    cannot be on) for cache classes `omlx.engine.cache_spec` does not know.

    Raises:
        ModelImportError: ``--kv-bits`` is set and the model cannot run on a quantized KV cache
            (no layout known, or its attention refuses one, e.g. attention sinks).
    """
    from omlx.engine.cache_spec import UnsupportedCacheError, spec_of_model
    from omlx.errors import ModelImportError

    try:
        spec = spec_of_model(loaded.model)
    except UnsupportedCacheError as e:
        if config.kv_bits is not None:
            raise ModelImportError(f"--kv-bits {config.kv_bits}: {loaded.model_id} cannot use a quantized KV cache: "
                                   f"{e}") from e
        return None, f"off: {e} (cache classes {sorted(set(loaded.cache_classes))})"
    if config.kv_bits is None:
        return spec, ""
    spec = spec.with_kv_bits(config.kv_bits, config.kv_group_size)
    if spec.kv_quantization is None:
        raise ModelImportError(f"--kv-bits {config.kv_bits}: {loaded.model_id} has no full-attention layer to quantize "
                               f"(cache layout {spec.describe()})")
    if mx.default_device() != mx.cpu:
        logger.info("%s: checking that it attends over quantized KV; on CUDA the first calls compile MLX's quantized "
                    "matmul kernels (MLX 0.32.4, H200: ~30 s, and again for new shapes)", loaded.model_id)
    t0 = time.monotonic()
    try:  # a model whose attention cannot read quantized KV fails here, not on a client's request
        mx.eval(loaded.model(mx.array([[1, 2]]), cache=spec.make_cache()))
    except Exception as e:
        raise ModelImportError(f"--kv-bits {config.kv_bits} (group size {config.kv_group_size}): {loaded.model_id} "
                               f"cannot attend over a quantized KV cache: {e}") from e
    logger.info("%s: KV cache quantized to %d bits, group size %d (cache layout %s; checked in %.1f s)",
                loaded.model_id, config.kv_bits, config.kv_group_size, spec.describe(), time.monotonic() - t0)
    if config.kv_bits <= 4 and config.cache.enabled:
        logger.warning("%s: --kv-bits %d with the prefix cache: a hit may reuse KV another request computed under other "
                       "prefill chunk cuts, which differs from a prefill of this prompt in the last bit; at %d bits the "
                       "quantization scales can amplify that into different later tokens (README, --kv-bits)",
                       loaded.model_id, config.kv_bits, config.kv_bits)
    if mx.default_device() == mx.cpu:
        logger.warning("%s: --kv-bits on the CPU: attention over quantized KV runs through MLX's CPU quantized "
                       "matmul, not BLAS: prefill ~3x and decode ~1.25x slower than unquantized (SmolLM2-135M, "
                       "2 cores, 600-token prompt: 10.4 s vs 3.6 s); it saves memory, not time", loaded.model_id)
    return spec, ""


def build_prefix_cache(loaded: LoadedModel, config: ServerConfig, spec=None, note: str = ""):
    """The KV cache tiers for a model of layout ``spec`` (`model_cache_spec`), or (None, reason)
    when the cache is off for it (``note``: why the layout is unknown)."""
    if not config.cache.enabled:
        return None, "off (disabled by configuration)"
    from omlx.engine.kv_cache import make_prefix_cache

    if spec is None:
        logger.warning("prefix cache for %s is %s; every prompt is prefilled in full", loaded.model_id, note)
        return None, note
    return make_prefix_cache(loaded, config, spec=spec), ""


def model_formats(loaded: LoadedModel, config: ServerConfig) -> tuple[str | None, tuple[str, str] | None]:
    """(tool dialect, think markers) of a model: configured, else detected from its template."""
    from omlx.tool_parsers import detect_dialect

    tok = loaded.tokenizer
    settings = config.model_settings.get(loaded.model_id)
    dialect = settings.tool_dialect if settings and settings.tool_dialect else None
    if dialect is None:
        template = getattr(tok, "chat_template", None)
        try:
            vocab = tok.get_vocab()
        except Exception:
            vocab = None
        kwargs = getattr(getattr(tok, "_tokenizer", tok), "init_kwargs", None)
        template_type = kwargs.get("chat_template_type") if isinstance(kwargs, dict) else None
        dialect = detect_dialect(template if isinstance(template, str) else None, vocab, template_type)
    think = (tok.think_start, tok.think_end) if getattr(tok, "has_thinking", False) else None
    if think is None and dialect:
        think = dialect_think_markers(dialect)
    return dialect, think


def dialect_think_markers(dialect: str) -> tuple[str, str] | None:
    """The reasoning markers a tool dialect's format defines (gpt-oss Harmony's analysis
    channel), for models whose tokenizer names none; None for an unknown dialect."""
    from omlx.tool_parsers import get_dialect

    try:
        return get_dialect(dialect).think_markers
    except ValueError:
        return None
