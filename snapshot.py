"""Snapshots (save and resume a run) and the random streams they carry.

Chapter: none; a snapshot is what makes a long run survivable. It is not checkpointing: here
*checkpointing* always means activation recomputation (checkpoint.py). Read first: `capture` and
`restore`, then `rng_state` (checkpoint.py's re-run draws the same dropout masks with it).
A snapshot is one torch.save'd dict (model, optimizer, loss scaler, every rank's random streams,
the step, the config), written atomically, loaded with weights_only=True, every field checked.
"""
import dataclasses
import os
import stat
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from config import RunError, UsageError
from guards.files import write_atomically
from guards.sharded_snapshot import whole_groups
from guards.snapshot_fields import check_optimizer_fits, validate

FILE = "snapshot.pt"


def save(path, state):
    """Write a snapshot atomically; a failed write (a full disk) keeps the previous one."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda fh: torch.save(state, fh))
    except OSError as e:
        raise RunError(f"cannot write snapshot {path}: {e.strerror or e}; the previous snapshot is kept") from None
    except RuntimeError as e:  # torch.save's writer turns a failed write (ENOSPC) into "unexpected pos ..."
        raise RunError(f"cannot write snapshot {path} (is the disk full?): {str(e).splitlines()[0]}; the previous "
                       f"snapshot is kept") from None


def read(path):
    """The snapshot at `path`, every field checked (`validate`), or UsageError."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a pipe must not wait for a writer (a regular file ignores the flag)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UsageError(f"no snapshot at {path} to resume or sample from; train first") from None
    except OSError as e:  # a name too long, a folder without permission
        raise UsageError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before open(): it refuses a folder with IsADirectoryError
        os.close(fd)
        raise UsageError(f"snapshot {path} is not a regular file (a pipe, a device or a folder)")
    with open(fd, "rb") as fh:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns of a raw-pickle file before refusing it
                state = torch.load(fh, map_location="cpu", weights_only=True)  # tensors and plain data, no code
        except Exception as e:  # a foreign or damaged file
            raise UsageError(f"cannot read snapshot {path}: {type(e).__name__}") from None
    validate(state, path)
    return state


# ---------------------------------------------------------------- a run's snapshot

def capture(cfg, model, parts, batches, step, device, world_size=1):
    """Everything a bit-identical resume needs. Every rank has its own data and dropout
    streams, so the snapshot keeps each rank's RNG states (gathered to rank 0)."""
    rngs = [dict(batch=batches.gen.get_state(), **rng_state(device))]
    if world_size > 1:
        mine, rngs = rngs[0], [None] * world_size
        dist.all_gather_object(rngs, mine)
    # a ZeRO/FSDP optimizer's state is gathered into DDP's format (a collective: every rank calls capture)
    return dict(model=model.state_dict(), optimizer=parts.optimizer.state_dict(), scaler=parts.scaler.state_dict(),
                rng=rngs, step=step, config=dataclasses.asdict(cfg))


def restore(snap, model, parts, batches, rank, world_size, device, scaler=True):
    """Load a snapshot into this rank's run; returns the step to continue from. The run's own
    optimizer hyperparameters (AdamW's betas, weight decay: its flags) apply; scaler=False keeps the run's
    fresh loss scaler (a --loss_scale that differs from the snapshot's) instead of the saved one."""
    opt = parts.optimizer
    masters = snap["optimizer"]["master_params"]
    expected = opt.model_params if opt.master_weights else []  # a master per parameter, its shape
    if [tuple(m.shape) for m in masters] != [tuple(m.shape) for m in expected]:
        raise UsageError(f"--resume: the snapshot holds {len(masters)} master weights, this run has "
                         f"{len(expected)} (or their shapes differ)")
    if opt.spec.name not in snap["optimizer"]:
        raise UsageError(f"--resume: the snapshot holds another optimizer's state, this run's is {opt.spec.name}")
    check_optimizer_fits(snap["optimizer"][opt.spec.name], whole_groups(opt), opt.spec)  # zero's: a slice
    if len(snap["rng"]) != world_size:
        raise UsageError(f"--resume: the snapshot was written by {len(snap['rng'])} ranks, this run has "
                         f"{world_size}: each rank's data stream is in it")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.torch_optimizer.param_groups]
    try:
        model.load_state_dict(snap["model"])
        parts.optimizer.load_state_dict(snap["optimizer"])
        rng = snap["rng"][rank]
        batches.gen.set_state(rng["batch"])
        set_rng_state(rng, device)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # a snapshot that does not fit this run
        raise UsageError(f"--resume: snapshot does not fit this run: {str(e).splitlines()[0]}") from None
    for group, own in zip(opt.torch_optimizer.param_groups, hyper):
        group.update(own)
    if scaler:
        parts.scaler.load_state_dict(snap["scaler"])
    else:
        parts.scaler.skipped_steps = snap["scaler"]["skipped_steps"]
    return snap["step"]


# ---------------------------------------------------------------- random streams

def rng_state(device):
    """This process's random streams: the CPU generator, and the CUDA one on a GPU."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
