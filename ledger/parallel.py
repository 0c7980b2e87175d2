"""The whole picture: what splitting across GPUs does to the four components, and the big shapes.

Chapter section 4 ("Splitting: ZeRO/FSDP split states, TP splits weights, PP splits
layers, SP/CP split activations; offload"). Read memory_ledger.py first (one GPU, this
model); this file divides its components the way each parallel technique does, keeps
the literature's per-layer activation formula (Korthikanti et al. 2022) beside ours,
and asks what the same model needs at GPT-2 XL, 7B and 175B scale (the what-if).
Every row here is a formula: this project runs none of these techniques. Nothing here
restates the model: which tensors TP splits, which parameters, which terms live on which
pipeline stage all come from memory_ledger's description (its Terms, what its ops hold).
"""
from dataclasses import replace

import torch

import memory_ledger as ml
from config import Config
from ledger import plan
from model import GPT


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


# ---------------------------------------------------------------- the parallel techniques, per GPU

def tp_block_bytes(cfg, t, sp, paths=None):
    """One block's saved bytes per GPU under TP t: a term made inside a tensor-parallel region
    (between a column-parallel Linear and the row-parallel one after it: the description's
    `split`) is split over t; the rest is whole on every rank, or / t under SP (split along
    the sequence). paths: its submodules recomputed as units (None: block 0's, as cfg's policy says)."""
    if paths is None:
        paths = ml.unit_paths(cfg, 0)
    return sum(term.nbytes // t if (sp or term.region) else term.nbytes
               for term in ml.block_activation_terms(cfg, paths))


