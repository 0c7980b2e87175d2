"""`make ledger`: the memory ledger's report: the step traced beside the step measured, the chapter's
closed forms beside both, the four components x techniques table, each rank under DDP, ZeRO and FSDP,
the published figures, an SVG. Big shapes, what fits a GPU: `make plan`.

A tool, not a chapter file: it composes ledger/trace.py (the step of model.py as it is, on fake
tensors: the exact column), ledger/measure.py (the same step run and counted), memory_ledger.py (the
formulas, and which of their terms each saved tensor is), ledger/parallel.py (the techniques this
project does not run) and ledger/papers.py (the published figures), and prints.

    python tools/ledger.py --precision=bf16 --ckpt=full   (make ledger PRECISION=bf16 CKPT=full)
    python tools/ledger.py --papers_only                   (make ledger ARGS=--papers_only)

--papers_only prints the published-figure table and nothing else: nothing is run or measured here (it
is traced). Every config key of train.py applies, plus the ledger's own (below).
The checks: every component and the peak, traced against measured, to the byte on CPU (both sides
count the storages of one step op by op: no tolerance); on CUDA the components to the byte and the
peak printed beside the caching allocator's, with the slack its block sizes allow. The closed forms
are no check: every byte the step keeps beyond or below them is named (memory_ledger.differences).
COMPILE=1: the compiled blocks' saved tensors against the eager trace, block by block. The ZeRO-1,
ZeRO-2 and FSDP rows are measured in 2 gloo processes on CPU (tools/ledger_ranks.py), each rank's
states and activations held to the byte to that rank's trace under a fake process group, and its
collectives to the trace's. Each section is printed as soon as it is ready; one that cannot run
says why in one line and the report goes on. Exit status 0 when every check passed, 1 when one
missed or a section could not run, 2 for bad input.
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
from ledger import compiled, measure, papers, trace  # noqa: E402
from ledger.loss import loss_at_most  # noqa: E402
from ledger import parallel as mp  # noqa: E402
from ledger.fits import check_fits  # noqa: E402
from guards.clean_end import check_writable, write_atomically  # noqa: E402
from tools import ledger_report as report  # noqa: E402
from tools.ledger_report import format_table, in_words  # noqa: E402,F401  (tools/chapter.py prints with it)
from tools.ledger_ranks import RANKS, format_ranks, measure_ranks, measure_ranks_many, sharded_rows  # noqa: E402,F401


BIG_SHAPE = "make plan N_LAYER=32 N_EMBD=4096 N_HEAD=32 BLOCK_SIZE=4096 VOCAB_SIZE=32000 NPROC=8"


@dataclass
class LedgerOptions:
    ranks: int = key(8, "data-parallel ranks for the ZeRO and FSDP rows", at_least=1)
    tp: int = key(8, "tensor-parallel size for the TP rows (the published Table 2 rows keep the paper's t=8)",
                  at_least=1)
    pp: int = key(8, "pipeline stages for the PP rows (the largest divisor of n_layer up to it)", at_least=1)
    cp: int = key(4, "context-parallel size for the CP row", at_least=1)
    table: str = key("measure", "measure the rows this project runs, or formulas only", ("measure", "formula"))
    papers_only: bool = key(False, "print only the published figures beside ours: nothing run or measured")


def run_config(cfg, device):
    """Build cfg's model, take one step (the optimizer states appear), measure the second."""
    check_fits(cfg, device)  # a shape this machine cannot hold is refused in one line
    model, parts = train.build(cfg, device)
    batch = measure.random_batch(cfg, device)
    accumulate.accumulation_step(model, parts, [batch])
    measured = (compiled.measure if cfg.compile else measure.measure)(model, parts, batch, device)
    return dict(measured, kinds=ml.module_kinds(model))


