"""Every field of a snapshot checked before any of it is used, by the command line's own rules.

Chapter: none; snapshot.py reads a file, this says whether what it read is a snapshot a run
can continue. Read first: `validate` (called by snapshot.read on everything that loaded),
then `check_same_model` and `check_optimizer_fits` (what needs this run's config or model).

A snapshot is loaded with weights_only=True, so it cannot run code, but it can still carry
any value: a string where AdamW's betas go, a negative step count, a moment of another
shape, a config with n_head=0. Each is refused here in one line (UsageError, exit 2),
never met later as a traceback mid-run.
"""
import dataclasses
import math

import torch

import precision
from backends.fp8_gemm import E4M3, E5M2, fp8_max
from config import FP32_MAX, INT64_MAX, Config, UsageError, validate as validate_config
from fp8 import FP8Linear, scale_from_amax

# the keys that must agree between a snapshot and the run that resumes from (or samples) it
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "precision")
FP8_SHAPE_KEYS = ("fp8_backend", "fp8_amax_history")  # the FP8 state (TE's or our amax history) has a shape
SCALER_KEYS = ("loss_scale", "clean_steps", "overflows_left", "skipped_steps")  # precision.LossScaler.state_dict


def validate(state, path):
    """Raise UsageError, with a one-line reason, unless every field of a loaded file is what a
    snapshot holds: the types, the ranges the command line has (the saved config goes through
    config.validate), finite numbers. What needs the live model (shapes) `restore` checks."""
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
    cfg = _check_config(state["config"], need)
    for name, t in state["model"].items():
        need(torch.is_tensor(t) or name.endswith("_extra_state"), f"model entry {name} is not a tensor")
        need(not torch.is_tensor(t) or _dense(t),
             f"model entry {name} is a sparse tensor ({t.layout if torch.is_tensor(t) else ''}), a snapshot holds "
             f"dense ones")
        need(not torch.is_tensor(t) or not t.is_floating_point() or bool(torch.isfinite(t).all()),
             f"model entry {name} holds inf or NaN")
    masters = state["optimizer"].get("master_params")
    need(isinstance(masters, list) and all(_dense(m) and m.dtype == torch.float32 for m in masters),
         "no list of FP32 master_params")
    need(all(bool(torch.isfinite(m).all()) for m in masters), "a master weight holds inf or NaN")
    try:
        spec = precision.optimizer_spec(cfg)
    except UsageError as e:
        need(False, f"its config's optimizer: {e}")
    _check_optimizer(state["optimizer"].get(spec.name), spec, state["step"], need)
    scaler = state["scaler"]
    need(sorted(scaler) == sorted(SCALER_KEYS),
         f"the loss scaler's state has {sorted(scaler)}, not {list(SCALER_KEYS)}")
    need(_number(scaler["loss_scale"]) and 1 / FP32_MAX <= scaler["loss_scale"] <= FP32_MAX,
         f"the loss scale {scaler['loss_scale']!r} is not a positive number within FP32's range")
    for name in SCALER_KEYS[1:]:
        need(type(scaler[name]) is int and 0 <= scaler[name] <= INT64_MAX,
             f"the loss scaler's {name}={scaler[name]!r} is not a count")
    _check_scaler(scaler, cfg, state["step"], need)
    size = torch.get_rng_state().numel()  # a CPU generator's state, the batch stream's too
    def generator_state(t):
        return _dense(t) and t.dtype == torch.uint8 and t.dim() == 1
    need(state["rng"] and all(isinstance(r, dict) and {"cpu", "batch"} <= set(r) <= {"cpu", "batch", "cuda"}
                              and all(generator_state(t) for t in r.values())
                              and r["cpu"].numel() == r["batch"].numel() == size for r in state["rng"]),
         "its random streams are not generator states")


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _dense(t):
    return torch.is_tensor(t) and t.layout == torch.strided


def _check_scaler(scaler, cfg, step, need):
    """The loss scaler's state is one its config's scaler writes, by the scaler's own rule
    (precision.not_written_by)."""
    why = precision.not_written_by(precision.decide(cfg).loss_scaler(), scaler)
    need(why is None, f"the loss scaler's state is not what its config's scaler writes: {why}")
    need(scaler["skipped_steps"] <= step,
         f"the loss scaler's skipped_steps={scaler['skipped_steps']} is more than the {step} steps taken")


def _check_config(saved, need):
    """The saved config as a Config, checked by the command line's own rules."""
    kinds = {f.name: f.type for f in dataclasses.fields(Config)}
    missing = sorted(set(kinds) - set(saved))  # defaults would stand in silently (the schedule's end, say)
    need(not missing, f"its config lacks {', '.join(missing)}: a snapshot's config holds every key")
    for name, value in saved.items():
        kind = kinds.get(name)
        fits = kind is not None and isinstance(value, (int, float) if kind is float else kind) and \
            (kind is bool or not isinstance(value, bool))
        what = getattr(kind, "__name__", "no such key")
        need(fits, f"config entry {name}={value!r} is not Config's {name} ({what})")
    try:
        return validate_config(Config(**saved))
    except UsageError as e:
        need(False, f"its config: {e}")


UPDATE_KEYS = ("eps", "amsgrad", "maximize", "decoupled_weight_decay")  # torch's, beside the spec's own


