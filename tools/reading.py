"""`make reading`: the lines a learner reads to follow each mechanism end to end, counted from the code.

    python tools/reading.py            the table (markdown), in the README's reading order
    python tools/reading.py --check    also the budgets and the chase rule; exit 1 on a miss
    python tools/reading.py --readme   write both tables into README.md, between their markers

A tool, not a chapter file. Read `PATHS` first: per mechanism, the file, the definitions of its
plain path in the order a reader takes them, its refinements (read after, each with one line on
why it exists), and its budget. A path's count is the file's docstring plus those definitions,
every physical line (blank and comment lines inside them too). The chase rule: every project
function or class the plain path calls is counted by it, or by another path, plain or refinement
(a reader who follows the call finds it counted there). Calls through an
object (`parts.recipe.forward_context`) are not resolved: what they reach is the caller's choice.
tests/test_structure.py holds the budgets, the chase rule and the README's table to this output.
"""
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["config", "model", "precision", "fp8", "accumulate", "checkpoint", "memory_ledger", "zero", "fsdp", "train", "build",
         "snapshot", "data", "flops"]  # the files in the order PATHS reads them


@dataclass(frozen=True)
class Reading:
    mechanism: str
    file: str
    plain: tuple  # definitions, "name" or "Class.method", in reading order
    refinements: tuple = ()
    budget: int = None  # lines of the plain path, at most
    docstring: bool = True  # the file's docstring is read first (False: a second path in a file already open)


PATHS = [  # in the README's reading order
    Reading("the config: every key and its meaning", "config.py", ("Config", "key")),
    Reading("the model", "model.py", ("GPT", "Block", "CausalSelfAttention", "AttentionCore", "MLP", "default_linear",
                                      "run_blocks_in_order")),
    Reading("mixed precision: master weights + loss scaler", "precision.py",
          ("MasterWeightOptimizer", "squared_sum", "host_value", "LossScaler"),
          ("AdamW", "optimizer_spec", "overflows_explained", "not_written_by", "decide", "Precision"), 150),
    Reading("FP8: E4M3 forward, delayed scaling, BF16 backward", "fp8.py",
          ("Settings", "scale_from_amax", "amax_of", "quantize", "_FP8LinearFunction", "FP8Linear", "layers",
           "fold_amax", "release_weight_copies"), (), 150),
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
                                         "norm_over_ranks"), (), 150),
    Reading("FSDP2 (ZeRO-3)", "fsdp.py", ("apply_fsdp", "ShardOptimizer"), (), 100),
    Reading("the training loop", "train.py", ("train_loop",), ("resume", "lr_at", "estimate_loss", "sample"), 60),
    Reading("building a run: precision, model, policy, optimizer", "build.py",
            ("build", "compile_blocks", "make_optimizer", "wrap_ddp", "pick_device")),
    Reading("snapshots and the random streams", "snapshot.py",
            ("capture", "restore", "save", "read", "rng_state", "set_rng_state")),
    Reading("the data", "data.py", ("Batches", "DrawnOnce")),
    Reading("MFU and HFU: FLOPs counted from the model", "flops.py",
            ("per_token", "model_code", "_counted", "_count", "Counted", "CPU_ATTENTION", "_attention", "utilization", "peak_flops", "_cpu_peak")),
]


