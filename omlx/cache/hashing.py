"""Content keys for KV blocks: namespaces, chained block hashes and model/tokenizer fingerprints.

This module owns every byte that goes into a block key. It is pure Python (no mlx, no numpy)
and never touches the filesystem: callers read config.json, the weight index and tokenizer
files themselves and pass the data in. Keys are sha256 digests, identical across processes,
restarts and machines; Python's ``hash()`` is never used.

Key of block i (DESIGN.md, "Decisions already taken")::

    key(0) = sha256(namespace.key() ‖ tokens(0) ‖ extra(0))
    key(i) = sha256(key(i - 1)      ‖ tokens(i) ‖ extra(i))

where ``tokens`` are the token ids as little-endian uint32 and ``extra`` is optional
caller-defined bytes (e.g. a content hash of an image in the block). Compare vLLM's
``kv_cache_utils.hash_block_tokens``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EXTRA_SEPARATOR",
    "FORMAT_VERSION",
    "HASH_NUM_BYTES",
    "MAX_TOKEN_ID",
    "BlockHashes",
    "Namespace",
    "block_hashes",
    "hash_block",
    "make_kv_format",
    "model_fingerprint",
    "tokenizer_hash",
]

FORMAT_VERSION = 2
"""Version of the key and block layout; bump it to orphan every key computed before."""

HASH_NUM_BYTES = 32
"""Length of every key (sha256 digest), in bytes."""

MAX_TOKEN_ID = 0xFFFF_FFFE
"""Largest token id a key accepts; ``0xFFFFFFFF`` is reserved as :data:`EXTRA_SEPARATOR`."""

EXTRA_SEPARATOR = b"\xff\xff\xff\xff"
"""Written between the token ids and non-empty extra bytes.

