"""`make gpu-check`: every check this project has for a GPU, in one run that never stops early.

A tool, not a chapter file. The steps, in order: the CUDA-marked tests, the memory ledger on
CUDA (tools/ledger.py), the plan's check (tools/plan_check.py: the CUDA context and the allocator's
slack measured, the planned micro-batch trains on a smaller GPU emulated where the next runs out of
memory), then the benchmark's sections one by one (tools/bench.py): the fast configuration (BF16,
sdpa, 12 layers of width 768 at context 1024: tokens/s and MFU, with the peak FLOP/s it divides by
named), compile (the same shape with each block compiled, beside eager: tokens/s, MFU, and the peak
under full recompute compiled and eager), precision (tokens/s per precision), fp8wide (FP8 against
BF16 at widths 2048 and 4096), ckpt and memory. Each runs in its own process with its own log
under OUT_DIR/gpu-check/; a step that fails, or runs past its share of the time, is recorded
and the next one runs. Then OUT_DIR/gpu-check/summary.md: the device, the torch, CUDA and
cuDNN versions, each step's status, time and figures. The exit status is the worst step's
(0 when every step passed; 124 for one stopped at its time limit).

    python tools/gpu_check.py [train.py flags for the ledger and the benchmark]   (make gpu-check)

The whole run is held to BUDGET_S (8 minutes on one H200 is the goal); without a CUDA device it
prints one line and exits 0 (`make test` is the CPU suite).
"""
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from guards import cli  # noqa: E402
from guards.clean_end import check_writable, write_atomically  # noqa: E402
from tools import plan_check  # noqa: E402
from tools.bench import fmt, overridden  # noqa: E402

BUDGET_S = 470  # the whole run; each step also has its own cap below
NO_GPU = "gpu-check: no CUDA device here; nothing to check (the CPU suite is 'make test')"


@dataclass
class Step:
    name: str
    argv: list  # the command, run from the project root
    cap_s: int  # the most this step may take
    figures: object = None  # callable(step folder) -> markdown lines, or None


def steps(python, flags, out):
    """The steps of a run: flags are the train.py flags given to make, for the ledger and the bench."""
    def bench(section, cap_s):
        folder = out / f"bench-{section}"
        argv = [python, "tools/bench.py", *overridden(flags, ["--device=cuda", f"--out_dir={folder}"]),
                f"--sections={section}"]
        return Step(f"bench {section}", argv, cap_s, lambda: bench_figures(folder / "bench.jsonl"))
    ledger_dir, plan_dir = out / "ledger", out / "plan"
    return [Step("tests", [python, "-m", "pytest", "-q", "-m", "cuda", "tests", "-p", "no:cacheprovider"], 150),
            Step("ledger", [python, "tools/ledger.py", *overridden(flags, ["--device=cuda", f"--out_dir={ledger_dir}"])],
                 90, lambda: ledger_figures(ledger_dir / "memory_ledger.json")),
            Step("plan", [python, "tools/plan_check.py",
                          *overridden(flags, ["--device=cuda", f"--out_dir={plan_dir}"])],
                 90, lambda: plan_figures(plan_dir / "plan_check.json")),
            bench("fast", 60), bench("compile", 120),
            bench("precision", 100), bench("fp8wide", 120), bench("ckpt", 120),
            bench("memory", 60)]


def run_steps(plan, out, budget_s=BUDGET_S):
    """Run every step of `plan`, each with its log in out/<name>.log, whatever the others did.
    Returns [(step, status, seconds)]: status is the exit code, 124 past the step's time."""
    deadline, results = time.monotonic() + budget_s, []
    for step in plan:
        log = out / f"{step.name.replace(' ', '-')}.log"
        left = deadline - time.monotonic()
        if left < 1:
            log.write_text("not run: the run's time budget was spent\n")
            results.append((step, 124, 0.0))
            continue
        started = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(step.argv, cwd=HERE, stdout=fh, stderr=subprocess.STDOUT)
            try:
                status = proc.wait(timeout=min(step.cap_s, left))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                status = 124
                fh.write(f"\ngpu-check: stopped after {min(step.cap_s, left):.0f} s (its time limit)\n")
        status = 128 - status if status < 0 else status  # killed by a signal: the shell's 128 + n
        results.append((step, status, time.monotonic() - started))
        print(f"gpu-check: {step.name:16} {'ok' if status == 0 else f'FAILED ({status})':12} "
              f"{time.monotonic() - started:6.1f} s  log {log}", flush=True)
    return results


