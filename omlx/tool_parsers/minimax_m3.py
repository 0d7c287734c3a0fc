"""MiniMax-M3 tool calls: MiniMax's XML with a namespace token before every tag, arguments named
by their element.

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">
    ]<]minimax[>[<city>Oslo]<]minimax[>[</city>
    ]<]minimax[>[<days>3]<]minimax[>[</days>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

``]<]minimax[>[`` is one special token in M3's vocabulary; the chat template's ``to_xml`` macro
writes an argument object as named child elements, an array as ``<item>`` children and a scalar
as its text (booleans as ``true``/``false``). So nesting is structural only after the token: a
value may hold ``</city>`` or ``<b>`` as text. Several ``<invoke>`` in one block are parallel
calls; a repeated element name folds into an array; ``<parameter name="k">`` (M2's spelling)
is accepted for an element. A leaf stays text unless the tool's schema types it (the shared
coercion, applied at every depth here); an empty element is ``[]``/``{}`` where the schema says
array/object. An unclosed element or block is text (``NEED_MORE`` until the end).

The template writes the token before every tag, but it is one token per tag, sampled like any
other: outputs in the wild drop it now and then (a bare ``<tool_call>`` opener, a value closed
by a bare ``</city>``, a bare ``</invoke>``) or put whitespace between it and its tag (which
SGLang's M3 parser normalizes away). So where a tag is expected the token is optional and may be
followed by whitespace; a bare ``<tool_call>`` opens a block only when an ``<invoke`` with the
token follows it; a value ends at the next token, and if that token does not start the value's
own close tag, a bare close tag at the end of the value text closes it. A value holding its own
close tag as text is still read whole when the real (tokened) close follows.

M2's ``<minimax:tool_call>`` with ``<parameter name=...>`` is ``minimax.py``; mlx-lm 0.32.2 has
no M3 parser (its ``minimax_m2`` does not know this markup, so M3 calls came back as text).
Markup as reported by mlx-lm PR #1416, llama.cpp PR #24523 and the SGLang/Dynamo M3 parsers.
"""

from __future__ import annotations

import re
from typing import Any

from omlx.tool_parsers._schema import _schema_types, coerce_value, tool_properties
from omlx.tool_parsers._xml import read_until
from omlx.tool_parsers.base import (
    FAIL,
    NEED_MORE,
    Dialect,
    Match,
    RawCall,
    Scan,
    ScanContext,
    ScanResult,
    expect,
    find_from,
    is_name,
    is_partial,
    skip_ws,
)

NS = "]<]minimax[>["
START = NS + "<tool_call>"
BARE_START = "<tool_call>"  # the token dropped: a block only if NS<invoke follows
END = "</tool_call>"  # tags below are matched by _tag: after NS (and whitespace), or bare
INVOKE = "<invoke"
INVOKE_END = "</invoke>"
THINK_MARKERS = ("<mm:think>", "</mm:think>")
_NAME_ATTR = re.compile(r"""^\s*name\s*=\s*(?:"([^"]*)"|'([^']*)')\s*$""")
_KEY_BANNED = frozenset(" \t\r\n<>/\"'=")
_MAX_DEPTH = 32


def _name_attr(text: str) -> str | None:
    m = _NAME_ATTR.match(text)
    return (m.group(1) if m.group(1) is not None else m.group(2)).strip() if m else None


def _sub_schema(schema: Any, key: str) -> Any:
    """The schema of child ``key`` (an array's ``item``, else an object's property), or None."""
    if not isinstance(schema, dict):
        return None
    if key == "item" and "array" in _schema_types(schema):
        return schema.get("items")
    props = schema.get("properties")
    return props.get(key) if isinstance(props, dict) else None


def _leaf(text: str, schema: Any) -> Any:
    # Verbatim: to_xml writes a scalar between the tags with nothing added, so a newline at
    # either end is the value's own.
    types = _schema_types(schema)
    if not text.strip() and "string" not in types:
        if "array" in types:
            return []
        if "object" in types:
            return {}
    return coerce_value(text, schema)


def _container(children: list[tuple[str, Any]]) -> Any:
    """``<item>`` children -> a list; named children -> an object (a repeated name -> a list)."""
    if all(key == "item" for key, _ in children):
        return [value for _, value in children]
    return _fold(children)


def _fold(children: list[tuple[str, Any]]) -> dict[str, Any]:
    grouped: dict[str, list[Any]] = {}
    for key, value in children:
        grouped.setdefault(key, []).append(value)
    return {k: v[0] if len(v) == 1 else v for k, v in grouped.items()}


