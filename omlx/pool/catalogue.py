"""The pool's catalogue: which model ids it serves and what a requested name resolves to.

Owns: one `ModelRecord` per known id (``--model`` specs, ``[models."<id>"]`` tables, folders
under ``<base-path>/models``, mlx-lm models in the Hugging Face hub cache as ``ORG/NAME``, the
embedded defaults), the aliases, the ``<id>:<profile>`` ids, the default id and the start
order; resolving a requested name (id, alias or ``<id>:<profile>``) to one record; what a
model's task is before it is loaded, and where its files are.
Must not: load, lease or unload (`omlx.pool.loaded` does), or decide about memory.
Locking: the pool's lock, shared; methods that say "caller holds the lock" do not take it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from omlx.config import ModelSettings, ServerConfig, closest, did_you_mean
from omlx.engine.encoder import folder_task
from omlx.engine.hub import HubModel
from omlx.engine.loader import is_safe_model_id
from omlx.errors import InvalidRequestError, ModelNotFoundError
from omlx.pool.model import ModelRecord
from omlx.profiles import profile_id, split_profile_id


class Catalogue:
    """Model ids, aliases and profiles the pool serves.

    Args:
        config: the server config (models dir, hub cache, aliases, per-model settings).
        lock: the pool's lock, held around every read or change of ``records``.
    """

    def __init__(self, config: ServerConfig, lock: threading.Condition):
        self.config = config
        self._lock = lock
        self.records: dict[str, ModelRecord] = {}
        self.aliases: dict[str, str] = dict(config.aliases)
        self.default_id: str | None = None
        self.start_ids: list[str] = []  # ``--model`` specs, in order
        for mid, s in config.model_settings.items():
            for a in s.aliases:
                self.aliases.setdefault(a, mid)
            if s.path:  # a pinned id without a path is found like any other (`lookup`), or refused at start
                self.records[mid] = ModelRecord(mid, s.path, s)

    def _settings(self, model_id: str) -> ModelSettings:
        return self.config.model_settings.get(model_id) or ModelSettings()

    def register(self, spec: str | None) -> str:
        """Make a ``--model`` spec (id, folder, .gguf; None = the default chat model) known.

        A .gguf is imported into the models folder here. Returns the served id.

        Raises:
            ModelNotFoundError, ModelImportError: nothing matches, or it cannot be imported.
        """
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID
        from omlx.engine.loader import resolve_model

        if spec == DEFAULT_EMBEDDING_MODEL_ID:
            mid, source = spec, None
        else:
            mid, path = resolve_model(spec, self.config.models_dir, progress=False, hub_cache=self.hub_cache())
            source = None if path == self.config.models_dir / mid else str(path)
        with self._lock:
            if mid not in self.records:
                self.records[mid] = ModelRecord(mid, source or self._settings(mid).path, self._settings(mid))
            if self.default_id is None:
                self.default_id = mid
            if mid not in self.start_ids:
                self.start_ids.append(mid)
        return mid

    def hub_cache(self) -> Path:
        from omlx.engine import hub

        return self.config.hub_cache or hub.cache_dir(None)

    def _discover(self, name: str) -> ModelRecord | None:
        """A record for a model not yet known: a folder in the models dir, a model in the hub
        cache (``ORG/NAME[@REVISION]``, its snapshot folder as the source) or an embedded default."""
        from omlx.engine.embedded import DEFAULT_MODEL_ID
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID

        if not is_safe_model_id(name):
            from omlx.engine import hub

            ref = hub.parse_hub_id(name)
            if ref is not None and ref.model_id != name:  # ORG/NAME@main is served as ORG/NAME
                return self.records.get(ref.model_id) or self._discover(ref.model_id)
            path = hub.find_cached(ref, self.hub_cache()) if ref is not None else None
            if path is None:
                return None
            rec = ModelRecord(name, str(path), self._settings(name))
            self.records[name] = rec
            return rec
        if (self.config.models_dir / name / "config.json").is_file() or name in (DEFAULT_MODEL_ID, DEFAULT_EMBEDDING_MODEL_ID):
            rec = ModelRecord(name, None, self._settings(name))
            self.records[name] = rec
            return rec
        return None

    def hub_models(self) -> list[HubModel]:
        """The hub cache's servable models (`omlx.engine.hub.list_cached`): a scan of its folders, so
        callers run it before taking the lock and hand it to `scan_models_dir`."""
        from omlx.engine import hub

        return hub.list_cached(self.hub_cache())

    def scan_models_dir(self, hub_models: list[HubModel]) -> None:
        """Add records for models that appeared in the models dir or the hub cache (``hub_models``)
        since the last look. Caller holds the lock."""
        d = self.config.models_dir
        try:
            names = sorted(p.name for p in d.iterdir() if (p / "config.json").is_file())
        except OSError:
            names = []
        for n in names:
            if n not in self.records:
                self._discover(n)
        for m in hub_models:
            if m.model_id not in self.records:
                self.records[m.model_id] = ModelRecord(m.model_id, str(m.path), self._settings(m.model_id))

    def lookup(self, name: str, *, depth: int = 0) -> tuple[ModelRecord, str | None] | None:
        """(record, profile) for a requested name, or None. Caller holds the lock."""
        rec = self.records.get(name)
        if rec is not None:
            return rec, None
        target = self.aliases.get(name)
        if target is not None and depth < 2:
            return self.lookup(target, depth=depth + 1)
        split = split_profile_id(name)
        if split is not None:
            found = self.lookup(split[0], depth=depth + 1)
            if found is not None and found[1] is None and split[1] in found[0].settings.profiles:
                return found[0], split[1]
            return None
        rec = self._discover(name)
        return (rec, None) if rec is not None else None

    def _known_ids(self) -> list[str]:
        """Every model id and alias known now, sorted (for a did-you-mean). Caller holds the lock."""
        return sorted({*self.records, *self.aliases})

    def resolve(self, model: str) -> tuple[str, str | None]:
        """(served id, profile or None) for a requested id, alias or ``<id>:<profile>``.

        Raises:
            ModelNotFoundError: none of those (an unknown name never falls back to a default).
        """
        with self._lock:
            found = self.lookup(model)
        if found is None:
            hub_models = self.hub_models()
            with self._lock:
                self.scan_models_dir(hub_models)
                known = self._known_ids()
            # A stricter cutoff than the config's 0.6: a request's id is often another server's
            # name ("no-such-model" is not a typo of "local-model").
            close = closest(model, known, cutoff=0.8)
            raise ModelNotFoundError(model, hint=f"did you mean {close}?; GET /v1/models lists the served ids"
                                     if close is not None else "")
        return found[0].model_id, found[1]

    def listed_ids(self) -> list[str]:
        """Every servable id: models (default first), their profiles, then aliases."""
        hub_models = self.hub_models()
        with self._lock:
            self.scan_models_dir(hub_models)
            ids = sorted(self.records, key=lambda m: (m != self.default_id, m))
            out = list(ids)
            for m in ids:
                out += [profile_id(m, p) for p in self.records[m].settings.profiles]
            out += [a for a in sorted(self.aliases) if a not in self.records and self.lookup(a) is not None]
            return out

    def aliases_of(self, model_id: str) -> list[str]:
        """The aliases that name ``model_id``, sorted. Caller holds the lock."""
        return sorted(a for a, t in self.aliases.items() if t == model_id)

    def start_order(self) -> list[str]:
        """The ids to load at start: the ``--model`` specs in order, then every pinned model
        (may repeat). Sets the default id to the first when none was registered. Takes the lock.

        Raises:
            ModelNotFoundError: a pinned model is not found (the message names the closest known id).
        """
        hub_models = self.hub_models()
        with self._lock:
            self.scan_models_dir(hub_models)
            order = list(self.start_ids)
            for m, s in self.config.model_settings.items():
                if s.pin:
                    if s.path and not Path(s.path).expanduser().exists():
                        raise ModelNotFoundError(m, hint=f'[models."{m}"] in the config has pin = true and path '
                                                         f'{s.path}, which does not exist; fix the path or remove the table')
                    found = self.lookup(m)
                    if found is None:
                        from omlx.engine import hub

                        known = self._known_ids()
                        fix = (f"fetch it with `omlx models pull {m}`, fix the id" if hub.parse_hub_id(m) is not None
                               else "fix the id")
                        raise ModelNotFoundError(m, hint=f'[models."{m}"] in the config has pin = true, but no model '
                                                         f'of that id is in {self.config.models_dir}, the hub cache or '
                                                         f'--model{did_you_mean(m, known)}; {fix} or remove the table')
                    order.append(found[0].model_id)
            if self.default_id is None and order:
                self.default_id = order[0]
        return order

    def unmatched_settings(self) -> list[str]:
        """One line for each ``[models."<id>"]`` table that names no model omlx can find now (not
        a ``--model``, not in the models dir or the hub cache, not an alias; a ``path`` that does
        not exist), with the closest known id, for a start-up warning. Not an error: a model of that
        id may be pulled or copied in later, and its settings then apply. Takes the lock."""
        hub_models = self.hub_models()
        lines = []
        with self._lock:
            self.scan_models_dir(hub_models)
            known = self._known_ids()
            for mid, s in self.config.model_settings.items():
                if s.path and not Path(s.path).expanduser().exists():
                    lines.append(f'[models."{mid}"] in the config: its path {s.path} does not exist')
                elif self.lookup(mid) is None and not s.pin:  # a pinned one refuses the start (`start_order`)
                    lines.append(f'[models."{mid}"] in the config names no model omlx can find (in '
                                 f'{self.config.models_dir}, the hub cache or --model){did_you_mean(mid, known)}; '
                                 f'its settings are unused until a model of that id appears')
        return lines

    def check_task(self, asked: str, model_id: str, task: str) -> None:
        """Refuse a model of another kind than ``task`` before it is loaded.

        Raises:
            InvalidRequestError: the model serves another task (``asked`` is the name the request used).
        """
        with self._lock:
            rec = self.records[model_id]
            kind = rec.task or rec.settings.task
        if kind is None:
            kind = self._peek_task(rec)
        if kind is not None and kind != task:
            hint = {"chat": "POST /v1/chat/completions, /v1/messages or /v1/responses",
                    "embeddings": "POST /v1/embeddings", "rerank": "POST /v1/rerank"}[kind]
            raise InvalidRequestError(f"model '{asked}' serves {kind}, not {task}; use {hint}", param="model")

    def _peek_task(self, rec: ModelRecord) -> str | None:
        """A model's task from its files, without loading it (None when they are not there yet)."""
        from omlx.engine.embedded import DEFAULT_MODEL_ID
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID

        if rec.source is None and rec.model_id in (DEFAULT_MODEL_ID, DEFAULT_EMBEDDING_MODEL_ID):
            return "chat" if rec.model_id == DEFAULT_MODEL_ID else "embeddings"
        folder = Path(rec.source) if rec.source else self.config.models_dir / rec.model_id
        return folder_task(folder) if (folder / "config.json").is_file() else None

    def resolve_path(self, model_id: str, source: str | None) -> tuple[Path, str]:
        """(folder, task) of a model's files, fetching the embedded embedding model if needed.

        Raises:
            ModelNotFoundError, ModelImportError: as `omlx.engine.loader.resolve_model`.
        """
        from omlx.engine.embedded_embeddings import DEFAULT_EMBEDDING_MODEL_ID, ensure_default_embedding_model
        from omlx.engine.loader import resolve_model

        if source is None and model_id == DEFAULT_EMBEDDING_MODEL_ID:
            path = ensure_default_embedding_model(self.config.models_dir)
        else:
            _, path = resolve_model(source or model_id, self.config.models_dir, progress=False,
                                    hub_cache=self.hub_cache())
        return path, folder_task(path)
