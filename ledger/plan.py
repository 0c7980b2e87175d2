"""Will it fit? Every configuration of a model that fits a GPU, its largest micro-batch and what it
costs, from the traced step. tools/plan.py (`make plan`) prints them, fastest first.

Chapter section 4 put to work. Read first: `Extended` (a big model's step from two small traces),
then `Peaks` (one configuration's peak on each kind of rank, at any micro-batch), then `plan`.
Every figure is ledger/trace.py's, model.py run on fake tensors: a step traced at two depths, each at a
micro-batch whose storages say how they grow with it, extends exactly to any depth and micro-batch (blocks
are alike, bytes bilinear in depth and micro-batch).
docs/plan.md has the why of each step and what is exact.
"""
import math
import re
from dataclasses import dataclass, replace

import numpy as np
import torch

import checkpoint
import precision
import zero
from config import PRECISIONS, Config, UsageError, choices, validate
from ledger import comm, trace
from ledger.loss import loss_at_most
from ledger.measure import MIN_BLOCK, SMALL_SIZE
from model import GPT

MIB, GIB = 2 ** 20, 2 ** 30
CONTEXT_MIB = 400  # the CUDA context with lazy module loading (CUDA >= 11.7): ~400 MB, pytorch/pytorch#109888
MFU = 0.40  # the utilization of the GPU's peak the step time assumes, stated, not measured
TARGET_TOKENS = 2 ** 19  # the default target batch, tokens per optimizer step (nanoGPT's GPT-2 run: 524,288)


# ---------------------------------------------------------------- a big step from two small traces

def units(cfg):
    """(blocks per unit k, full units q, blocks left over r) of cfg's recompute policy: L = q*k + r."""
    policy_units = checkpoint.policy(cfg).block_units(cfg.n_layer)
    k = len(policy_units[0]) if policy_units else 1
    return k, cfg.n_layer // k, cfg.n_layer % k


def at_depth(cfg, q, b):
    """cfg with q full units (and the same leftover blocks), micro-batch b; sqrt keeps its segment."""
    k, _, r = units(cfg)
    segment = k if checkpoint.policy(cfg).takes_segment else cfg.ckpt_segment
    return replace(cfg, n_layer=q * k + r, batch_size=b, ckpt_segment=segment)


def segments(points, q, k, window, step=False):
    """{where: [(op, bytes, storages, large)]} of a traced timeline up to its optimizer step, each block by its
    place: its unit's distance from the first or the last (within `window`) or "leftover", its index in its
    unit. A middle unit's points are left out: between its neighbours', they cannot be the highest."""
    out = {}
    for (n, phase, where), op, *counts in points:
        if phase == "step" and not step:
            continue  # the optimizer's step is traced at full depth on its own (Peaks)
        if where is not None:
            kind, i = where
            unit, j = divmod(i, k)
            place = ("first", unit) if unit < window else ("last", q - 1 - unit) if q - window <= unit < q else \
                ("leftover", 0) if unit == q else None
            if place is None:
                continue
            where = (kind, place, j)
        out.setdefault((n, phase, where), []).append((op, *counts))
    return out


def _runs(points):
    """A per-parameter loop's points (one op in a row, each an allocation: bytes rising) as its last."""
    out = []
    for point in points:
        if out and out[-1][0] == point[0]:
            if point[1] < out[-1][1]:
                raise ValueError("a run of one op whose bytes fall: its points are not a loop's")
            out[-1] = point
        else:
            out.append(point)
    return out


