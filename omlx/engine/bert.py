"""BERT-family encoders in MLX: BERT, RoBERTa/XLM-RoBERTa and ModernBERT (no torch).

Owns: the forward passes, reading Hugging Face checkpoints of these architectures (weight names
as ``transformers`` writes them, with or without the ``bert.``/``roberta.``/``model.`` prefix),
and the sequence-classification heads cross-encoders use. Must not: tokenize, batch, pool for
an API or know about HTTP; `omlx.engine.encoder` does that.

Sources: the architectures follow ``transformers`` (models/bert/modeling_bert.py,
models/xlm_roberta/modeling_xlm_roberta.py, models/modernbert/modeling_modernbert.py):
BERT is post-norm with learned absolute positions and token types; RoBERTa/XLM-R is BERT with
positions counted from ``pad_token_id + 1`` over non-padding tokens and a two-layer
classification head on ``<s>``; ModernBERT is pre-norm, bias-free, with rotary positions,
GeGLU MLPs and sliding-window attention on all but every ``global_attn_every_n_layers``-th layer.

Shapes: ``input_ids``, ``token_type_ids``, ``attention_mask`` are (B, L) int32 with padding on
the right (mask 1 = real token); hidden states are (B, L, D) in the weights' dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

BERT_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
MODERNBERT_TYPES = ("modernbert",)
ENCODER_TYPES = BERT_TYPES + MODERNBERT_TYPES

_PREFIXES = ("bert.", "roberta.", "model.", "0.auto_model.")


def _act(name: str):
    name = (name or "gelu").lower()
    if name in ("gelu", "gelu_python"):
        return nn.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return nn.gelu_approx
    if name == "relu":
        return nn.relu
    if name in ("silu", "swish"):
        return nn.silu
    raise ValueError(f"unsupported activation {name!r}")


@dataclass(frozen=True, slots=True)
class EncoderArgs:
    """The config.json fields these encoders use (defaults as in ``transformers``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 1
    # ModernBERT
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    classifier_pooling: str = "cls"
    global_attn_every_n_layers: int = 3
    local_attention: int = 128
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        mt = config.get("model_type", "bert")
        labels = config.get("id2label")
        num_labels = int(config.get("num_labels") or (len(labels) if labels else 1))
        kw: dict[str, Any] = {"model_type": mt, "num_labels": num_labels}
        for f in cls.__dataclass_fields__:
            if f in config and f not in kw:
                kw[f] = config[f]
        if mt in MODERNBERT_TYPES:
            kw["hidden_act"] = config.get("hidden_activation", "gelu")
        return cls(**kw)


# ---- BERT / RoBERTa / XLM-R -----------------------------------------------------------------


class _BertEmbeddings(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, a.type_vocab_size), a.hidden_size)
        self.norm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.roberta = a.model_type != "bert"
        self.pad_id = a.pad_token_id

    def __call__(self, ids: mx.array, types: mx.array, mask: mx.array) -> mx.array:
        B, L = ids.shape
        if self.roberta:  # positions count real tokens from pad_token_id + 1 (create_position_ids_from_input_ids)
            pos = mx.cumsum(mask, axis=1) * mask + self.pad_id
        else:
            pos = mx.broadcast_to(mx.arange(L)[None], (B, L))
        x = self.word_embeddings(ids) + self.position_embeddings(pos) + self.token_type_embeddings(types)
        return self.norm(x)


