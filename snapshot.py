"""Snapshots (save and resume a run) and the random streams they carry.

Chapter: none; a snapshot is what makes a long run survivable. It is not checkpointing:
in this project *checkpointing* always means activation recomputation (checkpoint.py).
Read first: `write_atomically`, then `rng_state` (also used by checkpoint.py, whose
re-run forward must draw the same dropout masks), then `read` and `check_fits`.

A snapshot is one torch.save'd dict: model and optimizer state, every rank's random
streams, the step, and the config. It is written to a temporary file beside the target
and renamed over it, so a crash mid-write leaves the previous snapshot intact, and it is
loaded with weights_only=True, so a foreign file cannot run code.
"""
import dataclasses
import os
from pathlib import Path

import torch
import torch.distributed as dist

from config import UsageError

FILE = "snapshot.pt"
# the keys that must agree between a snapshot and the run that resumes from (or samples) it
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "precision")
FP8_SHAPE_KEYS = ("fp8_backend", "fp8_amax_history")  # the FP8 state (TE's or our amax history) has a shape


def write_atomically(path, write):
    """write(fh) into a temporary file beside `path`, fsync, then rename it over `path`:
    a crash mid-write leaves the previous file intact (or none), never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save(path, state):
    write_atomically(path, lambda fh: torch.save(state, fh))


def read(path):
    path = Path(path)
    if not path.exists():
        raise UsageError(f"no snapshot at {path} to resume or sample from; train first")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data, no code
    except Exception as e:  # a foreign or damaged file
        raise UsageError(f"cannot read snapshot {path}: {type(e).__name__}") from None


def check_fits(state, cfg, fp8, path):
    """Raise UsageError unless the snapshot was written by a model of cfg's shape (fp8: with FP8 state)."""
    keys = SHAPE_KEYS + (FP8_SHAPE_KEYS if fp8 else ())
    shape = {k: getattr(cfg, k) for k in keys}
    saved = {k: state.get("config", {}).get(k) for k in keys}
    if saved != shape:
        diff = ", ".join(f"{k}={saved[k]} (now {shape[k]})" for k in keys if saved[k] != shape[k])
        raise UsageError(f"--resume: snapshot {path} is from a different model: {diff}")


# ---------------------------------------------------------------- a run's snapshot

def capture(cfg, model, parts, batches, step, device, world_size=1):
    """Everything a bit-identical resume needs. Every rank has its own data and dropout
    streams, so the snapshot keeps each rank's RNG states (gathered to rank 0)."""
    rngs = [dict(batch=batches.gen.get_state(), **rng_state(device))]
    if world_size > 1:
        mine, rngs = rngs[0], [None] * world_size
        dist.all_gather_object(rngs, mine)
    return dict(model=model.state_dict(), optimizer=parts.optimizer.state_dict(), scaler=parts.scaler.state_dict(),
                rng=rngs, step=step, config=dataclasses.asdict(cfg))


def restore(snap, model, parts, batches, rank, world_size, device):
    """Load a snapshot into this rank's run; returns the step to continue from."""
    try:
        model.load_state_dict(snap["model"])
        parts.optimizer.load_state_dict(snap["optimizer"])
        parts.scaler.load_state_dict(snap["scaler"])
    except (RuntimeError, ValueError, KeyError) as e:  # a snapshot that does not fit this model
        raise UsageError(f"--resume: snapshot does not fit this run: {str(e).splitlines()[0]}") from None
    if len(snap["rng"]) != world_size:
        raise UsageError(f"--resume: the snapshot was written by {len(snap['rng'])} ranks, this run has "
                         f"{world_size}: each rank's data stream is in it")
    rng = snap["rng"][rank]
    batches.gen.set_state(rng["batch"])
    set_rng_state(rng, device)
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
