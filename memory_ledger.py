"""The memory ledger: where every byte of a training step goes, in the chapter's formulas.

Chapter section 4 ("The whole picture"): parameters, gradients, optimizer states and activations under the
techniques of sections 1-3. Read first: the closed forms just below, then `term_of` (which term of the
formula a saved tensor is, told by the op that saved it and the module it ran in), then `account` and
`differences`. The bytes are counted elsewhere: ledger/trace.py runs the real step (build.py's run of
model.py) on fake tensors and ledger/measure.py counts it as it counts a real one. This file says what each
byte is and where the formula and the step part ways, so a learner's edit to model.py needs nothing here.

Letters: b micro-batch, s context, h width, a heads, L layers, V vocabulary, P parameters, e bytes per
element (4 fp32, 2 bf16/fp16/fp8). "activations": what autograd holds for backward once the forward has
finished; "peak": the most bytes alive in a steady-state step. More: docs/ledger.md.
"""
import math
import re
from collections import Counter

import torch.nn as nn

import checkpoint
import precision
from model import AttentionCore

COMPONENTS = ("parameters", "buffers", "gradients", "master", "optimizer", "fp8_kept", "activations", "inputs",
              "rng_states")


# ---------------------------------------------------------------- the chapter's closed forms, first

def bytes_per_param_closed(precision_name, moments=2):
    """(parameters, gradients, master, optimizer) bytes per parameter, the optimizer keeping `moments` FP32
    values each (AdamW: m and v). FP32: 4 + 4 + 0 + 8; mixed precision: 2 + 2 + 4 + 8, the ZeRO paper's
    2 + 2 + K with K = 12. Both are 16: mixed precision shrinks activations and time, not states."""
    if precision_name == "fp32":
        return 4, 4, 0, 4 * moments  # the parameters are the master copy
    return 2, 2, 4, 4 * moments


def params_closed(L, h, V, s, bias=True):
    """The chapter's GPT's parameters: per layer 12h^2 weights (c_attn 3h^2, c_proj h^2, the MLP's 8h^2) and
    13h of biases and norms (2h without biases), the embeddings Vh + sh (the head is wte), ln_f."""
    return L * (12 * h * h + (13 if bias else 2) * h) + V * h + s * h + (2 if bias else 1) * h


TERMS = {  # the formula's terms, per layer at e = 2 (the units' and the head's per model)
    "norms": "norms' inputs: 4sbh, + ln_f's 2sbh",
    "linears": "Linears' inputs: 2sbh + 2sbh + 2sbh + 8sbh",
    "qkv": "q, k and v: 6sbh",
    "softmax": "softmax output: 2as^2b, + its dropped copy 2as^2b",
    "masks": "dropout masks, 1 byte: as^2b + 2sbh",
    "activation": "the activation's input: 8sbh",
    "units": "recompute units' inputs: 2sbh each",
    "head": "the head's input 2sbh and FP32 log-softmax 4bsV (none in pieces)",
}


def layer_terms_closed(s, b, h, a, e=2, dropout=True, sdpa=False):
    """{term of TERMS: bytes} one transformer layer keeps for backward (Korthikanti et al. 2022, sec. 4.1).
    A fused attention kernel (sdpa) keeps no s x s tensor."""
    sbh, as2b = s * b * h, a * s * s * b
    return {"norms": 2 * e * sbh, "linears": 7 * e * sbh, "qkv": 3 * e * sbh,
            "softmax": 0 if sdpa else e * as2b * (1 + dropout),
            "masks": dropout * (2 * sbh + (0 if sdpa else as2b)), "activation": 4 * e * sbh}


def layer_activations_closed(s, b, h, a, e=2, dropout=True, sdpa=False):
    """Bytes one layer keeps (Korthikanti et al. 2022, eq. 1): with e = 2 and dropout, sbh(34 + 5as/h);
    without dropout, sbh(32 + 2as/h); with a fused kernel (sdpa), 34sbh and 32sbh."""
    return sum(layer_terms_closed(s, b, h, a, e, dropout, sdpa).values())


