"""The ledger's exact column: the real training step, run on fake tensors and counted.

Chapter section 4. Read memory_ledger.py first, then `step`: build.build's run of model.py (the real
recompute, optimizer and sharding) under PyTorch's FakeTensorMode (shapes, dtypes, devices, no data),
counted by ledger/measure.py as a real step is; over N ranks PyTorch's fake process group stands in for
the others. What has no value on a fake tensor the chapter's code states where it reads one
(precision.host_value). DDP's reducer (C++) is stated (`DDP`); where torch has no CUDA, a GPU's step
runs the GPU kernels' memory rules (ledger/cuda_rules.py), unverified until `make gpu-check`. Traces are
kept by request (`step`), on disk too for `make plan` (ledger/kept.py). More: docs/ledger.md.
"""
import contextlib
import math
import multiprocessing
import signal
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

import accumulate
import build
import flops
import fsdp
import memory_ledger
import precision
from ledger import comm, kept, measure
from ledger.cuda_rules import cuda_dtypes, cuda_rules, emulated

# DDP (SHARD=none over N ranks), beyond its unwrapped model: the reducer copies every gradient into
# buckets it makes when it wraps the model (torch/csrc/distributed/c10d/reducer.cpp, initialize_buckets:
# one more copy of the gradients, held all step) and all-reduces them once a step (2 x P elements), stated
# as one call of P elements: the reducer sizes its buckets itself (1 MiB first, then 25 MiB)
DDP = "DDP's reducer: a bucket copy of every gradient, and their all-reduce (reducer.cpp)"

@contextlib.contextmanager
def fake_tensors():
    """Everything made inside is a fake tensor. Two steps of torch's need a real tensor: Module.to swaps
    each parameter for its cast copy (torch.utils.swap_tensors), which refuses a tensor the fake mode's
    memo holds a weak reference to (pytorch/pytorch#148977): the memo is forgotten first; and a device
    mesh reads its rank numbers (.tolist()): fsdp.py's is made of real tensors."""
    mode = FakeTensorMode()
    swap, mesh = torch.utils.swap_tensors, getattr(fsdp, "init_device_mesh", None)

    def swap_unmemoized(t1, t2):
        mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        swap(t1, t2)

    def real_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return mesh(*args, **kwargs)
    torch.utils.swap_tensors, fsdp.init_device_mesh = swap_unmemoized, real_mesh
    try:
        with mode:
            yield mode
    finally:
        torch.utils.swap_tensors, fsdp.init_device_mesh = swap, mesh


