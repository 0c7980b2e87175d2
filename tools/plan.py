"""`make plan`: will it fit? Every configuration of model.py as it is that fits a GPU, fastest first.

A tool, not a chapter file: it asks ledger/plan.py (the planner, on the traced step of model.py:
ledger/trace.py) and prints. For the model shape of the config keys (N_LAYER, N_EMBD, N_HEAD,
BLOCK_SIZE, VOCAB_SIZE, DROPOUT, BIAS), a GPU, NPROC GPUs and a target batch (TOTAL_BATCH_TOKENS), it
lists every precision x recompute policy x sharding x attention that fits (the loss in 4, 16 or 64 pieces,
LOSS_CHUNKS, where it does not fit whole; "loss" is the pieces): the largest micro-batch (or
BATCH_SIZE's, where given: does it fit?), the micro-steps to the target batch, the peak as
torch.cuda.max_memory_allocated, max_memory_reserved and nvidia-smi would show it, the headroom, the
recompute FLOPs, what a step sends, the step time at a stated MFU; what does not fit or run says why.
The best row ends with the command that runs it.

    python tools/plan.py --n_layer=32 --n_embd=4096 --n_head=32 --block_size=4096 --vocab_size=32000 --nproc=8
    make plan N_LAYER=32 N_EMBD=4096 N_HEAD=32 BLOCK_SIZE=4096 VOCAB_SIZE=32000 NPROC=8 ARGS=--gpu=H200

--gpu is a name of the table (ledger/gpus.py) or a size ("24GiB": what CUDA reports). A key of
the search given on the command line (PRECISION, CKPT, SHARD, ATTN, LOSS_CHUNKS) fixes it. DEVICE=cpu plans
against a byte budget as this machine measures it (--gpu=<size>; no CUDA context, no allocator):
what tests/test_plan.py holds to ledger/measure.py. Writes OUT_DIR/plan.svg. On a terminal, one line on
stderr counts the traces as they are made; the last line says how long it took. Bad input is one line
'error: ...' and exit status 2, nothing written; no configuration that fits is exit status 1.
"""
import math
import os
import sys
import time
from html import escape
from dataclasses import dataclass, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import checkpoint  # noqa: E402
from config import UsageError, choices, key  # noqa: E402
from guards import cli  # noqa: E402
from guards.clean_end import check_writable, write_atomically  # noqa: E402
from ledger import gpus, kept  # noqa: E402
from ledger import plan as lp  # noqa: E402
from ledger.measure import SMALL_SIZE  # noqa: E402
from tools.ledger_report import fmt_bytes  # noqa: E402

SHAPE = ("n_layer", "n_embd", "n_head", "block_size", "vocab_size", "dropout", "bias")
APPLIES = set(SHAPE + lp.SEARCHED) | {"loss_chunks", "total_batch_tokens", "device", "out_dir", "peak_flops",
                                   "fp32_grad_accum", "ckpt_segment", "batch_size"}
MAKE_NAMES = dict(n_layer="N_LAYER", n_embd="N_EMBD", n_head="N_HEAD", block_size="BLOCK_SIZE",
                  vocab_size="VOCAB_SIZE", dropout="DROPOUT", bias="BIAS", fp32_grad_accum="FP32_GRAD_ACCUM",
                  ckpt_segment="CKPT_SEGMENT")


@dataclass
class PlanOptions:
    gpu: str = key("H100", f"a GPU of the table ({', '.join(gpus.GPUS)}) or a size such as 24GiB")
    nproc: int = key(1, "GPUs, one data-parallel rank each (make plan NPROC=8); this planner's range: up to 16384",
                     at_least=1, at_most=16384)
    mfu: float = key(lp.MFU, "the share of the GPU's peak FLOP/s the step time assumes, in (0, 1]", at_least=0.0)
    context_mib: int = key(lp.CONTEXT_MIB, "MiB the CUDA context takes outside PyTorch's allocator "
                                           "(make gpu-check measures it)", at_least=0)
    trace_cache: str = key(".cache/traces", "the folder traces are kept in, so a second question reads them "
                                            "(relative: to the project); empty: none kept")


