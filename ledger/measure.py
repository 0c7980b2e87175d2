"""The census: the bytes of one training step, counted from its tensors, real or fake.

Chapter section 4. Read first: `SavedBytes` (what autograd keeps for backward, and who kept it), then
`LiveTensors` (every storage alive, op by op, like CUDA's memory_allocated), then `measure`, which runs
accumulate.accumulation_step itself and reads memory at each of its phases (`phases`). The same census
counts a real step (`make ledger`'s measured column) and a fake one (ledger/trace.py: the traced column).
On CUDA the live bytes are the caching allocator's own counters (CudaAllocator).
"""
import weakref
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import accumulate
import checkpoint
import memory_ledger


def local(t):
    """This rank's part of `t`: a DTensor's local shard (its attribute: `to_local()` is an autograd op)."""
    return getattr(t, "_local_tensor", t)


def storage_key(t):
    return StorageWeakRef(local(t).untyped_storage()).cdata


def storage_ids(tensors):
    return {storage_key(t) for t in tensors if t is not None}


def storage_bytes(tensors, device=None, exclude=()):
    """Bytes of the distinct storages behind `tensors` (on `device`), skipping ids in `exclude`."""
    kind = None if device is None else torch.device(device).type
    sizes = {storage_key(t): local(t).untyped_storage().nbytes() for t in tensors
             if t is not None and kind in (None, t.device.type) and storage_key(t) not in exclude}
    return sum(sizes.values())


@dataclass
class SavedTensor:
    """A storage autograd saved: its bytes, shape and dtype, the modules running then, what holds it."""
    nbytes: int
    shape: tuple
    dtype: str
    modules: tuple = ()
    inputs: tuple = ()  # (node, which of its saved tensors, "softmax" if made from one): ("MmBackward0", "self", "")


