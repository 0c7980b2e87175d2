"""The trainer: the DDP lifecycle, the loop, evaluation, sampling.

Chapter: all of it, run end to end. Read first: `train_loop`, which calls accumulate.py once per
optimizer step, then build.py (the precision decisions, the model, the recompute policy and the optimizer,
each decided once). `python train.py --precision=bf16 --ckpt=full --accum=4`; under torchrun, DDP.
Model save/resume is a *snapshot* here (snapshot.py); checkpoint.py is activation checkpointing.
"""
import dataclasses
import gc
import math
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

from guards import interrupts

if __name__ == "__main__":  # before torch loads (seconds): a Ctrl-C there is one line too, not a traceback
    interrupts.from_the_start()

import torch
import torch.distributed as dist

import accumulate
import config
import snapshot
from build import build, pick_device, wrap_ddp  # noqa: F401  (the tools and the tests build through train)
from config import RunError, UsageError
from data import Batches
from guards import clean_end, cli, snapshot_fields
from guards.compiling import eagerly
from guards.preflight import check_saved_policy, preflight, resolve_accum, scaler_asked_anew
from guards.report import Report


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


@eagerly  # COMPILE compiles the training step only (guards/compiling.py)
@torch.no_grad()
def estimate_loss(model, batches, iters, prec):
    model.eval()
    losses = []
    for _ in range(iters):
        with prec.forward_context(model):  # TE's FP8 autocast, so evaluation runs in the precision trained in
            losses.append(model(*batches.next())[1].item())
    model.train()
    return sum(losses) / len(losses)


def train(cfg, log=print):
    """Train for cfg.max_iters optimizer steps; returns the per-step records. Under torchrun (RANK set),
    one rank of a DistributedDataParallel run: NCCL between GPUs, gloo between CPU processes."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    accum = resolve_accum(cfg, config.world_size())
    device = pick_device(cfg, local_rank)
    with ExitStack() as held:  # rank 0's lock on out_dir, for the run's whole life
        start = preflight(cfg, device, rank, held)  # bad input fails here, on every rank, before any process group
        if "RANK" not in os.environ:
            return train_loop(cfg, log, accum, 0, device, 1, start)
        if rank != 0:  # it writes nothing, so has nothing to unwind: a signal ends it at once, even in a collective
            held.enter_context(interrupts.signals_handled(signal.SIG_DFL))
        return train_ddp(cfg, log, accum, device, start)


def train_ddp(cfg, log, accum, device, start):
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with interrupts.signals_handled(signal.SIG_DFL):  # torchrun's SIGTERM must not wait out the rendezvous
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        with clean_end.lost_ranks_named():  # a rank killed mid-run is named in one line, not gloo's traceback
            history = train_loop(cfg, log, accum, dist.get_rank(), device, dist.get_world_size(), start)
            # free the DDP wrapper (in reference cycles) while its process group lives, or gloo's pending
            # work can abort the process at exit; and leave together, so no rank tears gloo down early
            gc.collect()
            dist.barrier()
        return history
    finally:
        dist.destroy_process_group()


def train_loop(cfg, log, accum, rank, device, world_size, start):
    """The loop: per optimizer step the learning rate, K micro-batches, one accumulation_step, then
    evaluation and snapshots when due. `report` says what the run does; `guard` stops it cleanly."""
    snap, train_tokens, val_tokens = start
    model, parts = build(cfg, device)
    # every rank draws its own batches; the validation stream is the same fixed one each evaluation
    batches = Batches(train_tokens, cfg.block_size, cfg.batch_size, cfg.seed + 1 + rank, device)
    torch.manual_seed(cfg.seed + 1000 + rank)  # dropout's stream, distinct per rank
    start_step = resume(cfg, snap, model, parts, batches, rank, world_size, device, log) if snap else 0
    run_model = wrap_ddp(model, device) if world_size > 1 and cfg.shard == "none" else model  # ZeRO, FSDP: no wrapper
    master, every_rank = rank == 0, cfg.shard == "fsdp"  # FSDP's forward gathers: evaluation is a collective
    report = Report(cfg, model, parts, device, world_size, accum, start_step,
                               (len(train_tokens), len(val_tokens)), log, rank)
    probe_batch = Batches(val_tokens, cfg.block_size, cfg.batch_size, cfg.seed, device).next()
    guard = clean_end.Guard(cfg, model, parts, probe_batch, device, world_size, Path(cfg.out_dir) / snapshot.FILE,
                            start_step if snap else None)
    history = []
    with guard.interruptible():
        for step in range(start_step, cfg.max_iters):
            parts.optimizer.set_lr(lr_at(cfg, step))
            micro_batches = batches.micro_batches(accum, all_at_once=cfg.loss_norm == "tokens")
            scale = parts.scaler.loss_scale
            loss, stepped, grad_norm = accumulate.accumulation_step(run_model, parts, micro_batches, cfg.loss_norm,
                                                                    cfg.no_sync)
            history.append(dict(step=step + 1, loss=loss, stepped=stepped, grad_norm=grad_norm,
                                loss_scale=parts.scaler.loss_scale))
            report.after_step(step, loss)
            if (master or every_rank) and (step + 1) % cfg.eval_interval == 0:
                with report.evaluation(step) as val:
                    val_batches = Batches(val_tokens, cfg.block_size, cfg.batch_size, cfg.seed, device)
                    val.append(estimate_loss(model, val_batches, cfg.eval_iters, parts.precision))
                history[-1]["val_loss"] = val[0]
            last = step + 1 == cfg.max_iters
            snapshot_due = last or (cfg.snapshot_interval and (step + 1) % cfg.snapshot_interval == 0)
            guard.after_step(step + 1, loss, stepped, scale, snapshot_due)
            if snapshot_due:
                state = snapshot.capture(cfg, model, parts, batches, step + 1, device, world_size)  # every rank
                if master:
                    snapshot.save(Path(cfg.out_dir) / snapshot.FILE, state)
                guard.saved(step + 1)
    if (master or every_rank) and cfg.sample_tokens and start_step < cfg.max_iters:
        text = sample(model, device, cfg.sample_tokens)  # every rank's forward under fsdp; rank 0's text
        if master:
            log("sample:\n" + text)
    return history


def resume(cfg, snap, model, parts, batches, rank, world_size, device, log):
    """Load the snapshot into this run; returns the step to continue from. A --loss_scale that
    differs from the snapshot's asks for a fresh loss scaler, and says so."""
    fresh_scaler = scaler_asked_anew(cfg, snap)
    step = snapshot.restore(snap, model, parts, batches, rank, world_size, device, scaler=not fresh_scaler)
    if rank == 0 and fresh_scaler:
        log(f"loss scale: this run's ({parts.precision.loss_scaling}, {parts.scaler.loss_scale:g}) replaces the "
            f"snapshot's ({snap['scaler']['loss_scale']:g}), as its flags ask")
    return step


