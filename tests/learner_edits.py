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
    """(at bf16) the norms' biases gone; each norm keeps x, rstd and the normalized x in FP32, not x and
    its 16-bit mean and rstd."""
    b, s, h, L = cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    return [f"  h.*.ln_1.bias: described, not in the model ({h} x {L} blocks)",
            f"  h.*.ln_2.bias: described, not in the model ({h} x {L} blocks)",
            f"  ln_f.bias: described, not in the model ({h})",
            f"  unexplained, saved by h.*.ln_1 (MulBackward0, PowBackward0): float32 ({b}, {s}, {h}), "
            f"{4 * b * s * h:,} bytes (x{L})",
            f"  described but not saved: ln_1 input, bfloat16, {2 * b * s * h:,} bytes (in each block) (x{L})",
            f"  described but not saved: ln_f input, bfloat16, {2 * b * s * h:,} bytes"]  # not the head's input


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
    """(at bf16) w1, w2, w3 for c_fc and c_proj; the product's two operands saved besides."""
    b, s, h, L = cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    lines = [f"  unexplained, saved by h.*.mlp (MulBackward0): bfloat16 ({b}, {s}, {4 * h}), {8 * b * s * h:,} bytes "
             f"(x{2 * L})",
             f"  h.*.mlp.w1.weight: in the model, not described ({4 * h} x {h}: {4 * h * h:,} x {L} blocks)",
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
        y = self.core(q, k, v)
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
        y = g.merge_heads("attn.merge", g.module("attn.core", ml.core, q, k, v))
        return g.dropout("attn.resid_dropout", g.linear("attn.c_proj", y, z.h, split="row"))
    monkeypatch.setattr(ml, "attention", attention)
    _describe(monkeypatch)


def gqa_named(cfg):
    """c_attn's k and v outputs one head wide (the saved activations weigh the same at this shape)."""
    h, d, L = cfg.n_embd, cfg.n_embd // cfg.n_head, cfg.n_layer
    n = h + 2 * d * GroupedQueryAttention.n_kv_head
    lines = [f"  h.*.attn.c_attn.bias: {n:,} in the model, described {3 * h:,} (x {L} blocks)"] if cfg.bias else []
    return lines + [f"  h.*.attn.c_attn.weight: {n} x {h}: {n * h:,} in the model, described {3 * h * h:,} "
                    f"(x {L} blocks)"]




# ---------------------------------------------------------------- rotary embeddings in place of wpe

class RotaryAttention(model.CausalSelfAttention):
    """q and k turned by their position's angles (RoFormer, as LLaMA writes it: each pair of features a
    complex number, times e^(i t theta)); the angles' cos and sin a buffer of the module's (it follows
    the model's dtype: cast to FP32 where it is used); no position embedding."""

    def __init__(self, cfg, linear_factory):
        super().__init__(cfg, linear_factory)
        d = cfg.n_embd // cfg.n_head
        angles = torch.outer(torch.arange(cfg.block_size).float(), 10000.0 ** (-torch.arange(0, d, 2).float() / d))
        self.register_buffer("rotation", torch.stack((angles.cos(), angles.sin()), -1), persistent=False)

    def rotate(self, x):
        B, a, T, d = x.shape
        pairs = torch.view_as_complex(x.float().reshape(B, a, T, d // 2, 2))
        turn = torch.view_as_complex(self.rotation[:T].float())
        return torch.view_as_real(pairs * turn).flatten(3).type_as(x)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.core(self.rotate(q), self.rotate(k), v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def rope_model(monkeypatch):
    monkeypatch.setattr(model, "CausalSelfAttention", RotaryAttention)
    init = model.GPT.__init__

    def without_wpe(self, cfg, linear_factory=model.default_linear):
        init(self, cfg, linear_factory)
        del self.wpe

    def forward(self, idx, targets=None):  # GPT.forward, the position embedding gone
        x = self.drop(self.wte(idx))
        x = self.ln_f(self.block_runner(self.h, x))
        logits = x @ self.wte.weight.t()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    monkeypatch.setattr(model.GPT, "__init__", without_wpe)
    monkeypatch.setattr(model.GPT, "forward", forward)


def rope_description(monkeypatch):
    def embeddings(g):
        return g.dropout("drop", g.embedding("wte", g.sizes.V))

    def attention(g, x):
        q, k, v = g.split_heads("attn.split", g.linear("attn.c_attn", x, 3 * g.sizes.h, split="column"))
        # the turned q and k are the call's temporaries, as in RotaryAttention.forward: gone when the core returns
        y = g.merge_heads("attn.merge", g.module("attn.core", ml.core, rotate(g, "attn.rotate q", q),
                                                 rotate(g, "attn.rotate k", k), v))
        return g.dropout("attn.resid_dropout", g.linear("attn.c_proj", y, g.sizes.h, split="row"))
    monkeypatch.setattr(ml, "attention", attention)
    _describe(monkeypatch, embeddings=embeddings)


def rotate(g, name, x):
    """RotaryAttention.rotate: x in FP32 (a copy, but for FP32), the table in FP32 (the same), their
    complex product (which saves the table), cast back to x's dtype; the FP32 x and table live to the
    end of rotate (its locals), the product to the end of the cast."""
    z = g.sizes
    d, fp32 = z.h // z.a, z.e == 4
    g.declare("buffer", "attn.rotation", z.s * d * z.e)  # (s, d/2, 2): cos and sin, in the model's dtype
    x32 = x if fp32 else g.new(name + " x.float()", name + " x fp32", x.nbytes // z.e * 4, region=x.region,
                               layout=x.layout, dtype="float32")
    if not fp32:
        g.record(name + " x.float()", [x], [x32], _same_layout_backward, nbytes=x.nbytes)
    turn = None if fp32 else g.new(name + " rotation.float()", name + " rotation (fp32)", z.s * d * 4,
                                   dtype="complex64")
    out = g.new(name + " * rotation", name + " output", x32.nbytes, region=x.region, layout=x.layout,
                dtype="float32" if fp32 else "complex64")  # (in FP32 the one saved is its real view)
    g.record(name + " * rotation", [x32], [out], _same_layout_backward, saved=[(turn, name + " rotation")] * (not fp32),
             nbytes=x32.nbytes)
    if not fp32:
        product, out = out, g.new(name + " type_as", name + " x", x.nbytes, region=x.region, layout=x.layout)
        g.record(name + " type_as", [product], [out], _same_layout_backward, nbytes=product.nbytes)
        del product
    del x32, turn
    return out


def _same_layout_backward(g, node, grads):
    """A cast's or a product's by a constant: one gradient of the input's size, laid out as the incoming one."""
    return [g.new(node.name + " backward", node.name + " dx", node.ctx["nbytes"], region=True,
                  layout=grads[0].layout)]


def rope_named(cfg):
    """(at bf16) wpe and its positions gone, the rotation tables come, and each FP32 copy of one saved."""
    d, s, L = cfg.n_embd // cfg.n_head, cfg.block_size, cfg.n_layer
    e = 4 if cfg.precision == "fp32" else 2
    return [f"  described but not saved: positions (wpe), int64, {8 * s:,} bytes",
            f"  unexplained, saved by h.*.attn (MulBackward0): complex64 ({s}, {d // 2}), {4 * s * d:,} bytes "
            f"(x{2 * L})",
            f"  wpe.weight: described, not in the model ({cfg.block_size * cfg.n_embd:,})",
            f"  h.*.attn.rotation: in the model, not described ({cfg.block_size} x {d // 2} x 2: "
            f"{cfg.block_size * d * e:,} bytes x {cfg.n_layer} blocks)"]


EDITS = {"rmsnorm": (rmsnorm_model, rmsnorm_description, rmsnorm_named),
         "swiglu": (swiglu_model, swiglu_description, swiglu_named),
         "gqa": (gqa_model, gqa_description, gqa_named),
         "rope": (rope_model, rope_description, rope_named)}
