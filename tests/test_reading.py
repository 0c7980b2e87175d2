"""tools/reading.py's counter, on a small project made here and run under its tracer: a line that runs is counted
once however often it runs, a line that does not run is not counted, and neither are the lines that run by merely
importing a file (imports, def and class headers with their decorators, docstrings)."""
import json
import subprocess
import sys
import textwrap

from conftest import ROOT

MAIN = '''\
"""The program: its docstring is no line to count."""
import functools

from pkg import helper


@functools.cache
def twice(x,
          y=2):
    """A docstring, and a signature on two lines."""
    total = 0
    for _ in range(3):
        total += x * y
    return total


def never():
    return "not run"


class Box:
    """A class: its body's assignment runs at import."""
    size = 4

    def unused(self):
        return self.size


if __name__ == "__main__":
    helper.run(twice(5))
'''
HELPER = '''\
"""A module of a folder: imported, one function run."""
import os


def run(value):
    if value > 100:
        return "big"
    return "small"
'''


def test_a_line_that_runs_is_counted_once_and_one_that_does_not_is_not(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "main.py").write_text(MAIN)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "helper.py").write_text(HELPER)
    into = tmp_path / "trace.json"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tools import reading
        sys.exit(reading.trace("main.py", [], {str(into)!r}, root={str(tmp_path)!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(ROOT))
    from tools import reading
    counted = reading.counted({p: set(v) for p, v in json.loads(into.read_text()).items()}, root=tmp_path)
    lines = {file: sorted(v) for file, v in counted.items()}
    # main.py: the body of twice (4 lines, the loop's 2 once each however often they ran), Box's size, the
    # __main__ test and its call; not never's nor unused's bodies, not the imports, headers or docstrings
    assert lines.get("main.py") == [11, 12, 13, 14, 23, 29, 30], f"main.py counted {lines.get('main.py')}"
    # helper.py: run's test and the return taken, not the one skipped
    assert lines.get("pkg/helper.py") == [6, 8], f"pkg/helper.py counted {lines.get('pkg/helper.py')}"
    assert set(lines) == {"main.py", "pkg/helper.py"}, f"files counted: {sorted(lines)} (an empty __init__ has none)"
