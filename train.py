"""The trainer: config, data, the loop, logging, snapshots. It composes the other files.

Chapter: all of it, run end to end. Read first: `Config` (every knob, each a make
variable in capitals), then `train`, which calls precision.py (master weights, loss
scaling), accumulate.py (micro-steps, no_sync), checkpoint.py (recompute) and
memory_ledger.py (predicted vs measured memory).

    python train.py --precision=bf16 --ckpt=full --accum=4
    torchrun --standalone --nproc_per_node=2 train.py --accum=4

Model save/resume is a *snapshot* here (checkpoint.py is activation checkpointing).
"""
import dataclasses
import gc
import hashlib
import inspect
import math
import os
import sys
import sysconfig
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

import accumulate
import checkpoint
import precision
from model import ATTN_CHOICES, GPT, GPTConfig

HERE = Path(__file__).resolve().parent


@dataclass
class Config:
    # data and output
    data: str = ""  # a text file or folder of text files; "" = this Python's standard library .py files
    out_dir: str = "out"
    seed: int = 1337
    device: str = "auto"  # auto|cpu|cuda
    # model
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 256
    dropout: float = 0.0
    bias: bool = True
    attn: str = "manual"  # manual|sdpa
    # batch and accumulation (accumulate.py)
    batch_size: int = 8  # micro-batch, sequences per rank per micro-step
    accum: int = 1  # micro-steps per optimizer step (K)
    total_batch_tokens: int = 0  # if > 0, derive accum from it
    loss_norm: str = "mean"  # mean|tokens
    no_sync: bool = True  # skip DDP's all-reduce on micro-steps 1..K-1
    fp32_grad_accum: bool = False  # sum micro-step gradients in FP32 buffers
    # optimizer
    max_iters: int = 500
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 20
    lr_decay_iters: int = 0  # 0 = max_iters
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    # precision (precision.py)
    precision: str = "bf16"  # fp32|bf16|fp16|fp8
    loss_scale: str = "auto"  # auto (dynamic for fp16, else none)|dynamic|none|<number>
    loss_scale_hysteresis: int = 1
    fp8_backend: str = "native"  # native (ours, precision.py)|te (Transformer Engine)
    fp8_recipe: str = "delayed"  # delayed (scale from an amax history)|current (from this tensor's amax)
    fp8_amax_history: int = 16  # amax history length for the delayed recipe
    fp8_margin: int = 0  # scale = (fp8_max / amax) / 2**margin
    fp8_grad: str = "bf16"  # bf16 (the chapter)|e5m2 (TE's HYBRID: gradients in FP8 E5M2)
    # activation checkpointing (checkpoint.py)
    ckpt: str = "none"  # none|full|sqrt|selective
    ckpt_segment: int = 0  # blocks per recompute unit for ckpt=sqrt; 0 = round(sqrt(n_layer))
    # logging, evaluation, snapshots
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    snapshot_interval: int = 0  # 0 = only at the end
    resume: bool = False
    sample_tokens: int = 200
    peak_flops: float = 0.0  # for MFU; 0 = a table on CUDA, a quick matmul measurement on CPU
    ledger: bool = True  # print predicted vs measured memory after the first step
    sample_only: bool = False  # load out_dir's snapshot, print a sample, train nothing


CHOICES = dict(device=("auto", "cpu", "cuda"), attn=ATTN_CHOICES, precision=precision.PRECISIONS,
               ckpt=checkpoint.CKPT_CHOICES, loss_norm=accumulate.LOSS_NORMS, fp8_backend=("native", "te"),
               fp8_recipe=("delayed", "current"), fp8_grad=("bf16", "e5m2"))
SNAPSHOT = "snapshot.pt"


class UsageError(Exception):
    """Bad input: main() prints it as one line and exits with status 2."""


# ---------------------------------------------------------------- the --key=value parser

def _convert(field, text):
    if field.type in (bool, "bool"):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"--{field.name} expects true|false, got {text!r}")
    kind = {"int": int, "float": float, "str": str}.get(field.type, field.type)
    try:
        return kind(text)
    except ValueError:
        raise UsageError(f"--{field.name} expects {kind.__name__}, got {text!r}") from None


