"""Benchmarks (not tests): tokens/s, ms/step, MFU and peak memory per precision, per recompute policy
(and ours against torch.utils.checkpoint on the same units, their steps in turn in one process:
measure_pair), compiled blocks against eager (compile: tools/bench_compile.py), the loss whole and in
pieces (loss: tools/bench_loss.py), DDP step time with and without no_sync, FP8 (native, its HYBRID
mode, Transformer Engine where installed) against BF16 at widths 2048 and 4096 (fp8wide), and the fast
configuration a GPU user expects (fast: BF16, the fused attention, a GPT-2-124M-like shape), with the
peak FLOP/s its MFU divides by named. Chapter: the "it saves memory *and* speeds up" claims of sections
1-3, measured. Read first: `measure_row` (one configuration: the median step after warm-up steps).

    python tools/bench.py [train.py flags as the base config] [--sections=precision,ckpt,...] [--steps=N]

Rows go to the screen as a table and to out_dir/bench.jsonl as one JSON object each. Peak memory is CUDA's
max_memory_allocated on a GPU and the process's peak RSS on CPU (with the ~0.3 GB of PyTorch's runtime).
"""
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # the project's root: train.py and the chapter files
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import accumulate  # noqa: E402
import checkpoint  # noqa: E402
import flops  # noqa: E402
from backends import fp8_gemm, fp8_te  # noqa: E402
from ledger import measure, trace  # noqa: E402
import precision  # noqa: E402
import train  # noqa: E402
from guards.clean_end import memory_available  # noqa: E402
from guards import cli  # noqa: E402
from config import UsageError, key, validate  # noqa: E402
from guards.cli import given  # noqa: E402
from data import Batches, load_tokens, split_tokens  # noqa: E402
from ledger.fits import check_fits  # noqa: E402
from guards.clean_end import check_writable, write_atomically  # noqa: E402

SECTIONS = ("precision", "ckpt", "compile", "loss", "memory", "ddp", "fp8wide", "fast")
# fast: what a GPU is for. ATTN=manual stays the teaching default (the chapter's s x s softmax); on a GPU users
# expect the fused kernel, BF16, GPT-2-124M's shape (L12 h768 s1024; 85M parameters at our byte vocabulary).
FAST = ["--precision=bf16", "--attn=sdpa", "--n_layer=12", "--n_embd=768", "--n_head=12", "--block_size=1024",
        "--batch_size=16", "--ckpt=none", "--ckpt_segment=0", "--accum=1", "--total_batch_tokens=0", "--dropout=0"]
# fp8wide: FP8 pays where the Linears' GEMMs dominate. With FP8_GRAD=bf16 only the forward GEMM,
# a third of a Linear's FLOPs, is FP8: even at 2x BF16's rate that is at best 1/(2/3 + 1/6) = 1.2x.
# HYBRID (FP8_GRAD=e5m2, and TE) puts all three GEMMs in FP8: the goal, >= 1.3x BF16's tokens/s
# at width >= 4096 on an H100/H200. Width: (heads, layers); 2 layers at 4096 keep `make gpu-check` short.
WIDE = {2048: (16, 4), 4096: (32, 2)}
# compile: on CPU the default shape (the goals: BF16 >= 1.3x, FP32 >= 1.5x eager's tokens/s); on CUDA the fast one
COMPILE_ROWS = {True: [("fp32", ["--precision=fp32"]), ("bf16", ["--precision=bf16"]), ("bf16 full", [
    "--precision=bf16", "--ckpt=full"]), ("bf16 selective", ["--precision=bf16", "--ckpt=selective"])],
    False: [("bf16 sdpa L12 h768", FAST), ("bf16 sdpa L12 h768 full", FAST + ["--ckpt=full"])]}
FP8_ROWS = (("fp8", ["--precision=fp8", "--fp8_backend=native", "--fp8_grad=bf16"]),
            ("fp8 hybrid", ["--precision=fp8", "--fp8_backend=native", "--fp8_grad=e5m2", "--fp8_keep_weight=true"]),
            ("fp8 te", ["--precision=fp8", "--fp8_backend=te", "--fp8_keep_weight=true"]))


