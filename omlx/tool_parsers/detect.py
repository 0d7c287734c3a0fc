"""Picks a model's tool-call dialect from its chat template and tokenizer vocabulary.

It owns only the detection rules (their order matters: several families share ``<tool_call>``).
It must not import any dialect module, so detection stays cheap.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

_DEEPSEEK = "<｜tool▁calls▁begin｜>"
_MINIMAX_NS = "]<]minimax[>["  # MiniMax-M3's namespace token, before every tool-call tag

# (dialect, markers that must all be in the template), first match wins.
_TEMPLATE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("minimax_m3", (_MINIMAX_NS,)),  # before hermes/qwen: its tags are <tool_call>, <invoke name=
    ("minimax", ("<minimax:tool_call>",)),
    ("muse_spark", ("<atem:function_calls>",)),
    ("gemma", ("<|tool_call>", "<tool_call|>")),
    ("gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm", ("<tool_call>", "<arg_key>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("kimi_k3", ("<|open|>tools<|sep|>",)),
    ("kimi_k3", ("<|open|>", "<|sep|>", "call tool=")),
    ("kimi_k3", ("<|open|>", "<|close|>", "<|sep|>")),  # the real template builds its tags in macros
    ("dsml", ("｜DSML｜",)),  # DeepSeek-V3.2: before deepseek (its vocabulary keeps V3's tokens)
    ("deepseek", (_DEEPSEEK,)),
    ("qwen3_coder_xml", ("<tool_call>", "<function=")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("minicpm5", ("<function name=", "<param name=")),
    ("harmony", ("<|channel|>", "<|call|>")),
    ("pythonic", ("<|tool_call_start|>",)),  # LFM2
    ("pythonic", ("[func_name1(",)),  # the Llama 3.2 / Llama 4 pythonic templates' instruction
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ("<|start_header_id|>", '"parameters": ')),
    ("hermes", ("<tool_call>",)),
)

# mlx-lm's Python chat templates (tokenizer_config's ``chat_template_type``, a module of
# ``mlx_lm.chat_templates``) -> the dialect their output is in. Such a model has no Jinja template
# text to read, and DeepSeek-V3.2's vocabulary still holds V3's call tokens.
_TEMPLATE_TYPES: dict[str, str] = {"deepseek_v32": "dsml", "muse_spark": "muse_spark"}

# (dialect, tokens that must all be in the vocabulary), used when the template decides nothing.
_VOCAB_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("minimax_m3", (_MINIMAX_NS,)),
    ("minimax", ("<minimax:tool_call>",)),
    ("muse_spark", ("<atem:function_calls>",)),
    ("gemma", ("<|tool_call>", "<tool_call|>")),
    ("gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm", ("<tool_call>", "<arg_key>")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("kimi_k3", ("<|open|>", "<|sep|>", "<|close|>")),
    ("deepseek", (_DEEPSEEK,)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("pythonic", ("<|tool_call_start|>", "<|tool_call_end|>")),
    ("harmony", ("<|channel|>", "<|constrain|>", "<|call|>")),
    ("llama3_json", ("<|python_tag|>",)),
    ("hermes", ("<tool_call>", "</tool_call>")),
)


def detect_dialect(
    chat_template: str | None, vocab: Collection[str] | Mapping[str, int] | None,
    template_type: str | None = None,
) -> str | None:
    """Returns the tool dialect a model speaks, or None if it has no (supported) tool format.

    Args:
        chat_template: the Jinja chat template text, or None if the tokenizer has none.
        vocab: token strings (a set, or ``tokenizer.get_vocab()``'s token -> id dict), or None.
        template_type: tokenizer_config.json's ``chat_template_type`` (mlx-lm's Python chat
            templates, e.g. ``deepseek_v32``); it decides first when it names a known one.

    Returns:
        A registry name, or None when the template never mentions tools, or no rule matches.
        A template that mentions tools without a known marker falls back to the vocabulary
        (some conversions keep the tool tokens but not the template text).
    """
    if template_type in _TEMPLATE_TYPES:
        return _TEMPLATE_TYPES[template_type]
    if isinstance(chat_template, str):
        if "tool" not in chat_template.lower():
            return None
        for dialect, markers in _TEMPLATE_RULES:
            if all(m in chat_template for m in markers):
                return dialect
    if vocab:
        for dialect, tokens in _VOCAB_RULES:
            if all(t in vocab for t in tokens):
                return dialect
    return None
