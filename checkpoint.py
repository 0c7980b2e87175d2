"""Activation checkpointing (recomputation) by hand: saved-tensor hooks that keep nothing, a
node that re-runs the unit in backward, and the policies that decide what it recomputes.

Chapter section 3. Read first: `recompute` (the forward keeps slot numbers, not tensors), then
`Unit` (what a re-run files for each slot), then `RerunNode` (the node that re-runs), then the
policies (each one class: which units it recomputes), then `apply_policy`.

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
blocks, about +33% of a step (forward 1 unit of work, backward 2), less the ops after the
last tensor a unit saves, which its re-run skips (`recompute_flops_per_token`).
`make flops` (tools/demos.py) counts it with FlopCounterMode for each policy.

Model save/resume is called a *snapshot* in this project (snapshot.py), never a checkpoint.
"""
import functools
import math
from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint

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


def recompute(fn, *args, contexts=None, stop_early=True):
    """Call fn(*args) so that the tensors its ops save for backward are recomputed instead of kept.
    fn returns a tensor or a tuple of tensors.

    The forward runs fn with grad, so autograd records the unit's nodes as usual and the
    gradients flow through them into the rest of the graph (DDP's hooks, FSDP's and the FP32
    gradient buffers see nothing unusual). But each tensor a node of the unit saves is packed
    as a slot number (Unit.slot, a saved-tensor hook): the forward keeps none of them. The
    outputs then pass through a node of their own (RerunNode), which keeps the unit's inputs
    and, in backward, re-runs the unit before any of its nodes needs what it saved (Unit.rerun).

    What it does differently from torch.utils.checkpoint (non-reentrant; make bench's reference
    row, tests/test_checkpoint.py its oracle), and why: the same saved-tensor hooks and the same
    early stop, but the re-run happens in one place you can read, the unit's output node,
    instead of inside whichever of the unit's nodes first unpacks a saved tensor; and the
    inputs go as soon as that node has re-run the unit (PyTorch's keep them until the unit's
    last node is done). The price: every gradient must enter the unit through fn's outputs (a
    tensor made inside the unit and used outside it would need its saved tensors before the
    re-run: refused in one line, see Unit.take). The RNG state is kept whether or not fn draws
    random numbers.

    contexts: None, or a callable giving (around the forward, around the re-run); it is called
    only where there will be a backward (in evaluation a precision's context would wait for a
    re-run that never comes: TE's recompute flags queue one per unit). stop_early: whether the
    re-run may stop after the last tensor the unit saves (rerun_stops_early says when not)."""
    if not torch.is_grad_enabled():
        return fn(*args)  # evaluation: no graph, no backward, nothing to recompute
    around_forward, around_rerun = contexts() if contexts else (nullcontext(), nullcontext())
    unit = Unit(fn, args, around_rerun, stop_early)
    with torch.autograd.graph.saved_tensors_hooks(unit.slot, unit.take), around_forward:
        output = fn(*args)
    outputs = output if isinstance(output, tuple) else (output,)
    if not all(torch.is_tensor(t) for t in outputs):
        raise TypeError("recompute: fn must return a tensor or a tuple of tensors")
    outputs = RerunNode.apply(unit, len(outputs), *outputs, *(a.detach() for a in args if torch.is_tensor(a)))
    return outputs if isinstance(output, tuple) else outputs[0]


class _Enough(Exception):
    """The re-run has made every tensor the unit's nodes saved: the rest of fn is skipped."""