@dataclass
class BenchOptions:
    sections: str = key("precision,ckpt,compile,loss,memory,ddp", "comma-separated: " + ",".join(SECTIONS)
                        + " (fp8wide and fast are for GPUs: skipped on CPU)")
    steps: int = key(9, "timed optimizer steps per row (the median is reported)", at_least=1)
    warmup: int = key(2, "untimed steps before them", at_least=0)
    rounds: int = key(9, "ckpt and compile sections: paired steps of the row's two models, in turn in one process",
                      at_least=1)


class AutocastReference:
    """PyTorch's own mixed precision, the reference: FP32 weights, matmuls under torch.autocast.
    It stands in for the Precision in accumulate.StepParts, which only asks it for a forward context."""

    def __init__(self, device_type):
        self.device_type = device_type

    def forward_context(self, model, micro_step=None):
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


def measure_row(flags, steps, warmup, autocast_reference=False):
    """Build the config's model, run warm-up steps, then time `steps` optimizer steps."""
    cfg = cli.parse_args(flags)
    device = train.pick_device(cfg)
    tokens, _ = split_tokens(load_tokens(cfg.data), cfg.block_size)
    model, parts = train.build(cfg, device)
    prec = parts.precision
    if autocast_reference:
        parts.precision = AutocastReference(device.type)
    batches = Batches(tokens, cfg.block_size, cfg.batch_size, cfg.seed, device)
    accum = accumulate.micro_steps(cfg, 1, memory_available())
    times = []
    for i in range(warmup + steps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times.append(timed_step(model, parts, [batches.next() for _ in range(accum)], cfg, device))
    # the median step: a shared 2-core machine adds outliers that a mean would report as speed
    dt = sorted(times[warmup:])[steps // 2]
    tokens_per_s = cfg.batch_size * accum * cfg.block_size / dt
    # autocast runs bf16 matmuls, so its MFU is against the bf16 peak
    if autocast_reference:
        prec = precision.decide(replace(cfg, precision="bf16"))
    peak, source = flops.peak(cfg, prec, model, device)
    model_flops, extra = flops.per_token(cfg, checkpoint.rerun_stops_early(cfg, prec))
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device)
    else:
        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    # what autograd keeps for backward after the forward, the ledger's trace (its tests hold it to the
    # measured saved-tensor bytes): the activation memory a policy saves
    activations = None if autocast_reference else \
        trace.step(replace(cfg, device=device.type))["activations"]  # autocast: not traced
    return dict(precision="autocast-bf16" if autocast_reference else prec.name, ckpt=cfg.ckpt,
                tokens_per_s=tokens_per_s, ms_per_step=1000 * dt, peak_flops=peak,
                peak_flops_source=source,
                mfu=flops.utilization(tokens_per_s, model_flops, peak),
                hfu=flops.utilization(tokens_per_s, model_flops + extra, peak),
                peak_mem_bytes=peak_mem, activation_bytes=activations, device=str(device),
                config=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size,
                            batch_size=cfg.batch_size, accum=accum, attn=cfg.attn))


def measure_pair(flags, pairs, warmup):
    """Our recompute against torch.utils.checkpoint (non-reentrant) on the same units, in one
    process: two models built alike (train.build seeds them), their steps taken in turn on the
    same batches, each first in every other pair, so that this machine's drift falls on both;
    the time ratio is the median of the pairs' ratios. Then one more step of each for its peak
    (step_peak: the bytes the step adds at its highest, beyond the states and the batch)."""
    cfg = cli.parse_args(flags)
    device = train.pick_device(cfg)
    tokens, _ = split_tokens(load_tokens(cfg.data), cfg.block_size)
    runs = pair_models(cfg, device)
    batches = Batches(tokens, cfg.block_size, cfg.batch_size, cfg.seed, device)
    accum = accumulate.micro_steps(cfg, 1, memory_available())
    times = dict(ours=[], torch=[])
    for i in range(warmup + pairs):
        micro = [batches.next() for _ in range(accum)]
        for who in ("ours", "torch") if i % 2 == 0 else ("torch", "ours"):
            times[who].append(timed_step(*runs[who], micro, cfg, device))
    ratios = [ours / theirs for ours, theirs in zip(times["ours"][warmup:], times["torch"][warmup:])]
    # without dropout the two runs are the same computation: their gradients are bit-identical
    # (tests/test_checkpoint.py), so are the weights after the same steps (dropout draws each
    # run's masks from one generator in turn: then they differ)
    same = cfg.dropout == 0 and all(torch.equal(a, b) for a, b in zip(runs["ours"][0].parameters(),
                                                                      runs["torch"][0].parameters()))
    peaks = {who: step_peak(model, parts, micro, cfg, device) for who, (model, parts) in runs.items()}
    return dict(section="ckpt ref", precision=runs["ours"][1].precision.name, ckpt=cfg.ckpt, pairs=pairs,
                time_ours_vs_torch=statistics.median(ratios), time_ratios=ratios,
                ms_per_step_ours=1000 * statistics.median(times["ours"][warmup:]),
                ms_per_step_torch=1000 * statistics.median(times["torch"][warmup:]),
                peak_ours=peaks["ours"], peak_torch=peaks["torch"], same_weights=same, dropout=cfg.dropout,
                device=str(device))


