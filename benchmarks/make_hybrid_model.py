"""Write an mlx-lm folder with random bfloat16 weights of a hybrid architecture's shape.

For GPU runs of the prefix cache on cache layouts other than plain attention (no real weights
of these families reach the GPU machine; speed and cache behaviour do not depend on the
weights' values). Vocab 49152, so the SmolLM2 tokenizer files serve as TOKENIZER_DIR
(tokenizer.json, tokenizer_config.json, special_tokens_map.json of the default model's folder).

Usage: python benchmarks/make_hybrid_model.py OUT_DIR SHAPE TOKENIZER_DIR
SHAPE:
    qwen3_5-2b   Qwen3.5-2B-like: 24 layers, every 4th full attention (8 heads x 256, 2 KV heads),
                 the others gated delta-net (16 heads x 128) -> cache layout S2*3,A repeated
    gemma3-1b    Gemma-3-1B-like: 26 layers, sliding window 512 on 5 of every 6
    small-qwen3_5  the same family at hidden size 512, 8 layers (~40M parameters: a CPU run)
    tiny-qwen3_5, tiny-gemma3   the same families at hidden size 64 (a CPU smoke test)
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB = 49152
SHAPES = {
    "qwen3_5-2b": {"model_type": "qwen3_5", "text_config": dict(
        model_type="qwen3_5_text", hidden_size=2048, num_hidden_layers=24, intermediate_size=6144,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_value_heads=16,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=65536)},
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                      sliding_window_pattern=6, query_pre_attn_scalar=256, vocab_size=VOCAB,
                      max_position_embeddings=32768),
    "small-qwen3_5": {"model_type": "qwen3_5", "text_config": dict(
        model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, linear_num_value_heads=8,
        linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        full_attention_interval=4, vocab_size=VOCAB, tie_word_embeddings=True)},
    "tiny-qwen3_5": {"model_type": "qwen3_5", "text_config": dict(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, vocab_size=VOCAB, tie_word_embeddings=True)},
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
                        sliding_window_pattern=2, query_pre_attn_scalar=16, vocab_size=VOCAB),
}


def main() -> int:
    from mlx_lm.utils import _get_classes

    out, shape, tok = sys.argv[1:4]
    if os.path.exists(os.path.join(out, "config.json")):
        print("exists", out)
        return 0
    cfg = dict(SHAPES[shape])
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    mx.random.seed(0)
    weights = {k: (mx.random.normal(v.shape) * 0.02 if v.ndim > 1 else v).astype(mx.bfloat16)
               for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    os.makedirs(out, exist_ok=True)
    mx.save_safetensors(os.path.join(out, "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in os.listdir(tok):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tok, name), out)
    print("params", sum(v.size for v in weights.values()), "->", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
