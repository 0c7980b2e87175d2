"""`make ledger`: the memory ledger's report: predicted vs measured bytes, the chapter's table,
the published figures beside ours, the what-if for big shapes, an SVG.

A tool, not a chapter file: it composes memory_ledger.py (the description and its formulas),
ledger/measure.py (measurement), ledger/explain.py (what the description does not explain),
ledger/parallel.py (the parallel techniques, the what-if) and ledger/papers.py (Korthikanti
et al. 2022 and ZeRO's figures) and prints.

    python tools/ledger.py --precision=bf16 --ckpt=full   (make ledger PRECISION=bf16 CKPT=full)
    python tools/ledger.py --what_if_only                  (make ledger ARGS=--what_if_only)

--what_if_only prints the what-if and the published-figure table and nothing else: no model
is built, nothing is measured. Every config key of train.py applies, plus the ledger's own
(below). The checks: every component is exact to the byte on every device (both sides count
storages: no tolerance; the activations are the storages autograd saved, read by
saved_tensors_hooks on CUDA as on CPU); the peak is within 2% of the measured one on CPU (it is
derived by walking the step, ledger/walk.py) and printed, not checked, on CUDA. Beside them, as
information, the growth over the forward of the live bytes: on CPU exactly the storages the
forward left alive, on CUDA the caching allocator's figure, with the slack its block sizes
allow (ledger/measure.allocator_bounds). Where model.py and its description differ, the report
says what (ledger/explain.py): each parameter and buffer one has and the other lacks, by name,
shape and count; each saved tensor the description does not explain (the module and autograd node
that saved it, dtype, shape, bytes) and each term nothing matched; every other component that
differs and what it follows. Every row of the table this project runs is measured on this machine,
the FP8 one included (on CPU its GEMM is backends/fp8_gemm.py's BF16 stand-in: about BF16's speed).
The ZeRO-1, ZeRO-2 and FSDP rows are measured in 2 gloo processes on CPU (tools/ledger_ranks.py),
each rank's parameters, master, AdamW states and the gradients its step holds checked to the byte
against ledger/shard.py, with the collectives each step sent; the "over 8" rows stay formulas.
Each section is printed as soon as it is measured; one that cannot run (a row, the ranks'
processes, the what-if) says why in one line and the report goes on. Exit status 0 when every
check passed, 1 when one missed or a section could not run, 2 for bad input.
"""
import functools
import json
import math
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up


import accumulate  # noqa: E402
import fp8  # noqa: E402
from backends import fp8_gemm  # noqa: E402
import memory_ledger as ml  # noqa: E402
import precision  # noqa: E402
import train  # noqa: E402
from guards import cli  # noqa: E402
from config import RunError, UsageError, key  # noqa: E402
from guards.cli import given  # noqa: E402
from ledger import compiled, explain, measure, papers  # noqa: E402
from ledger import parallel as mp  # noqa: E402
from guards.files import check_writable, write_atomically  # noqa: E402
from tools import ledger_report as report  # noqa: E402
from tools.ledger_report import format_table, in_words  # noqa: E402,F401  (tools/chapter.py prints with it)
from tools.ledger_ranks import RANKS, format_ranks, measure_ranks, measure_ranks_many, sharded_rows  # noqa: E402,F401

PEAK_TOL_CPU = 0.02  # the walk's peak against LiveTensors' (exact on the configs the tests run)


@dataclass
class LedgerOptions:
    ranks: int = key(8, "data-parallel ranks for the ZeRO rows and the what-if", at_least=1)
    tp: int = key(8, "tensor-parallel size for the TP rows (the published Table 2 rows keep the paper's t=8)",
                  at_least=1)
    pp: int = key(8, "pipeline stages for the PP rows (the largest divisor of n_layer up to it)", at_least=1)
    cp: int = key(4, "context-parallel size for the CP row", at_least=1)
    gpu_gib: int = key(80, "GPU memory of the what-if, GiB", at_least=1)
    table: str = key("measure", "measure the rows this project runs, or formulas only", ("measure", "formula"))
    what_if_only: bool = key(False, "print only the what-if and the published figures: nothing built or measured")


def run_config(cfg, device):
    """Build cfg's model, take one step (the optimizer states appear), measure the second."""
    model, parts = train.build(cfg, device)
    batch = measure.random_batch(cfg, device)
    accumulate.accumulation_step(model, parts, [batch])
    measured = (compiled.measure if cfg.compile else measure.measure)(model, parts, batch, device)
    return dict(measured, named=explain.named_states(model))