def pair_models(cfg, device):
    """{"ours": (model, parts), "torch": ...}: cfg's model built twice (train.build seeds it and
    applies our recompute), the second with the policy's units given to torch.utils.checkpoint."""
    runs = dict(ours=train.build(cfg, device), torch=train.build(cfg, device))
    model, parts = runs["torch"]
    checkpoint.apply_policy(model, checkpoint.policy(cfg), parts.precision.recompute_contexts,
                            recompute_fn=checkpoint.torch_recompute,
                            stop_early=checkpoint.rerun_stops_early(cfg, parts.precision))
    return runs


def timed_step(model, parts, micro, cfg, device):
    """Seconds of one optimizer step (accumulate.accumulation_step over the micro-batches)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    accumulate.accumulation_step(model, parts, micro, cfg.loss_norm, cfg.no_sync)
    sync()
    return time.perf_counter() - t0


def step_peak(model, parts, micro, cfg, device):
    """Bytes live at the step's peak, over those before it: every storage op by op on CPU
    (ledger/measure.py's LiveTensors), the caching allocator's high-water mark on CUDA."""
    before = measure.resident(model, parts) + (parts.grad_buffers or []) + [t for batch in micro for t in batch]
    tracker = measure.CudaAllocator(device) if device.type == "cuda" else measure.LiveTensors(device)
    with tracker:
        tracker.adopt(before)
        tracker.reset_peak()
        start = tracker.read()
        accumulate.accumulation_step(model, parts, micro, cfg.loss_norm, cfg.no_sync)
    return tracker.peak - start


def run_row_in_subprocess(flags, steps, warmup, autocast_reference=False, pair=False, script=__file__):
    """Each row in a fresh process: CPU peak RSS is a per-process high-water mark.
    pair: measure_pair's row (steps: its pairs) instead of measure_row's; script: whose `--row` runs it."""
    job = json.dumps(dict(flags=flags, steps=steps, warmup=warmup, autocast_reference=autocast_reference,
                          pair=pair))
    r = subprocess.run([sys.executable, script, "--row", job], capture_output=True, text=True, cwd=HERE)
    if r.returncode == 2:  # bad input, already one line
        raise UsageError(r.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if r.returncode != 0:
        raise SystemExit(f"bench row {flags} failed:\n{r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_sections_once(sections, base, cfg, device, steps, warmup, fp8_error, te_error, planned, dry, rounds=1):
    """The rows of `sections` in order. dry: run nothing, only collect each row's flags in `planned`."""
    on_cpu, say = device.type == "cpu", ((lambda *a, **k: None) if dry else print)
    base_keys = {a.split("=")[0] for a in base}
    rows = []

    def add(section, flags, label=None, **kw):
        if section == "precision" and "--precision=fp16" in flags and on_cpu:
            kw = dict(kw, steps=1, warmup=1)  # fp16 steps are ~80x bf16's on CPU: one timed step
        flags = overridden(base, flags)
        planned.append(flags)
        if dry:  # a stand-in row, so that the comparisons below can run
            return dict(tokens_per_s=1.0, ms_per_step=1.0, peak_mem_bytes=0)
        job = {k: kw[k] for k in ("autocast_reference", "pair", "script") if k in kw}
        row = run_row_in_subprocess(flags, kw.get("steps", steps), kw.get("warmup", warmup), **job)
        row["section"], row["label"] = section, label or row["precision"]
        rows.append(row)
        if kw.get("pair") or section == "compile":
            return row
        say(f"{section:9} {row['label']:17} {row['ckpt']:9} {fmt(row['tokens_per_s'], 'f1'):>12} tok/s "
              f"{fmt(row['ms_per_step'], 'f1'):>10} ms/step  MFU {fmt(row['mfu'], 'pct'):>6}  "
              f"HFU {fmt(row.get('hfu'), 'pct'):>6}  peak {fmt(row['peak_mem_bytes'], 'mem'):>9}  "
              f"activations {fmt(row['activation_bytes'], 'mem'):>9}", flush=True)
        return row

    say(f"{'section':9} {'precision':17} {'ckpt':9} {'tokens/s':>18} {'ms/step':>18}")
    if "precision" in sections:
        for p in ("fp32", "bf16", "fp16", "fp8"):
            if p == "fp8" and fp8_error:
                say(f"precision fp8: skipped, {fp8_error}")
                continue
            add("precision", [f"--precision={p}"] + (["--fp8_backend=native"] if p == "fp8" else []))
        if te_error:
            say(f"precision fp8 te: skipped, {te_error}")
        else:
            add("precision", ["--precision=fp8", "--fp8_backend=te"], label="fp8 te")
        add("precision", ["--precision=fp32"], autocast_reference=True)
    if "ckpt" in sections:
        prec = [] if "--precision" in base_keys else ["--precision=bf16"]
        none = None
        for policy in ("none", "full", "sqrt", "selective"):
            segment = [] if policy == "sqrt" else ["--ckpt_segment=0"]  # a base CKPT_SEGMENT is sqrt's only
            row = add("ckpt", prec + [f"--ckpt={policy}", "--attn=manual"] + segment)
            none = none or row
            row["time_vs_none"] = row["ms_per_step"] / none["ms_per_step"]
            say(f"{'':9} {'':17} {policy:9} time x{row['time_vs_none']:.2f} of none")
        for policy in ("full", "sqrt", "selective"):  # ours against PyTorch's own, on the same units
            flags = prec + [f"--ckpt={policy}", "--attn=manual"] + ([] if policy == "sqrt" else ["--ckpt_segment=0"])
            row = add("ckpt ref", flags, label=f"{policy} ours/torch", pair=True, steps=rounds)
            if not dry:
                ratios = row["time_ratios"]
                say(f"{'ckpt ref':9} {policy:9} ours / torch.utils.checkpoint: time x{row['time_ours_vs_torch']:.3f} "
                    f"(median of {rounds} paired steps, {min(ratios):.3f}-{max(ratios):.3f}; "
                    f"{fmt(row['ms_per_step_ours'], 'f1')} vs {fmt(row['ms_per_step_torch'], 'f1')} ms), peak "
                    f"{row['peak_ours']:,} vs {row['peak_torch']:,} bytes (live, op by op), same weights after "
                    f"them: {'yes' if row['same_weights'] else 'not compared (dropout)' if row['dropout'] else 'NO'}",
                    flush=True)
    if "compile" in sections:  # each row eager and compiled, in one process: tools/bench_compile.py
        for label, flags in COMPILE_ROWS[on_cpu]:
            flags = ["--ckpt=none", "--ckpt_segment=0", "--attn=manual", *flags] if on_cpu else flags
            row = add("compile", flags, label=label, steps=rounds, script=str(HERE / "tools" / "bench_compile.py"))
            say(row.get("line"), flush=True)
    if "loss" in sections:  # whole and in pieces at GPT-2's vocabulary, in one process: tools/bench_loss.py
        planned.append(overridden(base, []))
        script = f"{HERE}/tools/bench_loss.py"
        for row in [] if dry else run_row_in_subprocess(planned[-1], rounds, warmup, script=script):
            rows.append(row)
            say(row["line"], flush=True)
    if "memory" in sections:
        # a config where activations dominate: long context, bigger micro-batch
        shape = ["--block_size=1024", "--batch_size=16"]
        prec = [] if "--precision" in base_keys else ["--precision=bf16"]
        for policy in ("none", "selective", "sqrt", "full"):
            segment = [] if policy == "sqrt" else ["--ckpt_segment=0"]
            add("memory", prec + shape + [f"--ckpt={policy}", "--attn=manual"] + segment, steps=2, warmup=1)
    if "fp8wide" in sections and (fp8_error or on_cpu):
        say(f"fp8wide: skipped, {fp8_error or 'for GPUs (width 4096 takes minutes a step on CPU)'}")
    elif "fp8wide" in sections:
        for width, (heads, layers) in WIDE.items():
            wide = [f"--n_embd={width}", f"--n_head={heads}", f"--n_layer={layers}", "--block_size=1024",
                    "--batch_size=8", "--attn=sdpa"]
            bf16 = add("fp8wide", wide + ["--precision=bf16"], label=f"bf16 w{width}")
            for name, flags in FP8_ROWS:
                if name == "fp8 te" and te_error:
                    say(f"fp8wide {name} w{width}: skipped, {te_error}")
                    continue
                row = add("fp8wide", wide + flags, label=f"{name} w{width}")
                row["speedup_vs_bf16"] = row["tokens_per_s"] / bf16["tokens_per_s"]
                say(f"{'':9} {name} / bf16 tokens/s at width {width} = {row['speedup_vs_bf16']:.2f}x", flush=True)
    if "fast" in sections and on_cpu:
        say("fast: skipped, for GPUs (12 layers of width 768 at context 1024 take minutes a step on CPU)")
    elif "fast" in sections:
        row = add("fast", FAST, label="bf16 sdpa L12 h768")
        if not dry:
            say(f"{'':9} MFU {fmt(row['mfu'], 'pct')} of {fmt(row['peak_flops'], 'tflops')} "
                f"({row['peak_flops_source']}), eager mode", flush=True)
    if "ddp" in sections and dry:
        planned += [ddp_flags(base, no_sync, shard, steps, cfg.out_dir) for no_sync, shard in ddp_variants(cfg)]
    elif "ddp" in sections:
        for row in ddp_rows(base, ddp_variants(cfg), steps, cfg.out_dir):
            row["section"] = "ddp"
            rows.append(row)
            say(f"ddp       {row['precision']:17} shard={row['shard']:5} no_sync={str(row['no_sync']):5} nproc 2 "
                f"accum 4 {row['ms_per_step']:10.1f} ms/step {row['tokens_per_s']:12,.0f} tok/s"
                + (f"  x{row['vs_ddp']:.2f} DDP's time" if row.get("vs_ddp") else ""), flush=True)
    return rows


def ddp_variants(cfg):
    """(no_sync, shard) pairs of the ddp section: DDP with and without no_sync, then ZeRO-1, ZeRO-2
    and FSDP (where this config can run it: config.validate refuses FSDP with FP8 or FP32 sums)."""
    variants = [("true", "none"), ("false", "none")]
    for shard in ("zero1", "zero2", "fsdp"):
        try:
            validate(replace(cfg, shard=shard))
            variants.append(("true", shard))
        except UsageError:
            pass
    return variants


def ddp_flags(base, no_sync, shard, steps, out_dir):
    return overridden(base, ["--accum=4", f"--no_sync={no_sync}", f"--shard={shard}", f"--max_iters={steps + 2}",
                             "--log_interval=1", "--eval_interval=100000", "--sample_tokens=0", "--ledger=false",
                             "--total_batch_tokens=0", f"--out_dir={Path(out_dir) / 'bench-ddp'}"])


def ddp_rows(base, variants, steps, out_dir):
    """Step time on 2 processes (gloo on CPU) with accum=4: DDP with and without no_sync, and each
    SHARD, one run after the other in this bench; vs_ddp = ms/step over DDP's (with no_sync)."""
    rows = []
    for no_sync, shard in variants:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               *ddp_flags(base, no_sync, shard, steps, out_dir)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=env)
        lines = [l for l in r.stdout.splitlines() if " ms/step" in l][2:]  # one line per step; 2 warm-up
        if r.returncode != 0 or not lines:
            raise SystemExit(f"ddp bench failed:\n{r.stderr.strip()[-2000:]}")
        ms = sorted(float(re.search(r"([\d.]+) ms/step", l).group(1)) for l in lines)[len(lines) // 2]
        tokens_per_step = int(re.search(r"= (\d+) tokens per optimizer step", r.stdout).group(1))
        tok = tokens_per_step / (ms / 1000)
        rows.append(dict(precision=next((a.split("=")[1] for a in base if a.startswith("--precision=")), "bf16"),
                         ckpt="none", no_sync=no_sync == "true", shard=shard, nproc=2, accum=4, ms_per_step=ms,
                         tokens_per_s=tok, mfu=None, peak_mem_bytes=None,
                         vs_ddp=ms / rows[0]["ms_per_step"] if rows else 1.0))
    return rows


def overridden(base, flags):
    """base's --key=value flags with those in `flags` replacing any of the same key (a key twice is refused)."""
    return list({flag.partition("=")[0]: flag for flag in (*base, *flags)}.values())


def te_unavailable(device):
    """None where Transformer Engine's FP8 runs here, else why not (its own one-line reason)."""
    try:
        fp8_te.check_available(device)
    except ValueError as e:
        return str(e)
    return None


def fmt(v, kind):
    return "-" if v is None else {"mem": f"{v / 2**20:.0f} MiB", "pct": f"{100 * v:.1f}%", "f1": f"{v:,.1f}",
                                  "tflops": f"{v / 1e12:,.4g} TFLOP/s"}[kind]


def program(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + cli.usage("tools/bench.py", BenchOptions))
        return 0
    return run_sections(argv)


def main(argv):
    return cli.run(program, argv)


def run_sections(argv):
    cfg, opts = cli.parse_args(argv, BenchOptions)
    base = [a for a in argv if a.split("=")[0][2:] not in BenchOptions.__dataclass_fields__]
    steps, warmup, sections = opts.steps, opts.warmup, opts.sections.split(",")
    if any(s not in SECTIONS for s in sections):
        raise UsageError(f"--sections takes {','.join(SECTIONS)}, got {opts.sections!r}")
    device = train.pick_device(cfg)
    split_tokens(load_tokens(cfg.data), cfg.block_size)  # bad data fails here, not in a row
    check_writable(cfg.out_dir, "--out_dir")  # and an out_dir that cannot take the results, before any row runs
    # the compile and loss sections' own processes would refuse these, but after the rows before them
    for section, key, why in (("compile", "compile", "compiles one of its two models itself"),
                              ("loss", "loss_chunks", "sets LOSS_CHUNKS itself, to each of 1, 4 and 16")):
        if section in sections and key in given(argv):
            raise UsageError(f"the {section} section {why}: leave --{key} out")
    if ignored := given(argv) & {"resume", "sample_only", "memory_snapshot"}:
        raise UsageError(f"--{', --'.join(sorted(ignored))}: the benchmark times fresh runs, nothing else applies")
    fp8_error = fp8_gemm.fp8_matmul_error(device)
    if not fp8_error and cfg.n_embd % 16:
        fp8_error = f"n_embd={cfg.n_embd} is not a multiple of 16 (an FP8 GEMM rule)"
    te_error = fp8_error or te_unavailable(device)
    # every row's flags are checked before the first row runs: a bad one must not cost minutes
    planned = []
    run_sections_once(sections, base, cfg, device, steps, warmup, fp8_error, te_error, planned, dry=True)
    for flags in planned:
        check_fits(cli.parse_args(flags), device)  # and a shape this machine cannot hold, in one line
    rows = run_sections_once(sections, base, cfg, device, steps, warmup, fp8_error, te_error, [], dry=False,
                             rounds=opts.rounds)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "bench.jsonl", lambda fh: fh.write("".join(json.dumps(r) + "\n" for r in rows).encode()))
    print(f"wrote {len(rows)} rows to {out / 'bench.jsonl'}")
    return 0


def row_program(argv):
    """`--row JOB`, run_row_in_subprocess's entry point: one JSON job in, one JSON row out."""
    try:
        job = json.loads(argv[0]) if len(argv) == 1 else None
        flags, steps, warmup, autocast, pair = (job[k] for k in ("flags", "steps", "warmup", "autocast_reference",
                                                                 "pair"))
        ok = all(isinstance(f, str) for f in flags) and isinstance(autocast, bool) and isinstance(pair, bool) \
            and all(type(n) is int and n >= m for n, m in ((steps, 1), (warmup, 0)))
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise UsageError("--row takes one JSON job {\"flags\": [...], \"steps\": n >= 1, \"warmup\": n >= 0, "
                         "\"autocast_reference\": true|false, \"pair\": true|false} (tools/bench.py "
                         "starts it itself; run make bench)")
    print(json.dumps(measure_pair(flags, steps, warmup) if pair else measure_row(flags, steps, warmup, autocast)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--row"]:
        sys.exit(cli.run(row_program, sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
