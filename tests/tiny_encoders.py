"""Tiny random encoders of real architectures, written as Hugging Face checkpoints, and an
independent float64 numpy reference of their forward passes.

`write_encoder` writes config.json, model.safetensors (weight names as ``transformers`` saves
``BertForSequenceClassification``, ``XLMRobertaForSequenceClassification``,
``ModernBertForSequenceClassification`` or a sentence-transformers ``BertModel``) and a small
WordPiece tokenizer.json. The reference follows ``transformers``' modeling files directly and
runs one unpadded sequence at a time, so it shares nothing with omlx's batched MLX code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

WORDS = ("the a of and to in is it that was for on are with as his they be at one have this from or had by hot word "
         "but what some we can out other were all there when up use your how said an each she which do their time if "
         "will way about many then them paris france capital city river food bread eating music guitar").split()


def write_tokenizer(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for w in WORDS + ["##s", "##ing", "##ed", ".", ",", "?"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))
    return vocab


def _config(arch: str, vocab_size: int, classifier: bool) -> dict:
    if arch == "bert":
        return {"model_type": "bert", "architectures": ["BertForSequenceClassification" if classifier else "BertModel"],
                "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 64, "hidden_act": "gelu", "max_position_embeddings": 64, "type_vocab_size": 2,
                "layer_norm_eps": 1e-12, "pad_token_id": 0, "num_labels": 1}
    if arch == "xlm-roberta":
        return {"model_type": "xlm-roberta", "architectures": ["XLMRobertaForSequenceClassification"],
                "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 64, "hidden_act": "gelu", "max_position_embeddings": 66, "type_vocab_size": 1,
                "layer_norm_eps": 1e-5, "pad_token_id": 0, "num_labels": 1}
    if arch == "modernbert":
        return {"model_type": "modernbert", "architectures": ["ModernBertForSequenceClassification"],
                "vocab_size": vocab_size, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
                "intermediate_size": 48, "hidden_activation": "gelu", "max_position_embeddings": 128,
                "global_attn_every_n_layers": 3, "local_attention": 4, "global_rope_theta": 160000.0,
                "local_rope_theta": 10000.0, "norm_eps": 1e-5, "norm_bias": False, "classifier_pooling": "mean",
                "classifier_activation": "gelu", "pad_token_id": 0, "num_labels": 1}
    raise ValueError(arch)


def _weights(arch: str, cfg: dict, classifier: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]

    def n(*shape, s=0.3):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def ln(p, bias=True):
        out = {p + ".weight": (1 + n(d, s=0.1))}
        if bias:
            out[p + ".bias"] = n(d, s=0.1)
        return out

    w: dict[str, np.ndarray] = {}
    if arch == "modernbert":
        w["model.embeddings.tok_embeddings.weight"] = n(v, d, s=1.0)
        w.update(ln("model.embeddings.norm", bias=False))
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            if i:
                w.update(ln(p + "attn_norm", bias=False))
            w[p + "attn.Wqkv.weight"] = n(3 * d, d)
            w[p + "attn.Wo.weight"] = n(d, d)
            w.update(ln(p + "mlp_norm", bias=False))
            w[p + "mlp.Wi.weight"] = n(2 * f, d)
            w[p + "mlp.Wo.weight"] = n(d, f)
        w.update(ln("model.final_norm", bias=False))
        if classifier:
            w["head.dense.weight"] = n(d, d)
            w.update(ln("head.norm", bias=False))
            w["classifier.weight"] = n(cfg["num_labels"], d)
            w["classifier.bias"] = n(cfg["num_labels"])
        return w
    pre = ("bert." if arch == "bert" else "roberta.") if classifier else ""
    w[pre + "embeddings.word_embeddings.weight"] = n(v, d, s=1.0)
    w[pre + "embeddings.position_embeddings.weight"] = n(cfg["max_position_embeddings"], d)
    w[pre + "embeddings.token_type_embeddings.weight"] = n(cfg["type_vocab_size"], d)
    w[pre + "embeddings.position_ids"] = np.arange(cfg["max_position_embeddings"], dtype=np.int64)[None]
    w.update(ln(pre + "embeddings.LayerNorm"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"{pre}encoder.layer.{i}."
        for name in ("query", "key", "value"):
            w[p + f"attention.self.{name}.weight"] = n(d, d)
            w[p + f"attention.self.{name}.bias"] = n(d, s=0.1)
        w[p + "attention.output.dense.weight"] = n(d, d)
        w[p + "attention.output.dense.bias"] = n(d, s=0.1)
        w.update(ln(p + "attention.output.LayerNorm"))
        w[p + "intermediate.dense.weight"] = n(f, d)
        w[p + "intermediate.dense.bias"] = n(f, s=0.1)
        w[p + "output.dense.weight"] = n(d, f)
        w[p + "output.dense.bias"] = n(d, s=0.1)
        w.update(ln(p + "output.LayerNorm"))
    if classifier and arch == "bert":
        w["bert.pooler.dense.weight"] = n(d, d)
        w["bert.pooler.dense.bias"] = n(d, s=0.1)
        w["classifier.weight"] = n(1, d)
        w["classifier.bias"] = n(1, s=0.1)
    elif classifier:
        w["classifier.dense.weight"] = n(d, d)
        w["classifier.dense.bias"] = n(d, s=0.1)
        w["classifier.out_proj.weight"] = n(1, d)
        w["classifier.out_proj.bias"] = n(1, s=0.1)
    return w


def write_encoder(path: Path, arch: str, *, classifier: bool = True, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of ``arch`` ("bert", "xlm-roberta", "modernbert") to ``path``.

    With ``classifier=False`` (bert only) it is a sentence-transformers embedding model: mean
    pooling, then L2 normalization.
    """
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = _config(arch, len(vocab), classifier)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(_weights(arch, cfg, classifier, np.random.default_rng(seed)), str(path / "model.safetensors"))
    if not classifier:
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