def compare(cfg, meas):
    """[(component, predicted, measured, relative error, ok, rule)] and whether all passed:
    every component exact, on every device; then the peak."""
    pred, rows, cuda = ml.predicted(cfg), [], cfg.device == "cuda"
    for k in ml.COMPONENTS:
        p, m = pred[k], meas[k]
        rows.append((k, p, m, abs(m - p) / max(p, 1), m == p, "exact"))
    pk = ml.peak_estimate(cfg)[0]
    err = abs(meas["peak"] - pk) / max(pk, 1)
    naive = cfg.ckpt_impl == "naive"  # the walk follows the real recompute: the naive one peaks higher
    why = ": the walk follows ckpt_impl=hooks" if naive else ": the walk follows the eager ops" if cfg.compile else ""
    rows.append(("peak", pk, meas["peak"], err, cuda or naive or cfg.compile or err <= PEAK_TOL_CPU,
                 "printed, not checked" + why if cuda or naive or cfg.compile else f"<= {100 * PEAK_TOL_CPU:g}%"))
    return rows, all(r[4] for r in rows)


def format_comparison(cfg, rows, meas):
    lines = [f"memory ledger: precision {precision.recipe(cfg).name}, ckpt {cfg.ckpt}, attn {cfg.attn}, "
             f"L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.block_size} b={cfg.batch_size} "
             f"dropout={cfg.dropout}, device {cfg.device}",
             f"{'component':12} {'predicted':>14} {'measured':>14} {'rel.err':>8}  check"]
    for k, p, m, err, ok, rule in rows:
        note = " (host memory, not in the peak)" if k == "rng_states" else ""
        lines.append(f"{k:12} {p:14,d} {m:14,d} {100 * err:7.2f}%  {'ok' if ok else 'MISS'} ({rule}){note}")
    _, where, alive = ml.peak_estimate(cfg)
    lines.append(f"  peak measured in: {meas['peak_phase']}; predicted at: {where}; alive there: {alive}")
    lines.append(compiled_line(cfg, meas) if cfg.compile else allocator_line(cfg, meas))
    return "\n".join(lines + explain.report(cfg, meas))


def format_closed_forms(cfg, meas):
    """The chapter's closed forms (memory_ledger.py's first section) beside the op-by-op description's
    exact figure and the measured bytes, with each difference named (ledger/papers.closed_form_rows)."""
    measured = {"model states": sum(meas[k] for k in ("parameters", "gradients", "master", "optimizer")),
                "activations": meas["activations"]}
    lines = ["the chapter's closed forms beside the description (exact) and the measurement, bytes:",
             f"{'':28} {'closed form':>14} {'description':>14} {'measured':>14}  the closed form's formula:"]
    for quantity, formula, closed, described, differences in papers.closed_form_rows(cfg):
        got = measured[quantity.split(",")[0]]
        lines.append(f"{quantity:28} {closed:14,d} {described:14,d} {got:14,d}  {formula}")
        lines += [f"{'':28} {n:+14,d}  {why}" for why, n in differences]
    return lines


def allocator_line(cfg, meas):
    """Information, not a check: the live bytes' growth over the forward against the storages the
    forward left alive (the activations, the kept FP8 copies, the loss and its weighted copy). On CPU they are equal; on
    CUDA memory_allocated counts allocator blocks, within allocator_bounds of those storages."""
    growth, storages = meas["forward_growth"], meas["forward_storages"]
    if cfg.device != "cuda":
        return (f"  live bytes' growth over the forward {growth:,}: the storages it left alive (activations, "
                f"kept FP8 copies, the loss and the loss x weight) {sum(storages):,}")
    low, high = measure.allocator_bounds(storages)
    verdict = "within" if low <= growth <= high else "OUTSIDE"
    return (f"  CUDA allocator's growth over the forward {growth:,} bytes (information): the {len(storages)} "
            f"storages it left alive hold {sum(storages):,}, which its blocks count as {low:,} to {high:,} "
            f"(each request rounded up to 512 bytes; one over 1 MiB may hold a cached block up to 1 MiB "
            f"larger): {verdict}")


