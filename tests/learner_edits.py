"""Four edits a learner makes to model.py, each with the description of it for memory_ledger.py:
applied at test time (monkeypatch), never shipped. tests/test_learner_edits.py runs `make ledger`
(tools/ledger.py) on each, first with model.py's edit alone, then with the description's too.

Each edit is (edit_model, edit_description, named): two functions of a pytest monkeypatch, and
the lines `make ledger` must print for the model's edit alone (given the config's sizes).
"""
import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import memory_ledger as ml
import model
from ledger import step
from ledger.ops import Ops


def _describe(monkeypatch, embeddings=None, block=None, head=None, ops=()):
    """memory_ledger.py's embeddings, block and head as a learner rewrites them, and the ops they need
    added to ledger/ops.Ops; the census (cached per sizes) forgotten (the tests forget it again after)."""
    for name, fn in dict(embeddings=embeddings, block=block, head=head).items():
        if fn is not None:
            monkeypatch.setattr(ml, name, fn)
    monkeypatch.setattr(ml, "MODEL", step.Description(ml.embeddings, ml.block, ml.head))
    for name, op in ops:
        monkeypatch.setattr(Ops, name, op, raising=False)
    ml._census.cache_clear()


# ---------------------------------------------------------------- another norm: nn.RMSNorm

def rmsnorm_model(monkeypatch):
    """model.py: every nn.LayerNorm(n, bias=...) becomes nn.RMSNorm(n)."""
    monkeypatch.setattr(model, "nn", types.SimpleNamespace(**{**vars(nn), "LayerNorm": lambda n, bias=True:
                                                                nn.RMSNorm(n)}))


def rmsnorm_description(monkeypatch):
    def block(g, x):
        x = g.add("x + attn", x, ml.attention(g, g.rms_norm("ln_1", x)))
        return g.add("x + mlp", x, ml.mlp(g, g.rms_norm("ln_2", x)))

    def head(g, x):
        logits = g.tied_head("head", g.rms_norm("ln_f", x), "wte.weight", g.sizes.V)
        return g.cross_entropy("loss", g.to_fp32("logits.float()", logits))
    _describe(monkeypatch, block=block, head=head)


def rmsnorm_named(cfg):
    return [f"  h.*.ln_1.bias: described, not in the model ({cfg.n_embd} x {cfg.n_layer} blocks)",
            f"  h.*.ln_2.bias: described, not in the model ({cfg.n_embd} x {cfg.n_layer} blocks)",
            f"  ln_f.bias: described, not in the model ({cfg.n_embd})"] if cfg.bias else []


# ---------------------------------------------------------------- a SwiGLU MLP: w1, w2, w3

class SwiGLU(nn.Module):
    def __init__(self, cfg, linear_factory):
        super().__init__()
        self.w1 = linear_factory(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
        self.w3 = linear_factory(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
        self.w2 = linear_factory(4 * cfg.n_embd, cfg.n_embd, cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def swiglu_model(monkeypatch):
    monkeypatch.setattr(model, "MLP", SwiGLU)


def swiglu_description(monkeypatch):
    def mlp(g, x):
        h = g.sizes.h
        gate = g.silu("mlp.silu", g.linear("mlp.w1", x, 4 * h, split="column"))
        gated = g.mul("mlp.silu * w3", gate, g.linear("mlp.w3", x, 4 * h, split="column"))
        return g.dropout("mlp.dropout", g.linear("mlp.w2", gated, h, split="row"))
    monkeypatch.setattr(ml, "mlp", mlp)
    _describe(monkeypatch)


def swiglu_named(cfg):
    h, L = cfg.n_embd, cfg.n_layer
    lines = [f"  h.*.mlp.w1.weight: in the model, not described ({4 * h} x {h}: {4 * h * h:,} x {L} blocks)",
             f"  h.*.mlp.w2.weight: in the model, not described ({h} x {4 * h}: {4 * h * h:,} x {L} blocks)",
             f"  h.*.mlp.w3.weight: in the model, not described ({4 * h} x {h}: {4 * h * h:,} x {L} blocks)",
             f"  h.*.mlp.c_fc.weight: described, not in the model ({4 * h * h:,} x {L} blocks)"]
    return lines


# ---------------------------------------------------------------- grouped-query attention: one k, v head

class GroupedQueryAttention(model.CausalSelfAttention):
    """k and v of n_kv_head heads, each repeated to serve n_head / n_kv_head query heads."""
    n_kv_head = 1

    def __init__(self, cfg, linear_factory):
        super().__init__(cfg, linear_factory)
        self.kv = cfg.n_embd // cfg.n_head * self.n_kv_head
        self.c_attn = linear_factory(cfg.n_embd, cfg.n_embd + 2 * self.kv, cfg.bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split([C, self.kv, self.kv], dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_head, C // self.n_head).transpose(1, 2)
                .repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k, v))
        y = self.core_runner(self.core, q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def gqa_model(monkeypatch):
    monkeypatch.setattr(model, "CausalSelfAttention", GroupedQueryAttention)


def gqa_description(monkeypatch):
    n_kv = GroupedQueryAttention.n_kv_head

    def attention(g, x):
        z = g.sizes
        kv = z.h // z.a * n_kv
        qkv = g.linear("attn.c_attn", x, z.h + 2 * kv, split="column")
        q, k, v = g.split_heads("attn.split", qkv, [n * qkv.nbytes // (z.h + 2 * kv) for n in (z.h, kv, kv)])
        k, v = (g.repeat_heads(f"attn.{name} repeat", t, z.a // n_kv, n_kv) for name, t in (("k", k), ("v", v)))
        y = g.merge_heads("attn.merge", g.core_runner(ml.core, q, k, v))
        return g.dropout("attn.resid_dropout", g.linear("attn.c_proj", y, z.h, split="row"))
    monkeypatch.setattr(ml, "attention", attention)
    _describe(monkeypatch)


def gqa_named(cfg):
    h, d, L = cfg.n_embd, cfg.n_embd // cfg.n_head, cfg.n_layer
    n = h + 2 * d * GroupedQueryAttention.n_kv_head
    lines = [f"  h.*.attn.c_attn.bias: {n:,} in the model, described {3 * h:,} (x {L} blocks)"] if cfg.bias else []
    return lines + [f"  h.*.attn.c_attn.weight: {n} x {h}: {n * h:,} in the model, described {3 * h * h:,} "
                    f"(x {L} blocks)"]


EDITS = {"rmsnorm": (rmsnorm_model, rmsnorm_description, rmsnorm_named),
         "swiglu": (swiglu_model, swiglu_description, swiglu_named),
         "gqa": (gqa_model, gqa_description, gqa_named)}