Without it ``tokens=[a, b], extra=b""`` and ``tokens=[a], extra=le32(b)`` would hash the
same bytes. Token ids never equal ``0xFFFFFFFF``, so the first aligned separator word marks
the end of the token ids. With ``extra == b""`` the key is exactly the DESIGN.md formula.
"""

_NAMESPACE_DIGEST_HEX_CHARS = 32

# config.json keys that name where a model was loaded from rather than what it is; they differ
# between machines for the same weights and must never enter a fingerprint.
_VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "_commit_hash"})


def _canonical_json(value: object) -> bytes:
    """Serialize ``value`` to one canonical byte string (sorted keys, no spaces, ASCII).

    Raises:
        ValueError: ``value`` holds something JSON cannot represent or a non-string key.
    """
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot canonicalize for hashing: {exc}; pass plain JSON data") from exc
    return text.encode("ascii")


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes two blocks with the same token ids hold different KV.

    Blocks of different namespaces never match. The namespace key seeds block 0 of every
    chain, so it is mixed into every block key.

    Attributes:
        model_fingerprint: :func:`model_fingerprint` of the weights (hex).
        tokenizer_hash: :func:`tokenizer_hash` of the tokenizer and chat template (hex).
        kv_format: KV storage format, e.g. from :func:`make_kv_format` (dtype, kv bits,
            group size, cache class).
        layer_start: First layer whose KV the blocks hold (inclusive).
        layer_end: End of the layer range (exclusive); ``layer_end > layer_start``.
        format_version: :data:`FORMAT_VERSION` of the key and block layout.
        block_size: tokens per full block. It changes no KV value, but every chain key and
            every tail is cut at its multiples, so blocks of two sizes must never meet (a
            server started with another ``--block-size`` over the same SSD folder once read
            a 48-token tail back as a 16-token block and failed to start).
    """

    model_fingerprint: str
    tokenizer_hash: str
    kv_format: str
    layer_start: int
    layer_end: int
    format_version: int = FORMAT_VERSION
    block_size: int = 256
    _key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_fingerprint", "tokenizer_hash", "kv_format"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Namespace.{name} must be a non-empty str, got {value!r}")
        for name in ("layer_start", "layer_end", "format_version", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Namespace.{name} must be an int, got {value!r}")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(
                f"Namespace layer range [{self.layer_start}, {self.layer_end}) is empty or "
                "negative; pass 0 <= layer_start < layer_end (layer_end exclusive)"
            )
        if self.format_version < 1:
            raise ValueError(f"Namespace.format_version must be >= 1, got {self.format_version}")
        if self.block_size < 1:
            raise ValueError(f"Namespace.block_size must be >= 1, got {self.block_size}")
        object.__setattr__(self, "_key", hashlib.sha256(self.to_json().encode("ascii")).digest())

    def to_json(self) -> str:
        """Return the canonical JSON of all fields (sorted keys, no spaces, ASCII).

        This is the text the key is computed from; the SSD tier stores it as block metadata
        and :meth:`from_json` reads it back.
        """
        fields = {
            "block_size": self.block_size,
            "format_version": self.format_version,
            "kv_format": self.kv_format,
            "layer_end": self.layer_end,
            "layer_start": self.layer_start,
            "model_fingerprint": self.model_fingerprint,
            "tokenizer_hash": self.tokenizer_hash,
        }
        return _canonical_json(fields).decode("ascii")

    @classmethod
    def from_json(cls, text: str) -> Namespace:
        """Parse the output of :meth:`to_json`.

        Raises:
            ValueError: ``text`` is not a JSON object with exactly the namespace fields.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"namespace metadata is not JSON: {exc}") from exc
        expected = {
            "block_size",
            "format_version",
            "kv_format",
            "layer_end",
            "layer_start",
            "model_fingerprint",
            "tokenizer_hash",
        }
        if not isinstance(data, dict) or set(data) != expected:
            raise ValueError(f"namespace metadata must hold exactly the keys {sorted(expected)}")
        return cls(**data)

    def key(self) -> bytes:
        """Return the namespace key: sha256 of :meth:`to_json`, 32 bytes. Parent of block 0."""
        return self._key

    def digest(self) -> str:
        """Return a short hex name (32 chars, 128 bits) usable as a folder name."""
        return self._key.hex()[:_NAMESPACE_DIGEST_HEX_CHARS]


def make_kv_format(
    dtype: str, kv_bits: int | None, kv_group_size: int | None, cache_class: str
) -> str:
    """Build the canonical :attr:`Namespace.kv_format` string.

    Args:
        dtype: KV dtype name as mlx prints it, e.g. ``"bfloat16"``.
        kv_bits: Bits per quantized KV element, or ``None`` for an unquantized cache.
        kv_group_size: Quantization group size (elements), or ``None`` when unquantized.
        cache_class: Cache class name, e.g. ``"KVCache"`` or ``"QuantizedKVCache"``.

    Returns:
        e.g. ``"dtype=bfloat16;kv_bits=none;group_size=none;cache=KVCache"``.

    Raises:
        ValueError: An empty name, or a name containing ``;`` or ``=``.
    """
    for name, value in (("dtype", dtype), ("cache_class", cache_class)):
        if not value or ";" in value or "=" in value:
            raise ValueError(f"{name} must be a non-empty name without ';' or '=', got {value!r}")
    bits = "none" if kv_bits is None else str(int(kv_bits))
    group = "none" if kv_group_size is None else str(int(kv_group_size))
    return f"dtype={dtype};kv_bits={bits};group_size={group};cache={cache_class}"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Encode token ids as little-endian uint32.

    Raises:
        ValueError: A token id is not an int in ``[0, MAX_TOKEN_ID]``.
    """
    try:
        # "I" is 4 bytes on every platform CPython supports; checked once below.
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, {MAX_TOKEN_ID}]: {exc}") from exc
    if packed and max(packed) > MAX_TOKEN_ID:
        raise ValueError(f"token id {max(packed)} is reserved; ids must be <= {MAX_TOKEN_ID}")
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


