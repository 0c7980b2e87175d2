"""Snapshots: save a run, and resume it.

Chapter: none; a snapshot is what makes a long run survivable. It is not checkpointing: here
*checkpointing* always means activation recomputation (checkpoint.py). Read first: `capture` and
`save`, then `read`, `continued` and `restore`. A snapshot is one torch.save'd dict (model, optimizer,
loss scaler, every rank's random streams (model.rng_state), the step, the config), written atomically and
loaded with weights_only=True. It is this program's input, so each field is checked where it is read: the
config by the command line's own rules, the rest against the form this run writes (`check_form`: the same
keys, tensors of the same dtype and shape, every number finite), then by the rule of what reads it.
"""
import dataclasses
import math
import os
import stat
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import precision
from config import Config, RunError, UsageError
from guards.clean_end import write_atomically
from guards.cli import checked
from model import rng_state, set_rng_state

FILE = "snapshot.pt"


def save(path, state):
    """Write a snapshot atomically; a failed write (a full disk) keeps the previous one."""
    try:
        write_atomically(path, lambda fh: torch.save(state, fh))
    except OSError as e:
        raise RunError(f"cannot write snapshot {path}: {e.strerror or e}; the previous snapshot is kept") from None
    except RuntimeError as e:  # torch.save's writer turns a failed write (ENOSPC) into "unexpected pos ..."
        raise RunError(f"cannot write snapshot {path} (is the disk full?): {str(e).splitlines()[0]}; the previous "
                       f"snapshot is kept") from None


def capture(cfg, model, parts, batches, step, device, world_size=1):
    """Everything a bit-identical resume needs. Every rank has its own data and dropout
    streams, so the snapshot keeps each rank's RNG states (gathered to rank 0)."""
    rngs = [dict(batch=batches.gen.get_state(), **rng_state(device))]
    if world_size > 1:
        mine, rngs = rngs[0], [None] * world_size
        dist.all_gather_object(rngs, mine)
    # a ZeRO/FSDP optimizer's state is gathered into DDP's format (a collective: every rank calls capture)
    scaler = parts.scaler.state_dict() if parts.scaler else None
    return dict(model=model.state_dict(), optimizer=parts.optimizer.state_dict(), scaler=scaler, rng=rngs, step=step,
                config=dataclasses.asdict(cfg))


# ---------------------------------------------------------------- reading one back

def read(path):
    """The snapshot at `path`: a dict of tensors and plain data (weights_only: no code runs), or UsageError."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe must not wait for a writer
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
                state = torch.load(fh, map_location="cpu", weights_only=True)
        except Exception as e:  # a foreign or damaged file
            raise UsageError(f"cannot read snapshot {path}: {type(e).__name__}") from None
    check_form(state, dict.fromkeys(("model", "optimizer", "scaler", "rng", "step", "config"), ...), "it", path)
    return state


def continued(snap, cfg, given, path=FILE):
    """(the config a resume runs with, {key: (the snapshot's value, this run's)} where they differ): the
    snapshot's config, with the keys given on this command line (given=None: every key off its default) and
    this run's own (out_dir, resume, sample_only). The saved config is checked by the command line's rules; a
    key that shapes the model's tensors or the FP8 state cannot change."""
    defaults = dataclasses.asdict(Config())
    check_form(snap["config"], defaults, "its config", path)
    try:
        saved = checked(Config(**snap["config"]))
    except UsageError as e:
        raise UsageError(f"snapshot {path} is not usable: its config: {e}") from None
    given = {k for k, v in dataclasses.asdict(cfg).items() if v != defaults[k]} if given is None else set(given)
    merged = dataclasses.replace(saved, **{k: getattr(cfg, k) for k in given | {"out_dir", "resume", "sample_only"}})
    if differ := [k for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "precision",
                              "fp8_backend", "fp8_amax_history") if getattr(merged, k) != getattr(saved, k)]:
        raise UsageError(f"--resume: snapshot {path} is from a different model: "
                         + ", ".join(f"{k}={getattr(saved, k)} (now {getattr(merged, k)})" for k in differ))
    # lr_decay_iters=0 means "decay until max_iters": a resume with another max_iters would silently move the
    # end of the cosine; ask for it by name instead
    if not merged.lr_decay_iters and merged.max_iters != saved.max_iters:
        raise UsageError(f"--resume: the snapshot's learning rate decays until step {saved.max_iters}, this run's "
                         f"until max_iters={merged.max_iters}; pass --lr_decay_iters={saved.max_iters} to keep the "
                         f"schedule (or another value to change it)")
    return checked(merged), {k: (getattr(saved, k), getattr(merged, k)) for k in sorted(given)
                             if getattr(merged, k) != getattr(saved, k) and k not in ("out_dir", "resume", "sample_only")}