def definitions(path):
    """{"name" or "Class.method": (first line, last line, node)} of a file's top-level definitions and methods."""
    tree = ast.parse((ROOT / path).read_text())
    found = {}
    for node in tree.body:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            names = [t.id for t in node.targets]  # a namedtuple or a constant: counted where listed
        for name in names:
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            found[name] = (first, node.end_lineno, node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = (item.lineno, item.end_lineno, item)
    return found


def docstring_lines(path):
    tree = ast.parse((ROOT / path).read_text())
    doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    return doc.end_lineno - doc.lineno + 1 if doc else 0


def count(reading):
    """Lines of the plain path (the docstring and its definitions) and of its refinements."""
    defs = definitions(reading.file)
    missing = [n for n in reading.plain + reading.refinements if n not in defs]
    if missing:
        raise KeyError(f"{reading.file} has no {', '.join(missing)} (tools/reading.py PATHS)")
    lines = lambda names: sum(defs[n][1] - defs[n][0] + 1 for n in names)  # noqa: E731
    return docstring_lines(reading.file) * reading.docstring + lines(reading.plain), lines(reading.refinements)


def _imports(tree, modules):
    """{local name: module} for `import m [as n]`, and {name: (module, name)} for `from m import name`."""
    as_module, as_name = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    as_module[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in modules and node.level == 0:
            for a in node.names:
                as_name[a.asname or a.name] = (node.module, a.name)
    return as_module, as_name


def calls(reading):
    """[(caller, (file, name))] for each project definition a definition of the plain path calls."""
    modules = {p.stem for p in ROOT.glob("*.py")}
    tree = ast.parse((ROOT / reading.file).read_text())
    as_module, as_name = _imports(tree, modules)
    defs = definitions(reading.file)
    out = []
    for caller in reading.plain:
        node = defs[caller][2]
        cls = caller.split(".")[0] if isinstance(node, ast.ClassDef) else None
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            if isinstance(f, ast.Name) and f.id in defs:
                out.append((caller, (reading.file, f.id)))
            elif isinstance(f, ast.Name) and f.id in as_name:
                module, name = as_name[f.id]
                out.append((caller, (f"{module}.py", name)))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                if f.value.id in as_module:
                    out.append((caller, (f"{as_module[f.value.id]}.py", f.attr)))
                elif f.value.id == "self" and cls and f"{cls}.{f.attr}" in defs:
                    out.append((caller, (reading.file, f"{cls}.{f.attr}")))
    return out


def unchased(reading):
    """The calls of the plain path that reach a definition no path counts: what a reader would chase."""
    counted = {(p.file, n) for p in PATHS for n in p.plain + p.refinements}
    whole = {(f, n.split(".")[0]) for f, n in counted}  # a class counted whole counts its methods
    out = []
    for caller, (file, name) in calls(reading):
        if not (ROOT / file).exists() or name not in definitions(file) or name.endswith(("Error", "Exception")):
            continue  # not a definition of the project (a constant, torch's), or an exception raised
        if (file, name) not in counted and (file, name.split(".")[0]) not in whole:
            out.append(f"{reading.file} {caller} calls {file} {name}, which no reading path counts")
    return sorted(set(out))


def table():
    rows = ["| mechanism | file | plain path (lines) | budget | refinements after it (lines) |",
            "|---|---|---|---|---|"]
    plains, refinements = 0, 0
    for p in PATHS:
        plain, refined = count(p)
        plains, refinements = plains + plain, refinements + refined
        rows.append(f"| {p.mechanism} | `{p.file}` | {plain} | {p.budget if p.budget else '-'} | "
                    f"{refined if p.refinements else '-'} |")
    rows.append(f"| all of it, in this order | | {plains} | | {refinements} |")
    return "\n".join(rows)


def files_table():
    """Each root file (the chapter) with its line count and its docstring's first sentence."""
    rows = ["| file | lines | what it is |", "|---|---|---|"]
    total = 0
    for path in sorted(ROOT.glob("*.py"), key=lambda p: ORDER.index(p.stem) if p.stem in ORDER else len(ORDER)):
        lines = len(path.read_text().splitlines())
        total += lines
        first = ast.get_docstring(ast.parse(path.read_text())).split("\n")[0]
        rows.append(f"| `{path.name}` | {lines} | {first} |")
    rows.append(f"| all of them | {total} | |")
    return "\n".join(rows)


def check():
    """[problems]: a plain path over its budget, or calling what no path counts."""
    problems = []
    for p in PATHS:
        plain, _ = count(p)
        if p.budget and plain > p.budget:
            problems.append(f"{p.mechanism}: {plain} lines to read, the budget is {p.budget}")
        problems += unchased(p)
    return problems


MARKS = {"paths": table, "files": files_table}  # README.md: <!-- reading:NAME --> ... <!-- /reading:NAME -->


def write_readme():
    path = ROOT / "README.md"
    text = path.read_text()
    for name, make in MARKS.items():
        start, end = f"<!-- reading:{name} -->", f"<!-- /reading:{name} -->"
        before, _, rest = text.partition(start)
        _, _, after = rest.partition(end)
        text = f"{before}{start}\n{make()}\n{end}{after}"
    path.write_text(text)


def main(argv):
    try:
        print(table() + "\n\n" + files_table())
    except KeyError as e:  # a definition PATHS names that the code no longer has
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    if "--readme" in argv:
        write_readme()
    if "--check" in argv:
        problems = check()
        for line in problems:
            print(f"MISS: {line}", file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
