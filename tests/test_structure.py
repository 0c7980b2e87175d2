"""The house rules the code is read by: the chapter at the root and the machinery in folders,
imports run one way, precision is decided once, chapter files print nothing and parse nothing,
every file stays short."""
import ast
import re

import pytest
import torch

import fp8
import precision
from backends import fp8_refined
from config import Config
from conftest import ROOT
from model import default_linear

# the root holds the files a learner reads to learn the chapter, and nothing else
ROOT_FILES = {"config", "data", "model", "precision", "fp8", "accumulate", "checkpoint", "memory_ledger", "snapshot", "build",
              "flops", "zero", "fsdp", "train"}
CHAPTER = sorted(ROOT_FILES - {"config", "train"})
MACHINERY = ("ledger", "backends", "guards")  # what the chapter stands on, each a folder: not read to learn it
ORDER = ["config", *CHAPTER, "train"]  # tools/ come after train and nothing imports them
FILE_BUDGET = 450  # lines per file: the project's own rule (delete before you split)
ROOT_BUDGET = 2660  # lines of the chapter's files at the root, together (2,600 + the loss in pieces, 60 at most)
LOOP_BUDGET = 60  # lines of train.train_loop: the loop reads top to bottom
PRECISION_KEYS = {"precision", "loss_scale", "loss_scale_hysteresis", "loss_scale_growth", "loss_scale_backoff",
                  "loss_scale_interval", "fp8_backend", "fp8_recipe",
                  "fp8_amax_history", "fp8_margin", "fp8_grad", "fp8_keep_weight"}


def project_files():
    files = {p.stem: p for p in ROOT.glob("*.py")}
    for folder in ("tools", *MACHINERY):
        files.update({f"{folder}.{p.stem}": p for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"})
    return files


def test_the_root_holds_the_chapter_and_folders_the_rest():
    assert {p.stem for p in ROOT.glob("*.py")} == ROOT_FILES
    for folder in MACHINERY:
        face = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text()))
        assert face and "Read" in face, f"{folder}/__init__.py says what the folder holds and what to read first"
        listed = {p.name for p in (ROOT / folder).glob("*.py")} - {"__init__.py"}
        unlisted = sorted(name for name in listed if name not in face)
        assert not unlisted, f"{folder}/__init__.py does not list {', '.join(unlisted)}"


def project_imports(path, names):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found & set(names)


def test_imports_run_one_way():
    files = project_files()
    for name, path in files.items():
        for imported in project_imports(path, files):
            if name.startswith("tools."):
                continue  # a tool may import anything but is imported by nothing
            assert not imported.startswith("tools."), f"{name} imports {imported}: nothing imports a tool"
            assert imported != "train", f"{name} imports train.py"
            assert name != "config", f"config.py imports {imported}: config is imported, it imports nothing"
            if name.startswith("backends."):
                assert imported.startswith("backends.") or imported == "fp8", \
                    f"{name} imports {imported}: a backend imports backends and the chapter file it extends (fp8.py)"
    # no circle among the chapter files and their machinery: a topological order exists
    names = [n for n in files if not n.startswith("tools.")]
    graph = {n: project_imports(files[n], files) for n in names}
    done, pending = set(), set(names)
    while pending:
        ready = {n for n in pending if graph[n] <= done}
        assert ready, f"import circle among {sorted(pending)}"
        done |= ready
        pending -= ready


def test_chapter_files_print_nothing_and_parse_nothing():
    files = project_files()
    for name in CHAPTER + ["config"] + [n for n in files if n.startswith(MACHINERY)]:
        tree = ast.parse(files[name].read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "print" not in calls, name
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert "argv" not in attrs and "ArgumentParser" not in attrs, name
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert not mains, f"{name}.py has a __main__ block"


@pytest.mark.parametrize("name", list(project_files()))
def test_every_file_is_short_and_says_what_to_read_first(name):
    path = project_files()[name]
    lines = len(path.read_text().splitlines())
    assert lines <= FILE_BUDGET, f"{name}.py has {lines} lines; the project's rule is {FILE_BUDGET} at most"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc, f"{name} has no module docstring"
    if name in CHAPTER or name.startswith(MACHINERY):
        assert "Read first" in doc or re.search(r"Read\s+\S+\s+first", doc), f"{name} does not say what to read first"


def reads_of_precision_keys(path):
    """[(function, key)] where `path` reads an attribute named like a precision key. A loss
    scaler's own `loss_scale` (the current scale, `scaler.loss_scale` or `self.loss_scale`
    inside LossScaler) is its state, not the config key; a run's `precision` (the Precision in
    a StepParts, `parts.precision`, and in guards/clean_end.Divergence; any `.precision` whose own
    attribute is read) and a plan row's (ledger/plan.Row: `r`, `row`, `best`) are not the key either."""
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
                                                         or (base == "self" and cls == "Divergence")
                                                         or (isinstance(node, ast.Attribute) and node.value is child))
                if not scaler_state and not decided:
                    out.append((where, child.attr))
            visit(child, inner, inner_cls)
    visit(ast.parse(path.read_text()), "<module>", None)
    return out


