"""Model outputs rendered from real chat templates (tests/fixtures/chat_templates/real/).

Each template renders an assistant turn that makes tool calls, the way the model was trained to
write it: transformers' own renderer (``render_jinja_template``, what
``tokenizer.apply_chat_template`` runs), tools as JSON schemas and the calls' arguments as
objects. The text after the template's assistant header, up to its end-of-turn marker and with
a leading (empty) reasoning block removed, is what the model emits for those calls; the shared
suite (test_common.py) parses each one whole, per character and in random chunkings.

Facts about each template (its source and licence) are in the README next to the fixtures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "chat_templates" / "real"

OSLO = ("get_weather", {"city": "Oslo", "days": 3})
LYON = ("get_weather", {"city": "Lyon"})
NOARGS = ("list_files", {})
TYPED = ("configure", {"enabled": True, "ratio": 0.5, "tags": ["a", "b"], "opts": {"mode": "fast", "deep": {"x": "y"}}})
UNICODE = ("write_file", {"path": "007.md", "content": 'Zürich ☃ 東京 🌧\n  <b>x</b> "q" {y}\n'})
HYPHEN = ("save-snippet", {"lang": "js", "code": 'f = () => { return {ok: "y"}; };'})

# (id, assistant content, calls)
SCENARIOS: list[tuple[str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    ("one-call", None, [OSLO]),
    ("parallel", None, [OSLO, LYON]),
    ("parallel-after-text", "Let me check both.", [OSLO, LYON]),
    ("zero-args", None, [NOARGS]),
    ("typed-values", None, [TYPED]),
    ("unicode-multiline-string", None, [UNICODE]),
    ("hyphenated-name", None, [HYPHEN]),
    # MiniMax-M3's to_xml drops a None, so this one is not rendered for it
    ("null-values", None, [("configure", {"opts": {"k": "v", "z": None}, "tags": [None, 1]})]),
]


@dataclass(frozen=True)
class Spec:
    """How to cut the model's output out of one template's rendering.

    Attributes:
        file: the template under FIXTURES.
        dialect: the omlx dialect that must read it (and that detection must pick).
        header: the assistant turn's header; the output starts after its last occurrence.
        end: the end-of-turn marker the output stops before; None: the turn has none (the
            model's stop token is the next turn's header), the output runs to the end.
        think: a reasoning block the template writes first, as a regex removed at the start.
        id_style: how call ids look where the template writes them (``kimi``: functions.NAME:I,
            ``mistral``: 9 alphanumerics).
        args_as_string: the template concatenates the arguments, so they are passed as JSON text.
        parallel: the template renders several calls in one turn (Llama 3.1 raises).
        with_content: the template renders content beside calls (some drop it).
        none_content: a call-only turn is passed with content None (DeepSeek-R1 renders any
            string content as a second assistant turn).
        kwargs: extra template variables.
    """

    file: str
    dialect: str
    header: str
    end: str | None
    think: str | None = None
    id_style: str = "openai"
    args_as_string: bool = False
    parallel: bool = True
    with_content: bool = True
    none_content: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)


SPECS: list[Spec] = [
    Spec("glm-4.6.jinja", "glm", "<|assistant|>", None, think=r"\n?<think>.*?</think>\n?"),
    Spec("glm-4.7.jinja", "glm", "<|assistant|>", None, think=r"<think>.*?</think>|</think>"),
    Spec("glm-5.3-flash.jinja", "glm", "<|assistant|>", None, think=r"<think>.*?</think>"),
    Spec("minimax-m2.jinja", "minimax", "]~b]ai\n", "[e~[", think=r"<think>.*?</think>\n*"),
    Spec("deepseek-v3.1.jinja", "deepseek", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", think=r"</think>",
         args_as_string=True, kwargs={"bos_token": "<｜begin▁of▁sentence｜>"}),
    Spec("kimi-k2-thinking.jinja", "kimi_k2", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>",
         think=r"<think>.*?</think>", id_style="kimi"),
    Spec("kimi-k3.jinja", "kimi_k3", '<|open|>message role="assistant"<|sep|>', "<|end_of_msg|>",
         think=r"<\|open\|>think<\|sep\|>.*?<\|close\|>think<\|sep\|>"),
    Spec("gemma-4.jinja", "gemma", "<|turn>model\n", "<turn|>", kwargs={"bos_token": "<bos>"}),
    Spec("lfm2.5.jinja", "pythonic", "<|im_start|>assistant\n", "<|im_end|>", kwargs={"bos_token": "<|startoftext|>"}),
    Spec("qwen3.jinja", "hermes", "<|im_start|>assistant\n", "<|im_end|>", think=r"<think>\n.*?\n</think>\n\n"),
    Spec("qwen3-coder.jinja", "qwen3_coder_xml", "<|im_start|>assistant\n", "<|im_end|>"),
    Spec("llama-3.1.jinja", "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>",
         parallel=False, with_content=False, kwargs={"bos_token": "<|begin_of_text|>", "date_string": "26 Jul 2024"}),
    Spec("deepseek-r1.jinja", "deepseek", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", args_as_string=True,
         with_content=False, none_content=True, kwargs={"bos_token": "<｜begin▁of▁sentence｜>"}),
    Spec("mistral-small-3.1.jinja", "mistral", "[/INST]", "</s>", id_style="mistral", with_content=False,
         kwargs={"bos_token": "<s>", "eos_token": "</s>"}),
]


def _tools() -> list[dict[str, Any]]:
    from tests.unit.tool_parsers.dialect_cases import TOOLS

    return TOOLS


def _call_id(style: str, name: str, i: int) -> str:
    if style == "kimi":
        return f"functions.{name}:{i}"
    return f"a1B2c3D4{i}" if style == "mistral" else f"call{i:05d}"


def renders(spec: Spec, content: str | None, calls: list[Any]) -> bool:
    """Whether the template can render this scenario at all."""
    return (spec.parallel or len(calls) == 1) and (spec.with_content or not content)


def render_output(spec: Spec, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Renders one assistant turn with ``calls`` through ``spec``'s template; returns the model's part.

    Raises:
        AssertionError: the rendering has no assistant header or end marker after it.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (FIXTURES / spec.file).read_text(encoding="utf-8")
    tool_calls = [
        {
            "id": _call_id(spec.id_style, name, i),
            "type": "function",
            "function": {
                "name": name,
                "arguments": json.dumps(args, ensure_ascii=False) if spec.args_as_string else args,
            },
        }
        for i, (name, args) in enumerate(calls)
    ]
    messages = [
        {"role": "user", "content": "Use the tools."},
        # "" rather than None: several templates print a None content as the text "None"
        {"role": "assistant", "content": content or (None if spec.none_content else ""), "tool_calls": tool_calls},
    ]
    rendered, _ = render_jinja_template(
        conversations=[messages], tools=_tools(), chat_template=template, **spec.kwargs
    )
    text = rendered[0]
    start = text.rfind(spec.header)
    assert start >= 0, f"{spec.file}: no assistant header {spec.header!r}"
    out = text[start + len(spec.header) :]
    if spec.end is not None:
        stop = out.find(spec.end)
        assert stop >= 0, f"{spec.file}: no end marker {spec.end!r}"
        out = out[:stop]
    if spec.think:
        out = re.sub("^(?:" + spec.think + ")", "", out, count=1, flags=re.DOTALL)
    return out


def template_text(spec: Spec) -> str:
    return (FIXTURES / spec.file).read_text(encoding="utf-8")


# MiniMax-M3: its chat_template.jinja was not found in any public source here (see the README).
# Its tool-call rendering is known from two independent re-implementations that say they mirror
# it (ModelScope swift's MinimaxM3AgentTemplate and a Tinker M3 renderer), which agree: every
# tag gets the ]<]minimax[>[ token, the ``to_xml`` macro writes an object as child elements, a
# list as <item> children, a bool as true/false, any other scalar as its text, drops None, and
# adds no whitespace inside an <invoke>; content comes first, with nothing between it and the
# block. Until the file itself is found, this function stands in for rendering it.
M3_NS = "]<]minimax[>["


def _m3_xml(value: Any) -> str:
    if isinstance(value, dict):
        return "".join(f"{M3_NS}<{k}>{_m3_xml(v)}{M3_NS}</{k}>" for k, v in value.items() if v is not None)
    if isinstance(value, list):
        return "".join(f"{M3_NS}<item>{_m3_xml(v)}{M3_NS}</item>" for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def minimax_m3_output(content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The text MiniMax-M3 is trained to write for ``calls`` (see the note above)."""
    invokes = "".join(f'{M3_NS}<invoke name="{n}">{_m3_xml(a)}{M3_NS}</invoke>\n' for n, a in calls)
    return (content or "") + f"{M3_NS}<tool_call>\n{invokes}{M3_NS}</tool_call>"


