"""The experiments behind `make chapter`, one function per claim of the chapter.

A tool, not a chapter file: each function runs the project's own code at a tiny shape,
measures, and returns a Claim (what the chapter says, what this machine measured, what
was expected, and whether it holds). It composes the chapter files and re-implements
none of their mechanisms. Read tools/chapter.py first (the list of claims, the report).
"""
import math
import platform
import statistics
from dataclasses import dataclass, fields

import torch

import accumulate
import fp8
import precision
import train
from backends import fp8_gemm
from config import Config, validate
from data import Batches, load_tokens, split_tokens
from model import GPT
from tools import bench, bench_compile, demos, ledger, plots


@dataclass
class Claim:
    section: str
    quote: str  # the chapter's words
    measured: str
    expected: str
    holds: bool
    why: str = ""  # when it differs: the reason, one the report explains
    figure: str = ""  # SVG file names in the report's folder, space-separated


def cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "this CPU"


def machine(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()} ({torch.get_num_threads()} threads)"


TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, seed=1337, sample_tokens=0, ledger=False,
            log_interval=10 ** 6, eval_interval=10 ** 6, warmup_iters=20, learning_rate=3e-3)


def tiny(device, **over):
    return validate(Config(**{**TINY, "device": device.type, **over}))


def flags_of(cfg):
    """cfg as the flags that differ from the defaults."""
    default = Config()
    return [f"--{f.name}={getattr(cfg, f.name)}" for f in fields(Config) if getattr(cfg, f.name) != getattr(default, f.name)]


def step_seconds(cfg, steps):
    """Median seconds per optimizer step after two warm-up steps: the benchmark's own timing
    (tools/bench.py measure_row)."""
    return bench.measure_row(flags_of(cfg), steps, warmup=2)["ms_per_step"] / 1000


def slow_because(device):
    """Why a time ratio may differ from the chapter's on this device."""
    if device.type == "cpu":
        return "time on CPU"
    return "time at this tiny shape: a GPU step this small waits on kernel launches, not on its matmuls"


# ---------------------------------------------------------------- section 1: mixed precision

def half_the_memory(device):
    meas = {p: ledger.run_config(tiny(device, precision=p), device) for p in ("fp32", "bf16")}
    ratio = {k: meas["bf16"][k] / meas["fp32"][k] for k in ("parameters", "gradients", "activations")}
    holds = ratio["parameters"] == ratio["gradients"] == 0.5 and 0.45 <= ratio["activations"] <= 0.65
    return Claim("1", "fewer bits -> about half the memory",
                 ", ".join(f"{k} x{v:.3f}" for k, v in ratio.items()) + " (BF16 / FP32, measured bytes)",
                 "x0.5 for parameters and gradients; activations a little above x0.5: the loss keeps its "
                 "log-softmax in FP32", holds)


def twice_the_speed(device, steps, shape):
    secs = {p: step_seconds(tiny(device, precision=p, **{**shape, "n_embd": 2 * shape["n_embd"]}), steps)
            for p in ("fp32", "bf16")}
    ratio = secs["fp32"] / secs["bf16"]
    return Claim("1", "about twice the Tensor Core throughput", f"BF16 {ratio:.2f}x FP32's tokens/s on "
                 f"{machine(device)}", "> 1x (about 2x on Tensor Cores)", ratio > 1.2,
                 "" if ratio > 1.2 else f"{slow_because(device)}: BF16 speed depends on the CPU's BF16 instructions "
                 "(AVX512-BF16, AMX); the claim is about GPU Tensor Cores")


def fp16_overflows(device, scale=1e5):
    """The tied embedding scaled up: the logits pass FP16's 65,504 while BF16 (FP32's range) holds them."""
    torch.manual_seed(0)
    model = GPT(tiny(device)).to(device)
    with torch.no_grad():
        model.wte.weight.mul_(scale)
    x = torch.randint(0, 256, (2, 64), device=device)
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        with torch.no_grad():
            logits, _ = model.to(dtype)(x)
        peaks[name] = logits.float().abs().max().item()
    holds = peaks["fp32"] > 65504 and math.isinf(peaks["fp16"]) and math.isfinite(peaks["bf16"])
    return Claim("1", "FP16's small range overflows", f"largest |logit| FP32 {peaks['fp32']:.3g}, FP16 "
                 f"{peaks['fp16']:.3g}, BF16 {peaks['bf16']:.3g} (embedding x{scale:g})",
                 "FP16 inf past 65,504; BF16 finite", holds)