class _BertLayer(nn.Module):
    def __init__(self, a: EncoderArgs):
        super().__init__()
        d = a.hidden_size
        self.n_heads = a.num_attention_heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=a.layer_norm_eps)
        self.up = nn.Linear(d, a.intermediate_size)
        self.down = nn.Linear(a.intermediate_size, d)
        self.out_norm = nn.LayerNorm(d, eps=a.layer_norm_eps)
        self.act = _act(a.hidden_act)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        B, L, D = x.shape
        h = self.n_heads

        def heads(t: mx.array) -> mx.array:  # (B, n_heads, L, head_dim)
            return t.reshape(B, L, h, D // h).transpose(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(D // h), mask=bias)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, D)
        x = self.attn_norm(x + self.attn_out(o))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    """BERT, RoBERTa and XLM-RoBERTa, with the sequence-classification head when present.

    Args:
        args: the config.
        head: "bert" (pooler + ``classifier``), "roberta" (``classifier.dense`` +
            ``classifier.out_proj``) or None (no head: an embedding model).
    """

    def __init__(self, args: EncoderArgs, head: str | None = None):
        super().__init__()
        self.args = args
        self.embeddings = _BertEmbeddings(args)
        self.layers = [_BertLayer(args) for _ in range(args.num_hidden_layers)]
        self.head = head
        d = args.hidden_size
        if head == "bert":
            self.pooler = nn.Linear(d, d)
            self.classifier = nn.Linear(d, args.num_labels)
        elif head == "roberta":
            self.head_dense = nn.Linear(d, d)
            self.head_out = nn.Linear(d, args.num_labels)

    def __call__(self, ids: mx.array, types: mx.array, mask: mx.array) -> mx.array:
        """Last hidden states (B, L, D)."""
        x = self.embeddings(ids, types, mask)
        bias = attention_bias(mask, x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def classify(self, hidden: mx.array, mask: mx.array) -> mx.array:
        """Logits (B, num_labels) of the classification head on the first token."""
        cls = hidden[:, 0]
        if self.head == "bert":
            return self.classifier(mx.tanh(self.pooler(cls)))
        if self.head == "roberta":
            return self.head_out(mx.tanh(self.head_dense(cls)))
        raise ValueError("this encoder has no classification head")

    @staticmethod
    def rename(key: str) -> str | None:
        """A Hugging Face weight name -> this module's, or None for buffers to skip."""
        if key.endswith("position_ids") or key.startswith(("lm_head.", "cls.", "decoder.")):
            return None
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        key = key.replace("embeddings.LayerNorm.", "embeddings.norm.")
        m = re.match(r"encoder\.layer\.(\d+)\.(.*)", key)
        if m:
            i, rest = m.groups()
            for old, new in (("attention.self.query", "query"), ("attention.self.key", "key"),
                             ("attention.self.value", "value"), ("attention.output.dense", "attn_out"),
                             ("attention.output.LayerNorm", "attn_norm"), ("intermediate.dense", "up"),
                             ("output.dense", "down"), ("output.LayerNorm", "out_norm")):
                if rest.startswith(old + "."):
                    return f"layers.{i}.{new}.{rest[len(old) + 1:]}"
            return None
        if key.startswith("pooler.dense."):
            return "pooler." + key[len("pooler.dense."):]
        if key.startswith("classifier.dense."):
            return "head_dense." + key[len("classifier.dense."):]
        if key.startswith("classifier.out_proj."):
            return "head_out." + key[len("classifier.out_proj."):]
        return key


# ---- ModernBERT ------------------------------------------------------------------------------


class _ModernBertLayer(nn.Module):
    def __init__(self, a: EncoderArgs, index: int):
        super().__init__()
        d = a.hidden_size
        self.n_heads = a.num_attention_heads
        self.is_global = index % a.global_attn_every_n_layers == 0
        theta = a.global_rope_theta if self.is_global else a.local_rope_theta
        self.rope = nn.RoPE(d // a.num_attention_heads, traditional=False, base=theta)
        # layer 0 has no attention norm: the embedding norm precedes it (ModernBertEncoderLayer)
        self.attn_norm = nn.LayerNorm(d, eps=a.norm_eps, bias=a.norm_bias) if index else None
        self.wqkv = nn.Linear(d, 3 * d, bias=a.attention_bias)
        self.wo = nn.Linear(d, d, bias=a.attention_bias)
        self.mlp_norm = nn.LayerNorm(d, eps=a.norm_eps, bias=a.norm_bias)
        self.wi = nn.Linear(d, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.mlp_wo = nn.Linear(a.intermediate_size, d, bias=a.mlp_bias)
        self.act = _act(a.hidden_act)

    def __call__(self, x: mx.array, global_bias: mx.array, local_bias: mx.array) -> mx.array:
        B, L, D = x.shape
        h = self.n_heads
        y = self.attn_norm(x) if self.attn_norm is not None else x
        qkv = self.wqkv(y).reshape(B, L, 3, h, D // h).transpose(2, 0, 3, 1, 4)  # (3, B, h, L, hd)
        q, k, v = self.rope(qkv[0]), self.rope(qkv[1]), qkv[2]
        bias = global_bias if self.is_global else local_bias
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(D // h), mask=bias)
        x = x + self.wo(o.transpose(0, 2, 1, 3).reshape(B, L, D))
        inp, gate = mx.split(self.wi(self.mlp_norm(x)), 2, axis=-1)
        return x + self.mlp_wo(self.act(inp) * gate)


class ModernBertEncoder(nn.Module):
    """ModernBERT, with the sequence-classification head (``head`` + ``classifier``) when present."""

    def __init__(self, args: EncoderArgs, head: str | None = None):
        super().__init__()
        self.args = args
        d = args.hidden_size
        self.tok_embeddings = nn.Embedding(args.vocab_size, d)
        self.emb_norm = nn.LayerNorm(d, eps=args.norm_eps, bias=args.norm_bias)
        self.layers = [_ModernBertLayer(args, i) for i in range(args.num_hidden_layers)]
        self.final_norm = nn.LayerNorm(d, eps=args.norm_eps, bias=args.norm_bias)
        self.head = head
        if head is not None:
            self.head_dense = nn.Linear(d, d, bias=args.classifier_bias)
            self.head_norm = nn.LayerNorm(d, eps=args.norm_eps, bias=args.norm_bias)
            self.classifier = nn.Linear(d, args.num_labels)
            self.head_act = _act(args.classifier_activation)

    def __call__(self, ids: mx.array, types: mx.array, mask: mx.array) -> mx.array:
        x = self.emb_norm(self.tok_embeddings(ids))
        L = ids.shape[1]
        global_bias = attention_bias(mask, x.dtype)
        idx = mx.arange(L)
        window = mx.abs(idx[:, None] - idx[None, :]) <= self.args.local_attention // 2  # (L, L)
        local_bias = global_bias + mx.where(window, 0.0, _NEG).astype(x.dtype)[None, None]
        for layer in self.layers:
            x = layer(x, global_bias, local_bias)
        return self.final_norm(x)

    def classify(self, hidden: mx.array, mask: mx.array) -> mx.array:
        if self.head is None:
            raise ValueError("this encoder has no classification head")
        if self.args.classifier_pooling == "mean":
            m = mask[..., None].astype(hidden.dtype)
            pooled = (hidden * m).sum(axis=1) / m.sum(axis=1)
        else:
            pooled = hidden[:, 0]
        return self.classifier(self.head_norm(self.head_act(self.head_dense(pooled))))

    @staticmethod
    def rename(key: str) -> str | None:
        for old, new in (("embeddings.tok_embeddings.", "tok_embeddings."), ("embeddings.norm.", "emb_norm."),
                         ("head.dense.", "head_dense."), ("head.norm.", "head_norm.")):
            if key.startswith(old):
                return new + key[len(old):]
        m = re.match(r"layers\.(\d+)\.(.*)", key)
        if m:
            i, rest = m.groups()
            for old, new in (("attn.Wqkv", "wqkv"), ("attn.Wo", "wo"), ("mlp.Wi", "wi"), ("mlp.Wo", "mlp_wo")):
                if rest.startswith(old + "."):
                    return f"layers.{i}.{new}.{rest[len(old) + 1:]}"
            return key
        if key.startswith(("decoder.", "head.")) and not key.startswith(("head.dense", "head.norm")):
            return None
        return key


_NEG = -1e9  # additive mask value: exp() underflows to exactly 0 in float32 and bfloat16


def attention_bias(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """(B, L) padding mask -> additive attention bias (B, 1, 1, L): 0 for tokens, -1e9 for padding."""
    return mx.where(mask[:, None, None, :].astype(mx.bool_), 0.0, _NEG).astype(dtype)


def build_encoder(config: dict[str, Any], weights: dict[str, mx.array], *, classifier: bool) -> nn.Module:
    """An encoder for ``config`` with ``weights`` (Hugging Face names) loaded.

    Args:
        config: config.json of a BERT, RoBERTa, XLM-RoBERTa or ModernBERT checkpoint.
        weights: name -> array, e.g. from ``mx.load("model.safetensors")``.
        classifier: build the sequence-classification head (a cross-encoder).

    Raises:
        ValueError: an unsupported architecture, or weights that do not match it (names the
            missing or unexpected parameters).
    """
    args = EncoderArgs.from_config(config)
    if args.model_type in MODERNBERT_TYPES:
        cls: type = ModernBertEncoder
        head = "modernbert" if classifier else None
    elif args.model_type in BERT_TYPES:
        cls = BertEncoder
        head = ("bert" if args.model_type == "bert" else "roberta") if classifier else None
    else:
        raise ValueError(f"unsupported encoder type {args.model_type!r} (supported: {', '.join(ENCODER_TYPES)})")
    model = cls(args, head)
    renamed: dict[str, mx.array] = {}
    for key, w in weights.items():
        for p in _PREFIXES:
            if key.startswith(p):
                key = key[len(p):]
                break
        new = cls.rename(key)
        if new is not None:
            renamed[new] = w
    if head == "bert" and "pooler.weight" not in renamed:
        raise ValueError("a BERT cross-encoder needs pooler.dense weights (BertForSequenceClassification)")
    if not classifier:  # an embedding model may carry a pooler or head it does not use
        renamed = {k: v for k, v in renamed.items() if not k.startswith(("pooler.", "classifier.", "head_"))}
    model.load_weights(list(renamed.items()), strict=True)
    mx.eval(model.parameters())
    return model