def compare(cfg, traced, meas):
    """[(component, traced, measured, ok, rule)] and whether all passed: every component exact on every
    device, the peak exact on CPU. COMPILE: the compiled blocks' activations against the eager trace."""
    rows = [(k, traced[k], meas[k], traced[k] == meas[k], "exact") for k in ml.COMPONENTS]
    if cfg.device == "cuda":
        rows.append(("peak", traced["peak"], meas["peak"], True, "printed: CUDA counts allocator blocks (below)"))
    elif cfg.compile:
        rows.append(("peak", traced["peak"], meas["peak"], True, "printed: a compiled block's kernels allocate "
                                                                  "their own buffers"))
    else:
        rows.append(("peak", traced["peak"], meas["peak"], traced["peak"] == meas["peak"], "exact"))
    return rows, all(r[3] for r in rows)


def format_comparison(cfg, rows, traced, meas):
    lines = [f"memory ledger: precision {precision.decide(cfg).name}, ckpt {cfg.ckpt}, attn {cfg.attn}, "
             f"L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.block_size} b={cfg.batch_size} "
             f"dropout={cfg.dropout}, device {cfg.device}: model.py's step traced on fake tensors (ledger/trace.py) "
             f"and measured", f"{'component':12} {'traced':>14} {'measured':>14}  check"]
    for k, t, m, ok, rule in rows:
        note = " (host memory, not in the peak)" if k == "rng_states" else ""
        lines.append(f"{k:12} {t:14,d} {m:14,d}  {'ok' if ok else 'MISS'} ({rule}){note}")
    lines.append(f"  peak traced in: {traced['peak_phase']}; measured in: {meas['peak_phase']}")
    lines.append(compiled_line(cfg, traced, meas) if cfg.compile else allocator_line(cfg, meas))
    return "\n".join(lines)


def measured_only(cfg, meas, error):
    """The measured components, and why there is no trace: in words, with what it most often means."""
    lines = [f"memory ledger: precision {precision.decide(cfg).name}, ckpt {cfg.ckpt}, the step measured only",
             f"{'component':12} {'measured':>14}"] + [f"{k:12} {meas[k]:14,d}" for k in (*ml.COMPONENTS, "peak")]
    return "\n".join(lines + [f"the trace (ledger/trace.py: model.py on fake tensors) failed: {in_words(error)}; a "
                              f"fake tensor has shapes and no values, so a model that reads one (.item(), a "
                              f"tensor in an if) runs for real only"])


def format_closed_forms(cfg, traced, meas):
    """The chapter's closed forms (memory_ledger.py's first section) beside the trace and the measurement,
    the states and then the activations term by term, each difference named in words."""
    states = lambda d: sum(d[k] for k in ("parameters", "gradients", "master", "optimizer"))  # noqa: E731
    P, n_tensors = traced["params"]
    closed, named = ml.state_differences(cfg, P, n_tensors, states(traced))
    per = ml.bytes_per_param_closed(precision.decide(cfg).name)
    lines = ["the chapter's closed forms beside the trace (exact) and the measurement, bytes:",
             f"{'':28} {'closed form':>14} {'traced':>14} {'measured':>14}  the closed form's formula:",
             f"{'model states':28} {closed:14,d} {states(traced):14,d} {states(meas):14,d}  "
             f"{sum(per)} bytes/parameter ({' + '.join(map(str, per))}) x P, P = {P:,}"]
    lines += [f"{'':28} {n:+14,d}  {why}" for why, n in named]
    chapter_P = ml.params_closed(cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.bias)
    if P != chapter_P:  # a learner's model: the closed form takes its P, and says how far it is from the chapter's
        lines.append(f"{'':28} P is {abs(P - chapter_P):,} {'above' if P > chapter_P else 'below'} the chapter's GPT"
                     f" (12Lh^2 + {13 if cfg.bias else 2}Lh + Vh + sh + {2 if cfg.bias else 1}h = {chapter_P:,})")
    terms, unmatched = ml.account(traced["saved_tensors"], traced["kinds"])
    measured_terms, measured_unmatched = ml.account(meas["saved_tensors"], meas["kinds"])
    got = lambda tensors: sum(s.nbytes for s in tensors)  # noqa: E731
    closed_terms = ml.closed_terms(cfg)
    lines.append(f"{f'activations, ckpt={cfg.ckpt}':28} {sum(closed_terms.values()):14,d} "
                 f"{traced['activations']:14,d} {meas['activations']:14,d}  the terms below (Korthikanti et al. "
                 f"2022 per layer, the head's)")
    for term, formula in ml.TERMS.items():
        lines.append(f"  {term:26} {closed_terms[term]:14,d} {got(terms[term]):14,d} {got(measured_terms[term]):14,d}"
                     f"  {formula}")
    if unmatched or measured_unmatched:
        lines.append(f"  {'not in the formulas':26} {0:14,d} {got(unmatched):14,d} {got(measured_unmatched):14,d}")
    for term, closed_n, n, words in ml.differences(cfg, terms, unmatched):
        lines.append(f"  {term}: {n - closed_n:+,} bytes against the formula:")
        lines += [f"      {w}" for w in words]
    return lines + section(lambda: loss_lines(cfg), "the loss, at its most")  # a learner's loss may not run alone


