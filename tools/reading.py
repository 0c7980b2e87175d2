"""`make reading`: what a learner reads for each mechanism, counted by running it.

    python tools/reading.py            every row's run, traced; the table, and per file what each row adds
    python tools/reading.py --check    also the budgets: exit 1 where a row is over its budget
    python tools/reading.py --readme   write the table and the map of files into README.md, between their markers

A tool, not a chapter file. Read `ROWS` first. Each row runs train.py at a tiny shape (2 layers, 2 heads,
width 64, context 64, micro-batch 4; 20 steps with two evaluations and a snapshot; on the CPU) under a line
tracer (sys.settrace, its threads too, every rank under torchrun), and counts the distinct lines of the
project's own files that executed. Not counted: import lines, def and class headers (their decorators and
signatures too) and docstrings, which run by merely importing a file. What a learner reads for a mechanism
is what its run executes beyond its base run's: the plain run first, then each flag on top of it.
Every run is counted as on an x86 CPU without BF16 or FP16 instructions (ONEDNN_MAX_CPU_ISA=AVX2: the
emulation's warning included), so the count is the same whichever CPU runs it, CI's or a learner's.
"""
import ast
import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=4",
        "--max_iters=20", "--eval_interval=10", "--eval_iters=2"]
FORBIDDEN = ("ledger/", "tools/", "backends/", "zero.py", "fsdp.py", "fp8.py", "memory_ledger.py")


class Row(NamedTuple):
    name: str  # the run, as a learner types it
    flags: tuple  # train.py's flags beside TINY
    base: str = None  # the row whose lines it adds to (None: the plain run itself)
    budget: int = None  # lines it may add (the plain row: lines it may execute)
    ranks: int = 1  # processes under torchrun
    resumes: bool = False  # it resumes from a snapshot of its own flags at step 10


PLAIN = "make train PRECISION=bf16"
ROWS = [
    Row(PLAIN, ("--precision=bf16",), budget=550),
    Row("PRECISION=fp16 (the loss scaler)", ("--precision=fp16",), PLAIN, 120),
    Row("PRECISION=fp32", ("--precision=fp32",), PLAIN, 0),
    Row("PRECISION=fp8", ("--precision=fp8",), PLAIN, 200),
    Row("CKPT=full", ("--precision=bf16", "--ckpt=full"), PLAIN, 120),
    Row("CKPT=full CKPT_IMPL=naive", ("--precision=bf16", "--ckpt=full", "--ckpt_impl=naive"), "CKPT=full", 40),
    Row("ACCUM=4", ("--precision=bf16", "--accum=4"), PLAIN, 40),
    Row("make ddp NPROC=2", ("--precision=bf16",), PLAIN, 80, ranks=2),
    Row("make ddp NPROC=2 SHARD=zero2", ("--precision=bf16", "--shard=zero2"), "make ddp NPROC=2", 150, ranks=2),
    Row("make ddp NPROC=2 SHARD=fsdp", ("--precision=bf16", "--shard=fsdp"), "make ddp NPROC=2", 100, ranks=2),
    Row("LOSS_CHUNKS=4", ("--precision=bf16", "--loss_chunks=4"), PLAIN, 60),
    Row("RESUME=1 (a resume from a snapshot)", ("--precision=bf16",), PLAIN, 100, resumes=True),
]
PLAIN_FILES = 12  # the plain run executes lines of at most this many files


# ---------------------------------------------------------------- the counter

def not_counted(source):
    """Line numbers that run by merely importing a file: imports, def and class headers, docstrings."""
    skip = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            skip.update(range(first, node.body[0].lineno))  # decorators, the header, a long signature
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                skip.update(range(doc.lineno, doc.end_lineno + 1))
    return skip


def counted(hits, root=ROOT):
    """{file relative to root: the counted lines} of {absolute path: lines that ran}."""
    out = {}
    for path, lines in hits.items():
        source = Path(path).read_text()
        kept = {n for n in lines if n > 0} - not_counted(source)  # line 0: a module's own start, no line of it
        if kept:
            out[str(Path(path).relative_to(root))] = kept
    return out