if array("I").itemsize != 4:  # pragma: no cover - no supported platform differs
    raise ImportError("omlx.cache.hashing needs a 4-byte array('I') for uint32 token ids")


def hash_block(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra: bytes = b"",
    *,
    namespace: Namespace | None = None,
) -> bytes:
    """Return the chained key of one block (full or partial).

    ``sha256(parent ‖ le_uint32(token_ids))``, or with non-empty ``extra``
    ``sha256(parent ‖ le_uint32(token_ids) ‖ EXTRA_SEPARATOR ‖ extra)``.

    Args:
        parent: Key of the previous block (32 bytes), or ``None`` for block 0.
        token_ids: The block's token ids, at least one, each in ``[0, MAX_TOKEN_ID]``.
        extra: Extra key bytes for this block (e.g. an image content hash); ``b""`` for none.
        namespace: Seeds block 0 (its key is the parent when ``parent`` is ``None``);
            ignored when ``parent`` is given, since the parent chain already contains it.

    Returns:
        The 32-byte sha256 digest.

    Raises:
        ValueError: ``parent`` and ``namespace`` are both ``None``, ``parent`` is not 32 bytes,
            ``token_ids`` is empty or holds an invalid id.
    """
    if parent is None:
        if namespace is None:
            raise ValueError("block 0 needs its namespace: pass namespace= when parent is None")
        parent = namespace.key()
    elif len(parent) != HASH_NUM_BYTES:
        raise ValueError(f"parent key must be {HASH_NUM_BYTES} bytes, got {len(parent)}")
    if len(token_ids) == 0:
        raise ValueError("a block holds at least one token; got no token ids")
    hasher = hashlib.sha256(parent)
    hasher.update(_token_bytes(token_ids))
    if extra:
        hasher.update(EXTRA_SEPARATOR)
        hasher.update(extra)
    return hasher.digest()


