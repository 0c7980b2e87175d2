"""What every rank checks before a run is built: the input, out_dir (and its lock), the snapshot, K.

Chapter: none; it is why bad input costs nothing. Read first: `preflight` (called by
train.train on every rank before any process group exists, so a refusal is one line on
each rank and no rank waits for another), then `resolve_accum`.
"""
import dataclasses
import os
import re
from pathlib import Path

import torch

import accumulate
import checkpoint
import memory_ledger
from guards import clean_end as guard
from ledger import trace
import precision
import snapshot
from guards import compiling, files
from guards import snapshot_fields
import config
from config import UsageError
from data import load_tokens, split_tokens
from model import GPT, default_linear
from guards.data_files import host_memory_available
from guards.report import MEMORY_HISTORY

GiB = 2 ** 30
TRACED_LAYERS = 96  # deeper, check_fits takes the closed forms alone: a trace's time grows with the depth

# K micro-step gradients, each 1/K of the step's, add up in FP32 at best (a 24-bit significand):
# past 2^24 micro-steps each one is below half an FP32 ulp of the sum and adds nothing
MAX_ACCUM = 2 ** 24
# the lowest torch this code runs on: checkpoint.py asks torch.is_autocast_enabled(device_type) and
# torch.get_autocast_dtype(device_type), both new in 2.4 (torch/amp/autocast_mode.py); the rest it
# calls is older (float8 dtypes and torch._scaled_mm 2.1, whose tuple return before 2.5
# backends/fp8_gemm.py unpacks; nn.LayerNorm's bias= 2.1). The suite was run on 2.11 to 2.14 (README).
TORCH_FLOOR = (2, 4)


def torch_floor_error(version=None):
    """Why this torch is older than TORCH_FLOOR, or None; guards/cli.run asks it before anything else."""
    version = version or torch.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or tuple(map(int, found.groups())) >= TORCH_FLOOR:
        return None
    return (f"torch {version} is older than this code supports: it needs torch >= "
            f"{'.'.join(map(str, TORCH_FLOOR))} (torch.get_autocast_dtype(device_type)); "
            f"the tested range is in the README")


def launcher_error(env=None):
    """Why torchrun's variables in the environment cannot be a run's, or None; cli.run asks it before
    anything reads them (int() of 'abc' and a division by LOCAL_WORLD_SIZE=0 were tracebacks)."""
    env = os.environ if env is None else env
    counts = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        if name in env and not re.fullmatch(r"[0-9]{1,9}", env[name]):
            return f"{name}={env[name]!r} is not a count: torchrun sets it (start the run with torchrun, or unset it)"
        if name in env:
            counts[name] = int(env[name])
    for size, index in (("WORLD_SIZE", "RANK"), ("LOCAL_WORLD_SIZE", "LOCAL_RANK")):
        if counts.get(size) == 0:
            return f"{size}=0: a run has at least one process (torchrun sets it: start the run with torchrun)"
        if index in counts and size in counts and counts[index] >= counts[size]:
            return f"{index}={counts[index]} is not below {size}={counts[size]}: torchrun numbers its " \
                   f"processes from 0 (start the run with torchrun)"
    unset = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if "RANK" in env and unset:  # init_process_group reads all four
        return f"RANK is set but {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not: torchrun sets them " \
               f"all (start the run with torchrun, or unset RANK)"
    if "WORLD_SIZE" in env and "RANK" not in env:
        return "WORLD_SIZE is set but RANK is not: torchrun sets both (start the run with torchrun, or unset " \
               "WORLD_SIZE)"
    return None


