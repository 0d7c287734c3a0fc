"""Encoder models (embeddings, cross-encoders): loading, and one engine thread that batches them.

Owns: reading an encoder folder (config.json, *.safetensors, tokenizer.json, sentence-transformers
``modules.json``/``1_Pooling``/``sentence_bert_config.json``), deciding a folder's task
(`detect_task`), and `EncoderEngine`: the thread that owns the model's MLX work, gathers every
sequence waiting (from any number of requests), sorts them by length, runs padded batches and
hands each request its rows. Must not: speak HTTP or shape API JSON (`omlx.api.embeddings`),
or pool/score for an API (`omlx.engine.embeddings`, `omlx.engine.rerank`).

MLX belongs to the engine thread (STYLE.md habit 10); results cross threads as numpy arrays.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from omlx.engine.bert import ENCODER_TYPES, build_encoder
from omlx.errors import EngineError, ModelImportError

logger = logging.getLogger(__name__)

#: Padded tokens (batch x longest) one forward pass may hold; bounds activation memory.
MAX_BATCH_TOKENS = 16384
MAX_BATCH_SIZE = 128


def detect_task(config: dict[str, Any]) -> str:
    """"rerank" for a *ForSequenceClassification encoder, "embeddings" for another encoder, else "chat"."""
    if config.get("model_type") not in ENCODER_TYPES:
        return "chat"
    archs = config.get("architectures") or []
    return "rerank" if any(str(a).endswith("ForSequenceClassification") for a in archs) else "embeddings"


def folder_task(path: Path) -> str:
    """`detect_task` of a model folder's config.json ("chat" when there is none)."""
    try:
        return detect_task(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return "chat"


@dataclass(slots=True)
class LoadedEncoder:
    """An encoder in memory.

    Attributes:
        model_id, path: served id and folder.
        task: "embeddings" or "rerank".
        model: a `BertEncoder` or `ModernBertEncoder`.
        tokenizer: a ``tokenizers.Tokenizer`` with padding and truncation off.
        max_length: most tokens per sequence (special tokens included).
        pooling: "mean", "cls", "max" or "lasttoken" (embeddings).
        normalize: L2-normalize embeddings.
        dim: hidden size (the embedding dimension).
        num_labels: classifier outputs (rerank).
        type_vocab_size: 1 means token types are all 0 (RoBERTa family, ModernBERT).
        num_bytes: bytes of the weights.
    """

    model_id: str
    path: Path
    task: str
    model: Any
    tokenizer: Any
    max_length: int
    pooling: str
    normalize: bool
    dim: int
    num_labels: int
    type_vocab_size: int
    num_bytes: int


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ModelImportError(f"cannot read {path}: {e}") from e


def _pooling(path: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) from a sentence-transformers layout; ("cls", True) without one."""
    modules = _read_json(path / "modules.json")
    if not modules:
        return "cls", True
    pooling, normalize = "cls", False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            cfg = _read_json(path / m.get("path", "1_Pooling") / "config.json") or {}
            for mode, key in (("mean", "pooling_mode_mean_tokens"), ("max", "pooling_mode_max_tokens"),
                              ("lasttoken", "pooling_mode_lasttoken"), ("cls", "pooling_mode_cls_token")):
                if cfg.get(key):
                    pooling = mode
                    break
        elif kind.endswith("Normalize"):
            normalize = True
    return pooling, normalize


def load_encoder(model_id: str, path: Path, task: str) -> LoadedEncoder:
    """Load an encoder folder for ``task`` ("embeddings" or "rerank").

    Raises:
        ModelImportError: missing files, an unsupported architecture or mismatched weights.
    """
    from tokenizers import Tokenizer

    config = _read_json(path / "config.json")
    if not isinstance(config, dict):
        raise ModelImportError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelImportError(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ModelImportError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    try:
        model = build_encoder(config, weights, classifier=task == "rerank")
    except ValueError as e:
        raise ModelImportError(f"cannot load {model_id} from {path} as a {task} model: {e}") from e
    num_bytes = sum(w.nbytes for w in weights.values())
    del weights
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    limit = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        limit -= int(config.get("pad_token_id", 1)) + 1  # positions start after the padding index
    st = _read_json(path / "sentence_bert_config.json") or {}
    if st.get("max_seq_length"):
        limit = min(limit, int(st["max_seq_length"]))
    pooling, normalize = _pooling(path)
    labels = config.get("id2label")
    return LoadedEncoder(
        model_id=model_id, path=path, task=task, model=model, tokenizer=tok, max_length=limit,
        pooling=pooling, normalize=normalize, dim=int(config["hidden_size"]),
        num_labels=int(config.get("num_labels") or (len(labels) if labels else 1)),
        type_vocab_size=int(config.get("type_vocab_size", 1 if config.get("model_type") == "modernbert" else 2)),
        num_bytes=num_bytes,
    )


@dataclass(slots=True)
class Sequence:
    """One tokenized input: ids and token types, special tokens included."""

    ids: list[int]
    type_ids: list[int]


@dataclass(slots=True)
class _Job:
    sequences: list[Sequence]
    future: Future
    arrival_s: float = field(default_factory=time.monotonic)


class EncoderEngine:
    """Runs an encoder on its own thread, batching every waiting sequence together.

    ``submit`` returns a Future of a float32 numpy array, one row per sequence in order:
    (N, dim) pooled embeddings for "embeddings", (N, num_labels) logits for "rerank". Padding
    never changes a row: attention ignores padded keys and pooling ignores padded positions.
    """

    def __init__(self, loaded: LoadedEncoder):
        self.loaded = loaded
        self.model_id = loaded.model_id
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_pending = 0
        self._lock = threading.Lock()
        self.num_sequences = 0
        self.num_batches = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"encoder-{self.model_id}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; jobs still queued fail with an EngineError."""
        self._stopping = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet answered."""
        return self._num_pending

    def submit(self, sequences: list[Sequence]) -> Future:
        """Queue sequences for one request. Raises EngineError when the engine is stopped."""
        if not self.alive:
            raise EngineError(f"encoder {self.model_id} is not running")
        fut: Future = Future()
        with self._lock:
            self._num_pending += 1
        fut.add_done_callback(self._done)
        self._queue.put(_Job(sequences, fut))
        return fut

    def run(self, sequences: list[Sequence], timeout_s: float = 300.0) -> np.ndarray:
        """``submit`` and wait (tests and non-async callers)."""
        return self.submit(sequences).result(timeout_s)

    def _done(self, _: Future) -> None:
        with self._lock:
            self._num_pending -= 1

    # ---- engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            jobs = [] if job is None else [job]
            while True:  # everything already waiting joins this round
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is not None:
                    jobs.append(more)
            if self._stopping:
                for j in jobs:
                    j.future.set_exception(EngineError(f"encoder {self.model_id} was unloaded before it ran this request"))
                return
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
            if jobs:
                self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        flat = [(ji, si, s) for ji, j in enumerate(jobs) for si, s in enumerate(j.sequences)]
        width = self.loaded.dim if self.loaded.task == "embeddings" else self.loaded.num_labels
        outs = [np.zeros((len(j.sequences), width), np.float32) for j in jobs]
        try:
            order = sorted(range(len(flat)), key=lambda i: len(flat[i][2].ids))
            for batch in _batches(order, [len(f[2].ids) for f in flat]):
                rows = self._forward([flat[i][2] for i in batch])
                for r, i in zip(rows, batch):
                    ji, si, _ = flat[i]
                    outs[ji][si] = r
                self.num_batches += 1
            self.num_sequences += len(flat)
        except Exception as e:  # a failing batch fails this round's requests, never the thread
            logger.exception("encoder %s failed on a batch of %d sequences", self.model_id, len(flat))
            for j in jobs:
                j.future.set_exception(EngineError(f"{self.loaded.task} failed: {type(e).__name__}: {e}"))
            return
        for j, out in zip(jobs, outs):
            j.future.set_result(out)

    def _forward(self, seqs: list[Sequence]) -> np.ndarray:
        L = max(len(s.ids) for s in seqs)
        ids = np.zeros((len(seqs), L), np.int32)
        types = np.zeros((len(seqs), L), np.int32)
        mask = np.zeros((len(seqs), L), np.int32)
        pad = int(getattr(self.loaded.model.args, "pad_token_id", 0))
        ids[:] = pad
        for i, s in enumerate(seqs):
            ids[i, : len(s.ids)] = s.ids
            if self.loaded.type_vocab_size > 1:
                types[i, : len(s.ids)] = s.type_ids
            mask[i, : len(s.ids)] = 1
        m = mx.array(mask)
        hidden = self.loaded.model(mx.array(ids), mx.array(types), m)
        if self.loaded.task == "rerank":
            out = self.loaded.model.classify(hidden, m)
        else:
            out = pool_hidden(hidden, m, self.loaded.pooling)
            if self.loaded.normalize:
                out = out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        out = out.astype(mx.float32)
        mx.eval(out)
        return np.array(out)


def pool_hidden(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """(B, L, D) hidden states -> (B, D) by ``mode`` over real tokens (sentence-transformers Pooling)."""
    if mode == "cls":
        return hidden[:, 0]
    m = mask[..., None].astype(hidden.dtype)
    if mode == "mean":
        return (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1.0)
    if mode == "max":
        return mx.where(m > 0, hidden, mx.array(-1e9, hidden.dtype)).max(axis=1)
    if mode == "lasttoken":
        last = mask.sum(axis=1) - 1  # (B,)
        return mx.take_along_axis(hidden, last[:, None, None].astype(mx.int32), axis=1)[:, 0]
    raise ValueError(f"unknown pooling {mode!r}")


def _batches(order: list[int], lengths: list[int]) -> list[list[int]]:
    """Split length-sorted indices into batches of at most MAX_BATCH_SIZE rows and MAX_BATCH_TOKENS padded tokens."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[i]  # sorted ascending: the newest is the longest
        if cur and (len(cur) + 1 > MAX_BATCH_SIZE or (len(cur) + 1) * longest > MAX_BATCH_TOKENS):
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out
