"""EnginePool: model id -> running engine.

Resolves the ids (and aliases) requests ask for to loaded engines; loads models given at start.
LRU/TTL/pinning and memory-driven eviction build on this (issue 8).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from omlx.engine.engine import Engine
from omlx.engine.loader import LoadedModel
from omlx.config import ServerConfig
from omlx.errors import ModelNotFoundError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PoolEntry:
    """A loaded model and its engine."""

    loaded: LoadedModel
    engine: Engine
    cache_note: str = ""
    tool_dialect: str | None = None
    think: tuple[str, str] | None = None


class EnginePool:
    """Loaded engines by id, with aliases.

    Args:
        aliases: requested id -> served id (e.g. a client's model name -> the local model).
    """

    def __init__(self, aliases: Mapping[str, str] | None = None):
        self.aliases = dict(aliases or {})
        self._entries: dict[str, PoolEntry] = {}
        self._lock = threading.Lock()
        self.default_id: str | None = None

    def add(self, entry: PoolEntry) -> None:
        with self._lock:
            self._entries[entry.loaded.model_id] = entry
            if self.default_id is None:
                self.default_id = entry.loaded.model_id

    def resolve_id(self, model: str) -> str:
        """The served id for a requested id or alias.

        Raises:
            ModelNotFoundError: neither a served id nor an alias of one.
        """
        with self._lock:
            if model in self._entries:
                return model
            target = self.aliases.get(model)
            if target is not None and target in self._entries:
                return target
        raise ModelNotFoundError(model)

    def get(self, model: str) -> PoolEntry:
        """The entry serving ``model`` (id or alias). Raises ModelNotFoundError."""
        mid = self.resolve_id(model)
        with self._lock:
            return self._entries[mid]

    def entries(self) -> list[PoolEntry]:
        with self._lock:
            return list(self._entries.values())

    def listed_ids(self) -> list[str]:
        """Served ids, then aliases that point at one."""
        with self._lock:
            ids = list(self._entries)
            ids += [a for a, t in self.aliases.items() if t in self._entries and a not in self._entries]
            return ids

    def stop(self) -> None:
        for e in self.entries():
            e.engine.stop()

    @staticmethod
    def model_path(entry: PoolEntry) -> Path:
        return entry.loaded.path


def load_entry(spec: str | None, config: ServerConfig, *, progress: bool = True, warmup: bool = True) -> PoolEntry:
    """Resolve, load, start and warm up one model.

    The warm-up runs a short chat through the engine so the first client request is as fast
    as the tenth (kernels compiled, buffers allocated).

    Raises:
        ModelNotFoundError, ModelImportError: the model cannot be found or read.
    """
    from omlx.engine.chat import render_prompt
    from omlx.engine.loader import load, resolve_model
    from omlx.request import Failed, Request, SamplingParams
    from omlx.scheduler import Scheduler

    model_id, path = resolve_model(spec, config.models_dir, progress=progress)
    t0 = time.monotonic()
    loaded = load(model_id, path)
    logger.info("loaded %s from %s in %.1f s", model_id, path, time.monotonic() - t0)
    scheduler = Scheduler(config.max_concurrent_requests, config.max_queued_requests)
    prefix_cache, note = build_prefix_cache(loaded, config)
    engine = Engine(model_id, loaded.model, loaded.tokenizer, scheduler=scheduler,
                    prefix_cache=prefix_cache, block_size=config.cache.block_size)
    engine.start()
    entry = PoolEntry(loaded, engine, note, *model_formats(loaded, config))
    logger.info("%s: tool dialect %s, reasoning markers %s", model_id, entry.tool_dialect or "none", entry.think or "none")
    if warmup:
        t0 = time.monotonic()
        msgs = [{"role": "user", "content": "Warm-up: say hello in one short sentence, please."}]
        ids = render_prompt(loaded.tokenizer, msgs).token_ids
        evs = engine.run_sync(Request(model_id, ids, SamplingParams(max_tokens=4, temperature=0.0)), 300)
        if isinstance(evs[-1], Failed):
            raise evs[-1].error
        if prefix_cache is not None:
            prefix_cache.clear()
        logger.info("warmed up %s in %.2f s", model_id, time.monotonic() - t0)
    return entry


def build_prefix_cache(loaded: LoadedModel, config: ServerConfig):
    """The KV cache tiers for a model, or (None, reason) when the cache is off for it."""
    if not config.cache.enabled:
        return None, "off (disabled by configuration)"
    if not loaded.blockable:
        note = f"off: cache classes {sorted(set(loaded.cache_classes))} cannot be cut into exact blocks"
        logger.warning("prefix cache for %s is %s", loaded.model_id, note)
        return None, note
    from omlx.engine.kv_cache import make_prefix_cache

    return make_prefix_cache(loaded, config), ""


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
        dialect = detect_dialect(template if isinstance(template, str) else None, vocab)
    think = (tok.think_start, tok.think_end) if getattr(tok, "has_thinking", False) else None
    return dialect, think
