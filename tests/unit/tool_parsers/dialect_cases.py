"""The table of model outputs every dialect is tested on (by test_common.py, three ways).

Each case gives the whole model output and the expected split: content (None when there is no
text) and the calls as (name, arguments dict[, id]). Malformed calls must come back as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _tool(name: str, **props: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in props.items()},
            },
        },
    }


TOOLS = [
    _tool("get_weather", city="string", days="integer"),
    _tool("write_file", path="string", content="string"),
    _tool("search", regex="string"),
    _tool("configure", enabled="boolean", ratio="number", tags="array", opts="object"),
    _tool("save-snippet", lang="string", code="string"),
    _tool("list_files"),
]


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    content: str | None
    calls: list[tuple[Any, ...]] = field(default_factory=list)  # (name, args[, id])
    tools: list[dict[str, Any]] | None = None


def C(id: str, text: str, content: str | None, *calls: tuple[Any, ...], tools=TOOLS) -> Case:
    return Case(id, text, content, list(calls), tools)


OSLO = ("get_weather", {"city": "Oslo", "days": 3})
LYON = ("get_weather", {"city": "Lyon"})

_H = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
_H2 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'

HERMES = [
    C("single", _H, None, OSLO),
    C("text-before-parallel", "Let me check.\n" + _H + "\n" + _H2, "Let me check.", OSLO, LYON),
    C("text-after", _H + "\nDone.", "Done.", OSLO),
    C("text-between", "A\n\n" + _H + "\n\nB", "A\n\nB", OSLO),
    C("invalid-escape", '<tool_call>{"name": "search", "arguments": {"regex": "^v\\d+\\.\\d+$"}}</tool_call>',
      None, ("search", {"regex": "^v\\d+\\.\\d+$"})),
    C("end-tag-in-string",
      '<tool_call>{"name": "write_file", "arguments": {"path": "a.md", "content": "x </tool_call> y"}}</tool_call>',
      None, ("write_file", {"path": "a.md", "content": "x </tool_call> y"})),
    C("args-as-string", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": \\"3\\"}"}</tool_call>',
      None, OSLO),
    C("coerce-int", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": "3"}}</tool_call>', None, OSLO),
    C("unicode", '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich ☃"}}</tool_call>', None,
      ("get_weather", {"city": "Zürich ☃"})),
    C("malformed-json", 'Hi <tool_call>{"name": get_weather}</tool_call> ok', 'Hi <tool_call>{"name": get_weather}</tool_call> ok'),
    C("no-name", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
    C("truncated", "Hi " + _H[:-5], "Hi " + _H[:-5]),
    C("plain-angle-brackets", "if a < b and c <tool x", "if a < b and c <tool x"),
    C("malformed-then-valid", "<tool_call>oops</tool_call>\n" + _H, "<tool_call>oops</tool_call>", OSLO),
    # Qwen2.5-Coder-0.5B answers with the bare object (no tags): a call only as the whole response.
    C("bare-object", '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}', None, OSLO),
    C("bare-objects-parallel", '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n'
      '{"name": "get_weather", "arguments": {"city": "Lyon"}}\n', None, OSLO, LYON),
    C("bare-object-unknown-tool", '{"name": "launch", "arguments": {}}', '{"name": "launch", "arguments": {}}'),
    C("bare-object-then-text", '{"name": "get_weather", "arguments": {"city": "Oslo"}} is how you call it.',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}} is how you call it.'),
    C("json-answer-not-a-call", '{"city": "Oslo", "temp": 3}', '{"city": "Oslo", "temp": 3}'),
    C("bare-object-after-text", 'Call: {"name": "get_weather", "arguments": {"city": "Oslo"}}',
      'Call: {"name": "get_weather", "arguments": {"city": "Oslo"}}'),
]

_Q = "<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _qwen(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return _Q.format(name=name, params=body)


QWEN3_CODER_XML = [
    C("single", _qwen("get_weather", city="Oslo", days="3"), None, OSLO),
    C("closing-tags-in-value",
      _qwen("write_file", path="a.md", content="End with </parameter> and </tool_call> here."), None,
      ("write_file", {"path": "a.md", "content": "End with </parameter> and </tool_call> here."})),
    C("text-before-parallel", "I'll check both.\n" + _qwen("get_weather", city="Oslo", days="3") + "\n"
      + _qwen("get_weather", city="Lyon"), "I'll check both.", OSLO, LYON),
    C("multiline-value", _qwen("write_file", path="x.py", content="def f():\n    return 1\n"), None,
      ("write_file", {"path": "x.py", "content": "def f():\n    return 1\n"})),
    C("uncoercible", _qwen("get_weather", city="Oslo", days="a few"), None,
      ("get_weather", {"city": "Oslo", "days": "a few"})),
    C("typed-values", _qwen("configure", enabled="true", ratio="0.5", tags='["a", "b"]', opts='{"k": 1}'), None,
      ("configure", {"enabled": True, "ratio": 0.5, "tags": ["a", "b"], "opts": {"k": 1}})),
    C("no-params", "<tool_call>\n<function=list_files>\n</function>\n</tool_call>", None, ("list_files", {})),
    C("text-after", _qwen("get_weather", city="Lyon") + "\nThen I will summarise.", "Then I will summarise.", LYON),
    C("missing-function-close", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
      "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>"),
    C("tag-in-prose", "Wrap calls in <tool_call> tags.", "Wrap calls in <tool_call> tags."),
]

LLAMA3_JSON = [
    C("python-tag", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}', None, OSLO),
    C("bare", '  {"name": "get_weather", "parameters": {"city": "Oslo", "days": "3"}}', None, OSLO),
    C("parallel", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}; '
      '{"name": "get_weather", "arguments": {"city": "Lyon"}}', None, OSLO, LYON),
    C("json-later-in-prose", 'Use {"name": "x", "parameters": {}} to call.',
      'Use {"name": "x", "parameters": {}} to call.'),
    C("json-answer", '{"answer": 42}', '{"answer": 42}'),
    C("text-after", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lyon"}}\nok', "ok", LYON),
    C("python-code", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")'),
    C("trailing-semicolon", '{"name": "get_weather", "parameters": {"city": "Lyon"}};', ";", LYON),
    C("truncated", '{"name": "get_weather", "parameters": {"city": "Ly', '{"name": "get_weather", "parameters": {"city": "Ly'),
]

MISTRAL = [
    C("v13-parallel", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_weather[ARGS]{"city": "Osaka"}',
      None, LYON, ("get_weather", {"city": "Osaka"})),
    C("trailing-text", '[TOOL_CALLS]search[ARGS]{"regex": "FIXME"}\n\nI will read the matches next.',
      "I will read the matches next.", ("search", {"regex": "FIXME"})),
    C("text-before", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 3}', "Checking.", OSLO),
    C("old-list", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}, "id": "abc123xyz"}, '
      '{"name": "get_weather", "arguments": {"city": "Lyon"}, "id": "def456uvw"}]',
      None, (*OSLO, "abc123xyz"), (*LYON, "def456uvw")),
    C("call-id", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Lyon"}', None, (*LYON, "a1B2c3D4e")),
    C("repeated-header", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}list_files[ARGS]{}', None, LYON, ("list_files", {})),
    C("no-args-marker", '[TOOL_CALLS]get_weather{"city": "Lyon"}', None, LYON),
    C("invalid-escape", '[TOOL_CALLS]search[ARGS]{"regex": "\\d+"}', None, ("search", {"regex": "\\d+"})),
    C("malformed", '[TOOL_CALLS]get weather[ARGS]{"city": "Lyon"}', '[TOOL_CALLS]get weather[ARGS]{"city": "Lyon"}'),
    C("truncated", '[TOOL_CALLS]get_weather[ARGS]{"city": "Ly', '[TOOL_CALLS]get_weather[ARGS]{"city": "Ly'),
]

GEMMA = [
    C("functiongemma-two-calls", "<start_function_call>call:configure{enabled:true,ratio:0.5}<end_function_call>"
      "<start_function_call>call:get_weather{city:<escape>Oslo, {NO}<escape>,days:3}<end_function_call>", None,
      ("configure", {"enabled": True, "ratio": 0.5}), ("get_weather", {"city": "Oslo, {NO}", "days": 3})),
    C("gemma4-braces-hyphen", '<|tool_call>call:save-snippet{lang:<|"|>js<|"|>,code:<|"|>f = () => { return {ok: "y"}; };'
      '<|"|>}<tool_call|>', None, ("save-snippet", {"lang": "js", "code": 'f = () => { return {ok: "y"}; };'})),
    C("gemma4-nested", '<|tool_call>call:configure{tags:[<|"|>a,b<|"|>, <|"|>c<|"|>], opts:{file-path:<|"|>x<|"|>,n:-2.5e1,'
      'deep:{z:null}}}<tool_call|>', None,
      ("configure", {"tags": ["a,b", "c"], "opts": {"file-path": "x", "n": -25.0, "deep": {"z": None}}})),
    C("text-around", 'Sure.\n<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>\nDone.',
      "Sure.\nDone.", OSLO),
    C("gemma4-parallel", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>'
      '<|tool_call>call:get_weather{city:<|"|>Lyon<|"|>}<tool_call|>', None, OSLO, LYON),
    C("coerce-string-int", "<start_function_call>call:get_weather{city:<escape>Oslo<escape>,days:<escape>3<escape>}"
      "<end_function_call>", None, OSLO),
    C("no-args", "<start_function_call>call:list_files{}<end_function_call>", None, ("list_files", {})),
    C("truncated", "<start_function_call>call:get_weather{city:<escape>Oslo<escape>}",
      "<start_function_call>call:get_weather{city:<escape>Oslo<escape>}"),
    C("malformed", "<start_function_call>call:get_weather{city:<escape>Oslo<escape> days:3}<end_function_call>",
      "<start_function_call>call:get_weather{city:<escape>Oslo<escape> days:3}<end_function_call>"),
]

GLM = [
    C("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n"
      "<arg_value>3</arg_value>\n</tool_call>", None, OSLO),
    C("glm47-compact", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value></tool_call>", None, LYON),
    C("missing-open-value", "<tool_call>get_weather<arg_key>city</arg_key>Lyon</arg_value></tool_call>", None, LYON),
    C("close-tag-in-value", "<tool_call>write_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>content</arg_key>"
      "<arg_value>x</arg_value> and </tool_call> y\n</arg_value></tool_call>", None,
      ("write_file", {"path": "a", "content": "x</arg_value> and </tool_call> y\n"})),
    C("no-args", "<tool_call>list_files</tool_call>", None, ("list_files", {})),
    C("json-body", '<tool_call>get_weather\n{"city": "Oslo", "days": 3}\n</tool_call>', None, OSLO),
    C("text-before-parallel", "Checking.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
      "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>\n<tool_call>get_weather<arg_key>city</arg_key>"
      "<arg_value>Lyon</arg_value></tool_call>", "Checking.", OSLO, LYON),
    C("malformed", "<tool_call>get weather now</tool_call>", "<tool_call>get weather now</tool_call>"),
    C("truncated", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ly",
      "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ly"),
]

MINIMAX = [
    C("single", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
      '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>', None, OSLO),
    C("parallel-invokes", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
      '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_weather">\n<parameter name="city">Lyon'
      '</parameter>\n</invoke>\n</minimax:tool_call>', None, OSLO, LYON),
    C("close-tag-in-value", '<minimax:tool_call><invoke name="write_file"><parameter name="path">a</parameter>'
      '<parameter name="content">x </parameter> y</parameter></invoke></minimax:tool_call>', None,
      ("write_file", {"path": "a", "content": "x </parameter> y"})),
    C("text-around", 'Hi.\n<minimax:tool_call><invoke name="get_weather"><parameter name="city">Lyon</parameter></invoke>'
      "</minimax:tool_call>\nBye.", "Hi.\nBye.", LYON),
    C("malformed", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Lyon</invoke></minimax:tool_call>',
      '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Lyon</invoke></minimax:tool_call>'),
]

_KB, _KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def _kimi(name: str, idx: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


KIMI_K2 = [
    C("single", _KB + _kimi("get_weather", 0, '{"city": "Oslo", "days": 3}') + _KE, None,
      (*OSLO, "functions.get_weather:0")),
    C("parallel-text-before", "Looking.\n" + _KB + _kimi("get_weather", 0, '{"city": "Oslo", "days": 3}')
      + _kimi("get_weather", 1, '{"city": "Lyon"}') + _KE, "Looking.",
      (*OSLO, "functions.get_weather:0"), (*LYON, "functions.get_weather:1")),
    C("invalid-escape", _KB + _kimi("search", 0, '{"regex": "^\\d", "x": true}') + _KE, None,
      ("search", {"regex": "^\\d", "x": True}, "functions.search:0")),
    C("malformed", _KB + "<|tool_call_begin|>get_weather<|tool_call_end|>" + _KE,
      _KB + "<|tool_call_begin|>get_weather<|tool_call_end|>" + _KE),
]

_LB, _LE = "<longcat_tool_call>", "</longcat_tool_call>"
LONGCAT = [
    C("json", _LB + '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}' + _LE, None, OSLO),
    C("arg-keys", _LB + "get_weather\n<longcat_arg_key>city</longcat_arg_key>\n<longcat_arg_value>Lyon"
      "</longcat_arg_value>" + _LE, None, LYON),
    C("invalid-escape", "x " + _LB + '{"name": "search", "arguments": {"regex": "\\w+"}}' + _LE, "x",
      ("search", {"regex": "\\w+"})),
    C("malformed", _LB + "nothing here" + _LE, _LB + "nothing here" + _LE),
]

_DB, _DE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_CB, _CE, _SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

DEEPSEEK = [
    C("v3", _DB + _CB + "function" + _SEP + 'get_weather\n```json\n{"city": "Oslo", "days": 3}\n```' + _CE + _DE,
      None, OSLO),
    C("v31", _DB + _CB + "get_weather" + _SEP + '{"city": "Lyon"}' + _CE + _DE, None, LYON),
    C("parallel-text-before", "Sure." + _DB + _CB + "get_weather" + _SEP + '{"city": "Oslo", "days": "3"}' + _CE
      + _CB + "get_weather" + _SEP + '{"city": "Lyon"}' + _CE + _DE, "Sure.", OSLO, LYON),
    C("marker-in-string", _DB + _CB + "write_file" + _SEP + '{"path": "a", "content": "' + _CE + '"}' + _CE + _DE,
      None, ("write_file", {"path": "a", "content": _CE})),
    C("malformed", _DB + _CB + "get_weather" + _SEP + "city=Oslo" + _CE + _DE,
      _DB + _CB + "get_weather" + _SEP + "city=Oslo" + _CE + _DE),
]

CONF = ("configure", {"enabled": True, "ratio": 0.5, "tags": ["a", "b"], "opts": {"k": 1, "z": None}})
UNI = ("get_weather", {"city": "Zürich ☃ 東京 🌧"})
NOARGS = ("list_files", {})

# MiniMax-M3: the namespace token before every tag, arguments named by element (to_xml).
_NS = "]<]minimax[>["
_MB, _ME = _NS + "<tool_call>\n", _NS + "</tool_call>"


def _m3(name: str, body: str = "") -> str:
    return f'{_NS}<invoke name="{name}">\n{body}{_NS}</invoke>\n'


def _m3el(key: str, value: str) -> str:
    return f"{_NS}<{key}>{value}{_NS}</{key}>\n"


MINIMAX_M3 = [
    C("single", _MB + _m3("get_weather", _m3el("city", "Oslo") + _m3el("days", "3")) + _ME, None, OSLO),
    C("parallel-invokes", _MB + _m3("get_weather", _m3el("city", "Oslo") + _m3el("days", "3"))
      + _m3("get_weather", _m3el("city", "Lyon")) + _ME, None, OSLO, LYON),
    C("text-before-and-after", "I'll check.\n" + _MB + _m3("get_weather", _m3el("city", "Lyon")) + _ME + "\nDone.",
      "I'll check.\nDone.", LYON),
    C("zero-args", _MB + _m3("list_files") + _ME, None, NOARGS),
    C("typed-nested", _MB + _m3("configure", _m3el("enabled", "true") + _m3el("ratio", "0.5")
      + _m3el("tags", _m3el("item", "a") + _m3el("item", "b")) + _m3el("opts", _m3el("k", "1") + _m3el("z", "null")))
      + _ME, None, ("configure", {"enabled": True, "ratio": 0.5, "tags": ["a", "b"], "opts": {"k": "1", "z": "null"}})),
    C("repeated-element-is-an-array", _MB + _m3("configure", _m3el("tags", "a") + _m3el("tags", "b")) + _ME, None,
      ("configure", {"tags": ["a", "b"]})),
    C("m2-parameter-spelling", _MB + _m3("get_weather", f'{_NS}<parameter name="city">Oslo{_NS}</parameter>\n'
      + _m3el("days", "3")) + _ME, None, OSLO),
    C("tags-as-text-in-value", _MB + _m3("write_file", _m3el("path", "a.html")
      + _m3el("content", "<b>x</b> </content> </tool_call>")) + _ME, None,
      ("write_file", {"path": "a.html", "content": "<b>x</b> </content> </tool_call>"})),
    C("unicode", _MB + _m3("get_weather", _m3el("city", "Zürich ☃ 東京 🌧")) + _ME, None, UNI),
    C("m2-markup-is-text", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Lyon</parameter>'
      "</invoke></minimax:tool_call>", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">Lyon'
      "</parameter></invoke></minimax:tool_call>"),
    C("wrong-close", _MB + _m3("get_weather", f"{_NS}<city>Oslo{_NS}</days>\n") + _ME,
      _MB + _m3("get_weather", f"{_NS}<city>Oslo{_NS}</days>\n") + _ME),
    C("truncated", "Hi " + _MB + _m3("get_weather", _m3el("city", "Os"))[:-12], "Hi " + _MB
      + _m3("get_weather", _m3el("city", "Os"))[:-12]),
    # The token is one sampled token per tag: outputs in the wild drop it or space it out.
    C("token-dropped-on-block-open", "Checking.\n<tool_call>\n" + _m3("get_weather", _m3el("city", "Lyon")) + _ME,
      "Checking.", LYON),
    C("token-dropped-on-value-closes", _MB + f'{_NS}<invoke name="get_weather">{_NS}<city>Oslo</city>{_NS}<days>3</days>'
      f"{_NS}</invoke>\n" + _ME, None, OSLO),
    C("token-dropped-on-invoke-and-block-close", _MB + f'{_NS}<invoke name="get_weather">{_NS}<city>Lyon{_NS}</city>'
      "</invoke>\n</tool_call>", None, LYON),
    C("whitespace-after-token", _MB + f'{_NS}\n<invoke name="get_weather">{_NS} <city>Lyon{_NS}\n</city>{_NS}\n</invoke>'
      f"{_NS}\n</tool_call>", None, LYON),
    C("token-dropped-on-nested-closes", _MB + _m3("configure", f"{_NS}<tags>{_NS}<item>a</item>{_NS}<item>b</item>"
      f"{_NS}</tags>\n") + _ME, None, ("configure", {"tags": ["a", "b"]})),
    C("bare-close-in-value-with-real-close", _MB + _m3("write_file", _m3el("content", "x </content> y")) + _ME, None,
      ("write_file", {"content": "x </content> y"})),
    C("bare-block-without-token-is-text", '<tool_call>\n<invoke name="get_weather"><city>Oslo</city></invoke>\n'
      "</tool_call>", '<tool_call>\n<invoke name="get_weather"><city>Oslo</city></invoke>\n</tool_call>'),
    C("hermes-json-is-text", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
      '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
]

_TS, _TE = "<|tool_call_start|>", "<|tool_call_end|>"
PYTHONIC = [
    C("single", '[get_weather(city="Oslo", days=3)]', None, OSLO),
    C("parallel", '[get_weather(city="Oslo", days=3), get_weather(city="Lyon")]', None, OSLO, LYON),
    C("zero-args", "[list_files()]", None, NOARGS),
    C("typed", "[configure(enabled=True, ratio=0.5, tags=['a', 'b'], opts={'k': 1, 'z': None})]", None, CONF),
    C("json-literals-in-containers", '[configure(enabled=true, ratio=5e-1, tags=["a", "b"], opts={"k": 1, "z": null})]',
      None, CONF),
    C("unicode", "[get_weather(city='Zürich ☃ 東京 🌧')]", None, UNI),
    C("brackets-in-string", '[write_file(path="a.py", content="x = f(a[1])]) # \\"q\\"")]', None,
      ("write_file", {"path": "a.py", "content": 'x = f(a[1])]) # "q"'})),
    C("coerce-string-int", '[get_weather(city="Oslo", days="3")]', None, OSLO),
    C("invalid-escape", '[search(regex="^v\\d+\\.\\d+$")]', None, ("search", {"regex": "^v\\d+\\.\\d+$"})),
    C("escaped-quote-and-raw-string", "[search(regex=r'a\\'b')]", None, ("search", {"regex": "a\\'b"})),
    C("lfm2-wrapped", _TS + '[get_weather(city="Oslo", days=3)]' + _TE, None, OSLO),
    C("lfm2-call-after-text", "Let me check.\n" + _TS + '[get_weather(city="Lyon")]' + _TE, "Let me check.", LYON),
    C("lfm2-text-after-call", _TS + '[get_weather(city="Lyon")]' + _TE + "\nChecking now.", "Checking now.", LYON),
    C("llama4-python-start", '<|python_start|>[get_weather(city="Oslo", days=3), list_files()]<|python_end|>', None,
      OSLO, NOARGS),
    C("bare-then-text", '[get_weather(city="Lyon")] is the call.', '[get_weather(city="Lyon")] is the call.'),
    C("bare-after-text", 'Call [get_weather(city="Lyon")]', 'Call [get_weather(city="Lyon")]'),
    C("bare-unknown-tool", '[launch(x=1)]', "[launch(x=1)]"),
    C("json-list-answer", '[{"city": "Oslo", "temp": 3}, 2]', '[{"city": "Oslo", "temp": 3}, 2]'),
    C("positional-arg", '[get_weather("Oslo")]', '[get_weather("Oslo")]'),
    C("malformed", _TS + "[get_weather(city=Oslo Lyon)]" + _TE, _TS + "[get_weather(city=Oslo Lyon)]" + _TE),
    C("truncated", _TS + '[get_weather(city="Os', _TS + '[get_weather(city="Os'),
    C("bare-truncated", '[get_weather(city="Oslo"', '[get_weather(city="Oslo"'),
    # LFM2.5's template writes strings between quotes unescaped and names verbatim
    C("lfm2-raw-newline-in-string", _TS + "[write_file(path='a.py', content='def f():\n    return 1\n')]" + _TE, None,
      ("write_file", {"path": "a.py", "content": "def f():\n    return 1\n"})),
    C("lfm2-hyphenated-name", _TS + "[save-snippet(lang='js', code='x-y(1)')]" + _TE, None,
      ("save-snippet", {"lang": "js", "code": "x-y(1)"})),
    C("lfm2-python-reprs", _TS + "[configure(enabled=True, ratio=0.5, tags=['a', 'b'], opts={\"k\": 1, \"z\": null})]" + _TE,
      None, CONF),
]

_K3B, _K3E = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"


def _k3(name: str, *args: tuple[str, str, str], idx: int = 1) -> str:
    body = "".join(f'\n    <|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'\n  <|open|>call tool="{name}" index="{idx}"<|sep|>{body}\n  <|close|>call<|sep|>'


_K3_OSLO = _k3("get_weather", ("city", "string", "Oslo"), ("days", "integer", "3"))
KIMI_K3 = [
    C("single", _K3B + _K3_OSLO + "\n" + _K3E, None, OSLO),
    C("parallel", _K3B + _K3_OSLO + _k3("get_weather", ("city", "string", "Lyon"), idx=2) + "\n" + _K3E, None, OSLO, LYON),
    C("zero-args", _K3B + '<|open|>call tool="list_files" index="1"<|sep|><|close|>call<|sep|>' + _K3E, None, NOARGS),
    C("typed", _K3B + _k3("configure", ("enabled", "boolean", "true"), ("ratio", "number", "0.5"),
                          ("tags", "array", '["a", "b"]'), ("opts", "object", '{"k": 1, "z": null}')) + _K3E, None, CONF),
    C("string-type-keeps-json-text", _K3B + _k3("write_file", ("path", "string", "a.json"),
                                                ("content", "string", '{"k": 1}')) + _K3E, None,
      ("write_file", {"path": "a.json", "content": '{"k": 1}'})),
    C("json-block", _K3B + '<|open|>call tool="get_weather" index="1"<|sep|><|open|>json type="object"<|sep|>'
      '{"city": "Oslo", "days": 3}<|close|>json<|sep|><|close|>call<|sep|>' + _K3E, None, OSLO),
    C("json-block-invalid-escape", _K3B + '<|open|>call tool="search"<|sep|><|open|>json type="object"<|sep|>'
      '{"regex": "^\\d+"}<|close|>json<|sep|><|close|>call<|sep|>' + _K3E, None, ("search", {"regex": "^\\d+"})),
    C("unicode", _K3B + _k3("get_weather", ("city", "string", "Zürich ☃ 東京 🌧")) + _K3E, None, UNI),
    C("escaped-attr", _K3B + '<|open|>call tool="write_file"<|sep|><|open|>argument key="content" type="string"<|sep|>'
      'say "hi" & <b><|close|>argument<|sep|><|close|>call<|sep|>' + _K3E, None, ("write_file", {"content": 'say "hi" & <b>'})),
    C("call-after-text", "Let me look.\n" + _K3B + _K3_OSLO + _K3E, "Let me look.", OSLO),
    C("text-after-call", _K3B + _K3_OSLO + _K3E + "\nDone.", "Done.", OSLO),
    C("json-answer-not-a-call", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    C("no-tool-name", _K3B + '<|open|>call index="1"<|sep|><|close|>call<|sep|>' + _K3E,
      _K3B + '<|open|>call index="1"<|sep|><|close|>call<|sep|>' + _K3E),
    C("bad-json-block", _K3B + '<|open|>call tool="f"<|sep|><|open|>json<|sep|>[1, 2]<|close|>json<|sep|><|close|>call<|sep|>'
      + _K3E, _K3B + '<|open|>call tool="f"<|sep|><|open|>json<|sep|>[1, 2]<|close|>json<|sep|><|close|>call<|sep|>' + _K3E),
    C("truncated", "Hi " + _K3B + _K3_OSLO, "Hi " + _K3B + _K3_OSLO),
]


def _cpm(name: str, **params: str) -> str:
    body = "".join(f'<param name="{k}">{v}</param>' for k, v in params.items())
    return f'<function name="{name}">{body}</function>'


MINICPM5 = [
    C("single", _cpm("get_weather", city="Oslo", days="3"), None, OSLO),
    C("parallel", _cpm("get_weather", city="Oslo", days="3") + "\n" + _cpm("get_weather", city="Lyon"), None, OSLO, LYON),
    C("zero-args", '<function name="list_files"></function>', None, NOARGS),
    C("typed", _cpm("configure", enabled="true", ratio="0.5", tags='["a", "b"]', opts='{"k": 1, "z": null}'), None, CONF),
    C("cdata", _cpm("write_file", path="a.c", content="<![CDATA[if (a < b && c) {\n  </param> x;\n}\n]]>"), None,
      ("write_file", {"path": "a.c", "content": "if (a < b && c) {\n  </param> x;\n}\n"})),
    C("close-tag-in-bare-value", _cpm("write_file", path="a", content="x </param> y"), None,
      ("write_file", {"path": "a", "content": "x </param> y"})),
    C("spaced-and-newlines", '<function name="get_weather">\n<param name="city"> Oslo </param>\n<param name="days">3</param>\n'
      "</function>", None, OSLO),
    C("unicode", _cpm("get_weather", city="Zürich ☃ 東京 🌧"), None, UNI),
    C("unquoted-and-single-quoted-names", "<function name=get_weather><param name='city'>Oslo</param>"
      "<param name=days>3</param></function>", None, OSLO),
    C("uncoercible", _cpm("get_weather", city="Oslo", days="a few"), None, ("get_weather", {"city": "Oslo", "days": "a few"})),
    C("call-after-text", "Let me check.\n" + _cpm("get_weather", city="Lyon"), "Let me check.", LYON),
    C("text-after-call", _cpm("get_weather", city="Lyon") + "\nDone.", "Done.", LYON),
    C("json-answer-not-a-call", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    C("tag-in-prose", 'Write <function name="x"> tags.', 'Write <function name="x"> tags.'),
    C("truncated", _cpm("get_weather", city="Lyon")[:-11], _cpm("get_weather", city="Lyon")[:-11]),
    C("malformed", '<function name="get_weather"><param name="city">Lyon</function>',
      '<function name="get_weather"><param name="city">Lyon</function>'),
]

_AB, _AE = "<atem:function_calls>\n", "</atem:function_calls>"


def _atem(fn: str, **params: str) -> str:
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params.items())
    return f'<atem:invoke name="{fn}">\n{body}</atem:invoke>\n'


MUSE_SPARK = [
    C("single", _AB + _atem("get_weather", city="Oslo", days="3") + _AE, None, OSLO),
    C("parallel", _AB + _atem("get_weather", city="Oslo", days="3") + _atem("get_weather", city="Lyon") + _AE, None,
      OSLO, LYON),
    C("zero-args", _AB + '<atem:invoke name="list_files"></atem:invoke>' + _AE, None, NOARGS),
    C("typed", _AB + _atem("configure", enabled="true", ratio="0.5", tags='["a", "b"]', opts='{"k": 1, "z": null}') + _AE,
      None, CONF),
    # without tools (no schema, no offered-tool check), values are read as JSON
    C("undeclared-values-read-as-json", _AB + _atem("launch", n="3", flag="false", who="Ada") + _AE, None,
      ("launch", {"n": 3, "flag": False, "who": "Ada"}), tools=None),
    C("string-param-keeps-digits", _AB + _atem("write_file", path="42", content=" x ") + _AE, None,
      ("write_file", {"path": "42", "content": "x"})),
    C("extra-attributes", _AB + '<atem:invoke id="1" name="get_weather"><atem:parameter name="city" type="string">Lyon'
      "</atem:parameter></atem:invoke>" + _AE, None, LYON),
    C("close-tag-in-value", _AB + _atem("write_file", path="a", content="x </atem:parameter> y") + _AE, None,
      ("write_file", {"path": "a", "content": "x </atem:parameter> y"})),
    C("unicode", _AB + _atem("get_weather", city="Zürich ☃ 東京 🌧") + _AE, None, UNI),
    C("call-after-text", "Checking.\n" + _AB + _atem("get_weather", city="Lyon") + _AE, "Checking.", LYON),
    C("text-after-call", _AB + _atem("get_weather", city="Lyon") + _AE + "\nDone.", "Done.", LYON),
    C("json-answer-not-a-call", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    C("unclosed-invoke", _AB + '<atem:invoke name="get_weather"><atem:parameter name="city">Lyon</atem:parameter>' + _AE,
      _AB.strip() + '\n<atem:invoke name="get_weather"><atem:parameter name="city">Lyon</atem:parameter>' + _AE),
    C("truncated", _AB + _atem("get_weather", city="Lyon"), _AB + _atem("get_weather", city="Lyon")),
]

def _glm(name: str, **params: str) -> str:
    return "<tool_call>" + name + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in params.items()) \
        + "</tool_call>"


# Laguna (Poolside) emits the GLM-4.7 format: mlx-lm's laguna parser is its glm47 one.
GLM += [
    C("laguna-zero-args-compact", "Listing.<tool_call>list_files</tool_call>", "Listing.", NOARGS),
    C("laguna-typed", _glm("configure", enabled="true", ratio="0.5", tags='["a", "b"]', opts='{"k": 1, "z": null}'), None,
      CONF),
    C("laguna-unicode", _glm("get_weather", city="Zürich ☃ 東京 🌧"), None, UNI),
    C("laguna-text-after", _glm("get_weather", city="Lyon") + "\nDone.", "Done.", LYON),
    C("laguna-parallel-no-space", _glm("get_weather", city="Oslo", days="3") + _glm("get_weather", city="Lyon"), None,
      OSLO, LYON),
    C("json-answer-not-a-call", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
]

_G4 = '<|tool_call>call:{}{{{}}}<tool_call|>'
GEMMA += [
    C("gemma4-zero-args", _G4.format("list_files", ""), None, NOARGS),
    C("gemma4-typed", _G4.format("configure", 'enabled:true,ratio:0.5,tags:[<|"|>a<|"|>,<|"|>b<|"|>],opts:{k:1,z:null}'),
      None, CONF),
    C("gemma4-unicode", _G4.format("get_weather", 'city:<|"|>Zürich ☃ 東京 🌧<|"|>'), None, UNI),
    C("gemma4-two-calls-one-block", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}call:list_files{}<tool_call|>',
      None, OSLO, NOARGS),
    C("gemma4-call-after-text", "Let me check.\n" + _G4.format("get_weather", 'city:<|"|>Lyon<|"|>'), "Let me check.", LYON),
    C("gemma4-text-after-call", _G4.format("get_weather", 'city:<|"|>Lyon<|"|>') + "\nDone.", "Done.", LYON),
    C("json-answer-not-a-call", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    C("gemma4-truncated", '<|tool_call>call:get_weather{city:<|"|>Ly', '<|tool_call>call:get_weather{city:<|"|>Ly'),
    # Gemma 4's template: keys sorted, nested keys bare, a null printed as Jinja prints None
    C("gemma4-template-null", _G4.format("configure", 'opts:{k:<|"|>v<|"|>,z:None},tags:[None,1]'), None,
      ("configure", {"opts": {"k": "v", "z": None}, "tags": [None, 1]})),
]


def _hcall(name: str, args: str, end: str = "<|call|>", constrain: str = " <|constrain|>json") -> str:
    return f"<|start|>assistant<|channel|>commentary to=functions.{name}{constrain}<|message|>{args}{end}"


_HA = "<|channel|>analysis<|message|>The user wants weather. {\"city\": 1} maybe.<|end|>"
_HF = "<|start|>assistant<|channel|>final<|message|>"
HARMONY = [
    C("single", _hcall("get_weather", '{"city": "Oslo", "days": 3}'), None, OSLO),
    C("channel-first-no-start", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
      '{"city":"Oslo","days":3}<|call|>', None, OSLO),
    C("call-token-not-fed", _hcall("get_weather", '{"city": "Lyon"}', end=""), None, LYON),
    C("recipient-before-channel", '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
      '{"city": "Lyon"}<|call|>', None, LYON),
    C("no-constrain", _hcall("get_weather", '{"city": "Lyon"}', constrain=""), None, LYON),
    C("constrain-no-space", _hcall("get_weather", '{"city": "Lyon"}', constrain="<|constrain|>json"), None, LYON),
    # a built-in tool's recipient parses as a call; with tools offered it must be one of them
    C("other-recipient", '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>',
      None, ("browser.search", {"query": "x"}), tools=None),
    C("parallel", _hcall("get_weather", '{"city": "Oslo", "days": 3}') + _hcall("get_weather", '{"city": "Lyon"}'), None,
      OSLO, LYON),
    C("zero-args", _hcall("list_files", "{}"), None, NOARGS),
    C("typed", _hcall("configure", '{"enabled": true, "ratio": 0.5, "tags": ["a", "b"], "opts": {"k": 1, "z": null}}'),
      None, CONF),
    C("unicode", _hcall("get_weather", '{"city": "Zürich ☃ 東京 🌧"}'), None, UNI),
    C("invalid-escape", _hcall("search", '{"regex": "^v\\d+"}'), None, ("search", {"regex": "^v\\d+"})),
    C("analysis-then-call", _HA + _hcall("get_weather", '{"city": "Lyon"}'), None, LYON),
    C("preamble-then-call", "<|channel|>commentary<|message|>Checking the weather.<|end|>"
      + _hcall("get_weather", '{"city": "Lyon"}'), "Checking the weather.", LYON),
    C("final-answer", _HA + _HF + "It is 3 °C in Oslo.<|return|>", "It is 3 °C in Oslo."),
    C("final-answer-return-not-fed", _HF + "Done.", "Done."),
    C("json-answer-not-a-call", _HF + '{"city": "Oslo", "temp": 3}<|return|>', '{"city": "Oslo", "temp": 3}'),
    C("body-not-json", _hcall("get_weather", "city=Oslo"), "<|start|>assistant<|channel|>commentary to=functions."
      "get_weather <|constrain|>json<|message|>city=Oslo"),
    C("text-after-json", _hcall("get_weather", '{"city": "Lyon"} then', end=""), "<|start|>assistant<|channel|>commentary "
      'to=functions.get_weather <|constrain|>json<|message|>{"city": "Lyon"} then'),
    C("truncated", _hcall("get_weather", '{"city": "Ly', end=""),
      '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Ly'),
    C("marker-words-in-prose", "Use <|channel|> tokens, like <|start|> here", "Use <|channel|> tokens, like <|start|> here"),
    # gpt-oss's chat template: "<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>",
    # and its generation prompt ends "<|start|>assistant", so a reply that calls at once starts with " to=".
    C("template-call-right-after-prompt", ' to=functions.get_weather<|channel|>commentary json<|message|>'
      '{"city": "Oslo", "days": 3}<|call|>', None, OSLO),
    C("template-call-call-token-not-fed", ' to=functions.list_files<|channel|>commentary json<|message|>{}', None, NOARGS),
    C("template-call-after-analysis", _HA + '<|start|>assistant to=functions.get_weather<|channel|>commentary json'
      '<|message|>{"city": "Lyon"}<|call|>', None, LYON),
    C("code-instead-of-constrain", '<|channel|>commentary to=functions.get_weather code<|message|>{"city": "Lyon"}<|call|>',
      None, LYON),
    C("to-later-in-prose", "Send it to= the team", "Send it to= the team"),
    C("to-at-start-not-a-header", "to=be or not to be", "to=be or not to be"),
]

_T = "｜DSML｜"


def _dsml(name: str, *params: tuple[str, str, str]) -> str:
    body = "".join(f'<{_T}parameter name="{k}" string="{st}">{v}</{_T}parameter>\n' for k, st, v in params)
    return f'<{_T}invoke name="{name}">\n{body}</{_T}invoke>\n'


_DSB, _DSE = f"<{_T}function_calls>\n", f"</{_T}function_calls>"
DSML = [
    C("single", _DSB + _dsml("get_weather", ("city", "true", "Oslo"), ("days", "false", "3")) + _DSE, None, OSLO),
    C("close-tag-in-value", _DSB + _dsml("write_file", ("content", "true", f"a </{_T}parameter> b")) + _DSE, None,
      ("write_file", {"content": f"a </{_T}parameter> b"})),
    C("string-true-keeps-json-text", _DSB + _dsml("write_file", ("path", "true", "42"), ("content", "true", '{"k": 1}'))
      + _DSE, None, ("write_file", {"path": "42", "content": '{"k": 1}'})),
    C("no-string-attribute", _DSB + f'<{_T}invoke name="get_weather">\n<{_T}parameter name="city">Lyon</{_T}parameter>\n'
      f"</{_T}invoke>\n" + _DSE, None, LYON),
    C("bad-json-stays-text", _DSB + _dsml("search", ("regex", "false", "^v\\d+")) + _DSE, None, ("search", {"regex": "^v\\d+"})),
    C("text-after", _DSB + _dsml("get_weather", ("city", "true", "Lyon")) + _DSE + "\nDone.", "Done.", LYON),
    C("json-answer-not-a-call", '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
      '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    C("malformed", _DSB + f'<{_T}invoke name="get weather">\n</{_T}invoke>\n' + _DSE,
      _DSB + f'<{_T}invoke name="get weather">\n</{_T}invoke>\n' + _DSE),
    C("truncated", _DSB + _dsml("get_weather", ("city", "true", "Ly"))[:-20],
      _DSB + _dsml("get_weather", ("city", "true", "Ly"))[:-20]),
]

TABLE: dict[str, list[Case]] = {
    "hermes": HERMES,
    "qwen3_coder_xml": QWEN3_CODER_XML,
    "llama3_json": LLAMA3_JSON,
    "mistral": MISTRAL,
    "gemma": GEMMA,
    "glm": GLM,
    "minimax": MINIMAX,
    "minimax_m3": MINIMAX_M3,
    "kimi_k2": KIMI_K2,
    "longcat": LONGCAT,
    "deepseek": DEEPSEEK,
    "pythonic": PYTHONIC,
    "kimi_k3": KIMI_K3,
    "minicpm5": MINICPM5,
    "muse_spark": MUSE_SPARK,
    "harmony": HARMONY,
    "dsml": DSML,
}

# Outputs rendered from the real chat templates (tests/fixtures/chat_templates/real/).
from tests.unit.tool_parsers.real_templates import real_template_cases  # noqa: E402

for _dialect, _cases in real_template_cases().items():
    TABLE[_dialect] = TABLE[_dialect] + _cases