def block_hashes(namespace: Namespace, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Return the chained keys of the full blocks of ``token_ids``.

    Args:
        namespace: Seeds block 0.
        token_ids: A sequence's token ids; the trailing ``len % block_size`` tokens
            (a partial block) get no key.
        block_size: Tokens per block, >= 1.

    Returns:
        ``len(token_ids) // block_size`` keys of 32 bytes, in chain order.

    Raises:
        ValueError: ``block_size < 1`` or a token id is invalid.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    parent = namespace.key()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class BlockHashes:
    """The chained keys of one sequence's full blocks, computed once and extended as tokens arrive.

    A request carries one of these from admission to finish: the prompt's blocks are hashed at
    lookup, and every later caller (registering prefill chunks, filled decode blocks, the store
    at finish, SSD writes) reads the keys from here instead of hashing again. Only full blocks
    get a key; the trailing partial block is hashed when it completes.

    Args:
        parent_key: key of the block before the first one (``namespace.key()`` for block 0).
        block_size: tokens per block, >= 1.

    Attributes:
        hashes: keys of blocks ``0 .. len(hashes) - 1``, 32 bytes each, in chain order.
    """

    __slots__ = ("block_size", "hashes", "parent_key")

    def __init__(self, parent_key: bytes, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if len(parent_key) != HASH_NUM_BYTES:
            raise ValueError(f"parent key must be {HASH_NUM_BYTES} bytes, got {len(parent_key)}")
        self.parent_key = parent_key
        self.block_size = block_size
        self.hashes: list[bytes] = []

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def num_tokens(self) -> int:
        """Tokens covered by the keys (``len(hashes) * block_size``)."""
        return len(self.hashes) * self.block_size

    def parent_of(self, index: int) -> bytes:
        """Key that block ``index`` chains from (``parent_key`` for block 0)."""
        return self.hashes[index - 1] if index > 0 else self.parent_key

    def extend(self, token_ids: Sequence[int], num_tokens: int | None = None) -> int:
        """Hash the full blocks of ``token_ids[:num_tokens]`` that have no key yet.

        Args:
            token_ids: the sequence's tokens from position 0 (the tokens of blocks already
                hashed must be the ones they were hashed with; not re-checked).
            num_tokens: how many leading tokens to consider; ``None`` for all.

        Returns:
            The number of keys added.

        Raises:
            ValueError: a token id is invalid.
        """
        bs = self.block_size
        end = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        num_full = end // bs
        start = len(self.hashes)
        parent = self.hashes[-1] if self.hashes else self.parent_key
        for i in range(start, num_full):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            self.hashes.append(parent)
        return max(0, num_full - start)


def _without_volatile_keys(value: Any) -> Any:
    """Return ``value`` with :data:`_VOLATILE_CONFIG_KEYS` removed from every nested dict."""
    if isinstance(value, Mapping):
        return {
            k: _without_volatile_keys(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_without_volatile_keys(v) for v in value]
    return value


def model_fingerprint(
    config_json: Mapping[str, Any],
    weight_index: Mapping[str, Any] | None,
    weight_shas: Sequence[str] | None,
    quantization: Mapping[str, Any] | None,
) -> str:
    """Fingerprint a model's weights from data the caller read from its folder.

    The fingerprint must change whenever the KV for the same token ids could change. Two
    fine-tunes of one base share config.json and the weight index, so only ``weight_shas``
    tells them apart: pass them whenever you can (an HF cache names each weight blob by its
    sha256, so they cost nothing there). Without them the fingerprint covers config and
    layout only.

    Args:
        config_json: Parsed config.json. ``_name_or_path`` and ``_commit_hash`` (at any
            depth) are dropped: they say where the model came from, not what it is.
        weight_index: Parsed ``model.safetensors.index.json``, or ``None`` (single file).
        weight_shas: sha256 hex of each weight file, any order, or ``None`` if unknown.
        quantization: Quantization applied at load time (e.g. ``{"bits": 4,
            "group_size": 64}``), or ``None``. Quantization already in config.json is
            covered by ``config_json``.

    Returns:
        64 lowercase hex chars (sha256).

    Raises:
        ValueError: An argument holds non-JSON data or a sha is not hex.
    """
    shas: list[str] | None = None
    if weight_shas is not None:
        shas = []
        for sha in weight_shas:
            lowered = sha.lower()
            if not lowered or any(ch not in "0123456789abcdef" for ch in lowered):
                raise ValueError(f"weight sha must be hex, got {sha!r}")
            shas.append(lowered)
        shas.sort()
    document = {
        "config": _without_volatile_keys(config_json),
        "kind": "omlx.model_fingerprint",
        "quantization": quantization,
        "weight_index": weight_index,
        "weight_shas": shas,
    }
    return hashlib.sha256(_canonical_json(document)).hexdigest()


def tokenizer_hash(tokenizer_json_bytes: bytes, chat_template: str | None) -> str:
    """Fingerprint a tokenizer and its chat template.

    Args:
        tokenizer_json_bytes: Raw bytes of tokenizer.json (for a tokenizer without one,
            the bytes of the file that defines its vocabulary, e.g. tokenizer.model).
        chat_template: The chat template text in use, or ``None`` when there is none.

    Returns:
        64 lowercase hex chars (sha256).

    Raises:
        ValueError: ``tokenizer_json_bytes`` is not bytes.
    """
    if not isinstance(tokenizer_json_bytes, (bytes, bytearray, memoryview)):
        raise ValueError("tokenizer_json_bytes must be the file's bytes, not a path or str")
    data = bytes(tokenizer_json_bytes)
    hasher = hashlib.sha256(b"omlx.tokenizer_hash\x00")
    # Length prefixes keep (tokenizer, template) pairs from colliding by shifting bytes.
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)
    if chat_template is None:
        hasher.update(b"\x00")
    else:
        template = chat_template.encode("utf-8")
        hasher.update(b"\x01" + len(template).to_bytes(8, "little"))
        hasher.update(template)
    return hasher.hexdigest()
