"""The whole picture: what splitting across GPUs does to the four components, and the big shapes.

Chapter section 4 ("Splitting: ZeRO/FSDP split states, TP splits weights, PP splits
layers, SP/CP split activations; offload"). Read memory_ledger.py first (one GPU, this
model); this file divides its components the way each parallel technique does, keeps
the literature's per-layer activation formula (Korthikanti et al. 2022) beside ours,
and asks what the same model needs at GPT-2 XL, 7B and 175B scale (the what-if).
Every row here is a formula: this project runs none of these techniques.
"""
from dataclasses import replace

import torch

from config import Config
from memory_ledger import (activation_bytes, block_activation_terms, components, dims, head_activation_terms,
                           param_count, peak_estimate, units)
from model import GPT
import precision


# ---------------------------------------------------------------- the literature's per-layer activations

def korthikanti_layer_terms(s, b, h, a):
    """The literature's per-layer breakdown (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1): 16-bit activations, 1-byte dropout
    masks, LayerNorm statistics ignored. Sum: s*b*h*(34 + 5*a*s/h)."""
    return [("attention: QKV input", 2 * s * b * h), ("attention: Q and K", 4 * s * b * h),
            ("attention: softmax output", 2 * a * s * s * b), ("attention: softmax dropout mask", a * s * s * b),
            ("attention: dropout output", 2 * a * s * s * b), ("attention: V", 2 * s * b * h),
            ("attention: output-projection input", 2 * s * b * h), ("attention: dropout mask", s * b * h),
            ("MLP: first Linear input", 2 * s * b * h), ("MLP: GELU input", 8 * s * b * h),
            ("MLP: second Linear input", 8 * s * b * h), ("MLP: dropout mask", s * b * h),
            ("LayerNorms: inputs", 4 * s * b * h)]


# the paper's attention-core terms, the ones that grow with a*s^2: what selective recompute drops
KORTHIKANTI_CORE = frozenset({"attention: softmax output", "attention: softmax dropout mask",
                              "attention: dropout output"})


def korthikanti_layer_bytes(s, b, h, a, policy="none"):
    """Per-layer bytes from korthikanti_layer_terms: none = all terms, sbh(34 + 5as/h); selective =
    all but the a*s^2 attention-core terms (KORTHIKANTI_CORE), 34sbh; full = the layer's 16-bit
    input only, 2sbh. (Our block: the LayerNorm statistics on top, and no mask term: model.py's
    future_mask is a buffer, so the saved mask of masked_fill is a view of it, not an activation.)"""
    if policy == "full":
        return 2 * s * b * h
    terms = korthikanti_layer_terms(s, b, h, a)
    assert KORTHIKANTI_CORE <= {n for n, _ in terms}
    return sum(v for n, v in terms if policy != "selective" or n not in KORTHIKANTI_CORE)


# ---------------------------------------------------------------- the parallel techniques, per GPU

# block_activation_terms by name, for TP: inside the column/row-parallel regions (split over t)
# or replicated on every rank. Every term must be in exactly one set: tp_components raises on a
# term it cannot place, so renaming or adding a term cannot silently change the TP numbers.
TP_SPLIT = frozenset({
    "Q, K copies for QK^T", "softmax output", "attention dropout mask", "attention dropout output",
    "V copy for att@V", "q,k,v (recompute inputs)", "q,k,v (c_attn output)", "sdpa output = c_proj input",
    "sdpa logsumexp (fp32)", "sdpa-math Q, K copies (fp32)", "sdpa-math softmax (fp32)",
    "sdpa-math dropout mask (fp32)", "sdpa-math dropout output (fp32)", "sdpa-math V copy (fp32)",
    "c_proj input", "GELU input", "MLP c_proj input (GELU output)"})
TP_REPLICATED = frozenset({
    "ln_1 input", "ln_1 mean+rstd", "c_attn input", "residual dropout mask", "ln_2 input", "ln_2 mean+rstd",
    "c_fc input", "MLP dropout mask", "FP8 scales (x_scale, w_scale) x 4 Linears"})


def tp_components(cfg, t, sp):
    """Per-GPU components under tensor parallelism t (Megatron), with or without sequence parallel."""
    L, h, _, s, b, V = dims(cfg)
    c = components(cfg)
    P, _ = param_count(cfg)
    split = 12 * h * h * L + V * h  # Linear weights and the vocab-parallel embedding
    frac = (split / t + (P - split)) / P
    acts = 0
    for name, v in block_activation_terms(cfg, cfg.ckpt if cfg.ckpt == "selective" else "none"):
        if name not in TP_SPLIT and name not in TP_REPLICATED:
            raise KeyError(f"block term {name!r} is in neither TP_SPLIT nor TP_REPLICATED")
        acts += v // t if (sp or name in TP_SPLIT) else v
    acts *= L
    if cfg.ckpt in ("full", "sqrt"):
        e = precision.recipe(cfg).element_bytes
        acts = len(units(cfg)) * b * s * h * e // (t if sp else 1)
    acts += sum(v for _, v in head_activation_terms(cfg)) // t  # vocab-parallel logits
    return dict(parameters=int(c["parameters"] * frac), gradients=int(c["gradients"] * frac),
                optimizer=int(c["optimizer"] * frac), activations=acts)


