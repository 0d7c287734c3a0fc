"""Prompt segmentation at KV-block boundaries (omlx.engine.engine.split_segments)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from omlx.engine.engine import split_segments


def lens(segments: list[list[int]]) -> list[int]:
    return [len(s) for s in segments]


def test_cold_prompt_is_cut_at_every_block_boundary() -> None:
    assert lens(split_segments(list(range(600)), 0, 256)) == [256, 256, 88]


def test_block_aligned_hit_keeps_block_boundaries() -> None:
    assert lens(split_segments(list(range(836)), 512, 256)) == [256, 68]


def test_short_piece_after_a_tail_hit_joins_the_next_segment() -> None:
    # 725 cached (2 blocks + a 213-token tail): 43 tokens to the boundary, then 68.
    assert lens(split_segments(list(range(836)), 725, 256)) == [111]
    # a long piece to the boundary keeps its own pass; later boundaries stay
    assert lens(split_segments(list(range(1211)), 779, 256)) == [245, 187]
    assert lens(split_segments(list(range(1600)), 1469, 256)) == [131]
    assert lens(split_segments(list(range(1300)), 725, 256)) == [299, 256, 20]


@given(st.integers(1, 2000), st.integers(0, 1999), st.sampled_from([4, 16, 256]))
def test_segments_concatenate_to_the_rest_and_end_at_boundaries(n: int, start: int, bs: int) -> None:
    start = min(start, n - 1)
    tokens = list(range(n))
    segments = split_segments(tokens, start, bs)
    assert [t for s in segments for t in s] == tokens[start:]
    assert all(segments)
    pos = start
    for s in segments[:-1]:
        pos += len(s)
        assert pos % bs == 0  # every cut but the end of the prompt is a block boundary
