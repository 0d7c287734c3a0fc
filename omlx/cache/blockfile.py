"""The cold tier's file format: one KV block as one safetensors file, written crash-safely.

This module owns the bytes of a block file and nothing else: encoding, strict decoding and
validation, the atomic write (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder) and the naming of files and temp files. It uses numpy and safetensors only; it
must not import mlx, keep an index or decide anything about budgets (``omlx.cache.ssd``).

Format (safetensors, https://huggingface.co/docs/safetensors/index#format): named tensors.
The common one is ``kv`` of shape ``(num_layers, 2, n_kv_heads, num_tokens, head_dim)``,
block-major: the namespace's attention layers in order, keys at ``kv[l, 0]`` and values at
``kv[l, 1]``, in the KV dtype (``BF16`` is stored as itself; numpy, which has no bfloat16, sees
its bits as uint16). Cache layouts with other kinds of layers (``omlx.engine.cache_spec``)
add or replace tensors: ``win``, the same of the sliding-window layers (a block's *window
part*; absent from a file written after the hot tier dropped it), ``k.{layer}`` / ``v.{layer}`` ``(heads, num_tokens, dim)`` when keys
and values differ in shape (MLA), ``X.q`` (``U32``, packed), ``X.scales`` and ``X.biases`` in
place of a tensor ``X`` of a quantized KV cache (``--kv-bits``), and ``state.{layer}.{i}`` (a recurrent layer's state at the
block's end; any shape). Every tensor without the ``state.`` prefix has the token axis second
to last. The header is written here (JSON, padded with spaces to a multiple of 8
bytes, as the spec allows) and the tensor bytes straight from the host buffers, so a write holds
the GIL only for the small header: CRC-32, ``write`` and ``fsync`` release it. Any safetensors
reader (``safetensors.safe_open``) reads the file. String metadata:

    format          "omlx.kv_block"
    format_version  SSD_FORMAT_VERSION
    namespace       Namespace.to_json() (model, tokenizer, KV format and cache layout, layer range, key version)
    block_hash      hex of the chained block key (also the file name)
    parent_hash     hex of the previous block's key (the namespace key for block 0)
    token_ids       JSON list of the block's token ids
    num_tokens      len(token_ids)
    layer_start, layer_end, dtype (the KV dtype)
    dtypes          JSON object, tensor name -> dtype name (absent in files with ``kv`` only: dtype)
    layout          "layer,kv,head,token,dim" (the axes of ``kv``)
    checksum        "crc32:" + 8 hex digits: CRC-32 (zlib, ISO-HDLC) over the tensor bytes in file order

Versions: 1 had per-layer tensors ``layer.{i}.keys|values`` and a sha256 checksum; 2 the same
tensors with CRC-32; 3 the single block-major tensor (plus, for non-plain cache layouts, the named
tensors above: their namespaces are new, so no older reader meets them); 4 moves sliding-window
layers out of ``kv`` into ``win`` (a version-3 file of such a model would be misread: its ``kv``
holds every layer). Files of any other version are deleted when met (counted, and summed up in
one warning at start), never read; the one-time cost is a prefill of their prompts again.

A block stores only its own tokens, never its prefix: bytes on disk grow linearly with unique
tokens. A *tail* (``1 .. block_size - 1`` tokens after the last full block of a sequence) is a
file of the same format with fewer tokens; its hash chains from its parent like a block's.

The checksum guards against torn or flipped bytes (a disk or filesystem fault), not against
an adversary: the block's identity is already the sha256 chain over its tokens.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omlx.cache.hashing import HASH_NUM_BYTES, Namespace, hash_block
from omlx.errors import OmlxError

__all__ = [
    "BLOCK_SUFFIX",
    "DTYPES",
    "PACKED_DTYPE",
    "SSD_FORMAT_VERSION",
    "TMP_SUFFIX",
    "BadBlockError",
    "BlockHeader",
    "EncodedBlock",
    "OldFormatError",
    "HostBlock",
    "block_path",
    "check_metadata",
    "decode_block",
    "encode_block",
    "encode_block_parts",
    "iter_block_files",
    "parse_header",
    "read_header",
    "remove_stale_temp",
    "write_file_atomic",
]

SSD_FORMAT_VERSION = 4
"""Version of the block file layout; files of any other version are deleted when met."""

FORMAT_NAME = "omlx.kv_block"
LAYOUT = "layer,kv,head,token,dim"
TENSOR_NAME = "kv"
STATE_PREFIX = "state."
BLOCK_SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
_MAX_HEADER_BYTES = 16 * 1024 * 1024

# KV dtype name (as mlx prints it) -> (safetensors dtype code, numpy storage dtype).
DTYPES: dict[str, tuple[str, type[np.generic]]] = {
    "float32": ("F32", np.float32),
    "float16": ("F16", np.float16),
    "bfloat16": ("BF16", np.uint16),
    "uint32": ("U32", np.uint32),  # quantized KV's packed values (``*.q`` tensors)
}
PACKED_DTYPE = "uint32"


class BadBlockError(OmlxError, ValueError):
    """A block file is unreadable, inconsistent, or not the block that was asked for."""


class OldFormatError(BadBlockError):
    """A block file written by another format version (deleted like any bad file, counted apart).

    Attributes:
        version: the file's ``format_version`` metadata (as written; may be None).
    """

    def __init__(self, version: str | None) -> None:
        super().__init__(f"format version {version!r}, this omlx reads {SSD_FORMAT_VERSION}")
        self.version = version


class HostBlock:
    """One block's tensors in host memory (numpy).

    Per-token tensors have the token axis second to last: ``kv`` (the common case) is
    C-contiguous ``(num_layers, 2, n_kv_heads, num_tokens, head_dim)``, keys at ``kv[:, 0]``
    and values at ``kv[:, 1]``; layouts whose layers differ (``omlx.engine.cache_spec``) use
    ``k.{layer}`` / ``v.{layer}`` of ``(heads, num_tokens, dim)``. Tensors named
    ``state.{layer}.{i}`` are a recurrent layer's state snapshot at the block's end (no token
    axis). ``"bfloat16"`` arrays are uint16 bit patterns.

    Args:
        dtype: the KV dtype name (a key of :data:`DTYPES`), of ``kv``.
        kv: the ``kv`` tensor, or None when ``tensors`` holds everything.
        tensors: more tensors, name -> (dtype name, array).
    """

    __slots__ = ("tensors",)

    def __init__(self, dtype: str | None = None, kv: np.ndarray | None = None,
                 tensors: dict[str, tuple[str, np.ndarray]] | None = None):
        self.tensors: dict[str, tuple[str, np.ndarray]] = {}
        if kv is not None:
            self.tensors[TENSOR_NAME] = (dtype or "float32", kv)
        if tensors:
            self.tensors.update(tensors)

    @classmethod
    def from_layers(cls, dtype: str, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> HostBlock:
        """Stack per-layer ``(keys, values)``, each ``(1, n_kv_heads, num_tokens, head_dim)``
        (tests and tools; copies)."""
        return cls(dtype, np.ascontiguousarray(np.stack([np.stack([k[0], v[0]]) for k, v in layers])))

    @property
    def dtype(self) -> str:
        """The KV dtype (of the first per-token tensor that is not packed quantized values)."""
        for name, (dtype, _) in self.tensors.items():
            if not name.startswith(STATE_PREFIX) and dtype != PACKED_DTYPE:
                return dtype
        return next(iter(self.tensors.values()))[0]

    @property
    def kv(self) -> np.ndarray:
        return self.tensors[TENSOR_NAME][1]

    @property
    def layers(self) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """Per-layer ``(keys, values)`` views of ``kv``, each ``(1, n_kv_heads, num_tokens, head_dim)``."""
        return tuple((self.kv[i, 0][None], self.kv[i, 1][None]) for i in range(self.kv.shape[0]))

    @property
    def num_bytes(self) -> int:
        """Bytes of all tensors."""
        return int(sum(a.nbytes for _, a in self.tensors.values()))

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the block (the per-token tensors' second-to-last axis)."""
        for name, (_, a) in self.tensors.items():
            if not name.startswith(STATE_PREFIX):
                return int(a.shape[-2])
        return 0


