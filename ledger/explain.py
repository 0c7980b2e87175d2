"""Measured against described: what the description of the model (memory_ledger.py) does not
explain, named, component by component.

Chapter section 4. Read memory_ledger.py first (the description and its Terms), then
ledger/measure.py (the tensors a real step saved, each with the module running and the
autograd nodes holding it). When model.py changes and the description has not (another norm,
another MLP), `report` says where, in words:
  parameters, buffers  by name: model.named_parameters() and named_buffers() against the names
                       the description's ops declare, each difference with its shape and count
                       (`state_differences`);
  activations          every measured saved tensor no term accounts for (the module and the
                       autograd node that saved it, dtype, shape, bytes) and every term nothing
                       matched (`unexplained`);
  the others           gradients, the master copy, AdamW's states and FP8's kept copies follow
                       the parameters; rng_states counts the recompute units; the batch is the batch.

Saved tensors are matched to terms block by block (a tensor saved while model.h[i] ran belongs to
block i; the rest to "outside": the embeddings, the head, the recompute units' inputs), always
with equal bytes, the surest pairs first: the closest module, then the same dtype, then bytes
alone. A term fits a module when its name begins with the module's path inside the block
("attn.c_attn input" with h.0.attn.c_attn) or with a parent's (a module a learner wrapped); a
term named after no module of the model (the head's input, the loss's) fits the tensors the block
or GPT.forward saved itself. Shapes are printed, not compared: a storage is saved through views
of other shapes (q, k and v of c_attn's output), and its dtype and bytes give its elements.
A pair matched across dtypes is reported: by module and size, or by size alone.
"""
import math
import re

import torch

import memory_ledger as ml

_BLOCK = re.compile(r"h\.(\d+)(?:\.(.*))?")


def expected(cfg):
    """[(group, Term)]: what the description says the model saves, one entry per storage; group
    is a block's index or "outside"."""
    plan = ml.plan(cfg)
    in_units = {i for unit in plan.units for i in unit}
    out = [(i, term) for i in range(cfg.n_layer) if i not in in_units
           for term in ml.block_activation_terms(cfg, ml.unit_paths(cfg, i))]
    unit_input = ml.Term("unit input", ml.census(cfg)[2], "units", False, dtype=ml.sizes(cfg).dtype)
    out += [("outside", unit_input) for _ in plan.units]
    return out + [("outside", term) for term in ml.outside_terms(cfg)]


def named_states(model):
    """What the model holds, by name, for `state_differences`: its parameters' shapes, its buffers'
    shapes and bytes, its modules' paths."""
    return dict(param={n: tuple(p.shape) for n, p in model.named_parameters()},
                buffer={n: (tuple(b.shape), b.nbytes) for n, b in model.named_buffers()},
                modules=[n for n, _ in model.named_modules()])


def described_states(cfg):
    """{"param": {name: elements}, "buffer": {name: bytes}}: what the description's ops declare, under
    model.named_parameters()' names (a block's for each of the L blocks, as h.<i>.<name>)."""
    out = {"param": {}, "buffer": {}}
    for kind, found in out.items():
        for name, info in ml.census(cfg)[1][kind].items():
            if info["scope"] == 0:  # the census runs one block, its names prefixed "0."
                found.update({f"h.{i}.{name.partition('.')[2]}": info["numel"] for i in range(cfg.n_layer)})
            else:
                found[name] = info["numel"]
    return out


def state_differences(cfg, named):
    """Lines naming each parameter and buffer the description lacks, adds, or sizes otherwise ([] where
    none), a block's once for all the blocks it differs in: `h.*.ln_1.bias: described, not in the model
    (64 x 2 blocks)`. Parameters in elements, buffers in bytes."""
    described, lines = described_states(cfg), []
    for kind, unit in (("param", ""), ("buffer", " bytes")):
        model = {n: (v, math.prod(v)) if kind == "param" else v for n, v in named[kind].items()}
        counted = {}
        for name in sorted(set(model) | set(described[kind]), key=_natural):
            (shape, n), d = model.get(name, (None, None)), described[kind].get(name)
            if n != d:
                key = (_blocks(name), " x ".join(map(str, shape)) + ": " if shape and len(shape) > 1 else "", n, d)
                counted[key] = counted.get(key, 0) + 1
        for (name, shape, n, d), blocks in counted.items():
            times = f" x {blocks} block{'s' if blocks > 1 else ''}" if name.startswith("h.*") else ""
            if d is None:
                lines.append(f"  {name}: in the model, not described ({shape}{n:,}{unit}{times})")
            elif n is None:
                lines.append(f"  {name}: described, not in the model ({d:,}{unit}{times})")
            else:
                lines.append(f"  {name}: {shape}{n:,}{unit} in the model, described {d:,}{unit}" +
                             (f" ({times[1:]})" if times else ""))
    return lines


def _natural(name):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _place(module):
    """(group, the module's path inside its block) of a module path of model.named_modules()."""
    m = _BLOCK.fullmatch(module)
    return (int(m.group(1)), m.group(2) or "") if m else ("outside", module)


def _ancestors(path):
    parts = path.split(".") if path else []
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _names(term, path):
    return term.name == path or term.name.startswith((path + " ", path + "."))


def _fit(term, paths, modules):
    """How well a term's name fits the modules that saved a tensor: the longest of their paths (or
    of those paths' parents: a module a learner wrapped) that the name begins with; a half for a
    term named after none of the group's modules and a tensor the group's own forward saved."""
    fits = [len(p) for path in paths for p in _ancestors(path) if _names(term, p)]
    if fits:
        return max(fits)
    return 0.5 if "" in paths and not any(_names(term, m) for m in modules) else 0


