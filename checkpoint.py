"""Activation checkpointing (recomputation) by hand: a recompute autograd Function and
the policies that decide what to recompute.

Chapter section 3. Read first: `Recompute` (keep the inputs, drop the internals,
re-run in backward), then `apply_policy`.

Policies (CKPT=):
  none       autograd saves every activation of every block.
  full       each block is a recompute unit: only its input (s*b*h values) is kept;
             backward re-runs one block at a time, so one block's internals are live.
  sqrt       CKPT_SEGMENT=k consecutive blocks form one unit (default k = round(sqrt(L))):
             only L/k segment inputs are kept and one segment's internals are live in
             backward, about L/k + k block-activations, smallest at k = sqrt(L): O(sqrt(L)).
  selective  only the attention core (QK^T, softmax, dropout, @V) is recomputed, the
             part whose activations grow with s^2 but whose FLOPs are small; the big
             matmul outputs are kept. (sdpa/flash attention already does this inside
             its kernel: it never stores the softmax and recomputes it in backward.)

Cost: a recomputed unit runs its forward twice, so `full` adds one forward of the
blocks, about +33% of a step (forward 1 unit of work, backward 2).
`make flops` (tools/demos.py) counts it with FlopCounterMode for each policy.

Model save/resume is called a *snapshot* in this project (snapshot.py), never a checkpoint.
"""
import math
from contextlib import contextmanager, nullcontext

import torch

from config import CKPT_POLICIES
from model import run_blocks_in_order, run_directly
from snapshot import rng_state, set_rng_state

_recompute_depth = 0  # > 0 while a backward is re-running a forward
_make_contexts = None  # set by `recompute_contexts`: what a precision needs around a recomputed forward


def is_recomputing():
    """True inside the re-run forward of a recomputed unit (e.g. FP8 must not re-record amax)."""
    return _recompute_depth > 0


@contextmanager
def _recomputing():
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


@contextmanager
def recompute_contexts(make):
    """While open, every recompute unit calls make() once in its forward and gets two context
    managers: one entered around its forward, one around its re-run in backward (as
    torch.utils.checkpoint's context_fn). precision.Recipe.forward_context opens it, so this
    file knows nothing of FP8: Transformer Engine's recompute flags and FP8 autocast
    (fp8_te.recompute_contexts), or which FP8 weight copy the re-run uses (fp8.py)."""
    global _make_contexts
    previous, _make_contexts = _make_contexts, make
    try:
        yield
    finally:
        _make_contexts = previous


def _autocast_state(device):
    if not torch.is_autocast_enabled(device.type):
        return None
    return dict(device_type=device.type, dtype=torch.get_autocast_dtype(device.type),
                cache_enabled=torch.is_autocast_cache_enabled())


def _autocast(state):
    """The forward's autocast region again (or leave autocast as it is, if it had none)."""
    return torch.autocast(**state) if state else nullcontext()


class Recompute(torch.autograd.Function):
    """y = fn(*args) without saving fn's internals; backward re-runs fn and differentiates it.

    `params` are the parameters fn uses, passed as inputs so their gradients flow
    through this node's backward into the ordinary autograd graph (DDP's hooks and the
    FP32 gradient buffers see them as usual). Non-tensor args pass through untouched.
    `contexts`: (around the forward, around the re-run), from `recompute_contexts`.
    """

    @staticmethod
    def forward(ctx, fn, n_args, contexts, *args_and_params):
        args = args_and_params[:n_args]
        ctx.fn, ctx.n_args = fn, n_args
        ctx.params = args_and_params[n_args:]  # leaves: kept by reference, not saved activations
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.non_tensors = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.device = tensors[0].device if tensors else torch.device("cpu")
        ctx.rng = rng_state(ctx.device)  # so dropout draws the same masks when re-run
        ctx.autocast = _autocast_state(ctx.device)  # backward runs outside the caller's autocast
        ctx.save_for_backward(*tensors)  # the only activations this unit keeps
        around_forward, ctx.around_rerun = contexts
        with torch.no_grad(), around_forward:
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = iter(ctx.saved_tensors)
        inputs = []  # fresh leaves to differentiate
        for is_tensor, arg in zip(ctx.is_tensor, ctx.non_tensors):
            if is_tensor:
                t = next(saved)
                arg = t.detach().requires_grad_(t.requires_grad)
            inputs.append(arg)
        # re-run with the forward's RNG state and autocast state, then put the backward's
        # own RNG state back: the caller's random stream must not notice the re-run
        outer_rng = rng_state(ctx.device)
        set_rng_state(ctx.rng, ctx.device)
        try:
            with torch.enable_grad(), _recomputing(), _autocast(ctx.autocast), ctx.around_rerun:
                # fn gets non-leaf aliases of the leaves: module hooks (FlopCounterMode's
                # module tracker, for one) look up their inputs' autograd node, which the
                # engine refuses to do for a leaf inside autograd.grad
                outputs = ctx.fn(*(x.view_as(x) if torch.is_tensor(x) and x.requires_grad else x
                                   for x in inputs))
        finally:
            set_rng_state(outer_rng, ctx.device)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wrt = [x for x in inputs if torch.is_tensor(x) and x.requires_grad] + \
              [p for p in ctx.params if p.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                     if pairs and wrt else [None] * len(wrt))
        input_grads = [next(grads) if torch.is_tensor(x) and x.requires_grad else None for x in inputs]
        param_grads = [next(grads) if p.requires_grad else None for p in ctx.params]
        return (None, None, None, *input_grads, *param_grads)