def options(argv):
    """(cfg, opts, gpu, target tokens, fixed keys) from the command line, or UsageError."""
    cfg, opts = cli.parse_args(argv, PlanOptions)
    named = cli.given(argv)
    ignored = named - APPLIES - {f.name for f in fields(PlanOptions)}
    if "compile" in ignored:
        raise UsageError("--compile: the plan traces the eager step; compiled blocks keep what their partitioner "
                         "chooses (make ledger COMPILE=1 measures it)")
    if ignored:
        raise UsageError(f"--{', --'.join(sorted(ignored))}: the plan traces one step of the shape it is given, "
                         f"this does not apply")
    if not 0 < opts.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {opts.mfu}")
    gpu = gpus.find_gpu(opts.gpu)
    cpu = cfg.device == "cpu"
    if cpu and gpu.tflops is not None:
        raise UsageError(f"--device=cpu plans against a byte budget: give --gpu=<size> (e.g. 64MiB), not {gpu.name}")
    if not cpu and gpu.total <= opts.context_mib * lp.MIB:
        raise UsageError(f"--gpu={opts.gpu} is {fmt_bytes(gpu.total)}: not more than the CUDA context "
                         f"({opts.context_mib} MiB, --context_mib) alone")
    if "loss_chunks" in named and cfg.block_size % cfg.loss_chunks:
        raise UsageError(f"--loss_chunks={cfg.loss_chunks} does not divide block_size={cfg.block_size}: the plan "
                         f"extends a step in the micro-batch, which needs equal pieces at every b")
    if "shard" in named and cfg.shard != "none" and opts.nproc == 1:
        raise UsageError(f"--shard={cfg.shard} splits over ranks: give NPROC > 1 (--nproc)")
    step_tokens = opts.nproc * cfg.block_size
    target = cfg.total_batch_tokens or step_tokens * -(-lp.TARGET_TOKENS // step_tokens)
    if target % step_tokens:
        raise UsageError(f"--total_batch_tokens={target} is not a multiple of NPROC x block_size = {opts.nproc} x "
                         f"{cfg.block_size} = {step_tokens}")
    if "batch_size" in named and (target // step_tokens) % cfg.batch_size:
        raise UsageError(f"--batch_size={cfg.batch_size} does not divide the {target // step_tokens} sequences each "
                         f"GPU takes per step (TOTAL_BATCH_TOKENS={target} over NPROC={opts.nproc} x block_size "
                         f"{cfg.block_size})")
    return cfg, opts, gpu, target, {k: getattr(cfg, k) for k in (*lp.SEARCHED, "loss_chunks") if k in named}, \
        cfg.batch_size if "batch_size" in named else None


def command(cfg, row, world):
    """The make line that runs `row`: make train (one GPU) or make ddp NPROC=world."""
    words = ["make", "ddp", f"NPROC={world}"] if world > 1 else ["make", "train"]
    for flag in cli.flags(cfg):  # the shape's keys off their defaults, as make variables
        name, value = flag[2:].split("=", 1)
        if name in MAKE_NAMES:
            words.append(f"{MAKE_NAMES[name]}={value}")
    words += [f"PRECISION={row.precision}", f"CKPT={row.ckpt}", f"ATTN={row.attn}"]
    words += [f"SHARD={row.shard}"] if world > 1 else []
    words += [f"LOSS_CHUNKS={row.loss_chunks}"] if row.loss_chunks > 1 else []
    words += [f"BATCH_SIZE={row.b}", f"ACCUM={row.accum}"]
    return " ".join(words)


def margin_lines(cfg, gpu, opts):
    """Where the budget comes from: the GPU's memory less what is not PyTorch's tensors, each with its source."""
    if cfg.device == "cpu":
        return [f"budget: {gpu.total:,} bytes as given (CPU: no CUDA context, no caching allocator; ledger/measure.py "
                f"counts live storages)"]
    lines = [f"budget per GPU: {gpu.name}, {fmt_bytes(gpu.total)} as CUDA reports it"
             + (f" ({fmt_bytes(gpu.total + gpu.driver)} in nvidia-smi)" if gpu.driver else "")
             + f", less {opts.context_mib} MiB the CUDA context (pytorch/pytorch#109888); figures: {gpu.source}",
             f"  allocated = the traced peak + up to 511 bytes per storage alive there (the caching allocator rounds "
             f"to 512: CUDACachingAllocator.cpp) + {fmt_bytes(gpu.workspace)} of BLAS workspaces (main and autograd "
             f"threads: ledger/gpus.py)",
             f"  reserved = allocated + up to {SMALL_SIZE // lp.MIB} MiB per storage over {SMALL_SIZE // lp.MIB} MiB "
             f"there (a cached block may be larger); it must fit the budget. nvidia-smi = reserved + the context",
             f"  a GPU's kernels are traced by ledger/cuda_rules.CUDA's rules where this torch has no CUDA (each "
             f"unverified until make gpu-check); make gpu-check measures the context and the allocator on the GPU it "
             f"runs on"]
    return lines


def table(rows):
    head = (f"{'precision':9} {'ckpt':9} {'shard':5} {'attn':6} {'loss':>4} {'b':>4} {'K':>4} {'allocated':>10} "
            f"{'reserved':>10} {'nvidia-smi':>10} {'headroom':>10} {'recompute':>9} {'sent/step':>10} {'step':>8} "
            f"{'tokens/s':>12}")
    out = [head]
    for r in rows:
        if r.why:
            continue
        step = f"{r.step_s:7.2f}s" if r.step_s else "-"
        speed = f"{r.tokens_per_s:12,.0f}" if r.tokens_per_s else "-"
        out.append(f"{r.precision:9} {r.ckpt:9} {r.shard:5} {r.attn:6} {r.loss_chunks:4d} {r.b:4d} {r.accum:4d} "
                   f"{fmt_bytes(r.allocated):>10} {fmt_bytes(r.reserved):>10} {fmt_bytes(r.smi):>10} "
                   f"{fmt_bytes(r.budget - r.reserved):>10} {100 * r.recompute:+8.1f}% {fmt_bytes(r.sent):>10} "
                   f"{step:>8} {speed:>12}")
    return out


def pictured_pair(rows):
    """The precision and attention the picture shows: the one whose policies and shardings run most
    (fp8 runs no fsdp, sdpa no selective), the fastest of those."""
    pairs = {(r.precision, r.attn) for r in rows}
    runs = lambda pair: [r for r in rows if (r.precision, r.attn) == pair and (r.peak or r.states)]  # noqa: E731
    return max(pairs, key=lambda pair: (len(runs(pair)), max((r.tokens_per_s or 0) for r in runs(pair) or rows),
                                        -sum(r.peak for r in runs(pair))))


def svg(rows, title):
    """Per recompute policy and sharding (one precision and attention): the peak at the largest
    micro-batch that fits, the states apart from the rest, against the budget's line."""
    W, left, bar, gap, head = 900, 230, 16, 6, 56
    H = head + len(rows) * (bar + gap) + 40
    top = max([r.peak for r in rows] + [r.states for r in rows] + [r.budget for r in rows]) or 1
    scale = (W - left - 140) / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>',
           '<rect x="10" y="32" width="12" height="12" fill="#4e79a7"/><text x="26" y="42">states, buffers, batch '
           '(all step)</text><rect x="230" y="32" width="12" height="12" fill="#59a14f"/><text x="246" y="42">'
           'activations and the rest, at the peak</text>']
    for i, r in enumerate(rows):
        y = head + i * (bar + gap)
        label = f"{r.ckpt}, {r.shard}"
        out.append(f'<text x="{left - 6}" y="{y + 12}" text-anchor="end">{escape(label)}</text>')
        states, rest = min(r.states, top), max(0, r.peak - r.states)
        out.append(f'<rect x="{left}" y="{y}" width="{states * scale:.1f}" height="{bar}" fill="#4e79a7"/>')
        out.append(f'<rect x="{left + states * scale:.1f}" y="{y}" width="{rest * scale:.1f}" height="{bar}" '
                   f'fill="#59a14f"/>')
        note = f"b={r.b} K={r.accum}" if not r.why else r.why.split(" (")[0]
        end = left + max(r.peak, r.states) * scale
        out.append(f'<text x="{end + 4:.1f}" y="{y + 12}">{escape(note)}</text>')
    x = left + rows[0].budget * scale
    out.append(f'<line x1="{x:.1f}" y1="{head - 6}" x2="{x:.1f}" y2="{H - 34}" stroke="#e15759" stroke-width="2"/>'
               f'<text x="{x + 4:.1f}" y="{H - 22}" fill="#e15759">the budget per GPU</text>')
    out.append(f'<text x="10" y="{H - 8}">bytes per GPU at each row\'s micro-batch (b=1 where nothing fits); '
               f'ledger/plan.py, make plan</text></svg>')
    return "\n".join(out) + "\n"


def progress_line(started):
    """On a terminal, one line kept current while the traces are made: a first plan of a big model takes a
    minute, and silence would look like a hang."""
    def show(done, asked):
        sys.stderr.write(f"\rtracing model.py's steps: {done} made of the {asked} asked so far, "
                         f"{time.perf_counter() - started:.0f} s")
        sys.stderr.flush()
    return show


def program(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + cli.usage("tools/plan.py", PlanOptions))
        return 0
    started = time.perf_counter()
    cfg, opts, gpu, target, fixed, batch = options(argv)
    path = Path(cfg.out_dir) / "plan.svg"
    check_writable(path.parent, "--out_dir")
    world = opts.nproc
    cache = opts.trace_cache and Path(__file__).resolve().parent.parent / opts.trace_cache
    if cache:
        check_writable(cache, "--trace_cache")
    counts = dict(kept.COUNTS)
    progress = progress_line(started) if sys.stderr.isatty() else None
    try:
        with kept.kept_on_disk(cache):
            rows = lp.plan(cfg, gpu, world, target, fixed, opts.mfu, 0 if cfg.device == "cpu" else
                           opts.context_mib * lp.MIB, batch, workers=len(os.sched_getaffinity(0)),  # a process per core
                           progress=progress)
    finally:  # the progress line goes, whatever follows it: the plan, an error's line, Ctrl-C's
        if progress:
            sys.stderr.write("\r\033[K")
    made, read = (kept.COUNTS[k] - counts[k] for k in ("traced", "read"))
    if not rows:
        raise UsageError(f"nothing to plan: {', '.join(f'{k}={v}' for k, v in fixed.items())} with NPROC={world}")
    P = sum(math.prod(shape) for shape in lp.param_shapes(cfg))
    fits = [r for r in rows if r.why is None]
    print(f"plan: L={cfg.n_layer} h={cfg.n_embd} a={cfg.n_head} s={cfg.block_size} V={cfg.vocab_size} "
          f"({P:,} parameters) on {world} x {gpu.name}, {target:,} tokens per optimizer step "
          f"({target // (world * cfg.block_size)} sequences per GPU)")
    print("\n".join(margin_lines(cfg, gpu, opts)))
    peak_source = "the GPU's peak (ledger/gpus.py)" if gpu.tflops else \
        "PEAK_FLOPS" if cfg.peak_flops else None
    print(f"step = (model + recompute FLOPs, counted on the trace) per GPU / ({peak_source} x MFU {opts.mfu:.0%}); "
          f"fp8: its FP8 GEMMs' FLOPs at FP8's peak, the rest at BF16's" if peak_source else
          "step time: no FLOP/s for a GPU given by its size (PEAK_FLOPS=... gives one): sorted by recompute, bytes")
    print(f"\n{len(fits)} configurations fit{f' at BATCH_SIZE={batch}' if batch else ''}, "
          f"{'fastest first' if peak_source else 'least recompute first'} (the highest rank's peak, traced op by op: "
          f"on CPU what ledger/measure.py measures; sent: what a step's collectives move per rank, the ZeRO "
          f"paper's volume):")
    print("\n".join(table(rows)))
    if fits:
        best = fits[0]
        print(f"\nbest: {best.precision} {best.ckpt} {best.shard} {best.attn}, micro-batch {best.b} x {best.accum} "
              f"micro-steps x {world} GPUs; peak at {best.where}\n  {command(cfg, best, world)}")
    print(f"\ndoes not fit or run ({len(rows) - len(fits)}):")
    print("\n".join(f"  {r.precision:9} {r.ckpt:9} {r.shard:5} {r.attn:6} {r.why}"
                    + (f" (the loss in as many as {r.loss_chunks} pieces too)" if r.loss_chunks > 1 else "")
                    for r in rows if r.why))
    pictured_precision, attn = pictured_pair(rows)
    pictured = [r for r in rows if (r.precision, r.attn) == (pictured_precision, attn) and (r.peak or r.states)] \
        or rows  # nothing traced (every row refused): the rows still, each with why
    pictured.sort(key=lambda r: (list(checkpoint.POLICIES).index(r.ckpt), choices("shard").index(r.shard)))
    picture = svg(pictured, f"{cfg.n_layer} layers, width {cfg.n_embd}, context {cfg.block_size} on {world} x "
                            f"{gpu.name}: {pictured_precision}, attn {attn}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda fh: fh.write(picture.encode()))
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s: {made} traces made"
          + (f", {read} read from {cache}" if cache else "") + ")")
    return 0 if fits else 1


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