@contextlib.contextmanager
def fake_ranks(world, rank):
    """A fake process group of `world` ranks in which this process is rank `rank` (nothing for one)."""
    if world == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("a trace over several ranks needs a process with no process group of its own")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def marks(model, tracker):
    """Tell the tracker which block runs: ("forward", i) as block i's forward begins (in backward too:
    a recompute's re-run), ("backward", i) as its backward begins (a hook on its output's gradient)."""
    def set_mark(where):
        tracker.where = where

    def hooked(module, args, output, i):
        if torch.is_tensor(output) and output.requires_grad:
            output.register_hook(lambda grad: set_mark(("backward", i)))
    handles = [h for i, block in enumerate(model.h)
               for h in (block.register_forward_pre_hook(lambda module, args, i=i: set_mark(("forward", i))),
                         block.register_forward_hook(lambda module, args, out, i=i: hooked(module, args, out, i)))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_TRACED = {}  # the traces made in this process, and what is made of them (memoized), by _key
_ASKED = []  # while rounds() notes: the traces asked for and not made yet


def step(cfg, world=1, rank=0, micro_steps=1, planned=False):
    """measure.measure's dict for cfg's steady-state step on rank `rank` of `world`, traced: build.build's
    run on fake tensors, AdamW's states made (`warm`), then one step of `micro_steps` micro-batches counted.
    Added: "calls" (the collectives it issued, ledger/comm.Count), "kinds" (memory_ledger.module_kinds),
    "named" (each parameter's elements, dimensions, module kind, whether row-parallel), "params" (P, tensors),
    "host" (bytes a GPU keeps in host memory: taken out where CUDA's rules apply). planned: the planner's
    trace: its timeline ("points") and FLOPs ("flops", flops.Counted), up to where the optimizer's step
    begins (but FSDP's, whole). A learner's model that fails raises as it is."""
    return _cached("step", cfg, world, rank, micro_steps, planned)


def _key(kind, cfg, *args):
    return kind, repr(cfg), *args, emulated(cfg), flops.model_code()


class Missing(Exception):
    """A trace not made yet, asked for while `rounds` notes."""


def _cached(kind, cfg, *args):
    key = _key(kind, cfg, *args)
    if key not in _TRACED and (on_disk := kept.read(kind, cfg, *args)) is not None:
        _TRACED[key] = on_disk
    if key not in _TRACED:
        if _ASKED:
            _ASKED[-1].append((kind, cfg, *args))
            raise Missing(kind)
        if len(_TRACED) > 4096:
            _TRACED.clear()
        _TRACED[key] = _made(kind, cfg, *args)
    return _TRACED[key]


def _made(kind, cfg, *args, out=None):
    """A trace made now (or `out`, made by a worker), counted, and kept on disk where kept.kept_on_disk asks."""
    out = KINDS[kind](cfg, *args) if out is None else out
    kept.COUNTS["traced"] += 1
    kept.keep(out, kind, cfg, *args)
    return out


def all_of(requests):
    """[the trace of each request (kind, cfg, *args)], every missing one noted while `rounds` notes."""
    out, missing = [], None
    for request in requests:
        try:
            out.append(_cached(*request))
        except Missing as e:
            missing = e
    if missing:
        raise missing
    return out


def memoized(make, cfg, *args):
    """make(cfg, *args), kept beside the traces it reads."""
    key = _key(make.__qualname__, cfg, *args)
    if key not in _TRACED:
        _TRACED[key] = make(cfg, *args)
    return _TRACED[key]


def rounds(evaluate, items, workers, progress=None):
    """[evaluate(item)] of each item, the traces they read made `workers` processes at once: each item is
    evaluated while the traces it finds missing are noted (it stops at them), those are traced, forked
    (each process inherits model.py as this one holds it), the longest first, and again until none is
    missing. What a worker cannot trace is left to be traced (and to raise) here, where it is asked.
    progress(done, asked): called as each trace comes back, with the traces done and asked so far."""
    pool, done, asked = None, 0, 0  # one pool for every round: a worker's fake-tensor cache and imports stay warm
    try:
        while workers > 1 and "fork" in multiprocessing.get_all_start_methods():
            _ASKED.append([])
            try:
                for item in items:
                    with contextlib.suppress(Missing):
                        evaluate(item)
            finally:
                todo = {_key(*request): request for request in _ASKED.pop()}
            if not todo:
                break
            todo, asked = dict(sorted(todo.items(), key=lambda item: -_cost(*item[1][:2]))), asked + len(todo)
            pool = pool or multiprocessing.get_context("fork").Pool(workers, initializer=_worker_start)
            for key, out in zip(todo, pool.imap(_traced_or_none, todo.values())):
                if out is not None:
                    _TRACED[key] = _made(*todo[key], out=out)
                done += 1
                if progress:
                    progress(done, asked)
            if not any(key in _TRACED for key in todo):
                break
    finally:
        if pool:
            pool.terminate()
    return [evaluate(item) for item in items]


def _cost(kind, cfg):
    """A trace's time, roughly: blocks run (FSDP's with its gathers), an optimizer's step cheap."""
    return cfg.n_layer * (0.25 if kind != "step" else 4 if cfg.shard == "fsdp" else 1)


def _worker_start():
    torch.set_num_threads(1)
    # the pool ends its workers by SIGTERM, and Ctrl-C reaches the whole group: this process answers both
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _traced_or_none(request):
    try:
        return KINDS[request[0]](*request[1:])
    except Exception:  # noqa: BLE001  (traced again where it is asked, and raised there)
        return None


def warm(model_, parts):
    """AdamW's states made before the counted step, by its step alone, and FSDP's lazy init, which its first
    forward would run, remaking its shards after the census noted theirs (torch/distributed/fsdp/_fully_shard/
    _fsdp_state.py): nothing else of a step leaves state behind (tests/test_memory_parallel.py)."""
    if isinstance(model_, fsdp.FSDPModule):
        model_._get_fsdp_state()._lazy_init()
    opt = parts.optimizer
    for m in opt.master_params:
        m.grad = torch.zeros_like(m)
    opt.torch_optimizer.step()
    opt.zero_grad()


def optimizer_config(cfg):
    """cfg as the optimizer's step sees it: nothing of these reaches it (attn: the masks, which are buffers)."""
    return replace(cfg, ckpt="none", ckpt_segment=0, ckpt_impl="hooks", dropout=0.0, batch_size=1, attn="sdpa",
                   compile=False, loss_chunks=1)


def _optimizer_step(cfg, world, rank, meta=None):
    """Rank `rank`'s optimizer step alone at cfg's full depth (ZeRO's slices make each depth's unlike), its
    gradients made as backward leaves them, counted after a first (AdamW's states appear). Returns dict(held:
    states and FP32 sums; buffers; start: the bytes alive as it begins; points; calls; parameters: bytes).
    A GPU's (meta None: cfg.device cuda) runs on the meta device, not on fake tensors, at a tenth of the cost
    (FakeTensorMode's cache key and per-tensor foreach were most of it): what the code makes on the CPU by
    name stays off it as it stays off a GPU (AdamW's step counts, a constant's copy: tests/test_plan.py)."""
    meta = cfg.device == "cuda" if meta is None else meta
    device = torch.device("meta") if meta else traced_device(cfg)
    with fake_ranks(world, rank), device if meta else fake_tensors(), cuda_rules(emulated(cfg)):
        model_, parts = build.build(cfg, device)
        opt = parts.optimizer

        def gradients():
            if parts.grad_buffers is None:  # (the FP32 sums are the step's gradients: .grad went each micro-step)
                for p in opt.model_params:
                    p.grad = torch.empty_like(p)
            return [p.grad for p in opt.model_params if p.grad is not None]
        warm(model_, parts)  # AdamW's states exist from here
        tracker, found = measure.LiveTensors(device, timeline=True), {}
        static = measure.resident(model_, parts) + (parts.grad_buffers or [])
        opt_step = opt.step

        def step(*args, **kwargs):  # read where the optimizer begins, as measure.phases does
            tracker.start_phase("step")
            found["start"] = tracker.read()
            return opt_step(*args, **kwargs)
        opt.step = step
        try:
            with comm.Count() as count, tracker:
                tracker.adopt(static + gradients())  # (no reference kept here: ZeRO-2 lets .grad go)
                accumulate.optimizer_step(parts, across_ranks=world > 1)
        finally:
            del opt.step
        held, buffers, (host, host_n, _) = _held(cfg, model_, parts, device)
        return dict(held=held, buffers=buffers, start=found["start"] - host, calls=count.calls,
                    parameters=measure.storage_bytes(list(model_.parameters()), device),
                    points=[(n - host, storages - host_n, large) for (_, phase, _), _, n, storages, large
                            in tracker.points if phase == "step"])


def _held(cfg, model_, parts, device):
    """(bytes, storages, storages over 1 MiB) of what the step holds all along but the buffers (its states, FP32
    sums), of the buffers, and of what a GPU keeps in host memory (AdamW's per-tensor counts: CUDA's rules)."""
    per_tensor = precision.OPTIMIZERS[cfg.optimizer].per_tensor
    host = [v for state in parts.optimizer.torch_optimizer.state.values() for name, v in state.items()
            if name in per_tensor] if emulated(cfg) else []
    buffers = list(model_.buffers())
    left = measure.storage_ids(host + buffers)
    held = [t for t in measure.resident(model_, parts) + (parts.grad_buffers or [])
            if measure.storage_key(t) not in left]
    return tuple(_counts(tensors, device) for tensors in (held, buffers, host))


def _counts(tensors, device):
    sizes = {measure.storage_key(t): measure.local(t).untyped_storage().nbytes() for t in tensors
             if t.device.type == device.type}
    return sum(sizes.values()), len(sizes), sum(n > measure.SMALL_SIZE for n in sizes.values())


def traced_device(cfg):
    """Where cfg's step is traced: a GPU's on CPU tensors where CUDA's rules stand in (emulated)."""
    return torch.device("cuda" if cfg.device == "cuda" and not emulated(cfg) else "cpu")


def marker(cfg):
    """The micro-batch a planner's trace runs at (`PerSequence`): the least prime over 64 x cfg's largest
    dimension (and none of its widths, heads or pieces a multiple of it), so it divides a storage's bytes just
    where the micro-batch is one of its dimensions. A fake tensor of a million sequences costs what one of two
    does: nothing but its shape."""
    n = 64 * max(cfg.n_embd, cfg.block_size, cfg.vocab_size) + 1
    while any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


class PerSequence(measure.LiveTensors):
    """LiveTensors of a step at m = marker(cfg) sequences that tells its bytes apart: a storage whose bytes m
    divides grows with the micro-batch (bytes per sequence), any other does not (fixed). So one trace is the
    step at every micro-batch b >= 2: its points are (where, op, fixed, per sequence, storages, storages over
    1 MiB at b = 2, at b = 3), and each reading is kept split (`split`: reading -> (fixed, per sequence))."""

    def __init__(self, device, m, outputs=None):
        super().__init__(device, timeline=True, outputs=outputs)
        self.m, self.per_sequence, self.sequence_bytes, self.large_at, self.split = m, {}, 0, [0, 0], {}

    def _grew(self, key, nbytes, sign):
        if sign > 0 and nbytes and nbytes % self.m == 0:
            self.per_sequence[key] = nbytes // self.m
        each = self.per_sequence.pop(key, 0) if sign < 0 else self.per_sequence.get(key, 0)
        if not each:
            return super()._grew(key, nbytes, sign)
        self.now, self.sequence_bytes = self.now + sign * nbytes, self.sequence_bytes + sign * each
        self.large_at = [n + sign * (b * each > measure.SMALL_SIZE) for n, b in zip(self.large_at, (2, 3))]

    def _counted(self, op=None, grew=False):
        super()._counted(op)
        if grew:
            self.points.append(((self.phases, self.phase, self.where), op, self.now - self.m * self.sequence_bytes,
                                self.sequence_bytes, len(self.live), *(self.large + n for n in self.large_at)))

    def read(self):
        now = super().read()
        self.split[now] = (now - self.m * self.sequence_bytes, self.sequence_bytes)
        return now


def at_micro_batch(marked, b):
    """A trace at marker(cfg) sequences (PerSequence) as the trace at micro-batch b, 2 or 3, reads:
    its points and phases their fixed bytes + b x their bytes per sequence; its inputs and FLOPs b of its own
    per sequence; all else (states, buffers, what FSDP gathers) the same at every b."""
    m = marked["per_sequence"]
    out = dict(marked, points=[(where, op, fixed + b * each, storages, large[b - 2])
                               for where, op, fixed, each, storages, *large in marked["points"]],
               phase={name: fixed + b * each for name, (fixed, each) in marked["phase"].items()})
    for name in ("inputs", "flops", "fp8_flops"):
        if out[name] % m:
            raise ValueError(f"the trace's {name} are no whole figure per sequence: not linear in the micro-batch")
        out[name] = out[name] // m * b
    return out


def _trace(cfg, world, rank, micro_steps, planned):
    device = traced_device(cfg)
    with fake_ranks(world, rank), fake_tensors(), cuda_rules(emulated(cfg)):
        model_, parts = build.build(cfg, device)
        batch = measure.random_batch(cfg, device)
        if not planned or cfg.shard == "fsdp":  # (the planner's stop before the step: Peaks sets the states)
            warm(model_, parts)  # AdamW's states exist from here: the steady state
        counted, cuda = flops.Counted(), emulated(cfg)

        def outputs(func, args, kwargs, out):  # in the census's own mode: a mode more costs every op 10-20%
            if planned:
                counted.count(func, args, kwargs, out)
            return cuda_dtypes(func, args, kwargs, out) if cuda else out
        marked = planned and cfg.batch_size == marker(cfg)
        tracker = PerSequence(device, cfg.batch_size, outputs) if marked else measure.LiveTensors(device, planned,
                                                                                                   outputs)
        with comm.Count() as count:
            out = measure.measure(model_, parts, batch, device, micro_steps, timeline=marks if planned else None,
                                  until_step=planned and cfg.shard != "fsdp", tracker=tracker)
        if planned:  # the planner's: its timeline and figures (it keeps a trace for each of hundreds of configs)
            out.pop("saved_tensors")
        if marked:  # each phase's reading as (fixed, per sequence)
            out.update(phase={name: tracker.split[n] for name, n in out["phase"].items()}, per_sequence=cfg.batch_size)
        params = list(model_.parameters())  # (a DTensor's numel is the whole parameter's)
        owners = {name: module for path, module in model_.named_modules()
                  for name in [f"{path}.{n}" if path else n for n, _ in module.named_parameters(recurse=False)]}
        out["named"] = [(name, p.numel(), p.dim(), memory_ledger.module_kinds(owners[name])[""],
                         getattr(owners[name], "residual_projection", False)) for name, p in model_.named_parameters()]
        out["row_parallel"] = {path for path, m in model_.named_modules() if getattr(m, "residual_projection", False)}
        out.update(calls=count.calls, flops=counted.total if planned else None,
                   fp8_flops=counted.by_op.get("_scaled_mm", 0) if planned else None,
                   sent=comm.volume(count.calls), gathered=comm.volume([c for c in count.calls if "gather" in c[0]])
                   // micro_steps, kinds=memory_ledger.module_kinds(model_),
                   params=(sum(p.numel() for p in params), len(params)), host=0)
        out["held"], out["buffer_counts"], (host, host_n, _) = _held(cfg, model_, parts, device)
        if host:  # AdamW's step counts are host memory on a GPU: static, out of every reading (fixed bytes)
            i = 1 if marked else 0  # a point: (where, op, bytes, [bytes per sequence,] storages, ...)
            out.update(host=host, optimizer=out["optimizer"] - host, peak=out["peak"] - host,
                       points=[(where, op, n - host, *rest[:i], rest[i] - host_n, *rest[i + 1:])
                               for where, op, n, *rest in out["points"] or []],
                       phase={k: (v[0] - host, v[1]) if marked else v - host for k, v in out["phase"].items()})
    if world > 1 and cfg.shard == "none":  # DDP: what its reducer holds and sends, beyond the unwrapped model
        out["ddp_buckets"] = out["parameters"]  # a copy of every gradient, in the parameters' dtype
        if parts.grad_buffers is None:  # with FP32 sums every micro-step is no_sync: accumulate.py all-reduces them
            out["calls"] = out["calls"] + [("all_reduce", out["parameters"], out["params"][0])]
    return out


KINDS = {"step": _trace, "optimizer step": _optimizer_step}
