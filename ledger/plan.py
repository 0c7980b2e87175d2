"""Will it fit? Every configuration of a model that fits a GPU, its largest micro-batch and what it
costs, from the exact peak walk. tools/plan.py (`make plan`) prints them, fastest first.

Chapter section 4 ("the whole picture"), put to work: which precision, recompute policy and sharding
fit a given GPU. Read first: memory_ledger.peak_walk and ledger/shard.py (one rank's step, walked),
then `Peaks` (one configuration's peak as a function of the micro-batch), then `plan`.

Nothing is built: the description is walked (ledger/walk.py); model.GPT only on the meta device, for
its parameters' shapes and its FLOPs. What makes the answer exact and cheap (tests/test_plan.py
holds each; docs/plan.md says more):
  - a walk has the same points at every micro-batch b >= 2, each x + b*y bytes: every tensor the
    walk counts has a batch dimension or none (b = 1 walks other points: one sequence makes some
    copies views). So the walks at b = 2 and 3 give every point at every b, and the largest b that
    fits is min over the points of (budget - x) // y: solved, not searched;
  - DDP, ZeRO-1 and ZeRO-2 run the same forward and backward; a rank differs in what it holds all
    step and in its optimizer step (ledger/step.walk_before, tail): one walk serves every rank;
  - with K > 1 micro-steps a later one starts with .grad alive: such a step is walked with two
    (micro_steps=2); a step of one micro-step peaks no higher.
The FSDP rows are the textbook ZeRO-3 walk (memory_ledger.peak_walk(cfg, N)), an estimate: FSDP2's
own buffers are not described.
"""
import difflib
import functools
import re
from dataclasses import dataclass, replace

import numpy as np
import torch

import checkpoint
import flops
import memory_ledger as ml
import precision
import zero
from config import ATTENTIONS, PRECISIONS, SHARDS, Config, UsageError, validate
from ledger import shard as ls
from ledger import step
from ledger.measure import MIN_BLOCK, SMALL_SIZE
from model import GPT

MIB, GIB = 2 ** 20, 2 ** 30

# memory.total as nvidia-smi prints it (MiB), and PyTorch's "total capacity" (what CUDA gives a process,
# printed by its out-of-memory error, GiB to 2 places) where a public log shows one. The difference is
# what the driver keeps; where no log shows it, the largest seen (768 MiB) is taken.
GPUS = {  # name: (flops.CUDA_PEAK_TFLOPS key, nvidia-smi MiB, CUDA's total GiB or None, where the figures are from)
    "H200": ("H200", 143771, None, "nvidia-smi on H200 141GB machines in public logs"),
    "H100": ("H100", 81559, 79.11, "nvidia-smi: modal-labs/modal-client#2797; CUDA: vllm-project/vllm#27508"),
    "A100-80GB": ("A100", 81920, 79.25, "nvidia-smi: modal-labs/modal-client#2797; CUDA: levihsu/OOTDiffusion#235"),
    "A100-40GB": ("A100", 40960, 39.50, "nvidia-smi: modal-labs/modal-client#2797; CUDA: TianheWu/CoSeR#10"),
    "L40S": ("L40S", 46068, None, "nvidia-smi: modal-labs/modal-client#2797"),
    "RTX4090": ("4090", 24564, 23.68, "nvidia-smi on RTX 4090 machines in public logs; CUDA: zai-org/CogVideo#36"),
    "L4": ("L4", 23034, None, "nvidia-smi: modal-labs/modal-client#2797"),
}
DRIVER_MIB_WHEN_UNKNOWN = 768  # the largest driver reserve of the four GPUs above with both figures (A100-80GB)
CONTEXT_MIB = 400  # the CUDA context with lazy module loading (CUDA >= 11.7): ~400 MB, pytorch/pytorch#109888
# cuBLAS's workspaces, taken from PyTorch's allocator per handle and stream: 4096 KiB x 8 on sm90 (Hopper),
# else 2 x 4096 KiB + 8 x 16 KiB (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize), one
# for the main thread and one for autograd's, which runs backward (ledger/run.blas_workspaces measures them)
WORKSPACE = {"sm90": 2 * 4096 * 1024 * 8, "other": 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)}
HOPPER = ("H200", "H100")
MFU = 0.40  # the utilization of the GPU's peak the step time assumes, stated, not measured
TARGET_TOKENS = 2 ** 19  # the default target batch, tokens per optimizer step (nanoGPT's GPT-2 run: 524,288)
SIZE = re.compile(r"([0-9]+(?:[.][0-9]+)?)(GiB|GB|MiB|MB)", re.IGNORECASE)
UNITS = {"gib": GIB, "gb": 10 ** 9, "mib": MIB, "mb": 10 ** 6}
LARGEST = 2 ** 50  # bytes: a GPU given by size is at most 1 PiB (the walk's figures are 64-bit integers)


