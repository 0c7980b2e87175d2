"""Snapshots (save and resume a run) and the random streams they carry.

Chapter: none; a snapshot is what makes a long run survivable. It is not checkpointing:
in this project *checkpointing* always means activation recomputation (checkpoint.py).
Read first: `write_atomically`, then `rng_state` (also used by checkpoint.py, whose
re-run forward must draw the same dropout masks), then `capture` and `restore`.

A snapshot is one torch.save'd dict: model and optimizer state, the loss scaler, every
rank's random streams, the step, and the config. It is written to a temporary file
beside the target and renamed over it, so a crash mid-write leaves the previous snapshot
intact; a temporary file that a killed run left behind is removed at the next start. It
is loaded with weights_only=True, so a foreign file cannot run code, and its structure is
checked (`validate`) before any of it is used.
"""
import dataclasses
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from config import Config, RunError, UsageError

FILE = "snapshot.pt"
# the keys that must agree between a snapshot and the run that resumes from (or samples) it
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "precision")
FP8_SHAPE_KEYS = ("fp8_backend", "fp8_amax_history")  # the FP8 state (TE's or our amax history) has a shape
TEMP = re.compile(r".+\.partial-memtrain-(\d+)")  # write_atomically's temporary files: NAME.partial-memtrain-<pid>


def write_atomically(path, write):
    """write(fh) into a temporary file beside `path`, fsync, then rename it over `path`:
    a crash mid-write leaves the previous file intact (or none), never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + f".partial-memtrain-{os.getpid()}")  # a name no user file has
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temps(folder):
    """Delete the temporary files of writes whose process is gone (a kill -9 mid-write)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for f in folder.iterdir():
        match = TEMP.fullmatch(f.name)
        if match and f.is_file() and not _alive(int(match.group(1))):
            f.unlink(missing_ok=True)


def _alive(pid):
    if pid == os.getpid():
        return False  # ours, from before an exec: nothing of this process writes it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def check_writable(folder, flag):
    """Raise UsageError unless `folder` can be created and written: a probe file is written
    and removed, and any folder made for it is removed again, so nothing is left behind."""
    folder = Path(folder)
    made = []
    try:
        for parent in reversed([folder, *folder.parents]):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        probe = folder / f".probe.partial-memtrain-{os.getpid()}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
    finally:
        for path in reversed(made):
            path.rmdir()


def save(path, state):
    """Write a snapshot atomically; a failed write (a full disk) keeps the previous one."""
    try:
        write_atomically(path, lambda fh: torch.save(state, fh))
    except OSError as e:
        raise RunError(f"cannot write snapshot {path}: {e.strerror or e}; the previous snapshot is kept") from None


def read(path):
    path = Path(path)
    if not path.exists():
        raise UsageError(f"no snapshot at {path} to resume or sample from; train first")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data, no code
    except Exception as e:  # a foreign or damaged file
        raise UsageError(f"cannot read snapshot {path}: {type(e).__name__}") from None
    validate(state, path)
    return state


def validate(state, path):
    """Raise UsageError, with a one-line reason, for a file that loaded but is not a whole snapshot."""
    def need(ok, why):
        if not ok:
            raise UsageError(f"snapshot {path} is not usable: {why}")
    need(isinstance(state, dict), f"it holds a {type(state).__name__}, not a dict")
    kinds = dict(model=dict, optimizer=dict, scaler=dict, rng=list, step=int, config=dict)
    for name, kind in kinds.items():
        need(name in state, f"it has no '{name}'")
        need(isinstance(state[name], kind) and not isinstance(state[name], bool),
             f"'{name}' is a {type(state[name]).__name__}, not a {kind.__name__}")
    need(state["step"] >= 0, f"step={state['step']} is negative")
    for name, t in state["model"].items():
        need(torch.is_tensor(t) or name.endswith("_extra_state"), f"model entry {name} is not a tensor")
        need(not torch.is_tensor(t) or not t.is_floating_point() or bool(torch.isfinite(t).all()),
             f"model entry {name} holds inf or NaN")
    masters = state["optimizer"].get("master_params")
    need(isinstance(masters, list) and all(torch.is_tensor(m) for m in masters), "no master_params list")
    need(all(bool(torch.isfinite(m).all()) for m in masters), "a master weight holds inf or NaN")
    need(isinstance(state["optimizer"].get("adamw"), dict), "no AdamW state")
    need(all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in state["scaler"].values()),
         "the loss scaler's state is not numbers")
    need(state["rng"] and all(isinstance(r, dict) and {"cpu", "batch"} <= set(r) for r in state["rng"]),
         "no random streams")
    need(all(k in state["config"] for k in SHAPE_KEYS), "its config lacks the model's shape")
    kinds = {f.name: f.type for f in dataclasses.fields(Config)}
    for name, value in state["config"].items():
        kind = kinds.get(name)
        fits = kind is not None and isinstance(value, (int, float) if kind is float else kind) and \
            (kind is bool or not isinstance(value, bool))
        what = getattr(kind, "__name__", "no such key")
        need(fits, f"config entry {name}={value!r} is not Config's {name} ({what})")


def check_same_model(state, cfg, fp8, path):
    """Raise UsageError unless the snapshot was written by a model of cfg's shape (fp8: with FP8
    state), and on the same learning-rate schedule."""
    keys = SHAPE_KEYS + (FP8_SHAPE_KEYS if fp8 else ())
    shape = {k: getattr(cfg, k) for k in keys}
    saved = {k: state["config"].get(k) for k in keys}
    if saved != shape:
        diff = ", ".join(f"{k}={saved[k]} (now {shape[k]})" for k in keys if saved[k] != shape[k])
        raise UsageError(f"--resume: snapshot {path} is from a different model: {diff}")
    # lr_decay_iters=0 means "decay until max_iters": a resume with another max_iters would
    # silently move the end of the cosine; ask for it by name instead
    then = state["config"].get("lr_decay_iters") or state["config"].get("max_iters")
    if not cfg.lr_decay_iters and then != cfg.max_iters:
        raise UsageError(f"--resume: the snapshot's learning rate decays until step {then}, this run's until "
                         f"max_iters={cfg.max_iters}; pass --lr_decay_iters={then} to keep the schedule "
                         f"(or another value to change it)")


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
    masters = snap["optimizer"]["master_params"]
    expected = parts.optimizer.master_params if parts.optimizer.master_weights else []
    if [tuple(m.shape) for m in masters] != [tuple(m.shape) for m in expected]:
        raise UsageError(f"--resume: the snapshot holds {len(masters)} master weights, this run has "
                         f"{len(expected)} (or their shapes differ)")
    try:
        model.load_state_dict(snap["model"])
        parts.optimizer.load_state_dict(snap["optimizer"])
        parts.scaler.load_state_dict(snap["scaler"])
        if len(snap["rng"]) != world_size:
            raise ValueError(f"the snapshot was written by {len(snap['rng'])} ranks, this run has "
                             f"{world_size}: each rank's data stream is in it")
        rng = snap["rng"][rank]
        batches.gen.set_state(rng["batch"])
        set_rng_state(rng, device)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # a snapshot that does not fit this run
        raise UsageError(f"--resume: snapshot does not fit this run: {str(e).splitlines()[0]}") from None
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
