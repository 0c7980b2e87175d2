"""tools/reading.py's counter on a small project made here: each way a path reaches code (a call into a
folder, through an object, a function passed as a value, a parameter its caller types) must be counted,
and what it cannot resolve printed."""
import textwrap

import pytest

from tools import reach, reading

FILES = {
    "chapter.py": '''
        """A chapter: its docstring is read first."""
        import functools
        from dataclasses import dataclass

        from pkg import helper
        from pkg.gemm import scaled


        class Scaler:
            """Scales."""
            def __init__(self, k):
                self.k = k

            def unscale(self, x):
                return self.divide(x)

            def divide(self, x):
                return x / self.k


        class Holder:
            def __init__(self):
                self.scaler = Scaler(2)


        class Grower:
            def grow(self):
                return 2


        class Meter:
            def read(self):
                return 3


        class Made:
            def done(self):
                return 4


        @dataclass
        class Parts:
            meter: Meter


        @dataclass
        class Box:
            thing: object


        def passed(x):
            return -x


        def partly(x, n):
            return x * n


        def step(x):
            holder = Holder()
            y = holder.scaler.unscale(x)
            z = helper.work(y) + scaled(y)
            run, make = functools.partial(partly, n=2), functools.partial(Made)
            return sorted([run(z), make().done()], key=passed)


        def use(s):
            return s.grow()


        def grow_one():
            return use(Grower())


        def annotated(parts: Parts):
            return parts.meter.read()


        def boxed(box):
            return box.thing.grow()


        def box_one():
            return boxed(Box(Grower()))


        def blind(things):
            for t in things:
                t.unscale(1.0)
        ''',
    "pkg/__init__.py": '"""A folder."""\n',
    "pkg/helper.py": '''
        def work(y):
            return deeper(y)


        def deeper(y):
            return y
        ''',
    "pkg/gemm.py": '''
        def scaled(y):
            return y * 2


        def unused(y):
            return y
        ''',
}


@pytest.fixture
def project(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip("\n"))
    return tmp_path


def read(root, *paths):
    return reading.counts(list(paths), root=root)


STEP = reading.Reading("the step", "chapter.py", ("step",))

# (file, definition) the step must reach, and how, in words: what was missed if it is not counted
REACHED = [
    (("chapter.py", "Holder.__init__"), "Holder(), a class built, runs its __init__"),
    (("chapter.py", "Scaler.unscale"), "holder.scaler.unscale(x): a call through an attribute built as Scaler(2)"),
    (("chapter.py", "Scaler.divide"), "self.divide(x) inside Scaler.unscale: a method of self's class"),
    (("pkg/helper.py", "work"), "helper.work(y): a call into a folder (from pkg import helper)"),
    (("pkg/helper.py", "deeper"), "deeper(y) inside helper.work: what a reached definition calls"),
    (("pkg/gemm.py", "scaled"), "scaled(y): a name imported from a folder's file (from pkg.gemm import scaled)"),
    (("chapter.py", "passed"), "sorted(..., key=passed): a function passed as a value"),
    (("chapter.py", "partly"), "functools.partial(partly, n=2): a function passed to partial, then called"),
    (("chapter.py", "Made.done"), "make().done(), make = functools.partial(Made): a method of what partial builds"),
]


@pytest.mark.parametrize("target,how", REACHED, ids=[t[1] for t, _ in REACHED])
def test_a_path_counts_what_it_reaches(project, target, how):
    count, = read(project, STEP)
    assert target in count.reached, f"not followed: {how}"
    definition = reach.Project(project).lines((reading.module_of(reach.Project(project), target[0]), target[1]))
    assert definition <= count.plain, f"followed but its lines are not counted: {how}"


def test_a_path_counts_each_line_once_and_nothing_it_does_not_reach(project):
    count, = read(project, STEP)
    assert ("pkg/gemm.py", "unused") not in count.reached, "pkg/gemm.unused is counted, but nothing calls it"
    assert not any(f == "pkg/__init__.py" for f, _ in count.plain), "a folder's docstring is counted for one call"
    source = {f: len(textwrap.dedent(t).lstrip("\n").splitlines()) for f, t in FILES.items()}
    assert len(count.plain) < sum(source.values()), "the whole project is counted"
    assert ("chapter.py", 1) in count.plain, "the path's file's docstring is not counted"


def test_a_parameter_is_typed_by_what_its_callers_pass(project):
    count, = read(project, reading.Reading("the use", "chapter.py", ("use",)))
    assert ("chapter.py", "Grower.grow") in count.reached, \
        "s.grow() in use(s) is not followed, though its only caller passes Grower()"


def test_a_parameter_annotated_and_a_dataclass_field_are_typed(project):
    count, = read(project, reading.Reading("the annotated", "chapter.py", ("annotated",)))
    assert ("chapter.py", "Meter.read") in count.reached, \
        "parts.meter.read() is not followed, though parts is annotated Parts and Parts.meter a Meter field"


def test_a_dataclass_field_is_typed_by_what_its_constructions_pass(project):
    count, = read(project, reading.Reading("the boxed", "chapter.py", ("boxed",)))
    assert ("chapter.py", "Grower.grow") in count.reached, \
        "box.thing.grow() is not followed, though the only Box built holds a Grower()"


def test_what_the_code_does_not_type_is_listed_not_guessed(project):
    blind = reading.Reading("the blind loop", "chapter.py", ("blind",))
    count, = read(project, blind)
    assert ("chapter.py", "Scaler.unscale") not in count.reached, "t.unscale() was guessed to be Scaler's"
    assert any("t.unscale" in line and "Scaler.unscale" in line for line in count.unresolved), \
        f"t.unscale() over a parameter no caller types is not listed as unresolved: {count.unresolved}"


def test_a_definition_another_path_lists_is_read_there(project):
    other = reading.Reading("the helper", "pkg/helper.py", ("work",))
    step, work = read(project, STEP, other)
    assert ("pkg/helper.py", "work") not in step.reached, "helper.work is counted by the step and by its own path"
    assert ("pkg/helper.py", "deeper") not in step.reached, "the step follows into the helper path's definition"
    assert len(step.elsewhere) == 2, f"helper.work's 2 lines are not in the step's other-path column: {step.elsewhere}"
    assert ("pkg/helper.py", "deeper") in work.reached, "the helper path does not count what work calls"


def test_a_refinement_is_counted_after_the_plain_path(project):
    refined = reading.Reading("the step", "chapter.py", ("step",), ("pkg/helper.py:work",))
    count, = read(project, refined)
    assert ("pkg/helper.py", "work") not in count.reached, "the plain path follows into its refinement"
    assert len(count.refined) == 4, f"the refinement and what it calls (2 + 2 lines) are not after it: {count.refined}"
    assert count.cut == ["work"], f"the refinement the plain path calls is not named under the table: {count.cut}"


def test_a_budget_is_met_or_says_why(project):
    over = reading.Reading("the step", "chapter.py", ("step",), budget=5)
    assert reading.check([over], project), "a path over its budget without a why passes the check"
    said = reading.Reading("the step", "chapter.py", ("step",), budget=5, why="it reaches the helper")
    assert not reading.check([said], project), "a path over its budget that says why fails the check"
    assert "it reaches the helper" in reading.table([said], project), "the why is not printed under the table"
    stale = reading.Reading("the step", "chapter.py", ("step",), budget=500, why="it reaches the helper")
    assert reading.check([stale], project), "a why on a path within its budget passes the check"
