"""`make ledger`: the memory ledger's report: predicted vs measured bytes, the chapter's table, an SVG.

A tool, not a chapter file: it composes memory_ledger.py (formulas), memory_measure.py
(measurement) and memory_parallel.py (the parallel techniques, the what-if) and prints.

    python tools/ledger.py --precision=bf16 --ckpt=full      (make ledger PRECISION=bf16 CKPT=full)

Every config key of train.py applies, plus the ledger's own: --ranks=N (ZeRO/data
parallel), --tp=t, --pp=p, --cp=c (sequence/context parallel), --gpu_gib=G (what-if GPU
size), --table=measure|formula. Exit status 0 when every component matched, 1 when one
missed, 2 for bad input.
"""
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import torch  # noqa: E402

import accumulate  # noqa: E402
import fp8  # noqa: E402
import memory_ledger as ml  # noqa: E402
import memory_measure  # noqa: E402
import memory_parallel as mp  # noqa: E402
import precision  # noqa: E402
import train  # noqa: E402
from config import UsageError, key, parse_args, usage  # noqa: E402
from snapshot import write_atomically  # noqa: E402

EXACT = ("parameters", "gradients", "master", "optimizer", "buffers")  # storage sizes: must match to the byte
ACT_TOL = {"cpu": 0.02, "cuda": 0.05}  # activations: saved-tensor bytes (CPU), allocator deltas (CUDA)


@dataclass
class LedgerOptions:
    ranks: int = key(8, "data-parallel ranks for the ZeRO rows and the what-if", at_least=1)
    tp: int = key(8, "tensor-parallel size for the TP rows", at_least=1)
    pp: int = key(8, "pipeline stages for the PP row", at_least=1)
    cp: int = key(4, "context-parallel size for the CP row", at_least=1)
    gpu_gib: int = key(80, "GPU memory of the what-if, GiB", at_least=1)
    table: str = key("measure", "measure the rows this project runs, or formulas only", ("measure", "formula"))


def run_config(cfg, device):
    """Build cfg's model, take one step (the optimizer states appear), measure the second."""
    model, parts = train.build(cfg, device)
    batch = memory_measure.random_batch(cfg, device)
    accumulate.accumulation_step(model, parts, [batch])
    return memory_measure.measure(model, parts, batch, device)


def compare(cfg, meas):
    """[(component, predicted, measured, relative error, ok)] and whether all passed."""
    pred, rows, tol = ml.predicted(cfg), [], ACT_TOL[cfg.device]
    for k in ml.COMPONENTS:
        p, m = pred[k], meas[k]
        err = abs(m - p) / max(p, 1)
        ok = m == p if k in EXACT else err <= tol
        rows.append((k, p, m, err, ok))
    return rows, all(r[4] for r in rows)


def fmt_bytes(n):
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def format_comparison(cfg, rows, meas):
    tol = ACT_TOL[cfg.device]
    lines = [f"memory ledger: precision {precision.recipe(cfg).name}, ckpt {cfg.ckpt}, attn {cfg.attn}, L={cfg.n_layer} "
             f"h={cfg.n_embd} a={cfg.n_head} s={cfg.block_size} b={cfg.batch_size} dropout={cfg.dropout}, "
             f"device {cfg.device}",
             f"{'component':12} {'predicted':>14} {'measured':>14} {'rel.err':>8}  check"]
    for k, p, m, err, ok in rows:
        rule = "exact" if k in EXACT else f"<= {100 * tol:g}%"
        lines.append(f"{k:12} {p:14,d} {m:14,d} {100 * err:7.2f}%  {'ok' if ok else 'MISS'} ({rule})")
    pk, where, alive = ml.peak_estimate(cfg)
    err = abs(meas["peak"] - pk) / max(pk, 1)
    lines.append(f"{'peak':12} {pk:14,d} {meas['peak']:14,d} {100 * err:7.2f}%  estimate, not checked "
                 f"(measured in: {meas['peak_phase']}; predicted at {where}: {alive})")
    return "\n".join(lines)


