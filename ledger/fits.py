"""Will this shape's step fit? The tools' check, before they build anything: the chapter's closed forms, and the
traced step near the line.

Not read to learn the chapter (train.py has its own, shorter: guards/clean_end.check_fits and within_memory,
which need no ledger). Read first: `check_fits`, then `closed_form_need` (memory_ledger.py's closed forms,
P from model.py on the meta device).
"""
import dataclasses
import os

import torch

import memory_ledger
import precision
from config import UsageError
from guards.clean_end import memory_free
from ledger import trace
from model import GPT

TRACED_LAYERS = 96  # deeper, check_fits takes the closed forms alone: a trace's time grows with the depth


def check_fits(cfg, device):
    """Raise UsageError when a step's peak exceeds what this device has free (CPU: available memory shared by this
    node's ranks). The chapter's closed forms first, in O(1) (16 bytes a parameter, the layers' activations, the
    head's); where they come within a factor of 2 of what is free, the traced step of this run (ledger/trace.py:
    model.py on fake tensors, seconds at a large shape)."""
    (free, where), world = memory_free(device), int(os.environ.get("WORLD_SIZE", 1))
    ledger_cfg = dataclasses.replace(cfg, device=device.type)
    try:
        need, how = closed_form_need(ledger_cfg, world), "the chapter's closed forms"
        if free / 2 < need <= 2 * free and cfg.n_layer <= TRACED_LAYERS:  # near the line: the trace says exactly
            micro_steps = 2 if cfg.accum > 1 or cfg.total_batch_tokens else 1
            need, how = trace.step(ledger_cfg, world, int(os.environ.get("RANK", 0)), micro_steps)["peak"], \
                "the traced step"
    except Exception:  # noqa: BLE001  (the learner's model, failing here: make ledger says why; the run goes on)
        return
    if need > free:
        raise UsageError(f"this shape needs about {need / 2**30:,.1f} GiB for one step ({how}), "
                         f"{free / 2**30:,.1f} GiB {where}: make it smaller")


def closed_form_need(cfg, world=1):
    """Bytes of a step by the chapter's closed forms: the states per rank (ZeRO's division by SHARD),
    every layer's activations and the head's (memory_ledger.py), P from model.py on the meta device."""
    with torch.device("meta"):  # one block and two: blocks are alike (a deep model's modules take minutes to make)
        one, two = (sum(p.numel() for p in GPT(dataclasses.replace(cfg, n_layer=n)).parameters()) for n in (1, 2))
    P = one + (cfg.n_layer - 1) * (two - one)
    stage = {"none": 0, "zero1": 1, "zero2": 2, "fsdp": 3}[cfg.shard]
    prec = precision.decide(cfg)
    e, s, b, h, a = prec.element_bytes, cfg.block_size, cfg.batch_size, cfg.n_embd, cfg.n_head
    return memory_ledger.zero_bytes_per_rank(P, world, stage, prec.name) + \
        cfg.n_layer * memory_ledger.layer_activations_closed(s, b, h, a, e, cfg.dropout > 0, cfg.attn == "sdpa") + \
        memory_ledger.head_activations_closed(s, b, h, cfg.vocab_size, e)