def test_precision_keys_are_read_in_one_place():
    """PRECISION, LOSS_SCALE and the FP8_* keys: config.py validates them, precision.decide()
    turns them into the Precision, and every other file asks the Precision."""
    for name, path in project_files().items():
        if name == "config":
            continue
        reads = reads_of_precision_keys(path)
        if name == "precision":
            assert reads and {where for where, _ in reads} == {"decide"}, reads
        else:
            assert not reads, (name, reads)


@pytest.mark.parametrize("prec,dtype,master,scaler,linear", [
    ("fp32", torch.float32, False, "none", torch.nn.Linear),
    ("bf16", torch.bfloat16, True, "none", torch.nn.Linear),
    ("fp16", torch.float16, True, "dynamic", torch.nn.Linear),
    ("fp8", torch.bfloat16, True, "none", fp8.FP8Linear),  # fp8.py's own: no refinement is on
])
def test_what_each_precision_decides(prec, dtype, master, scaler, linear):
    decided = precision.decide(Config(precision=prec))
    assert decided.param_dtype == dtype and decided.master_weights == master
    assert decided.loss_scaler().mode == scaler
    assert decided.element_bytes == torch.empty((), dtype=dtype).element_size()
    layer = decided.linear_factory()(32, 16, True)
    assert type(layer) is linear
    assert (decided.fp8 is not None) == (prec == "fp8")
    if prec != "fp8":
        assert decided.linear_factory() is default_linear


@pytest.mark.parametrize("flags,linear", [({}, fp8.FP8Linear), (dict(fp8_keep_weight=True), fp8_refined.FP8Linear),
                                          (dict(fp8_grad="e5m2"), fp8_refined.FP8Linear)])
def test_fp8_builds_fp8pys_layer_unless_a_refinement_is_on(flags, linear):
    """The plain path is the default path: PRECISION=fp8 alone builds the layer fp8.py's reader reads."""
    layer = precision.decide(Config(precision="fp8", **flags)).linear_factory()(32, 16, True)
    built, wanted = (f"{c.__module__}.{c.__name__}" for c in (type(layer), linear))
    assert built == wanted, f"precision=fp8 with {flags or 'no other flag'} built {built}, not {wanted}"


def test_a_precision_is_decided_once_from_the_loss_scale_keys():
    assert precision.decide(Config(precision="bf16", loss_scale="dynamic")).loss_scaler().mode == "dynamic"
    static = precision.decide(Config(precision="fp16", loss_scale="1024")).loss_scaler()
    assert static.mode == "static" and static.loss_scale == 1024.0
    te = precision.decide(Config(precision="fp8", fp8_backend="te", fp8_recipe="current", fp8_amax_history=4))
    assert te.fp8 == fp8.Settings(backend="te", scaling="current", history=4, margin=0, grad="bf16")


def test_the_chapter_at_the_root_stays_short():
    total = sum(len(p.read_text().splitlines()) for p in ROOT.glob("*.py"))
    assert total <= ROOT_BUDGET, f"the root's .py files hold {total} lines; the budget is {ROOT_BUDGET}"
    loop = next(n for n in ast.parse((ROOT / "train.py").read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "train_loop")
    length = loop.end_lineno - loop.lineno + 1
    assert length <= LOOP_BUDGET, f"train.train_loop is {length} lines; the budget is {LOOP_BUDGET}"


def test_each_mechanism_reads_within_its_budget_or_says_why():
    """tools/reading.py follows every call a path makes (tests/test_reading.py holds it to that), so what
    a path reaches is counted by it or by the path that lists it: the budgets are on honest counts."""
    from tools import reading
    problems = reading.check()
    assert not problems, "\n".join(problems)


def test_the_readmes_tables_are_the_counts():
    from tools import reading
    readme = (ROOT / "README.md").read_text()
    for name, table in (("reading paths", reading.table()), ("files", reading.files_table())):
        assert table in readme, f"README.md's table of {name} is not what tools/reading.py counts now " \
                                f"(python3 tools/reading.py --readme writes it):\n{table}"
