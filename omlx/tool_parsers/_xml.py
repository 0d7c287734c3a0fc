"""Scanning for the XML-like dialects (Qwen3-Coder, MiniMax, GLM): tag names and values whose
closing tag is structural only where the grammar allows it.

A value may contain its own closing tag as text (a file that documents the format). The closing
tag ends the value only when the next non-whitespace text is one of the tags that may follow
it; otherwise it is part of the value. Everything here is prefix-stable and never raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Match,
    RawCall,
    Scan,
    ScanResult,
    expect,
    find_from,
    is_name,
    is_partial,
    partial_suffix,
    skip_ws,
)


def find_close(
    buf: str, start: int, close: str, followers: tuple[str, ...], memo: dict[Any, Any]
) -> int | Scan:
    """Finds the structural ``close`` tag at or after ``start``.

    Args:
        memo: the region's memo; rejected candidates are not looked at again.

    Returns:
        The index of the closing tag, or ``NEED_MORE`` when the text so far cannot decide.
        (At the end of the input an undecided close means the value never closed.)
    """
    key = ("close", start, close)
    pos = memo.get(key, start)
    while True:
        idx = find_from(buf, close, pos, memo)
        if idx < 0:
            memo[key] = pos
            return NEED_MORE
        after = skip_ws(buf, idx + len(close))
        rest = buf[after : after + max(map(len, followers))]
        if any(rest.startswith(f) for f in followers):
            memo[key] = idx
            return idx
        if after == len(buf) or any(f.startswith(rest) for f in followers):
            memo[key] = idx
            return NEED_MORE
        pos = idx + 1


def read_until(buf: str, start: int, stop: str, banned: str = "<\n") -> tuple[str, int] | Scan:
    """Reads a tag attribute up to ``stop`` (e.g. a name up to ``>``).

    Returns:
        ``(text, index after stop)``; ``NEED_MORE`` if ``stop`` has not come yet; ``FAIL`` if a
        banned character comes first.
    """
    idx = buf.find(stop, start)
    # Without the stop yet, a partial stop at the end is not text.
    end = len(buf) - partial_suffix(buf, stop) if idx < 0 else idx
    if any(c in buf[start:end] for c in banned):
        return FAIL
    return NEED_MORE if idx < 0 else (buf[start:idx], idx + len(stop))


def strip_one_newline(value: str) -> str:
    """Drops one leading and one trailing newline (templates put the value on its own line)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def unquote(text: str) -> str:
    """Strips whitespace and one pair of matching quotes."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


@dataclass(frozen=True, slots=True)
class XmlGrammar:
    """Tags of a ``<block><func NAME><param NAME>value</param>...</func>...</block>`` format."""

    block_open: str  # "<tool_call>"
    block_close: str  # "</tool_call>"
    func_open: str  # "<function="
    func_close: str  # "</function>"
    param_open: str  # "<parameter="
    param_close: str  # "</parameter>"
    # The template writes a value on a line of its own (Qwen3-Coder: "<parameter=k>\nv\n</parameter>"),
    # so one newline each side is markup; False where it writes the value verbatim (MiniMax-M2).
    value_on_own_line: bool = True


@dataclass(slots=True)
class _Progress:
    """Decided part of a block, kept in the memo so a rescan resumes after the last value."""

    i: int  # where to read next
    calls: list[RawCall]
    name: str | None = None  # the open function, None between functions
    args: dict[str, str] | None = None


def scan_block(buf: str, g: XmlGrammar, memo: dict[Any, Any]) -> ScanResult:
    """Scans ``block_open (func_open NAME> (param_open NAME>value param_close)* func_close)+
    block_close`` with whitespace allowed between tags.

    A value drops one leading and one trailing newline where the grammar puts values on their
    own line (``value_on_own_line``), else it is kept verbatim. ``block_close`` counts only after a
    ``func_close``, so it may appear inside a value.
    """
    p = memo.get("xml")
    if p is None:
        p = memo["xml"] = _Progress(skip_ws(buf, len(g.block_open)), [])
    while True:
        if p.name is None or p.args is None:  # between functions
            i = skip_ws(buf, p.i)
            if p.calls:
                end = expect(buf, i, g.block_close)
                if isinstance(end, int):
                    return Match(end, p.calls)
                if end is NEED_MORE:
                    return NEED_MORE
            r = expect(buf, i, g.func_open)
            if isinstance(r, Scan):
                return r
            head = read_until(buf, r, ">")
            if isinstance(head, Scan):
                return head
            name = unquote(head[0])
            if not is_name(name):
                return FAIL
            p.i, p.name, p.args = head[1], name, {}
            continue
        i = skip_ws(buf, p.i)
        if buf.startswith(g.param_open, i):
            head = read_until(buf, i + len(g.param_open), ">")
            if isinstance(head, Scan):
                return head
            key, vstart = unquote(head[0]), head[1]
            if not key:
                return FAIL
            followers = (g.param_open, g.func_close)
            close = find_close(buf, vstart, g.param_close, followers, memo)
            if isinstance(close, Scan):
                return close
            value = buf[vstart:close]
            p.args[key] = strip_one_newline(value) if g.value_on_own_line else value
            p.i = close + len(g.param_close)
        elif buf.startswith(g.func_close, i):
            p.calls.append(RawCall(p.name, p.args))
            p.i, p.name, p.args = i + len(g.func_close), None, None
        elif is_partial(buf, i, g.param_open) or is_partial(buf, i, g.func_close):
            return NEED_MORE
        else:
            return FAIL
