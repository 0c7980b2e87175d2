"""The published figures beside ours: Korthikanti et al. 2022 and the ZeRO paper, reproduced.

Chapter section 4 (the whole picture, tied to the literature the chapter builds on).
Read memory_ledger.py first (our terms), then ledger/parallel.py (TP, ZeRO); this file
sets our formulas beside the sources' own, on the sources' own shapes, and says where
and why they differ. `make ledger` prints the table; `make ledger ARGS=--what_if_only`
prints it (and the what-if) without building or measuring anything.

The sources' figures are computed from the sources' formulas, never typed in:
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
from ledger.parallel import big_config, korthikanti_layer_terms, tp_block_bytes, zero_components


def norm_extras(cfg, t=1):
    """The bytes our block's norms keep beyond the 16-bit inputs Korthikanti's terms count for
    them ("LayerNorms: inputs", 4sbh): for LayerNorm its mean and rstd (FP32 on CUDA: 2 x 2 x
    b*s x 4 = 16bs per layer), which the paper drops; for another norm, whatever it keeps.
    Replicated under TP, / t under SP."""
    h, a, s, b = cfg.n_embd, cfg.n_head, cfg.block_size, cfg.batch_size
    counted = dict(korthikanti_layer_terms(s, b, h, a))["LayerNorms: inputs"]
    kept = sum(term.nbytes for term in ml.block_activation_terms(cfg) if term.role == ml.NORM)
    return (kept - counted) // t


def korthikanti_rows(t=8):
    """[(row, the paper's formula, paper bytes, ours, explained difference, why)] per layer,
    GPT-3 175B (s=2048, b=1, h=12288, a=96), CUDA BF16, manual attention."""
    gpt3 = big_config("175B (GPT-3)", precision="bf16", attn="manual", dropout=0.1)
    h, a, s, b = gpt3.n_embd, gpt3.n_head, gpt3.block_size, gpt3.batch_size
    sbh, core = s * b * h, 5 * a * s * s * b
    stats = norm_extras(gpt3)
    why = "our norms keep more than their inputs (LayerNorm: the FP32 mean+rstd, 16bs), the paper drops it"
    ours = lambda cfg: sum(term.nbytes for term in ml.block_activation_terms(cfg, ml.unit_paths(cfg, 0)))  # noqa
    no_drop = replace(gpt3, dropout=0.0)
    # eq. 1 less its dropout terms: the a*s^2 mask (1 byte) and output (2 bytes), two sbh masks
    paper_no_drop = ml.layer_activations_closed(s, b, h, a, dropout=False)
    sel = replace(gpt3, ckpt="selective")
    return [
        ("GPT-3 175B, eq. 1 (with dropout)", "sbh(34 + 5as/h)", ml.layer_activations_closed(s, b, h, a), ours(gpt3),
         stats, why),
        ("GPT-3 175B, eq. 1 less its dropout terms", "sbh(32 + 2as/h)", paper_no_drop, ours(no_drop),
         norm_extras(no_drop), why),
        (f"Table 2: TP t={t}", "sbh(10 + 24/t + 5as/(ht))", 10 * sbh + 24 * sbh // t + core // t,
         tp_block_bytes(gpt3, t, sp=False), stats, why + " (replicated under TP)"),
        (f"Table 2: TP t={t} + SP", "sbh(34/t + 5as/(ht))", 34 * sbh // t + core // t, tp_block_bytes(gpt3, t, sp=True),
         norm_extras(gpt3, t), why + " (/ t under SP)"),
        (f"Table 2: TP t={t} + selective", "sbh(10 + 24/t)", 10 * sbh + 24 * sbh // t, tp_block_bytes(sel, t, sp=False),
         stats, why + " (replicated under TP)"),
        (f"Table 2: TP t={t} + SP + selective", "sbh(34/t)", 34 * sbh // t, tp_block_bytes(sel, t, sp=True),
         norm_extras(gpt3, t), why + " (/ t under SP)"),
        ("Table 2: full recomputation", "2sbh", ml.full_recompute_layer_closed(s, b, h), kept_per_layer(gpt3), 0,
         "the same: each layer keeps its 16-bit input"),
    ]


def kept_per_layer(cfg):
    """Bytes full recompute keeps per layer: all activations less the head's, over L."""
    full = replace(cfg, ckpt="full")
    return (ml.activation_bytes(full) - sum(term.nbytes for term in ml.outside_terms(full))) // full.n_layer


def bytes_per_param(cfg):
    """(params, grads, master, optimizer) bytes per parameter, from the description's states (CUDA: no step
    counts): 4+4+0+8 or 2+2+4+8 (= 16, the ZeRO figure)."""
    one = replace(cfg, n_layer=1, n_embd=64, n_head=1, block_size=1, batch_size=1, vocab_size=1, device="cuda",
                  attn="sdpa", ckpt="none", ckpt_segment=0)
    st, (P, _) = ml.state_bytes(one), ml.param_count(one)
    return tuple(st[k] / P for k in ("parameters", "gradients", "master", "optimizer"))


def zero_rows(psi=7.5e9, n=64):
    """ZeRO Table 1's row, Psi parameters over N_d GPUs, 1 GB = 1e9 bytes: baseline, P_os,
    P_os+g, P_os+g+p; the paper's (2+2+K)Psi terms with K = 12 against our bytes_per_param."""
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


# ---------------------------------------------------------------- the closed forms beside the description

def closed_form_rows(cfg):
    """[(quantity, formula, closed, described, [(difference, bytes)])] for cfg: memory_ledger's closed
    forms beside the op-by-op description's exact figure, with what differs named and counted, so that
    closed + the differences = described. A learner's change the differences do not cover shows up as
    "not explained by the closed form"."""
    rec, z = precision.recipe(cfg), ml.sizes(cfg)
    e, sbh, sb = rec.element_bytes, z.bsh, z.b * z.s
    P, n_tensors = ml.param_count(cfg)
    st = ml.state_bytes(cfg)
    spec = precision.OPTIMIZERS[cfg.optimizer]
    per = ml.bytes_per_param_closed(rec.name, len(spec.per_element))
    described = st["parameters"] + st["gradients"] + st["master"] + st["optimizer"]
    counts = len(spec.per_tensor) * 4 * n_tensors * (not z.cuda)
    differences = [(f"{spec.name}'s per-tensor counts ({', '.join(spec.per_tensor)}): FP32, kept on the CPU", counts),
                   ("the FP32 gradient sums (fp32_grad_accum)", st["gradients"] - per[1] * P)]
    rows = [_row("model states", f"{sum(per)} bytes/parameter ({' + '.join(map(str, per))}) x P",
                 sum(per) * P, described, differences)]

    kinds, n_units = ml.block_kinds(cfg), len(ml.plan(cfg).units)
    n_plain, n_core = kinds.get((), 0), kinds.get(("attn.core",), 0)  # other kinds: no closed form (below)
    sdpa, dropout = cfg.attn == "sdpa", cfg.dropout > 0
    layer = ml.layer_activations_closed(z.s, z.b, z.h, z.a, e, dropout, sdpa)
    selective = ml.layer_activations_closed(z.s, z.b, z.h, z.a, e, dropout, sdpa=True)
    closed = n_plain * layer + n_core * selective + n_units * ml.full_recompute_layer_closed(z.s, z.b, z.h, e)
    formula = {"none": "L x sbh(34 + 5as/h)" if dropout else "L x sbh(32 + 2as/h)", "full": "L x 2sbh",
               "selective": "L x 34sbh" if dropout else "L x 32sbh"}.get(cfg.ckpt, f"{n_units} units x 2sbh "
                                                                           f"(L/k + k at the peak)")
    if sdpa and cfg.ckpt == "none":
        formula = "L x 34sbh" if dropout else "L x 32sbh"
    kept = n_plain + n_core  # blocks that keep their insides
    terms = [t for t in ml.block_activation_terms(cfg) if t.role == ml.NORM]
    norms = sum(t.nbytes for t in terms) - 2 * e * sbh
    others = [t.name for t in terms if not (t.name.endswith(" input") and t.nbytes == e * sbh)]  # not the paper's
    masks = (kept * 2 * sbh + (0 if sdpa else n_plain * z.a * z.s * sb)) * dropout  # the paper's 1-byte masks
    differences = [(f"the norms keep {', '.join(others)} (the paper: their inputs only)", kept * norms),
                   ("outside the blocks: embeddings, ln_f, the head's input and FP32 log-softmax",
                    sum(t.nbytes for t in ml.outside_terms(cfg))),
                   ("dropout's masks in the activation dtype on CPU, not 1 byte", masks * (z.mask_bytes - 1))]
    if z.core == "sdpa":  # its output is c_proj's input, but an FP8 c_proj keeps an E4M3 copy instead
        differences.append(("sdpa keeps its FP32 logsumexp (and its output, under FP8)",
                            n_plain * (4 * z.b * z.a * z.lse_rows + e * sbh * (rec.fp8 is not None))))
    if z.core == "math":  # q, k, v, the softmax, its mask and its output, all in FP32
        whole_qkv = 2 * 4 * sbh if (e == 4 and z.b == 1) else 0  # one FP32 sequence: v is c_attn's output, kept
        differences.append(("CPU's sdpa with dropout runs torch's math path in FP32 (the s x s softmax kept)",
                            n_plain * (3 * (4 - e) * sbh + 3 * 4 * z.a * z.s * sb + whole_qkv)))
    if rec.fp8 is not None:  # the four Linears' inputs, h + h + h + 4h per token, at 1 byte instead of e
        differences.append(("FP8 Linears keep their inputs in E4M3, 1 byte per element",
                            -kept * (e - 1) * 7 * sbh))
    rows.append(_row(f"activations, ckpt={cfg.ckpt}", formula, closed, ml.activation_bytes(cfg), differences))
    return rows


def _row(quantity, formula, closed, described, differences):
    named = [(why, n) for why, n in differences if n]
    rest = described - closed - sum(n for _, n in named)
    if rest:
        named.append(("not explained by the closed form (a change to the model?)", rest))
    return quantity, formula, closed, described, named