def parse_args(argv):
    """Config from ["--key=value", ...]; a bare --flag sets a bool to true."""
    by_name = {f.name: f for f in fields(Config)}
    values = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}; use --key=value (see --help)")
        key, eq, text = arg[2:].partition("=")
        if key not in by_name:
            raise UsageError(f"unknown flag --{key} (see --help)")
        if not eq:
            if by_name[key].type not in (bool, "bool"):
                raise UsageError(f"--{key} needs a value: --{key}=...")
            text = "true"
        values[key] = _convert(by_name[key], text)
    cfg = Config(**values)
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise UsageError(f"--{key}={getattr(cfg, key)} is not one of {'|'.join(allowed)}")
    for key in ("batch_size", "accum", "max_iters", "log_interval", "eval_interval", "eval_iters"):
        if getattr(cfg, key) < 1:
            raise UsageError(f"--{key} must be >= 1, got {getattr(cfg, key)}")
    for key in ("learning_rate", "min_lr", "grad_clip", "weight_decay", "warmup_iters", "total_batch_tokens",
                "snapshot_interval", "sample_tokens", "peak_flops", "lr_decay_iters"):
        if getattr(cfg, key) < 0:
            raise UsageError(f"--{key} must be >= 0, got {getattr(cfg, key)}")
    try:
        model_config(cfg).validate()
        precision.LossScaler.from_config(cfg.loss_scale, cfg.precision)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.total_batch_tokens and cfg.accum != 1:
        raise UsageError("give --accum or --total_batch_tokens (which derives accum), not both")
    return cfg


def usage():
    lines = ["usage: python train.py [--key=value ...]   (make train KEY=value)", ""]
    for f in fields(Config):
        lines.append(f"  --{f.name}={f.default!r}".ljust(36) + f" {f.type if isinstance(f.type, str) else f.type.__name__}")
    return "\n".join(lines)


def model_config(cfg):
    return GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                     dropout=cfg.dropout, bias=cfg.bias, attn=cfg.attn)


# ---------------------------------------------------------------- data

def stdlib_files():
    """This Python's standard library .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())


def text_files(path):
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--data={path}: no such file or folder")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    if not files:
        raise UsageError(f"--data={path}: the folder holds no files")
    return files


def load_tokens(data, cache_dir=HERE / "data_cache"):
    """All bytes of the data as a uint8 array (vocab 256: a token is a byte).

    The default data is cached once as a memmap under data_cache/ (git-ignored);
    a --data path is read directly.
    """
    if data:
        return np.frombuffer(b"".join(f.read_bytes() for f in text_files(data)), dtype=np.uint8)
    files = stdlib_files()
    key = hashlib.sha1("\n".join(f"{f}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:12]
    cache = Path(cache_dir) / f"stdlib-{key}.u8"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache, lambda fh: fh.writelines(f.read_bytes() for f in files))
    return np.memmap(cache, dtype=np.uint8, mode="r")


def split_tokens(tokens, block_size, val_fraction=0.1):
    """(train, val): the last 10% is validation. Both must hold at least one window."""
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if len(train) <= block_size or len(val) <= block_size:
        raise UsageError(f"data too short: {len(tokens)} bytes give {len(train)} train / {len(val)} val, "
                         f"each needs more than block_size={block_size}")
    return train, val


class Batches:
    """Random (x, y) windows from a token array, drawn from a seeded generator.
    Its state is part of a snapshot, so a resumed run sees the same batches."""

    def __init__(self, tokens, block_size, batch_size, seed, device):
        self.tokens, self.block_size, self.batch_size, self.device = tokens, block_size, batch_size, device
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        ix = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.gen).tolist()
        chunk = np.stack([self.tokens[i:i + self.block_size + 1] for i in ix]).astype(np.int64)
        xy = torch.from_numpy(chunk)
        x, y = xy[:, :-1], xy[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()


# ---------------------------------------------------------------- device, peak FLOPs, memory

CUDA_PEAK_TFLOPS = {  # dense, per GPU (SXM parts), TFLOP/s. fp32 is plain FP32: TF32 is not enabled here
    "H200": {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979},
    "H100": {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979},
    "A100": {"fp32": 19.5, "bf16": 312, "fp16": 312, "fp8": 312},  # no FP8 units: fp8 runs as bf16
}


def peak_flops(cfg, device):
    """FLOP/s that MFU is measured against: cfg.peak_flops, a table on CUDA, or measured on CPU."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops
    if device.type == "cuda":
        words = torch.cuda.get_device_name(device).replace("-", " ").split()
        for key, table in CUDA_PEAK_TFLOPS.items():
            if key in words:
                return table[cfg.precision] * 1e12
        return 0.0  # unknown GPU: MFU not shown
    # CPU: time the kernel the model's Linears run (x @ W^T + b) in the parameter dtype, at
    # a size past cache effects. fp8's matmuls are measured as bf16, its backward's dtype.
    # (A square `a @ a` in fp16 takes a far slower path on CPU than addmm does.)
    dtype = precision.param_dtype(cfg.precision)
    n = 512 if dtype == torch.float16 else 1024  # fp16 matmuls crawl on CPU
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    x, w, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((2048, n), (n, n), (n,)))
    best = float("inf")
    for _ in range(5):  # the best of several: the machine's peak, not its noise
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * n * n / best