class _Held:
    """A saved tensor as autograd holds it: one object per slot, whose death says the slot let go."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedBytes:
    """Count the bytes autograd saves for backward, by storage, while the context is open: a storage once
    however many views of it are saved, none of the `static` ones (parameters, buffers, optimizer states: a
    saved view of the causal mask costs nothing). `total` adds a storage as it starts being held, `live`
    follows what saved-tensor slots still hold, `peak` is the most `live` was. A recompute unit's re-run
    (checkpoint.Unit.pack_rerun) counts too, until its node takes what it kept (Unit.unpack)."""

    def __init__(self, static=(), where=None):
        self.static = storage_ids(static)
        self.where = where  # None, or a callable naming the module running now (ModulePath)
        self.total = self.live = self.peak = 0
        self.found = {}  # storage key -> SavedTensor, for each storage counted in `total`
        self._holders = {}  # storage key -> how many saved-tensor slots hold it
        self._units = {}  # (id of a checkpoint.Unit, slot) -> what _pack made of what it keeps there

    def _pack(self, t):
        key, nbytes = storage_key(t), t.untyped_storage().nbytes()
        if key in self.static or nbytes == 0:
            return t
        if self._holders.get(key, 0) == 0:
            self.total, self.live = self.total + nbytes, self.live + nbytes
            self.peak = max(self.peak, self.live)
            if key not in self.found:
                self.found[key] = SavedTensor(nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        if self.where and (module := self.where()) not in self.found[key].modules:
            self.found[key].modules += (module,)
        self._holders[key] = self._holders.get(key, 0) + 1
        held = _Held(t)  # keeps the storage alive (so its key stays unique) until autograd drops it
        weakref.finalize(held, self._release, key, nbytes)
        return held

    def _release(self, key, nbytes):
        self._holders[key] -= 1
        if self._holders[key] == 0:
            self.live -= nbytes

    def __enter__(self):
        unpack = lambda held: held.t if isinstance(held, _Held) else held  # noqa: E731
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)
        self._hooks.__enter__()
        file, take, units = checkpoint.Unit.pack_rerun, checkpoint.Unit.unpack, self._units

        def counted_file(unit, tensor):
            # detached, as the unit keeps it: the re-run's graph would hold the re-run's inputs
            units[id(unit), len(unit.recomputed)] = self._pack(tensor.detach())
            return file(unit, tensor)

        def counted_take(unit, slot):
            units.pop((id(unit), slot), None)
            return take(unit, slot)
        self._unit_methods = file, take
        checkpoint.Unit.pack_rerun, checkpoint.Unit.unpack = counted_file, counted_take
        return self

    def __exit__(self, *exc):
        checkpoint.Unit.pack_rerun, checkpoint.Unit.unpack = self._unit_methods
        self._hooks.__exit__(*exc)


class ModulePath:
    """The path of the innermost module running now, by forward hooks on every module (`skip`: not these)."""

    def __init__(self, model, skip=lambda name: False):
        self.stack, self.handles = [], []
        for name, module in model.named_modules():
            if not skip(name):  # (a forward hook that returns something replaces the output: these return None)
                self.handles += [module.register_forward_pre_hook(lambda m, args, name=name: self.stack.append(name)),
                                 module.register_forward_hook(lambda m, args, out: [self.stack.pop()] and None)]

    def __call__(self):
        return self.stack[-1] if self.stack else ""

    def remove(self):
        for handle in self.handles:
            handle.remove()


_SAVED_ATTRS = {}  # autograd node class -> its `_saved_*` attributes


def saving_nodes(loss, found):
    """Fill in each SavedTensor.inputs of `found`: the nodes of loss's graph that hold its storage, which of
    their saved tensors it is, and "softmax" for a matmul's input made from one (the attention weights: so
    memory_ledger tells it from q and k). Returns the host bytes of the RNG states the recompute units hold."""
    names, seen, stack, rng_states = {}, set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        held = []  # (which, tensor)
        if type(node) not in _SAVED_ATTRS:  # (dir() of every node was half a small trace's time)
            _SAVED_ATTRS[type(node)] = [attr for attr in dir(node) if attr.startswith("_saved_")]
        for attr in _SAVED_ATTRS[type(node)]:
            try:
                value = getattr(node, attr)
            except RuntimeError:  # released already, or not a tensor torch will hand out
                continue
            held += [(attr[len("_saved_"):], v) for v in (value if isinstance(value, (list, tuple)) else [value])]
        try:
            held += [(str(i), t) for i, t in enumerate(getattr(node, "saved_tensors", ()))]
        except RuntimeError:  # a node inside a recompute unit: it holds nothing until the re-run
            pass
        # checkpoint.Unit.rng: RerunNode's ctx is the node, NaiveRecompute's keeps it itself
        rng = node.unit.rng if isinstance(node, checkpoint.RerunNode._backward_cls) else \
            node.rng if isinstance(node, checkpoint.NaiveRecompute._backward_cls) else {}
        rng_states.update({storage_key(t): t.untyped_storage().nbytes() for t in rng.values()})
        name = type(node).__name__
        for which, t in held:
            if torch.is_tensor(t) and storage_key(t) in found:
                index = {"self": 0, "mat2": 1}.get(which) if name == "BmmBackward0" else None
                came = "softmax" if index is not None and _from_softmax(node.next_functions[index][0]) else ""
                names.setdefault(storage_key(t), set()).add((name, which, came))
        stack.extend(fn for fn, _ in node.next_functions)
    for key, saved in found.items():
        saved.inputs = tuple(sorted(names.get(key, ())))
    return sum(rng_states.values())


def _from_softmax(node, depth=8):
    """Whether `node`'s output was made from a softmax's within `depth` nodes, not through a matmul."""
    if node is None or depth == 0:
        return False
    if (name := type(node).__name__) in memory_ledger.SOFTMAX:
        return True
    if "mm" in name.lower() or "Linear" in name or "Rerun" in name:
        return False
    return any(_from_softmax(fn, depth - 1) for fn, _ in node.next_functions)


class LiveTensors(TorchDispatchMode):
    """Counts the bytes of distinct live storages on one device, op by op, like CUDA's memory_allocated:
    each op's outputs are registered by storage, dropped when a finalizer says the storage died."""

    def __init__(self, device, timeline=False, outputs=None):
        super().__init__()
        self.outputs = outputs  # None, or (op, args, kwargs, its outputs) -> the outputs to count (ledger/trace.py)
        self.device, self.live, self.dead = torch.device(device), {}, []  # live: storage id -> bytes; dead: ids
        self.now = self.peak = self.large = 0  # the bytes in `live`, kept as a running sum; large: those over 1 MiB
        self.phase = self.peak_phase = "start"
        # timeline: each op that allocated, as ((phases begun, phase, `marks`' block), op, bytes, storages, large)
        self.points, self.phases, self.where = ([] if timeline else None), 0, None

    def adopt(self, tensors):  # start counting storages made before the tracker was switched on
        for t in tensors:
            self._add(t)

    def _add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != self.device.type:
            return
        try:
            st = local(t).untyped_storage()  # a DTensor's own storage is its whole size: its shard is what it holds
        except (RuntimeError, NotImplementedError):
            return
        self._drop_dead()  # a dead storage's id may be a new one's now
        key = StorageWeakRef(st).cdata
        if key not in self.live:
            self._grew(key, self.live.setdefault(key, st.nbytes()), 1)
            weakref.finalize(st, self.dead.append, key)  # torch keeps a storage's Python object while it lives

    def _drop_dead(self):
        while self.dead:
            if (key := self.dead.pop()) in self.live:
                self._grew(key, self.live.pop(key), -1)

    def _grew(self, key, nbytes, sign):  # the running sums as storage `key` comes (sign 1) or goes (-1)
        self.now, self.large = self.now + sign * nbytes, self.large + sign * (nbytes > SMALL_SIZE)

    def _counted(self, op=None, grew=False):
        """The peak so far, and a point of the timeline where an op grew the live bytes."""
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
        if self.points is not None and grew:
            self.points.append(((self.phases, self.phase, self.where), op, self.now, len(self.live), self.large))

    def read(self):
        self._drop_dead()
        self._counted()
        return self.now

    def start_phase(self, name):
        self.phase, self.phases, self.where = name, self.phases + 1, None

    def reset_peak(self):
        self.peak, self.peak_phase = self.read(), self.phase

    def __enter__(self):
        # FSDP frees a gathered block's memory and takes it back by resizing its storage (_fsdp_param.py,
        # free_storage/alloc_storage), which no op dispatches: the storage's bytes are followed here
        self._resize, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage, size):
            out = tracker._resize(storage, size)
            tracker._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _resized(self, st):
        if (key := StorageWeakRef(st).cdata) in self.live:
            old, new = self.live[key], st.nbytes()
            self._grew(key, old, -1)
            self.live[key] = new
            self._grew(key, new, 1)
            self._counted("resize_", new > old)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:  # C++ asking a fake tensor its device (half the calls): no op
            return args[0].device  # (answered here, not by every mode below: a trace ~8% faster)
        out = func(*args, **(kwargs or {}))
        if self.outputs is not None:
            out = self.outputs(func, args, kwargs, out)
        self._drop_dead()  # what the op's inputs' owners let go of, before its outputs count
        before = self.now
        for t in tree_leaves(out):
            self._add(t)
        self._counted(func.__name__, self.now > before)
        return out