def head_activations_closed(s, b, h, V, e=2, chunks=1):
    """Bytes the head keeps: its input (2sbh) and the FP32 log-softmax of the logits (4bsV) for the loss's
    backward; in pieces (LOSS_CHUNKS > 1, model.ChunkedLoss) the input only: backward re-runs the logits."""
    return e * s * b * h + (4 * b * s * V if chunks == 1 else 0)


def loss_temporaries_closed(s, b, V, chunks=1):
    """Bytes the loss holds at its most, in backward: three FP32 tensors of the logits' size (the log-softmax,
    its gradient from the NLL, the logits' gradient), 4bsV each; under LOSS_CHUNKS a piece's, bs/k rows.
    In no paper's formula, yet at GPT-2's vocabulary most of a step's peak."""
    return 3 * 4 * math.ceil(b * s / chunks) * V


def full_recompute_layer_closed(s, b, h, e=2):
    """Bytes a layer keeps under full recompute: its input only, 2sbh at 16 bits."""
    return s * b * h * e


def sqrt_units_closed(n_layer, k):
    """Layers' worth of activations alive at sqrt recompute's peak: L/k kept unit inputs, plus the k
    blocks of the one unit being re-run. Smallest at k = sqrt(L), where it is 2 sqrt(L): O(sqrt(L))."""
    return math.ceil(n_layer / k) + k


def zero_bytes_per_rank(n_params, ranks, stage, precision_name="bf16"):
    """Bytes of model states per rank (ZeRO, Rajbhandari et al. 2020, Table 1): stage 0 (DDP) keeps all
    16 bytes per parameter; ZeRO-1 splits the master copy and AdamW's states over the N ranks, ZeRO-2
    the gradients too, ZeRO-3 (FSDP) the parameters too."""
    params, grads, master, adamw = (n * n_params for n in bytes_per_param_closed(precision_name))
    split = [master + adamw, grads, params][:stage]
    return params + grads + master + adamw - sum(split) + sum(split) / ranks


def closed_terms(cfg):
    """{term: bytes} the chapter's formulas give for cfg's whole model after its forward: each block by
    what its recompute policy keeps (a block unit: its input; a unit of the attention core: all but the
    s x s terms), ln_f's input, the head's."""
    e, (s, b, h, a) = precision.decide(cfg).element_bytes, (cfg.block_size, cfg.batch_size, cfg.n_embd, cfg.n_head)
    policy = checkpoint.policy(cfg)
    in_units = {i for unit in policy.block_units(cfg.n_layer) for i in unit}
    kept = [i for i in range(cfg.n_layer) if i not in in_units]
    cores = {i for i, path in policy.own_submodules(cfg.n_layer) if path == "attn.core"}
    out = dict.fromkeys(TERMS, 0)
    for i in kept:
        layer = layer_terms_closed(s, b, h, a, e, cfg.dropout > 0, sdpa=cfg.attn == "sdpa" or i in cores)
        for term, n in layer.items():
            out[term] += n
    out["norms"] += e * s * b * h  # ln_f
    out["units"] = len(policy.block_units(cfg.n_layer)) * full_recompute_layer_closed(s, b, h, e)
    out["head"] = head_activations_closed(s, b, h, cfg.vocab_size, e, cfg.loss_chunks)
    return out


# ---------------------------------------------------------------- which term a saved tensor is

RECOMPUTE = {"RerunNodeBackward", "NaiveRecomputeBackward"}  # checkpoint.py's nodes: they keep a unit's inputs
LINEAR_INPUTS = {("AddmmBackward0", "mat1"), ("MmBackward0", "self"), ("_FP8LinearFunctionBackward", "0")}
SOFTMAX = {"SoftmaxBackward0", "SafeSoftmaxBackward0"}
ACTIVATIONS = {"GeluBackward0", "SiluBackward0", "ReluBackward0", "TanhBackward0", "SigmoidBackward0"}


def module_kinds(model):
    """{path: kind} of model.named_modules(): "core" (the attention core), "norm", "dropout", "embedding",
    "linear" (a module with a 2-D weight of its own), else "module"."""
    def kind(m):
        if isinstance(m, (AttentionCore, nn.Dropout, nn.Embedding)):
            return {AttentionCore: "core", nn.Dropout: "dropout"}.get(type(m), "embedding")
        if "norm" in type(m).__name__.lower():
            return "norm"
        weight = getattr(m, "weight", None)
        return "linear" if getattr(weight, "dim", lambda: 0)() == 2 else "module"
    return {path: kind(m) for path, m in model.named_modules()}


