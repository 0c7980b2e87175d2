"""The trainer: the loop, evaluation, sampling, and the DDP lifecycle around them.

Chapter: all of it, run end to end. Read first: `train_loop`, which calls accumulate.py once per optimizer
step, then build.py (the precision, the model, the recompute policy and the optimizer, each decided once).
`python train.py --precision=bf16 --ckpt=full --accum=4`; under torchrun, DDP. Each protection is one line
here, marked `# guard:`, and lives in guards/ (cli.py: the command line and how a program ends;
clean_end.py: the rest). Model save/resume is a *snapshot* here (snapshot.py); checkpoint.py is activation
checkpointing.
"""
import gc
import math
import os
import resource
import signal
import sys
import time
import traceback
from contextlib import ExitStack, nullcontext
from pathlib import Path

from guards import cli

if __name__ == "__main__":  # before torch loads (seconds): a Ctrl-C there is one line too, not a traceback
    cli.from_the_start()

import torch
import torch.distributed as dist

import accumulate
import flops
import precision
import snapshot
from build import build, pick_device, wrap_ddp  # noqa: F401  (the tools and the tests build through train)
from config import RunError, UsageError
from data import Batches, load_tokens, split_tokens
from guards import clean_end



# ---------------------------------------------------------------- the loop

def lr_at(cfg, it):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def train_loop(cfg, log, accum, rank, device, world_size, train_tokens, val_tokens, snap=None, changes=None):
    """The loop: per optimizer step the learning rate, K micro-batches, one accumulation_step, then evaluation
    and a snapshot when due. snap: the snapshot a resume continues (changes: the keys its flags change)."""
    model, parts = build(cfg, device)
    # every rank draws its own batches; the validation stream is the same fixed one each evaluation
    batches = Batches(train_tokens, cfg.block_size, cfg.batch_size, cfg.seed + 1 + rank, device)
    torch.manual_seed(cfg.seed + 1000 + rank)  # dropout's stream, distinct per rank
    path, speaks, every_rank = Path(cfg.out_dir) / snapshot.FILE, rank == 0, cfg.shard == "fsdp"  # fsdp: eval gathers
    start = resume(snap, changes, model, parts, batches, rank, world_size, device, speaks and log, path) if snap else 0
    run_model = wrap_ddp(model, device) if world_size > 1 and cfg.shard == "none" else model  # ZeRO, FSDP: none
    report = Report(cfg, model, parts, device, world_size, accum, start, speaks and log)
    watch = clean_end.Divergence(parts.precision, parts.optimizer, path, start if snap else None)  # guard: one line
    history = []
    with watch.interruptible(cfg.max_iters):  # guard: Ctrl-C and SIGTERM say the step and the last snapshot
        for step in range(start, cfg.max_iters):
            parts.optimizer.set_lr(lr_at(cfg, step))
            scale = parts.scaler.loss_scale if parts.scaler else 1.0
            micro_batches = batches.micro_batches(accum, all_at_once=cfg.loss_norm == "tokens")
            loss, stepped, grad_norm = accumulate.accumulation_step(run_model, parts, micro_batches, cfg.loss_norm,
                                                                    cfg.no_sync)
            history.append(dict(step=step + 1, loss=loss, stepped=stepped, grad_norm=grad_norm, loss_scale=scale))
            report.after_step(step, loss)
            if (speaks or every_rank) and (step + 1) % cfg.eval_interval == 0:
                history[-1]["val_loss"] = report.evaluation(step, model, val_tokens)
            watch.after_step(step + 1, loss, stepped, scale)
            snapshot_due = step + 1 == cfg.max_iters or (cfg.snapshot_interval and (step + 1) % cfg.snapshot_interval == 0)
            if snapshot_due or (step + 1) % cfg.log_interval == 0:  # one host sync per log interval
                # guard: a good snapshot is replaced only by weights whose next forward is finite (the probe)
                watch.check(step + 1, cfg, snapshot_due and path.exists() and estimate_loss(model, val_tokens, cfg,
                                                                                            iters=1))
            if snapshot_due:
                state = snapshot.capture(cfg, model, parts, batches, step + 1, device, world_size)  # every rank
                if speaks:
                    snapshot.save(path, state)  # guard: atomic, a failed write keeps the previous one
                watch.saved_step = step + 1
    if (speaks or every_rank) and cfg.sample_tokens and start < cfg.max_iters:
        text = sample(model, device, cfg.sample_tokens, cfg.compile)  # every rank's forward under fsdp
        if speaks:
            log("sample:\n" + text)
    return history


