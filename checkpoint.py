"""Activation checkpointing (recomputation) by hand: a recompute autograd Function and the
policies that decide what it recomputes.

Chapter section 3. Read first: `Recompute` (keep the inputs, drop the internals, re-run in
backward), then the policies (each one class: which units it recomputes), then `apply_policy`.

Policies (CKPT=), one class each in POLICIES:
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
A policy says which units it recomputes: runs of consecutive blocks (`block_units`) and
blocks whose attention core alone is one (`core_units`), and what it refuses (`check`).
apply_policy, the recompute FLOPs (HFU), the memory ledger (its saved tensors and its
peak), CKPT's choices and `make help` all read POLICIES, so a policy nobody wrote cannot
be asked for, and a new one is one class (tests/test_checkpoint.py defines one in a test:
every other block).

Cost: a recomputed unit runs its forward twice, so `full` adds one forward of the
blocks, about +33% of a step (forward 1 unit of work, backward 2).
`make flops` (tools/demos.py) counts it with FlopCounterMode for each policy.

Model save/resume is called a *snapshot* in this project (snapshot.py), never a checkpoint.
"""
import functools
import math
from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint
from torch.autograd.graph import get_gradient_edge

from config import UsageError
from model import run_blocks_in_order, run_directly
from snapshot import rng_state, set_rng_state

# how deep in re-run forwards the running backward is. A context manager's state, like torch's
# grad mode: it says what the computation is doing right now, not how the run was configured
_recompute_depth = 0


def is_recomputing():
    """True inside the re-run forward of a recomputed unit (the tests tell the forward's dropout
    masks from the re-run's with it)."""
    return _recompute_depth > 0


