"""The pool's record of one model id, and the small values its parts pass around.

Owns: `ModelRecord` (what the pool knows about a model, loaded or not: its state, entry, bytes,
leases, counters), `ModelState`, `LeaseHolder`, `PoolEvent`, and the figures read off an entry
(`num_requests`, `is_working`, `hot_cache_bytes`, `weights_bytes`).
Must not: lock, load, unload or decide anything; the parts of the pool that hold the lock do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx.config import ModelSettings
from omlx.engine.factory import EncoderEntry, Entry, PoolEntry
from omlx.errors import OmlxError


class ModelState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    """One lease as its record keeps it: since when (``time.monotonic()``) and for whom (a
    request, "start", or an admin call such as "POST /v1/models/<id>/load")."""

    since_s: float
    owner: str


@dataclass(slots=True)
class ModelRecord:
    """What the pool knows about one model id (loaded or not)."""

    model_id: str
    source: str | None  # a path or spec to resolve; None: the id itself
    settings: ModelSettings
    state: ModelState = ModelState.UNLOADED
    entry: Entry | None = None
    task: str | None = None
    weights_bytes: int = 0
    measured_bytes: int = 0
    last_used_s: float = 0.0
    leases: dict[int, LeaseHolder] = field(default_factory=dict)  # lease token -> since when, for whom
    num_expired_leases: int = 0
    num_loads: int = 0
    generation: int = 0
    load_error: OmlxError | None = None
    profile_entries: dict[str | None, Entry] = field(default_factory=dict)

    @property
    def pinned(self) -> bool:
        return self.settings.pin

    @property
    def num_bytes(self) -> int:
        """What unloading it frees, as planned: the larger of its weights and its measured load."""
        return max(self.weights_bytes, self.measured_bytes)


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """One load or unload, with what it cost or freed (``/v1/models/status`` "events").

    ``freed_*`` are measured before and after the unload (MLX active memory, process RSS)
    once freed memory was given back; negative values would mean memory was not freed.
    """

    at_s: float
    model_id: str
    kind: str
    reason: str
    duration_s: float
    num_bytes: int = 0
    freed_mlx_bytes: int = 0
    freed_process_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in PoolEvent.__dataclass_fields__}


def num_requests(entry: Entry | None) -> int:
    """Requests an entry's engine is running or has waiting (0 for no entry)."""
    if isinstance(entry, PoolEntry):
        st = entry.engine.scheduler.stats()
        return st.num_running + st.num_waiting
    if isinstance(entry, EncoderEntry):
        return entry.engine.num_pending
    return 0


def is_working(entry: Entry | None) -> bool:
    """An entry's engine has requests to run (a lease is not needed for that)."""
    if isinstance(entry, PoolEntry):
        return entry.engine.scheduler.has_work or entry.engine.num_active() > 0
    if isinstance(entry, EncoderEntry):
        return entry.engine.num_pending > 0
    return False


def last_work_s(entry: Entry | None) -> float:
    """``time.monotonic()`` of the last step the entry's engine ran with work (`Engine.last_step_s`);
    0.0 for an engine that does not say."""
    engine = getattr(entry, "engine", None)
    return float(getattr(engine, "last_step_s", 0.0) or 0.0)


def hot_cache_bytes(entry: Entry | None) -> int:
    """Bytes in a chat model's hot KV tier (0 for encoders and models without a cache)."""
    pc = entry.engine.prefix_cache if isinstance(entry, PoolEntry) else None
    return int(pc.stats().get("num_bytes", 0)) if pc is not None else 0


def weights_bytes(path: Path) -> int:
    """Bytes of a model folder's weight files (what loading it will allocate, before margins)."""
    files = list(path.glob("*.safetensors")) + list(path.glob("*.gguf"))
    return sum(f.stat().st_size for f in files if f.is_file())