def eager(compiled):
    """COMPILE compiles the training step only: evaluation, the probe and sampling run the blocks eagerly (each
    would compile graphs of its own: eval mode and no grad, a new length per sampled token)."""
    return torch.compiler.set_stance("force_eager") if compiled else nullcontext()


@torch.no_grad()
def estimate_loss(model, val_tokens, cfg, prec=None, iters=None):
    """The mean loss of `iters` (eval_iters) batches of the validation stream, the same fixed one each time, in
    eval mode: no dropout, no FP8 amax recorded. prec: its forward context (TE's FP8 autocast), None: none."""
    batches = Batches(val_tokens, cfg.block_size, cfg.batch_size, cfg.seed, next(model.parameters()).device)
    model.eval()
    with eager(cfg.compile), prec.forward_context(model) if prec else nullcontext():
        losses = [model(*batches.next())[1].item() for _ in range(iters or cfg.eval_iters)]
    model.train()
    return sum(losses) / len(losses)




@torch.no_grad()
def sample(model, device, n_tokens, compiled=False, prompt=b"def "):
    """A short sample from the model, decoded as bytes. It draws from the random stream: after the last
    snapshot, which keeps the stream as training left it."""
    model.eval()
    try:
        with eager(compiled):
            out = model.generate(torch.tensor([list(prompt)], device=device), n_tokens, temperature=0.8, top_k=50)
    except RuntimeError as e:  # torch.multinomial refuses inf or NaN probabilities: logits that overflowed
        raise RunError(f"no sample: the weights give inf or NaN probabilities ({str(e).splitlines()[0]})") from None
    model.train()
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def resume(snap, changes, model, parts, batches, rank, world_size, device, log, path):
    """Load the snapshot into this run (every rank); returns the step to continue from. A changed loss scaling
    (--loss_scale and the dynamic scale's keys) starts a fresh loss scaler, as its flags ask."""
    fresh = any(k.startswith("loss_scale") for k in changes)
    step = snapshot.restore(snap, model, parts, batches, rank, world_size, device, scaler=not fresh, path=path)
    if log:
        log(f"resumed at step {step}" + (": the flags given change " if changes else ", the snapshot's config as is")
            + ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changes.items())
            + ("; its loss scaler starts fresh" if fresh else ""))
    return step


# ---------------------------------------------------------------- what a run says

