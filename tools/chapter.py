"""`make chapter`: every claim of the chapter, run on this machine, as a report with pictures.

    python tools/chapter.py [--quick] [--steps=300] [--device=auto] [--out_dir=out]
                                                    (make chapter; ARGS=--quick for a short run)

A tool, not a chapter file: it composes the project's files (through tools/chapter_runs.py
and tools/chapter_runs_memory.py) and re-implements none of their mechanisms. It prints one
verdict per claim and writes out_dir/chapter/report.md with its SVG figures. A claim that
"differs" says why (e.g. on CPU the time ratio is not the FLOP ratio). Tiny shapes: a few
minutes on a 2-core CPU; on a GPU it runs there.
"""
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import train  # noqa: E402
from guards import cli  # noqa: E402
from config import UsageError, key  # noqa: E402
from guards.cli import given  # noqa: E402
from guards.clean_end import check_writable, write_atomically  # noqa: E402
from tools import chapter_runs as section1  # noqa: E402
from tools import chapter_runs_memory as sections234  # noqa: E402
from tools import ledger  # noqa: E402

TIMED_SHAPE = dict(n_embd=128, n_head=4, block_size=128)  # what the timed claims run at (--quick: smaller)
SECTIONS = {"1": "Mixed-precision training", "2": "Gradient accumulation", "3": "Activation checkpointing",
            "4": "The whole picture of memory optimisation"}


@dataclass
class ChapterOptions:
    quick: bool = key(False, "a short run (fewer steps and timings): what the test suite runs")
    steps: int = key(300, "optimizer steps of each loss curve", at_least=10)


def run_claims(device, out, opts, say):
    """Every claim in the chapter's order; `say` gets each verdict line as soon as it is known."""
    steps = 30 if opts.quick else opts.steps
    timed = 3 if opts.quick else 9
    # the shape the timed claims run at: --quick's only has to run (its time ratios are noise)
    timed_shape = dict(n_embd=64, n_head=2, block_size=64) if opts.quick else TIMED_SHAPE
    claims, extras = [], {}

    def add(claim):
        claims.append(claim)
        say(verdict_line(claim))

    add(section1.half_the_memory(device))
    add(section1.twice_the_speed(device, timed, timed_shape))
    add(section1.fp16_overflows(device))
    add(section1.fp16_underflows())
    claim, extras["curves"] = section1.loss_curves(device, steps, out)
    add(claim)
    add(section1.master_weights_matter(device, steps))
    add(section1.fp8_scaling_risk(device))
    add(sections234.effective_batch(out))
    add(sections234.loss_over_k(device))
    add(sections234.count_allreduces(out))
    add(sections234.saved_bytes_vs_depth(out))
    add(sections234.recompute_cost(device, timed, timed_shape))
    add(sections234.loss_in_pieces(device, timed, timed_shape))
    add(sections234.states_split(device))
    add(sections234.communication_volume(device))
    claim, extras["table"] = sections234.components_table(device)
    add(claim)
    return claims, extras


def verdict_line(claim):
    verdict = "holds" if claim.holds else f"differs: {claim.why or 'see the report'}"
    return f"[section {claim.section}] {claim.quote}: {verdict}"


def report(claims, extras, device, seconds):
    lines = ["# The chapter, measured on this machine", "",
             f"`make chapter` on {section1.machine(device)}, {seconds:.0f} s. Each row: what the chapter says, what this "
             f"machine measured, what was expected, and whether it holds (a claim that differs says why).", ""]
    for number, title in SECTIONS.items():
        lines += [f"## {number}. {title}", "", "| the chapter says | measured here | expected | verdict |",
                  "|---|---|---|---|"]
        for c in (c for c in claims if c.section == number):
            verdict = "holds" if c.holds else f"differs: {c.why or 'unexpected'}"
            lines.append(f"| {c.quote} | {c.measured} | {c.expected} | {verdict} |")
        lines.append("")
        lines += [f"![{name}]({name})" for c in claims if c.section == number for name in c.figure.split()]
        lines.append("")
    lines += ["## The four components x techniques, per GPU", "",
              "```", ledger.format_table(extras["table"]), "```", "",
              "\"measured\": run on this machine by ledger/measure.py; \"formula\": memory_ledger.py and "
              "ledger/parallel.py for techniques this project does not run.", "",
              "## Beside the chapter: torch.compile", "", extras["compile"], ""]
    return "\n".join(lines)


def program(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + cli.usage("tools/chapter.py", ChapterOptions))
        return 0
    cfg, opts = cli.parse_args(argv, ChapterOptions)
    ignored = given(argv) - {"device", "out_dir", "quick", "steps"}
    if ignored:
        raise UsageError(f"--{', --'.join(sorted(ignored))}: the chapter's experiments choose their own shapes; "
                         f"only --device, --out_dir, --quick and --steps apply")
    device = train.pick_device(cfg)
    out = Path(cfg.out_dir) / "chapter"
    check_writable(out, "--out_dir")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    claims, extras = run_claims(device, out, opts, say=lambda line: print(line, flush=True))
    # beside the chapter: not under --quick (the test suite's run), where compiling would cost more than the rest
    extras["compile"] = "torch.compile: not measured under --quick (its first step compiles for tens of seconds)" \
        if opts.quick else section1.what_compile_buys(device, 9, TIMED_SHAPE)
    print(extras["compile"], flush=True)
    text = report(claims, extras, device, time.perf_counter() - started)
    write_atomically(out / "report.md", lambda fh: fh.write(text.encode()))
    print(f"wrote {out / 'report.md'}: {sum(c.holds for c in claims)} of {len(claims)} claims hold here")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(cli.run(sections234.worker_program, sys.argv[2:]))
    sys.exit(cli.run(program, sys.argv[1:]))