def term_of(saved, kinds, activation_modules=()):
    """The term of TERMS that a saved tensor (ledger/measure.SavedTensor) is, or None: told by the ops
    that saved it (grad_fn and which of its inputs) and the module it was saved in (its first), never by
    its size. activation_modules: the modules where an activation (GELU, SiLU, ...) saved."""
    where = saved.modules[0] if saved.modules else ""
    kind, block = kinds.get(where, "module"), where.startswith("h.")
    ops, pairs = {node for node, *_ in saved.inputs}, {(node, which) for node, which, _ in saved.inputs}
    if ops & RECOMPUTE:
        return "qkv" if kind == "core" else "units"
    if kind == "norm":
        return "norms"
    if block and (("NativeDropoutBackward0", "result1") in pairs or
                  (kind in ("dropout", "core") and ("MulBackward0", "other") in pairs)):
        return "masks"  # (the embeddings' dropout mask is in no layer's formula)
    if block and pairs & LINEAR_INPUTS and any(kinds.get(m) == "linear" for m in saved.modules):
        return "linears"
    if kind == "core":  # softmax's own output, a matmul's input made from it, or a fused kernel's statistics
        after = any(came == "softmax" for *_, came in saved.inputs) or ops & SOFTMAX
        fused_qkv = {which for node, which, _ in saved.inputs if "Attention" in node} & {"query", "key", "value"}
        return "qkv" if not after and (fused_qkv or "BmmBackward0" in ops) else "softmax"
    if block and (ops & ACTIVATIONS or (ops <= {"MulBackward0"} and where in activation_modules)):
        return "activation"
    if not block and kind not in ("embedding", "dropout"):
        return "head"
    return None


def account(saved_tensors, kinds):
    """({term: [SavedTensor]}, [SavedTensor no term fits]) for one step's saved tensors."""
    activation_modules = {s.modules[0] for s in saved_tensors.values()
                          if s.modules and {node for node, *_ in s.inputs} & ACTIVATIONS}
    terms, unmatched = {term: [] for term in TERMS}, []
    for saved in saved_tensors.values():
        term = term_of(saved, kinds, activation_modules)
        (terms[term] if term else unmatched).append(saved)
    return terms, unmatched


COUNTED = {"norms": {("NativeLayerNormBackward0", "input")}, "linears": LINEAR_INPUTS,
           "head": {("MmBackward0", "self"), ("ChunkedLossBackward", "0")},
           "activation": {(node, "self") for node in ACTIVATIONS}}


def as_counted(term, saved, dtype):
    """Whether the formula counts this saved tensor of `term` as it is: its op and input (for the terms
    in COUNTED), at the activations' `dtype` (a mask: 1 byte; the head's log-softmax: FP32)."""
    pairs, ops = {(node, which) for node, which, _ in saved.inputs}, {node for node, *_ in saved.inputs}
    if term == "masks":
        return saved.dtype in ("bool", "uint8")
    if term == "head" and ("LogSoftmaxBackward0", "result") in pairs:
        return saved.dtype == "float32"
    if term == "softmax":  # its output, or a matmul's input made from it: not a fused kernel's statistics
        return saved.dtype == dtype and (any(came == "softmax" for *_, came in saved.inputs) or bool(ops & SOFTMAX))
    return saved.dtype == dtype and (term not in COUNTED or bool(pairs & COUNTED[term]))


def _once_each(lines):
    """The lines, each once in first-seen order, " (xN)" after one seen N times."""
    return [line + (f" (x{n})" if n > 1 else "") for line, n in Counter(lines).items()]


def in_words(tensors):
    """The tensors, told once per kind: the module (h.* for every block), the op and which of its inputs
    saved it, dtype, shape, bytes, how many."""
    def words(s):
        where = re.sub(r"^h\.\d+", "h.*", s.modules[0]) if s.modules and s.modules[0] else "GPT.forward"
        ops = ", ".join(f"{node} {which}" for node, which, _ in s.inputs) or "no node found"
        return f"{where} ({ops}): {s.dtype} {tuple(s.shape)}, {s.nbytes:,} bytes"
    return _once_each(words(s) for s in tensors)


