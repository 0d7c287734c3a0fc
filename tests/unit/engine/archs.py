"""Tiny random models of real mlx-lm architectures whose caches are not plain ``KVCache``.

Each config is small (2-4 layers, hidden 64, vocab 512) but keeps its family's cache layout:

- ``gemma3_text``: sliding-window layers (``RotatingKVCache``, window 16) beside global ones;
- ``gpt_oss``: sliding and full attention, mixture-of-experts MLP;
- ``qwen3_5``: Qwen3.5's text model, gated delta-net and attention alternating;
- ``qwen3_next``: gated delta-net layers (``ArraysCache``: conv + recurrent state) beside
  attention (``full_attention_interval`` 2);
- ``nemotron_h``: Mamba-2 layers (``ArraysCache``), attention and MLP (pattern ``M*M-``);
- ``deepseek_v3``: MLA (``KVCache`` whose keys and values differ in head dim: 32 vs 8).

Weights are drawn as in ``conftest.tiny_llama`` (std 3/sqrt(fan_in)) so greedy decoding
wanders over the vocabulary.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

VOCAB = 512
WINDOW = 16

CONFIGS: dict[str, dict] = {
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                        num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=VOCAB,
                        sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_next": dict(model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                       num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=64,
                       rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2, rope_theta=10000.0,
                       partial_rotary_factor=0.25, max_position_embeddings=4096, head_dim=16,
                       full_attention_interval=2),
    "qwen3_5": {"model_type": "qwen3_5", "text_config": dict(
        model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        full_attention_interval=2, vocab_size=VOCAB, tie_word_embeddings=True)},
    "nemotron_h": dict(model_type="nemotron_h", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       max_position_embeddings=4096, num_attention_heads=4, num_key_value_heads=2,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=16, conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "M", "-"], head_dim=16),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        n_shared_experts=1, n_routed_experts=4, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
}


def tiny(arch: str, seed: int = 3):
    """A random model of ``arch`` (a key of `CONFIGS`), built by mlx-lm's own model classes."""
    from mlx_lm.utils import _get_classes

    cfg = dict(CONFIGS[arch])
    model_cls, args_cls = _get_classes(cfg)
    return randomize(model_cls(args_cls.from_dict(cfg)), seed)


def randomize(model, seed: int):
    """Draw ``model``'s matrices with std 3/sqrt(fan_in) (vectors kept), evaluated; returns it."""
    mx.random.seed(seed)
    weights = [(k, mx.random.normal(v.shape) * 3.0 / v.shape[-1] ** 0.5 if v.ndim > 1 else v)
               for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())
    return model
