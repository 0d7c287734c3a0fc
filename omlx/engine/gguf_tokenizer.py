"""Rebuild the tokenizer a GGUF file describes as `tokenizers` objects and HF tokenizer configs.

Owns: turning `tokenizer.ggml.*` metadata into a `tokenizers.Tokenizer` (saved by the importer as
`tokenizer.json`) and the contents of `tokenizer_config.json` / `special_tokens_map.json`.
Must not: read tensors, write files, or import transformers (its GGUF code needs torch).

Tokenizers: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) only; SentencePiece files (Gemma,
Llama 2) raise, since a faithful SentencePiece rebuild is not done here.

Sources: token types from llama.cpp's `llama_token_type` (1 normal, 2 unknown, 3 control, 4 user
defined, 5 unused, 6 byte); pre-tokenizer regexes from llama.cpp's `llama-vocab.cpp` per
`tokenizer.ggml.pre`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from omlx.errors import ModelImportError

logger = logging.getLogger(__name__)

# llama_token_type in llama.cpp's llama-vocab.h.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer split regexes, by `tokenizer.ggml.pre` (llama.cpp llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None) -> Any:
    """The `tokenizers` pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name."""
    from tokenizers import Regex, pre_tokenizers

    def split_then_bytes(pattern: str) -> Any:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    if pre == "smollm":
        # llama.cpp splits every digit first, then applies GPT-2's regex; this is also what
        # HuggingFaceTB/SmolLM2's own tokenizer.json says (Digits + ByteLevel).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return split_then_bytes(_QWEN2_SPLIT)
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe"):
        return split_then_bytes(_LLAMA3_SPLIT)
    if pre not in (None, "default", "gpt-2", "gpt2"):
        logger.warning(
            "GGUF pre-tokenizer %r is not known to omlx; using GPT-2's split. Tokenization of numbers "
            "and punctuation may differ from llama.cpp's.",
            pre,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def build_tokenizer(metadata: Mapping[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equal to the one the GGUF metadata describes (byte-level BPE).

    Vocabulary and merges come from `tokenizer.ggml.tokens` / `.merges`; tokens typed control (3)
    become special added tokens and user-defined (4) plain added tokens, so both are matched whole.
    BOS is prepended only if `tokenizer.ggml.add_bos_token` is true.

    Raises:
        ModelImportError: no tokenizer, or a tokenizer model other than `gpt2` (byte-level BPE).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelImportError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "import the original folder with its tokenizer.json instead"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate token strings; later ids win", len(tokens) - len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre")
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as in Qwen2's own tokenizer.json
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()

    token_types = list(metadata.get("tokenizer.ggml.token_type", []))
    special = [t for t, kind_ in zip(tokens, token_types) if kind_ == _TOKEN_CONTROL]
    user = [t for t, kind_ in zip(tokens, token_types) if kind_ == _TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def build_tokenizer_config(metadata: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(tokenizer_config.json, special_tokens_map.json)` contents from GGUF metadata."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types = list(metadata.get("tokenizer.ggml.token_type", []))

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    special_map: dict[str, Any] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        value = token(key)
        if value is not None:
            special_map[name] = value
    special_map["additional_special_tokens"] = [
        t for t, kind in zip(tokens, token_types) if kind == _TOKEN_CONTROL and t not in special_map.values()
    ]
    arch = metadata.get("general.architecture", "")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{arch}.context_length", 2048)),
        **{k: v for k, v in special_map.items() if k != "additional_special_tokens"},
        "additional_special_tokens": special_map["additional_special_tokens"],
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config, special_map
