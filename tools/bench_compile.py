"""`make bench`'s compile section: the same model eager and with each block compiled (COMPILE=1,
build.compile_blocks), in one process, their steps in turn on the same batches.

A tool, not a chapter file. Read tools/bench.py first (measure_pair: the same design, our recompute
against PyTorch's), then `measure_compiled`. tools/bench.py starts this file once per row, in a
process of its own (`--row JOB`, as its own rows), and prints the row:

    python tools/bench.py --sections=compile          (make bench ARGS=--sections=compile)

The compiled model's first step compiles its blocks: it is timed on its own (first_step_s), and
the pairs start after `warmup` more steps of each. The time ratio is the median of the pairs'
ratios (eager / compiled: above 1, compile is faster), each model first in every other pair, so
the machine's drift falls on both. The peak of a step is measured the same way for both: on CPU
by the allocator's own events (ledger/compiled.Allocations: a dispatch mode such as LiveTensors
would run the compiled blocks eagerly), on CUDA by the caching allocator's counters.
"""
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import torch  # noqa: E402

import accumulate  # noqa: E402
import flops  # noqa: E402
import train  # noqa: E402
from guards.clean_end import memory_available  # noqa: E402
from config import UsageError  # noqa: E402
from data import Batches, load_tokens, split_tokens  # noqa: E402
from guards import cli  # noqa: E402
from ledger import compiled as ledger_compiled  # noqa: E402
from ledger import measure  # noqa: E402
from tools import bench  # noqa: E402

def measure_compiled(flags, pairs, warmup):
    """flags' model eager and compiled in one process; their steps in turn. Returns the row."""
    cfg = cli.parse_args(flags)
    if cfg.compile:
        raise UsageError("the compile section compiles one of its two models itself: leave --compile out")
    device = train.pick_device(cfg)
    tokens, _ = split_tokens(load_tokens(cfg.data), cfg.block_size)
    runs = dict(eager=train.build(cfg, device), compiled=train.build(replace(cfg, compile=True), device))
    batches = Batches(tokens, cfg.block_size, cfg.batch_size, cfg.seed, device)
    accum = accumulate.micro_steps(cfg, 1, memory_available())
    micro = [batches.next() for _ in range(accum)]
    first = {who: bench.timed_step(*runs[who], micro, cfg, device) for who in ("eager", "compiled")}
    times = dict(eager=[], compiled=[])
    for i in range(warmup + pairs):
        micro = [batches.next() for _ in range(accum)]
        for who in ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager"):
            times[who].append(bench.timed_step(*runs[who], micro, cfg, device))
    ratios = [e / c for e, c in zip(times["eager"][warmup:], times["compiled"][warmup:])]
    ms = {who: 1000 * statistics.median(t[warmup:]) for who, t in times.items()}
    model, parts = runs["eager"]
    peak, source = flops.peak(cfg, parts.precision, model, device)
    tokens_per_step = cfg.batch_size * accum * cfg.block_size
    row = dict(section="compile", precision=parts.precision.name, ckpt=cfg.ckpt, attn=cfg.attn, pairs=pairs,
               first_step_s=first["compiled"], first_step_eager_s=first["eager"], speedup=statistics.median(ratios),
               time_ratios=ratios, peak_flops=peak, device=str(device),
               peak_flops_source=source, config=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size,
                                               batch_size=cfg.batch_size, accum=accum))
    for who, (model, parts) in runs.items():
        tok_s = tokens_per_step / (ms[who] / 1000)
        row |= {f"ms_per_step_{who}": ms[who], f"tokens_per_s_{who}": tok_s,
                f"mfu_{who}": flops.utilization(tok_s, flops.per_token(cfg)[0], peak),
                f"peak_{who}": step_peak(model, parts, micro, cfg, device),
                f"gemm_share_{who}": gemm_share(model, parts, micro, cfg, device)}
    row["line"] = line(row, f"{parts.precision.name} {cfg.ckpt}")  # what tools/bench.py prints
    return row


def step_peak(model, parts, micro, cfg, device):
    """bench.step_peak, with the CPU allocator's events on CPU for both models (the same yardstick)."""
    if device.type == "cuda":
        return bench.step_peak(model, parts, micro, cfg, device)
    before = measure.resident(model, parts) + (parts.grad_buffers or []) + [t for batch in micro for t in batch]
    start = measure.storage_bytes(before, device)
    with ledger_compiled.Allocations(start) as allocations:
        accumulate.accumulation_step(model, parts, micro, cfg.loss_norm, cfg.no_sync)
    return allocations.peak - start


def gemm_share(model, parts, micro, cfg, device, steps=2):
    """The share of a step's time spent in matrix products (mm, addmm, bmm: what compile leaves as they
    are, calling the same kernels), from torch.profiler's op times over `steps` steps; None on CUDA."""
    if device.type == "cuda":
        return None
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with ledger_compiled.quiet():
        profile.__enter__()
    for _ in range(steps):
        accumulate.accumulation_step(model, parts, micro, cfg.loss_norm, cfg.no_sync)
    with ledger_compiled.quiet():
        profile.__exit__(None, None, None)
    events = profile.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / total


def line(row, label):
    """The row in words: tokens/s, MFU, the ratio, the first step, the peaks."""
    mfu = lambda who: bench.fmt(row[f"mfu_{who}"], "pct")  # noqa: E731
    ratios = row["time_ratios"]
    return (f"compile   {label:17} eager {row['tokens_per_s_eager']:10,.0f} tok/s (MFU {mfu('eager')}), compiled "
            f"{row['tokens_per_s_compiled']:10,.0f} tok/s (MFU {mfu('compiled')}): x{row['speedup']:.2f} (median of "
            f"{row['pairs']} paired steps, {min(ratios):.2f}-{max(ratios):.2f}); first step "
            f"{row['first_step_s']:.1f} s compiling (eager's {row['first_step_eager_s']:.2f} s); step peak {row['peak_compiled']:,} bytes "
            f"compiled, {row['peak_eager']:,} eager"
            + (f"; GEMMs {row['gemm_share_eager']:.0%} of an eager step, {row['gemm_share_compiled']:.0%} of a "
               f"compiled one" if row["gemm_share_eager"] is not None else ""))


def job_of(argv, section):
    """(flags, steps, warmup) of `--row JOB`, as tools/bench.py starts a section's own process, or UsageError."""
    try:
        job = json.loads(argv[0]) if len(argv) == 1 else None
        flags, steps, warmup = job["flags"], job["steps"], job["warmup"]
        ok = all(isinstance(f, str) for f in flags) and all(type(n) is int and n >= m for n, m in ((steps, 1),
                                                                                                   (warmup, 0)))
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise UsageError("--row takes one JSON job {\"flags\": [...], \"steps\": n >= 1, \"warmup\": n >= 0} "
                         f"(tools/bench.py starts it itself; run make bench ARGS=--sections={section})")
    return flags, steps, warmup


def row_program(argv):
    """`--row JOB`, tools/bench.py's entry point into this file: its JSON job in, one JSON row out."""
    print(json.dumps(measure_compiled(*job_of(argv, "compile"))))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--row"]:
        sys.exit(cli.run(lambda argv: print(__doc__.strip()) or 0, []))
    sys.exit(cli.run(row_program, sys.argv[2:]))