class CudaAllocator:
    """LiveTensors' interface on CUDA: the caching allocator's counters, its peak statistics reset at each
    phase (the tools run it in a process of their own). They count allocator blocks and kernels' scratch,
    not storages: only this figure gets a slack (`allocator_bounds`); the components are storages here too."""

    def __init__(self, device):
        self.device, self.phase, self.peak_phase, self.peak = torch.device(device), "start", "start", 0

    def adopt(self, tensors):  # the allocator counts everything already
        pass

    def _fold(self):
        torch.cuda.synchronize(self.device)
        high = torch.cuda.max_memory_allocated(self.device)
        if high > self.peak:
            self.peak, self.peak_phase = high, self.phase

    def read(self):
        self._fold()
        return torch.cuda.memory_allocated(self.device)

    def start_phase(self, name):
        self._fold()
        self.phase = name
        torch.cuda.reset_peak_memory_stats(self.device)

    def reset_peak(self):
        self.start_phase(self.phase)  # (synchronizes, and resets the peak statistics)
        self.peak, self.peak_phase = torch.cuda.memory_allocated(self.device), self.phase

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# c10/cuda/CUDACachingAllocator.cpp: round_size rounds a request up to kMinBlockSize (512 bytes); up to
# kSmallSize (1 MiB) a small-pool block is split to that size (should_split); a larger request may take a
# cached large-pool block up to 1 MiB larger, unsplit, counted whole (malloc adds block->size)
MIN_BLOCK, SMALL_SIZE = 512, 2 ** 20


