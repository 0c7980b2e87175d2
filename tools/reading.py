"""`make reading`: the lines a learner reads to follow each mechanism end to end, counted from the code.

    python tools/reading.py            the table (markdown), in the README's reading order, and the calls
                                       it could not resolve
    python tools/reading.py --check    also the budgets: exit 1 where a path is over its budget and not saying why
    python tools/reading.py --readme   write both tables into README.md, between their markers

A tool, not a chapter file. Read `PATHS` first: per mechanism, the file, the definitions of its plain path
in the order a reader takes them, its refinements (read after it), its budget and, where the plain path is
over it, why. What a path counts, each (file, line) once (tools/reach.py follows the calls):
  plain path    its file's docstring, its definitions, and every definition of the project they reach, in
                any file (backends/, ledger/, guards/ too): called, passed as a value (`partial(f, ...)`,
                `self.run = f`), or called through an object whose class the code shows; transitively. A
                definition is all its physical lines; a class reached is its head (its line, docstring and
                attributes) and the methods reached, a class listed is all of it. A file entered for a
                definition adds that definition, not the file's docstring.
  read in another path  a definition another path lists (plain or refinement): read there, counted in
                this column and not followed from here.
  refinements   what the path lists as its refinements: not followed by its plain path; counted after it,
                with what they reach that the plain path does not.
Not followed: torch, the stdlib, builtins; an exception class raised; a use whose value the code does not
show (a loop variable over torch's container, a function passed in): `make reading` prints those.
tests/test_structure.py holds the budgets and the README's table to this output; tests/test_reading.py the counter.
"""
import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the project's files sit one folder up

from tools import reach  # noqa: E402

ORDER = ["config", "model", "precision", "fp8", "accumulate", "checkpoint", "memory_ledger", "zero", "fsdp", "train",
         "build", "snapshot", "data", "flops"]  # the files in the order PATHS reads them


@dataclass(frozen=True)
class Reading:
    mechanism: str
    file: str
    plain: tuple  # definitions, "name" or "Class.method", in reading order
    refinements: tuple = ()  # read after it: "name" in file, or "folder/file.py:name"
    budget: int = None  # lines of the plain path, at most
    docstring: bool = True  # the file's docstring is read first (False: a second path in a file already open)
    why: str = None  # over its budget: what the extra lines are for (--check takes it, --readme prints it)