@dataclass(frozen=True)
class GPU:
    """A GPU the plan fits into: its name, the bytes CUDA reports (total), what the driver keeps
    beyond that (driver), its peak TFLOP/s per precision (None: given by size), the figures' source,
    and cuBLAS's workspaces there (the larger, sm90's, for a GPU given by size)."""
    name: str
    total: int
    driver: int
    tflops: dict
    source: str
    workspace: int = WORKSPACE["sm90"]


def find_gpu(text):
    """A GPU of GPUS by name (any case), or one given by its size ("24GiB", "80GB": what CUDA reports)."""
    size = SIZE.fullmatch(text.replace(" ", ""))
    if size:
        number, unit = size.group(1), UNITS[size.group(2).lower()]
        if float(number) * unit > LARGEST:  # (a number past float's range is inf: refused too)
            raise UsageError(f"--gpu={text}: this planner takes a GPU of at most {LARGEST // GIB:,} GiB")
        return GPU(text, int(float(number) * unit), 0, None, "given")
    if re.fullmatch(r"[-+.0-9eE]+\s*[A-Za-z]*", text.strip()):
        raise UsageError(f"--gpu={text}: a size is a positive number and GiB, GB, MiB or MB (24GiB, 80GB), "
                         f"or name a GPU of the table ({', '.join(GPUS)})")
    names = {name.lower(): name for name in GPUS}
    name = names.get(text.lower().replace(" ", ""))
    if name is None:
        nearest = [n for n in GPUS if n.lower().startswith(text.lower())] or \
            difflib.get_close_matches(text.upper(), list(GPUS), 1, 0.3)
        raise UsageError(f"--gpu={text} is no GPU of the table ({', '.join(GPUS)})"
                         + (f"; the nearest is {' or '.join(nearest)}" if nearest else "")
                         + ", nor a size such as 24GiB")
    key, smi_mib, cuda_gib, source = GPUS[name]
    driver = smi_mib * MIB - int(cuda_gib * GIB) if cuda_gib else DRIVER_MIB_WHEN_UNKNOWN * MIB
    return GPU(name, smi_mib * MIB - driver, driver, flops.CUDA_PEAK_TFLOPS[key], source,
               WORKSPACE["sm90" if name in HOPPER else "other"])


# ---------------------------------------------------------------- one configuration, every micro-batch

