"""Measuring the ledger: the bytes of a real training step, counted from live tensors.

Chapter section 4. Read first: `SavedBytes` (what autograd keeps for backward, and who kept it),
then `LiveTensors` (every storage alive, op by op, like CUDA's memory_allocated), then `measure`,
which runs accumulate.accumulation_step itself and reads memory at each of its phases (`phases`).
Every component is counted from storages on every device: exact on CPU and CUDA alike. The live
bytes op by op are LiveTensors on CPU and the caching allocator's counters on CUDA (CudaAllocator),
whose growth over the forward is reported with the slack its block sizes allow (`allocator_bounds`).
"""
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import accumulate
import checkpoint


def local(t):
    """What this rank holds of `t`: a DTensor (fsdp.py's shards, their gradients and AdamW's
    states) is its local shard; its own storage would be the whole tensor's size."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_key(t):
    return StorageWeakRef(local(t).untyped_storage()).cdata


def storage_ids(tensors):
    return {storage_key(t) for t in tensors if t is not None}


def storage_bytes(tensors, device=None, exclude=()):
    """Bytes of the distinct storages behind `tensors` (on `device`), skipping ids in `exclude`."""
    seen = {}
    for t in tensors:
        if t is None or (device is not None and t.device.type != torch.device(device).type):
            continue
        if storage_key(t) not in exclude:
            seen[storage_key(t)] = local(t).untyped_storage().nbytes()
    return sum(seen.values())


class SavedBytes:
    """Count the bytes autograd saves for backward, by storage, while the context is open.

    A storage is counted once however many tensors (views) of it are saved; storages of
    `static` tensors (parameters, buffers, optimizer states) are not activations and are
    left out: a saved view of one (masked_fill's view of the causal-mask buffer) costs
    nothing new. `total` adds a storage each time it starts being held; `live` follows what
    saved-tensor slots still hold (a node's saved tensors are dropped when backward has run
    it), and `peak` is the most `live` ever was. What a recompute unit's re-run files for its
    nodes (checkpoint.Unit.pack_rerun: its own hooks, which these do not see) is counted too, from
    when it is filed to when its node takes it (Unit.unpack). A unit's forward must run inside
    the context too: its nodes' unpack hook is bound there.
    """

    def __init__(self, static=(), where=None):
        self.static = storage_ids(static)
        self.total = self.live = self.peak = 0
        self._holders = {}  # storage key -> how many saved-tensor slots hold it
        self.where = where  # None, or a callable naming the module running now (ModulePath)
        self.found = {}  # storage key -> SavedTensor, for each storage counted in `total`
        self._units = {}  # (id of a checkpoint.Unit, slot) -> what _pack made of the tensor kept there

    def _pack(self, t):
        key, nbytes = storage_key(t), t.untyped_storage().nbytes()
        if key in self.static or nbytes == 0:
            return t
        if self._holders.get(key, 0) == 0:
            self.total += nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            if key not in self.found:
                self.found[key] = SavedTensor(nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        if key in self.found and self.where and self.where() not in self.found[key].modules:
            self.found[key].modules += (self.where(),)
        self._holders[key] = self._holders.get(key, 0) + 1
        held = _Held(t)  # keeps the storage alive (so its key stays unique) until autograd drops it
        weakref.finalize(held, self._release, key, nbytes)
        return held

    def _release(self, key, nbytes):
        self._holders[key] -= 1
        if self._holders[key] == 0:
            self.live -= nbytes

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        # a recompute unit's re-run keeps what its nodes saved itself (checkpoint.Unit.pack_rerun), out
        # of these hooks' sight, until each node takes its own back (Unit.unpack): count those too
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


@dataclass
class SavedTensor:
    """One storage autograd saved: its bytes, the shape and dtype of the tensor first saved on
    it, the modules running when it was saved (paths of model.named_modules(), "" for GPT
    itself; the first one first) and the autograd nodes holding it (their grad_fn names,
    filled in by `saving_nodes`)."""
    nbytes: int
    shape: tuple
    dtype: str
    modules: tuple = ()
    nodes: tuple = ()


class ModulePath:
    """The path of the innermost module running now, by forward hooks on every module."""

    def __init__(self, model):
        self.stack, self.handles = [], []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(name)
        return hook

    def _leave(self, module, args, output):  # a forward hook that returns something replaces the output
        self.stack.pop()

    def __call__(self):
        return self.stack[-1] if self.stack else ""

    def remove(self):
        for handle in self.handles:
            handle.remove()


def saving_nodes(loss, found):
    """Fill in, for each storage in `found`, the autograd nodes (grad_fn names) of loss's graph
    that hold it: a node's saved tensors are its `_saved_*` attributes, or a custom Function's
    saved_tensors (checkpoint.RerunNode: a unit's inputs; fp8's)."""
    names, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        held = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # released already, or not a tensor torch will hand out
                    continue
                held += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if torch.is_tensor(v)]
        try:
            held += [t for t in getattr(node, "saved_tensors", ()) if torch.is_tensor(t)]
        except RuntimeError:  # a node inside a recompute unit: it holds nothing until the re-run
            pass
        for t in held:
            if storage_key(t) in found:
                names.setdefault(storage_key(t), set()).add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    for key, saved in found.items():
        saved.nodes = tuple(sorted(names.get(key, ())))


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class LiveTensors(TorchDispatchMode):
    """Counts the bytes of distinct live storages on one device, op by op, like CUDA's
    memory_allocated: every op's outputs are registered by storage, and storages whose last
    tensor has died are dropped (checked through weak references after each op)."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.live = {}  # storage id -> (weak ref, bytes)
        self.now = self.peak = 0  # now: the bytes in `live`, kept as a running sum
        self.phase = self.peak_phase = "start"

    def adopt(self, tensors):
        """Start counting storages made before the tracker was switched on."""
        for t in tensors:
            self._add(t)
        self.read()

    def _add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != self.device.type or t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ref = StorageWeakRef(st)
        if ref.cdata not in self.live:  # (a dead one was dropped by the _drop_dead before this)
            self.live[ref.cdata] = (ref, st.nbytes())
            self.now += st.nbytes()

    def _drop_dead(self):
        # one pass over every live storage per op is this tracker's whole cost: call the
        # built-in check directly (StorageWeakRef.expired wraps it in two Python calls)
        expired = torch.UntypedStorage._expired
        for key in [key for key, (ref, _) in self.live.items() if expired(ref.cdata)]:
            self.now -= self.live.pop(key)[1]

    def _count(self):
        """The bytes live now (the storages found dead already dropped), and the peak so far."""
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
        return self.now

    def read(self):
        self._drop_dead()
        return self._count()

    def start_phase(self, name):
        self.phase = name

    def reset_peak(self):
        self.peak, self.peak_phase = self.read(), self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._drop_dead()  # what the op's inputs' owners let go of, before its outputs count
        for t in tree_leaves(out):
            self._add(t)
        self._count()
        return out


class CudaAllocator:
    """The same interface on CUDA: the caching allocator's own counters. Every phase starts
    with reset_peak_memory_stats, so max_memory_allocated is that phase's peak. (It resets
    the process's peak statistics: the tools run it in their own process, never a training run.)

    Why its readings are not storage sizes (the ledger's components are, on CUDA too; only
    this figure gets a slack, `allocator_bounds`): memory_allocated counts allocator blocks,
    not tensors, and kernels allocate their own scratch through it (cuBLAS workspaces, the
    attention kernels' accumulators), which is gone by the end of an op."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.phase = self.peak_phase = "start"
        self.peak = 0

    def adopt(self, tensors):
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
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak, self.peak_phase = torch.cuda.memory_allocated(self.device), self.phase

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# c10/cuda/CUDACachingAllocator.cpp: round_size rounds every request up to a multiple of
# kMinBlockSize (512 bytes); requests up to kSmallSize (1 MiB) come from the small pool, whose
# blocks are split whenever 512 bytes or more would remain (should_split), so they count exactly
# the rounded size; a larger request may be served by a cached large-pool block that is split
# only where more than kSmallSize would remain: up to 1 MiB more, counted whole (malloc adds
# block->size to allocated_bytes)
MIN_BLOCK, SMALL_SIZE = 512, 2 ** 20


def allocator_bounds(sizes):
    """(least, most) bytes CUDA's memory_allocated counts for live storages of these byte sizes."""
    blocks = [MIN_BLOCK * max(1, -(-n // MIN_BLOCK)) for n in sizes if n > 0]
    return sum(blocks), sum(blocks) + SMALL_SIZE * sum(b > SMALL_SIZE for b in blocks)


def kept_copy_storages(fp8_layers):
    """{storage key: bytes} of the FP8 weight copies the layers keep now (fp8_refined.WeightCopy)."""
    copies = [m.weight_copy for m in fp8_layers if getattr(m, "weight_copy", None) is not None]
    return {storage_key(t): t.untyped_storage().nbytes() for c in copies
            for t in (c.data, c.column_major, c.scale, c.amax) if t is not None}


def resident(model, parts):
    """What a step finds alive and leaves alive: parameters, buffers, the master copy, AdamW's states."""
    opt = parts.optimizer
    return list(model.parameters()) + list(model.buffers()) + opt.master_params + opt.state_tensors()


def random_batch(cfg, device, b=None):
    """A seeded (x, y) of random bytes, b sequences of cfg.block_size, in two storages of their
    own. (Not .contiguous(): for one sequence the shifted slice is contiguous already, so x and
    y would stay views of one (s+1)-token storage and the ledger's inputs would come out
    (s-1) x 8 bytes short: issue 10, defect 3.)"""
    g = torch.Generator().manual_seed(cfg.seed)
    b = b or cfg.batch_size
    xy = torch.randint(0, 256, (b, cfg.block_size + 1), generator=g)
    return xy[:, :-1].clone().to(device), xy[:, 1:].clone().to(device)


def rng_state_bytes(loss):
    """Host bytes of the RNG states held by the recompute units in loss's autograd graph
    (checkpoint.Unit.rng, found through each unit's output node: checkpoint.RerunNode's ctx *is* the
    graph node; NaiveRecompute's keeps it itself), distinct storages."""
    seen, stack, found = set(), [loss.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        rng = node.unit.rng if isinstance(node, checkpoint.RerunNode._backward_cls) else \
            node.rng if isinstance(node, checkpoint.NaiveRecompute._backward_cls) else {}
        for t in rng.values():
            found[storage_key(t)] = t.untyped_storage().nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(found.values())


@contextmanager
def phases(model, parts, observe):
    """Call observe(name, ...) as each phase of accumulate.accumulation_step begins, read from outside
    it: "forward" (each micro-step's forward), "backward" (the scaler's backward, given the weighted
    loss), "gradients" (after it), "step" (the optimizer's step, the FP8 weight copies released)."""
    scaler, opt = parts.scaler, parts.optimizer
    backward, step = scaler.backward, opt.step

    def observed_backward(loss):
        observe("backward", loss)
        backward(loss)
        observe("gradients")
    scaler.backward = observed_backward  # instance attributes, deleted after: the class's methods again
    opt.step = lambda *args, **kwargs: (observe("step"), step(*args, **kwargs))[1]
    starts = model.register_forward_pre_hook(lambda module, args: observe("forward"))
    try:
        yield
    finally:
        del scaler.backward, opt.step
        starts.remove()


def measure(model, parts, batch, device, micro_steps=1):
    """Run one accumulation_step of (model, parts) on one micro-batch (micro_steps=K: K times; the activations
    are the first's), and count. Call it once the optimizer states exist (after a first step): the steady
    state. Returns bytes per component (storage sizes on every device; gradients: the .grad storages once
    backward is done, plus FP32 sums; fp8_kept: the kept FP8 weight copies; activations: what SavedBytes
    saw the forward save, less those copies),
    saved_tensors ({storage: SavedTensor}, for ledger/explain.py), the phase readings, the peak and its
    phase, forward_growth (the tracker's growth over the forward) and forward_storages (the sizes of
    the storages the forward left alive: activations, kept copies, the loss and the loss x weight,
    which on CPU add up to forward_growth exactly and on CUDA bound it: allocator_bounds)."""
    device = torch.device(device)
    opt = parts.optimizer
    params, buffers = list(model.parameters()), list(model.buffers())
    static = resident(model, parts)
    cuda = device.type == "cuda"
    tracker = CudaAllocator(device) if cuda else LiveTensors(device)
    out = dict(parameters=storage_bytes(params, device),
               buffers=storage_bytes(buffers, device, exclude=storage_ids(params)),
               master=storage_bytes(opt.master_params, device, exclude=storage_ids(params)),
               optimizer=storage_bytes(opt.state_tensors(), device),
               inputs=storage_bytes(batch, device))
    module_path = ModulePath(model)
    phase, saved, losses = {}, SavedBytes(static + list(batch), where=module_path), [None]  # the last loss: no more
    hook = model.register_forward_hook(lambda module, args, output: losses.__setitem__(-1, output[1]))

    def observe(name, weighted_loss=None):
        phase[name] = tracker.read()
        if name == "backward" and "saved" not in out:
            # what the forward saved, before any recompute re-run, less the kept FP8 copies it made
            kept = kept_copy_storages(parts.fp8_layers)
            activations = {k: v for k, v in saved.found.items() if k not in kept}
            out["saved"] = saved.total - sum(v.nbytes for k, v in saved.found.items() if k in kept)
            out["saved_tensors"] = activations  # and who saved each storage, for ledger/explain.py
            saving_nodes(losses[-1], out["saved_tensors"])
            out["rng_states"] = rng_state_bytes(losses[-1])
            out["forward_storages"] = [v.nbytes for v in activations.values()] + list(kept.values()) \
                + [losses[-1].untyped_storage().nbytes(), weighted_loss.untyped_storage().nbytes()]
        if name == "gradients" and "gradients" not in out:
            out["gradients"] = storage_bytes([p.grad for p in params] + (parts.grad_buffers or []), device)
            # the FP8 weight copies kept for this step (alive until optimizer_step releases them)
            copies = [m.weight_copy for m in parts.fp8_layers if getattr(m, "weight_copy", None) is not None]
            out["fp8_kept"] = storage_bytes([t for c in copies for t in (c.data, c.column_major, c.scale, c.amax)],
                                            device)
        tracker.start_phase(name)

    adamw_step = opt.torch_optimizer.step

    def read_step_gradients(*args, **kwargs):
        # the gradients alive while AdamW steps: .grad, a ZeRO rank's reduced slice, the FP32 sums
        # (ZeRO-2 has released .grad by now, ZeRO-1 has not: the rows of zero.py differ here)
        held = [p.grad for p in params] + [getattr(opt, "grad_slice", None)] + (parts.grad_buffers or [])
        out["step_gradients"] = storage_bytes([t for t in held if t is not None], device)
        return adamw_step(*args, **kwargs)
    opt.torch_optimizer.step = read_step_gradients
    try:
        with tracker, saved, phases(model, parts, observe):
            tracker.adopt(static + (parts.grad_buffers or []) + list(batch))
            tracker.reset_peak()
            before = tracker.read()
            accumulate.accumulation_step(model, parts, [batch] * micro_steps)
            phase["end"] = tracker.read()
    finally:
        del opt.torch_optimizer.step  # the instance attribute goes: the optimizer's own step again
        hook.remove()
        module_path.remove()
    out["phase"] = dict(before=before, **phase)
    out["activations"] = out["saved"]
    out["forward_growth"] = phase["backward"] - before
    out["peak"], out["peak_phase"] = tracker.peak, tracker.peak_phase
    return out
