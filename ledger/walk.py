"""The ledger's engine: a description of the model, run op by op, holding memory as PyTorch does.

Chapter sections 3 and 4 (what recomputation keeps; the ledger's peak). Read
memory_ledger.py first: its `block` says, op by op, what one block of model.py makes and
saves, in the ops of ledger/ops.py. This file runs such a description the way PyTorch
runs the code it describes:

  a Storage is memory, alive while anything refers to it: a Tensor handle (a variable of
    the description, living as long as its twin in model.py), a Node that saved it, or
    the engine's gradient buffers. It is freed the moment the last of them lets go, as
    CPython and autograd free a torch storage;
  an op's outputs are allocated while its inputs are still alive: every allocation is a
    point of the walk, a candidate for the peak;
  with grad enabled an op records a Node that keeps what the op saves. `backward` visits
    the Nodes in the autograd engine's order (of those ready, the newest first): a Node's
    rule allocates its inputs' gradients, then the Node lets go of what it saved and of
    the gradient it consumed; a tensor used twice sums its two gradients into a new one;
  a recompute unit (checkpoint.recompute) keeps only its inputs: its forward records its
    Nodes as usual but they save slot numbers, not storages; in backward the unit's output
    Node (checkpoint.RerunNode) runs it again, filing what each Node saves under its slot, and
    stops after the last one; each Node takes its own back when it runs.

Kinds of bytes, for the breakdown at the peak: a storage some Node saved is an activation;
else a kept FP8 weight copy; else a parameter's .grad; else in flight.
"""
import heapq
from contextlib import contextmanager

SAVED, GRAD, FLIGHT, KEPT = "activations", "parameter gradients", "in flight", "FP8 weights kept for the step"


class Entry:
    """The walk's book entry for one live storage. saved: how many Nodes hold it; term: its
    name as a saved activation, scope: where it was first saved (a block's index, or
    "embedding", "head", "units"); region: made inside a tensor-parallel region (split over
    t ranks under TP); role: what kept it (ops.NORM: a normalization layer); dtype: torch's name
    of its dtype ("bfloat16", "float32", "int64", ...)."""
    __slots__ = ("name", "label", "nbytes", "saved", "kept", "grad", "term", "scope", "region", "role", "point",
                 "dtype")

    def __init__(self, prefix, label, nbytes, region=False, grad=False, dtype=None):
        self.name, self.label, self.nbytes, self.region, self.grad = prefix + label, label, nbytes, region, grad
        self.dtype = dtype
        self.saved, self.kept, self.term, self.scope, self.role = 0, False, None, None, None
        self.point = None  # the walk's point where it was allocated

    @property
    def kind(self):
        return SAVED if self.saved else KEPT if self.kept else GRAD if self.grad else FLIGHT


class Storage:
    """Memory, freed by the walk when CPython frees this object: when nothing refers to it."""
    __slots__ = ("entry", "walk")

    def __init__(self, walk, entry):
        self.walk, self.entry = walk, entry

    def __del__(self):
        self.walk.free(self.entry)


class Tensor:
    """A handle on a storage, as a torch.Tensor is: views share one. nbytes is the tensor's
    own (a view of a third of a storage has a third of its bytes); layout is how ops see its
    strides ("rows", or "heads": a (B, a, T, d) view of a (B, T, a*d) tensor, "head-major":
    a contiguous (B, a, T, d), "sdpa": sdpa's (B, T, a, d) output seen as (B, a, T, d));
    node/index: the op output it is, for its gradient (None: no gradient flows to it)."""
    __slots__ = ("storage", "nbytes", "layout", "node", "index")

    def __init__(self, storage, nbytes=None, layout="rows", node=None, index=0):
        self.storage, self.layout, self.node, self.index = storage, layout, node, index
        self.nbytes = storage.entry.nbytes if nbytes is None else nbytes

    @property
    def region(self):
        return self.storage.entry.region

    @property
    def dtype(self):
        return self.storage.entry.dtype

    def view(self, nbytes=None, layout=None):
        """Another handle on the same storage (a view: no memory), with no gradient edge."""
        return Tensor(self.storage, self.nbytes if nbytes is None else nbytes, layout or self.layout)


