"""`make house`: the project's own rules, which CI holds after `make test` (a learner's edit of model.py or a new
recompute policy passes `make test`; these are the house's, not the learner's).

    python tools/house.py       every rule; each failure is one line with the command that fixes it; exit 1 on any

A tool, not a chapter file. Read `RULES` first. The rules: the chapter at the root and the machinery in folders,
imports one way and no circle, chapter files print and parse nothing, every file at most 450 lines and opening
with what to read first, the precision keys read in precision.decide alone, what each run executes within its
budget and the README's tables `make reading`'s own output (tools/reading.py: it runs them, a minute or two).
"""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import reading  # noqa: E402

# the root holds the files a learner reads to learn the chapter, and nothing else
ROOT_FILES = {"config", "data", "model", "precision", "fp8", "accumulate", "checkpoint", "memory_ledger", "snapshot",
              "build", "flops", "zero", "fsdp", "train"}
CHAPTER = sorted(ROOT_FILES - {"config", "train"})
MACHINERY = ("ledger", "backends", "guards")  # what the chapter stands on, each a folder: not read to learn it
FILE_BUDGET = 450  # lines per file: delete before you split
PRECISION_KEYS = {"precision", "loss_scale", "loss_scale_hysteresis", "loss_scale_growth", "loss_scale_backoff",
                  "loss_scale_interval", "fp8_backend", "fp8_recipe", "fp8_amax_history", "fp8_margin", "fp8_grad",
                  "fp8_keep_weight"}
EDIT = "edit the file it names"


def project_files():
    files = {p.stem: p for p in ROOT.glob("*.py")}
    for folder in ("tools", *MACHINERY):
        files.update({f"{folder}.{p.stem}": p for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"})
    return files


def project_imports(path, names):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & set(names)


def the_root_holds_the_chapter():
    extra = {p.stem for p in ROOT.glob("*.py")} ^ ROOT_FILES
    if extra:
        yield f"the root's files are not the chapter's: {sorted(extra)}", "move machinery into a folder"
    for folder in MACHINERY:
        face = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or ""
        unlisted = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name != "__init__.py" and p.name not in face)
        if "Read" not in face or unlisted:
            yield f"{folder}/__init__.py does not say what to read first, or list {unlisted}", EDIT


def imports_run_one_way():
    files = project_files()
    graph = {}
    for name, path in files.items():
        graph[name] = project_imports(path, files)
        for imported in graph[name] if not name.startswith("tools.") else ():  # a tool may import anything
            if imported.startswith("tools.") or imported == "train" or name == "config" or (
                    name.startswith("backends.") and not (imported.startswith("backends.") or imported == "fp8")):
                yield f"{name} imports {imported}: config -> chapter files -> train.py -> tools, backends import " \
                      f"backends and fp8.py", EDIT
    done, pending = set(), {n for n in graph if not n.startswith("tools.")}
    while pending:  # a topological order exists: no circle
        ready = {n for n in pending if graph[n] <= done}
        if not ready:
            yield f"an import circle among {sorted(pending)}", "python ../shared/tools/house.py names it"
            return
        done |= ready
        pending -= ready


def chapter_files_print_and_parse_nothing():
    files = project_files()
    for name in CHAPTER + ["config"] + [n for n in files if n.startswith(MACHINERY)]:
        tree = ast.parse(files[name].read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if "print" in calls or {"argv", "ArgumentParser"} & attrs or mains:
            yield f"{name} prints, parses arguments or has a __main__ block", "move it to train.py or a tool"


def every_file_is_short_and_says_what_to_read_first():
    for name, path in project_files().items():
        lines, doc = len(path.read_text().splitlines()), ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > FILE_BUDGET:
            yield f"{path.relative_to(ROOT)} has {lines} lines, the rule is {FILE_BUDGET}", "delete before you split"
        if not doc or ((name in CHAPTER or name.startswith(MACHINERY))
                       and not ("Read first" in doc or re.search(r"Read\s+\S+\s+first", doc))):
            yield f"{path.relative_to(ROOT)} opens with no docstring saying what to read first", EDIT


def reads_of_precision_keys(path):
    """[(function, key)] where `path` reads an attribute named like a precision key. A loss scaler's own
    `loss_scale` (`scaler.loss_scale`, `self.loss_scale` in LossScaler) is its state, not the key; a run's
    `precision` whose own attribute is read (`parts.precision.name`, the Precision) or a plan row's (`r`, `row`,
    `best`) is not the key either."""
    out = []

    def visit(node, where, cls):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else where
            inner_cls = child.name if isinstance(child, ast.ClassDef) else cls
            if isinstance(child, ast.Attribute) and child.attr in PRECISION_KEYS and isinstance(child.ctx, ast.Load):
                base = ast.unparse(child.value)
                scaler_state = child.attr == "loss_scale" and (base.endswith("scaler") or
                                                               (base == "self" and cls == "LossScaler"))
                decided = child.attr == "precision" and (base.endswith("parts") or base in ("r", "row", "best")
                                                         or (isinstance(node, ast.Attribute) and node.value is child))
                if not scaler_state and not decided:
                    out.append((where, child.attr))
            visit(child, inner, inner_cls)
    visit(ast.parse(path.read_text()), "<module>", None)
    return out


def precision_keys_are_read_in_one_place():
    """PRECISION, LOSS_SCALE and the FP8_* keys: config.py declares them, precision.decide() (and decided_here, for
    PRECISION=auto) turns them into the Precision, and every other file asks the Precision."""
    for name, path in project_files().items():
        reads = [(where, key) for where, key in reads_of_precision_keys(path) if name != "config"
                 and not (name == "precision" and where in ("decide", "decided_here"))]
        if reads:
            yield f"{name} reads precision keys outside precision.decide: {reads}", "ask precision.decide(cfg)"


def what_runs_is_within_its_budget():
    found = reading.measure()
    for problem in reading.check(found):
        yield problem, "shorten what that run executes (tools/reading.py says per file)"
    readme = (ROOT / "README.md").read_text()
    for name, table in (("reading paths", reading.table(found)), ("files", reading.files_table())):
        if table not in readme:
            yield f"README.md's table of {name} is not what `make reading` counts now", \
                "python tools/reading.py --readme (make reading ARGS=--readme)"


RULES = [the_root_holds_the_chapter, imports_run_one_way, chapter_files_print_and_parse_nothing,
         every_file_is_short_and_says_what_to_read_first, precision_keys_are_read_in_one_place,
         what_runs_is_within_its_budget]


def main(argv):
    failures = 0
    for rule in RULES:
        problems = list(rule())
        for problem, fix in problems:
            print(f"FAIL {rule.__name__}: {problem} (fix: {fix})")
        print(f"{'ok' if not problems else 'FAILED'}: {rule.__name__}")
        failures += len(problems)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
