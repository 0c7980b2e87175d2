"""Activation checkpointing (recomputation) by hand: keep a unit's inputs, re-run it in backward.

Chapter section 3. Read first: `NaiveRecompute` (the textbook custom autograd Function, about
thirty lines), then `recompute` (the real one, PyTorch's design: what the naive one costs, fixed),
then the policies (each one class: which units a policy recomputes), then `apply_policy`.

Policies (CKPT=), one class each in POLICIES:
  none       autograd keeps every activation of every block.
  full       each block a unit: only its input (s*b*h values) is kept, one block re-run at a time.
  sqrt       CKPT_SEGMENT=k blocks a unit (default round(sqrt(L))): L/k inputs kept plus one
             unit's internals live in backward, L/k + k, smallest at k = sqrt(L): O(sqrt(L)).
  selective  only the attention core (QK^T, softmax, dropout, @V): the s^2 part, cheap to redo.
A new policy is one class: apply_policy, the recompute FLOPs, the ledger, CKPT's choices and
`make help` all read POLICIES.

Cost: a recomputed block runs its forward twice: about +33% of a step (forward 1, backward 2), less
what its re-run skips after the last tensor the unit saves. Model save/resume is a *snapshot* here.
"""
import functools
import math
from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint

from config import UsageError
from model import rng_state, run_blocks_in_order, set_rng_state


# ---------------------------------------------------------------- the naive recompute, first

_TENSOR = object()  # where a tensor argument goes back in

