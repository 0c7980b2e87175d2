"""Measured against described: which saved tensor the description does not explain, and which
of its terms nothing matched.

Chapter section 4. Read memory_ledger.py first (the description and its Terms), then
ledger/measure.py (the tensors a real step saved, each with the module running and the
autograd nodes holding it). When model.py changes and memory_ledger's description has not
(another norm, another MLP), the activations stop matching; this says where: every measured
saved tensor no term accounts for, with the node that saved it (its grad_fn name), its
shape, dtype and bytes, and every term nothing matched, with its name and bytes. `make
ledger` prints it, and the tests' failure messages carry it.

Matching is by bytes, block by block (a tensor saved while model.h[i] ran belongs to block
i; the rest to "outside": the embeddings, the head, the recompute units' inputs), the
closest pairs first: a term whose name begins with the path, inside the block, of a module
that saved the tensor or of its parent ("attn.c_attn input" with h.0.attn.c_attn), the
longer the path the closer, the deeper-saved tensor first; then any term of the same size.
"""
import re

import memory_ledger as ml

_BLOCK = re.compile(r"h\.(\d+)(?:\.(.*))?")


def expected(cfg):
    """[(group, Term)]: what the description says the model saves, one entry per storage; group
    is a block's index or "outside"."""
    plan = ml.plan(cfg)
    in_units = {i for unit in plan.units for i in unit}
    out = [(i, term) for i in range(cfg.n_layer) if i not in in_units
           for term in ml.block_activation_terms(cfg, ml.unit_paths(cfg, i))]
    out += [("outside", ml.Term("unit input", ml.census(cfg)[2], "units", False)) for _ in plan.units]
    return out + [("outside", term) for term in ml.outside_terms(cfg)]


def _place(module):
    """(group, the module's path inside its block) of a module path of model.named_modules()."""
    m = _BLOCK.fullmatch(module)
    return (int(m.group(1)), m.group(2) or "") if m else ("outside", module)


def _closeness(term, paths):
    """How well a term's name fits the modules that saved a tensor: the longest of their paths (or
    of those paths' parents: a module a learner wrapped) that the name begins with."""
    fits = [len(p) for path in paths for p in _ancestors(path)
            if term.name == p or term.name.startswith((p + " ", p + "."))]
    return max(fits, default=0)


def _ancestors(path):
    parts = path.split(".") if path else []
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def unexplained(cfg, saved_tensors):
    """([SavedTensor] no term accounts for, [(group, Term)] nothing measured matched)."""
    measured = {}
    for saved in saved_tensors.values():
        places = [_place(m) for m in saved.modules] or [("outside", "")]
        measured.setdefault(places[0][0], []).append(([p for g, p in places if g == places[0][0]], saved))
    terms = {}
    for group, term in expected(cfg):
        terms.setdefault(group, []).append(term)
    extra, missing = [], []
    for group in set(measured) | set(terms):
        tensors, wanted = measured.get(group, []), terms.get(group, [])
        # the closest pairs first; of equally close ones, the tensor saved deeper in the modules
        pairs = sorted(((_closeness(term, paths), max((p.count(".") for p in paths), default=0), -i, -j)
                        for i, term in enumerate(wanted) for j, (paths, saved) in enumerate(tensors)
                        if saved.nbytes == term.nbytes), reverse=True)
        used_terms, used_tensors = set(), set()
        for _, _, i, j in pairs:
            if -i not in used_terms and -j not in used_tensors:
                used_terms.add(-i)
                used_tensors.add(-j)
        missing += [(group, term) for i, term in enumerate(wanted) if i not in used_terms]
        extra += [saved for j, (_, saved) in enumerate(tensors) if j not in used_tensors]
    return extra, missing


def report(cfg, saved_tensors):
    """Lines that say what differs, [] where the description explains every saved tensor."""
    extra, missing = unexplained(cfg, saved_tensors)
    if not extra and not missing:
        return []
    lines = ["the description of the model (memory_ledger.py) does not explain what autograd saved:"]
    for text, count in _counted(f"saved by {_blocks(s.modules[0] if s.modules else '')} "
                                f"({', '.join(s.nodes) or 'no node found'}): "
                                f"{s.dtype} {s.shape}, {s.nbytes:,} bytes" for s in extra):
        lines.append(f"  unexplained, {text}" + (f" (x{count})" if count > 1 else ""))
    for text, count in _counted(f"{term.name}, {term.nbytes:,} bytes" + (" (in each block)" if group != "outside"
                                                                          else "") for group, term in missing):
        lines.append(f"  described but not saved: {text}" + (f" (x{count})" if count > 1 else ""))
    return lines


def _blocks(module):
    """h.3.ln_1 as h.*.ln_1, so that alike lines of every block are told once."""
    return _BLOCK.sub(lambda m: "h.*" + (f".{m.group(2)}" if m.group(2) else ""), module) or "GPT.forward"


def _counted(texts):
    counts = {}
    for text in texts:
        counts[text] = counts.get(text, 0) + 1
    return list(counts.items())