@eagerly
@torch.no_grad()
def sample(model, device, n_tokens, prompt=b"def "):
    """A short sample from the model, decoded as bytes (with its RNG state put back after)."""
    rng = snapshot.rng_state(device)
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    try:
        out = model.generate(idx, n_tokens, temperature=0.8, top_k=50)[0].tolist()
    except RuntimeError as e:  # torch.multinomial refuses inf or NaN probabilities: logits that overflowed
        raise RunError(f"no sample: the weights give inf or NaN probabilities ({str(e).splitlines()[0]})") from None
    model.train()
    snapshot.set_rng_state(rng, device)
    return bytes(out).decode("utf-8", errors="replace")


SAMPLE_KEYS = {"sample_only", "out_dir", "device", "seed", "sample_tokens"}  # what --sample_only reads


def sample_from_snapshot(cfg):
    """Print a sample from out_dir/snapshot.pt, with the model shape it was trained with."""
    device, path = pick_device(cfg), Path(cfg.out_dir) / snapshot.FILE
    snap = snapshot.read(path)
    check_saved_policy(snap, path)
    saved = snap["config"]  # checked by snapshot.read, as a whole config
    keys = (*snapshot_fields.SHAPE_KEYS, *snapshot_fields.FP8_SHAPE_KEYS, "attn", "fp8_recipe")
    cfg = config.validate(dataclasses.replace(cfg, **{k: saved[k] for k in keys if k in saved}))
    model, _ = build(cfg, device)
    snapshot_fields.check_model_state(snap, model, path)
    try:
        model.load_state_dict(snap["model"])
        print(sample(model, device, cfg.sample_tokens or 200))
    except (RuntimeError, KeyError) as e:
        raise UsageError(f"snapshot does not fit its own config: {str(e).splitlines()[0]}") from None
    except RunError as e:  # the snapshot's weights are this program's input
        raise UsageError(f"snapshot {path} is not usable: {e}") from None


def program(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(cli.usage("train.py"))
        return 0
    cfg = cli.parse_args(argv)
    ignored = cli.given(argv) - SAMPLE_KEYS
    if cfg.sample_only and ignored:
        raise UsageError(f"--sample_only takes its model from the snapshot in out_dir: "
                         f"--{', --'.join(sorted(ignored))} would be ignored; only "
                         f"--{', --'.join(sorted(SAMPLE_KEYS - {'sample_only'}))} apply")
    sample_from_snapshot(cfg) if cfg.sample_only else train(cfg)


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