def differences(cfg, terms, unmatched):
    """[(term, closed form, traced bytes, [lines in words])] for each term the step keeps otherwise than the
    formula says: what it keeps that the formula leaves out or counts otherwise, and where what it keeps as
    the formula does adds up otherwise, those too; then what no term explains."""
    closed, rows = closed_terms(cfg), []
    dtype = str(precision.decide(cfg).param_dtype).removeprefix("torch.")
    for term, tensors in terms.items():
        got = sum(s.nbytes for s in tensors)
        if got == closed[term]:
            continue
        counted = [s for s in tensors if as_counted(term, s, dtype)]
        lines = [f"not as the formula counts it: {line}" for line in
                 in_words([s for s in tensors if not as_counted(term, s, dtype)])]
        if term == "softmax" and counted and cfg.attn == "sdpa":  # the formula's sdpa is a fused kernel
            lines.append("sdpa ran unfused here (torch's math path, as on CPU with dropout): it keeps the softmax")
        if sum(s.nbytes for s in counted) != closed[term]:
            lines.append(f"as the formula counts them, {sum(s.nbytes for s in counted):,} bytes where it says "
                         f"{closed[term]:,}" + (": " if counted else ""))
            lines += [f"  {line}" for line in in_words(counted)]
        rows.append((term, closed[term], got, lines))
    if unmatched:
        rows.append(("not in the formulas", 0, sum(s.nbytes for s in unmatched), in_words(unmatched)))
    return rows


def loss_differences(cfg, alive):
    """[line] naming what the loss holds at its most beyond loss_temporaries_closed's three FP32 tensors:
    `alive` is [(dtype, shape, bytes)] of each storage then (ledger/loss.loss_at_most)."""
    rows = cfg.batch_size * cfg.block_size
    piece = {rows // cfg.loss_chunks, math.ceil(rows / cfg.loss_chunks)}  # tensor_split's sizes
    left, others = 3, []
    for dtype, shape, nbytes in alive:
        if left and dtype == "float32" and shape and shape[-1] == cfg.vocab_size and math.prod(shape[:-1]) in piece:
            left -= 1  # one of the formula's
        else:
            others.append(f"{dtype} {shape}, {nbytes:,} bytes")
    rows = math.ceil(rows / cfg.loss_chunks)  # the loss at its most may come after the pieces (the weight's sum)
    missing = (f"not alive then, of the formula's: float32 ({rows}, {cfg.vocab_size}), "
               f"{4 * rows * cfg.vocab_size:,} bytes")
    return _once_each(others + [missing] * left)


# ---------------------------------------------------------------- the states, and the four components

def state_differences(cfg, n_params, n_tensors, states):
    """(closed, [(why, bytes)]): the closed form's states (16 bytes per parameter, bytes_per_param_closed) and
    what the step's `states` (parameters + gradients + master + optimizer) keep beyond them, each named;
    what no rule names last."""
    spec, prec = precision.OPTIMIZERS[cfg.optimizer], precision.decide(cfg)
    closed = sum(bytes_per_param_closed(prec.name, len(spec.per_element))) * n_params
    named = [(f"{spec.name}'s per-tensor counts ({', '.join(spec.per_tensor)}): FP32, kept on the CPU",
              4 * len(spec.per_tensor) * n_tensors * (cfg.device != "cuda")),
             ("the FP32 gradient sums (fp32_grad_accum)", 4 * n_params * (cfg.fp32_grad_accum and prec.master_weights))]
    named = [(why, n) for why, n in named if n]
    rest = states - closed - sum(n for _, n in named)
    return closed, named + ([("not explained by the closed form", rest)] if rest else [])


def components(meas):
    """The chapter's four components of a counted step (ledger/measure.measure's dict), buffers apart (FSDP
    shards parameters, not buffers): the master copy in the optimizer's states, native FP8's kept copies apart."""
    return dict(parameters=meas["parameters"], buffers=meas["buffers"], gradients=meas["gradients"],
                optimizer=meas["master"] + meas["optimizer"], fp8_kept=meas["fp8_kept"],
                activations=meas["activations"])