# ---------------------------------------------------------------- the chapter's table

def _measured_components(m):
    return dict(parameters=m["parameters"] + m["buffers"], gradients=m["gradients"],
                optimizer=m["master"] + m["optimizer"], activations=m["activations"])


def technique_rows(cfg, device, opts, measure_runs=True):
    """[(technique, {component: bytes per GPU}, how)] for cfg's shape. how: "measured" when
    this project runs the technique (one ledger run on this machine), else "formula".

    Gradient accumulation: K = cfg.accum when > 1 (else 4); the row is the same batch of
    b sequences taken in K micro-batches of ceil(b/K), so only the activations shrink.
    FP8: native is measured (whatever cfg.fp8_backend says) where its matmul runs on the
    device, else a formula row; Transformer Engine is a formula row: native's activations
    (an approximation: TE's saved tensors are its own) plus its cached FP8 weight copies.
    The parallel techniques are memory_parallel.parallel_rows, all formulas.
    """
    runs = {}

    def row(name, c, runnable=True):
        if measure_runs and runnable:
            c = replace(c, fp8_backend="native")
            if repr(c) not in runs:  # a row the table already has is measured once
                runs[repr(c)] = _measured_components(run_config(c, device))
            return (name, runs[repr(c)], "measured")
        return (name, ml.components(c), "formula")

    rows = [row("FP32 baseline", replace(cfg, precision="fp32", ckpt="none", fp32_grad_accum=False)),
            row("BF16 mixed precision", replace(cfg, precision="bf16", ckpt="none"))]
    if cfg.n_embd % 16 == 0 and fp8.E4M3 is not None:
        runs_here = fp8.fp8_matmul_error(device) is None  # e.g. False on a pre-sm89 GPU
        rows.append(row("FP8 (native)", replace(cfg, precision="fp8", ckpt="none", fp8_backend="native"),
                        runnable=runs_here))
        rows.append(row("FP8 (Transformer Engine)", replace(cfg, precision="fp8", ckpt="none", fp8_backend="te"),
                        runnable=False))
    cur = replace(cfg, ckpt="none")
    accum = cfg.accum if cfg.accum > 1 else 4
    if cfg.batch_size > 1:
        micro = -(-cfg.batch_size // accum)
        rows.append(row(f"grad accumulation K={accum} (micro-b {micro})", replace(cur, batch_size=micro)))
    rows.append(row("full checkpointing", replace(cur, ckpt="full")))
    rows.append(row("sqrt checkpointing", replace(cur, ckpt="sqrt")))
    if cfg.attn == "manual":
        rows.append(row("selective checkpointing", replace(cur, ckpt="selective")))
    rows += [(name, c, "formula") for name, c in mp.parallel_rows(cur, opts.ranks, opts.tp, opts.pp, opts.cp)]
    return rows


def format_table(rows):
    keys = ("parameters", "gradients", "optimizer", "activations")
    lines = [f"{'technique':34} {'parameters':>12} {'gradients':>12} {'optim+master':>12} {'activations':>12} "
             f"{'total':>12}  how"]
    for name, c, how in rows:
        lines.append(f"{name:34} " + " ".join(f"{fmt_bytes(c[k]):>12}" for k in keys)
                     + f" {fmt_bytes(sum(c[k] for k in keys)):>12}  {how}")
    return "\n".join(lines)


def format_what_if(rows, gpu_gib):
    lines = [f"what-if (bf16 + AdamW, manual attention, CUDA dtypes; largest micro-batch on a {gpu_gib} GiB GPU):",
             f"{'shape':14} {'params':>9} {'ckpt':>9} {'states':>9} {'per-GPU states':>15} "
             f"{'activations b=1':>16} {'max b':>6}"]
    for name, P, ckpt, zero, static, act, b in rows:
        lines.append(f"{name:14} {P / 1e9:8.2f}B {ckpt:>9} {zero:>9} {fmt_bytes(static):>15} "
                     f"{fmt_bytes(act):>16} {b:6d}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the picture

COLORS = dict(parameters="#4e79a7", gradients="#f28e2b", optimizer="#e15759", activations="#59a14f")


def svg(rows, title):
    """Stacked horizontal bars, one per technique, hand-written SVG."""
    keys = ("parameters", "gradients", "optimizer", "activations")
    total = lambda c: sum(c[k] for k in keys)
    top = max(total(c) for _, c, _ in rows) or 1
    W, left, bar, gap, head = 900, 260, 18, 8, 50
    H = head + len(rows) * (bar + gap) + 40
    scale = (W - left - 120) / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{_esc(title)}</text>']
    x = 10
    for k in keys:
        out.append(f'<rect x="{x}" y="30" width="12" height="12" fill="{COLORS[k]}"/>'
                   f'<text x="{x + 16}" y="40">{k}</text>')
        x += 120
    for i, (name, c, how) in enumerate(rows):
        y = head + i * (bar + gap)
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_esc(name)}'
                   f'{"" if how == "measured" else " *"}</text>')
        x = left
        for k in keys:
            w = c[k] * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{COLORS[k]}">'
                       f'<title>{k}: {fmt_bytes(c[k])}</title></rect>')
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 13}">{fmt_bytes(total(c))}</text>')
    out.append(f'<text x="10" y="{H - 12}">* computed from formulas (not run here); the rest measured. '
               f'Bytes per GPU.</text></svg>')
    return "\n".join(out) + "\n"


