"""The whole picture: what splitting across GPUs does to the four components (big shapes: make plan).

Chapter section 4 ("Splitting: ZeRO/FSDP split states, TP splits weights, PP splits layers, SP/CP
split activations; offload"). Read memory_ledger.py first, then `tp_components` and `pp_stages`. ZeRO
and FSDP over N ranks are traced (rank 0); TP, PP, CP and offload, which this project does not run, are
the papers' rules applied tensor by tensor to this config's traced step: which term a tensor is, the
module that saved it, whether model.py's Linear writes into the residual stream (`residual_projection`).
"""
from dataclasses import replace

import memory_ledger as ml
import precision
from ledger import trace


def zero_components(c, n, stage):
    """ZeRO stage 1/2/3 over n data-parallel ranks (Rajbhandari et al. 2020, sec. 5) as the paper divides:
    the optimizer states (with the FP32 master copy), then the gradients, then the parameters / n.
    Buffers and native FP8's kept weight copies are not parameters: whole on every rank."""
    out = dict(c)
    for k in ("optimizer", "gradients", "parameters")[:stage]:
        out[k] = c[k] // n
    return out


def te_weights(c, cfg):
    """Transformer Engine's row, from native FP8's counted one: its Linears quantize an E4M3 weight and its
    transpose (1 byte each per weight element). FP8_KEEP_WEIGHT (is_first_microbatch set): cached across
    steps, in the parameters' row; off (None): made by each forward and saved for its backward, activations."""
    linear = sum(n for _, n, dim, kind, _ in trace.step(cfg)["named"] if kind == "linear" and dim == 2)
    held = "parameters" if precision.decide(cfg).fp8.keep_weight else "activations"
    return dict(c, **{held: c[held] + 2 * linear}, fp8_kept=0)


def _split(saved, term, traced, t, sp):
    """Bytes of one saved tensor per GPU under TP t (Korthikanti et al. 2022, sec. 4.2): inside a
    tensor-parallel region (after a column-parallel Linear, before a row-parallel one: q, k, v, the
    attention core's, the activation's input, a row-parallel Linear's input, the vocab-parallel logits'
    log-softmax) / t; the rest whole, or / t along the sequence under SP."""
    where = saved.modules[0] if saved.modules else ""
    inside = term in ("qkv", "softmax", "activation") or (term == "masks" and traced["kinds"].get(where) == "core") \
        or (term == "linears" and any(m in traced["row_parallel"] for m in saved.modules)) \
        or (term == "head" and any(node == "LogSoftmaxBackward0" for node, *_ in saved.inputs))
    return saved.nbytes // t if sp or inside else saved.nbytes


def tp_components(cfg, t, sp):
    """Per-GPU components under tensor parallelism t (Megatron), with or without sequence parallel.
    Parameters (and their gradients and states): a Linear's weight, a column-parallel Linear's bias and
    the vocab-parallel embedding / t; norms, row-parallel biases and position embeddings whole. Buffers
    whole. Activations: `_split` of every saved tensor."""
    traced = trace.step(cfg)
    c = ml.components(traced)
    P = sum(n for _, n, *_ in traced["named"])
    split = sum(n for name, n, dim, kind, row in traced["named"]
                if (kind == "linear" and (dim == 2 or not row)) or name == "wte.weight")
    frac = (split / t + P - split) / P
    terms, unmatched = ml.account(traced["saved_tensors"], traced["kinds"])
    acts = sum(_split(s, term, traced, t, sp) for term, tensors in terms.items() for s in tensors) + \
        sum(s.nbytes // (t if sp else 1) for s in unmatched)
    return dict(parameters=int(c["parameters"] * frac), buffers=c["buffers"], gradients=int(c["gradients"] * frac),
                optimizer=int(c["optimizer"] * frac), fp8_kept=c["fp8_kept"] // t, activations=acts)


def pp_stages(cfg, p):
    """(first stage, last stage) components under pipeline parallelism p with 1F1B (Megatron): each stage
    holds L/p blocks; stage i has p - i micro-batches in flight, so the first keeps p micro-batches of its
    blocks' activations and of the embeddings', the last one micro-batch of its blocks' and the head's.
    The embeddings' parameters sit on the first stage, the rest outside the blocks on the last; a head tied
    to wte keeps a copy of it there (Megatron's, with its own gradient and states)."""
    traced, L = trace.step(cfg), cfg.n_layer
    c = ml.components(traced)
    P = sum(n for _, n, *_ in traced["named"])
    per_param = {k: c[k] / P for k in ("parameters", "gradients", "optimizer")}
    saved = traced["saved_tensors"].values()
    blocks = sum(s.nbytes for s in saved if s.modules and s.modules[0].startswith("h."))
    embedding = sum(s.nbytes for s in saved if s.modules and traced["kinds"].get(s.modules[0]) in
                    ("embedding", "dropout") and not s.modules[0].startswith("h."))
    head = traced["activations"] - blocks - embedding
    in_blocks = sum(n for name, n, *_ in traced["named"] if name.startswith("h."))
    first = sum(n for name, n, _, kind, _ in traced["named"] if kind == "embedding" and not name.startswith("h."))
    last = P - in_blocks - first
    tied = not any(kind == "linear" for name, _, _, kind, _ in traced["named"] if not name.startswith("h."))
    last += sum(n for name, n, *_ in traced["named"] if name == "wte.weight") * tied

    def stage(n, acts):
        return dict({k: int(v * n) for k, v in per_param.items()}, buffers=c["buffers"] // p,
                    fp8_kept=c["fp8_kept"] // p, activations=int(acts))
    return (stage(first + in_blocks / p, p * (blocks / p + embedding)), stage(last + in_blocks / p, blocks / p + head))


def parallel_rows(cfg, ranks=8, tp=8, pp=8, cp=4):
    """[(technique, {component: bytes per GPU}, how)]: ZeRO-1, ZeRO-2 and FSDP over `ranks`, traced (rank 0);
    TP t and TP + SP (tp_components); the first and last PP stage (p the largest divisor of L up to pp);
    CP c (every activation scales with s: / c); CPU offload (ZeRO-Offload: gradients, FP32 master and
    AdamW's states in host memory): formulas on the trace."""
    c = ml.components(trace.step(cfg))
    rows = []
    for shard, name in (("zero1", "ZeRO-1"), ("zero2", "ZeRO-2"), ("fsdp", "FSDP (ZeRO-3)")):
        try:
            sharded = trace.step(replace(cfg, shard=shard), ranks, 0)
        except Exception:  # noqa: BLE001  (FSDP refuses FP8: config.validate says so; no row then)
            continue
        rows.append((f"{name} over {ranks} (rank 0)", dict(ml.components(sharded), gradients=sharded["step_gradients"]),
                     "traced"))
    rows.append((f"tensor parallel t={tp}", tp_components(cfg, tp, sp=False), "formula"))
    rows.append((f"TP t={tp} + sequence parallel", tp_components(cfg, tp, sp=True), "formula"))
    p = max(k for k in range(1, min(pp, cfg.n_layer) + 1) if cfg.n_layer % k == 0)  # stages of L/p blocks
    first, last = pp_stages(cfg, p)
    rows += [(f"pipeline p={p}, first stage", first, "formula"), (f"pipeline p={p}, last stage", last, "formula")]
    rows.append((f"context parallel c={cp}", dict(c, activations=c["activations"] // cp), "formula"))
    rows.append(("CPU offload (ZeRO-Offload)", dict(c, gradients=0, optimizer=0), "formula"))
    return rows