PATHS = [  # in the README's reading order
    Reading("the config: every key and its meaning", "config.py", ("Config", "key")),
    Reading("the model", "model.py", ("GPT", "Block", "CausalSelfAttention", "AttentionCore", "MLP", "default_linear",
                                      "run_blocks_in_order")),
    Reading("the loss in pieces (LOSS_CHUNKS)", "model.py", ("ChunkedLoss", "logits_gradient", "sum_in_fp32"), (), 60,
            docstring=False),
    Reading("mixed precision: master weights + loss scaler", "precision.py",
          ("MasterWeightOptimizer", "squared_sum", "host_value", "LossScaler"),
          ("AdamW", "optimizer_spec", "overflows_explained", "not_written_by", "decide", "Precision"), 150),
    Reading("FP8: E4M3 forward, delayed scaling, BF16 backward", "fp8.py",
          ("Settings", "scale_from_amax", "amax_of", "quantize", "_FP8LinearFunction", "FP8Linear", "layers",
           "fold_amax", "release_weight_copies"), (), 150,
            why="the GEMM its Function calls (scaled_mm, and dequantize in backward): torch._scaled_mm on a GPU; "
                "on CPU an exact stand-in, as torch's own CPU _scaled_mm is about 10,000x slower on AMX CPUs; "
                "and CUDA's rules for its arguments, checked on every device so a CPU run fails where a GPU run "
                "would."),
    Reading("FP8: the weight kept per step, the E5M2 backward", "backends/fp8_refined.py",
            ("WEIGHT_MODES", "weight_copies", "Rerun", "WeightCopy", "_FP8LinearFunction", "FP8Linear")),
    Reading("gradient accumulation + no_sync", "accumulate.py",
          ("StepParts", "accumulation_step", "optimizer_step", "effective_batch"),
          ("token_weights", "fp32_grad_buffers", "add_to_fp32_sums", "all_reduce_mean", "accum_from_total_tokens"),
          70),
    Reading("recompute, the naive Function", "checkpoint.py", ("NaiveRecompute", "naive_recompute"), (), 40,
            docstring=False),
    Reading("recompute, the real one and its policies", "checkpoint.py",
          ("recompute", "_Enough", "Unit", "_never_unpacked", "RerunNode", "Policy", "register", "NoRecompute", "Full",
           "Sqrt", "Selective", "policy", "apply_policy", "_unit_runner", "_checked_units"),
          ("is_recomputing", "_recomputing", "_autocast_state", "_autocast", "rerun_stops_early", "torch_recompute",
           )),
    Reading("the memory ledger's closed forms", "memory_ledger.py",
          ("bytes_per_param_closed", "params_closed", "layer_terms_closed", "layer_activations_closed",
           "head_activations_closed", "full_recompute_layer_closed", "sqrt_units_closed", "zero_bytes_per_rank")),
    Reading("the memory ledger: which term each traced byte is", "memory_ledger.py",
            ("TERMS", "closed_terms", "module_kinds", "term_of", "account", "as_counted", "in_words", "differences",
             "state_differences", "components"), docstring=False),
    Reading("ZeRO-1/2 by hand", "zero.py", ("Shards", "Piece", "flatten", "SliceOptimizer", "ShardedOptimizer",
                                         "norm_over_ranks"), (), 150,
            why="ShardedOptimizer's state_dict and load_state_dict: the slices' state gathered into DDP's "
                "format and cut back out of it, so a snapshot resumes under DDP, ZeRO or FSDP alike."),
    Reading("FSDP2 (ZeRO-3)", "fsdp.py", ("apply_fsdp", "ShardOptimizer"), (), 100),
    Reading("the training loop", "train.py", ("train_loop",),  # Report: the log (and the ledger's line), Guard: the
            ("resume", "lr_at", "estimate_loss", "sample",  # clean ends; both read after it, as its refinements
             "guards/report.py:Report", "guards/clean_end.py:Guard"), 60),
    Reading("building a run: precision, model, policy, optimizer", "build.py",
            ("build", "compile_blocks", "make_optimizer", "wrap_ddp", "pick_device")),
    Reading("snapshots and the random streams", "snapshot.py",
            ("capture", "restore", "save", "read", "rng_state", "set_rng_state")),
    Reading("the data", "data.py", ("Batches", "DrawnOnce")),
    Reading("MFU and HFU: FLOPs counted from the model", "flops.py",
            ("per_token", "model_code", "_counted", "_count", "Counted", "CPU_ATTENTION", "_attention", "utilization",
             "peak_flops", "_cpu_peak")),
]


class Count(NamedTuple):
    plain: set  # {(file, line)} the plain path reads
    elsewhere: set  # {(file, line)} of other paths' definitions it reaches
    refined: set  # {(file, line)} its refinements read past the plain path's
    unresolved: list  # its uses of unknown value that may be the project's, in words
    reached: set  # {(file, name)} of the definitions the plain path reads
    cut: list  # its refinements that the plain path calls: not followed, read after it


def counts(paths=None, root=ROOT):
    """A Count per path, what it reaches resolved by tools/reach.py in the project at root."""
    paths, project = paths or PATHS, reach.Project(root)
    listed = [(names(project, p, p.plain), names(project, p, p.refinements)) for p in paths]
    owner = {t: i for i, (plain, refined) in enumerate(listed) for t in plain | refined}
    out = []
    for i, (p, (plain, refined)) in enumerate(zip(paths, listed)):
        others = {t for t, j in owner.items() if j != i}
        read, stopped, unresolved = project.reach([(t, None) for t in sorted(plain)], others | refined)
        lines = project.docstring(module_of(project, p.file)) if p.docstring else set()
        lines |= union(project.lines(t, whole=t in plain) for t in read)
        elsewhere = union(project.lines(t) for t in stopped & others) - lines
        after, _, _ = project.reach([(t, None) for t in sorted(refined)], others | read)
        refined_lines = union(project.lines(t, whole=t in refined) for t in after) - lines
        out.append(Count(lines, elsewhere, refined_lines, unresolved, {(project.files[m], n) for m, n in read},
                         cut(project, p, stopped)))
    return out