@contextmanager
def _recomputing():
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


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
    `contexts`: (around the forward, around the re-run): what a precision needs there
    (precision.Recipe.recompute_contexts: TE's recompute flags, the FP8 weight a re-run uses).

    What it does differently from torch.utils.checkpoint (non-reentrant; make bench's reference
    row), and why. PyTorch's records the unit's own graph in the forward, through saved-tensor
    hooks that keep nothing, and in backward re-runs the unit inside the first of its nodes to
    need a saved tensor, stopping the re-run once the last saved tensor is made. Ours is one
    node: the forward keeps the inputs, the backward re-runs the whole unit and differentiates
    the re-run with autograd.grad. So the re-run, its RNG and autocast, the gradients' way out
    (returned through this node, where DDP's hooks and the FP32 buffers meet them) and the
    ledger's model of it (ledger/walk.py `_rerun`: one node) are each in one place. Its costs:
      - the re-run runs the unit's last ops too, which PyTorch's skips (a block's MLP projection
        and residual add; a core's att @ V): time (FlopCounterMode, default shape: +7.6% of a
        step's FLOPs with full, +3.7% sqrt, +2.3% selective), not memory, since only the
        outputs' gradient edges are kept and the outputs are freed at once (`rerun`);
      - autograd holds a node's incoming gradient until its backward returns, so the unit's
        output gradient stays alive through the whole walk back through the re-run, where
        PyTorch's frees it after the unit's last op: one output-sized tensor more wherever the
        step's peak falls later in the unit's backward (the softmax backward where that is the
        peak: selective at the default shape, full and sqrt at shapes whose attention backward,
        not the MLP's, is the peak; tests/test_checkpoint.py holds both to the byte). Only a
        design like PyTorch's, the unit's own nodes receiving that gradient, avoids it.
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
    def rerun(ctx, grad_outputs):
        """(inputs, roots): the forward again, on fresh leaves of the saved inputs, with grad on.
        roots: (gradient edge, incoming gradient) of each output that has both. Only the edges of the
        re-run's outputs are kept, not the outputs: backward starts from an output's grad_fn and
        never reads its values, so an output no node of the re-run saved is freed here, before the
        walk back through the re-run (holding it would cost one output more than PyTorch's own)."""
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
        roots = [(get_gradient_edge(o), g) for o, g in zip(outputs, grad_outputs)
                 if o.requires_grad and g is not None]
        return inputs, roots

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs, roots = Recompute.rerun(ctx, grad_outputs)
        wrt = [x for x in inputs if torch.is_tensor(x) and x.requires_grad] + \
              [p for p in ctx.params if p.requires_grad]
        grads = iter(torch.autograd.grad([e for e, _ in roots], wrt, [g for _, g in roots], allow_unused=True)
                     if roots and wrt else [None] * len(wrt))
        input_grads = [next(grads) if torch.is_tensor(x) and x.requires_grad else None for x in inputs]
        param_grads = [next(grads) if p.requires_grad else None for p in ctx.params]
        return (None, None, None, *input_grads, *param_grads)


def recompute(fn, *args, params=(), contexts=None):
    """Call fn(*args) so that its activations are recomputed in backward instead of kept.
    contexts: None, or a callable giving (around the forward, around the re-run); it is called
    only where there will be a backward (in evaluation a precision's context would wait for a
    re-run that never comes: TE's recompute flags queue one per unit)."""
    if not torch.is_grad_enabled():
        return fn(*args)  # evaluation: no graph, no backward, nothing to recompute
    around = contexts() if contexts else (nullcontext(), nullcontext())
    return Recompute.apply(fn, len(args), around, *args, *tuple(params))


def torch_recompute(fn, *args, params=(), contexts=None):
    """PyTorch's own recompute, torch.utils.checkpoint (non-reentrant), called like `recompute`:
    the reference the tests hold ours to, and `make bench`'s reference row (apply_policy's
    recompute_fn). params: unused (its saved-tensor hooks find them); contexts: its context_fn."""
    kw = dict(context_fn=contexts) if contexts else {}
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kw)


# ---------------------------------------------------------------- policies

class Policy:
    """What backward recomputes instead of keeping. A subclass names itself (`name`: CKPT's value,
    `help`: one line for --help and make help) and says which units it recomputes."""
    name, help = None, ""
    takes_segment = False  # CKPT_SEGMENT applies to it

    def __init__(self, segment=0):
        self.segment = segment

    def block_units(self, n_layer):
        """Runs of consecutive block indices, each recomputed as one unit (only its input kept)."""
        return []

    def core_units(self, n_layer):
        """Blocks whose attention core alone is recomputed (its q, k, v kept)."""
        return []

    def check(self, cfg):
        """Raise UsageError where this policy cannot run with cfg."""


POLICIES = {}  # CKPT's choices: name -> Policy class


def register(cls):
    POLICIES[cls.name] = cls
    return cls


@register
class NoRecompute(Policy):
    name, help = "none", "autograd keeps every activation"


@register
class Full(Policy):
    name, help = "full", "every block a unit: its input kept, the block re-run in backward"

    def block_units(self, n_layer):
        return [[i] for i in range(n_layer)]


@register
class Sqrt(Policy):
    name, help = "sqrt", "CKPT_SEGMENT blocks a unit (default round(sqrt(L))): O(sqrt(L)) memory"
    takes_segment = True

    def block_units(self, n_layer):
        k = self.segment or max(1, round(math.sqrt(n_layer)))
        return [list(range(i, min(i + k, n_layer))) for i in range(0, n_layer, k)]

    def check(self, cfg):
        if cfg.ckpt_segment > cfg.n_layer:
            raise UsageError(f"--ckpt_segment={cfg.ckpt_segment} is more blocks than n_layer={cfg.n_layer} "
                             f"(one unit of all blocks is ckpt_segment={cfg.n_layer})")


@register
class Selective(Policy):
    name, help = "selective", "each block's attention core a unit: the s x s softmax re-run, the rest kept"

    def core_units(self, n_layer):
        return list(range(n_layer))

    def check(self, cfg):
        if cfg.attn != "manual":
            raise UsageError("ckpt=selective recomputes the manual attention core; use attn=manual "
                             "(attn=sdpa already recomputes its core inside the kernel)")


def policy(cfg):
    """The Policy cfg.ckpt names, with cfg.ckpt_segment, checked against cfg: UsageError for a
    policy that does not exist or cannot run here."""
    cls = POLICIES.get(cfg.ckpt)
    if cls is None:
        raise UsageError(f"--ckpt={cfg.ckpt} is not one of {'|'.join(POLICIES)}")
    if cfg.ckpt_segment and not cls.takes_segment:
        takers = "|".join(name for name, c in POLICIES.items() if c.takes_segment)
        raise UsageError(f"--ckpt_segment applies to ckpt={takers} only, this run has ckpt={cfg.ckpt}")
    chosen = cls(cfg.ckpt_segment)
    chosen.check(cfg)
    return chosen


def _checked_units(units, n_layer):
    seen = set()
    for unit in units:
        if not unit or unit != list(range(unit[0], unit[-1] + 1)) or unit[0] < 0 or unit[-1] >= n_layer \
                or seen & set(unit):
            raise ValueError(f"a recompute unit must be a run of consecutive blocks of 0..{n_layer - 1}, "
                             f"each block in one unit at most: got {units}")
        seen |= set(unit)
    return units


def apply_policy(model, policy, contexts=None, recompute_fn=recompute):
    """Set model.block_runner and each attention's core_runner for `policy` (a Policy).
    contexts: what the precision needs around a unit of blocks, called with the unit's blocks
    at its forward (precision.Recipe.recompute_contexts, given by train.build); a core holds no
    Linear and needs none (with Transformer Engine: no TE module inside, nothing to re-enter).
    recompute_fn: ours, or torch_recompute for the reference."""
    n = len(model.h)
    units = _checked_units(policy.block_units(n), n)
    cores = set(policy.core_units(n))
    model.block_runner = _unit_runner(units, contexts, recompute_fn) if units else run_blocks_in_order
    for i, block in enumerate(model.h):
        block.attn.core_runner = recompute_fn if i in cores else run_directly  # q, k, v: the core's inputs
    return model


def _unit_runner(units, contexts, recompute_fn):
    """GPT.block_runner with `units`: each run of blocks one Recompute, the other blocks as they are."""
    starts = {unit[0]: unit for unit in units}

    def run(blocks, x):
        i = 0
        while i < len(blocks):
            if i not in starts:
                x = blocks[i](x)
                i += 1
                continue
            group = [blocks[j] for j in starts[i]]
            params = [p for b in group for p in b.parameters()]
            x = recompute_fn(run_blocks_in_order, group, x, params=params,
                             contexts=functools.partial(contexts, group) if contexts else None)
            i = starts[i][-1] + 1
        return x
    return run


def recompute_flops_per_token(model, policy):
    """Forward FLOPs per token that recomputation adds: counted in HFU, not in MFU.

    A recomputed block runs its forward once more: 2 FLOPs (a multiply and an add) per
    matmul weight per token, plus the attention core's QK^T and @V, 2 x 2*s*h per token;
    a recomputed core alone, the core's. Biases and LayerNorms are elementwise work, not
    counted (nor does FlopCounterMode count them; the tests hold this function to its count).
    (sqrt re-runs every block as full does: it keeps fewer inputs, not fewer re-runs.)
    """
    c, n = model.cfg, len(model.h)
    core = 4 * c.block_size * c.n_embd
    in_units = {i for unit in policy.block_units(n) for i in unit}
    cores = set(policy.core_units(n)) - in_units
    matmuls = lambda block: 2 * sum(p.numel() for p in block.parameters() if p.dim() >= 2)  # noqa: E731
    return sum(matmuls(model.h[i]) + core for i in in_units) + core * len(cores)