class Report:
    """What rank 0 says while the run runs (log=None on the others): the header, a progress line every
    log_interval steps (loss, ms/step, tokens/s, MFU and HFU, memory, FP16's loss scale), evaluation's line.
    On a GPU or under SHARD, ledger/live.py adds the memory ledger's view after the first step."""

    def __init__(self, cfg, model, parts, device, world_size, accum, start_step, log):
        self.cfg, self.parts, self.device, self.start, self.log = cfg, parts, device, start_step, log
        seqs, self.tokens_per_step = accumulate.effective_batch(cfg.batch_size, world_size, accum, cfg.block_size)
        self.flops_per_token = flops.per_token_formula(model, cfg) / world_size  # MFU's, one device's share
        # HFU's: more where recompute (or the loss in pieces) runs parts twice, counted on one real step
        self.hw_flops_per_token = self.flops_per_token if cfg.ckpt == "none" and cfg.loss_chunks == 1 else \
            flops.hardware_per_token(model, cfg, parts.precision) / world_size
        self.peak, source = flops.peak(cfg, parts.precision, model, device)
        self.live, self.model, self.world = None, model, world_size  # a GPU's allocator beside the ledger (ledger/live.py)
        if device.type == "cuda":
            from ledger import live
            self.live = live.Live(cfg, model, parts, device, world_size, start_step, log)
        self.t_last, self.tokens_since, (auto, why) = time.perf_counter(), 0, precision.native(device)
        if log:
            parameters, name = sum(p.numel() for p in model.parameters()) / 1e6, parts.precision.name
            log(f"model: {parameters:.2f}M parameters, {cfg.n_layer} layers, width {cfg.n_embd}, precision {name}, "
                f"ckpt {cfg.ckpt}, attn {cfg.attn}; device {device}: {why}\neffective batch = micro-batch "
                f"{cfg.batch_size} x world_size {world_size} x accum {accum} = {seqs} sequences = "
                f"{self.tokens_per_step} tokens per optimizer step\npeak for MFU {self.peak / 1e12:.3g} TFLOP/s "
                f"({source}); memory: `make ledger`")
        if log and (emulated := precision.emulated(parts.precision.name, device)):  # guard: a precision only emulated
            rate, fp32 = (flops.gemm_rate(model, cfg.batch_size * cfg.block_size, dtype, device)[0]
                          for dtype in (parts.precision.param_dtype, torch.float32))
            log(f"warning: {parts.precision.name.upper()} runs {fp32 / rate:.0f}x slower than FP32 here ({emulated}): at "
                f"least {self.flops_per_token * self.tokens_per_step / rate:.1f} s a step; PRECISION=auto is {auto} here")

    def after_step(self, step, loss):
        """step: 0-based, just done. Every log_interval steps (and the last): the progress line."""
        self.tokens_since += self.tokens_per_step
        if step == self.start and (self.cfg.compile or self.cfg.shard != "none") or self.live:
            self.first_step(step, loss)
        if not (self.log and self.tokens_since and ((step + 1) % self.cfg.log_interval == 0 or step + 1 == self.cfg.max_iters)):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt, tokens, scaler = time.perf_counter() - self.t_last, self.tokens_since, self.parts.scaler  # all ranks' tokens
        mfu, hfu = (flops.utilization(tokens / dt, f, self.peak) for f in (self.flops_per_token, self.hw_flops_per_token))
        self.t_last, self.tokens_since = time.perf_counter(), 0
        self.log(f"step {step + 1:5d} | loss {loss:.4f} | lr {self.parts.optimizer.torch_optimizer.param_groups[0]['lr']:.2e}"
                 f" | {1000 * dt * self.tokens_per_step / tokens:7.1f} ms/step | {tokens / dt / 1e3:7.1f}k tok/s | MFU "
                 f"{f'{100 * mfu:.1f}%' if mfu else 'n/a'}" + (f" HFU {100 * hfu:.1f}%" if hfu != mfu else "")
                 + f" | mem {memory_now(self.device)}"
                 + (f" | scale {scaler.loss_scale:g} skipped {scaler.skipped_steps}" if scaler else ""))

    def first_step(self, step, loss):
        """What the first step has to say. COMPILE: it compiled the blocks (build.compile_blocks) as it ran; its
        time is said on a line of its own, and tokens/s, MFU and ms/step count from the step after it. SHARD:
        each rank's states, measured (every rank measures its share, rank 0 says it). On a GPU, ledger/live.py
        (the ledger beside the CUDA allocator, after every step: the allocator's history of the first steps)."""
        if self.live:
            self.live.after_step(step)
        if step == self.start and self.cfg.shard != "none":
            import zero
            if line := zero.states_line(self.cfg, self.model, self.parts, self.world):
                self.log(line)
        if step != self.start or not self.cfg.compile:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.log:
            self.log(f"step {step + 1:5d} | loss {loss:.4f} | {time.perf_counter() - self.t_last:7.1f} s: "
                     f"torch.compile compiled {self.cfg.n_layer} blocks in this step (not in the timings below, "
                     f"which start at step {step + 2})")
        self.t_last, self.tokens_since = time.perf_counter(), 0

    def evaluation(self, step, model, val_tokens):
        """The validation loss, said; its time is not training time."""
        t_eval = time.perf_counter()
        val = estimate_loss(model, val_tokens, self.cfg, self.parts.precision)
        if self.log:
            self.log(f"step {step + 1:5d} | val loss {val:.4f}")
        self.t_last += time.perf_counter() - t_eval
        return val


def memory_now(device):
    """For the progress line: CUDA's allocated and peak bytes, or this process's peak RSS."""
    if device.type == "cuda":
        return f"{torch.cuda.memory_allocated(device) / 2**20:.0f}/{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB peak rss"


# ---------------------------------------------------------------- a run, from its command line

