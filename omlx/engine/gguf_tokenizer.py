"""Rebuild the tokenizer a GGUF file describes as `tokenizers` objects and HF tokenizer configs.

Owns: turning `tokenizer.ggml.*` metadata into a `tokenizers.Tokenizer` (saved by the importer as
`tokenizer.json`) and the contents of `tokenizer_config.json` / `special_tokens_map.json`.
Must not: read tensors, write files, or import transformers (its GGUF code needs torch).

Tokenizers: byte-level BPE (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Qwen2, Llama 3) for any
architecture; SentencePiece (`"llama"`) only for gemma3, whose layout (no prefix space, byte
fallback, merges implied by the vocabulary order) is rebuilt as HF's `GemmaTokenizer` has it.
Llama-2-style SentencePiece files (prefix space) raise.

Sources: token types from llama.cpp's `llama_token_type` (1 normal, 2 unknown, 3 control, 4 user
defined, 5 unused, 6 byte); pre-tokenizer regexes from llama.cpp's `llama-vocab.cpp` per
`tokenizer.ggml.pre`; SentencePiece defaults (BOS added, prefix space) from llama.cpp's
`llama_vocab::impl::load`; Gemma's layout from transformers 5.x `models/gemma/tokenization_gemma.py`
and `integrations/gguf/gguf_tokenizer_mapping.py::gemma_tokenizer`, checked token for token
against transformers' GGUF tokenizer (`tests/integration/test_gemma3_import.py`).
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

#: SentencePiece's visible space, U+2581.
_SPM_SPACE = "\u2581"
#: Architectures whose `tokenizer.ggml.model == "llama"` (SentencePiece) vocabulary is rebuilt.
_SENTENCEPIECE_ARCHITECTURES = frozenset({"gemma3"})

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


def adds_bos(metadata: Mapping[str, Any]) -> bool:
    """Whether encoding prepends BOS: `tokenizer.ggml.add_bos_token`, else llama.cpp's default
    for a SentencePiece vocabulary (true, `llama_vocab::impl::load`); false for BPE, as omlx has
    always read it (llama.cpp defaults a few BPE pre-tokenizers, such as llama3, to true)."""
    value = metadata.get("tokenizer.ggml.add_bos_token")
    if value is None:
        return metadata.get("tokenizer.ggml.model") == "llama"
    return bool(value)


def build_tokenizer(metadata: Mapping[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equal to the one the GGUF metadata describes.

    Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): vocabulary and merges come from
    `tokenizer.ggml.tokens` / `.merges`. A SentencePiece vocabulary (`"llama"`) is rebuilt by
    `_build_sentencepiece` for the architectures in `_SENTENCEPIECE_ARCHITECTURES` (gemma3).
    Either way tokens typed control (3) become special added tokens and user-defined (4) plain
    added tokens, so both are matched whole, and BOS is prepended when `adds_bos` says so.

    Raises:
        ModelImportError: no tokenizer, or a tokenizer model this importer does not rebuild.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    kind = metadata.get("tokenizer.ggml.model")
    arch = metadata.get("general.architecture")
    if arch in _SENTENCEPIECE_ARCHITECTURES:
        if kind != "llama":
            raise ModelImportError(f"GGUF tokenizer model {kind!r} for {arch} is not supported (expected 'llama', SentencePiece)")
        return _build_sentencepiece(metadata)
    if kind != "gpt2":
        raise ModelImportError(
            f"GGUF tokenizer model {kind!r} is not supported for architecture {arch!r} (only byte-level BPE, 'gpt2'; "
            f"SentencePiece only for {sorted(_SENTENCEPIECE_ARCHITECTURES)}); import the original folder with its "
            "tokenizer.json instead"
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
    _set_post_processor(tokenizer, metadata, tokens)
    return tokenizer


def _set_post_processor(tokenizer: Any, metadata: Mapping[str, Any], tokens: list[str]) -> None:
    from tokenizers import processors

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if adds_bos(metadata) and bos_id is not None:
        bos = tokens[int(bos_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    elif metadata.get("tokenizer.ggml.model") == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)


def _respell_spaces(token: str) -> str:
    """Gemma's files spell its whitespace tokens with real spaces ("  "); the vocabulary the text
    is matched against (after `" " -> "▁"`) spells them "▁▁". The same rule as transformers'
    `gemma_tokenizer` (integrations/gguf/gguf_tokenizer_mapping.py)."""
    return _SPM_SPACE * len(token) if " " in token and not token.strip() else token


def sentencepiece_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary whose file lists none.

    Every token that is the join of two vocabulary tokens yields those pairs; merges are ranked by
    the joined token's position in the vocabulary, then longest left piece first. For Gemma that
    is SentencePiece's own rule (merge the pair whose join has the highest score): its normal
    tokens' scores fall by 1 per id (`tokenizer.ggml.scores`), while its control, user-defined and
    byte tokens carry -1000 or 0 and would sort wrongly by score. This equals transformers'
    `generate_merges(vocab, {token: -position})` (tokenization_utils_base.py), which its GGUF
    loader uses for gemma.

    Args:
        tokens: the vocabulary by id, whitespace tokens already respelled with "▁".

    Returns:
        `(left, right)` pairs, best first.
    """
    vocab = set(tokens)
    merges: list[tuple[str, str]] = []
    seen: set[str] = set()
    for token in tokens:
        if token in seen:
            continue
        seen.add(token)
        for i in range(len(token) - 1, 0, -1):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _build_sentencepiece(metadata: Mapping[str, Any]) -> Any:
    """Gemma's SentencePiece BPE as a `tokenizers` BPE, the layout of HF's `GemmaTokenizer`.

    Normalizer `" " -> "▁"` and no prefix space (`tokenizer.ggml.add_space_prefix = false`), no
    pre-tokenizer, BPE with byte fallback (a character outside the vocabulary becomes its UTF-8
    bytes as `<0xNN>` tokens), unknown pieces fused into `<unk>`, decoder `"▁" -> " "` + byte
    fallback + fuse (which mlx-lm streams with its SPM detokenizer). Merges come from
    `tokenizer.ggml.merges` if the file has them, else `sentencepiece_merges`. Control tokens are
    special added tokens; user-defined ones (a newline, `<table>`, ...) plain added tokens, except the
    whitespace runs, which merges reach (as transformers does).

    Raises:
        ModelImportError: a prefix space is asked for, or byte tokens are missing.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    if metadata.get("tokenizer.ggml.add_space_prefix", True):  # llama.cpp's default for SentencePiece
        raise ModelImportError(
            "GGUF SentencePiece vocabulary with add_space_prefix = true (Llama-2 style) is not supported; "
            "only Gemma's layout without a prefix space is rebuilt"
        )
    original: list[str] = list(metadata["tokenizer.ggml.tokens"])
    tokens = [_respell_spaces(t) for t in original]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate token strings; later ids win", len(tokens) - len(vocab))
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise ModelImportError(f"SentencePiece vocabulary lacks byte tokens ({missing[0]} and {len(missing) - 1} more)")
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = sentencepiece_merges(tokens)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])

    token_types = list(metadata.get("tokenizer.ggml.token_type", []))
    special = [t for t, kind in zip(original, token_types) if kind == _TOKEN_CONTROL]
    user = [t for t, kind in zip(original, token_types) if kind == _TOKEN_USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    _set_post_processor(tokenizer, metadata, tokens)
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
        "add_bos_token": adds_bos(metadata),
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
