"""Stop strings and UTF-8 handling of the engine's output state, with a real byte-level tokenizer."""

from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from omlx.engine.output import OutputState, _held_suffix_len
from tests.helpers import default_model_dir


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(Path(default_model_dir()))


def _run(tok, text: str, stops: tuple[str, ...]) -> tuple[list[str], str | None]:
    st = OutputState(tok.detokenizer, stops)
    out = [st.add(t, None) for t in tok.encode(text, add_special_tokens=False)]
    if st.matched_stop is None:
        out.append(st.finish())
    return [o for o in out if o], st.matched_stop


def test_held_suffix():
    assert _held_suffix_len("hello wor", ("world",)) == 3
    assert _held_suffix_len("hello", ("xyz",)) == 0


def test_stop_string_across_tokens_is_cut_and_never_leaked(tok):
    pieces, stop = _run(tok, "The capital of France is Paris, a city.", ("Paris",))
    assert "".join(pieces) == "The capital of France is "
    assert stop == "Paris"
    assert not any("Par" in p for p in pieces)


def test_no_stop_returns_everything(tok):
    text = "Caching 日本語 and emoji 🚀 work."
    pieces, stop = _run(tok, text, ())
    assert "".join(pieces) == text and stop is None
    assert all("\ufffd" not in p for p in pieces)


def test_earliest_stop_wins(tok):
    pieces, stop = _run(tok, "one two three four", ("four", "two"))
    assert "".join(pieces) == "one " and stop == "two"