def restore(snap, model, parts, batches, rank, world_size, device, scaler=True, path=FILE):
    """Load a snapshot into this rank's run, each field held first to what this run writes; returns the step to
    continue from. The run's own optimizer hyperparameters (its config) replace the saved ones; scaler=False
    keeps the run's fresh loss scaler (its loss scaling changed) instead of the saved one."""
    opt, spec, step = parts.optimizer, parts.optimizer.spec, snap["step"]
    if type(step) is not int or step < 0:
        unusable(path, f"its step={step!r} is no count of steps")
    load_model(snap, model, path, parts.precision.fp8)
    check_form(snap["optimizer"], written_optimizer(opt, snap["optimizer"]), "optimizer", path)
    # its counts whole and no more than the steps taken (a skipped step counts none); v, a mean of squares, >= 0
    states = snap["optimizer"][spec.name]["state"].values()
    if any(not (c := e[n].item()) == int(c) or not 0 <= c <= step for e in states for n in spec.per_tensor) or \
            not all(bool((e[n] >= 0).all()) for e in states for n in spec.nonnegative):
        unusable(path, f"its {spec.name} state: {', '.join(spec.per_tensor)} is no whole number in [0, {step}], or "
                       f"{', '.join(spec.nonnegative)} is negative")
    rngs = [{k: v for k, v in r.items() if k != "cuda"} for r in snap["rng"] if isinstance(r, dict)]  # a GPU's too
    check_form(rngs if len(rngs) == len(snap["rng"]) else snap["rng"], [dict(
        batch=meta(batches.gen.get_state()), cpu=meta(torch.get_rng_state()))] * world_size, "its random streams", path)
    if scaler:
        check_form(snap["scaler"], parts.scaler.state_dict() if parts.scaler else None, "its loss scaler", path)
    if scaler and parts.scaler and (why := precision.not_written_by(parts.scaler, snap["scaler"], step)):
        unusable(path, f"its loss scaler's state is not what its config's scaler writes: {why}")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.torch_optimizer.param_groups]
    try:
        opt.load_state_dict(snap["optimizer"])
        batches.gen.set_state(snap["rng"][rank]["batch"])
        set_rng_state(snap["rng"][rank], device)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # a snapshot that does not fit this run
        raise UsageError(f"--resume: snapshot does not fit this run: {str(e).splitlines()[0]}") from None
    for group, own in zip(opt.torch_optimizer.param_groups, hyper):
        group.update(own)
    if scaler and parts.scaler:
        parts.scaler.load_state_dict(snap["scaler"])
    return step


def written_optimizer(opt, saved):
    """The form of the optimizer's state a snapshot holds: DDP's whatever this run shards. A master per parameter
    (FP32), the spec's state per parameter, numbered as a whole-model optimizer numbers them (decayed first);
    none before its first step. The groups: their parameters' ids (`groups_of`), the rest this run's own."""
    groups, spec = precision.whole_groups(opt.model_params), opt.spec
    stepped = isinstance(saved, dict) and isinstance(saved.get(spec.name), dict) and saved[spec.name].get("state")
    each = {name: torch.empty((), device="meta") for name in spec.per_tensor}  # FP32 counts
    state = {k: dict(each, **dict.fromkeys(spec.per_element, meta(p, torch.float32)))
             for k, p in enumerate(p for group in groups for p in group)} if stepped else {}
    ids = iter(range(sum(map(len, groups))))
    return {"master_params": [meta(p, torch.float32) for p in opt.model_params] if opt.master_weights else [],
            spec.name: dict(state=state, param_groups=[GroupIds([next(ids) for _ in g]) for g in groups])}