def allocator_bounds(sizes):
    """(least, most) bytes CUDA's memory_allocated counts for live storages of these byte sizes."""
    blocks = [MIN_BLOCK * max(1, -(-n // MIN_BLOCK)) for n in sizes if n > 0]
    return sum(blocks), sum(blocks) + SMALL_SIZE * sum(b > SMALL_SIZE for b in blocks)


def kept_copies(fp8_layers):
    """The tensors of the FP8 weight copies the layers keep now (fp8_refined.WeightCopy)."""
    copies = [m.weight_copy for m in fp8_layers if getattr(m, "weight_copy", None) is not None]
    return [t for c in copies for t in (c.data, c.column_major, c.scale, c.amax) if t is not None]


def resident(model, parts):
    """What a step finds alive and leaves alive: parameters, buffers, the master copy, AdamW's states."""
    opt = parts.optimizer
    return list(model.parameters()) + list(model.buffers()) + opt.master_params + opt.state_tensors()


def random_batch(cfg, device, b=None):
    """A seeded (x, y) of random bytes, b sequences of cfg.block_size, each in a storage of its own
    (cloned: for one sequence .contiguous() would leave both views of one storage)."""
    g = torch.Generator().manual_seed(cfg.seed)
    xy = torch.randint(0, 256, (b or cfg.batch_size, cfg.block_size + 1), generator=g)
    return xy[:, :-1].clone().to(device), xy[:, 1:].clone().to(device)


@contextmanager
def phases(model, parts, observe):
    """Call observe(name, ...) as each phase of accumulate.accumulation_step begins: "forward" (each micro-
    step's), "backward" (given the weighted loss), "gradients" (after it), "step" (the optimizer's)."""
    # FP16's backward is its scaler's (loss x scale); BF16's and FP32's the loss's own, Tensor.backward
    scaler, opt, owner = parts.scaler, parts.optimizer, parts.scaler or torch.Tensor
    backward, step = owner.backward, opt.step

    def observed_backward(loss, *args, **kwargs):
        observe("backward", loss)
        backward(loss, *args, **kwargs)
        observe("gradients")
    owner.backward = observed_backward  # an instance attribute (the scaler's) or Tensor's own, put back after
    opt.step = lambda *args, **kwargs: (observe("step"), step(*args, **kwargs))[1]
    starts = model.register_forward_pre_hook(lambda module, args: observe("forward"))
    try:
        yield
    finally:
        if scaler:
            del scaler.backward
        else:
            torch.Tensor.backward = backward
        del opt.step
        starts.remove()


class _Stop(Exception):  # measure(until_step=True): the optimizer's step begins
    pass


def measure(model, parts, batch, device, micro_steps=1, timeline=None, until_step=False, tracker=None,
            module_path=ModulePath):
    """Run one accumulation_step of (model, parts) on `batch` micro_steps times, the optimizer's states made
    already (the steady state), and count it. Returns bytes per component (gradients: .grad and the FP32
    sums once backward is done; fp8_kept: the kept FP8 weight copies; activations: what the first forward
    saved, less those), saved_tensors ({storage: SavedTensor}), the phases' readings, the peak and its phase,
    forward_growth (the live bytes' growth over the forward) and forward_storages (the sizes of what the
    forward left alive: on CPU they add up to it, on CUDA they bound it, allocator_bounds). timeline: None, or
    (model, tracker) -> a context marking which block runs (ledger/trace.marks), for the tracker's "points";
    until_step: stop as the optimizer's step begins; tracker (None: CudaAllocator on CUDA, else LiveTensors)
    and module_path (ModulePath, or ledger/compiled.BlockPath): what reads the bytes and names the modules."""
    device, opt, grad_sums = torch.device(device), parts.optimizer, parts.grad_buffers or []
    params, buffers = list(model.parameters()), list(model.buffers())
    static = resident(model, parts)
    if tracker is None:
        tracker = CudaAllocator(device) if device.type == "cuda" else LiveTensors(device, timeline is not None)
    out = dict(parameters=storage_bytes(params, device),
               buffers=storage_bytes(buffers, device, exclude=storage_ids(params)),
               master=storage_bytes(opt.master_params, device, exclude=storage_ids(params)),
               optimizer=storage_bytes(opt.state_tensors(), device),
               inputs=storage_bytes(batch, device))
    path = module_path(model)
    phase, saved, losses = {}, SavedBytes(static + list(batch), where=path), [None]  # the last loss: no more
    hook = model.register_forward_hook(lambda module, args, output: losses.__setitem__(-1, output[1]))

    def observe(name, weighted_loss=None):
        phase[name] = tracker.read()
        if name == "backward" and "activations" not in out:
            # what the forward saved, before any recompute re-run, less the kept FP8 copies it made
            kept = {storage_key(t): t.untyped_storage().nbytes() for t in kept_copies(parts.fp8_layers)}
            out["saved_tensors"] = {k: v for k, v in saved.found.items() if k not in kept}
            out["activations"] = saved.total - sum(v.nbytes for k, v in saved.found.items() if k in kept)
            out["rng_states"] = saving_nodes(losses[-1], out["saved_tensors"])
            out["forward_storages"] = [v.nbytes for v in out["saved_tensors"].values()] + list(kept.values()) \
                + [losses[-1].untyped_storage().nbytes(), weighted_loss.untyped_storage().nbytes()]
        if name == "gradients" and "gradients" not in out:
            out["gradients"] = storage_bytes([p.grad for p in params] + grad_sums, device)
            out["fp8_kept"] = storage_bytes(kept_copies(parts.fp8_layers), device)  # alive until the step's end
        tracker.start_phase(name)
        if name == "step" and until_step:
            raise _Stop

    adamw_step = opt.torch_optimizer.step

    def read_step_gradients(*args, **kwargs):
        # the gradients alive as AdamW steps: .grad (ZeRO-2 has let it go), a ZeRO rank's slice, the FP32 sums
        held = [p.grad for p in params] + [getattr(opt, "grad_slice", None)] + grad_sums
        out["step_gradients"] = storage_bytes(held, device)
        return adamw_step(*args, **kwargs)
    opt.torch_optimizer.step = read_step_gradients
    try:
        with tracker, saved, phases(model, parts, observe), timeline(model, tracker) if timeline else nullcontext():
            tracker.adopt(static + grad_sums + list(batch))
            tracker.reset_peak()
            before = tracker.read()
            with suppress(_Stop):
                accumulate.accumulation_step(model, parts, [batch] * micro_steps)
            phase["end"] = tracker.read()
    finally:
        del opt.torch_optimizer.step  # the instance attribute goes: the optimizer's own step again
        hook.remove()
        path.remove()
    out["phase"] = dict(before=before, **phase)
    out["forward_growth"] = phase["backward"] - before
    out["peak"], out["peak_phase"], out["points"] = tracker.peak, tracker.peak_phase, getattr(tracker, "points", None)
    return out