def _tag(buf: str, i: int, tag: str) -> int | Scan:
    """Matches ``tag`` at ``i`` after the namespace token and any whitespace, or bare.

    Returns:
        The index after the tag, ``NEED_MORE`` or ``FAIL`` (prefix-stable, as ``expect``).
    """
    if buf.startswith(NS, i):
        j = skip_ws(buf, i + len(NS))
        return NEED_MORE if j == len(buf) else expect(buf, j, tag)
    if is_partial(buf, i, NS):
        return NEED_MORE
    return expect(buf, i, tag)


def _element(buf: str, i: int, parent: Any, memo: dict[Any, Any], depth: int) -> tuple[str, Any, int] | Scan:
    """Reads ``NS<key>value NS</key>`` at ``i``, the value text or child elements.

    Returns:
        (key, value, index after the close tag), or ``NEED_MORE`` / ``FAIL``.
    """
    if depth > _MAX_DEPTH:
        return FAIL
    r = _tag(buf, i, "<")
    if isinstance(r, Scan):
        return r
    head = read_until(buf, r, ">", banned="<\n")
    if isinstance(head, Scan):
        return head
    tag, v = head
    if tag.startswith("parameter") and tag[9:10].isspace():  # M2's spelling
        key, close = _name_attr(tag[10:]), "</parameter>"
    else:
        key, close = tag.strip(), "</" + tag.strip() + ">"
        if any(c in _KEY_BANNED for c in key):
            return FAIL
    if not key:
        return FAIL
    schema = _sub_schema(parent, key)
    j = find_from(buf, NS, v, memo)
    if j < 0:
        return NEED_MORE
    end = _tag(buf, j, close)
    if isinstance(end, int):
        return key, _leaf(buf[v:j], schema), end
    if end is NEED_MORE:
        return NEED_MORE
    text = buf[v:j].rstrip()
    if text.endswith(close):  # the token dropped before the close tag
        return key, _leaf(text[: -len(close)], schema), j
    if text.strip():
        return FAIL  # text beside child elements: not what to_xml writes
    children: list[tuple[str, Any]] = []
    k = j
    while True:
        k = skip_ws(buf, k)
        end = _tag(buf, k, close)
        if isinstance(end, int):
            return key, _container(children), end
        if end is NEED_MORE:
            return NEED_MORE
        child = _element(buf, k, schema, memo, depth + 1)
        if isinstance(child, Scan):
            return child
        children.append((child[0], child[1]))
        k = child[2]


def _invoke(buf: str, i: int, ctx: ScanContext) -> tuple[RawCall, int] | Scan:
    r = _tag(buf, i, INVOKE)
    if isinstance(r, Scan):
        return r
    if r < len(buf) and not buf[r].isspace():
        return FAIL  # e.g. "<invokes"
    head = read_until(buf, r, ">", banned="<\n")
    if isinstance(head, Scan):
        return head
    name = _name_attr(head[0])
    if name is None or not is_name(name):
        return FAIL
    props = tool_properties(ctx.tools, name)
    schema = {"type": "object", "properties": props} if props else None
    children: list[tuple[str, Any]] = []
    k = head[1]
    while True:
        k = skip_ws(buf, k)
        end = _tag(buf, k, INVOKE_END)
        if isinstance(end, int):
            return RawCall(name, _fold(children)), end
        if end is NEED_MORE:
            return NEED_MORE
        el = _element(buf, k, schema, ctx.memo, 0)
        if isinstance(el, Scan):
            return el
        children.append((el[0], el[1]))
        k = el[2]


def _scan(buf: str, ctx: ScanContext) -> ScanResult:
    # Complete invokes are decided for good: resume after the last one.
    if "m3" not in ctx.memo:
        if not buf.startswith(START):  # the bare opener: the token must come back at <invoke
            i = skip_ws(buf, len(BARE_START))
            r = expect(buf, i, NS + INVOKE)
            if isinstance(r, Scan):
                return r
        ctx.memo["m3"] = (len(START) if buf.startswith(START) else len(BARE_START), [])
    i, calls = ctx.memo["m3"]
    while True:
        i = skip_ws(buf, i)
        if calls:
            end = _tag(buf, i, END)
            if isinstance(end, int):
                return Match(end, list(calls))
            if end is NEED_MORE:
                return NEED_MORE
        got = _invoke(buf, i, ctx)
        if isinstance(got, Scan):
            return got
        calls = [*calls, got[0]]
        i = got[1]
        ctx.memo["m3"] = (i, calls)


class MiniMaxM3(Dialect):
    name = "minimax_m3"
    start_markers = (START, BARE_START)
    think_markers = THINK_MARKERS

    def scan(self, buf: str, ctx: ScanContext) -> ScanResult:
        return _scan(buf, ctx)


DIALECT = MiniMaxM3()
