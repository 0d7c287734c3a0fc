"""`render_prompt` leaves the tools out only for a chat template that provably never reads them
(`omlx.engine.chat.template_reads_tools`, decided once per model: `LoadedModel.template_reads_tools`),
and the prompt is then the very text it was with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from omlx.engine import chat
from omlx.api.prepare import render_fitting
from omlx.engine.chat import render_prompt, template_reads_tools
from omlx.engine.loader import LoadedModel
from tests.helpers import default_model_dir

ROOT = Path(__file__).resolve().parents[3]
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 50, "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "description": "a file"}}, "required": ["path"]}}}
    for i in range(24)]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list the files"}]


def _tokenizer(tmp_path: Path, template: str | dict | None) -> TokenizerWrapper:
    src = Path(default_model_dir())
    dest = tmp_path / "tok"
    dest.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json", "config.json"):
        shutil.copy(src / name, dest / name)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    if template is not None:
        tc["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    return load_tokenizer(dest)


def _both(tok: TokenizerWrapper) -> tuple[str, str]:
    new = render_prompt(tok, MESSAGES, tools=TOOLS, reads_tools=template_reads_tools(tok)).text
    return new, render_prompt(tok, MESSAGES, tools=TOOLS, reads_tools=True).text  # the old way: always pass them


def test_a_template_that_never_names_tools_renders_the_same_text_without_them(tmp_path, monkeypatch):
    tok = _tokenizer(tmp_path, None)  # SmolLM2's own template, the default model's
    assert not template_reads_tools(tok)
    calls: list[dict] = []
    apply = tok._tokenizer.apply_chat_template  # watched on the instance: a class of its own would count as one
    monkeypatch.setattr(tok._tokenizer, "apply_chat_template", lambda *a, **kw: calls.append(kw) or apply(*a, **kw))
    new, old = _both(tok)
    assert new == old and "tools" not in calls[0] and calls[1]["tools"] == TOOLS


@pytest.mark.parametrize("template", [
    (ROOT / "tests" / "fixtures" / "chat_templates" / "chatml_tools_thinking.jinja").read_text(),
    "{# tools are never shown #}{% for m in messages %}{{ m['content'] }}{% endfor %}",  # named in a comment: kept
    {"default": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "tool_use": "{% for m in messages %}TOOL {{ m['content'] }}{% endfor %}"},  # tools pick the template
], ids=["renders-tools", "names-tools", "template-dict"])
def test_a_template_that_may_read_tools_gets_them(tmp_path, template):
    tok = _tokenizer(tmp_path, template)
    assert template_reads_tools(tok)
    new, old = _both(tok)
    assert new == old


def test_the_check_runs_once_per_model_not_per_request(tmp_path, monkeypatch):
    """It ran inside every render (each truncation step too): the model now carries it."""
    tok = _tokenizer(tmp_path, None)
    loaded = LoadedModel("smol", tmp_path / "tok", None, tok, {}, 8192, ())
    assert loaded.template_reads_tools is False

    def no_more_checks(_tok):
        raise AssertionError("template_reads_tools ran for a request")

    monkeypatch.setattr(chat, "template_reads_tools", no_more_checks)
    rendered = render_fitting(tok, [dict(m) for m in MESSAGES], tools=TOOLS, reads_tools=loaded.template_reads_tools,
                              context_length=8192, truncate=True, thinking=None)
    assert rendered.text == render_prompt(tok, MESSAGES, tools=TOOLS, reads_tools=True).text


def test_mlx_lm_keeps_a_python_chat_template_where_the_check_looks(tmp_path):
    """`template_reads_tools` relies on mlx-lm's TokenizerWrapper holding a Python chat template
    (a model's ``chat_template.py``) in ``_chat_template``: this fails when that changes."""
    hf = _tokenizer(tmp_path, None)._tokenizer

    def python_template(messages, **kw):  # may read the tools however it likes
        return "".join(m["content"] for m in messages) + json.dumps(kw.get("tools"))

    tok = TokenizerWrapper(hf, chat_template=python_template)
    assert tok._chat_template is python_template and template_reads_tools(tok)
    assert "tool_0" in render_prompt(tok, MESSAGES, tools=TOOLS, reads_tools=template_reads_tools(tok)).text