def _check_optimizer(saved, spec, step, need):
    """The optimizer's state_dict, by its spec (precision.OPTIMIZERS): its groups carry the hyperparameters that
    change the update as its config builds the optimizer (AdamW's betas, eps, amsgrad, ...), its per-element tensors are finite (and >= 0 where the spec says),
    its per-tensor counts are whole numbers no larger than the snapshot's step (a skipped step does not count)."""
    who = type(spec).__name__
    need(isinstance(saved, dict) and isinstance(saved.get("state"), dict)
         and isinstance(saved.get("param_groups"), list), f"no {who} state")
    # the hyperparameters that change the update, as its config builds the optimizer: the spec's (betas) always,
    # torch's own where the group carries them (a torch before 2.7 wrote no decoupled_weight_decay, and its
    # load fills it); lr follows the schedule and weight_decay is per group, both checked below
    built = spec.build([{"params": [torch.zeros(1)]}], lr=0.0).param_groups[0]
    fixed = {k: built[k] for k in (*spec.hyperparameters, *UPDATE_KEYS) if k in built}
    ids = []
    for i, group in enumerate(saved["param_groups"]):
        need(isinstance(group, dict) and isinstance(group.get("params"), list)
             and all(type(p) is int for p in group["params"]), f"{who} group {i} has no list of parameter ids")
        ids += group["params"]
        for name, value in fixed.items():
            if name not in group and name not in spec.hyperparameters:
                continue
            got = group.get(name)
            same = tuple(got) == tuple(value) if isinstance(value, tuple) and isinstance(got, (tuple, list)) \
                else got == value
            need(same, f"{who} group {i} has {name}={got!r}, its config's is {value!r}")
        for name in ("lr", "weight_decay"):
            need(_number(group.get(name)) and group[name] >= 0, f"{who} group {i} has {name}={group.get(name)!r}")
    need(len(set(ids)) == len(ids), f"{who}'s groups share a parameter id")
    keys = sorted(spec.per_element + spec.per_tensor)
    for pid, entry in saved["state"].items():
        need(pid in ids and isinstance(entry, dict) and sorted(entry) == keys,
             f"{who} state {pid!r} is not a parameter's {', '.join(keys)}")
        for name in spec.per_tensor:
            count = entry[name]
            count = count.item() if _dense(count) and count.numel() == 1 and count.is_floating_point() else count
            need(_number(count) and count == int(count) and 0 <= count <= step,
                 f"{who} state {pid}: {name}={entry[name]!r} is not a whole number in [0, {step}]")
        for name in spec.per_element:
            t = entry[name]
            # the optimizer steps the FP32 master weights (fp32: the FP32 parameters)
            need(_dense(t) and t.dtype == torch.float32, f"{who} state {pid}: {name} is not a dense FP32 tensor")
            need(bool(torch.isfinite(t).all()), f"{who} state {pid}: {name} is not a finite float tensor")
            need(name not in spec.nonnegative or bool((t >= 0).all()), f"{who} state {pid}: {name} is negative")


def saved_config(state):
    """The Config a (validated) snapshot was written with."""
    return Config(**state["config"])


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


def check_model_state(state, model, path):
    """Raise UsageError unless every model tensor of the snapshot is what `model` (this run's, or its copy
    on the meta device) holds, in dtype and shape (load_state_dict would cast another dtype silently), and
    each FP8 Linear's scales are what its amax history gives (what FP8Linear.fold_amax writes)."""
    own = model.state_dict()
    for name, t in state["model"].items():
        if torch.is_tensor(own.get(name)) and (t.dtype, t.shape) != (own[name].dtype, own[name].shape):
            what = f"of shape {tuple(t.shape)}" if t.dtype == own[name].dtype else f"a {t.dtype} tensor"
            raise UsageError(f"snapshot {path} is not usable: model entry {name} is {what}, this run writes "
                             f"{own[name].dtype if t.dtype != own[name].dtype else tuple(own[name].shape)}")
    maxima = torch.tensor([fp8_max(E4M3), fp8_max(E4M3), fp8_max(E5M2)])  # FP8Linear.fp8_max's columns
    settings = precision.decide(saved_config(state)).fp8  # the scales were written with the snapshot's margin
    for prefix, layer in model.named_modules():
        history, scale = (state["model"].get(f"{prefix}.{k}") for k in ("amax_history", "scale"))
        if not isinstance(layer, FP8Linear) or history is None or scale is None:
            continue
        if not bool((history >= 0).all()):
            raise UsageError(f"snapshot {path} is not usable: model entry {prefix}.amax_history holds a negative "
                             f"amax (an amax is a largest absolute value)")
        expected = scale_from_amax(history.amax(0), maxima, settings.margin)
        if not torch.allclose(scale, expected, rtol=1e-6, atol=0):
            raise UsageError(f"snapshot {path} is not usable: model entry {prefix}.scale is {scale.tolist()}, its "
                             f"amax history gives {expected.tolist()} (fp8_max / amax / 2**fp8_margin)")


def check_optimizer_fits(saved, live, spec):
    """Raise UsageError unless the saved optimizer state has these param groups (a whole-model optimizer's)
    and its per-element tensors the shapes of the parameters they belong to (torch checks neither before
    a step)."""
    sizes, own = [len(g["params"]) for g in saved["param_groups"]], [len(g["params"]) for g in live]
    if sizes != own:
        raise UsageError(f"--resume: the snapshot's {spec.name} groups hold {sizes} parameters, this run's {own}")
    for group, own in zip(saved["param_groups"], live):
        for pid, param in zip(group["params"], own["params"]):
            entry = saved["state"].get(pid, {})
            for name in spec.per_element:
                if name in entry and tuple(entry[name].shape) != tuple(param.shape):
                    raise UsageError(f"--resume: the snapshot's {spec.name} {name} of parameter {pid} has shape "
                                     f"{tuple(entry[name].shape)}, the parameter {tuple(param.shape)}")