class Peaks:
    """One configuration's step, walked on every rank that differs (ZeRO's slices), as a function of
    the micro-batch b. SHARD=none is DDP when world > 1 (its buckets held all step), one process when
    world = 1; fsdp is the ZeRO-3 estimate. micro_steps: 2 walks a later micro-step too (K > 1)."""

    def __init__(self, cfg, world, micro_steps=1, befores=None):
        self.cfg, self.world, self.micro_steps = cfg, world, micro_steps
        self.befores = {} if befores is None else befores  # walks shared with the other shardings
        self.ranks = list(differing_ranks(cfg, world)) if cfg.shard in zero.STAGES else [0]

    def before(self, b):
        """step.Before at micro-batch b: the walk up to the optimizer step, the same on every rank (the
        one of two micro-steps read off the walk of two where there is one)."""
        cfg = replace(self.cfg, batch_size=b)
        grads_split = self.world if cfg.shard == "fsdp" else 1
        key = (repr(replace(cfg, shard="none")), grads_split)
        if (key, 2) in self.befores and self.micro_steps == 1:
            self.befores[key, 1] = self.befores[key, 2].first_micro_step()
        if (key, self.micro_steps) not in self.befores:
            self.befores[key, self.micro_steps] = step.walk_before(lambda optimizer: ml.peak_walk(
                cfg, grads_split, static=0, optimizer=optimizer, micro_steps=self.micro_steps))
        return self.befores[key, self.micro_steps]

    @functools.cached_property
    def tails(self):
        """Per rank: (static bytes less the batch's, the optimizer step's points less the bytes alive as
        it starts, their places, storages alive at its peak). Walked once: the optimizer step moves
        parameter-sized tensors only, so at every b it is these points on top of what is alive then."""
        cfg = replace(self.cfg, batch_size=2)  # any b: 2 is walked anyway
        before, out = self.before(2), []
        for rank in self.ranks:
            static = ls.rank_static(cfg, cfg.shard, self.world, rank) - ml.input_bytes(cfg)
            tail = step.tail(before, 0, ls.optimizer_walk(cfg, cfg.shard, self.world, rank))
            grads_alive = tail.parts.get("parameter gradients", 0) > 0  # one entry in the tail: count each .grad
            counted = tail.peak_count + (ml.param_count(cfg)[1] - 1) * grads_alive
            offsets = np.asarray(tail.totals, dtype=np.int64) - before.alive
            out.append((static, int(offsets.max()), tail.steps[int(offsets.argmax())], counted))
        return out

    def points(self, b):
        """(the shared points, their places, per rank (its static bytes, its optimizer step's peak)) at b."""
        before, batch = self.before(b), ml.input_bytes(replace(self.cfg, batch_size=b))
        return (np.asarray(before.totals, dtype=np.int64), before.steps,
                [(static + batch, static + batch + before.alive + top) for static, top, _, _ in self.tails])

    @functools.cached_property
    def lines(self):
        """The points as lines, x + b*y bytes at b >= 2, from b = 2 and 3: the shared points', then per
        rank its static bytes' and its optimizer step's peak. None where b = 2 and 3 walk different
        points or a point shrinks as b grows (then: whole walks)."""
        (t2, s2, r2), (t3, s3, r3) = self.points(2), self.points(3)
        if s2 != s3:
            return None
        line = lambda at2, at3: (at2 - 2 * (at3 - at2), at3 - at2)  # noqa: E731
        shared = line(t2, t3)
        ranks = [(line(a[0], c[0]), line(a[1], c[1])) for a, c in zip(r2, r3)]
        if (shared[1] < 0).any() or any(y < 0 for pair in ranks for _, y in pair):
            return None
        return shared, ranks

    def at(self, b):
        """(peak bytes, where, rank) at micro-batch b: the highest point of the highest rank."""
        if b >= 2 and self.lines:  # read off the lines: no walk at b
            (x, y), ranks = self.lines
            shared, steps = x + b * y, self.before(2).steps
            ranks = [(xs + b * ys, xt + b * yt) for (xs, ys), (xt, yt) in ranks]
        else:
            shared, steps, ranks = self.points(b)
        i, tops = int(shared.argmax()), []
        for rank, (static, top), (_, _, where, _) in zip(self.ranks, ranks, self.tails):
            tops += [(int(static + shared[i]), steps[i], rank), (int(top), where, rank)]
        return max(tops, key=lambda top: top[0])

    def largest(self, budget, limit=1 << 20):
        """The largest micro-batch whose peak fits `budget` bytes (0: not even one sequence), at most limit."""
        if self.lines is not None:
            (x, y), ranks = self.lines
            best = min([_most(x + xs, y + ys, budget, limit) for xs, ys in {r[0] for r in ranks}] +
                       [_most(np.array([xt]), np.array([yt]), budget, limit) for _, (xt, yt) in ranks])
            if best >= 2:
                return best
            return 1 if self.at(1)[0] <= budget else 0
        lo, hi = 0, 1  # the points depend on b after all: bisect over whole walks
        while hi <= limit and self.at(hi)[0] <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.at(mid)[0] <= budget else (lo, mid)
        return lo

    def storages(self):
        """Storages alive at the peak, at most (the walk's, each rank's static ones) and how many of them
        may exceed 1 MiB: what the CUDA allocator's rounding and block slack are bounded by."""
        dynamic = max([self.before(b).peak_count for b in (2, 3)] + [counted for *_, counted in self.tails])
        count, large = max(static_storages(self.cfg, self.world, rank) for rank in self.ranks)
        return count + dynamic, large + dynamic


def differing_ranks(cfg, world):
    """The first ZeRO rank of each kind: ranks whose slices cut the same pieces (their lengths, matrix
    or not, in order) hold and step alike, so one of them is walked. Most hold one piece of one matrix."""
    return _first_of_each_kind(ls.param_sizes(cfg), tuple(len(s) >= 2 for s in ls.param_shapes(cfg)), world)


@functools.lru_cache(maxsize=16)
def _first_of_each_kind(sizes, matrices, world):
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


def static_storages(cfg, world, rank):
    """(storages, those over 1 MiB) of what rank `rank` holds all step: each state of each parameter
    (ZeRO: the flat buffer and the pieces of its slice; fsdp: 1/N of each), the buffers, the batch
    (taken as large), DDP's buckets (25 MiB each, the first 1 MiB: DistributedDataParallel's bucket_cap_mb)."""
    key = (repr(cfg), world, rank)
    if key not in _COUNTED:
        _COUNTED[key] = _static_storages(cfg, world, rank)
    return _COUNTED[key]