def preflight(cfg, device, rank, held):
    """Everything bad input can trip on, on every rank, before anything heavy is built, any
    process group exists or anything is written; rank 0 then holds out_dir (its lock goes into
    the ExitStack `held`). Returns (the snapshot to resume from or None, train tokens, val tokens)."""
    if cfg.shard != "none" and config.world_size() == 1:
        raise UsageError(f"--shard={cfg.shard} splits the run's states over its ranks, and this run has one: start "
                         f"it with torchrun (make ddp NPROC=2 SHARD={cfg.shard})")
    if cfg.memory_snapshot and device.type != "cuda":
        raise UsageError("--memory_snapshot records the CUDA allocator's history: it needs a CUDA device")
    check_fits(cfg, device)
    if cfg.compile and (why := compiling.compile_error(device)):
        raise UsageError(why)
    try:
        precision.decide(cfg).check_device(device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if rank == 0:  # the writer of snapshots: its folder must take them
        files.check_writable(cfg.out_dir, "--out_dir")
    else:  # rank 0 probes the same folder now: look without making anything
        files.check_reachable(cfg.out_dir, "--out_dir")
    tokens = split_tokens(load_tokens(cfg.data), cfg.block_size)
    if rank == 0:  # no other run may write there from now on: the snapshot read next is the one continued
        held.enter_context(guard.out_dir_lock(cfg.out_dir))
    snap, path = None, Path(cfg.out_dir) / snapshot.FILE
    if cfg.resume:
        snap = snapshot.read(path)
        check_saved_policy(snap, path)
        snapshot_fields.check_same_model(snap, cfg, precision.decide(cfg).fp8 is not None, path)
        snapshot_fields.check_model_state(snap, meta_model(cfg), path)
    if rank == 0:  # what a killed run of ours left in out_dir goes
        files.remove_stale_temps(cfg.out_dir, (snapshot.FILE, files.PROBE, MEMORY_HISTORY))
    return snap, *tokens


def meta_model(cfg):
    """The model cfg's run builds, on the meta device (no memory, no values): the names, dtypes and shapes
    of what its snapshot holds. Transformer Engine's Linears hold a weight and a bias as nn.Linear does."""
    prec = precision.decide(cfg)
    te = prec.fp8 is not None and prec.fp8.backend == "te"
    with torch.device("meta"):
        return GPT(cfg, linear_factory=default_linear if te else prec.linear_factory()).to(prec.param_dtype)


def scaler_asked_anew(cfg, snap):
    """True when this run's loss scaling (--loss_scale and the dynamic scale's keys) differs from the
    snapshot's: the run's own scaler then starts fresh, as asked, instead of the saved one."""
    mine, saved = precision.decide(cfg), precision.decide(snapshot_fields.saved_config(snap))
    return (mine.loss_scaling, mine.static_scale, mine.hysteresis, mine.growth) != \
        (saved.loss_scaling, saved.static_scale, saved.hysteresis, saved.growth)


def resolve_accum(cfg, world_size):
    """K, from --accum or --total_batch_tokens; refused where an optimizer step cannot finish."""
    accum, source = cfg.accum, f"accum={cfg.accum}"
    if cfg.total_batch_tokens:
        try:
            accum = accumulate.accum_from_total_tokens(cfg.total_batch_tokens, cfg.batch_size, world_size,
                                                       cfg.block_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        source = f"total_batch_tokens={cfg.total_batch_tokens} is accum={accum}"
    if accum > MAX_ACCUM:
        raise UsageError(f"{source} micro-steps per optimizer step: past 2^24 = {MAX_ACCUM:,} a micro-step's "
                         f"gradient (1/K of the sum) is below half an FP32 ulp of the sum and adds nothing; "
                         f"use a larger --batch_size or fewer tokens per step")
    # held per optimizer step: accumulate.accumulation_step's two lists of weights (16 bytes a micro-step) and, for
    # loss_norm=tokens, every micro-batch (x and y, int64) at once; otherwise they are drawn as used
    held = accum * (16 + (16 * cfg.batch_size * cfg.block_size + 600 if cfg.loss_norm == "tokens" else 0))
    if held > host_memory_available() // 2:
        raise UsageError(f"{source} micro-steps per optimizer step hold {held / 2**30:.1f} GiB at once, more than "
                         f"half the {host_memory_available() / 2**30:.1f} GiB of memory available"
                         + ("; loss_norm=mean draws micro-batches as used" if cfg.loss_norm == "tokens" else ""))
    return accum


def check_saved_policy(snap, path):
    """The saved config's recompute policy, by the command line's own rules (checkpoint.policy):
    snapshot.read checks the rest of it through config.validate, which does not know the policies."""
    try:
        checkpoint.policy(snapshot_fields.saved_config(snap))
    except UsageError as e:
        raise UsageError(f"snapshot {path} is not usable: its config: {e}") from None


# ---------------------------------------------------------------- will this run fit?

def check_fits(cfg, device):
    """Raise UsageError when a step's peak exceeds what this device has free (CPU: available memory shared
    by this node's ranks): refused before anything is built. The chapter's closed forms first, in O(1)
    (16 bytes a parameter, the layers' activations, the head's); where they come within a factor of 2 of
    what is free, the traced step of this run (ledger/trace.py: model.py on fake tensors, seconds at a large
    shape)."""
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"free on {torch.cuda.get_device_name(device)}"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        free = host_memory_available() // ranks
        where = "of memory available" + (f" per rank ({ranks})" if ranks > 1 else "")
    world = int(os.environ.get("WORLD_SIZE", 1))
    ledger_cfg = dataclasses.replace(cfg, device=device.type)
    try:
        need, how = closed_form_need(ledger_cfg, world), "the chapter's closed forms"
        if free / 2 < need <= 2 * free and cfg.n_layer <= TRACED_LAYERS:  # near the line: the trace says exactly
            need, how = traced(ledger_cfg, world, 2 if cfg.accum > 1 or cfg.total_batch_tokens else 1)["peak"], \
                "the traced step"
    except Exception:  # noqa: BLE001  (the learner's model, failing here: make ledger says why; the run goes on)
        return
    if need > free:
        raise UsageError(f"this shape needs about {need / GiB:,.1f} GiB for one step ({how}), "
                         f"{free / GiB:,.1f} GiB {where}: make it smaller")


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


def traced(cfg, world, micro_steps=1):
    """This rank's step, traced (with a later micro-step where micro_steps = 2), before any process group."""
    return trace.step(cfg, world, int(os.environ.get("RANK", 0)), micro_steps)