# ---- the reference (float64, one sequence, no padding) --------------------------------------

def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _ln(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(v + eps) * w
    return y + b if b is not None else y


def _softmax(s):
    s = np.exp(s - s.max(-1, keepdims=True))
    return s / s.sum(-1, keepdims=True)


class Reference:
    """Forward passes of one checkpoint folder written by `write_encoder` (or a real one)."""

    def __init__(self, path: Path):
        from safetensors.numpy import load_file

        self.cfg = json.loads((path / "config.json").read_text())
        raw = load_file(str(path / "model.safetensors"))
        self.w = {}
        for k, v in raw.items():
            for p in ("bert.", "roberta.", "model."):
                if k.startswith(p):
                    k = k[len(p):]
                    break
            self.w[k] = v.astype(np.float64)

    def lin(self, x, name, bias=True):
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if bias and name + ".bias" in self.w else y

    def hidden(self, ids, types):
        if self.cfg["model_type"] == "modernbert":
            return self._modernbert(np.array(ids))
        return self._bert(np.array(ids), np.array(types))

    def _bert(self, ids, types):
        c, w = self.cfg, self.w
        L, H = len(ids), c["num_attention_heads"]
        if c["model_type"] == "bert":
            pos = np.arange(L)
        else:  # RoBERTa: positions after the padding index (no padding here)
            pos = np.arange(L) + c["pad_token_id"] + 1
            types = np.zeros_like(types)
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][pos]
        x = x + w["embeddings.token_type_embeddings.weight"][types]
        eps = c["layer_norm_eps"]
        x = _ln(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        D = x.shape[1]
        hd = D // H
        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            q, k, v = (self.lin(x, p + f"attention.self.{n}").reshape(L, H, hd).transpose(1, 0, 2) for n in ("query", "key", "value"))
            o = (_softmax(q @ k.transpose(0, 2, 1) / math.sqrt(hd)) @ v).transpose(1, 0, 2).reshape(L, D)
            x = _ln(x + self.lin(o, p + "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                    w[p + "attention.output.LayerNorm.bias"], eps)
            h = _gelu(self.lin(x, p + "intermediate.dense"))
            x = _ln(x + self.lin(h, p + "output.dense"), w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        return x

    def _modernbert(self, ids):
        c, w = self.cfg, self.w
        L, H, eps = len(ids), c["num_attention_heads"], c["norm_eps"]
        x = _ln(w["embeddings.tok_embeddings.weight"][ids], w["embeddings.norm.weight"], None, eps)
        D = x.shape[1]
        hd = D // H
        dist = np.abs(np.arange(L)[:, None] - np.arange(L)[None, :])
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            is_global = i % c["global_attn_every_n_layers"] == 0
            theta = c["global_rope_theta"] if is_global else c["local_rope_theta"]
            y = _ln(x, w[p + "attn_norm.weight"], None, eps) if i else x
            qkv = self.lin(y, p + "attn.Wqkv", False).reshape(L, 3, H, hd).transpose(1, 2, 0, 3)  # (3, H, L, hd)
            inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
            ang = np.arange(L)[:, None] * inv[None]
            cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

            def rope(t):
                rot = np.concatenate([-t[..., hd // 2:], t[..., : hd // 2]], -1)
                return t * cos + rot * sin

            q, k, v = rope(qkv[0]), rope(qkv[1]), qkv[2]
            s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
            if not is_global:
                s = np.where(dist <= c["local_attention"] // 2, s, -np.inf)
            o = (_softmax(s) @ v).transpose(1, 0, 2).reshape(L, D)
            x = x + self.lin(o, p + "attn.Wo", False)
            a, g = np.split(self.lin(_ln(x, w[p + "mlp_norm.weight"], None, eps), p + "mlp.Wi", False), 2, -1)
            x = x + self.lin(_gelu(a) * g, p + "mlp.Wo", False)
        return _ln(x, w["final_norm.weight"], None, eps)

    def logits(self, ids, types) -> np.ndarray:
        """Classifier logits (num_labels,) of one pair."""
        h = self.hidden(ids, types)
        mt = self.cfg["model_type"]
        if mt == "modernbert":
            pooled = h.mean(0) if self.cfg.get("classifier_pooling") == "mean" else h[0]
            z = _ln(_gelu(self.lin(pooled, "head.dense", False)), self.w["head.norm.weight"], None, self.cfg["norm_eps"])
            return self.lin(z, "classifier")
        if mt == "bert":
            return self.lin(np.tanh(self.lin(h[0], "pooler.dense")), "classifier")
        return self.lin(np.tanh(self.lin(h[0], "classifier.dense")), "classifier.out_proj")

    def score(self, ids, types) -> float:
        return float(1 / (1 + np.exp(-self.logits(ids, types)[0])))

    def embedding(self, ids) -> np.ndarray:
        """Mean pooling + L2 normalization (sentence-transformers)."""
        v = self.hidden(ids, [0] * len(ids)).mean(0)
        return v / np.linalg.norm(v)