def memory_now(device):
    """(text, bytes) for the progress line: CUDA allocated/peak, or this process's RSS."""
    if device.type == "cuda":
        alloc, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
        return f"{alloc / 2**20:.0f}/{peak / 2**20:.0f} MiB", peak
    try:
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return f"{rss / 2**20:.0f} MiB rss", rss


# ---------------------------------------------------------------- snapshots (save/resume)

def write_atomically(path, write):
    """write(fh) into a temporary file beside `path`, fsync, then rename it over `path`:
    a crash mid-write leaves the previous file intact (or none), never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_snapshot(path, state):
    write_atomically(path, lambda fh: torch.save(state, fh))


SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "precision")


def read_snapshot(path):
    path = Path(path)
    if not path.exists():
        raise UsageError(f"no snapshot at {path} to resume or sample from; train first")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain data, no code
    except Exception as e:  # a foreign or damaged file
        raise UsageError(f"cannot read snapshot {path}: {type(e).__name__}") from None


def load_snapshot(path, cfg):
    """The snapshot at path, if it was written by a model of cfg's shape."""
    state = read_snapshot(path)
    keys = list(SHAPE_KEYS)
    if cfg.precision == "fp8":  # the FP8 state (TE's or our amax history) has its own shape
        keys += ["fp8_backend", "fp8_amax_history"]
    shape = {k: getattr(cfg, k) for k in keys}
    saved = {k: state.get("config", {}).get(k) for k in shape}
    if saved != shape:
        diff = ", ".join(f"{k}={saved[k]} (now {shape[k]})" for k in shape if saved[k] != shape[k])
        raise UsageError(f"--resume: snapshot {path} is from a different model: {diff}")
    return state


# ---------------------------------------------------------------- building and the loop

def lr_at(cfg, it):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def pick_device(cfg, local_rank=0):
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device=cuda but no CUDA device is available")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build(cfg, device=None):
    """Model (in its precision, with its recompute policy) and its optimizer, for cfg.
    Shared by the loop, bench.py, memory_ledger.py and the tests."""
    device = device or pick_device(cfg)
    try:
        torch.manual_seed(cfg.seed)
        model = GPT(model_config(cfg), linear_factory=precision.linear_factory(cfg))
        model.to(device=device, dtype=precision.param_dtype(cfg.precision))
        if cfg.precision == "fp8" and cfg.fp8_backend == "native" and (why := precision.fp8_matmul_error(device)):
            raise ValueError(f"precision=fp8 with fp8_backend=native: {why}")
        checkpoint.apply_policy(model, cfg.ckpt, cfg.ckpt_segment)
        scaler = precision.LossScaler.from_config(cfg.loss_scale, cfg.precision, cfg.loss_scale_hysteresis)
        opt = precision.MasterWeightOptimizer(model, cfg.precision, lr=cfg.learning_rate,
                                              weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2),
                                              grad_clip=cfg.grad_clip, loss_scaler=scaler,
                                              fp32_grad_accum=cfg.fp32_grad_accum)
    except ValueError as e:  # also AdamW's own checks (betas in [0, 1), a finite lr)
        raise UsageError(str(e)) from None
    return model, opt