def loss_lines(cfg):
    """The loss's temporaries at their most (model.GPT.head_and_loss run alone), beside their closed form."""
    closed = ml.loss_temporaries_closed(cfg.block_size, cfg.batch_size, cfg.vocab_size, cfg.loss_chunks)
    traced, alive = loss_at_most(cfg)
    measured = f"{loss_at_most(cfg, fake=False)[0]:14,d}" if cfg.device == "cpu" else f"{'-':>14}"
    pieces = f", in {cfg.loss_chunks} pieces: bs/{cfg.loss_chunks} rows" if cfg.loss_chunks > 1 else ""
    lines = [f"{'the loss, at its most':28} {closed:14,d} {traced:14,d} {measured}  3 x 4bsV: the FP32 log-softmax, "
             f"its gradient from the NLL, the logits' gradient{pieces}"]
    if traced != closed:
        lines.append(f"  the loss: {traced - closed:+,} bytes against the formula, alive beside its three tensors:")
        lines += [f"      {line}" for line in ml.loss_differences(cfg, alive)]
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


def compiled_line(cfg, traced, meas):
    """COMPILE: what each compiled block saved, against the eager trace's, block by block (ledger/compiled.py)."""
    per_block, eager = (compiled.block_bytes(m["saved_tensors"], cfg.n_layer) for m in (meas, traced))
    blocks = ", ".join(f"{k if k == 'outside' else f'h.{k}'} {v:,}" + ("" if v == eager[k] else f" (eager {eager[k]:,})")
                       for k, v in per_block.items())
    held = [s for s in meas["saved_tensors"].values() if any(node == "CompiledFunctionBackward" for node, *_ in s.inputs)]
    how = "the CUDA allocator's counters" if cfg.device == "cuda" else "the CPU allocator's events"
    return (f"  compiled blocks saved {meas['activations']:,} bytes ({blocks}; {len(held)} tensors held by compiled "
            f"graphs), the eager trace {traced['activations']:,}; the step's peak {meas['peak']:,} ({how}); a "
            f"compiled block keeps what its partitioner chose:\n" + "\n".join(f"    {w}" for w in ml.in_words(held)))


def failure(cfg, rows):
    """In words, what a test that holds the ledger exact says when it is not: each component that
    missed, traced and measured."""
    return "\n".join(f"{k}: traced {t:,} bytes, measured {m:,} ({'+' if m >= t else ''}{m - t:,})"
                     for k, t, m, ok, _ in rows if not ok)


# ---------------------------------------------------------------- the chapter's table