def load_model(snap, model, path=FILE, fp8_settings=None):
    """The snapshot's model tensors into `model`, each first held to what model.state_dict() holds (its dtype:
    load_state_dict would cast another one silently); FP8's scales to what their amax histories give."""
    check_form(snap["model"], {k: meta(v) if torch.is_tensor(v) else ... for k, v in model.state_dict().items()},
               "model", path)
    if fp8_settings:
        import fp8
        fp8.check_saved_scales(snap["model"], model, snap["config"].get("fp8_margin", 0), path)
    try:
        model.load_state_dict(snap["model"])
    except (RuntimeError, KeyError) as e:
        raise UsageError(f"snapshot {path} does not fit its own config: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------- the form of what this run writes

class GroupIds(list):
    """An optimizer group's form: its parameters' ids, these and in this order; its other keys are this run's."""


def meta(t, dtype=None):
    """A tensor's form, no memory: its shape and dtype (or `dtype`: a parameter's FP32 state) on the meta device."""
    return torch.empty(tuple(t.shape), dtype=dtype or t.dtype, device="meta")


def unusable(path, why):
    raise UsageError(f"snapshot {path} is not usable: {why}")


def check_form(saved, written, where, path):
    """UsageError unless `saved` has the form of `written`, what this run writes: dicts with the same keys,
    lists as long, tensors dense and of the same dtype and shape, numbers of the same type, all finite."""
    if written is ...:  # any value here: what a later check, or its reader, holds to its own rule
        return
    if isinstance(written, GroupIds):  # these ids in this order: torch maps the saved state to parameters by them
        if (saved.get("params") if isinstance(saved, dict) else saved) != list(written):
            unusable(path, f"{where} is not this run's group of parameters {written[0]}..{written[-1]}")
        return
    if isinstance(written, dict):
        if not isinstance(saved, dict) or saved.keys() != written.keys():
            missing = sorted(written.keys() - saved.keys()) if isinstance(saved, dict) else None
            unusable(path, f"{where} is a {type(saved).__name__}, not a dict" if missing is None else
                     f"{where} lacks {', '.join(missing)}" if missing else
                     f"{where} holds {', '.join(map(str, saved.keys() - written.keys()))}, which this run does not write")
        for k in written:
            check_form(saved[k], written[k], f"{where}[{k!r}]", path)
    elif isinstance(written, list):
        if not isinstance(saved, list) or len(saved) != len(written):
            unusable(path, f"{where} holds {len(saved) if isinstance(saved, list) else type(saved).__name__}, this "
                           f"run writes a list of {len(written)}")
        for i, (s, w) in enumerate(zip(saved, written)):
            check_form(s, w, f"{where}[{i}]", path)
    elif torch.is_tensor(written):
        if not torch.is_tensor(saved) or saved.layout != torch.strided:
            unusable(path, f"{where} is {getattr(saved, 'layout', type(saved).__name__)}, not a dense tensor")
        if (saved.dtype, saved.shape) != (written.dtype, written.shape):
            unusable(path, f"{where} is a {saved.dtype} tensor of shape {tuple(saved.shape)}, this run writes "
                           f"{written.dtype} of shape {tuple(written.shape)}")
        if saved.is_floating_point() and not bool(torch.isfinite(saved).all()):
            unusable(path, f"{where} holds inf or NaN")
    elif type(saved) is not type(written) or (isinstance(saved, float) and not math.isfinite(saved)):
        unusable(path, f"{where} is {saved!r}, this run writes a {type(written).__name__}")