def parallel_rows(cfg, ranks=8, tp=8, pp=8, cp=4):
    """[(technique, {component: bytes per GPU})] for the techniques this project does not run.

      ZeRO-1 optimizer states / N; ZeRO-2 also gradients / N; ZeRO-3 (FSDP) also parameters / N.
      TP t: block weights / t (embeddings vocab-parallel / t too); activations per Korthikanti:
        the terms inside the column/row-parallel regions / t, the rest (LayerNorm and Linear
        inputs, dropout masks) replicated. SP on top of TP: the replicated ones / t as well.
      PP p: parameters, gradients, optimizer / p (L/p layers per stage); activations: with 1F1B
        the first stage holds p micro-batches of L/p layers = L layers' worth: unchanged.
      CP c: every activation term scales with s, each rank holds s/c of the sequence: / c.
      CPU offload (ZeRO-Offload): FP32 master, AdamW states and the gradients live in CPU memory.
    """
    c = components(cfg)
    z = dict(c)
    rows = []
    z["optimizer"] //= ranks
    rows.append((f"ZeRO-1 over {ranks}", dict(z)))
    z["gradients"] //= ranks
    rows.append((f"ZeRO-2 over {ranks}", dict(z)))
    z["parameters"] //= ranks
    rows.append((f"ZeRO-3 over {ranks}", dict(z)))
    rows.append((f"tensor parallel t={tp}", tp_components(cfg, tp, sp=False)))
    rows.append((f"TP t={tp} + sequence parallel", tp_components(cfg, tp, sp=True)))
    rows.append((f"pipeline parallel p={pp}", dict(parameters=c["parameters"] // pp, gradients=c["gradients"] // pp,
                                                  optimizer=c["optimizer"] // pp, activations=c["activations"])))
    rows.append((f"context parallel c={cp}", dict(c, activations=c["activations"] // cp)))
    rows.append(("CPU offload (ZeRO-Offload)", dict(c, gradients=0, optimizer=0)))
    return rows


# ---------------------------------------------------------------- what-if: shapes that do not fit here

BIG_SHAPES = {  # name: (L, h, a, s, V), GPT-2-style blocks as in model.py
    "GPT-2 XL": (48, 1600, 25, 1024, 50257),
    "7B": (32, 4096, 32, 4096, 32000),
    "175B (GPT-3)": (96, 12288, 96, 2048, 50257),
}


def big_config(name, **over):
    """A Config of one of BIG_SHAPES (CUDA dtypes, micro-batch 1), with `over` on top."""
    L, h, a, s, V = BIG_SHAPES[name]
    base = dict(n_layer=L, n_embd=h, n_head=a, block_size=s, vocab_size=V, batch_size=1, device="cuda")
    return Config(**{**base, **over})


def meta_param_count(cfg):
    """P of model.GPT built on the meta device (no memory): the cross-check of param_count."""
    with torch.device("meta"):
        m = GPT(cfg)
    return sum(p.numel() for p in m.parameters())


def largest_micro_batch(cfg, gpu_bytes, shard=1, limit=1 << 16):
    """Largest b whose estimated peak fits gpu_bytes (0 if not even b=1 fits)."""
    fits = lambda b: peak_estimate(replace(cfg, batch_size=b), shard)[0] <= gpu_bytes
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def what_if(gpu_gib=80, ranks=8, precision_name="bf16"):
    """[(shape, P, ckpt, zero, per-GPU static bytes, activations at b=1, largest b)] on CUDA."""
    out = []
    for name in BIG_SHAPES:
        for ckpt in ("none", "selective", "full"):
            for zero in (0, 3):
                cfg = big_config(name, precision=precision_name, ckpt=ckpt, attn="manual")
                c = components(cfg)
                static = (c["parameters"] + c["gradients"] + c["optimizer"]) // (ranks if zero else 1)
                b = largest_micro_batch(cfg, gpu_gib * 2 ** 30, shard=ranks if zero else 1)
                out.append((name, param_count(cfg)[0], ckpt, f"ZeRO-3/{ranks}" if zero else "none", static,
                            activation_bytes(cfg), b))
    return out