def technique_rows(cfg, device, opts, measure_runs=True, skipped=None, not_here=None):
    """[(technique, {component: bytes per GPU}, how)] for cfg's shape. how: "measured" when
    this project runs the technique (one ledger run on this machine), "traced" where it is not run here
    (--table=formula, FP8 where this device has no FP8 GEMM), "formula" for the techniques it does not run.

    Gradient accumulation: K = cfg.accum when > 1 (else 4); the row is the same batch of
    b sequences taken in K micro-batches of ceil(b/K), so only the activations shrink.
    FP8: native is measured where its matmul runs on the device; Transformer Engine is a formula row:
    native's activations (an approximation: TE's saved tensors are its own) plus its FP8 weight and
    transpose (cached across steps under FP8_KEEP_WEIGHT, else saved for backward: ledger/parallel.te_weights). The parallel techniques are ledger/parallel.py's parallel_rows, formulas on this
    config's trace. skipped: None (a row that fails raises), or a list that gets one line per row left
    out, saying why (`make ledger` goes on without it). not_here: None, or a list that gets one line per
    technique this model's shapes rule out (FP8 on a Linear that is not a multiple of 16): not a miss.
    COMPILE: one more row, the compiled blocks.
    """
    runs, rows, compiled_blocks = {}, [], cfg.compile
    cfg = replace(cfg, compile=False)

    def row(name, c, runnable=True, extra=None):
        try:
            c = replace(c, fp8_backend="native")
            counted = (run_config if measure_runs and runnable else lambda c, d: trace.step(c))
            if repr((c, measure_runs and runnable)) not in runs:  # a row the table has already is counted once
                runs[repr((c, measure_runs and runnable))] = ml.components(counted(c, device))
            components = dict(runs[repr((c, measure_runs and runnable))])
            if extra:
                components = extra(components, c)
            rows.append((name, components, "formula" if extra else "measured" if measure_runs and runnable else
                         "traced"))
        except UsageError as e:  # the technique's own rule refuses this model (build.py says which Linear)
            if not_here is None:
                raise
            not_here.append(f"  {name}: does not apply to this model: {e}")
        except Exception as e:  # noqa: BLE001  (the learner's model: said, not raised)
            if skipped is None:
                raise
            skipped.append(f"  {name}: skipped: {in_words(e)}")

    row("FP32 baseline", replace(cfg, precision="fp32", ckpt="none", fp32_grad_accum=False))
    row("BF16 mixed precision", replace(cfg, precision="bf16", ckpt="none"))
    if fp8.E4M3 is not None:
        runs_here = fp8_gemm.fp8_matmul_error(device) is None  # e.g. False on a pre-sm89 GPU
        fp8_cfg = replace(cfg, precision="fp8", ckpt="none", fp8_backend="native")
        row("FP8 (native)", fp8_cfg, runnable=runs_here)
        row("FP8 (Transformer Engine)", fp8_cfg, runnable=runs_here, extra=mp.te_weights)
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
        rows += mp.parallel_rows(cur, opts.ranks, opts.tp, opts.pp, opts.cp)
    except Exception as e:  # noqa: BLE001
        if skipped is None:
            raise
        skipped.append(f"  the parallel techniques' rows (formulas on this config's trace): skipped: {in_words(e)}")
    return rows


@functools.lru_cache(maxsize=1)
def papers_text():
    """The published figures beside ours: traced, once per process (the same for every config)."""
    return report.format_papers(papers.korthikanti_rows(), papers.zero_rows()) + \
        f"\nbig shapes, what fits a GPU and with what: {BIG_SHAPE} (ledger/plan.py)", True


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
    fp8_settings = precision.decide(cfg).fp8
    if fp8_settings is not None and fp8_settings.backend == "te":
        raise UsageError("the ledger measures fp8_backend=native only (Transformer Engine's cached FP8 "
                         "weights are a formula row of its table); use --fp8_backend=native")
    return opts