def trace(script, argv, into, root=ROOT):
    """Run `script` as __main__ under the tracer; write {path: [lines]} of root's own files to `into`."""
    root, hits = str(root), {}

    def local(frame, event, arg):
        if event == "line":
            hits[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def tracer(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(root + os.sep) or os.sep + ".venv" + os.sep in path:
            return None  # torch, the stdlib, the venv: not the project's
        hits.setdefault(path, set())
        return local(frame, event, arg)

    sys.argv, sys.path[0] = [script, *argv], root
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        import runpy
        runpy.run_path(str(Path(root) / script), run_name="__main__")
    except SystemExit as e:
        status = e.code
    else:
        status = 0
    finally:
        sys.settrace(None)
        threading.settrace(None)
        Path(into).write_text(json.dumps({p: sorted(lines) for p, lines in hits.items()}))
    return status


# ---------------------------------------------------------------- the rows

def run_row(row, folder):
    """The row's counted lines: {file: lines}, every rank's together."""
    out_dir, traces = Path(folder) / "out", Path(folder) / "traces"
    traces.mkdir(parents=True)
    out_dir.mkdir()  # there already, as on a learner's second run: rank 1 never races rank 0 making it
    flags = [*TINY, *row.flags, f"--out_dir={out_dir}"]
    python, env = [sys.executable], {**os.environ, "PYTHONHASHSEED": "0", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    if row.ranks > 1:
        python += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.ranks}"]
    if row.resumes:  # the snapshot at step 10 of the same run, written untraced
        ten = [f for f in flags if not f.startswith("--max_iters=")] + ["--max_iters=10", "--lr_decay_iters=20"]
        first = subprocess.run([sys.executable, "train.py", *ten], cwd=ROOT, capture_output=True, text=True, env=env)
        if first.returncode:
            raise RuntimeError(f"{row.name}: the run to resume from failed: {first.stderr.strip()[-400:]}")
        flags += ["--resume", "--lr_decay_iters=20"]
    done = subprocess.run([*python, "tools/reading.py", f"--trace={traces}", "--", "train.py", *flags],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{row.name}: exit status {done.returncode}: {done.stderr.strip()[-600:]}")
    lines = {}
    for path in traces.glob("*.json"):
        for file, kept in counted({p: set(v) for p, v in json.loads(path.read_text()).items()}).items():
            lines.setdefault(file, set()).update(kept)
    return lines


def measure(rows=ROWS):
    """{row name: {file: lines}} of every row's run, two at a time (each is a process of its own)."""
    def one(row):
        with tempfile.TemporaryDirectory() as folder:
            return run_row(row, folder)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([row.name for row in rows], pool.map(one, rows)))


def added(found, row):
    """{file: lines} the row executes beyond its base's (all of it for the plain row)."""
    base = found[row.base] if row.base else {}
    out = {file: lines - base.get(file, set()) for file, lines in found[row.name].items()}
    return {file: lines for file, lines in out.items() if lines}


def table(found, rows=ROWS):
    lines = ["| run | over | lines executed (added) | budget | in these files |", "|---|---|---|---|---|"]
    for row in rows:
        more = added(found, row)
        files = ", ".join(f"`{f}` {len(v)}" for f, v in sorted(more.items(), key=lambda kv: (-len(kv[1]), kv[0])))
        total = sum(map(len, more.values()))
        what = f"{total} in {len(more)} files" if not row.base else f"+{total}"
        lines.append(f"| `{row.name}` | {f'`{row.base}`' if row.base else '-'} | {what} | "
                     f"{row.budget if row.budget is not None else '-'} | {files or '-'} |")
    return "\n".join(lines)


def files_table(root=ROOT):
    """Each root file (the chapter) with its line count and its docstring's first sentence."""
    rows, total = ["| file | lines | what it is |", "|---|---|---|"], 0
    for path in sorted(Path(root).glob("*.py")):
        lines = len(path.read_text().splitlines())
        total += lines
        first = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]
        rows.append(f"| `{path.name}` | {lines} | {first} |")
    rows.append(f"| all of them | {total} | |")
    return "\n".join(rows)


def check(found, rows=ROWS):
    """[problems]: a row over its budget, the plain run in more files than PLAIN_FILES or in FORBIDDEN ones."""
    problems = []
    for row in rows:
        total = sum(map(len, added(found, row).values()))
        if row.budget is not None and total > row.budget:
            problems.append(f"{row.name}: {total} lines, the budget is {row.budget}")
    plain = found[ROWS[0].name]
    if len(plain) > PLAIN_FILES:
        problems.append(f"{ROWS[0].name}: lines of {len(plain)} files run, at most {PLAIN_FILES}")
    for file in sorted(plain):
        if file.startswith(FORBIDDEN):
            problems.append(f"{ROWS[0].name}: {file} runs {len(plain[file])} lines; nothing of it should")
    return problems


def write_readme(tables, root=ROOT):
    """tables: {NAME: text}, each written into README.md between <!-- reading:NAME --> and <!-- /reading:NAME -->."""
    path = Path(root) / "README.md"
    text = path.read_text()
    for name, made in tables.items():
        start, end = f"<!-- reading:{name} -->", f"<!-- /reading:{name} -->"
        before, _, rest = text.partition(start)
        _, _, after = rest.partition(end)
        text = f"{before}{start}\n{made}\n{end}{after}"
    path.write_text(text)


def main(argv):
    if argv and argv[0].startswith("--trace="):  # one traced process (a rank under torchrun)
        folder = argv[0].split("=", 1)[1]
        script, *rest = argv[argv.index("--") + 1:]
        return trace(script, rest, Path(folder) / f"rank{os.environ.get('RANK', '0')}.json")
    found = measure()
    tables = {"paths": table(found), "files": files_table()}
    print(tables["paths"] + "\n\n" + tables["files"])
    if "--readme" in argv:
        write_readme(tables)
    if "--check" in argv:
        problems = check(found)
        for line in problems:
            print(f"OVER: {line}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
