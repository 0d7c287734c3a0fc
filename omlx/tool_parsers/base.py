"""Shared types of the tool-call parsers: results, streaming events and the dialect contract.

This module owns the data passed out of `omlx.tool_parsers` (``ToolCall``, ``ParseResult``,
the four streaming events) and the small contract every dialect module implements
(``Dialect.scan``). It must not know any dialect's markers and must not import mlx.

A dialect's ``scan`` looks at a buffer that begins with one of its start markers and answers
``NEED_MORE``, ``FAIL`` or a ``Match``. The answer must be *prefix-stable*: ``FAIL`` or a
``Match`` for a prefix is the same answer for every longer text, so the streaming parser gets
the same result however the text is chunked.
"""

from __future__ import annotations

import enum
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

IdFactory = Callable[[], str]

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """Returns an OpenAI-style tool call id: ``call_`` + 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


def new_mistral_call_id() -> str:
    """Returns 9 random alphanumerics: Mistral chat templates reject any other id shape."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(slots=True)
class ToolCall:
    """One parsed tool call.

    Attributes:
        id: the call id (the model's own where its format has one, else from the id factory).
        name: the function name, never empty.
        arguments: a JSON-encoded object, e.g. ``'{"city": "Oslo"}'``.
    """

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class TextDelta:
    """Plain content text (never contains a tool-call marker that was parsed as one)."""

    text: str


@dataclass(slots=True)
class ToolCallStart:
    """A tool call begins; the only event that carries its id and name."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    """A fragment of the call's arguments; a call's fragments join to ``ToolCall.arguments``."""

    index: int
    fragment: str


@dataclass(slots=True)
class ToolCallEnd:
    """The call at ``index`` is complete; no more events carry this index."""

    index: int


Event = TextDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass(slots=True)
class ParseResult:
    """The whole of one response, split into content and tool calls.

    Attributes:
        content: the text outside tool calls, or None when there is none.
        tool_calls: the calls in the order the model wrote them (empty if none).
    """

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> ParseResult:
        """Folds streaming events into the result a non-streaming parse gives."""
        texts: list[str] = []
        calls: dict[int, ToolCall] = {}
        for event in events:
            if isinstance(event, TextDelta):
                texts.append(event.text)
            elif isinstance(event, ToolCallStart):
                calls[event.index] = ToolCall(event.id, event.name, "")
            elif isinstance(event, ToolCallArgsDelta):
                calls[event.index].arguments += event.fragment
        content = "".join(texts)
        return cls(content or None, [calls[i] for i in sorted(calls)])


# --------------------------------------------------------------------------- dialect contract


class Scan(enum.Enum):
    """A ``scan`` answer that is not a match."""

    NEED_MORE = "need_more"  # the text so far could still become a valid call
    FAIL = "fail"  # no extension of the text is a valid call: it is plain text


NEED_MORE = Scan.NEED_MORE
FAIL = Scan.FAIL


@dataclass(slots=True)
class RawCall:
    """A call as a dialect read it, before schema coercion and JSON encoding."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(slots=True)
class Match:
    """``scan`` found one or more complete calls.

    Attributes:
        end: index in the scanned buffer just past the last character the calls consumed.
        calls: the calls; empty when the region is markup the dialect drops (only dialects
            with ``drops_markup``, e.g. Harmony's channel headers and end tokens).
    """

    end: int
    calls: list[RawCall]


ScanResult = Match | Scan


@dataclass(slots=True)
class ScanContext:
    """What ``scan`` may use besides the text.

    Attributes:
        final: no more text will come; ``NEED_MORE`` will be read as ``FAIL``.
        tools: the request's tools (OpenAI shape) or None.
        memo: scratch space kept while one call region is rescanned with more text (the buffer
            only grows, so positions stay valid); helpers store resumable progress here so a
            long call costs linear, not quadratic, time.
    """

    final: bool = False
    tools: list[dict[str, Any]] | None = None
    memo: dict[Any, Any] = field(default_factory=dict)


class Dialect:
    """One model family's tool-call format. Subclasses set the markers and implement ``scan``.

    Attributes:
        name: the registry name.
        start_markers: texts that open a call region; none may be a prefix of another.
        default_id_factory: makes ids for calls whose text carries none.
        drops_markup: ``scan`` may answer a ``Match`` without calls: that text is removed
            (format markup around content), so content is not always the text minus calls.
        think_markers: (start, end) of the format's reasoning block, for a caller's think
            splitter to take out before this parser; None when the format has none of its own.
    """

    name: str = ""
    start_markers: tuple[str, ...] = ()
    default_id_factory: IdFactory = staticmethod(new_call_id)
    drops_markup: bool = False
    think_markers: tuple[str, str] | None = None

    def find_start(self, text: str, at_message_start: bool) -> tuple[int, int] | None:
        """Finds the earliest call start in ``text``.

        Args:
            text: undecided text (not inside a call).
            at_message_start: no content and no call has been emitted yet.

        Returns:
            ``(position, marker_length)``, or None when no complete marker is in ``text``.
            On ``FAIL`` the first ``marker_length`` characters become text, so it is > 0.
        """
        best: tuple[int, int] | None = None
        for marker in self.start_markers:
            pos = text.find(marker)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, len(marker))
        return best

    def hold_len(self, text: str, at_message_start: bool) -> int:
        """Returns how many trailing characters of ``text`` could begin a start marker."""
        return max((partial_suffix(text, m) for m in self.start_markers), default=0)

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        """Reads the call region at the start of ``buf`` (which begins with a start marker).

        Args:
            buf: the marker and everything after it received so far.
            ctx: end-of-input flag, tools and the region's memo.

        Returns:
            ``Match``, ``NEED_MORE`` or ``FAIL``, prefix-stable; never raises on any text.
        """
        raise NotImplementedError


# --------------------------------------------------------------------------- scan helpers

NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.:/@")


def partial_suffix(text: str, marker: str) -> int:
    """Returns the length of the longest suffix of ``text`` that is a proper marker prefix."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def skip_ws(buf: str, i: int) -> int:
    """Returns the index of the first non-whitespace character at or after ``i``."""
    n = len(buf)
    while i < n and buf[i].isspace():
        i += 1
    return i


def expect(buf: str, i: int, literal: str) -> int | Scan:
    """Matches ``literal`` at ``buf[i:]``.

    Returns:
        The index after it; ``NEED_MORE`` if ``buf[i:]`` is a proper prefix of it; else ``FAIL``.
    """
    if buf.startswith(literal, i):
        return i + len(literal)
    return NEED_MORE if is_partial(buf, i, literal) else FAIL


def is_partial(buf: str, i: int, literal: str) -> bool:
    """Whether ``buf[i:]`` (possibly empty) is a proper prefix of ``literal``."""
    return len(buf) - i < len(literal) and literal.startswith(buf[i:])


def is_name(name: str) -> bool:
    """Whether ``name`` can be a function name: non-empty, no spaces, quotes or brackets."""
    return 0 < len(name) <= 256 and all(c in NAME_CHARS or c.isalnum() for c in name)


def find_from(buf: str, sub: str, start: int, memo: dict[Any, Any] | None) -> int:
    """``buf.find(sub, start)`` that resumes where the last call on a shorter ``buf`` stopped.

    Returns:
        The index of the first ``sub`` at or after ``start``, or -1.
    """
    key = ("find", sub, start)
    pos = memo.get(key, start) if memo is not None else start
    idx = buf.find(sub, pos)
    if memo is not None:
        memo[key] = idx if idx >= 0 else max(pos, len(buf) - len(sub) + 1)
    return idx
