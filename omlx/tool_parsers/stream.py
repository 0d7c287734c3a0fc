"""The streaming tool-call parser that every dialect runs in, and the one-shot ``parse_tool_calls``.

It owns the text/call split, holding back text that could begin a marker, whitespace around
calls, schema coercion, the offered-tool check (`omlx.tool_parsers.check`), JSON encoding and
ids. Dialects only answer ``scan``. A non-streaming parse is one ``feed`` plus ``finish``, so
the two cannot disagree.

Rules (the same whatever the chunking):
  * Text that could be the start of a marker is held back until it is decided.
  * A call is emitted (start, arguments, end) once it is complete and valid; a malformed or
    truncated call becomes plain text, from its marker on, with a warning in the log when it
    opened with a real marker. Nothing here raises on model text.
  * With the request's tools given, a complete call must name an offered tool and a strict
    tool's arguments must match its schema, or the whole call region stays text (warning
    logged); a non-strict tool's mismatch stays a call (warning logged). A call cut off by
    the end of the output (max_tokens inside the markup) stays text.
  * A ``drops_markup`` dialect (Harmony) may match markup without calls: it is removed.
  * Whitespace that only separates text from a call is dropped; between two pieces of text,
    the whitespace that preceded the (first) call is kept.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from omlx.tool_parsers._schema import coerce_arguments
from omlx.tool_parsers.check import CallCheck
from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Event,
    IdFactory,
    Match,
    ParseResult,
    RawCall,
    ScanContext,
    ScanResult,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    is_name,
)

logger = logging.getLogger(__name__)


class StreamingToolParser:
    """Splits a model's streamed text into content and tool calls for one response.

    Example:
        >>> p = StreamingToolParser("hermes", tools)
        >>> for delta in deltas:
        ...     send(p.feed(delta))
        >>> send(p.finish())

    Attributes:
        dialect: the resolved dialect name.
        num_tool_calls: calls emitted so far (the API sends finish_reason "tool_calls" if > 0).
    """

    def __init__(
        self,
        dialect: str,
        tools: list[dict[str, Any]] | None = None,
        *,
        id_factory: IdFactory | None = None,
    ) -> None:
        """Creates a parser.

        Args:
            dialect: a registry name or alias (see ``omlx.tool_parsers.available_dialects``).
            tools: the request's tools, used to coerce argument types and to check each call
                (`CallCheck`: offered name, schema); None skips coercion and checks.
            id_factory: makes call ids; default ``call_`` + 24 hex (9 alphanumerics for Mistral).

        Raises:
            ValueError: unknown or unavailable dialect.
        """
        from omlx.tool_parsers import get_dialect  # the registry imports this module

        self._dialect: Dialect = get_dialect(dialect)
        self.dialect = self._dialect.name
        self._tools = tools
        self._check = CallCheck(tools) if tools is not None else None
        self._new_id = id_factory or self._dialect.default_id_factory
        self._buf = ""  # undecided text; starts with a marker while _marker_len > 0
        self._marker_len = 0
        self._ctx = ScanContext(False, tools)
        self._held_ws = ""  # trailing whitespace of emitted text, not sent yet
        self._ws_before_call = ""
        self._gap_ws = ""  # whitespace to restore if text follows the last call
        self._after_call = False
        self._any_text = False
        self._ids: set[str] = set()
        self._finished = False
        self.num_tool_calls = 0

    @property
    def has_tool_calls(self) -> bool:
        """Whether at least one tool call has been emitted."""
        return self.num_tool_calls > 0

    def feed(self, delta: str) -> list[Event]:
        """Adds model text; returns the events it decides (possibly none).

        Raises:
            ValueError: called after ``finish``.
        """
        if self._finished:
            raise ValueError("feed() after finish(): create a new StreamingToolParser")
        # Move the buffer to a local first: CPython then appends in place (amortized O(1))
        # instead of copying the whole buffer on every chunk.
        buf, self._buf = self._buf, ""
        buf += delta
        self._buf = buf
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Ends the response: held-back text is released and an unfinished call becomes text.

        Raises:
            ValueError: called twice.
        """
        if self._finished:
            raise ValueError("finish() called twice")
        events = self._drain(final=True)
        self._finished = True
        return events

    # ------------------------------------------------------------------ internals

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if self._marker_len:
                self._ctx.final = final
                result = self._scan()
                if result is NEED_MORE and not final:
                    break
                valid = isinstance(result, Match) and result.end >= self._marker_len
                encoded = self._encode(result) if valid else None
                if not isinstance(encoded, list):
                    self._log_rejected(result, encoded)
                    self._fail(events)
                    continue
                assert isinstance(result, Match)
                if encoded:
                    self._emit_calls(encoded, events)
                else:  # markup only (drops_markup): removed, whitespace before it kept
                    self._held_ws, self._ws_before_call = self._ws_before_call, ""
                self._buf = self._buf[result.end :]
                self._marker_len = 0
                continue
            at_start = not self._any_text and not self.num_tool_calls
            found = self._dialect.find_start(self._buf, at_start)
            if found is not None:
                pos, self._marker_len = found
                self._ctx = ScanContext(final, self._tools)  # a fresh memo per call region
                self._emit_text(self._buf[:pos], events)
                self._ws_before_call, self._held_ws = self._held_ws, ""
                self._buf = self._buf[pos:]
                continue
            keep = 0 if final else self._dialect.hold_len(self._buf, at_start)
            self._emit_text(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            break
        if final and self._held_ws:
            events.append(TextDelta(self._held_ws))
            self._held_ws = ""
        return _merge_text(events)

    def _scan(self) -> ScanResult:
        try:
            return self._dialect.scan(self._buf, self._ctx)
        except Exception:  # noqa: BLE001 - a parser bug must not break the response
            logger.exception("%s tool parser failed; the call is kept as text", self.dialect)
            return FAIL

    def _log_rejected(self, result: ScanResult, reason: str | None) -> None:
        """A warning for a call the offered-tool check rejected (``reason``), and for a region
        that opened with a real marker (a bare ``{`` or ``[`` that is no call is just an
        answer: debug only)."""
        marked = reason is not None or any(self._buf.startswith(m) for m in self._dialect.start_markers)
        if reason is None:  # "unfinished": the output ended inside the call (max_tokens, a stop)
            reason = ("unfinished" if result is NEED_MORE else "malformed") + " tool call"
        logger.log(
            logging.WARNING if marked else logging.DEBUG,
            "%s: %s kept as text: %r",
            self.dialect,
            reason,
            self._buf[:120],
        )

    def _fail(self, events: list[Event]) -> None:
        """The call at the buffer start is not one: its marker becomes text."""
        text = self._ws_before_call + self._buf[: self._marker_len]
        self._buf = self._buf[self._marker_len :]
        self._marker_len = 0
        self._ws_before_call = ""
        self._emit_text(text, events)

    def _encode(self, match: Match) -> list[tuple[RawCall, str]] | str | None:
        """Coerces, checks and JSON-encodes every call of a match.

        Returns:
            The encoded calls; None if one is malformed; the reason (for the log) if one fails
            the offered-tool check. One bad call keeps the whole region as text: its parallel
            calls share the markup. A match without calls (markup to drop) is allowed only for
            ``drops_markup`` dialects.
        """
        if not match.calls:
            return [] if self._dialect.drops_markup else None
        out = []
        for call in match.calls:
            if not is_name(call.name) or not isinstance(call.arguments, dict):
                return None
            try:
                args = coerce_arguments(call.name, call.arguments, self._tools)
                encoded = json.dumps(args, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError):
                return None
            if self._check is not None:
                reason = self._check.rejects(self.dialect, call.name, args)
                if reason is not None:
                    return reason
            out.append((call, encoded))
        return out

    def _emit_calls(self, encoded: list[tuple[RawCall, str]], events: list[Event]) -> None:
        if not self._after_call:
            self._gap_ws = self._ws_before_call
        self._ws_before_call = ""
        for call, arguments in encoded:
            call_id = call.id if call.id and call.id not in self._ids else self._new_id()
            self._ids.add(call_id)
            index = self.num_tool_calls
            self.num_tool_calls += 1
            events.append(ToolCallStart(index, call_id, call.name))
            events.append(ToolCallArgsDelta(index, arguments))
            events.append(ToolCallEnd(index))
        self._after_call = True

    def _emit_text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            text = (self._gap_ws if self._any_text else "") + text
            self._after_call = False
            self._gap_ws = ""
        text = self._held_ws + text
        core = text.rstrip()
        self._held_ws = text[len(core) :]
        if core:
            events.append(TextDelta(core))
            self._any_text = True


def _merge_text(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for event in events:
        if isinstance(event, TextDelta) and out and isinstance(out[-1], TextDelta):
            out[-1] = TextDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def parse_tool_calls(
    text: str,
    dialect: str,
    tools: list[dict[str, Any]] | None = None,
    *,
    id_factory: IdFactory | None = None,
) -> ParseResult:
    """Parses a complete response.

    Args:
        text: the model's whole output (reasoning already removed).
        dialect: a registry name or alias.
        tools: the request's tools (OpenAI shape), for argument type coercion.
        id_factory: makes call ids (tests pass a deterministic one).

    Returns:
        Content (None if empty) and the tool calls; malformed calls stay in the content.

    Raises:
        ValueError: unknown or unavailable dialect (never for any model text).
    """
    parser = StreamingToolParser(dialect, tools, id_factory=id_factory)
    return ParseResult.from_events(parser.feed(text) + parser.finish())