def cut(project, reading, stopped):
    """The refinements that a path's plain path calls (of a class: the methods), in the order listed."""
    out = []
    for entry in reading.refinements:
        file, _, name = entry.rpartition(":")
        module = module_of(project, file or reading.file)
        methods = [n.split(".", 1)[1] for m, n in sorted(stopped) if m == module and n.startswith(f"{name}.")]
        if methods or (module, name) in stopped:
            out.append(f"{name} ({', '.join(methods)})" if methods else name)
    return out


def module_of(project, file):
    return next(m for m, f in project.files.items() if f == file)


def names(project, reading, listed):
    """{(module, name)} of what a path lists; a class listed is all of it, its methods too."""
    out = set()
    for entry in listed:
        file, _, name = entry.rpartition(":")
        module = module_of(project, file or reading.file)
        if name not in project.defs[module]:
            raise KeyError(f"{file or reading.file} has no {name} (tools/reading.py PATHS)")
        out |= {(module, n) for n in project.defs[module] if n == name or n.startswith(f"{name}.")}
    return out


def union(sets):
    return set().union(*sets)


def table(paths=None, root=ROOT, found=None):
    """The reading paths' table, and under it why each path over its budget is."""
    paths = paths or PATHS
    found = found or counts(paths, root)
    rows = ["| mechanism | file | plain path (lines) | budget | read in another path (lines) | "
            "refinements after it (lines) | calls not resolved |", "|---|---|---|---|---|---|---|"]
    for p, c in zip(paths, found):
        rows.append(f"| {p.mechanism} | `{p.file}` | {len(c.plain)} | {p.budget or '-'} | {len(c.elsewhere) or '-'} | "
                    f"{len(c.refined) or '-'} | {len(c.unresolved) or '-'} |")
    plains = union(c.plain for c in found)
    rows.append(f"| all of it, in this order, each line once | | {len(plains)} | | | "
                f"{len(union(c.refined for c in found) - plains)} | |")
    for p, c in zip(paths, found):
        if p.why:
            files = {}
            for file, _ in sorted(c.plain):
                files[file] = files.get(file, 0) + 1
            where = ", ".join(f"{n} of them in `{f}`" for f, n in files.items() if f != p.file)
            rows.append(f"\n*{p.mechanism}*: {len(c.plain)} lines (budget {p.budget}), {where}: {p.why}")
    cuts = "; ".join(f"*{p.mechanism}*, {', '.join(c.cut)}" for p, c in zip(paths, found) if c.cut)
    if cuts:
        rows.append(f"\nWhat plain paths call of their own refinements (read after them, not followed): {cuts}.")
    return "\n".join(rows)


def files_table(root=ROOT):
    """Each root file (the chapter) with its line count and its docstring's first sentence."""
    rows = ["| file | lines | what it is |", "|---|---|---|"]
    total = 0
    for path in sorted(Path(root).glob("*.py"), key=lambda p: ORDER.index(p.stem) if p.stem in ORDER else len(ORDER)):
        lines = len(path.read_text().splitlines())
        total += lines
        first = ast.get_docstring(ast.parse(path.read_text())).split("\n")[0]
        rows.append(f"| `{path.name}` | {lines} | {first} |")
    rows.append(f"| all of them | {total} | |")
    return "\n".join(rows)


def check(paths=None, root=ROOT, found=None):
    """[problems]: a plain path over its budget that does not say why, or a why for one within it."""
    paths = paths or PATHS
    problems = []
    for p, c in zip(paths, found or counts(paths, root)):
        over = p.budget is not None and len(c.plain) > p.budget
        if over and not p.why:
            problems.append(f"{p.mechanism}: {len(c.plain)} lines to read, the budget is {p.budget}, and no why")
        if p.why and not over:
            problems.append(f"{p.mechanism}: {len(c.plain)} lines, within its budget of {p.budget}: drop its why")
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
    try:
        found = counts()
    except KeyError as e:  # a definition PATHS names that the code no longer has
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    tables = {"paths": table(found=found), "files": files_table()}
    print(tables["paths"] + "\n\n" + tables["files"])
    unresolved = [f"{p.mechanism}: {line}" for p, c in zip(PATHS, found) for line in c.unresolved]
    print("\nnot followed, what they are is not in the code (a function passed in, a loop variable):\n  " +
          "\n  ".join(unresolved) if unresolved else "")
    if "--readme" in argv:
        write_readme(tables)
    if "--check" in argv:
        problems = check(found=found)
        for line in problems:
            print(f"MISS: {line}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