class NaiveRecompute(torch.autograd.Function):
    """The textbook recompute (PyTorch's reentrant checkpoint): forward runs fn without a graph and
    keeps only its inputs and the RNG state; backward runs fn again, with a graph, and backpropagates
    through that graph to the inputs (and, on the way, into the parameters' .grad)."""

    @staticmethod
    def forward(ctx, fn, contexts, *args):
        ctx.fn, ctx.args = fn, [_TENSOR if torch.is_tensor(a) else a for a in args]
        ctx.device = next((a.device for a in args if torch.is_tensor(a)), torch.device("cpu"))
        ctx.rng = rng_state(ctx.device)  # so dropout draws the same masks when re-run
        around_forward, ctx.around_rerun = contexts() if contexts else (nullcontext(), nullcontext())
        ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))  # the only activations kept
        with torch.no_grad(), around_forward:
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        inputs = [next(tensors) if a is _TENSOR else a for a in ctx.args]
        outer_rng = rng_state(ctx.device)
        set_rng_state(ctx.rng, ctx.device)
        with torch.enable_grad(), ctx.around_rerun:
            outputs = ctx.fn(*inputs)
        set_rng_state(outer_rng, ctx.device)  # the caller's random stream must not notice the re-run
        pairs = [(o, g) for o, g in zip(outputs if isinstance(outputs, tuple) else (outputs,), grads)
                 if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward(*zip(*pairs))  # into the inputs' .grad and the parameters' .grad
        return (None, None, *(a.grad if torch.is_tensor(a) else None for a in inputs))


def naive_recompute(fn, *args, contexts=None, stop_early=True):
    """fn(*args) through NaiveRecompute (called like `recompute`; it never stops early)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return NaiveRecompute.apply(fn, contexts, *args)


# What the real design below fixes, and how:
# - the naive backward holds the outputs' gradients (one b*s*h per output) while it re-runs the
#   unit and backpropagates through all of it; the real one re-runs in the output node, hands the
#   gradients on and lets the unit's own nodes run in the same backward, each freeing as it goes;
# - the naive re-run recomputes the unit's last ops, whose outputs nothing saved; the real one
#   stops once the last saved tensor is made (the early stop: fewer FLOPs, flops.per_token counts them);
# - the naive backward is a second backward inside the first: gradients reach the parameters from a
#   nested graph, which FSDP's per-block hooks do not follow (config.py refuses it under FSDP).

# ---------------------------------------------------------------- the real recompute

def recompute(fn, *args, contexts=None, stop_early=True):
    """Call fn(*args) so that the tensors its ops save for backward are recomputed instead of kept.

    Forward: fn runs with grad, its nodes recorded, but each tensor they save is packed as a slot
    number (`Unit.pack_forward`); the outputs pass through one node of their own, `RerunNode`, which
    keeps the inputs. Backward: gradients enter the unit through its outputs only, so autograd reaches
    RerunNode first; it re-runs fn (`Unit.rerun`), filing what the re-run saves under its slots
    (`Unit.pack_rerun`), and each node of the unit takes its own back (`Unit.unpack`, which enforces
    that order). contexts: None, or a callable giving (around the forward, around the re-run), the
    precision's. stop_early: may the re-run stop after the last saved tensor (rerun_stops_early)."""
    if not torch.is_grad_enabled():
        return fn(*args)  # evaluation: no graph, no backward, nothing to recompute
    around_forward, around_rerun = contexts() if contexts else (nullcontext(), nullcontext())
    unit = Unit(fn, args, around_rerun, stop_early)
    with torch.autograd.graph.saved_tensors_hooks(unit.pack_forward, unit.unpack), around_forward:
        output = fn(*args)
    outputs = output if isinstance(output, tuple) else (output,)
    if not all(torch.is_tensor(t) for t in outputs):
        raise TypeError("recompute: fn must return a tensor or a tuple of tensors")
    outputs = RerunNode.apply(unit, len(outputs), *outputs, *(a.detach() for a in args if torch.is_tensor(a)))
    return outputs if isinstance(output, tuple) else outputs[0]


class _Enough(Exception):
    """The re-run has made every tensor the unit's nodes saved: the rest of fn is skipped."""


class Unit:
    """One recomputed call of fn: what its re-run needs, and, once re-run, what its nodes saved."""

    def __init__(self, fn, args, around_rerun, stop_early=True):
        self.fn, self.around_rerun, self.stop_early = fn, around_rerun, stop_early
        self.is_tensor = [torch.is_tensor(a) for a in args]
        self.non_tensors = [None if t else a for a, t in zip(args, self.is_tensor)]
        tensors = [a for a in args if torch.is_tensor(a)]
        self.requires_grad = [t.requires_grad for t in tensors]  # RerunNode saves them detached
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.rng = rng_state(self.device)  # so dropout draws the same masks when re-run
        # backward runs outside the caller's autocast: its re-run enters the forward's again
        self.autocast = torch.is_autocast_enabled(self.device.type) and dict(
            device_type=self.device.type, dtype=torch.get_autocast_dtype(self.device.type),
            cache_enabled=torch.is_autocast_cache_enabled())
        # slots handed out in the forward; slot -> the tensor the re-run saved there, until its node takes it
        self.n_saved, self.recomputed = 0, None

    def pack_forward(self, tensor):
        """The forward's pack hook: keep a number, not the tensor."""
        self.n_saved += 1
        return self.n_saved - 1

    def unpack(self, slot):
        """The unpack hook: a node of the unit needs, in its backward, what it saved."""
        if self.recomputed is None:  # the order rule: RerunNode runs before every node of its unit
            raise RuntimeError("a recomputed unit's node needs its saved tensors before the unit was re-run: a tensor "
                               "made inside the unit is used outside it (recompute: gradients must enter the unit "
                               "through fn's outputs)")
        if slot not in self.recomputed:
            raise RuntimeError("a recomputed unit's saved tensors are used once each: to run backward through it "
                               "twice, run the forward again")
        return self.recomputed.pop(slot)

    def pack_rerun(self, tensor):
        """The re-run's pack hook: file the tensor under the next slot; after the last, stop."""
        self.recomputed[len(self.recomputed)] = tensor.detach()
        if len(self.recomputed) == self.n_saved and self.stop_early:
            raise _Enough  # fn's remaining ops feed nothing saved (PyTorch's early stop)
        return None  # the re-run's own nodes keep nothing: its graph is thrown away

    def rerun(self, saved_inputs):
        """fn again on the saved inputs, with grad (so its ops save), the forward's RNG state and
        autocast; then the backward's RNG state back: the caller's stream must not notice."""
        self.recomputed = {}
        if self.n_saved == 0:
            return
        saved = iter(t.detach().requires_grad_(grad) for t, grad in zip(saved_inputs, self.requires_grad))
        inputs = [next(saved) if is_tensor else arg for is_tensor, arg in zip(self.is_tensor, self.non_tensors)]
        outer_rng = rng_state(self.device)
        set_rng_state(self.rng, self.device)
        try:
            with torch.enable_grad(), _autocast(self.autocast), self.around_rerun, \
                    torch.autograd.graph.saved_tensors_hooks(self.pack_rerun, _never_unpacked):
                self.fn(*inputs)
        except _Enough:
            pass
        finally:
            set_rng_state(outer_rng, self.device)
        if len(self.recomputed) != self.n_saved:
            raise RuntimeError(f"a recomputed unit's re-run saved {len(self.recomputed)} tensors where its forward "
                               f"saved {self.n_saved}: fn must run the same ops both times")


def _never_unpacked(packed):
    raise RuntimeError("the re-run's own graph is not differentiated")


class RerunNode(torch.autograd.Function):
    """The unit's outputs as a node of their own: its backward re-runs the unit from the inputs it
    saved, then hands the outputs' gradients on, unchanged, to the unit's last nodes. The inputs
    come in detached: saved here, but their gradients flow through the unit's own nodes."""

    @staticmethod
    def forward(ctx, unit, n_outputs, *outputs_and_inputs):
        outputs, inputs = outputs_and_inputs[:n_outputs], outputs_and_inputs[n_outputs:]
        ctx.unit, ctx.n_inputs = unit, len(inputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        ctx.save_for_backward(*inputs)  # the only activations the unit keeps
        views = tuple(t.view_as(t) for t in outputs)  # new tensors, so this node owns them
        ctx.mark_non_differentiable(*(v for v, t in zip(views, outputs) if not t.requires_grad))
        return views

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.rerun(ctx.saved_tensors)  # saved_tensors unpacks (an outer unit's slots): read once
        return (None, None, *grads) + (None,) * ctx.n_inputs


def _autocast(state):
    return torch.autocast(**state) if state else nullcontext()


def rerun_stops_early(cfg, prec):
    """Whether a re-run may stop after the last saved tensor: not under Transformer Engine
    (precision.Precision.rerun_stops_early says why) nor FSDP, whose post-forward hook must see each
    block's re-run end (our re-run runs before FSDP2's pre-backward hook: docs/recompute.md)."""
    return prec.rerun_stops_early and cfg.shard != "fsdp"


def torch_recompute(fn, *args, contexts=None, stop_early=True):
    """PyTorch's own, torch.utils.checkpoint (non-reentrant), called like `recompute`: the tests'
    oracle and `make bench`'s reference row. contexts: its context_fn; stop_early: its early stop."""
    kw = dict(context_fn=contexts) if contexts else {}
    with torch.utils.checkpoint.set_checkpoint_early_stop(stop_early):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kw)


IMPLEMENTATIONS = {"hooks": recompute, "naive": naive_recompute}  # CKPT_IMPL's choices


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

    def submodule_units(self, n_layer):
        """[(block index, submodule path)]: submodules of blocks recomputed as units of their own, their
        inputs kept ("attn.core": the attention core, its q, k, v; "mlp"; any path of model.Block)."""
        return []

    def own_submodules(self, n_layer):
        """submodule_units but those inside a block unit (they re-run with their block already)."""
        in_units = {i for unit in self.block_units(n_layer) for i in unit}
        return [(i, path) for i, path in self.submodule_units(n_layer) if i not in in_units]

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

    def submodule_units(self, n_layer):
        return [(i, "attn.core") for i in range(n_layer)]

    def check(self, cfg):
        if cfg.attn != "manual":
            raise UsageError("ckpt=selective recomputes the manual attention core; use attn=manual "
                             "(attn=sdpa already recomputes its core inside the kernel)")


def policy(cfg):
    """The Policy cfg.ckpt names, checked against cfg: UsageError for one that does not exist or cannot run."""
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
    blocks = [i for unit in units for i in unit]  # each a run of consecutive blocks, each block in one unit at most
    if [] in units or any(unit != list(range(unit[0], unit[-1] + 1)) for unit in units) \
            or len(set(blocks)) != len(blocks) or not set(blocks) <= set(range(n_layer)):
        raise ValueError(f"a recompute unit must be a run of consecutive blocks of 0..{n_layer - 1}, "
                         f"each block in one unit at most: got {units}")
    return units


def apply_policy(model, policy, contexts=None, recompute_fn=recompute, stop_early=True):
    """Make `model` recompute what `policy` (a Policy) says: model.block_runner runs the runs of blocks
    as units; each submodule unit's calls go through recompute_fn from now on. contexts: the precision's,
    called with a unit's modules at its forward (precision.Precision.recompute_contexts). recompute_fn:
    `recompute`, `naive_recompute` or `torch_recompute`. stop_early: may a re-run stop after the last
    tensor its unit saves."""
    recompute_fn = functools.partial(recompute_fn, stop_early=stop_early)
    n = len(model.h)
    units = _checked_units(policy.block_units(n), n)
    model.block_runner = _unit_runner(units, contexts, recompute_fn) if units else run_blocks_in_order
    for module in model.h.modules():
        module.__dict__.pop("forward", None)  # a unit of a policy applied before: the class's forward again
    for i, path in policy.own_submodules(n):
        module = model.h[i].get_submodule(path)
        forward = type(module).forward.__get__(module)  # the class's forward, bound to this module
        module.forward = functools.partial(recompute_fn, forward,
                                           contexts=functools.partial(contexts, [module]) if contexts else None)
    return model


def _unit_runner(units, contexts, recompute_fn):
    """GPT.block_runner with `units`: each run of blocks one recompute unit, the other blocks as they are."""
    starts = {unit[0]: unit for unit in units}

    def run(blocks, x):
        i = 0
        while i < len(blocks):
            if i not in starts:
                x = blocks[i](x)
                i += 1
                continue
            group = [blocks[j] for j in starts[i]]
            x = recompute_fn(run_blocks_in_order, group, x,
                             contexts=functools.partial(contexts, group) if contexts else None)
            i = starts[i][-1] + 1
        return x
    return run
