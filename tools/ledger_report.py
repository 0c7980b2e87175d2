"""The ledger's printed tables and its SVG: formatting only, nothing computed here.

A tool, split from tools/ledger.py (which decides what to measure and check) so that each
stays short: this file turns rows into text and a picture.
"""
import traceback
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# buffers and native FP8's weight copies kept during a step (memory_ledger.components): their own lines everywhere
KEYS = ("parameters", "buffers", "gradients", "optimizer", "fp8_kept", "activations")
COLORS = dict(parameters="#4e79a7", buffers="#9c755f", gradients="#f28e2b", optimizer="#e15759",
              fp8_kept="#b07aa1", activations="#59a14f")


def fmt_bytes(n):
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def format_table(rows):
    lines = [f"{'technique':34} {'parameters':>11} {'buffers':>11} {'gradients':>11} {'optim+master':>12} "
             f"{'fp8 kept':>11} {'activations':>11} {'total':>11}  how"]
    for name, c, how in rows:
        lines.append(f"{name:34} {fmt_bytes(c['parameters']):>11} {fmt_bytes(c['buffers']):>11} "
                     f"{fmt_bytes(c['gradients']):>11} {fmt_bytes(c['optimizer']):>12} {fmt_bytes(c['fp8_kept']):>11} "
                     f"{fmt_bytes(c['activations']):>11} {fmt_bytes(sum(c[k] for k in KEYS)):>11}  {how}")
    return "\n".join(lines)


def format_papers(korthikanti, zero):
    """The published figures beside ours; a difference is 'explained' when it equals the
    bytes the row's reason names (computed from our terms, not typed in)."""
    lines = ["published figure vs ours (ledger/papers.py; Korthikanti et al. 2022 per layer in bytes, GPT-3 175B: "
             "s=2048 b=1 h=12288 a=96, BF16, dropout 0.1, CUDA; ours: this model.py's layer traced at that shape, "
             "so a layer edited away from the paper's differs by more than the reasons given):",
             f"{'figure':44} {'formula':26} {'paper':>14} {'ours':>14} {'difference':>11}  why"]
    for name, formula, paper, ours, explained, why in korthikanti:
        mark = "" if ours - paper == explained else "  UNEXPLAINED"
        lines.append(f"{name:44} {formula:26} {paper:14,d} {ours:14,d} {ours - paper:+11,d}  {why}{mark}")
    lines.append("ZeRO (Rajbhandari et al. 2020), Psi = 7.5B parameters, N_d = 64, K = 12, 1 GB = 1e9 bytes:")
    for name, formula, paper, ours in zero:
        if formula.startswith("GB"):  # Table 1 prints its figures rounded to 0.1 GB
            printed = round(paper, 1)
            lines.append(f"{name:44} {formula:26} {printed:14.1f} {ours:14.4f} {ours - printed:+11.4f}  "
                         + ("the same" if ours == printed else "the same formula; Table 1 rounds to 0.1 GB"))
        else:
            lines.append(f"{name:44} {formula:26} {paper:14g} {ours:14g} {ours - paper:+11g}  "
                         + ("the same" if ours == paper else "DIFFERENT"))
    return "\n".join(lines)


def svg(rows, title):
    """Stacked horizontal bars, one per technique, hand-written SVG."""
    total = lambda c: sum(c[k] for k in KEYS)
    top = max((total(c) for _, c, _ in rows), default=0) or 1
    W, left, bar, gap, head = 900, 260, 18, 8, 50
    H = head + len(rows) * (bar + gap) + 40
    scale = (W - left - 120) / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    x = 10
    for k in KEYS:
        out.append(f'<rect x="{x}" y="30" width="12" height="12" fill="{COLORS[k]}"/>'
                   f'<text x="{x + 16}" y="40">{k}</text>')
        x += 120
    for i, (name, c, how) in enumerate(rows):
        y = head + i * (bar + gap)
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{escape(name)}'
                   f'{"" if how == "measured" else " *"}</text>')
        x = left
        for k in KEYS:
            w = c[k] * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{COLORS[k]}">'
                       f'<title>{k}: {fmt_bytes(c[k])}</title></rect>')
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 13}">{fmt_bytes(total(c))}</text>')
    out.append(f'<text x="10" y="{H - 12}">* computed from formulas (not run here at this shape); the rest measured. '
               f'Bytes per GPU.</text></svg>')
    return "\n".join(out) + "\n"


def in_words(e):
    """An exception as one line for the learner, the report going on around it: its type, its message
    on one line, and the innermost place in this project it came from, outside the ledger's own machinery
    (ledger/: the census and the trace around a learner's code), never a traceback."""
    where = ""
    frames = [(Path(f.filename).resolve(), f.lineno) for f in traceback.extract_tb(e.__traceback__)]
    ours = [(path, line) for path, line in frames
            if path.is_relative_to(ROOT) and not {".venv", "site-packages"} & set(path.parts)]
    for path, line in reversed([f for f in ours if f[0].parent.name != "ledger"] or ours):
        where = f" ({path.relative_to(ROOT)}:{line})"
        break
    text = " ".join(str(e).split())
    return f"{type(e).__name__}{': ' + text[:300] if text else ''}{where}"