def recompute(fn, *args, params=(), precision_contexts=True):
    """Call fn(*args) so that its activations are recomputed in backward instead of kept.
    precision_contexts=False: fn holds no layer that needs them (the attention core)."""
    if not torch.is_grad_enabled():
        # evaluation: no graph, no backward, nothing to recompute (and a precision's forward
        # context would wait for a re-run that never comes: TE's recompute flags queue one per unit)
        return fn(*args)
    make = _make_contexts if precision_contexts else None
    contexts = make() if make else (nullcontext(), nullcontext())
    return Recompute.apply(fn, len(args), contexts, *args, *tuple(params))


def recompute_core(fn, *args):
    """The selective policy's unit: the attention core, which holds no Linear, so it needs no
    precision context (with Transformer Engine: no TE module inside, nothing to re-enter)."""
    return recompute(fn, *args, precision_contexts=False)


# ---------------------------------------------------------------- policies

def segments(n_layer, policy, segment=0):
    """Block indices grouped into recompute units: [[0], [1], ...] for full, runs of k for sqrt."""
    if policy == "full":
        k = 1
    elif policy == "sqrt":
        k = segment or max(1, round(math.sqrt(n_layer)))
    else:
        return []
    return [list(range(i, min(i + k, n_layer))) for i in range(0, n_layer, k)]


def apply_policy(model, policy, segment=0):
    """Set model.block_runner / each attention's core_runner for a CKPT policy."""
    if policy not in CKPT_POLICIES:
        raise ValueError(f"ckpt must be one of {'|'.join(CKPT_POLICIES)}, got {policy!r}")
    if segment < 0:
        raise ValueError(f"ckpt_segment must be >= 0 (0 = round(sqrt(n_layer))), got {segment}")
    model.block_runner = run_blocks_in_order
    for block in model.h:
        block.attn.core_runner = run_directly
    if policy in ("full", "sqrt"):
        units = segments(len(model.h), policy, segment)

        def run_segments(blocks, x):
            for unit in units:
                group = [blocks[i] for i in unit]
                params = [p for b in group for p in b.parameters()]
                x = recompute(run_blocks_in_order, group, x, params=params)
            return x
        model.block_runner = run_segments
    elif policy == "selective":
        if model.cfg.attn != "manual":
            raise ValueError("ckpt=selective recomputes the manual attention core; use attn=manual "
                             "(attn=sdpa already recomputes its core inside the kernel)")
        for block in model.h:
            block.attn.core_runner = recompute_core  # the core has no parameters: q, k, v are its inputs
    return model


def recompute_flops_per_token(model, policy, segment=0):
    """Forward FLOPs per token that recomputation adds: counted in HFU, not in MFU.

    A recomputed block runs its forward once more: 2 FLOPs (a multiply and an add) per
    matmul weight per token, plus the attention core's QK^T and @V, 2 x 2*s*h per token
    per layer. Biases and LayerNorms are elementwise work, not counted (nor does
    FlopCounterMode count them; the tests hold this function to its count).
    `selective` re-runs the attention core only. (Every block is recomputed for full
    and sqrt alike: sqrt keeps fewer inputs, not fewer re-runs.)
    """
    c = model.cfg
    attention_core = 4 * c.n_layer * c.block_size * c.n_embd
    if policy in ("full", "sqrt"):
        return 2 * sum(p.numel() for p in model.h.parameters() if p.dim() >= 2) + attention_core
    if policy == "selective":
        return attention_core
    return 0