class Node:
    """What autograd records for one op: the edges to its inputs' producers, what it saved
    (Storages), and the rule its backward follows: rule(g, node, grads) -> input gradients,
    run with the names (prefix) and scope the op ran with. A rule may let go of an incoming
    gradient early (grads[i] = None) where PyTorch's own nodes would."""
    __slots__ = ("name", "prefix", "scope", "seq", "inputs", "saved", "slots", "rule", "n_outputs", "ctx")

    def __init__(self, name, prefix, scope, seq, inputs, rule, n_outputs, ctx):
        self.name, self.prefix, self.scope, self.seq = name, prefix, scope, seq
        self.inputs, self.rule, self.n_outputs, self.ctx = inputs, rule, n_outputs, ctx
        self.saved = []
        self.slots = []  # inside a recompute unit: (unit, slot) of each tensor it saved, filled by the re-run

    def release(self):
        """release_variables: let go of everything saved (what nothing else holds is freed)."""
        for storage in self.saved:
            storage.entry.saved -= 1
        self.saved = []

    def __lt__(self, other):  # the engine's ready queue: the newest node first
        return self.seq > other.seq


class Walk:
    """The bytes alive over a step. `static` bytes (states, buffers, the batch) are alive
    throughout; every allocation adds a point (steps: where, totals: bytes alive), and the
    peak keeps where it was and what was alive there, by kind. ZeRO-3 over `shard` ranks
    keeps 1/shard of every parameter gradient."""

    def __init__(self, static, shard=1):
        self.static, self.shard = static, shard
        self.tag = ""  # named before every point's place: which micro-step (ledger/step.py)
        self.total, self.totals, self.steps = static, [], []
        self.peak, self.where, self.parts = static, "start", {}
        self.peak_count = 0  # storages alive at the peak (the static bytes' not among them)
        self.live = {}  # id(entry) -> entry
        self._peaks = []  # (point, the peak before it): what `undo` restores

    track_parts = True  # what is alive at the peak, by kind: half a walk's time (ledger/plan.py reads points only)

    def allocate(self, where, entries):
        for entry in entries:
            if entry.grad:
                entry.nbytes //= self.shard
            entry.point = len(self.totals)
            self.live[id(entry)] = entry
            self.total += entry.nbytes
        self.mark(where)

    def mark(self, where):
        """A point of the walk: the bytes alive now, and a new peak if it is one."""
        where = self.tag + where
        self.totals.append(self.total)
        self.steps.append(where)
        if self.total > self.peak:
            self._peaks.append((len(self.totals) - 1, self.peak, self.where, self.parts, self.peak_count))
            self.peak, self.where, self.parts, self.peak_count = self.total, where, {}, len(self.live)
            for entry in self.live.values() if self.track_parts else ():
                self.parts[entry.kind] = self.parts.get(entry.kind, 0) + entry.nbytes

    def undo(self, point):
        """Take back the points from `point` on: allocations an op never made (a re-run stopped
        before it ran). Their storages are freed as the walk's handles on them go."""
        del self.totals[point:], self.steps[point:]
        while self._peaks and self._peaks[-1][0] >= point:
            _, self.peak, self.where, self.parts, self.peak_count = self._peaks.pop()

    def free(self, entry):
        if self.live.pop(id(entry), None) is not None:
            self.total -= entry.nbytes

    def alive(self, kind=None):
        """{name: bytes} of the live storages (of one kind)."""
        return {e.name: e.nbytes for e in self.live.values() if kind is None or e.kind == kind}