_COUNTED = {}  # static_storages' answers: every rank of every configuration asks


def _static_storages(cfg, world, rank):
    rec = precision.recipe(cfg)
    e, P = rec.element_bytes, ml.param_count(cfg)[0]
    per_element = [4] * (2 + rec.master_weights + (cfg.fp32_grad_accum and rec.master_weights))
    sizes = ls.param_sizes(cfg)
    if cfg.shard in zero.STAGES:
        pieces = [p.length for p in ls.slice_pieces(sizes, world, rank)]
        held = [(e, P)] + [(4, n) for n in pieces for _ in per_element[:3]]
    else:
        held = [(c, n // (world if cfg.shard == "fsdp" else 1)) for n in sizes for c in [e] + per_element]
    if cfg.shard == "none" and world > 1:
        held += [(1, MIB)] + [(1, 25 * MIB)] * -(-e * P // (25 * MIB))
    buffers = [info["numel"] for scope in (0, "embedding", "head") for info in ml.held(cfg, "buffer", scope)
               for _ in range(cfg.n_layer if scope == 0 else 1)]
    nbytes = [c * n for c, n in held] + buffers + [SMALL_SIZE + 1] * 2
    return len(nbytes), sum(n > SMALL_SIZE for n in nbytes)


# ---------------------------------------------------------------- what each configuration costs

@functools.lru_cache(maxsize=8)
def _meta_model(shape, fp8_linears, dropout):
    cfg = Config(**dict(zip(ls.SHAPE_KEYS, shape)), precision="fp8" if fp8_linears else "bf16", dropout=dropout)
    with torch.device("meta"):
        return GPT(cfg, linear_factory=precision.recipe(cfg).linear_factory())


def flops_per_token(cfg):
    """(model FLOPs, recompute FLOPs, FLOPs in FP8) per token: model.GPT.flops_per_token and
    checkpoint.recompute_flops_per_token, on the model built on the meta device; under fp8 the
    blocks' Linears' forward (2 per weight) runs in FP8, the rest (backward too) in BF16."""
    rec = precision.recipe(cfg)
    model = _meta_model(tuple(getattr(cfg, k) for k in ls.SHAPE_KEYS), rec.fp8 is not None, cfg.dropout)
    fp8_part = 2 * sum(p.numel() for p in model.h.parameters() if p.dim() == 2) if rec.fp8 else 0
    again = checkpoint.recompute_flops_per_token(model, checkpoint.policy(cfg), checkpoint.rerun_stops_early(cfg, rec))
    return model.flops_per_token(), again, fp8_part


@dataclass
class Row:
    """One configuration of the plan: its recipe (PRECISION's name), ckpt, shard and attn. b, accum:
    the micro-batch and the micro-steps to the target batch; peak and budget in bytes; sent: bytes a
    step's collectives move (the paper's volume); step_s: the predicted step time (None without the
    GPU's FLOP/s); why: what stops it, or None."""
    recipe: str
    ckpt: str
    shard: str
    attn: str
    b: int = 0
    accum: int = 0
    peak: int = 0
    budget: int = 0
    where: str = ""
    recompute: float = 0.0
    sent: int = 0
    step_s: float = None
    tokens: int = 0
    why: str = None
    estimate: bool = False
    states: int = 0  # of the peak, what the rank holds all step: its states, buffers and batch

    @property
    def tokens_per_s(self):
        return self.tokens / self.step_s if self.step_s else None


SEARCHED = ("precision", "ckpt", "shard", "attn")  # the keys a plan varies, in Row's order


def configurations(world):
    """Every (precision, ckpt, shard, attn) to try: every sharding only over more than one rank."""
    return [(p, c, s, a) for p in PRECISIONS for c in checkpoint.POLICIES for s in SHARDS for a in ATTENTIONS
            if world > 1 or s == "none"]


def plan(cfg, gpu, world, target_tokens, fixed=None, mfu=MFU, context=CONTEXT_MIB * MIB):
    """[Row] for cfg's shape on `world` GPUs of `gpu` (a GPU), fastest first, then those that do not
    fit or run, each with why. fixed: {key: value} of SEARCHED not to vary. On device cpu the budget
    is gpu.total exactly (no CUDA context, no allocator)."""
    cuda, befores, rows = cfg.device != "cpu", {}, []
    n = target_tokens // (world * cfg.block_size)  # micro-batch x K: sequences per rank per step
    for combo in configurations(world):
        if any(fixed and k in fixed and fixed[k] != v for k, v in zip(SEARCHED, combo)):
            continue
        row, one = Row(*combo), replace(cfg, **dict(zip(SEARCHED, combo)), batch_size=1, accum=1,
                                        total_batch_tokens=0, device="cuda" if cuda else "cpu")
        rows.append(row)
        try:
            validate(one)
            checkpoint.policy(one)
        except UsageError as e:
            row.why = re.split(r"[:;(]", str(e))[0].strip().lstrip("-")
            continue
        rec = precision.recipe(one)
        if gpu.tflops is not None and gpu.tflops[rec.name] is None:
            row.why = f"does not run: {gpu.name} has no {rec.name.upper()} units"
            continue
        fit(row, one, gpu, world, n, befores, cuda, context)
        row.recompute, row.estimate = recompute_share(one), row.shard == "fsdp"
        row.tokens, row.sent = world * row.b * row.accum * cfg.block_size, ls.step_bytes(one, row.shard, world,
                                                                                          row.accum)
        peak_tflops = gpu.tflops or ({p: cfg.peak_flops / 1e12 for p in PRECISIONS} if cfg.peak_flops else None)
        if row.why is None and peak_tflops:
            row.step_s = row.b * row.accum * cfg.block_size * seconds_per_token(one, peak_tflops) / mfu
    return sorted(rows, key=lambda r: (r.why is not None, -(r.tokens_per_s or 0), r.recompute, r.sent,
                                       -(r.budget - r.peak)))


def recompute_share(cfg):
    model_f, again_f, _ = flops_per_token(cfg)
    return again_f / model_f


def seconds_per_token(cfg, peak_tflops):
    """At 100% of the peak: the FP8 FLOPs at FP8's peak, the rest (all of it but under fp8) at the
    precision's own (fp8: BF16's, its backward's)."""
    rec = precision.recipe(cfg)
    model_f, again_f, fp8_f = flops_per_token(cfg)
    in_fp8 = fp8_f / peak_tflops["fp8"] if fp8_f else 0.0
    return (in_fp8 + (model_f + again_f - fp8_f) / peak_tflops["bf16" if rec.fp8 else rec.name]) / 1e12


def fit(row, one, gpu, world, n, befores, cuda, context):
    """Fill row's micro-batch and micro-steps (the largest b dividing n, the sequences per rank per step,
    whose peak fits; walked with a later micro-step where b < n: K > 1), its peak and states (where
    nothing fits: the states, or the peak at b = 1) and its budget."""
    allocator = gpu.total - context if cuda else gpu.total
    row.states = ls.rank_static(one, one.shard, world, 0)
    row.budget = allocator
    if row.states > allocator:
        row.why = f"states alone {row.states / GIB:.1f} GiB"
        return
    later, one_step = Peaks(one, world, 2, befores), Peaks(one, world, 1, befores)
    row.budget = budget(later, gpu, context, cuda)
    most = later.largest(row.budget) if n > 1 else 1
    if most >= n:  # one micro-step holds the whole batch: K = 1, which peaks no higher than K = 2
        row.b, row.accum = n, 1
    else:
        row.b = max((d for d in range(1, most + 1) if n % d == 0), default=0)
        row.accum = n // row.b if row.b else 0
    row.peak, row.where, _ = (one_step if row.accum == 1 else later).at(max(row.b, 1))
    row.states += ml.input_bytes(replace(one, batch_size=max(row.b, 1))) - ml.input_bytes(one)
    if row.b == 0 or row.peak > row.budget:  # the second: n = 1, one sequence in one micro-step
        row.b = row.accum = 0
        row.why = f"b=1 peaks at {row.peak / GIB:.1f} GiB ({row.where})"


def budget(peaks, gpu, context, cuda=True):
    """The bytes a peak may reach on `gpu`: its total less the CUDA context, cuBLAS's workspaces and
    allocator_bound; on CPU its bytes as given (ledger/measure.py counts live storages: nothing else)."""
    return gpu.total - context - gpu.workspace - allocator_bound(peaks) if cuda else gpu.total


def allocator_bound(peaks):
    """What CUDA's caching allocator may count beyond the storages alive at peaks' highest point: each
    rounded up to 512 bytes, one over 1 MiB in a block up to 1 MiB larger (ledger/measure.allocator_bounds)."""
    count, large = peaks.storages()
    return (MIN_BLOCK - 1) * count + SMALL_SIZE * large


def largest_micro_batch(cfg, nbytes, world=1, micro_steps=1):
    """The largest micro-batch of cfg (its shard, over `world` ranks) whose peak fits `nbytes`: the
    what-if's (ledger/parallel.what_if) and the plan's one solve (Peaks.largest)."""
    return Peaks(cfg, world, micro_steps).largest(nbytes)