class Unit:
    """One recomputed call of fn: what its re-run needs, and, once re-run, what its nodes saved.

    `slot` and `take` are the forward's saved-tensor hooks (pack: a number, not the tensor;
    unpack: the tensor the re-run filed under that number). `rerun` runs fn again in backward,
    where `file` is the pack hook: the same ops save the same tensors in the same order, so the
    n-th tensor saved goes under slot n; each node of the unit takes its own back when its
    backward runs, and it goes when that node is done. around_rerun: what the precision needs
    around the re-run (precision.Recipe.recompute_contexts: the FP8 weight copies kept from the
    forward)."""

    def __init__(self, fn, args, around_rerun, stop_early=True):
        self.fn, self.around_rerun, self.stop_early = fn, around_rerun, stop_early
        self.is_tensor = [torch.is_tensor(a) for a in args]
        self.non_tensors = [None if t else a for a, t in zip(args, self.is_tensor)]
        tensors = [a for a in args if torch.is_tensor(a)]
        self.requires_grad = [t.requires_grad for t in tensors]  # RerunNode saves them detached
        self.device = tensors[0].device if tensors else torch.device("cpu")
        self.rng = rng_state(self.device)  # so dropout draws the same masks when re-run
        self.autocast = _autocast_state(self.device)  # backward runs outside the caller's autocast
        self.n_saved = 0  # slots handed out in the forward
        self.recomputed = None  # slot -> the tensor the re-run saved there, until its node takes it

    def slot(self, tensor):
        """Pack hook of the forward: keep a number, not the tensor."""
        self.n_saved += 1
        return self.n_saved - 1

    def take(self, slot):
        """Unpack hook: a node of the unit needs, in its backward, what it saved."""
        if self.recomputed is None:
            raise RuntimeError("a recomputed unit's node needs its saved tensors before the unit was re-run: a tensor "
                               "made inside the unit is used outside it (recompute: gradients must enter the unit "
                               "through fn's outputs)")
        if slot not in self.recomputed:
            raise RuntimeError("a recomputed unit's saved tensors are used once each: to run backward through it "
                               "twice, run the forward again")
        return self.recomputed.pop(slot)

    def file(self, tensor):
        """Pack hook of the re-run: file the tensor under the next slot. After the last slot
        the re-run stops (PyTorch's checkpoint does too): fn's remaining ops feed nothing saved.
        (Unless stop_early is off: rerun_stops_early says when.)"""
        self.recomputed[len(self.recomputed)] = tensor.detach()
        if len(self.recomputed) == self.n_saved and self.stop_early:
            raise _Enough
        return None  # the re-run's own nodes keep nothing: its graph is thrown away

    def rerun(self, saved_inputs):
        """fn again on the saved inputs, with grad on (so its ops save), with the forward's RNG
        state and autocast; then the backward's own RNG state back: the caller's random stream
        must not notice the re-run."""
        self.recomputed = {}
        if self.n_saved == 0:
            return
        saved, inputs = iter(zip(saved_inputs, self.requires_grad)), []
        for is_tensor, arg in zip(self.is_tensor, self.non_tensors):
            if is_tensor:
                t, requires_grad = next(saved)
                arg = t.detach().requires_grad_(requires_grad)
            inputs.append(arg)
        outer_rng = rng_state(self.device)
        set_rng_state(self.rng, self.device)
        try:
            with torch.enable_grad(), _recomputing(), _autocast(self.autocast), self.around_rerun, \
                    torch.autograd.graph.saved_tensors_hooks(self.file, _never_unpacked):
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
    """The unit's outputs as a node of their own: its backward re-runs the unit (Unit.rerun) from
    the inputs it saved, then hands the outputs' gradients on, unchanged, to the unit's last
    nodes. The inputs come in detached: they are saved here, but no gradient flows to them
    through this node (the unit's own nodes carry those)."""

    @staticmethod
    def forward(ctx, unit, n_outputs, *outputs_and_inputs):
        outputs, inputs = outputs_and_inputs[:n_outputs], outputs_and_inputs[n_outputs:]
        ctx.unit, ctx.n_inputs = unit, len(inputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        ctx.save_for_backward(*inputs)  # the only activations the unit keeps
        # an output must be a new tensor for this node to own it: a view costs nothing (but, made
        # inside a Function, may not be changed in place)
        views = tuple(t.view_as(t) for t in outputs)
        ctx.mark_non_differentiable(*(v for v, t in zip(views, outputs) if not t.requires_grad))
        return views

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.rerun(ctx.saved_tensors)  # saved_tensors unpacks (an outer unit's slots): read once
        return (None, None, *grads) + (None,) * ctx.n_inputs


def rerun_stops_early(cfg, recipe):
    """Whether a unit's re-run may stop after the last tensor the unit saves (Unit.file): not under
    Transformer Engine (precision.Recipe.rerun_stops_early says why) nor FSDP. Our re-run runs
    before FSDP2's pre-backward hook, so FSDP takes it for a forward, and a stop inside a block
    would leave that forward unfinished (its post-forward hook never runs). torch 2.13 tidies
    that up at the end of backward (tests/test_fsdp.py passes either way, two steps), but FSDP2
    from torch 2.6 on is not tested here, so we do not lean on it."""
    return recipe.rerun_stops_early and cfg.shard != "fsdp"


def torch_recompute(fn, *args, contexts=None, stop_early=True):
    """PyTorch's own recompute, torch.utils.checkpoint (non-reentrant), called like `recompute`:
    the reference the tests hold ours to, and `make bench`'s reference row (apply_policy's
    recompute_fn). contexts: its context_fn; stop_early: its set_checkpoint_early_stop."""
    kw = dict(context_fn=contexts) if contexts else {}
    with torch.utils.checkpoint.set_checkpoint_early_stop(stop_early):
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

    def own_cores(self, n_layer):
        """core_units but those inside a block unit, which re-run with their block already: the
        cores that are units of their own (what apply_policy, the FLOPs and the ledger count)."""
        in_units = {i for unit in self.block_units(n_layer) for i in unit}
        return [i for i in self.core_units(n_layer) if i not in in_units]

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


def apply_policy(model, policy, contexts=None, recompute_fn=recompute, stop_early=True):
    """Set model.block_runner and each attention's core_runner for `policy` (a Policy).
    contexts: what the precision needs around a unit of blocks, called with the unit's blocks
    at its forward (precision.Recipe.recompute_contexts, given by train.build); a core holds no
    Linear and needs none (with Transformer Engine: no TE module inside, nothing to re-enter).
    recompute_fn: ours, or torch_recompute for the reference. stop_early: whether a re-run may
    stop after the last tensor its unit saves (rerun_stops_early)."""
    recompute_fn = functools.partial(recompute_fn, stop_early=stop_early)
    n = len(model.h)
    units = _checked_units(policy.block_units(n), n)
    cores = set(policy.own_cores(n))
    model.block_runner = _unit_runner(units, contexts, recompute_fn) if units else run_blocks_in_order
    for i, block in enumerate(model.h):
        block.attn.core_runner = recompute_fn if i in cores else run_directly  # q, k, v: the core's inputs
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


def recompute_flops_per_token(model, policy, stop_early=True):
    """Forward FLOPs per token that recomputation adds: counted in HFU, not in MFU.

    A recomputed block runs its forward once more: 2 FLOPs (a multiply and an add) per
    matmul weight per token, plus the attention core's QK^T and @V, 2 x 2*s*h per token;
    a recomputed core alone, the core's. But a re-run stops once it has made the last tensor
    the unit's nodes saved (Unit.file), and an op saves its inputs before it runs: a core's
    last op, att @ v, is not re-run, nor is a unit's last block's MLP projection where nothing
    after it saves (no dropout; a plain nn.Linear: fp8's Function saves after it has run).
    Biases and LayerNorms are elementwise work, not counted (nor does FlopCounterMode count
    them; the tests hold this function to its count). (sqrt re-runs every block as full
    does: it keeps fewer inputs, not fewer re-runs.) stop_early: as apply_policy's.
    """
    c, n = model.cfg, len(model.h)
    core = 4 * c.block_size * c.n_embd
    units = policy.block_units(n)
    in_units = {i for unit in units for i in unit}
    cores = policy.own_cores(n)
    matmuls = lambda block: 2 * sum(p.numel() for p in block.parameters() if p.dim() >= 2)  # noqa: E731
    last = [model.h[unit[-1]].mlp.c_proj for unit in units]
    if not stop_early:
        return sum(matmuls(model.h[i]) + core for i in in_units) + core * len(cores)
    skipped = sum(2 * proj.weight.numel() for proj in last if type(proj) is torch.nn.Linear and not c.dropout)
    return sum(matmuls(model.h[i]) + core for i in in_units) - skipped + core // 2 * len(cores)