def fp16_underflows():
    rows = demos.underflow_demo()
    lost = {r["name"].split(" (")[0]: r["lost"] for r in rows}
    none, dynamic, bf16 = (lost[k] for k in ("fp16, no scaling", "fp16, dynamic scaling", "bf16, no scaling"))
    return Claim("1", "Loss scaling: required for FP16", f"gradients lost (zero or subnormal): FP16 {100 * none:.2f}%, "
                 f"FP16 with dynamic scaling {100 * dynamic:.2f}%, BF16 {100 * bf16:.2f}%",
                 "FP16 loses a visible share; scaling and BF16 keep almost all", none > 0.01 and dynamic < none / 10
                 and bf16 < none / 10)


CURVES = [("FP32", dict(precision="fp32")), ("BF16 + master weights", dict(precision="bf16")),
          ("FP16 + dynamic scaling", dict(precision="fp16", loss_scale="dynamic")),
          ("FP16, no scaling", dict(precision="fp16", loss_scale="none")), ("FP8 (native)", dict(precision="fp8"))]


def loss_curves(device, steps, out):
    runs = {}
    for name, over in CURVES:
        if over["precision"] == "fp8" and fp8_gemm.fp8_matmul_error(device):
            continue
        history = train.train(tiny(device, max_iters=steps, out_dir=str(out / "runs" / over["precision"]), **over),
                              log=lambda line: None)
        runs[name] = history
    window = max(1, steps // 30)
    smooth = {name: plots.moving_average([(h["step"], h["loss"]) for h in hist], window) for name, hist in runs.items()}
    skipped = [(name, h["step"]) for name, hist in runs.items() for h in hist if not h["stepped"]]
    (out / "loss_curves.svg").write_text(plots.line_chart(
        list(smooth.items()), f"training loss, same seed and data ({window}-step average)", "optimizer step", "loss",
        marks=skipped))
    fp32 = dict(smooth["FP32"])
    gaps = [(name, [(x, y - fp32[x]) for x, y in pts]) for name, pts in smooth.items() if name != "FP32"]
    (out / "loss_gap.svg").write_text(plots.line_chart(
        gaps, f"loss minus the FP32 run's ({window}-step average)", "optimizer step", "loss - FP32 loss",
        marks=skipped))
    tail = {name: statistics.mean(h["loss"] for h in hist[-10:]) for name, hist in runs.items()}
    gap = tail["FP16, no scaling"] - tail["FP16 + dynamic scaling"]
    tracks = max(abs(tail[n] - tail["FP32"]) for n in ("BF16 + master weights", "FP16 + dynamic scaling")) < 0.1
    measured = ", ".join(f"{n} {v:.3f}" for n, v in tail.items()) + f" (mean loss of the last 10 steps); " \
        f"{len(skipped)} steps skipped; FP16 without scaling {gap:+.3f} vs with"
    behind = gap > 0.02
    return Claim("1", "BF16's range usually makes it [loss scaling] unnecessary", measured,
                 "BF16 and scaled FP16 track FP32; FP16 without scaling falls behind", tracks and behind,
                 "" if behind else "at this scale FP16 without scaling does not fall behind within the run; the "
                 "lost-gradient share above shows what it loses", "loss_curves.svg loss_gap.svg"), runs


def master_weights_matter(device, steps):
    """BF16 parameters updated by AdamW in BF16 (no master copy) against the master-weight run."""
    cfg = tiny(device, precision="bf16", max_iters=steps, learning_rate=1e-3)
    tokens, _ = split_tokens(load_tokens(""), cfg.block_size)
    result = {}
    for name, keep_master in (("master", True), ("bf16 only", False)):
        model, parts = train.build(cfg, device)
        if not keep_master:
            parts.optimizer = precision.MasterWeightOptimizer(model.parameters(), False, precision.optimizer_spec(cfg),
                                                              lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                                              grad_clip=cfg.grad_clip)
        batches, losses, unchanged, counted = Batches(tokens, cfg.block_size, cfg.batch_size, cfg.seed, device), [], 0, 0
        watched = parts.optimizer.master_params  # what the optimizer updates: FP32 master or the BF16 weights
        for step in range(steps):
            parts.optimizer.set_lr(train.lr_at(cfg, step))
            before = [w.detach().clone() for w in watched]
            losses.append(accumulate.accumulation_step(model, parts, [batches.next()])[0])
            unchanged += sum(int((b == w).sum()) for b, w in zip(before, watched))
            counted += sum(w.numel() for w in watched)
        result[name] = (statistics.mean(losses[-10:]), unchanged / counted)
    gap = result["bf16 only"][0] - result["master"][0]
    holds = result["bf16 only"][1] > 10 * result["master"][1] and gap > 0
    return Claim("1", "the parameter update in FP32 on an FP32 master weight copy",
                 f"updates rounded to nothing: BF16-only {100 * result['bf16 only'][1]:.1f}%, master copy "
                 f"{100 * result['master'][1]:.2f}%; final loss BF16-only {gap:+.3f} vs master", "BF16-only updates "
                 "vanish (below half a BF16 ulp) and its loss lags", holds)


def fp8_scaling_risk(device):
    """E4M3 error of a tensor with and without a few outliers, current vs delayed scaling."""
    gen = torch.Generator().manual_seed(0)
    clean = torch.randn(65536, generator=gen)
    spiky = clean.clone()
    spiky[:4] = 1e5  # past 448 / (E4M3 smallest normal) ~ 28,700 x the body: the body goes subnormal
    e4m3_max = torch.finfo(fp8.E4M3).max

    def error(x, amax):
        scale = fp8.scale_from_amax(amax, e4m3_max)
        back = fp8.dequantize(fp8.quantize(x, scale, fp8.E4M3), scale, torch.float32)
        body = slice(4, None)  # the ordinary values, outliers left out
        return ((back[body] - x[body]).norm() / x[body].norm()).item(), ((back - x).abs().max() / x.abs().max()).item()
    rows = {"current, no outliers": error(clean, clean.abs().amax()),
            "current, 4 outliers": error(spiky, spiky.abs().amax()),
            "delayed (amax from the step before), 4 outliers": error(spiky, clean.abs().amax())}
    holds = rows["current, 4 outliers"][0] > 3 * rows["current, no outliers"][0] and \
        rows["delayed (amax from the step before), 4 outliers"][1] > 0.5
    return Claim("1", "FP8 training ... per-tensor dynamic scaling ... its accuracy risks",
                 "; ".join(f"{k}: {100 * v[0]:.1f}% error of ordinary values, {100 * v[1]:.0f}% worst" for k, v in
                           rows.items()), "outliers cost the other values precision (current scaling) or get "
                 "clipped (a delayed scale that has not seen them)", holds)


# ---------------------------------------------------------------- beside the chapter

def what_compile_buys(device, steps, shape):
    """COMPILE=1 is no technique of the chapter, but a nanoGPT user expects it: each block compiled against
    the same model eager, BF16 at the timed shape, their steps in turn (tools/bench_compile.py). A sentence."""
    cfg = tiny(device, precision="bf16", **shape)
    row = bench_compile.measure_compiled(flags_of(cfg), steps, warmup=2)
    mib = lambda n: f"{n / 2 ** 20:.1f} MiB"  # noqa: E731
    return (f"torch.compile (COMPILE=1: each block compiled, the chapter's mechanisms eager) at this shape (BF16, "
            f"L={cfg.n_layer} h={cfg.n_embd} s={cfg.block_size} b={cfg.batch_size}) on {machine(device)}: "
            f"x{row['speedup']:.2f} eager's tokens/s (median of {steps} paired steps, {min(row['time_ratios']):.2f}-"
            f"{max(row['time_ratios']):.2f}), after a first step of {row['first_step_s']:.0f} s compiling; a step's "
            f"peak {mib(row['peak_compiled'])} compiled, {mib(row['peak_eager'])} eager.")
