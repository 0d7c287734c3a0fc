"""Content a text model cannot read (omlx.engine.content): every kind of every API becomes the one
placeholder where it stood, is counted, and is the old 400 with ``strict_content``. No model."""

from __future__ import annotations

import pytest

from omlx.api.anthropic import chat_input, messages_from_anthropic
from omlx.api.openai import _messages
from omlx.api.responses import input_to_messages
from omlx.cli.serve import serve_flags
from omlx.config import load_config
from omlx.engine.chat import content_text
from omlx.engine.content import KINDS, DroppedContent, placeholder, unreadable_kind
from omlx.errors import InvalidRequestError

PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
PDF = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQ="}

# (API, wire block or part, kind): every type the issue names
ANTHROPIC = [
    ({"type": "image", "source": PNG}, "image"),
    ({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}, "image"),
    ({"type": "document", "source": PDF}, "document"),
    ({"type": "document", "source": {"type": "file", "file_id": "file_1"}}, "document"),
    ({"type": "file", "file_id": "file_1"}, "file"),
    ({"type": "container_upload", "file_id": "file_2"}, "file"),
]
OPENAI = [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}}, "file"),
    ({"type": "input_file", "file_id": "file_1"}, "file"),
]
RESPONSES = [
    ({"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "auto"}, "image"),
    ({"type": "input_image", "file_id": "file_1"}, "image"),
    ({"type": "input_file", "file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}, "file"),
    ({"type": "input_file", "file_url": "https://example.com/a.pdf"}, "file"),
]


def test_the_placeholder_names_the_kind_and_nothing_else():
    assert placeholder("image") == "[image omitted: this model reads text only]"
    assert [placeholder(k) for k in KINDS] == [f"[{k} omitted: this model reads text only]" for k in KINDS]
    for block, kind in ANTHROPIC + OPENAI + RESPONSES:
        assert unreadable_kind(block["type"]) == kind
    for other in ("text", "input_text", "output_text", "tool_use", "tool_result", "thinking", None, 3):
        assert unreadable_kind(other) is None


@pytest.mark.parametrize("block,kind", ANTHROPIC)
def test_anthropic_blocks_become_placeholders_in_a_message_and_in_a_tool_result(block, kind):
    d = DroppedContent()
    msgs = messages_from_anthropic([
        {"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "read 1 file"}, block]}]},
    ], None, d)
    ph = placeholder(kind)
    assert msgs[0] == {"role": "user", "content": f"{ph}\n\nWhat is this?"}
    assert msgs[2] == {"role": "tool", "tool_call_id": "t1", "name": "Read", "content": f"read 1 file\n{ph}"}
    assert d.counts == {kind: 2} and d.num_dropped == 2


def test_an_anthropic_document_with_a_text_source_keeps_its_text():
    d = DroppedContent(strict=True)
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "the notes"}}
    msgs = messages_from_anthropic([{"role": "user", "content": [doc, {"type": "text", "text": "Summarize."}]}], None, d)
    assert msgs == [{"role": "user", "content": "the notes\n\nSummarize."}] and d.counts == {}


def test_the_placeholder_is_the_same_for_any_bytes():
    """Deterministic: a conversation carrying an image renders to one prompt on every turn (the
    prefix cache hits on the next turn)."""
    a = messages_from_anthropic([{"role": "user", "content": [ANTHROPIC[0][0]]}])
    b = messages_from_anthropic([{"role": "user", "content": [{"type": "image", "source": {**PNG, "data": "AAAA"}}]}])
    assert a == b == [{"role": "user", "content": placeholder("image")}]


@pytest.mark.parametrize("block,kind", OPENAI + RESPONSES)
def test_openai_parts_become_placeholders_on_a_line_of_their_own(block, kind):
    d = DroppedContent()
    text = content_text([{"type": "text", "text": "What is"}, {"type": "text", "text": " this?"}, block,
                         {"type": "text", "text": "Be brief."}], dropped=d)
    assert text == f"What is this?\n{placeholder(kind)}\nBe brief."
    assert content_text([block], dropped=d) == placeholder(kind)
    assert d.counts == {kind: 2}


@pytest.mark.parametrize("block,kind", OPENAI)
def test_openai_chat_messages_carry_the_placeholder(block, kind):
    d = DroppedContent()
    msgs = _messages([
        {"role": "user", "content": [block, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [block]},
    ], d)
    assert msgs[0]["content"] == f"{placeholder(kind)}\nDescribe it." and msgs[2]["content"] == placeholder(kind)
    assert msgs[1]["content"] is None and d.counts == {kind: 2}


@pytest.mark.parametrize("block,kind", RESPONSES)
def test_responses_parts_become_placeholders_in_messages_and_function_call_output(block, kind):
    d = DroppedContent()
    msgs = input_to_messages([
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look."}, block]},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}, block]},
    ], dropped=d)
    assert msgs[0] == {"role": "user", "content": f"Look.\n{placeholder(kind)}"}
    assert msgs[2]["content"] == f"ok\n{placeholder(kind)}"
    assert d.counts == {kind: 2}


def test_counts_add_up_over_kinds_and_read_in_one_line():
    d = DroppedContent()
    messages_from_anthropic([{"role": "user", "content": [b for b, _ in ANTHROPIC]}], None, d)
    assert d.counts == {"image": 2, "document": 2, "file": 2}
    assert d.summary() == "2 image, 2 document, 2 file"
    assert DroppedContent().summary() == ""


# ---- strict_content: the 400s of before, naming the block or part ---------------------------------


@pytest.mark.parametrize("block,kind", ANTHROPIC)
def test_strict_anthropic_is_the_old_400_naming_the_block(block, kind):
    for content, param in (([{"type": "text", "text": "hi"}, block], "messages[0].content[1]"),
                           ([{"type": "tool_result", "tool_use_id": "t", "content": [block]}], "messages[0].content[0].content[0]")):
        with pytest.raises(InvalidRequestError) as ei:
            chat_input({"messages": [{"role": "user", "content": content}]}, 16, strict_content=True)
        assert ei.value.param == param
        assert str(ei.value) == f"{param}: content of type {block['type']!r} is not supported by this text model"


@pytest.mark.parametrize("block,kind", OPENAI)
def test_strict_openai_chat_is_the_old_400_naming_the_part(block, kind):
    with pytest.raises(InvalidRequestError) as ei:
        _messages([{"role": "user", "content": "hi"},
                   {"role": "user", "content": [{"type": "text", "text": "x"}, block]}], DroppedContent(strict=True))
    assert ei.value.param == "messages[1].content[1]"
    assert str(ei.value) == f"messages[1].content: content part 1 of type {block['type']!r} is not supported by this text model"


@pytest.mark.parametrize("block,kind", RESPONSES)
def test_strict_responses_is_the_old_400_naming_the_part(block, kind):
    for item, param in (({"type": "message", "role": "user", "content": [block]}, "input[0].content[0]"),
                        ({"type": "function_call_output", "call_id": "c", "output": [block]}, "input[0].output[0]")):
        with pytest.raises(InvalidRequestError) as ei:
            input_to_messages([item], dropped=DroppedContent(strict=True))
        assert ei.value.param == param and "is not supported by this text model" in str(ei.value)


def test_strict_content_is_off_by_default_and_set_by_file_env_and_flag(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("strict_content = true\n")
    assert load_config({}, {}, None).strict_content is False
    assert load_config({}, {}, f).strict_content is True
    assert load_config({}, {"OMLX_STRICT_CONTENT": "1"}, None).strict_content is True
    assert load_config({}, {"OMLX_STRICT_CONTENT": "0"}, f).strict_content is False  # env over file
    assert load_config(serve_flags({"strict_content": True}), {"OMLX_STRICT_CONTENT": "0"}, None).strict_content is True
    assert serve_flags({"strict_content": False})["strict_content"] is None  # not given: env and file decide
