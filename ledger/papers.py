"""The published figures beside ours: Korthikanti et al. 2022 and the ZeRO paper, reproduced.

Chapter section 4, tied to the literature it builds on. Read memory_ledger.py first (our terms), then
ledger/parallel.py (TP, ZeRO). The sources' formulas on their own shapes, beside our step traced at that
shape, naming the tensors a formula does not count as they are (memory_ledger.as_counted); the sources'
figures computed from their formulas, never typed in:
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
    eq. 1, activations per layer, 16-bit, 1-byte dropout masks: sbh(34 + 5as/h); Table 2,
    the same with tensor parallelism t, sequence parallelism and recomputation.
  Rajbhandari et al. 2020 (ZeRO), sec. 3.1 and Table 1: mixed-precision Adam keeps
    2 + 2 + K bytes per parameter, K = 12; Table 1 prints a 7.5B model over N_d = 64 GPUs.
"""
from dataclasses import replace

import memory_ledger as ml
import precision
from config import Config
from ledger import trace
from ledger.parallel import _split, zero_components


def layer(cfg, t=1, sp=False):
    """(bytes block 0 keeps per GPU under TP t, and of those, the tensors the formula does not count as they are)."""
    traced = trace.step(cfg)
    terms, unmatched = ml.account(traced["saved_tensors"], traced["kinds"])
    dtype = str(precision.decide(cfg).param_dtype).removeprefix("torch.")
    rows = [(term, s) for term, tensors in terms.items() for s in tensors] + [(None, s) for s in unmatched]
    mine = [(term, s) for term, s in rows if s.modules and s.modules[0].startswith("h.0.")]
    per_gpu = lambda pairs: sum(_split(s, term, traced, t, sp) for term, s in pairs)  # noqa: E731
    return per_gpu(mine), per_gpu([(term, s) for term, s in mine if term is None or not ml.as_counted(term, s, dtype)])


def korthikanti_rows(t=8):
    """[(row, the paper's formula, paper bytes, ours, explained difference, why)] per layer, GPT-3 175B
    (s=2048, b=1, h=12288, a=96), CUDA BF16, manual attention, dropout 0.1, two layers traced."""
    gpt3 = Config(n_layer=2, n_embd=12288, n_head=96, block_size=2048, vocab_size=50257, batch_size=1, device="cuda",
                  precision="bf16", attn="manual", dropout=0.1)  # (two of its 96 layers: blocks are alike)
    h, a, s, b = gpt3.n_embd, gpt3.n_head, gpt3.block_size, gpt3.batch_size
    sbh, core = s * b * h, 5 * a * s * s * b
    why = "what our layer keeps that the formula does not count as it is: LayerNorm's FP32 mean and rstd (16bs)"
    no_drop, sel = replace(gpt3, dropout=0.0), replace(gpt3, ckpt="selective")
    rows = []
    for name, formula, paper, cfg, tp, sp, note in [
            ("GPT-3 175B, eq. 1 (with dropout)", "sbh(34 + 5as/h)", ml.layer_activations_closed(s, b, h, a), gpt3, 1,
             False, ""),
            ("GPT-3 175B, eq. 1 less its dropout terms", "sbh(32 + 2as/h)",
             ml.layer_activations_closed(s, b, h, a, dropout=False), no_drop, 1, False, ""),
            (f"Table 2: TP t={t}", "sbh(10 + 24/t + 5as/(ht))", 10 * sbh + 24 * sbh // t + core // t, gpt3, t, False,
             " (replicated under TP)"),
            (f"Table 2: TP t={t} + SP", "sbh(34/t + 5as/(ht))", 34 * sbh // t + core // t, gpt3, t, True,
             " (/ t under SP)"),
            (f"Table 2: TP t={t} + selective", "sbh(10 + 24/t)", 10 * sbh + 24 * sbh // t, sel, t, False,
             " (replicated under TP)"),
            (f"Table 2: TP t={t} + SP + selective", "sbh(34/t)", 34 * sbh // t, sel, t, True, " (/ t under SP)")]:
        ours, explained = layer(cfg, tp, sp)
        rows.append((name, formula, paper, ours, explained, why + note))
    full = replace(gpt3, ckpt="full")
    kept = sum(s.nbytes for s in trace.step(full)["saved_tensors"].values()
               if any(node == "RerunNodeBackward" for node, *_ in s.inputs)) // 2
    rows.append(("Table 2: full recomputation", "2sbh", ml.full_recompute_layer_closed(s, b, h), kept, 0,
                 "the same: each layer keeps its 16-bit input"))
    return rows


def bytes_per_param(cfg):
    """(params, grads, master, optimizer) bytes per parameter of cfg's traced step on a GPU (AdamW's step
    counts in host memory): 4+4+0+8 or 2+2+4+8 (= 16, the ZeRO figure)."""
    one = replace(cfg, n_layer=1, n_embd=64, n_head=1, block_size=16, batch_size=1, device="cuda", attn="sdpa",
                  ckpt="none", ckpt_segment=0)
    traced = trace.step(one)
    P = traced["params"][0]
    return tuple(traced[k] / P for k in ("parameters", "gradients", "master", "optimizer"))


def zero_rows(psi=7.5e9, n=64):
    """ZeRO Table 1's row, Psi parameters over N_d GPUs, 1 GB = 1e9 bytes: baseline, P_os, P_os+g,
    P_os+g+p; the paper's (2+2+K)Psi terms with K = 12 against our traced bytes per parameter."""
    K = 12
    paper = [(2 + 2 + K) * psi, 2 * psi + 2 * psi + K * psi / n, 2 * psi + (2 + K) * psi / n, (2 + 2 + K) * psi / n]
    p, g, m, o = bytes_per_param(Config(precision="bf16"))
    ours = dict(parameters=p * psi, buffers=0, gradients=g * psi, optimizer=(m + o) * psi)
    rows = [("ZeRO sec. 3.1: bytes per parameter", "2 + 2 + K", 2 + 2 + K, p + g + m + o)]
    for stage, name in enumerate(("baseline", "P_os (ZeRO-1)", "P_os+g (ZeRO-2)", "P_os+g+p (ZeRO-3)")):
        c = zero_components(ours, n, stage)
        rows.append((f"ZeRO Table 1: {name}", "GB per GPU", paper[stage] / 1e9,
                     (c["parameters"] + c["gradients"] + c["optimizer"]) / 1e9))
    return rows