def _esc(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------- main

def main(argv):
    """Bad input of any kind (flags, config, an fp8 setting the FP8 row would trip on, an
    unwritable out_dir) is one line 'error: ...' on stderr and exit status 2; all measuring
    happens before anything is printed, so such an error leaves stdout empty."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + usage("tools/ledger.py", LedgerOptions))
        return 0
    try:
        cfg, opts = parse_args(argv, LedgerOptions)
        fp8_settings = precision.recipe(cfg).fp8
        if fp8_settings is not None and fp8_settings.backend == "te":
            raise UsageError("the ledger measures fp8_backend=native only (Transformer Engine's cached FP8 "
                             "weights are a formula row of its table); use --fp8_backend=native")
        device = train.pick_device(cfg)
        cfg = replace(cfg, device=device.type)
        meas = run_config(cfg, device)
        table = technique_rows(cfg, device, opts, measure_runs=opts.table == "measure")
        path = Path(cfg.out_dir) / "memory_ledger.svg"
        picture = svg(table, f"memory per GPU by technique: L={cfg.n_layer} h={cfg.n_embd} "
                             f"s={cfg.block_size} b={cfg.batch_size}")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda fh: fh.write(picture.encode()))
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the SVG under --out_dir: {e}", file=sys.stderr)
        return 2
    rows, ok = compare(cfg, meas)
    print(format_comparison(cfg, rows, meas))
    print()
    print("activations, term by term (bytes after forward):")
    for name, v in ml.activation_terms(cfg):
        print(f"  {name:48} {v:14,d}")
    print()
    print(f"four components x techniques (per GPU, this config, precision {precision.recipe(cfg).name} "
          f"unless named):")
    print(format_table(table))
    print()
    print(format_what_if(mp.what_if(opts.gpu_gib, opts.ranks), opts.gpu_gib))
    for name in mp.BIG_SHAPES:
        big = mp.big_config(name)
        n, m = ml.param_count(big)[0], mp.meta_param_count(big)
        print(f"  {name}: formula {n:,} parameters, model.GPT on the meta device {m:,}: "
              f"{'same' if n == m else 'DIFFERENT'}")
        ok = ok and n == m
    print(f"\nwrote {path}")
    if not ok:
        print("ledger: some component missed its tolerance", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