def tp_components(cfg, t, sp):
    """Per-GPU components under tensor parallelism t (Megatron), with or without sequence parallel.

    Parameters: what the description's ops split (the Linear weights, the column-parallel
    Linears' biases, the vocab-parallel embedding) / t; the rest (norms, row-parallel biases,
    wpe) replicated; buffers (the causal masks, FP8 amax state) replicated. Activations per
    Korthikanti et al. 2022 sec. 4.2: without SP the terms outside the parallel regions stay
    whole, in the blocks and out of them (outside, only the vocab-parallel logits'
    log-softmax and the loss are split); with SP every term is split along the sequence or
    the hidden dimension: / t. A unit's kept input is whole under TP, / t under SP."""
    c = ml.components(cfg)
    P, _ = ml.param_count(cfg)
    frac = (ml.split_param_count(cfg) / t + (P - ml.split_param_count(cfg))) / P
    p = ml.plan(cfg)
    acts = sum(n * tp_block_bytes(cfg, t, sp, paths) for paths, n in ml.block_kinds(cfg).items())
    acts += len(p.units) * ml.census(cfg)[2] // (t if sp else 1)
    acts += sum(term.nbytes // t if (sp or term.region) else term.nbytes for term in ml.outside_terms(cfg))
    # native FP8: each rank keeps the E4M3 copy of its shard of every Linear weight, and its own 16-byte scale and amax
    scalars = 16 * cfg.n_layer * len(ml.block_held(cfg, "fp8 weight")) if c["fp8_kept"] else 0
    return dict(parameters=int(c["parameters"] * frac), buffers=c["buffers"], gradients=int(c["gradients"] * frac),
                optimizer=int(c["optimizer"] * frac), fp8_kept=(c["fp8_kept"] - scalars) // t + scalars,
                activations=acts)


def zero_components(c, n, stage):
    """ZeRO stage 1/2/3 over n data-parallel ranks (Rajbhandari et al. 2020, sec. 5): the
    optimizer states (with the FP32 master copy), then the gradients, then the parameters
    partitioned / n. Buffers are not parameters: ZeRO-3/FSDP keeps them whole on every rank;
    nor are native FP8's weight copies kept during a step: copies of the whole (gathered) weights."""
    out = dict(c)
    for k in ("optimizer", "gradients", "parameters")[:stage]:
        out[k] = c[k] // n
    return out


def pp_stages(cfg, p):
    """(first stage, last stage) components under pipeline parallelism p with 1F1B (Megatron):
    each stage holds L/p blocks; stage i has p - i micro-batches in flight, so the first
    stage keeps p micro-batches of its blocks' activations (L blocks' worth) and of the
    embeddings' (and their parameters), the last stage one micro-batch of its blocks' and
    the head's (and its parameters). The tied output head needs the embedding's weight on the
    last stage too: Megatron keeps a copy there (its gradient all-reduced with the first
    stage's), with its own gradient and optimizer states."""
    L = cfg.n_layer
    c, (P, _) = ml.components(cfg), ml.param_count(cfg)
    per_param = {k: c[k] / P for k in ("parameters", "gradients", "optimizer")}  # bytes per parameter
    outside = ml.outside_terms(cfg)
    embed_acts = sum(term.nbytes for term in outside if term.scope == "embedding")
    head_acts = sum(term.nbytes for term in outside if term.scope == "head")
    block_acts = (c["activations"] - embed_acts - head_acts) / L  # per block (under sqrt, an average)
    block_params = ml.block_param_count(cfg)
    n_first = ml.held_count(cfg, "param", "embedding") + L // p * block_params
    n_last = L // p * block_params + ml.held_count(cfg, "param", "head") + ml.held_count(cfg, "tied", "head")

    def stage(n, acts):
        return dict({k: int(v * n) for k, v in per_param.items()}, buffers=c["buffers"] // p,
                    fp8_kept=c["fp8_kept"] // L * (L // p), activations=int(acts))
    return (stage(n_first, p * (L // p * block_acts + embed_acts)),
            stage(n_last, L // p * block_acts + head_acts))


def parallel_rows(cfg, ranks=8, tp=8, pp=8, cp=4):
    """[(technique, {component: bytes per GPU})] for the techniques this project does not run.

      ZeRO-1 optimizer states / N; ZeRO-2 also gradients / N; ZeRO-3 (FSDP) also parameters
        / N; buffers whole (zero_components).
      TP t, and TP + SP: tp_components (Megatron, Korthikanti et al. 2022).
      PP p: the first and the last stage (pp_stages: 1F1B, the tied embedding on both ends);
        p is the largest divisor of L up to `pp`, so that every stage holds L/p whole blocks.
      CP c: every activation term scales with s, each rank holds s/c of the sequence: / c.
      CPU offload (ZeRO-Offload): FP32 master, AdamW states and the gradients live in CPU memory.
    """
    c = ml.components(cfg)
    rows = [(f"ZeRO-{k} over {ranks}", zero_components(c, ranks, k)) for k in (1, 2, 3)]
    rows.append((f"tensor parallel t={tp}", tp_components(cfg, tp, sp=False)))
    rows.append((f"TP t={tp} + sequence parallel", tp_components(cfg, tp, sp=True)))
    p = max(k for k in range(1, min(pp, cfg.n_layer) + 1) if cfg.n_layer % k == 0)  # stages of L/p blocks
    first, last = pp_stages(cfg, p)
    rows += [(f"pipeline p={p}, first stage", first), (f"pipeline p={p}, last stage", last)]
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


def what_if(gpu_gib=80, ranks=8, precision_name="bf16"):
    """[dict(shape, P, ckpt, zero, states, buffers, activations, max_b)] per GPU, CUDA dtypes,
    manual attention, dropout as Config's default (0): states = parameters + gradients +
    master + AdamW, / ranks under ZeRO-3; buffers whole (ZeRO-3 does not shard them);
    activations after the forward at b=1; max_b: the planner's (ledger/plan.py, `make plan`)
    largest micro-batch on one GPU, or on one of `ranks` under ZeRO-3 (its fsdp rows' walk)."""
    out = []
    for name in BIG_SHAPES:
        for ckpt in ("none", "selective", "full"):
            for zero in (0, 3):
                cfg = big_config(name, precision=precision_name, ckpt=ckpt, attn="manual")
                c = zero_components(ml.components(cfg), ranks, 3 if zero else 0)
                out.append(dict(shape=name, P=ml.param_count(cfg)[0], ckpt=ckpt,
                                zero=f"ZeRO-3/{ranks}" if zero else "none",
                                states=c["parameters"] + c["gradients"] + c["optimizer"], buffers=c["buffers"],
                                activations=ml.activation_bytes(cfg),
                                max_b=plan.largest_micro_batch(replace(cfg, shard="fsdp" if zero else "none"),
                                                               gpu_gib * 2 ** 30, world=ranks if zero else 1)))
    return out