def program(argv):
    """Bad input of any kind (flags, config, an unwritable out_dir) is one line 'error: ...' on stderr and
    exit status 2, refused before anything is measured or printed. Then each section is printed as soon
    as it is ready. A learner's model that fails in its own step says why in one line (exit 1)."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + cli.usage("tools/ledger.py", LedgerOptions))
        return 0
    started = time.perf_counter()
    cfg, opts = cli.parse_args(argv, LedgerOptions)
    say = functools.partial(print, flush=True)
    if opts.papers_only:  # the papers' shapes: no key of this run applies, nor the ledger's sizes
        ignored = given(argv) - {"papers_only"}
        if ignored:
            raise UsageError(f"--{', --'.join(sorted(ignored))}: --papers_only prints the papers' figures at "
                             f"their shapes, this run's keys do not apply")
        text, ok = section_text(papers_text, "the published figures")
        say(text)
        return 0 if ok else 1
    opts = check_options(cfg, opts, argv)
    device = train.pick_device(cfg)
    cfg = replace(cfg, device=device.type)
    path = Path(cfg.out_dir) / "memory_ledger.svg"
    check_writable(path.parent, "--out_dir")
    try:
        meas = run_config(cfg, device)
    except (UsageError, RunError):
        raise  # a shape this machine cannot hold (guards/preflight.check_fits), said as such
    except ValueError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # noqa: BLE001  (the model's own step failed: nothing to compare)
        raise RunError(f"the step could not be run: {in_words(e)}") from None
    try:
        traced = trace.step(replace(cfg, compile=False))
    except Exception as e:  # noqa: BLE001  (the learner's model runs for real, not on fake tensors)
        say(measured_only(cfg, meas, e))
        print("ledger: the trace failed (named above)", file=sys.stderr)
        return 1
    rows, ok = compare(cfg, traced, meas)
    say(format_comparison(cfg, rows, traced, meas))
    say("\n" + "\n".join(section(lambda: format_closed_forms(cfg, traced, meas), "the chapter's closed forms")))
    # the comparison for programs (tools/gpu_check.py's summary): the rows and the allocator's line
    figures = json.dumps(dict(device=cfg.device, ok=ok, allocator=allocator_line(cfg, meas).strip(),
                              rows=[dict(component=k, traced=t, measured=m, ok=good, rule=rule)
                                    for k, t, m, good, rule in rows]), indent=1)
    skipped, not_here = [], []
    table = technique_rows(cfg, device, opts, measure_runs=opts.table == "measure", skipped=skipped,
                           not_here=not_here)
    say(f"\nfour components x techniques (per GPU, this config, precision {precision.decide(cfg).name} "
        f"unless named):")
    say("\n".join([report.format_table(table)] + not_here + skipped))
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
            rank_lines, ranks_ok = format_ranks(replace(cfg, ckpt="none"), measure_ranks(replace(cfg, ckpt="none")))
        except RunError as e:
            rank_lines, ranks_ok = [f"each rank's states under DDP, ZeRO and FSDP: skipped: {e}"], False
        say("\n" + "\n".join(rank_lines))
        ok = ok and ranks_ok
    text, same = section_text(papers_text, "the published figures")
    say("\n" + text)
    say(f"\nwrote {path} and {path.with_suffix('.json').name} ({time.perf_counter() - started:.1f} s)")
    if not (ok and same):
        compiled_only = cfg.compile and [r[0] for r in rows if not r[3]] == ["activations"]
        print("ledger: " + ("the compiled blocks save other tensors than the eager trace (named above)"
                            if compiled_only else "some check missed"), file=sys.stderr)
    return 0 if ok and same else 1


def section(lines, what):
    """lines(), or the one line that says why `what` could not be printed."""
    try:
        return lines()
    except Exception as e:  # noqa: BLE001
        return [f"{what}: skipped: {in_words(e)}"]


def section_text(text_and_ok, what):
    """(text, ok) of a section, or the line that says why it could not be printed and False."""
    try:
        return text_and_ok()
    except Exception as e:  # noqa: BLE001
        return f"{what}: skipped: {in_words(e)}", False


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