def resolve_accum(cfg, world_size):
    if cfg.total_batch_tokens:
        try:
            return accumulate.accum_from_total_tokens(cfg.total_batch_tokens, cfg.batch_size, world_size,
                                                      cfg.block_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return cfg.accum


@torch.no_grad()
def estimate_loss(model, batches, iters, forward_context=nullcontext):
    model.eval()
    losses = []
    for _ in range(iters):
        with forward_context():  # TE's FP8 autocast, so evaluation runs in the precision trained in
            losses.append(model(*batches.next())[1].item())
    model.train()
    return sum(losses) / len(losses)


def train(cfg, log=print):
    """Train for cfg.max_iters optimizer steps; returns the list of per-step records.
    Under torchrun (RANK set) this is one rank of a DistributedDataParallel run:
    NCCL between GPUs, gloo between CPU processes."""
    accum = resolve_accum(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # bad input fails before any process group
    if "RANK" not in os.environ:
        return train_loop(cfg, log, accum, 0, pick_device(cfg), 1)
    import torch.distributed as dist
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        history = train_loop(cfg, log, accum, dist.get_rank(), device, dist.get_world_size())
        # the DDP wrapper sits in reference cycles: free it while its process group lives
        # (collected at interpreter exit instead, gloo's pending work can abort the process),
        # and leave together, so no rank tears gloo down while a peer still writes
        gc.collect()
        dist.barrier()
        return history
    finally:
        dist.destroy_process_group()


def train_loop(cfg, log, accum, rank, device, world_size):
    # bad input fails before anything is read or written: the model config, then the snapshot
    model, opt = build(cfg, device)
    out_dir = Path(cfg.out_dir)
    start_step, snap = 0, None
    if cfg.resume:
        snap = load_snapshot(out_dir / SNAPSHOT, cfg)
    train_tokens, val_tokens = split_tokens(load_tokens(cfg.data), cfg.block_size)
    # every rank draws its own batches; the validation stream is the same fixed one each eval
    batches = Batches(train_tokens, cfg.block_size, cfg.batch_size, cfg.seed + 1 + rank, device)
    torch.manual_seed(cfg.seed + 1000 + rank)  # dropout's stream, distinct per rank
    if snap is not None:
        try:
            model.load_state_dict(snap["model"])
            opt.load_state_dict(snap["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:  # a snapshot that does not fit this model
            raise UsageError(f"--resume: snapshot does not fit this run: {str(e).splitlines()[0]}") from None
        if len(snap["rng"]) != world_size:
            raise UsageError(f"--resume: the snapshot was written by {len(snap['rng'])} ranks, this run has "
                             f"{world_size}: each rank's data stream is in it")
        rng = snap["rng"][rank]
        batches.gen.set_state(rng["batch"])
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
        start_step = snap["step"]
    run_model = model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel
        # no buffer sync per forward: DDP would otherwise copy rank 0's buffers over every
        # rank's at each forward; the causal masks are constant, and FP8's per-step amax must
        # stay each rank's own until accumulate.py takes the max over ranks. (torch 2.13
        # deprecates broadcast_buffers for forward_sync_buffers, which still syncs once at
        # init: harmless here, every rank starts identical.)
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                          else {"broadcast_buffers": False})
        run_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                            **no_buffer_sync)
    master = rank == 0
    seqs, tokens_per_step = accumulate.effective_batch(cfg.batch_size, world_size, accum, cfg.block_size)
    flops_per_token = model.flops_per_token()
    hw_flops_per_token = flops_per_token + checkpoint.recompute_flops_per_token(model, cfg.ckpt, cfg.ckpt_segment)
    peak = peak_flops(cfg, device)
    if master:
        log(f"model: {model.num_params() / 1e6:.2f}M parameters, {cfg.n_layer} layers, width {cfg.n_embd}, "
            f"precision {cfg.precision}, ckpt {cfg.ckpt}, attn {cfg.attn}, device {device}")
        log(f"effective batch = micro-batch {cfg.batch_size} x world_size {world_size} x accum {accum} "
            f"= {seqs} sequences = {tokens_per_step} tokens per optimizer step")
        log(f"data: {len(train_tokens):,} train / {len(val_tokens):,} val bytes; "
            f"peak for MFU {peak / 1e12:.3g} TFLOP/s")
        out_dir.mkdir(parents=True, exist_ok=True)
    history = []
    t_last, tokens_since = time.perf_counter(), 0
    for step in range(start_step, cfg.max_iters):
        opt.set_lr(lr_at(cfg, step))
        micro = [batches.next() for _ in range(accum)]
        loss, stepped, grad_norm = accumulate.accumulation_step(run_model, opt, micro, cfg.loss_norm, cfg.no_sync)
        tokens_since += tokens_per_step
        history.append(dict(step=step + 1, loss=loss, stepped=stepped, grad_norm=grad_norm,
                            loss_scale=opt.scaler.loss_scale))
        if master and step == start_step and cfg.ledger:
            t_ledger = time.perf_counter()
            report_memory(cfg, model, opt, micro[0], device, log)
            t_last += time.perf_counter() - t_ledger  # a one-off measurement, not training time
        if master and ((step + 1) % cfg.log_interval == 0 or step + 1 == cfg.max_iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t_last
            tok_s = tokens_since / dt  # all ranks together
            n_steps = tokens_since // tokens_per_step
            per_device = tok_s / world_size  # MFU compares one device's work with one device's peak
            mfu = f"{100 * per_device * flops_per_token / peak:.1f}%" if peak else "n/a"
            hfu = f"{100 * per_device * hw_flops_per_token / peak:.1f}%" if peak else "n/a"
            mem_text, _ = memory_now(device)
            log(f"step {step + 1:5d} | loss {loss:.4f} | lr {lr_at(cfg, step):.2e} | {1000 * dt / n_steps:7.1f} ms/step"
                f" | {tok_s / 1e3:7.1f}k tok/s | MFU {mfu} HFU {hfu} | mem {mem_text}"
                f" | scale {opt.scaler.loss_scale:g} skipped {opt.scaler.skipped_steps}")
            t_last, tokens_since = time.perf_counter(), 0
        if master and (step + 1) % cfg.eval_interval == 0:
            t_eval = time.perf_counter()
            val = estimate_loss(model, Batches(val_tokens, cfg.block_size, cfg.batch_size, cfg.seed, device),
                                cfg.eval_iters, opt.forward_context)
            log(f"step {step + 1:5d} | val loss {val:.4f}")
            history[-1]["val_loss"] = val
            t_last += time.perf_counter() - t_eval  # evaluation is not training time
        last = step + 1 == cfg.max_iters
        if last or (cfg.snapshot_interval and (step + 1) % cfg.snapshot_interval == 0):
            state = snapshot_state(cfg, model, opt, batches, step + 1, device, world_size)  # every rank: it gathers
            if master:
                save_snapshot(out_dir / SNAPSHOT, state)
    if master and cfg.sample_tokens and start_step < cfg.max_iters:
        log("sample:\n" + sample(model, device, cfg.sample_tokens))
    return history


def snapshot_state(cfg, model, opt, batches, step, device, world_size=1):
    """Everything a bit-identical resume needs. Every rank has its own data and dropout
    streams, so the snapshot keeps each rank's RNG states (gathered to rank 0)."""
    rng = dict(batch=batches.gen.get_state(), torch=torch.get_rng_state())
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device).cpu()
    rngs = [rng]
    if world_size > 1:
        import torch.distributed as dist
        rngs = [None] * world_size
        dist.all_gather_object(rngs, rng)
    return dict(model=model.state_dict(), optimizer=opt.state_dict(), rng=rngs, step=step,
                config=dataclasses.asdict(cfg))


def report_memory(cfg, model, opt, batch, device, log):
    """Once, after the first step: the memory ledger's prediction next to a measurement."""
    import memory_ledger  # here, not at the top: memory_ledger imports train for its config
    try:
        log(memory_ledger.summary_after_first_step(cfg, model, opt, batch, device))
    except torch.cuda.OutOfMemoryError:  # it measures on a copy of the model: room for one, not two
        torch.cuda.empty_cache()
        log("memory ledger: skipped, no room for its copy of the model (run memory_ledger.py on its own)")


@torch.no_grad()
def sample(model, device, n_tokens, prompt=b"def "):
    """A short sample from the model, decoded as bytes (with its RNG state put back after)."""
    rng = torch.get_rng_state()
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out = model.generate(idx, n_tokens, temperature=0.8, top_k=50)[0].tolist()
    model.train()
    torch.set_rng_state(rng)
    return bytes(out).decode("utf-8", errors="replace")


def sample_from_snapshot(cfg):
    """Print a sample from out_dir/snapshot.pt, with the model shape it was trained with."""
    device = pick_device(cfg)
    snap = read_snapshot(Path(cfg.out_dir) / SNAPSHOT)
    saved = snap.get("config", {})
    cfg = dataclasses.replace(cfg, **{k: saved[k] for k in (*SHAPE_KEYS, "attn", "fp8_backend", "fp8_recipe",
                                                             "fp8_amax_history") if k in saved})
    model, _ = build(cfg, device)
    try:
        model.load_state_dict(snap["model"])
    except (RuntimeError, KeyError) as e:
        raise UsageError(f"snapshot does not fit its own config: {str(e).splitlines()[0]}") from None
    print(sample(model, device, cfg.sample_tokens or 200))


def main(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    try:
        cfg = parse_args(argv)
        sample_from_snapshot(cfg) if cfg.sample_only else train(cfg)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
