"""Seven edits a learner makes to model.py, and nothing else: applied at test time (monkeypatch), never
shipped. tests/test_learner_edits.py trains each for a few steps and runs `make ledger` (tools/ledger.py)
on it: the trace reads the edited model, so the ledger is exact with no second edit, and its closed-form
column names how the edit departs from the chapter's formula.

Each edit is (edit_model, departs): a function of a pytest monkeypatch, and the lines `make ledger`'s
closed-form section must print for it at a config (given the config's sizes).
"""
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import model


def _dtype(cfg):
    return "float32" if cfg.precision == "fp32" else "bfloat16" if cfg.precision in ("bf16", "fp8") else "float16"


# ---------------------------------------------------------------- another norm: nn.RMSNorm

def rmsnorm_model(monkeypatch):
    """model.py: every nn.LayerNorm(n, bias=...) becomes nn.RMSNorm(n)."""
    monkeypatch.setattr(model, "nn", types.SimpleNamespace(**{**vars(nn), "LayerNorm": lambda n, bias=True:
                                                                nn.RMSNorm(n)}))


def rmsnorm_departs(cfg):
    """The norms keep FP32 copies of x and x squared (nn.RMSNorm's decomposition), not x and its statistics;
    they have no biases."""
    b, s, h = cfg.batch_size, cfg.block_size, cfg.n_embd
    return [f"not as the formula counts it: h.*.ln_1 (MulBackward0 self, PowBackward0 self): float32 ({b}, {s}, {h})",
            f"not as the formula counts it: ln_f (MulBackward0 other, RsqrtBackward0 result): float32 ({b}, {s}, 1)"] + \
        [f"P is {(2 * cfg.n_layer + 1) * h:,} below the chapter's GPT"] * cfg.bias


# ---------------------------------------------------------------- a SwiGLU MLP: w1, w2, w3

class SwiGLU(nn.Module):
    width = 4  # the hidden size over n_embd; LLaMA's 8/3 keeps the parameters of a 4x MLP

    def __init__(self, cfg, linear_factory):
        super().__init__()
        hidden = int(self.width * cfg.n_embd)
        self.w1 = linear_factory(cfg.n_embd, hidden, cfg.bias)
        self.w3 = linear_factory(cfg.n_embd, hidden, cfg.bias)
        self.w2 = linear_factory(hidden, cfg.n_embd, cfg.bias)
        self.w2.residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def swiglu_model(monkeypatch):
    monkeypatch.setattr(model, "MLP", SwiGLU)


def swiglu_departs(cfg):
    """A third Linear (w3) and the product's operands: the gate's SiLU output and w3's output."""
    b, s, h = cfg.batch_size, cfg.block_size, cfg.n_embd
    return [f"not as the formula counts it: h.*.mlp (MulBackward0 {which}): {_dtype(cfg)} ({b}, {s}, {4 * h})"
            for which in ("self", "other")] + [f"P is {cfg.n_layer * 4 * h * (h + cfg.bias):,} above the chapter's GPT"]


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


def gqa_departs(cfg):
    """c_attn's output one head wide for k and v: fewer parameters, the same q, k, v saved (repeated)."""
    h, d = cfg.n_embd, cfg.n_embd // cfg.n_head
    fewer = 2 * (h - d * GroupedQueryAttention.n_kv_head) * (h + cfg.bias) * cfg.n_layer
    return [f"P is {fewer:,} below the chapter's GPT"]


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


def _without_wpe(monkeypatch):
    """GPT.__init__ without wpe, GPT.forward without the position embedding: what a learner deletes."""
    init = model.GPT.__init__

    def without_wpe(self, cfg, linear_factory=model.default_linear):
        init(self, cfg, linear_factory)
        del self.wpe

    def forward(self, idx, targets=None):
        x = self.drop(self.wte(idx))
        x = self.ln_f(self.block_runner(self.h, x))
        logits = x @ self.wte.weight.t()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
    monkeypatch.setattr(model.GPT, "__init__", without_wpe)
    monkeypatch.setattr(model.GPT, "forward", forward)


def rope_model(monkeypatch):
    monkeypatch.setattr(model, "CausalSelfAttention", RotaryAttention)
    _without_wpe(monkeypatch)


def rope_departs(cfg):
    """The rotation's complex product saves the table, in FP32, each call."""
    d, s = cfg.n_embd // cfg.n_head, cfg.block_size
    return [f"h.*.attn (MulBackward0 other): complex64 ({s}, {d // 2}), {s * d * 4:,} bytes (x{2 * cfg.n_layer})",
            f"P is {s * cfg.n_embd:,} below the chapter's GPT"]


# ---------------------------------------------------------------- no position embeddings at all (NoPE)

def nope_model(monkeypatch):
    _without_wpe(monkeypatch)


def nope_departs(cfg):
    return [f"P is {cfg.block_size * cfg.n_embd:,} below the chapter's GPT"]


# ---------------------------------------------------------------- an untied output head

def untied_model(monkeypatch):
    """GPT gets lm_head = nn.Linear(n_embd, vocab_size, bias=False), and GPT.head_and_loss takes its weight
    as the head: one line, and the loss in pieces (LOSS_CHUNKS) follows."""
    init = model.GPT.__init__

    def with_head(self, cfg, linear_factory=model.default_linear):
        init(self, cfg, linear_factory)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.02)

    def head_and_loss(self, x, targets=None):  # model.py's, its first line edited: the head is lm_head
        head = self.lm_head.weight
        if targets is not None and self.cfg.loss_chunks > 1:
            return None, model.ChunkedLoss.apply(x, head, targets, self.cfg.loss_chunks)
        logits = x @ head.t()
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                                       ignore_index=model.IGNORE_INDEX)
    monkeypatch.setattr(model.GPT, "__init__", with_head)
    monkeypatch.setattr(model.GPT, "head_and_loss", head_and_loss)


def untied_departs(cfg):
    return [f"P is {cfg.vocab_size * cfg.n_embd:,} above the chapter's GPT"]


# ---------------------------------------------------------------- SiLU in place of GELU

def silu_model(monkeypatch):
    monkeypatch.setattr(model, "F", types.SimpleNamespace(**{**vars(F), "gelu": F.silu}))


def silu_departs(cfg):
    """None: SiLU saves its input as GELU does, the formula's 8sbh, matched by its op."""
    n = 4 * (4 if cfg.precision == "fp32" else 2) * cfg.block_size * cfg.batch_size * cfg.n_embd * cfg.n_layer
    return [f"{'activation':26} {n:14,d} {n:14,d}"]


EDITS = {"rmsnorm": (rmsnorm_model, rmsnorm_departs), "swiglu": (swiglu_model, swiglu_departs),
         "gqa": (gqa_model, gqa_departs), "rope": (rope_model, rope_departs), "nope": (nope_model, nope_departs),
         "untied": (untied_model, untied_departs), "silu": (silu_model, silu_departs)}