def block_path(root: Path, namespace: Namespace, block_hash: bytes) -> Path:
    """Where a block's file lives: ``<root>/<namespace digest>/<hh>/<hash hex>.safetensors``."""
    h = block_hash.hex()
    return root / namespace.digest() / h[:2] / f"{h}{BLOCK_SUFFIX}"


@dataclass(slots=True)
class EncodedBlock:
    """A block file as two buffers: the header and the tensor bytes (a view of the host array).

    Attributes:
        block_hash: the block's key (the file's name).
        header: the 8-byte header length and the JSON header.
        data: the tensor bytes, not copied (valid while the host array is).
    """

    block_hash: bytes
    header: bytes
    data: memoryview
    more: tuple[memoryview, ...] = ()

    @property
    def buffers(self) -> tuple[memoryview, ...]:
        """The tensor bytes in file order (``data``, then ``more``)."""
        return (self.data, *self.more)

    @property
    def num_bytes(self) -> int:
        """Size of the file in bytes."""
        return len(self.header) + sum(b.nbytes for b in self.buffers)

    def to_bytes(self) -> bytes:
        """The whole file in one bytes object (copies; tests and tools)."""
        return self.header + b"".join(b.tobytes() for b in self.buffers)


def encode_block_parts(
    namespace: Namespace,
    parent_hash: bytes,
    token_ids: Sequence[int],
    host: HostBlock,
    *,
    block_hash: bytes | None = None,
) -> EncodedBlock:
    """Build one block's file without copying its tensor bytes (see the module docstring).

    Holds the GIL only to build the small header; the CRC-32 over the tensor releases it.

    Args:
        namespace: the block's namespace (its layer range is the tensor's first axis).
        parent_hash: key of the previous block, or ``namespace.key()`` for block 0.
        token_ids: the block's token ids.
        host: its KV, ``(num_layers, 2, heads, len(token_ids), head_dim)``.
        block_hash: its key when the caller already computed it (``hash_block(parent_hash,
            token_ids)``, e.g. the request's ``BlockHashes``); not re-checked.

    Raises:
        ValueError: a layer count, dtype, shape or token count that does not match.
    """
    tokens = [int(t) for t in token_ids]
    if block_hash is None:
        block_hash = hash_block(parent_hash, tokens)
    if not host.tensors:
        raise ValueError("a block needs at least one tensor")
    num_layers = namespace.layer_end - namespace.layer_start
    entries: dict[str, dict] = {}
    buffers: list[memoryview] = []
    checksum, offset = 0, 0
    for name in sorted(host.tensors):
        dtype, a = host.tensors[name]
        if dtype not in DTYPES:
            raise ValueError(f"{name}: unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        code, storage = DTYPES[dtype]
        if a.dtype != storage:
            raise ValueError(f"{name}: got {a.dtype}, expected {np.dtype(storage)} for {dtype}")
        if name == TENSOR_NAME and (a.ndim != 5 or a.shape[0] > num_layers or a.shape[1] != 2
                                    or a.shape[3] != len(tokens)):
            raise ValueError(f"kv: got {a.dtype}{a.shape}, expected (at most {num_layers} layers, 2, heads, "
                             f"{len(tokens)}, head_dim)")
        if not name.startswith(STATE_PREFIX) and (a.ndim < 2 or a.shape[-2] != len(tokens)):
            raise ValueError(f"{name}: shape {a.shape} does not hold {len(tokens)} tokens on axis -2")
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        data = memoryview(a).cast("B")
        checksum = zlib.crc32(data, checksum)  # releases the GIL (buffers over 5 KiB)
        entries[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        buffers.append(data)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(SSD_FORMAT_VERSION),
        "namespace": namespace.to_json(),
        "block_hash": block_hash.hex(),
        "parent_hash": parent_hash.hex(),
        "token_ids": json.dumps(tokens, separators=(",", ":")),
        "num_tokens": str(len(tokens)),
        "layer_start": str(namespace.layer_start),
        "layer_end": str(namespace.layer_end),
        "dtype": host.dtype,
        "dtypes": json.dumps({n: host.tensors[n][0] for n in sorted(host.tensors)}, separators=(",", ":")),
        "layout": LAYOUT,
        "checksum": _checksum_text(checksum),
    }
    header = {"__metadata__": metadata, **entries}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-(8 + len(text)) % 8)  # the spec's padding: tensor data starts 8-aligned
    return EncodedBlock(block_hash, struct.pack("<Q", len(text)) + text, buffers[0], tuple(buffers[1:]))


