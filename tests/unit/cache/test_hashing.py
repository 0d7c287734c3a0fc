"""Block keys: the DESIGN.md formula, determinism across processes, namespace isolation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from omlx.cache.hashing import (
    EXTRA_SEPARATOR,
    FORMAT_VERSION,
    MAX_TOKEN_ID,
    Namespace,
    block_hashes,
    hash_block,
    make_kv_format,
    model_fingerprint,
    tokenizer_hash,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
KV_FORMAT = make_kv_format("bfloat16", None, None, "KVCache")
NS = Namespace("f" * 64, "a" * 64, KV_FORMAT, 0, 28)

# Pinned: SSD blocks written by earlier builds are named by these keys. A change here orphans
# every cold block, so it must come with a FORMAT_VERSION bump.
GOLDEN_NAMESPACE_KEY = "44546213d436b79b3c46da6e44ac305a15bb5a87f82f466fd9418b8f3e9e93e5"
GOLDEN_BLOCK_HASHES = [
    "032050c1a41ccf4fca8a1efaaaec190a0eedb06e3316519dd6ebd3deacf87e75",
    "2cad7fe292695edbc94b7fee61f7b68b2c6a9645a53ab62deaa98e42703af027",
]
GOLDEN_MODEL_FINGERPRINT = "70156f749bf85d23a5512ecea23e72ad4223e0d0346ff9433a167d3c92b6f47b"
GOLDEN_TOKENIZER_HASH = "ed35361414314bfa14549de06ec03b19976bd0599275579ea02cc4cbcade97d4"


def _golden_values() -> dict[str, object]:
    return {
        "namespace_key": NS.key().hex(),
        "block_hashes": [h.hex() for h in block_hashes(NS, list(range(8)), 4)],
        "model_fingerprint": model_fingerprint(
            {"model_type": "llama", "hidden_size": 64}, None, ["AB" * 32], None
        ),
        "tokenizer_hash": tokenizer_hash(b"{}", "T"),
    }


def test_golden_values_are_stable() -> None:
    assert _golden_values() == {
        "namespace_key": GOLDEN_NAMESPACE_KEY,
        "block_hashes": GOLDEN_BLOCK_HASHES,
        "model_fingerprint": GOLDEN_MODEL_FINGERPRINT,
        "tokenizer_hash": GOLDEN_TOKENIZER_HASH,
    }


_SUBPROCESS_SCRIPT = """
import json
from omlx.cache.hashing import Namespace, block_hashes, make_kv_format, model_fingerprint
from omlx.cache.hashing import tokenizer_hash
ns = Namespace("f" * 64, "a" * 64, make_kv_format("bfloat16", None, None, "KVCache"), 0, 28)
print(json.dumps({
    "namespace_key": ns.key().hex(),
    "block_hashes": [h.hex() for h in block_hashes(ns, list(range(8)), 4)],
    "model_fingerprint": model_fingerprint(
        {"model_type": "llama", "hidden_size": 64}, None, ["AB" * 32], None
    ),
    "tokenizer_hash": tokenizer_hash(b"{}", "T"),
}))
"""


@pytest.mark.parametrize("seeds", [("0", "12345"), ("1", "random")])
def test_same_keys_in_processes_with_different_hash_seeds(seeds: tuple[str, str]) -> None:
    outputs = []
    for seed in seeds:
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_SCRIPT],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == _golden_values()


def test_hash_block_is_the_design_formula() -> None:
    tokens = [1, 2, 70000, MAX_TOKEN_ID]
    expected0 = hashlib.sha256(NS.key() + struct.pack("<4I", *tokens)).digest()
    assert hash_block(None, tokens, namespace=NS) == expected0
    assert hash_block(NS.key(), tokens) == expected0
    expected1 = hashlib.sha256(expected0 + struct.pack("<2I", 5, 6)).digest()
    assert hash_block(expected0, (5, 6)) == expected1
    # namespace is only the seed of block 0; a given parent already carries it
    other = dataclasses.replace(NS, layer_end=27)
    assert hash_block(expected0, (5, 6), namespace=other) == expected1


def test_extra_keys_are_separated_from_token_ids() -> None:
    parent = NS.key()
    with_extra = hash_block(parent, [1], struct.pack("<I", 2))
    assert (
        with_extra
        == hashlib.sha256(
            parent + struct.pack("<I", 1) + EXTRA_SEPARATOR + struct.pack("<I", 2)
        ).digest()
    )
    assert with_extra != hash_block(parent, [1, 2])
    assert hash_block(parent, [1], b"img-a") != hash_block(parent, [1], b"img-b")
    assert hash_block(parent, [1], b"") == hash_block(parent, [1])


def test_block_hashes_chain_full_blocks_only() -> None:
    tokens = list(range(11))
    keys = block_hashes(NS, tokens, 4)
    assert len(keys) == 2
    assert keys[0] == hash_block(None, tokens[0:4], namespace=NS)
    assert keys[1] == hash_block(keys[0], tokens[4:8])
    assert block_hashes(NS, tokens[:3], 4) == []
    assert block_hashes(NS, tokens[:8], 4) == keys
    assert block_hashes(NS, tokens, 1) == block_hashes(NS, tuple(tokens), 1)
    assert [k.hex() for k in block_hashes(NS, list(range(8)), 4)] == GOLDEN_BLOCK_HASHES


def test_same_tokens_different_position_differ() -> None:
    keys = block_hashes(NS, [7, 7, 7, 7, 7, 7, 7, 7], 4)
    assert keys[0] != keys[1]


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "e" * 64},
        {"tokenizer_hash": "b" * 64},
        {"kv_format": make_kv_format("bfloat16", 8, 64, "QuantizedKVCache")},
        {"kv_format": make_kv_format("float16", None, None, "KVCache")},
        {"layer_start": 1},
        {"layer_end": 14},
        {"format_version": FORMAT_VERSION + 1},
        {"block_size": 16},
    ],
)
def test_different_namespace_never_matches(change: dict[str, object]) -> None:
    other = dataclasses.replace(NS, **change)  # type: ignore[arg-type]
    assert other != NS
    assert other.key() != NS.key()
    assert other.digest() != NS.digest()
    tokens = list(range(8))
    assert set(block_hashes(other, tokens, 4)).isdisjoint(block_hashes(NS, tokens, 4))


def test_namespace_key_digest_and_json_round_trip() -> None:
    assert NS.key().hex() == GOLDEN_NAMESPACE_KEY
    assert NS.key() == hashlib.sha256(NS.to_json().encode()).digest()
    assert NS.digest() == GOLDEN_NAMESPACE_KEY[:32]
    assert json.loads(NS.to_json())["layer_end"] == 28
    assert Namespace.from_json(NS.to_json()) == NS
    assert Namespace.from_json(NS.to_json()).key() == NS.key()
    assert hash(Namespace.from_json(NS.to_json())) == hash(NS)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model_fingerprint": ""},
        {"kv_format": ""},
        {"layer_start": -1},
        {"layer_start": 4, "layer_end": 4},
        {"format_version": 0},
        {"layer_end": 2.0},
    ],
)
def test_namespace_rejects_wrong_fields(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "model_fingerprint": "m",
        "tokenizer_hash": "t",
        "kv_format": "k",
        "layer_start": 0,
        "layer_end": 4,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError):
        Namespace(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["[]", "{}", "not json", '{"kv_format": "k"}'])
def test_namespace_from_json_rejects_other_documents(text: str) -> None:
    with pytest.raises(ValueError):
        Namespace.from_json(text)


@pytest.mark.parametrize(
    ("parent", "tokens", "namespace"),
    [
        (None, [1], None),
        (b"short", [1], None),
        (None, [], NS),
        (None, [-1], NS),
        (None, [MAX_TOKEN_ID + 1], NS),
        (None, [2**40], NS),
        (None, [1.5], NS),
    ],
)
def test_hash_block_rejects_wrong_calls(
    parent: bytes | None, tokens: list[int], namespace: Namespace | None
) -> None:
    with pytest.raises(ValueError):
        hash_block(parent, tokens, namespace=namespace)


def test_block_hashes_rejects_zero_block_size() -> None:
    with pytest.raises(ValueError):
        block_hashes(NS, [1, 2], 0)


def test_model_fingerprint_ignores_paths_and_order() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "text_config": {"vocab_size": 10}}
    base = model_fingerprint(config, None, ["ab" * 32, "cd" * 32], None)
    moved = {
        "_name_or_path": "/Users/me/models/llama",
        "text_config": {"vocab_size": 10, "_name_or_path": "/tmp/x"},
        "hidden_size": 64,
        "model_type": "llama",
    }
    assert model_fingerprint(moved, None, ["CD" * 32, "AB" * 32], None) == base
    assert len(base) == 64


def test_model_fingerprint_changes_with_weights_layout_and_quantization() -> None:
    config = {"model_type": "llama", "hidden_size": 64}
    index = {"weight_map": {"a.weight": "model-00001.safetensors"}}
    base = model_fingerprint(config, index, ["ab" * 32], None)
    variants = [
        model_fingerprint({**config, "hidden_size": 65}, index, ["ab" * 32], None),
        model_fingerprint(config, None, ["ab" * 32], None),
        model_fingerprint(config, index, ["ac" * 32], None),
        model_fingerprint(config, index, None, None),
        model_fingerprint(config, index, [], None),
        model_fingerprint(config, index, ["ab" * 32], {"bits": 4, "group_size": 64}),
    ]
    assert len({base, *variants}) == len(variants) + 1


@pytest.mark.parametrize("shas", [["not-hex"], [""]])
def test_model_fingerprint_rejects_non_hex_shas(shas: list[str]) -> None:
    with pytest.raises(ValueError):
        model_fingerprint({}, None, shas, None)


def test_model_fingerprint_rejects_non_json_config() -> None:
    with pytest.raises(ValueError):
        model_fingerprint({"x": object()}, None, None, None)


def test_tokenizer_hash_covers_tokenizer_and_template() -> None:
    base = tokenizer_hash(b'{"model": 1}', "{{ messages }}")
    others = {
        tokenizer_hash(b'{"model": 2}', "{{ messages }}"),
        tokenizer_hash(b'{"model": 1}', "{{ messages }}!"),
        tokenizer_hash(b'{"model": 1}', None),
        tokenizer_hash(b'{"model": 1}', ""),
        # bytes moved from the tokenizer into the template must not collide
        tokenizer_hash(b'{"model": ', "1}{{ messages }}"),
    }
    assert base not in others
    assert len(others) == 5


def test_tokenizer_hash_rejects_a_path() -> None:
    with pytest.raises(ValueError):
        tokenizer_hash("/path/to/tokenizer.json", None)  # type: ignore[arg-type]


def test_make_kv_format() -> None:
    assert make_kv_format("bfloat16", 8, 64, "QuantizedKVCache") == (
        "dtype=bfloat16;kv_bits=8;group_size=64;cache=QuantizedKVCache"
    )
    with pytest.raises(ValueError):
        make_kv_format("a;b", None, None, "KVCache")
    with pytest.raises(ValueError):
        make_kv_format("bfloat16", None, None, "")


def test_block_hashes_extends_incrementally_to_the_same_chain_as_block_hashes():
    from omlx.cache.hashing import BlockHashes

    ns = Namespace("m" * 8, "t" * 8, "kv", 0, 2)
    tokens = list(range(3, 3 + 4 * 5 + 2))
    chain = BlockHashes(ns.key(), 4)
    assert chain.extend(tokens, 3) == 0 and chain.hashes == []
    assert chain.extend(tokens, 9) == 2
    assert chain.extend(tokens[:9]) == 0  # nothing new: blocks are never hashed twice
    assert chain.extend(tokens) == 3 and len(chain) == 5 and chain.num_tokens == 20
    assert chain.hashes == block_hashes(ns, tokens, 4)
    assert chain.parent_of(0) == ns.key() and chain.parent_of(3) == chain.hashes[2]
    with pytest.raises(ValueError):
        BlockHashes(ns.key(), 0)


def test_the_block_size_is_part_of_the_namespace():
    a = Namespace("m", "t", "float16|-|-|KVCache", 0, 4)
    b = dataclasses.replace(a, block_size=16)
    assert a.block_size == 256 and a.key() != b.key() and a.digest() != b.digest()
    assert Namespace.from_json(b.to_json()) == b
    old = json.loads(a.to_json())
    del old["block_size"]  # a namespace file written before the block size was in it
    with pytest.raises(ValueError):
        Namespace.from_json(json.dumps(old))
    with pytest.raises(ValueError):
        dataclasses.replace(a, block_size=0)
