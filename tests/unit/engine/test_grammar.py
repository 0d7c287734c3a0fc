"""Constrained decoding (`omlx.engine.grammar`) in the step loop, on a tiny random llama with the
default model's real tokenizer: constrained rows follow their grammar, unconstrained rows beside
them keep mlx-lm's exact greedy tokens, and the matcher's bookkeeping (rewind, start_after) holds.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from omlx.engine.grammar import Grammars, mask_logits
from omlx.engine.runner import BatchRunner
from omlx.errors import InvalidRequestError
from omlx.request import Constraint
from tests.unit.engine.test_runner import VOCAB, prompts, reference

SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, VOCAB)


def test_constrained_rows_follow_their_grammar_and_the_others_stay_exact(model, tokenizer, grammars):
    eos = frozenset(tokenizer.eos_token_ids)
    runner = BatchRunner(model, stop_tokens=[(t,) for t in eos], grammars=grammars)
    free = prompts([40, 75, 12], seed=5)
    tied = prompts([30, 55], seed=6)
    c = grammars.json_schema(SMALL, label="small", param="p")
    uids = runner.insert_segments([[p] for p in free + tied], max_tokens=[24] * 5,
                                  grammars=[None] * 3 + [grammars.matcher(c) for _ in tied])
    got: dict[int, list[int]] = {u: [] for u in uids}
    reasons: dict[int, str] = {}
    while len(runner):
        for r in runner.next()[1]:
            got[r.uid].append(r.token)
            if r.finish_reason:
                reasons[r.uid] = r.finish_reason
    for u, p in zip(uids[:3], free):
        out = [t for t in got[u] if t not in eos]
        assert out == reference(model, p, 24, eos), "an unconstrained row changed beside constrained ones"
    for u in uids[3:]:
        assert reasons[u] == "stop" and got[u][-1] in eos, "a complete value must end with EOS"
        jsonschema.validate(json.loads(tokenizer.decode(got[u][:-1])), SMALL)


def test_mask_logits_leaves_unconstrained_rows_bit_for_bit(tokenizer, grammars):
    logits = mx.random.normal((3, VOCAB)).astype(mx.bfloat16)
    m = grammars.matcher(grammars.json_object(param="p"))
    out = mask_logits(logits, [None, m, None], grammars)
    assert mx.array_equal(out[0], logits[0]) and mx.array_equal(out[2], logits[2])
    allowed = np.isfinite(np.array(out[1].astype(mx.float32)))
    assert 0 < allowed.sum() < 100  # an object starts with "{" (and its few spellings)
    assert all(tokenizer.decode([int(t)]).lstrip().startswith("{") for t in np.flatnonzero(allowed))


def test_rewind_takes_tokens_back_exactly(tokenizer, grammars):
    c = grammars.json_schema(SMALL, label="small", param="p")
    ids = tokenizer.encode('{"ok": true, "n": 3}', add_special_tokens=False)
    a, b = grammars.matcher(c), grammars.matcher(c)
    for t in ids:
        a.consume(t)
    for t in ids[:4]:
        b.consume(t)
    a.rewind(4)
    assert a.tokens == b.tokens
    la = mask_logits(mx.zeros((1, VOCAB)), [a], grammars)
    lb = mask_logits(mx.zeros((1, VOCAB)), [b], grammars)
    assert mx.array_equal(la, lb)


def test_start_after_leaves_reasoning_free_then_constrains(tokenizer, grammars):
    end = tuple(tokenizer.encode("</end>", add_special_tokens=False))
    base = grammars.json_object(param="p")
    m = grammars.matcher(Constraint(base.grammar, base.label, end))
    assert not m.active
    for t in tokenizer.encode("let me think", add_special_tokens=False):
        m.consume(t)
    assert not m.active and mx.all(mask_logits(mx.zeros((1, VOCAB)), [m], grammars) == 0).item()
    for t in end:
        m.consume(t)
    assert m.active
    m.rewind(1)  # back inside the reasoning
    assert not m.active


def test_schemas_it_cannot_enforce_are_refused_naming_the_keyword(grammars):
    with pytest.raises(InvalidRequestError, match="uniqueItems") as e:
        grammars.json_schema({"type": "array", "uniqueItems": True}, label="x", param="response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError, match="get_weather"):
        grammars.tool_call([("get_weather", {"type": "object", "not": {}})], prefix="", suffix="", name_key="name",
                           args_key="arguments", param="tool_choice")
    with pytest.raises(InvalidRequestError):
        grammars.json_schema([1], label="x", param="p")


def test_a_tool_call_grammar_takes_only_a_call_of_an_offered_tool(tokenizer, grammars):
    c = grammars.tool_call([("a", {"type": "object", "properties": {"x": {"type": "integer"}}}), ("b", {})],
                           prefix="<tool_call>\n", suffix="\n</tool_call>", name_key="name", args_key="arguments",
                           param="tool_choice")
    ok = tokenizer.encode('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>', add_special_tokens=False)
    m = grammars.matcher(c)
    assert m.matcher.try_consume_tokens(ok) == len(ok) and m.complete
    for bad in ('{"name": "c", "arguments": {}}', '<tool_call>\n{"name": "a", "arguments": {"y": 1}}'):
        ids = tokenizer.encode(bad, add_special_tokens=False)
        assert grammars.matcher(c).matcher.try_consume_tokens(ids) < len(ids), bad


def test_a_strict_auto_grammar_waits_for_the_marker_then_takes_calls_in_a_row(tokenizer, grammars):
    marker = tuple(tokenizer.encode("<tool_call>", add_special_tokens=False))
    c = grammars.tool_call([("a", {"type": "object", "properties": {"x": {"type": "integer"}}})], prefix="\n",
                           suffix="\n</tool_call>", name_key="name", args_key="arguments", param="tools",
                           more="\n<tool_call>\n", start_after=marker)
    m = grammars.matcher(c)
    for t in tokenizer.encode("Sure, I will call it.", add_special_tokens=False) + list(marker):
        m.consume(t)
    assert m.active
    two = '\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "a", "arguments": {"x": 2}}\n</tool_call>'
    ids = tokenizer.encode(two, add_special_tokens=False)
    assert m.matcher.try_consume_tokens(ids) == len(ids) and m.complete


def test_a_call_marker_that_is_an_added_token_is_matched_as_that_token(tokenizer, grammars):
    """Qwen's ``<tool_call>`` is one added token with no text bytes for llguidance: as a string
    literal its mask offered the token and consuming it broke the matcher (a forced call came
    back as text). Here SmolLM2's added ``<|im_start|>`` stands in for it."""
    marker = "<|im_start|>"
    assert marker in tokenizer._tokenizer.get_added_vocab()
    assert grammars._lark_text(marker + "call\n") == f'<[{tokenizer.convert_tokens_to_ids(marker)}]> "call\\n"'
    c = grammars.tool_call([("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})],
                           prefix=marker + "call\n", suffix="\n" + marker, name_key="name", args_key="arguments", param="p")
    m = grammars.matcher(c)
    text = marker + 'call\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' + marker
    for t in tokenizer.encode(text, add_special_tokens=False):
        m.consume(t)
    assert m.complete and not m.matcher.is_error(), m.matcher.get_error()
