"""Constrained decoding with llguidance: grammars compiled per model, a matcher per request, and
the token mask applied inside the batched step.

A request's `omlx.request.Constraint` carries an llguidance grammar (JSON text: a JSON Schema,
or a Lark grammar that embeds JSON Schemas with ``@name``; llguidance's grammar format,
https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md). `Grammars` builds those
grammars for one model and validates them against its tokenizer; the API layer calls it before a
request is submitted, so a schema llguidance cannot enforce is a 400 naming the keyword, never a
silently unconstrained answer. The runner gives each constrained sequence a `GrammarMatcher` and
calls `mask_logits` once per step for the whole batch: rows of unconstrained sequences are left
as they are (``mx.where`` with an all-true row returns the same values), and a batch without a
constrained row never reaches this module.

Why llguidance (DESIGN.md): no dependency beyond itself (xgrammar 0.2.9's wheel requires torch,
transformers and triton), JSON Schema with named errors for unimplemented keywords, Lark for tool
calls, and a thread-pool executor that computes a batch's masks in parallel. Its own MLX helper
is a Metal kernel; the mask here is applied with plain MLX ops so it runs on the CPU and CUDA too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from omlx.errors import InvalidRequestError
from omlx.request import Constraint

logger = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is spaced: compact but readable (``{"a": 1, "b": 2}``), no free
whitespace (a small model given free whitespace may write newlines until ``max_tokens``)."""

_CACHE_SIZE = 256  # compiled grammars kept per model (keyed by the sha256 of their text)

_executor_lock = threading.Lock()
_executor: Any = None


def shared_executor() -> Any:
    """The process's llguidance ``LLExecutor`` (a thread pool computing a batch's masks)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor()
        return _executor


class Grammars:
    """Grammars for one model's tokenizer, validated and cached.

    Args:
        tokenizer: the model's mlx-lm ``TokenizerWrapper`` (its Hugging Face tokenizer is read).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).

    The llguidance tokenizer (~0.4 s for a 49k vocabulary on the CPU) is built on first use, in
    the calling thread; the API calls `Grammars` off its event loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._valid: OrderedDict[str, str] = OrderedDict()  # sha256 -> grammar text
        self.num_masked_steps = 0  # batch steps with a constrained row (engine thread)
        self.mask_host_s = 0.0  # host seconds those steps spent consuming tokens and computing masks

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                import llguidance.hf

                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                eos = self._tokenizer.eos_token_id
                n_vocab = max(self.vocab_size, len(hf))
                self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
            return self._ll_tokenizer

    # ---- building grammars ------------------------------------------------------------

    def json_schema(self, schema: Any, *, label: str, param: str) -> Constraint:
        """A constraint to JSON that validates against ``schema`` (JSON Schema draft 2020-12,
        llguidance's subset).

        Raises:
            InvalidRequestError: ``schema`` is not an object, or llguidance cannot enforce it
                (the message names the keyword, e.g. ``Unimplemented keys: ["uniqueItems"]``).
        """
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"'{param}' must be a JSON Schema object", param=param)
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return Constraint(self._validated(grammar, param), label)

    def json_object(self, *, param: str) -> Constraint:
        """A constraint to any JSON object (OpenAI's ``json_object`` mode)."""
        return self.json_schema({"type": "object"}, label="json_object", param=param)

    def tool_call(self, calls: Sequence[tuple[str, dict[str, Any]]], *, prefix: str, suffix: str,
                  name_key: str, args_key: str, param: str, more: str | None = None,
                  start_after: tuple[int, ...] = ()) -> Constraint:
        """A constraint to one call of one of ``calls`` ((name, parameters schema) pairs):
        ``prefix`` + ``{"<name_key>": name, "<args_key>": {...arguments...}}`` + ``suffix``, the
        arguments valid against that tool's schema; a schema with ``properties`` and no
        ``additionalProperties`` gets only its declared properties (no parameters: ``{}``).
        With ``more``, further calls may follow, each introduced by ``more``; ``start_after``:
        the constraint starts once those tokens were generated (`Constraint.start_after`).

        Raises:
            InvalidRequestError: a parameters schema llguidance cannot enforce (names the tool).
        """
        import llguidance

        options = []
        for name, params in calls:
            args = dict(params) if isinstance(params, dict) and params else {"type": "object", "properties": {}}
            if "properties" in args and "additionalProperties" not in args:
                # Only the declared parameters, as OpenAI's strict function calling has it (the
                # call still validates against the schema as given); a small model otherwise
                # invents arguments until max_tokens.
                args["additionalProperties"] = False
            options.append({"type": "object", "properties": {name_key: {"const": name}, args_key: args},
                            "required": [name_key, args_key], "additionalProperties": False})
        schema = {"anyOf": options, "x-guidance": JSON_OPTIONS} if len(options) > 1 else {**options[0], "x-guidance": JSON_OPTIONS}
        pre, post = self._lark_text(prefix), self._lark_text(suffix)
        one = " ".join(p for p in (pre, "@call", post) if p)
        lark = f"start: {one}" + (f" ({self._lark_text(more)} @call {post})*" if more is not None else "")
        grammar = json.dumps({"grammars": [{"lark_grammar": lark}, {"name": "call", "json_schema": schema}]})
        try:
            return Constraint(self._validated(grammar, param), "tool call", tuple(start_after))
        except InvalidRequestError as e:
            names = ", ".join(n for n, _ in calls)
            raise InvalidRequestError(f"the parameters of tool(s) {names} cannot be enforced: {e.message}", param=param) from None

    def _validated(self, grammar: str, param: str) -> str:
        import llguidance

        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                return self._valid[key]
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise InvalidRequestError(f"'{param}' cannot be enforced by constrained decoding: {'; '.join(messages)}", param=param)
        for m in messages:
            logger.warning("grammar for %s: %s", param, m)
        with self._lock:
            self._valid[key] = grammar
            while len(self._valid) > _CACHE_SIZE:
                self._valid.popitem(last=False)
        return grammar

    @functools.cached_property
    def _added_vocab(self) -> dict[str, int]:
        """The tokenizer's added tokens (text -> id), read once."""
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        return dict(getattr(hf, "get_added_vocab", dict)())

    def _lark_text(self, text: str) -> str:
        """``text`` as a Lark expression: a string literal, except that a token the tokenizer
        added (Qwen's ``<tool_call>``) is matched as that token, ``<[id]>``.

        llguidance gives a special token no text bytes, so a literal ``"<tool_call>"`` could only
        be spelled with ordinary tokens, which is not what the model writes: its mask offers the
        special token, and consuming that token puts the matcher in an error state.
        """
        if not text:
            return ""
        added = self._added_vocab
        names = sorted((t for t in added if t and t in text), key=len, reverse=True)
        if not names:
            return _lark_str(text)
        parts, i = [], 0
        while i < len(text):
            hit = next((t for t in names if text.startswith(t, i)), None)
            if hit is None:
                j = min((k for k in (text.find(t, i) for t in names) if k >= 0), default=len(text))
                parts.append(_lark_str(text[i:j]))
                i = j
            else:
                parts.append(f"<[{added[hit]}]>")
                i += len(hit)
        return " ".join(parts)

    # ---- per request --------------------------------------------------------------------

    def matcher(self, constraint: Constraint) -> "GrammarMatcher":
        import llguidance

        return GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, constraint.grammar, log_level=0), constraint)