class Extended:
    """cfg's traced step at its depth and any micro-batch b >= 2 (b=(1,): at b = 1), from traces at 2 and 3
    units (a model no deeper than both together: at its depth), each at trace.marker(cfg) sequences and read
    at micro-batches 2 and 3 (trace.at_micro_batch). Each point's bytes and storages (all, and those over 1 MiB),
    and each figure: f22 + (q-2)(f32 - f22) + (b-2)(f23 - f22) + (q-2)(b-2)(f33 - f32 - f23 + f22)."""

    def __init__(self, cfg, world=1, rank=0, micro_steps=1, b=(2, 3)):
        k, q, _ = units(cfg)
        window, self.depths = self.depths_of(cfg)
        self.q, self.bs = q, (b[0], b[-1])
        keys = [(i, j) for i in range(2) for j in range(2)]
        # one trace a depth: at b = 1 itself, else at marker(cfg) sequences, read as the traces at 2 and 3 would be
        at = 1 if b == (1,) else trace.marker(cfg)
        by_depth = trace.all_of([("step", at_depth(cfg, depth, at), world, rank, micro_steps, True)
                                 for depth in self.depths])
        self.traced = {(i, j): by_depth[i] if at == 1 else trace.at_micro_batch(by_depth[i], self.bs[j])
                       for i, j in keys}
        timelines = {key: segments(t["points"], self.depths[key[0]], k, window, cfg.shard == "fsdp")
                     for key, t in self.traced.items()}
        labels = list(timelines[0, 0])
        if any(list(t) != labels for t in timelines.values()):
            raise ValueError("the small traces' timelines differ in their phases or blocks")
        self.points, self.where = {key: [] for key in timelines}, []
        for label in labels:
            runs = {key: t[label] for key, t in timelines.items()}
            if len({len(p) for p in runs.values()}) > 1:
                runs = {key: _runs(p) for key, p in runs.items()}
            if len({len(p) for p in runs.values()}) > 1:
                raise ValueError(f"the small traces' timelines differ at {label}")
            for key, p in runs.items():
                self.points[key].extend(point[1:] for point in p)
            self.where += [label] * len(runs[0, 0])
        self.points = {key: np.asarray(p, dtype=np.int64).reshape(-1, 3) for key, p in self.points.items()}

    @staticmethod
    def depths_of(cfg):
        """(window, the two depths traced): FSDP's backward gathers the next block early, so two blocks at
        each end are told apart (units of one block: traced at 4 and 5 units). A model no deeper than the
        two small traces together is traced at its own depth: that is fewer blocks run, and exact as it is."""
        k, q, r = units(cfg)
        window = -(-2 // k) if cfg.shard == "fsdp" else 1
        small = (2 * window * k + r) + ((2 * window + 1) * k + r)  # blocks the two small depths run
        deep = q > 2 * window + 1 and (small < q * k + r or not Extended.whole_when_cheaper)
        return window, ((2 * window, 2 * window + 1) if deep else (q, q))

    whole_when_cheaper = True  # (tests/test_plan.py extends shallow models too, to hold the extension to them)

    def _at(self, f, b):
        """f(i, j) of the four traces (depths i, micro-batches j), extended to this depth and micro-batch b."""
        dq, db, span = self.q - self.depths[0], b - self.bs[0], max(1, self.bs[1] - self.bs[0])
        f00, f01, f10, f11 = f(0, 0), f(0, 1), f(1, 0), f(1, 1)
        return f00 + dq * (f10 - f00) + db * ((f01 - f00) // span) + dq * db * ((f11 - f10 - f01 + f00) // span)

    def figure(self, name, b):
        """A figure of the traces (a number, or a tuple of them) at this depth and b."""
        out = self._at(lambda i, j: np.asarray(self.traced[i, j][name], dtype=np.int64), b)
        return int(out) if out.ndim == 0 else out

    def phase(self, name, b):
        return self._at(lambda i, j: self.traced[i, j]["phase"][name], b)

    def line(self):
        """The points as lines in b, x + b*y, each a row of (bytes, storages, storages over 1 MiB)."""
        at = self._at(lambda i, j: self.points[i, j], self.bs[0])
        y = self._at(lambda i, j: self.points[i, j], self.bs[0] + 1) - at if self.bs[1] > self.bs[0] else 0 * at
        return at - self.bs[0] * y, y


def said(label):
    """A timeline's place in words."""
    n, phase, where = label
    if where is None:
        return phase
    kind, (end, away), j = where
    unit = "the leftover unit" if end == "leftover" else f"the {end} unit" if away == 0 else \
        f"the {'second' if end == 'first' else 'next-to-last'} unit"
    return f"{phase}: block {j} of {unit}, its {kind}"


# ---------------------------------------------------------------- one configuration, every micro-batch

class Peaks:
    """One configuration's step on each kind of rank, as lines in the micro-batch b (x + b*y per point):
    SHARD=none is one process (world 1) or DDP; zero1/zero2 share none's forward and backward, each kind
    of rank tracing its own optimizer step; fsdp is traced as it runs. b=(1,): at micro-batch 1."""

    def __init__(self, cfg, world, micro_steps=1, b=(2, 3)):
        self.cfg, self.world, self.micro_steps, self.one = cfg, world, micro_steps, b == (1,)
        self.steps = {} if cfg.shard == "fsdp" else optimizer_steps(cfg, world)
        self.ranks = list(self.steps) or [0]
        # one micro-step read off a trace of two, but under FSDP (whose first of two skips its reduce-scatter):
        # its three phases, then the optimizer's step, which finds the same bytes alive after either
        self.traced_steps = micro_steps if cfg.shard == "fsdp" else 2
        # the extension: FSDP as it runs, the others unsharded, alone
        self.ext = trace.memoized(Extended, cfg, world, 0, micro_steps, b) if cfg.shard == "fsdp" else \
            trace.memoized(Extended, replace(cfg, shard="none"), 1, 0, 2, b)  # (one for DDP, ZeRO-1 and ZeRO-2)
        self.lines = self._lines()

    def _lines(self):
        """{rank: (x, y, where)}: each point x + b*y (bytes, storages, storages over 1 MiB) and its place: the
        extension's forward and backward, then the rank's own optimizer step set on what the extension says
        is alive as it begins; FSDP's all the extension's (its optimizer's step is alike block by block)."""
        x, y = self.ext.line()
        where, b0 = list(self.ext.where), self.ext.bs[0]
        if self.cfg.shard == "fsdp":
            return {0: (x, y, where)}
        ahead = np.array([label[1] != "step" and (self.traced_steps == self.micro_steps or label[0] <= 3)
                          for label in where], dtype=bool)
        start = [self.ext.phase("step", b) for b in (b0, b0 + (not self.one))]
        buffers = self.ext.figure("buffer_counts", b0)
        out = {}
        for rank in self.ranks:
            # this rank's states (and DDP's buckets) for what the extension's held (bytes, storages, large ones)
            z = self.steps[rank]
            shift = np.asarray(z["held"]) - self.ext.figure("held", b0) + [_ddp(self.cfg, self.world), 0, 0]
            steps = np.asarray(z["points"], dtype=np.int64).reshape(-1, 3) - [z["start"], 0, 0]
            y_step = np.tile([start[1] - start[0], 0, 0], (len(steps), 1))
            x_step = steps + [start[0] - b0 * (start[1] - start[0]) + shift[0], *(buffers - z["buffers"])[1:]]
            out[rank] = (np.concatenate([x[ahead] + shift, x_step]), np.concatenate([y[ahead], y_step]),
                         [w for w, a in zip(where, ahead) if a] + [(0, "step", None)] * len(steps))
        return out

    def at(self, b):
        """(peak bytes, where, rank, storages alive there, those over 1 MiB) at micro-batch b."""
        best = None
        for rank, (x, y, where) in self.lines.items():
            alive = x + b * y
            i = int(alive[:, 0].argmax())
            if best is None or alive[i, 0] > best[0]:
                best = (int(alive[i, 0]), said(where[i]), rank, int(alive[i, 1]), int(alive[i, 2]))
        return best

    def largest(self, budget, limit=1 << 20):
        """The largest b >= 2 whose peak fits `budget` bytes, at most limit; 1 if not even b = 2 fits."""
        return min(_most(x[:, 0], y[:, 0], budget, limit) for x, y, _ in self.lines.values())

    def states(self):
        """What the highest-holding rank holds all step: its states, buffers, FP32 sums (and DDP's buckets)."""
        if self.cfg.shard == "fsdp":
            return self.ext.phase("before", self.ext.bs[0]) - self.ext.figure("inputs", self.ext.bs[0])
        return held_all_step(self.cfg, self.world) + self.ext.figure("buffers", self.ext.bs[0])


def optimizer_steps(cfg, world):
    """{rank: its optimizer step} of each kind of rank (differing_ranks), traced at full depth (DDP's: one
    process's)."""
    ranks = differing_ranks(cfg, world) if cfg.shard in zero.STAGES else [0]
    return dict(zip(ranks, trace.all_of([("optimizer step", trace.optimizer_config(cfg),
                                          1 if cfg.shard == "none" else world, rank) for rank in ranks])))


def held_all_step(cfg, world):
    """What the highest-holding rank holds all step, buffers aside: its states, FP32 sums (and DDP's buckets)."""
    return max(z["held"][0] for z in optimizer_steps(cfg, world).values()) + _ddp(cfg, world)


def _ddp(cfg, world):
    """DDP's buckets, a copy of every gradient (trace.DDP): the parameters' bytes."""
    return optimizer_steps(cfg, world)[0]["parameters"] if cfg.shard == "none" and world > 1 else 0


def peaks(cfg, world, micro_steps=1, b=(2, 3)):
    """Peaks(...), made once."""
    return trace.memoized(Peaks, cfg, world, micro_steps, b)


def param_shapes(cfg):
    """Each parameter's shape in model.GPT's order, the model built on the meta device (no memory)."""
    return trace.memoized(_param_shapes, replace(cfg, shard="none"))


def _param_shapes(cfg):
    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(cfg, linear_factory=precision.decide(cfg).linear_factory()).parameters()]


def differing_ranks(cfg, world):
    """The first ZeRO rank of each kind: ranks whose slices cut the same pieces (their lengths, matrix
    or not, in order) hold and step alike, so one of them is traced."""
    return trace.memoized(_differing_ranks, trace.optimizer_config(cfg), world)


def _differing_ranks(cfg, world):
    shapes = param_shapes(cfg)
    sizes, matrices = [math.prod(s) for s in shapes], [len(s) >= 2 for s in shapes]
    first = {}
    for rank in range(world):
        pieces = zero.Shards(sizes, world, rank).pieces()
        first.setdefault((tuple((p.length, matrices[p.index]) for p in pieces), rank == world - 1), rank)
    return tuple(sorted(first.values()))


def _most(x, y, budget, limit):
    """The largest b >= 2 with every x + b*y <= budget (y >= 0), limit if none grows; 1 if not even b = 2."""
    grows = y > 0
    if (x[~grows] + 2 * y[~grows] > budget).any():
        return 1
    return int(min(limit, ((budget - x[grows]) // y[grows]).min())) if grows.any() else limit


# ---------------------------------------------------------------- what each configuration costs

@dataclass
class Row:
    """One configuration of the plan. b, accum: the micro-batch and the micro-steps to the target batch; peak:
    the traced bytes at the highest point of the highest rank; allocated, reserved, smi: what the allocator's
    counters and nvidia-smi would show there (`allocator`); budget: what reserved may reach; sent: bytes a
    step's collectives move per rank; step_s: at the stated MFU (None without the GPU's FLOP/s); why: what
    stops it, or None; states: of the peak, what the rank holds all step."""
    precision: str
    ckpt: str
    shard: str
    attn: str
    b: int = 0
    accum: int = 0
    peak: int = 0
    allocated: int = 0
    reserved: int = 0
    smi: int = 0
    budget: int = 0
    where: str = ""
    recompute: float = 0.0
    sent: int = 0
    step_s: float = None
    tokens: int = 0
    why: str = None
    loss_chunks: int = 1
    states: int = 0

    @property
    def tokens_per_s(self):
        return self.tokens / self.step_s if self.step_s else None


SEARCHED = ("precision", "ckpt", "shard", "attn")  # the keys a plan varies, in Row's order
UNTRACED = Config()  # out_dir and peak_flops, which no trace reads, at their defaults: a trace kept serves any
LOSS_CHUNKS = (1, 4, 16, 64)  # the loss's pieces tried in order where the whole loss does not fit, k | s


def configurations(world):
    """Every (precision, ckpt, shard, attn) to try: every sharding only over more than one rank."""
    return [(p, c, s, a) for p in PRECISIONS for c in checkpoint.POLICIES for s in choices("shard") for a in choices("attn")
            if world > 1 or s == "none"]


def allocator(peak, storages, large, gpu, context, cuda):
    """(allocated, reserved, nvidia-smi) estimates from a traced peak: the caching allocator rounds each of the
    `storages` alive there up to 512 bytes and holds cuBLAS's workspaces (allocated: c10/cuda/
    CUDACachingAllocator.cpp, round_size); a storage over 1 MiB may sit in a cached block up to 1 MiB larger
    (reserved, a bound); nvidia-smi adds the CUDA context. On CPU all three are the peak."""
    if not cuda:
        return peak, peak, peak
    allocated = peak + (MIN_BLOCK - 1) * storages + gpu.workspace
    return allocated, allocated + SMALL_SIZE * large, allocated + SMALL_SIZE * large + context


def plan(cfg, gpu, world, target_tokens, fixed=None, mfu=MFU, context=CONTEXT_MIB * MIB, batch=None, workers=1,
         progress=None):
    """[Row] for cfg's shape on `world` GPUs of `gpu` (a GPU), fastest first, then those that do not fit or
    run, each with why. fixed: {key: value} of SEARCHED not to vary; batch: the micro-batch to try (None:
    the largest that fits). On device cpu the budget is gpu.total exactly (no CUDA context, no allocator).
    workers, progress: processes that trace at once, and what hears of each trace made (trace.rounds)."""
    cuda = cfg.device != "cpu"
    n = target_tokens // (world * cfg.block_size)  # micro-batch x K: sequences per rank per step
    budget = gpu.total - context if cuda else gpu.total

    def evaluate(combo):
        row = Row(*combo, budget=budget)
        one = replace(cfg, **dict(zip(SEARCHED, combo)), batch_size=1, accum=1, total_batch_tokens=0,
                      device="cuda" if cuda else "cpu", out_dir=UNTRACED.out_dir, peak_flops=UNTRACED.peak_flops)
        try:
            validate(one)
            checkpoint.policy(one)
        except UsageError as e:
            row.why = re.split(r"[:;(]", str(e))[0].strip().lstrip("-")
            return row
        prec = precision.decide(one)
        if gpu.tflops is not None and gpu.tflops[prec.name] is None:
            row.why = f"does not run: {gpu.name} has no {prec.name.upper()} units"
            return row
        if one.shard != "fsdp":  # what a rank holds all step, its states (and DDP's buckets), traced alone first
            row.states = held_all_step(one, world)
            if row.states > budget:
                row.why = f"its states alone, held all step (buffers aside), are {row.states / GIB:.1f} GiB"
                return row
        # the loss in pieces only where the whole loss does not fit: each piece's logits re-run, a GEMM more
        for chunks in [fixed["loss_chunks"]] if fixed and "loss_chunks" in fixed else LOSS_CHUNKS:
            if cfg.block_size % chunks:  # pieces of b s / k rows: linear in b, as the extension must be
                continue
            row.why, row.loss_chunks = None, chunks
            fit(row, replace(one, loss_chunks=chunks), gpu, world, n, context, batch)
            if row.why is None or row.states > budget or row.where == "step":
                break  # it fits, or the loss is not what stops it
            if chunks == 1 and row.peak - loss_at_most(replace(one, batch_size=batch or 1))[0] > budget:
                break  # less all of the whole loss's bytes, it would not fit either: no piece can help
        if row.why is None:
            cost(row, replace(one, loss_chunks=row.loss_chunks), gpu, world, mfu, cfg.peak_flops)
        return row
    combos = [combo for combo in configurations(world)
              if not any(fixed and k in fixed and fixed[k] != v for k, v in zip(SEARCHED, combo))]
    return sorted(trace.rounds(evaluate, combos, workers, progress), key=lambda r: (
        r.why is not None, -(r.tokens_per_s or 0), r.recompute, r.sent, max(r.reserved, r.states) - r.budget))


def fit(row, one, gpu, world, n, context, batch):
    """Fill row's micro-batch b and micro-steps K (the largest b dividing n, the sequences per rank per step,
    whose reserved bytes fit row.budget; K > 1 traced with a later micro-step), or try `batch`; its peak, its
    allocator's figures and its states."""
    cuda = one.device == "cuda"
    if batch is None:
        most = 1
        if n > 1:
            later = peaks(one, world, 2)

            def reserved(b):
                peak, _, _, storages, large = later.at(b)
                return allocator(peak, storages, large, gpu, context, cuda)[1]
            most = later.largest(row.budget - (gpu.workspace if cuda else 0))
            while most >= 2 and reserved(most) > row.budget:
                most -= 1  # the allocator's rounding and block slack come on top of the bytes
        b = n if most >= n else max([1] + [d for d in range(2, most + 1) if n % d == 0])
    elif n % batch:
        row.why = f"BATCH_SIZE={batch} does not divide the {n} sequences each GPU takes per step"
        return
    else:
        b = batch
    at_b = peaks(one, world, 1 if b == n else 2, (1,) if b == 1 else (2, 3))
    row.peak, row.where, _, storages, large = at_b.at(b)
    row.allocated, row.reserved, row.smi = allocator(row.peak, storages, large, gpu, context, cuda)
    row.states = at_b.states()
    if row.reserved > row.budget:
        row.why = f"b={b} peaks at {row.reserved / GIB:.1f} GiB reserved ({row.where})"
        return
    row.b, row.accum = b, n // b


def cost(row, one, gpu, world, mfu, peak_flops):
    """row's recompute share, what a step sends, its tokens and (with the GPU's FLOP/s) its step time."""
    b, k = row.b, row.accum
    steps, bs = 1 if k == 1 else 2, (1,) if b == 1 else (2, 3)
    at_b = peaks(one, world, steps, bs)
    per_micro_step = lambda p, name: p.ext.figure(name, b) // p.traced_steps * k  # noqa: E731
    flops = per_micro_step(at_b, "flops")  # FSDP's as it runs: its re-run does not stop early (checkpoint.py)
    # the model's FLOPs: one process's forward and backward, no recompute
    model = per_micro_step(peaks(replace(one, ckpt="none", ckpt_segment=0, ckpt_impl="hooks", shard="none",
                                         loss_chunks=1), 1, steps, bs), "flops")
    row.recompute, row.tokens = flops / model - 1, world * b * k * one.block_size
    row.sent = sent(one, at_b, world, b, k)
    tflops = gpu.tflops or ({p: peak_flops / 1e12 for p in PRECISIONS} if peak_flops else None)
    if tflops:
        fp8 = per_micro_step(at_b, "fp8_flops")
        rest = precision.decide(one).name if precision.decide(one).fp8 is None else "bf16"
        row.step_s = (fp8 / (tflops["fp8"] or 1) + (flops - fp8) / tflops[rest]) / 1e12 / mfu


def sent(cfg, peaks, world, b, k):
    """Bytes a step's collectives move per rank (the paper's volume, ledger/comm.py), as they were issued:
    DDP's all-reduce of its buckets (trace.DDP); ZeRO's from its optimizer step's trace; FSDP's from its
    trace, whose all-gathers a micro-step repeats (K of them a step) and whose reductions it does not."""
    if world == 1:
        return 0
    if cfg.shard == "none":
        return 2 * peaks.ext.figure("parameters", b) * (1 if cfg.fp32_grad_accum is False else 2)
    if cfg.shard in zero.STAGES:
        return max(comm.volume(peaks.steps[rank]["calls"]) for rank in peaks.ranks)
    return peaks.ext.figure("sent", b) + (k - peaks.traced_steps) * peaks.ext.figure("gathered", b)