def worst(results):
    return max((status for _, status, _ in results), default=0)


# ---------------------------------------------------------------- the summary's figures

def bench_figures(path):
    if not path.exists():
        return ["no rows written (see the log)"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out = ["| row | ckpt | tokens/s | ms/step | MFU | peak FLOP/s (source) | peak memory |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("section") == "compile":  # one process, two models: eager and each block compiled
            out += [f"| {r['label']} {who} (compiled x{r['speedup']:.2f} eager's tokens/s) | {r['ckpt']} | "
                    f"{fmt(r[f'tokens_per_s_{who}'], 'f1')} | {fmt(r[f'ms_per_step_{who}'], 'f1')} | "
                    f"{fmt(r[f'mfu_{who}'], 'pct')} | {fmt(r['peak_flops'] or None, 'tflops')} | "
                    f"{fmt(r[f'peak_{who}'], 'mem')} (a step's peak) |" for who in ("eager", "compiled")]
            continue
        if "tokens_per_s" not in r:  # the ckpt section's paired summary
            out.append(f"| {r.get('section')} {r.get('ckpt')}: ours / torch.utils.checkpoint | | time "
                       f"x{r.get('time_ours_vs_torch', float('nan')):.3f} | | | | |")
            continue
        speedup = f" ({r['speedup_vs_bf16']:.2f}x BF16)" if "speedup_vs_bf16" in r else ""
        out.append(f"| {r.get('label', r['precision'])}{speedup} | {r['ckpt']} | {fmt(r['tokens_per_s'], 'f1')} | "
                   f"{fmt(r['ms_per_step'], 'f1')} | {fmt(r.get('mfu'), 'pct')} | "
                   f"{fmt(r.get('peak_flops') or None, 'tflops')} ({r.get('peak_flops_source', '-')}) | "
                   f"{fmt(r.get('peak_mem_bytes'), 'mem')} |")
    return out


def ledger_figures(path):
    if not path.exists():
        return ["no comparison written (see the log)"]
    got = json.loads(path.read_text())
    out = ["| component | traced | measured | check |", "|---|---|---|---|"]
    out += [f"| {r['component']} | {r['traced']:,} | {r['measured']:,} | {'ok' if r['ok'] else 'MISS'} "
            f"({r['rule']}) |" for r in got["rows"]]
    return out + ["", got["allocator"]]


def plan_figures(path):
    """tools/plan_check.py's figures in words: the margin measured, the planned micro-batch and the next."""
    if not path.exists():
        return ["no figures written (see the log)"]
    return [f"- {line}" for line in plan_check.summary(json.loads(path.read_text()))]


def summary(results, seconds):
    cuda = torch.cuda.is_available()
    lines = [f"# make gpu-check, {date.today().isoformat()}", "",
             f"- device: {torch.cuda.get_device_name() if cuda else 'no CUDA device'}",
             f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
             f"{torch.backends.cudnn.version() if cuda else None}",
             f"- {len(results)} steps in {seconds:.0f} s (budget {BUDGET_S} s); exit status {worst(results)}", "",
             "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {step.name} | {'ok' if status == 0 else f'FAILED ({status})'} | {took:.1f} |"
              for step, status, took in results]
    for step, status, _ in results:
        if step.figures is not None:
            try:
                figures = step.figures()
            except (OSError, ValueError, KeyError, TypeError) as e:  # a step that died half-way wrote half a file
                figures = [f"its figures could not be read: {e}"]
            lines += ["", f"## {step.name}", ""] + figures
    return "\n".join(lines) + "\n"


def program(argv, plan=None):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    cfg = cli.parse_args(argv)  # the flags the ledger and the benchmark will get: bad ones stop here
    if plan is None and not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    out = Path(cfg.out_dir) / "gpu-check"
    check_writable(out.parent, "--out_dir")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = run_steps(plan if plan is not None else steps(sys.executable, argv, out), out)
    text = summary(results, time.monotonic() - started)
    write_atomically(out / "summary.md", lambda fh: fh.write(text.encode()))
    print(f"gpu-check: wrote {out / 'summary.md'}; exit status {worst(results)} (the worst step's)")
    return worst(results)


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