def encode_block(
    namespace: Namespace,
    parent_hash: bytes,
    token_ids: Sequence[int],
    host: HostBlock,
    *,
    block_hash: bytes | None = None,
) -> tuple[bytes, bytes]:
    """Serialize one block to safetensors bytes (one copy; the writer uses
    :func:`encode_block_parts`).

    Returns:
        ``(block_hash, file bytes)``.

    Raises:
        ValueError: as :func:`encode_block_parts`.
    """
    enc = encode_block_parts(namespace, parent_hash, token_ids, host, block_hash=block_hash)
    return enc.block_hash, enc.to_bytes()


def _checksum_text(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


@dataclass(slots=True)
class BlockHeader:
    metadata: dict[str, str]
    tensors: dict[str, dict]
    header_len: int
    data_len: int


def parse_header(prefix: bytes, file_size: int) -> BlockHeader:
    """Parse and sanity-check a safetensors header; ``prefix`` holds at least the header."""
    if file_size < 8 or len(prefix) < 8:
        raise BadBlockError(f"file of {file_size} bytes is too short for a header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > _MAX_HEADER_BYTES or 8 + n > file_size or 8 + n > len(prefix):
        raise BadBlockError(f"header length {n} does not fit a file of {file_size} bytes")
    try:
        header = json.loads(prefix[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadBlockError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise BadBlockError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BadBlockError("metadata missing or not all strings")
    data_len = file_size - 8 - n
    end = 0
    spans = []
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise BadBlockError(f"tensor {name}: bad data_offsets")
        spans.append((offsets[0], offsets[1]))
        end = max(end, offsets[1])
    spans.sort()
    pos = 0
    for begin, stop in spans:
        if begin != pos or stop < begin:
            raise BadBlockError("tensor data is not one contiguous, non-overlapping region")
        pos = stop
    if end != data_len:
        raise BadBlockError(f"tensor data is {data_len} bytes, header describes {end} (truncated?)")
    return BlockHeader(meta, header, n, data_len)


def check_metadata(
    meta: dict[str, str],
    namespace: Namespace,
    block_hash: bytes,
    parent_hash: bytes | None,
    token_ids: Sequence[int] | None,
    dtype: str | None,
) -> tuple[bytes, list[int]]:
    """Check a block's metadata against what was asked for; returns (parent, tokens)."""
    if meta.get("format") != FORMAT_NAME:
        raise BadBlockError(f"not an omlx KV block (format {meta.get('format')!r})")
    if meta.get("format_version") != str(SSD_FORMAT_VERSION):
        raise OldFormatError(meta.get("format_version"))
    if meta.get("namespace") != namespace.to_json():
        raise BadBlockError("namespace differs (another model, tokenizer, KV format or layers)")
    if meta.get("block_hash") != block_hash.hex():
        raise BadBlockError("block hash in the metadata differs from the file's name")
    try:
        parent = bytes.fromhex(meta["parent_hash"])
        tokens = json.loads(meta["token_ids"])
        num_tokens = int(meta["num_tokens"])
        layers = (int(meta["layer_start"]), int(meta["layer_end"]))
    except (KeyError, ValueError) as exc:
        raise BadBlockError(f"metadata field missing or malformed: {exc}") from exc
    if len(parent) != HASH_NUM_BYTES:
        raise BadBlockError("parent hash is not 32 bytes")
    if parent_hash is not None and parent != parent_hash:
        raise BadBlockError("parent hash differs from the chain being restored")
    if not isinstance(tokens, list) or len(tokens) != num_tokens or num_tokens < 1:
        raise BadBlockError("token ids do not match num_tokens")
    if token_ids is not None and tokens != list(token_ids):
        raise BadBlockError("token ids differ from the request's")
    # With the expected parent and tokens given, the caller's key is sha256(parent, tokens) by
    # construction (a request's BlockHashes) and both were compared above: no second hash.
    if parent_hash is None or token_ids is None:
        try:
            if hash_block(parent, tokens) != block_hash:
                raise BadBlockError("block hash does not match sha256(parent, token ids)")
        except ValueError as exc:
            raise BadBlockError(f"token ids invalid: {exc}") from exc
    if layers != (namespace.layer_start, namespace.layer_end):
        raise BadBlockError(f"layer range {layers} differs from the namespace's")
    if meta.get("dtype") not in DTYPES or (dtype is not None and meta.get("dtype") != dtype):
        raise BadBlockError(f"dtype {meta.get('dtype')!r}, expected {dtype!r}")
    if meta.get("layout") != LAYOUT:
        raise BadBlockError(f"layout {meta.get('layout')!r}, expected {LAYOUT!r}")
    return parent, tokens


def decode_block(
    data: bytes,
    namespace: Namespace,
    block_hash: bytes,
    *,
    parent_hash: bytes | None = None,
    token_ids: Sequence[int] | None = None,
    dtype: str | None = None,
) -> tuple[HostBlock, bytes, list[int]]:
    """Parse and fully validate one block file's bytes.

    Checks the header, the format version, the namespace, the block hash (against the name,
    and recomputed from parent and tokens), the expected parent, tokens and dtype when given,
    every tensor's name, dtype, shape and extent, and the content checksum.

    Returns:
        ``(host block whose arrays are views into data, parent hash, token ids)``.

    Raises:
        BadBlockError: anything does not match; the file must not be served.
    """
    header = parse_header(data, len(data))
    meta = header.metadata
    parent, tokens = check_metadata(meta, namespace, block_hash, parent_hash, token_ids, dtype)
    try:
        dtypes = json.loads(meta["dtypes"]) if "dtypes" in meta else {TENSOR_NAME: meta["dtype"]}
    except ValueError as exc:
        raise BadBlockError(f"dtypes metadata is not JSON: {exc}") from exc
    if not isinstance(dtypes, dict) or set(dtypes) != set(header.tensors):
        raise BadBlockError(f"tensors {sorted(header.tensors)} do not match the dtypes metadata")
    num_layers = namespace.layer_end - namespace.layer_start
    base = 8 + header.header_len
    view = memoryview(data)
    checksum = 0
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for name, info in sorted(header.tensors.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        dtype = dtypes[name]
        if dtype not in DTYPES:
            raise BadBlockError(f"{name}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        code, storage = DTYPES[dtype]
        shape = info.get("shape")
        if info.get("dtype") != code:
            raise BadBlockError(f"{name}: dtype {info.get('dtype')!r}, expected {code}")
        if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
            raise BadBlockError(f"{name}: shape {shape!r} is not a list of sizes")
        if name == TENSOR_NAME and (len(shape) != 5 or shape[0] > num_layers or shape[1] != 2
                                    or shape[3] != len(tokens)):
            raise BadBlockError(f"kv: shape {shape} does not hold at most {num_layers} layers of {len(tokens)} tokens")
        if not name.startswith(STATE_PREFIX) and (len(shape) < 2 or shape[-2] != len(tokens)):
            raise BadBlockError(f"{name}: shape {shape} does not hold {len(tokens)} tokens")
        begin, end = info["data_offsets"]
        if end - begin != int(np.prod(shape)) * np.dtype(storage).itemsize:
            raise BadBlockError(f"{name}: {end - begin} bytes for shape {shape}")
        chunk = view[base + begin : base + end]
        checksum = zlib.crc32(chunk, checksum)  # releases the GIL: reader threads overlap
        tensors[name] = (dtype, np.frombuffer(chunk, dtype=storage).reshape(shape))
    if meta.get("checksum") != _checksum_text(checksum):
        raise BadBlockError("content checksum mismatch (corrupted tensor data)")
    return HostBlock(tensors=tensors), parent, tokens


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a folder; the rename is still atomic
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes | memoryview, *more: bytes | memoryview) -> None:
    """Write ``data`` (then each of ``more``) to ``path`` so a crash leaves either no file or the
    whole file. ``os.write`` and ``fsync`` release the GIL.

    Temp file in the same folder (named ``.<name>.<pid>.<random>.tmp``), fsync, ``os.replace``,
    fsync of the folder.

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``); no temp file is left behind.
    """
    folder = path.parent
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(folder.parent)
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            for chunk in (data, *more):
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(folder)


def remove_stale_temp(path: Path) -> bool:
    """Delete a temp file whose writer process is gone; True if deleted."""
    parts = path.name.rsplit(".", 3)  # [".<name>", "<pid>", "<random>", "tmp"]
    try:
        pid = int(parts[1])
    except (IndexError, ValueError):
        pid = -1
    if pid > 0 and pid != os.getpid():
        try:
            os.kill(pid, 0)
            return False  # another live process (sharing this cache) may still rename it
        except ProcessLookupError:
            pass
        except PermissionError:
            return False
    elif pid == os.getpid():
        return False
    try:
        path.unlink()
        return True
    except OSError:
        return False


def iter_block_files(ns_dir: Path) -> Iterator[Path]:
    """Block files and temp files of one namespace folder."""
    try:
        subdirs = sorted((d for d in os.scandir(ns_dir) if d.is_dir() and len(d.name) == 2), key=lambda d: d.name)
    except OSError:
        return
    for sub in subdirs:
        try:
            entries = list(os.scandir(sub.path))
        except OSError:
            continue
        for e in entries:
            if e.name.endswith(BLOCK_SUFFIX) or e.name.endswith(TMP_SUFFIX):
                yield Path(e.path)


def read_header(path: Path) -> tuple[BlockHeader, int, float]:
    """Read only the header of a block file; returns (header, file size, mtime)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        first = f.read(8)
        if len(first) < 8:
            raise BadBlockError("file too short")
        (n,) = struct.unpack("<Q", first)
        if n > _MAX_HEADER_BYTES:
            raise BadBlockError(f"header length {n} too large")
        prefix = first + f.read(n)
    return parse_header(prefix, st.st_size), st.st_size, st.st_mtime