def _lark_str(text: str) -> str:
    return json.dumps(text) if text else ""


class GrammarMatcher:
    """One request's place in its grammar (engine thread only).

    ``consume`` advances it over each generated token; ``rewind`` takes tokens back (a batch
    step that failed after its tokens were consumed). With ``constraint.start_after`` the mask
    applies only once those tokens were generated (the end of a reasoning block).
    """

    __slots__ = ("matcher", "constraint", "tokens", "_waiting", "_warned")

    def __init__(self, matcher: Any, constraint: Constraint):
        self.matcher = matcher
        self.constraint = constraint
        self.tokens: list[int] = []  # every generated token seen, in order
        self._waiting = bool(constraint.start_after)
        self._warned = False

    @property
    def active(self) -> bool:
        """The mask applies to the next token."""
        return not self._waiting and not self.matcher.is_error()

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar (e.g. complete, valid JSON)."""
        return not self._waiting and self.matcher.is_accepting()

    def consume(self, token: int) -> None:
        self.tokens.append(token)
        if self._waiting:
            after = self.constraint.start_after
            self._waiting = tuple(self.tokens[-len(after):]) != after
            return
        if not self.matcher.consume_token(token) and not self._warned:
            self._warned = True
            logger.warning("constrained decoding: token %d is outside the grammar (%s): %s; this request "
                           "continues unconstrained", token, self.constraint.label, self.matcher.get_error())

    def rewind(self, num_tokens: int) -> None:
        """Take back to the first ``num_tokens`` generated tokens."""
        extra = len(self.tokens) - num_tokens
        if extra <= 0:
            return
        self.tokens = self.tokens[:num_tokens]
        after = self.constraint.start_after
        if after:
            idx = next((i + len(after) for i in range(len(self.tokens) - len(after) + 1)
                        if tuple(self.tokens[i:i + len(after)]) == after), None)
            self.matcher.reset()
            self._waiting = idx is None
            for t in self.tokens[idx:] if idx is not None else []:
                self.matcher.consume_token(t)
        else:
            self.matcher.rollback(extra)


def mask_logits(logits: mx.array, matchers: Sequence[GrammarMatcher | None], grammars: Grammars) -> mx.array:
    """Set the logits of tokens each row's grammar forbids to -inf.

    Args:
        logits: (B, V) the step's logits, any float dtype.
        matchers: per row, its matcher or None (the row is returned unchanged).
        grammars: the model's `Grammars` (its tokenizer's vocabulary sets the mask width); the
            rows' masks are computed in parallel threads (`shared_executor`).

    Returns:
        (B, V) logits of the same dtype.
    """
    batch, vocab = logits.shape
    rows = [(m.matcher, i) for i, m in enumerate(matchers) if m is not None and m.active]
    if not rows:
        return logits
    words = (grammars.ll_tokenizer.vocab_size + 31) // 32
    bitmask = np.full((batch, words), -1, dtype=np.int32)  # rows not listed keep every token
    shared_executor().unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, words * 4, batch)
    need = (vocab + 31) // 32
    if need > words:  # tokens past the grammar's vocabulary: never allowed in a constrained row
        masked = {r for _, r in rows}
        pad = np.zeros((batch, need - words), dtype=np.int32)
        pad[[i for i in range(batch) if i not in masked]] = -1
        bitmask = np.concatenate([bitmask, pad], axis=1)
    # The packed words go to the device (B x V/32 int32, not B x V booleans) and unpack there.
    packed = mx.array(bitmask).view(mx.uint32)
    allowed = ((packed[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1).reshape(batch, -1)[:, :vocab]
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-float("inf"), dtype=logits.dtype))