def unexplained(cfg, saved_tensors, modules=None):
    """([SavedTensor] no term accounts for, [(group, Term)] nothing measured matched, [(by module too,
    Term, SavedTensor)] matched across dtypes). modules: model.named_modules()' paths (None: those
    the saved tensors name)."""
    measured = {}
    for saved in saved_tensors.values():
        places = [_place(m) for m in saved.modules] or [("outside", "")]
        measured.setdefault(places[0][0], []).append(([p for g, p in places if g == places[0][0]], saved))
    terms = {}
    for group, term in expected(cfg):
        terms.setdefault(group, []).append(term)
    known = [_place(m) for m in (modules if modules is not None else
                                 [m for s in saved_tensors.values() for m in s.modules])]
    extra, missing, loose = [], [], []
    for group in set(measured) | set(terms):
        tensors, wanted = measured.get(group, []), terms.get(group, [])
        inside = {a for g, p in known if g == group for a in _ancestors(p)}
        pairs = []
        for i, term in enumerate(wanted):
            for j, (paths, saved) in enumerate(tensors):
                if saved.nbytes == term.nbytes:
                    fit, dtype = _fit(term, paths, inside), saved.dtype == term.dtype
                    # the closest module, then the dtype, then the deeper-saved tensor (a module a learner wrapped)
                    pairs.append((fit, dtype, max((p.count(".") for p in paths), default=0), -i, -j, dtype))
        used_terms, used_tensors = set(), set()
        for fit, _, _, i, j, dtype in sorted(pairs, reverse=True):
            if -i not in used_terms and -j not in used_tensors:
                used_terms.add(-i)
                used_tensors.add(-j)
                if not dtype:
                    loose.append((fit > 0, wanted[-i], tensors[-j][1]))
        missing += [(group, term) for i, term in enumerate(wanted) if i not in used_terms]
        extra += [saved for j, (_, saved) in enumerate(tensors) if j not in used_tensors]
    return extra, missing, loose


def report(cfg, meas):
    """Lines that say, in words, what differs between the measured step `meas` (ledger/measure.measure,
    with "named": named_states of its model) and the description; [] where it explains everything."""
    states = state_differences(cfg, meas["named"]) if "named" in meas else []
    lines = ["model.py and the description (memory_ledger.py) hold different parameters or buffers:"] + states \
        if states else []
    extra, missing, loose = unexplained(cfg, meas["saved_tensors"], meas.get("named", {}).get("modules"))
    if extra or missing or loose:
        lines.append("the description of the model (memory_ledger.py) does not explain what autograd saved:")

    def saver(s):
        return f"{_blocks(s.modules[0] if s.modules else '')} ({', '.join(s.nodes) or 'no node found'})"
    for text, count in _counted(f"saved by {saver(s)}: {s.dtype} {s.shape}, {s.nbytes:,} bytes" for s in extra):
        lines.append(f"  unexplained, {text}" + (f" (x{count})" if count > 1 else ""))
    for text, count in _counted(f"{t.name}, {t.dtype}, {t.nbytes:,} bytes" + (" (in each block)" if g != "outside"
                                                                            else "") for g, t in missing):
        lines.append(f"  described but not saved: {text}" + (f" (x{count})" if count > 1 else ""))
    for text, count in _counted(f"{'module and size, not dtype' if module else 'size alone'}: {t.name} ({t.dtype}) "
                                f"taken for the {s.dtype} {s.shape} saved by {saver(s)}" for module, t, s in loose):
        lines.append(f"  matched by {text}" + (f" (x{count})" if count > 1 else ""))
    return lines + component_lines(cfg, meas, bool(states))


def component_lines(cfg, meas, states_differ):
    """One line for each other component that differs, saying what it follows."""
    predicted, lines = ml.predicted(cfg), []
    per_state = torch.get_rng_state().numel() + (16 if cfg.device == "cuda" else 0)
    why = dict(gradients="one per parameter (and FP32 sums with fp32_grad_accum)",
               master="an FP32 copy of each parameter", optimizer="AdamW's m and v per parameter and a step count "
               "per tensor (CPU)", fp8_kept="one E4M3 copy of each FP8 Linear's weight, with 16 bytes of scales",
               inputs="the batch: token ids and targets, b x s int64 each",
               rng_states=f"the step's graph holds {meas['rng_states'] // per_state} RNG states of {per_state:,} "
               f"bytes (checkpoint.Unit.rng: one per recompute unit); the description's plan (memory_ledger.plan) "
               f"{predicted['rng_states'] // per_state}")
    if not states_differ:
        why = dict(parameters="every name and size as described: the bytes per element differ",
                   buffers="every name and size as described: the bytes per element differ", **why)
    for k, text in why.items():
        if meas[k] != predicted[k]:
            follows = "; it follows the parameters above" if states_differ and k != "rng_states" else ""
            lines.append(f"  {k}: predicted {predicted[k]:,} bytes, measured {meas[k]:,}: {text}{follows}")
    return lines


def _blocks(module):
    """h.3.ln_1 as h.*.ln_1, so that alike lines of every block are told once."""
    return _BLOCK.sub(lambda m: "h.*" + (f".{m.group(2)}" if m.group(2) else ""), module) or "GPT.forward"


def _counted(texts):
    counts = {}
    for text in texts:
        counts[text] = counts.get(text, 0) + 1
    return list(counts.items())