class Graph:
    """The engine the description runs on (ledger/ops.py adds the ops). `sizes` is what the ops
    need to know of the run (ops.Sizes); `plan` which units a recompute policy makes
    (ledger/step.py). `declared` gathers what the ops hold, by kind ("param", "buffer",
    "fp8 weight", "tied": a parameter another op owns): {name: {numel, scope, ...}}; `grads`
    holds each parameter's .grad; `kept` the
    FP8 weight copies kept for the step (fp8_ops.py); `accumulating`: a micro-step after the first."""

    def __init__(self, walk, sizes):
        self.walk, self.sizes = walk, sizes
        self.grad_enabled, self.seq, self.prefix, self.scope, self.plan = True, 0, "", None, None
        self.path = ""  # the block's submodule running now (module)
        self.role = None  # what the tensors saved now are kept by (ops.NORM inside a norm)
        self.running_unit = None  # the recompute unit running now: its forward or, once it has `recomputed`, its re-run
        self.declared, self.grads, self.kept = {"param": {}, "buffer": {}, "fp8 weight": {}, "tied": {}}, {}, {}
        self.accumulating, self.pending = False, {}  # a later micro-step: .grad is there, added into in place

    # ---------------------------------------------------------------- memory

    def alloc(self, where, *parts, region=False, layout="rows", dtype=None):
        """Allocate one storage per (name, bytes) part, or (name, bytes, dtype), at one point; returns
        their Tensors. dtype: theirs, by torch's name (None: the activations', sizes.dtype)."""
        default = self.sizes.dtype if self.sizes else None  # a walk of the optimizer step alone has no sizes
        entries = [Entry(self.prefix, name, nbytes, region, dtype=(own or [dtype])[0] or default)
                   for name, nbytes, *own in parts]
        self.walk.allocate(self.prefix + where, entries)
        return [Tensor(Storage(self.walk, e), layout=layout) for e in entries]

    def new(self, where, name, nbytes, region=False, layout="rows", role=None, dtype=None):
        """One storage at its own point."""
        t, = self.alloc(where, (name, nbytes), region=region, layout=layout, dtype=dtype)
        t.storage.entry.role = role
        return t

    def mark(self, where):
        self.walk.mark(self.prefix + where)

    def declare(self, kind, name, numel, **info):
        """Something an op holds ("param", "buffer", "fp8 weight": bytes for buffers, elements
        otherwise), counted once however often the op runs. info: for a parameter, whether it
        is a matrix (AdamW decays those) and whether TP splits it (split)."""
        self.declared[kind].setdefault(self.prefix + name, dict(numel=numel, scope=self.scope, **info))

    def keep(self, name, **tensors):
        """FP8 weight copies kept from this forward to the optimizer step (fp8_refined.FP8Linear.weight_copy)."""
        copy = self.kept.setdefault(self.prefix + name, {})
        for key, t in tensors.items():
            t.storage.entry.kept = True
            copy[key] = t

    # ---------------------------------------------------------------- autograd

    def record(self, name, inputs, outputs, rule, saved=(), packs_after=False, **ctx):
        """Make the op's Node (grad enabled only): edges to `inputs`' producers, `outputs` made
        its own, `saved` [(tensor, term name)] held. Returns the Node, or None without grad.
        Inside a recompute unit the Node keeps slots instead (`_save_in_unit`); packs_after: the
        op is a custom autograd Function, which saves once its forward has returned (fp8's)."""
        if not self.grad_enabled:
            return None
        self.seq += 1
        node = Node(name, self.prefix, self.scope, self.seq, [(t.node, t.index) if t.node else None for t in inputs],
                    rule, len(outputs), ctx)
        for i, t in enumerate(outputs):
            t.node, t.index = node, i
        if self.running_unit is not None:
            self._save_in_unit(node, outputs, saved, packs_after)
            return node
        for t, term in saved:
            self.save(node, t, term)
        return node

    def save(self, node, tensor, term):
        """node keeps tensor's storage. Its term: what the op calls it, or the storage's own name
        where the op saves a view of part of it (q, k and v of c_attn's output); None: something
        kept for the step anyway (an FP8 weight copy's scales), not an activation: not held here,
        though a recompute unit gives it a slot as PyTorch does."""
        if term is None:
            return
        self._name(tensor, term)
        tensor.storage.entry.saved += 1
        node.saved.append(tensor.storage)

    def _name(self, tensor, term):
        entry = tensor.storage.entry
        if entry.term is None and term is not None:
            entry.term, entry.scope = term if tensor.nbytes == entry.nbytes else entry.label, self.scope
            entry.role = entry.role or self.role

    def _save_in_unit(self, node, outputs, saved, packs_after):
        """What checkpoint.Unit does with what an op of a unit saves. In the forward (Unit.pack_forward)
        the node keeps a slot number. In the re-run (Unit.pack_rerun) the unit keeps the storage under
        the next slot, and after the last one the re-run stops: autograd saves an op's inputs
        before the op runs (its outputs after it: a tensor allocated with the outputs or later),
        so a stop at an input means the op's outputs were never made (`Walk.undo`). A custom
        Function (packs_after) saves everything after its forward. A saved tensor with term None
        (kept for the step anyway) takes a slot and holds nothing. (The walk gives slots to the
        tensors it models; PyTorch packs parameters too. Only where the last slot falls matters,
        and for every op a unit of this model can end with, it falls on the same side of it.)"""
        unit = self.running_unit
        made = min((t.storage.entry.point for t in outputs), default=None)
        made_here = lambda t: made is not None and t.storage.entry.point >= made  # noqa: E731
        order = sorted(saved, key=lambda pair: made_here(pair[0])) if not packs_after else list(saved)
        for tensor, term in order:
            if unit.recomputed is None:  # the forward
                node.slots.append((unit, unit.n_saved))
                unit.n_saved += 1
                continue
            if term is None:
                unit.recomputed[len(unit.recomputed)] = None
            else:
                self._name(tensor, term)
                tensor.storage.entry.saved += 1
                unit.recomputed[len(unit.recomputed)] = tensor.storage
            if len(unit.recomputed) == unit.n_saved and self.sizes.rerun_stops_early:
                if not packs_after and not made_here(tensor) and made is not None:
                    self.walk.undo(made)
                raise _Enough

    def unit(self, name, fn, *args, term, scope):
        """checkpoint.recompute around fn(*args): fn runs with grad, its Nodes keeping slots, not
        storages; then the unit's output Node (checkpoint.RerunNode) keeps only its tensor arguments
        and, in backward, re-runs fn (_rerun). Without grad (evaluation) it is just fn(*args)."""
        if not self.grad_enabled:
            return fn(*args)
        unit = _Unit()
        previous, self.running_unit = self.running_unit, unit
        try:
            out = fn(*args)
        finally:
            self.running_unit = previous
        previous, self.scope = self.scope, scope
        view = out.view()
        self.record(name, [out], [view], _rerun, saved=[(t, term) for t in args], packs_after=True, fn=fn,
                    unit=unit, specs=[(t.nbytes, t.layout) for t in args])
        self.scope = previous
        return view

    def module(self, path, fn, *args):
        """A block's submodule `path`, described by fn(g, *args): as it is, or a recompute unit where the
        policy makes this block's `path` one (checkpoint.apply_policy's submodule units)."""
        previous, self.path = self.path, path
        try:
            if self.plan is not None and (self.scope, path) in self.plan.submodule_units:
                return self.unit(path, lambda *a: fn(self, *a), *args, term="recompute inputs", scope=self.scope)
            return fn(self, *args)
        finally:
            self.path = previous

    def no_grad(self):
        return self._grad_mode(False)

    def enable_grad(self):
        return self._grad_mode(True)

    @contextmanager
    def _grad_mode(self, enabled):
        previous, self.grad_enabled = self.grad_enabled, enabled
        try:
            yield
        finally:
            self.grad_enabled = previous

    @contextmanager
    def kept_by(self, role):
        """Tensors saved inside are kept by `role` (ops.NORM: a normalization layer's)."""
        previous, self.role = self.role, role
        try:
            yield
        finally:
            self.role = previous

    @contextmanager
    def within(self, prefix, scope):
        """Names of points and terms inside one block ("3."), and the scope its terms go to."""
        previous = self.prefix, self.scope
        self.prefix, self.scope = prefix, scope
        try:
            yield
        finally:
            self.prefix, self.scope = previous

    def param_grad(self, where, param, nbytes, made=None):
        """AccumulateGrad for `param` (nbytes: its gradient's): a gradient allocated right here
        as .grad, or one made in flight already (made: [it], handed over); where .grad holds
        one, the two are summed into a new .grad and both go. In a later micro-step (`accumulating`:
        .grad holds the earlier ones' sum) AccumulateGrad adds into .grad in place and the gradient
        goes; a tied parameter's first gradient waits in the engine's buffer for its second."""
        name = self.prefix + param
        tensor = made.pop() if made else self._grad(where, param + " grad", nbytes)
        first = self.pending.pop(name, None)
        old = first if first is not None else None if self.accumulating else self.grads.pop(name, None)
        if old is not None:
            total = self._grad(param + " gradient accumulated", param + " grad (sum)", nbytes)
            del old, tensor
            tensor = total
        if self.accumulating:
            if first is None and name in self.declared["tied"]:
                self.pending[name] = tensor
            return  # .grad += tensor: nothing new stays
        tensor.storage.entry.grad = True
        self.grads[name] = tensor

    def _grad(self, where, label, nbytes):
        entry = Entry(self.prefix, label, nbytes, grad=True)
        self.walk.allocate(self.prefix + where, [entry])
        return Tensor(Storage(self.walk, entry))

    def backward(self, roots):
        """Run backward from [(tensor, its gradient)] through the recorded Nodes."""
        deps, stack, seen = {}, [t.node for t, _ in roots], set()
        while stack:  # how many edges point at each node: it runs when all have delivered
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            for edge in node.inputs:
                if edge is not None:
                    deps[id(edge[0])] = deps.get(id(edge[0]), 0) + 1
                    stack.append(edge[0])
        buffers, ready = {}, []
        for t, grad in roots:
            self._deliver(buffers, (t.node, t.index), grad)
            ready.append(t.node)
        del t, grad  # the caller holds the roots' gradients for as long as backward runs
        heapq.heapify(ready)
        while ready:
            node = heapq.heappop(ready)
            grads = buffers.pop(id(node), None) or [None] * node.n_outputs
            if node.slots:  # a Node of a recompute unit: what it saved, from the re-run (Unit.unpack)
                node.saved = [s for s in (unit.recomputed.pop(slot) for unit, slot in node.slots) if s is not None]
            with self.within(node.prefix, node.scope):
                outs = node.rule(self, node, grads)
            del grads  # the gradient this node consumed goes (unless its rule passed it on)
            node.release()
            for i, edge in enumerate(node.inputs):
                if edge is None:
                    continue
                if outs[i] is not None:
                    self._deliver(buffers, edge, outs[i])
                deps[id(edge[0])] -= 1
                if deps[id(edge[0])] == 0:
                    heapq.heappush(ready, edge[0])
            del outs

    def _deliver(self, buffers, edge, grad):
        node, index = edge
        slots = buffers.setdefault(id(node), [None] * node.n_outputs)
        if slots[index] is None:
            slots[index] = grad
            return
        # a second gradient for one tensor: old + new into a new tensor, and both go
        entry = Entry(node.prefix, node.name + " gradient sum", grad.nbytes, grad.region)
        self.walk.allocate(node.prefix + node.name + " gradients add", [entry])
        slots[index] = Tensor(Storage(self.walk, entry), layout=grad.layout)


class _Unit:
    """checkpoint.Unit as the walk keeps it: slots handed out, and the storages the re-run filed."""

    def __init__(self):
        self.n_saved, self.recomputed = 0, None  # recomputed: {} from the re-run on


class _Enough(Exception):
    """checkpoint._Enough: the re-run has filed every slot."""


def _rerun(g, node, grads):
    """checkpoint.RerunNode.backward: fn run again on the saved inputs (handles on their storages: no
    memory) with grad, its saves filed in the unit (FP8 reuses the kept weight copies), stopped
    after the last (what it made and nobody saved goes as the re-run ends); then the incoming
    gradient handed on unchanged. The inputs go when the node releases them, unless the re-run
    saved them again."""
    unit = node.ctx["unit"]
    unit.recomputed = {}
    if unit.n_saved:
        previous, g.running_unit = g.running_unit, unit
        try:
            with g.enable_grad():
                node.ctx["fn"](*[Tensor(storage, nbytes, layout) for storage, (nbytes, layout)
                                 in zip(node.saved, node.ctx["specs"])])
        except _Enough:
            pass
        finally:
            g.running_unit = previous
    return [grads[0]]