def compiled_line(cfg, meas):
    """COMPILE: what each compiled block saved, against the eager step's figures (ledger/compiled.py)."""
    per_block = compiled.block_bytes(meas["saved_tensors"], cfg.n_layer)
    blocks = ", ".join(f"{k if k == 'outside' else f'h.{k}'} {v:,}" for k, v in per_block.items())
    graphs = sum("CompiledFunctionBackward" in s.nodes for s in meas["saved_tensors"].values())
    how = "the CUDA allocator's counters" if cfg.device == "cuda" else "the CPU allocator's events"
    return (f"  compiled blocks: saved {meas['activations']:,} bytes ({blocks}; {graphs} tensors held by compiled "
            f"graphs), the eager step {meas['eager_activations']:,}; step peak {meas['peak']:,} ({how}), the eager "
            f"step's {meas['eager_peak']:,} (op by op); a compiled block keeps what its partitioner chose")


def failure(cfg, rows, meas):
    """In words, what a test that holds the ledger exact says when it is not: each component
    that missed, predicted and measured, and what the description does not explain."""
    lines = [f"{k}: predicted {p:,} bytes, measured {m:,} ({'+' if m >= p else ''}{m - p:,})"
             for k, p, m, _, ok, _ in rows if not ok]
    return "\n".join(lines + explain.report(cfg, meas))


# ---------------------------------------------------------------- the chapter's table

def _measured_components(m):
    return dict(parameters=m["parameters"], buffers=m["buffers"], gradients=m["gradients"],
                optimizer=m["master"] + m["optimizer"], fp8_kept=m["fp8_kept"], activations=m["activations"])


