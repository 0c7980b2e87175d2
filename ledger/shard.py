"""What one rank holds under SHARD (zero.py, fsdp.py), as formulas: what `make ledger`'s
sharded rows, measured in two gloo processes (tools/ledger_ranks.py), are held against.

Chapter section 4. Read zero.py first. ledger/parallel.py's zero_components is the textbook's
division by N for any N; this is the exact figure for the runs this project makes: the flat
buffer's padding, AdamW's per-tensor step counts (one per parameter piece of a slice) and the
gradients the step holds (ZeRO-1 keeps the whole .grad beside its reduced slice, ZeRO-2 only
the slice), per rank.

Components (bytes), as ledger/measure.measure counts them, after a steady-state step:
  parameters      the parameters' storages (ZeRO: the padded flat buffer, whole on every rank)
  master          the FP32 master copy (a slice of it under ZeRO; 0 for fp32: the parameters are it)
  optimizer       AdamW's m and v, FP32, plus its FP32 step count per tensor (CPU only)
  step_gradients  the gradients alive while AdamW steps: .grad, the reduced slice, the FP32 sums
"""
import torch

import memory_ledger as ml
import precision
import zero
from model import GPT


def param_sizes(cfg):
    """Each parameter's element count in model.GPT's order (built on the meta device: no memory);
    the order decides which parameters a rank's slice cuts through."""
    with torch.device("meta"):
        model = GPT(cfg)
    sizes = [p.numel() for p in model.parameters()]
    assert sum(sizes) == ml.param_count(cfg)[0], "model.py and memory_ledger.py count different parameters"
    return sizes


def rank_states(cfg, shard, world, rank):
    """{component: bytes} for rank `rank` of `world` under SHARD=shard (none: DDP's whole copy)."""
    rec = precision.recipe(cfg)
    e, master = rec.element_bytes, rec.master_weights
    sizes = param_sizes(cfg)
    P = sum(sizes)
    step_counts = 0 if cfg.device == "cuda" else 4  # torch keeps AdamW's FP32 `step` on the CPU
    sums = cfg.fp32_grad_accum and master  # FP32 sums: .grad is added into them and released each micro-step
    whole_grad = 4 * P if sums else e * P  # what the micro-steps leave behind on every rank
    if shard == "none":
        return dict(parameters=e * P, master=4 * P if master else 0, optimizer=8 * P + step_counts * len(sizes),
                    step_gradients=whole_grad, padding=0)
    if shard in zero.STAGES:
        shards = zero.Shards(sizes, world, rank)
        pieces = shards.pieces()
        real = sum(n for *_, n in pieces)  # elements of parameters in my slice (the padding is none's)
        keeps_whole = zero.STAGES[shard] == 1 or sums  # ZeRO-1's .grad, or the FP32 sums: both whole
        return dict(parameters=e * (P + shards.padding), master=4 * real if master else 0,
                    optimizer=8 * real + step_counts * len(pieces),
                    step_gradients=(4 if sums else e) * shards.size + (whole_grad if keeps_whole else 0),
                    padding=shards.padding)
    raise ValueError(f"no per-rank formula for shard={shard}")
