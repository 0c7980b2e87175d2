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
checked (snapshot_fields.py) before any of it is used.
"""
import dataclasses
import os
import re
import stat
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from config import RunError, UsageError
from guards.sharded_snapshot import whole_groups
from guards.snapshot_fields import check_adamw_fits, validate

FILE = "snapshot.pt"
# write_atomically's temporary files: TARGET.partial-memtrain-<pid>
TEMP = re.compile(r"(.+)\.partial-memtrain-([0-9]{1,7})")
PROBE = ".probe"  # check_writable's probe file, PROBE.partial-memtrain-<pid>
PID_MAX = 2 ** 22  # Linux's largest pid (PID_MAX_LIMIT): a larger number in a name is no pid of ours


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


def remove_stale_temps(folder, targets):
    """Delete the temporary files of writes whose process is gone (a kill -9 mid-write): only
    regular files directly in `folder` named TARGET.partial-memtrain-<pid> for one of `targets`
    (the files this program writes there), so no file of the user's is taken for one."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return  # no folder (yet): nothing left over
    for entry in entries:
        match = TEMP.fullmatch(entry.name)
        if match and match.group(1) in targets and entry.is_file(follow_symlinks=False) \
                and not _alive(int(match.group(2))):
            Path(entry.path).unlink(missing_ok=True)


def _alive(pid):
    if not 0 < pid <= PID_MAX:
        return True  # no pid: not ours to judge, leave the file
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
    made, probe = [], None
    try:
        for parent in reversed([folder, *folder.parents]):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        probe = folder / f"{PROBE}.partial-memtrain-{os.getpid()}"
        probe.write_bytes(b"probe")  # on a full disk: created, then ENOSPC
    except OSError as e:
        raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
    finally:
        # whatever failed above, nothing of the probe stays (a cleanup error must not hide the first)
        for path in ([probe] if probe else []) + made[::-1]:
            try:
                path.unlink(missing_ok=True) if path is probe else path.rmdir()
            except OSError:
                pass


def check_reachable(folder, flag):
    """check_writable for a rank that writes nothing there, without creating anything (rank 0
    probes the same folder at the same moment): its nearest existing folder must be writable."""
    for parent in [Path(folder), *Path(folder).parents]:
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue  # not there (or rank 0's probe folder, just removed again): look one up
        except OSError as e:
            raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
        if not stat.S_ISDIR(mode):
            raise UsageError(f"{flag}={folder} cannot be written: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK) and parent.exists():
            raise UsageError(f"{flag}={folder} cannot be written: Permission denied")
        return


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
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"snapshot {path} is not a regular file (a pipe, a device or a folder)")
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
    AdamW hyperparameters (betas, weight decay: its flags) apply; scaler=False keeps the run's
    fresh loss scaler (a --loss_scale that differs from the snapshot's) instead of the saved one."""
    opt = parts.optimizer
    masters = snap["optimizer"]["master_params"]
    expected = opt.model_params if opt.master_weights else []  # a master per parameter, its shape
    if [tuple(m.shape) for m in masters] != [tuple(m.shape) for m in expected]:
        raise UsageError(f"--resume: the snapshot holds {len(masters)} master weights, this run has "
                         f"{len(expected)} (or their shapes differ)")
    check_adamw_fits(snap["optimizer"]["adamw"], whole_groups(opt))  # zero.py's hold a slice, load the whole
    if len(snap["rng"]) != world_size:
        raise UsageError(f"--resume: the snapshot was written by {len(snap['rng'])} ranks, this run has "
                         f"{world_size}: each rank's data stream is in it")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.adamw.param_groups]
    try:
        model.load_state_dict(snap["model"])
        parts.optimizer.load_state_dict(snap["optimizer"])
        rng = snap["rng"][rank]
        batches.gen.set_state(rng["batch"])
        set_rng_state(rng, device)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # a snapshot that does not fit this run
        raise UsageError(f"--resume: snapshot does not fit this run: {str(e).splitlines()[0]}") from None
    for group, own in zip(parts.optimizer.adamw.param_groups, hyper):
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