def technique_rows(cfg, device, opts, measure_runs=True, skipped=None):
    """[(technique, {component: bytes per GPU}, how)] for cfg's shape. how: "measured" when
    this project runs the technique (one ledger run on this machine), else "formula".

    Gradient accumulation: K = cfg.accum when > 1 (else 4); the row is the same batch of
    b sequences taken in K micro-batches of ceil(b/K), so only the activations shrink.
    FP8: native is measured where its matmul runs on the device, else a formula row;
    Transformer Engine is a formula row: native's activations (an approximation: TE's saved
    tensors are its own) plus its cached FP8 weight copies. The parallel techniques are
    ledger/parallel.py's parallel_rows, all formulas. skipped: None (a row that fails raises),
    or a list that gets one line per row left out, saying why (`make ledger` goes on without it).
    COMPILE: the techniques' rows eager, and one row of the compiled blocks (ledger/compiled.py).
    """
    runs, rows, compiled_blocks = {}, [], cfg.compile
    cfg = replace(cfg, compile=False)

    def row(name, c, runnable=True):
        try:
            if measure_runs and runnable:
                c = replace(c, fp8_backend="native")
                if repr(c) not in runs:  # a row the table already has is measured once
                    runs[repr(c)] = _measured_components(run_config(c, device))
                rows.append((name, runs[repr(c)], "measured"))
            else:
                rows.append((name, ml.components(c), "formula"))
        except Exception as e:  # noqa: BLE001  (the learner's model or description: said, not raised)
            if skipped is None:
                raise
            skipped.append(f"  {name}: skipped: {in_words(e)}")

    row("FP32 baseline", replace(cfg, precision="fp32", ckpt="none", fp32_grad_accum=False))
    row("BF16 mixed precision", replace(cfg, precision="bf16", ckpt="none"))
    if cfg.n_embd % 16 == 0 and fp8.E4M3 is not None:
        runs_here = fp8_gemm.fp8_matmul_error(device) is None  # e.g. False on a pre-sm89 GPU
        row("FP8 (native)", replace(cfg, precision="fp8", ckpt="none", fp8_backend="native"), runnable=runs_here)
        row("FP8 (Transformer Engine)", replace(cfg, precision="fp8", ckpt="none", fp8_backend="te"), runnable=False)
    cur = replace(cfg, ckpt="none")
    accum = cfg.accum if cfg.accum > 1 else 4
    if cfg.batch_size > 1:
        micro = -(-cfg.batch_size // accum)
        row(f"grad accumulation K={accum} (micro-b {micro})", replace(cur, batch_size=micro))
    if compiled_blocks:
        row("torch.compile, each block", replace(cur, compile=True))
    row("full checkpointing", replace(cur, ckpt="full"))
    row("sqrt checkpointing", replace(cur, ckpt="sqrt"))
    if cfg.attn == "manual":
        row("selective checkpointing", replace(cur, ckpt="selective"))
    if measure_runs:  # on CPU in RANKS processes, whatever the device: gloo, exact there
        try:
            rows += sharded_rows(measure_ranks(cur))
        except RunError:
            if skipped is None:
                raise
            skipped.append(f"  ZeRO-1, ZeRO-2 and FSDP over {RANKS}: skipped: their processes failed (below)")
    try:
        rows += [(name, c, "formula") for name, c in mp.parallel_rows(cur, opts.ranks, opts.tp, opts.pp, opts.cp)]
    except Exception as e:  # noqa: BLE001
        if skipped is None:
            raise
        skipped.append(f"  the parallel techniques' rows (formulas, memory_ledger.py's description): skipped: "
                       f"{in_words(e)}")
    return rows


def what_if_text(opts):
    """The what-if and the published figures: formulas only (once per process and size: the same for
    every config)."""
    return _what_if(opts.gpu_gib, opts.ranks)


@functools.lru_cache(maxsize=4)
def _what_if(gpu_gib, ranks):
    out = [report.format_what_if(mp.what_if(gpu_gib, ranks), gpu_gib)]
    ok = True
    for name in mp.BIG_SHAPES:
        big = mp.big_config(name)
        n, m = ml.param_count(big)[0], mp.meta_param_count(big)
        out.append(f"  {name}: formula {n:,} parameters, model.GPT on the meta device {m:,}: "
                   f"{'same' if n == m else 'DIFFERENT'}")
        ok = ok and n == m
    out += ["", report.format_papers(papers.korthikanti_rows(), papers.zero_rows())]
    return "\n".join(out), ok


# ---------------------------------------------------------------- main

def check_options(cfg, opts, argv):
    """Parallel sizes the formulas can mean, and no flag the ledger would ignore. Returns the
    options to use: a default --tp or --cp that does not divide this model's heads or context
    becomes the largest size up to it that does (the row names the size it uses); a size given
    on the command line that does not divide is refused."""
    named = given(argv)
    for name, whole, what in (("tp", math.gcd(cfg.n_head, cfg.n_embd), f"n_head={cfg.n_head} and n_embd={cfg.n_embd}"),
                              ("cp", cfg.block_size, f"block_size={cfg.block_size}")):
        size = getattr(opts, name)
        if whole % size and name in named:
            raise UsageError(f"--{name}={size} must divide {what}")
        opts = replace(opts, **{name: max(d for d in range(1, size + 1) if whole % d == 0)})
    if "pp" in named and cfg.n_layer % opts.pp:
        raise UsageError(f"--pp={opts.pp} must divide n_layer={cfg.n_layer} (each stage holds n_layer/p blocks)")
    ignored = named & {"data", "resume", "sample_only", "memory_snapshot", "max_iters", "log_interval",
                       "eval_interval", "eval_iters", "snapshot_interval", "sample_tokens", "ledger"}
    if ignored:
        raise UsageError(f"--{', --'.join(sorted(ignored))}: the ledger measures one step on random tokens, "
                         f"nothing else applies")
    fp8_settings = precision.recipe(cfg).fp8
    if fp8_settings is not None and fp8_settings.backend == "te":
        raise UsageError("the ledger measures fp8_backend=native only (Transformer Engine's cached FP8 "
                         "weights are a formula row of its table); use --fp8_backend=native")
    return opts


def program(argv):
    """Bad input of any kind (flags, config, an unwritable out_dir) is one line 'error: ...' on stderr and
    exit status 2, refused before anything is measured or printed. Then each section is printed as soon
    as it is measured. A difference between model.py and its description is a finding, not a crash: the
    table is printed with every difference named, and a section that cannot run says why in one line."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + cli.usage("tools/ledger.py", LedgerOptions))
        return 0
    started = time.perf_counter()
    cfg, opts = cli.parse_args(argv, LedgerOptions)
    if opts.what_if_only:  # the big shapes and the papers' own: no key of this run applies
        ignored = given(argv) - {f.name for f in fields(LedgerOptions)}
        if ignored:
            raise UsageError(f"--{', --'.join(sorted(ignored))}: --what_if_only prints the big shapes and the "
                             f"papers' figures, this run's keys do not apply")
        text, ok = what_if_text(opts)
        print(text)
        return 0 if ok else 1
    opts = check_options(cfg, opts, argv)
    device = train.pick_device(cfg)
    cfg = replace(cfg, device=device.type)
    path = Path(cfg.out_dir) / "memory_ledger.svg"
    check_writable(path.parent, "--out_dir")
    try:
        meas = run_config(cfg, device)
    except (UsageError, RunError):
        raise  # a shape this machine cannot hold (ledger/run.check_fits), said as such
    except ValueError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # noqa: BLE001  (the model's own step failed: nothing to compare)
        raise RunError(f"the step could not be measured: {in_words(e)}") from None
    ok, say = True, functools.partial(print, flush=True)
    try:
        rows, ok = compare(cfg, meas)
        described = None
    except Exception as e:  # noqa: BLE001  (memory_ledger.py's description itself failed)
        rows, ok, described = [], False, in_words(e)
        say(format_measured(cfg, meas, described))
    if described is None:
        ok = ok and not explain.report(cfg, meas)  # a name or a dtype the description has wrong is a miss too
        say(format_comparison(cfg, rows, meas))
        say("\n" + "\n".join(section(lambda: format_closed_forms(cfg, meas), "the chapter's closed forms")))
        say("\nactivations, term by term (bytes after forward):")
        say("\n".join(section(lambda: [f"  {t.name:48} {t.nbytes:14,d}" for t in ml.activation_terms(cfg)],
                               "the terms")))
    # the comparison for programs (tools/gpu_check.py's summary): the rows and the allocator's line
    figures = json.dumps(dict(device=cfg.device, ok=ok, allocator=allocator_line(cfg, meas).strip(),
                              rows=[dict(component=k, predicted=p, measured=m, ok=good, rule=rule)
                                    for k, p, m, _, good, rule in rows]), indent=1)
    skipped = []
    table = technique_rows(cfg, device, opts, measure_runs=opts.table == "measure", skipped=skipped)
    say(f"\nfour components x techniques (per GPU, this config, precision {precision.recipe(cfg).name} "
        f"unless named):")
    say("\n".join([report.format_table(table)] + skipped))
    ok = ok and not skipped
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        picture = report.svg(table, f"memory per GPU by technique: L={cfg.n_layer} h={cfg.n_embd} "
                                    f"s={cfg.block_size} b={cfg.batch_size}")
        write_atomically(path, lambda fh: fh.write(picture.encode()))
        write_atomically(path.with_suffix(".json"), lambda fh: fh.write(figures.encode()))
    except OSError as e:
        raise RunError(f"cannot write {path}: {e.strerror or e}") from None
    if opts.table == "measure":
        try:
            rank_lines, ranks_ok = format_ranks(measure_ranks(replace(cfg, ckpt="none")))
        except RunError as e:
            rank_lines, ranks_ok = [f"each rank's states under DDP, ZeRO and FSDP: skipped: {e}"], False
        say("\n" + "\n".join(rank_lines))
        ok = ok and ranks_ok
    if described is None:
        try:
            text, same = what_if_text(opts)
        except Exception as e:  # noqa: BLE001
            text, same = f"the what-if and the published figures: skipped: {in_words(e)}", False
    else:
        text, same = "the what-if and the published figures: skipped: they are the description's, which failed", False
    say("\n" + text)
    say(f"\nwrote {path} and {path.with_suffix('.json').name} ({time.perf_counter() - started:.1f} s)")
    if not (ok and same):
        compiled_only = cfg.compile and [r[0] for r in rows if not r[4]] == ["activations"]
        print("ledger: " + ("the compiled blocks save other tensors than the eager description's (named above)"
                            if compiled_only else "some check missed"), file=sys.stderr)
    return 0 if ok and same else 1


def section(lines, what):
    """lines(), or the one line that says why `what` could not be printed."""
    try:
        return lines()
    except Exception as e:  # noqa: BLE001
        return [f"{what}: skipped: {in_words(e)}"]


def format_measured(cfg, meas, why):
    """The measured components alone, where the description failed (why: in one line)."""
    lines = [f"memory ledger: precision {precision.recipe(cfg).name}, ckpt {cfg.ckpt}, device {cfg.device}: measured "
             f"only; the description (memory_ledger.py) failed: {why}", f"{'component':12} {'measured':>14}"]
    return "\n".join(lines + [f"{k:12} {meas[k]:14,d}" for k in ml.COMPONENTS + ("peak",)])


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