def dsml_output(content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """DeepSeek-V3.2's output for ``calls``, from DeepSeek's own encoder (V3.2 ships Python, not
    Jinja; mlx-lm carries it as ``mlx_lm.chat_templates.deepseek_v32``)."""
    from mlx_lm.chat_templates import deepseek_v32

    tool_calls = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                  for n, a in calls]
    messages = [{"role": "user", "content": "Use the tools."},
                {"role": "assistant", "content": content or "", "tool_calls": tool_calls}]
    text = deepseek_v32.apply_chat_template(messages, enable_thinking=False)
    out = text[text.rfind("<｜Assistant｜>") + len("<｜Assistant｜>") :].removeprefix("</think>")
    return out.removesuffix("<｜end▁of▁sentence｜>")


@cache
def real_template_cases() -> dict[str, list[Any]]:
    """The renders as shared-suite cases, by dialect (ids ``real-<template>-<scenario>``)."""
    from tests.unit.tool_parsers.dialect_cases import Case

    out: dict[str, list[Any]] = {}
    for spec in SPECS:
        stem = spec.file.removesuffix(".jinja")
        for sid, content, calls in SCENARIOS:
            if not renders(spec, content, calls):
                continue
            text = render_output(spec, content, calls)
            expected = [(n, a, _call_id(spec.id_style, n, i)) if spec.id_style != "openai" else (n, a)
                        for i, (n, a) in enumerate(calls)]
            out.setdefault(spec.dialect, []).append(
                Case(f"real-{stem}-{sid}", text, content, expected, _tools()))
    for sid, content, calls in SCENARIOS:
        if sid != "null-values":
            out.setdefault("minimax_m3", []).append(
                Case(f"real-minimax-m3-{sid}", minimax_m3_output(content, calls), content, list(calls), _tools()))
        out.setdefault("dsml", []).append(
            Case(f"real-deepseek-v3.2-{sid}", dsml_output(content, calls), content, list(calls), _tools()))
    return out