def train(cfg, log=print, given=None):
    """Train for cfg.max_iters optimizer steps; returns the per-step records. Under torchrun (RANK set), one rank
    of a data-parallel run: NCCL between GPUs, gloo between CPU processes. given: the keys named on the command
    line, which a resume takes over the snapshot's (None: every key off its default)."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size, device = int(os.environ.get("WORLD_SIZE", 1)), pick_device(cfg, local_rank)
    if cfg.shard != "none" and world_size == 1:
        raise UsageError(f"--shard={cfg.shard} splits the run's states over its ranks, and this run has one: start "
                         f"it with torchrun (make ddp NPROC=2 SHARD={cfg.shard})")
    if cfg.memory_snapshot and device.type != "cuda":
        raise UsageError("--memory_snapshot records the CUDA allocator's history: it needs a CUDA device")
    if cfg.compile:
        from guards.compiling import compile_error
        if why := compile_error(device):
            raise UsageError(why)
    with ExitStack() as held:
        if rank == 0:  # guard: one run per out_dir, which must take a file; what a killed run of ours left goes
            held.enter_context(clean_end.out_dir_held(cfg.out_dir, ours=(snapshot.FILE, clean_end.MEMORY_HISTORY)))
        else:  # rank 0 holds it now: look without making anything
            clean_end.check_reachable(cfg.out_dir, "--out_dir")
        snap, changes = None, {}
        if cfg.resume:  # guard: a snapshot is input, checked as it is read (snapshot.py)
            snap = snapshot.read(Path(cfg.out_dir) / snapshot.FILE)
            cfg, changes = snapshot.continued(snap, cfg, given, Path(cfg.out_dir) / snapshot.FILE)
        clean_end.check_fits(cfg, device)  # guard: parameters alone past the memory, refused in a second
        accum = accumulate.micro_steps(cfg, world_size, clean_end.memory_available())
        tokens = split_tokens(load_tokens(cfg.data), cfg.block_size)
        held.enter_context(clean_end.within_memory(device))  # guard: a step past the memory is one line
        if world_size == 1:
            return train_loop(cfg, log, accum, 0, device, 1, *tokens, snap, changes)
        if rank != 0:  # it writes nothing, so has nothing to unwind: a signal ends it at once, even in a collective
            held.enter_context(cli.signals_handled(signal.SIG_DFL))
        return train_ddp(cfg, log, accum, device, tokens, snap, changes)


def train_ddp(cfg, log, accum, device, tokens, snap, changes):
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with cli.signals_handled(signal.SIG_DFL):  # torchrun's SIGTERM must not wait out the rendezvous
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        with clean_end.lost_ranks_named():  # guard: a rank killed mid-run is named in one line
            history = train_loop(cfg, log, accum, dist.get_rank(), device, dist.get_world_size(), *tokens, snap,
                                 changes)
            # free the DDP wrapper (in reference cycles) while its process group lives, or gloo's pending
            # work can abort the process at exit; and leave together, so no rank tears gloo down early
            gc.collect()
            dist.barrier()
        return history
    except BaseException as e:  # the same for a run that stops: its frames hold the wrapper (freed later, gloo hangs)
        traceback.clear_frames(e.__traceback__)
        gc.collect()
        raise
    finally:
        dist.destroy_process_group()


def sample_from_snapshot(cfg, given):
    """Print a sample from out_dir/snapshot.pt, with the model it was trained with (the snapshot's: of the keys
    given, only these apply)."""
    reads = ("device", "out_dir", "sample_tokens", "seed")
    if ignored := given - {"sample_only", *reads}:
        raise UsageError(f"--sample_only takes its model from the snapshot in out_dir: --{', --'.join(sorted(ignored))} "
                         f"would be ignored; only --{', --'.join(sorted(reads))} apply")
    device, path = pick_device(cfg), Path(cfg.out_dir) / snapshot.FILE
    snap = snapshot.read(path)
    cfg, _ = snapshot.continued(snap, cfg, given, path)
    model, parts = build(cfg, device)
    snapshot.load_model(snap, model, path, parts.precision.fp8)
    try:
        print(sample(model, device, cfg.sample_tokens or 200))
    except RunError as e:  # the snapshot's weights are this program's input
        raise UsageError(f"snapshot {path} is not usable: {e}") from None


def program(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(cli.usage("train.py"))
        return 0
    cfg, given = cli.parse_args(argv), cli.given(argv)
    sample_from_snapshot(cfg, given) if cfg.sample_only else train(cfg, given=given)


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
