"""Faults from outside the command line, tried as a new user meets them: torchrun's environment
malformed, a data folder that loops through its links, a file of the user's where the lock goes,
Ctrl-C from the first instant to the last, a rank or its launcher killed. Each ends in one line
(exit 2 for bad input, 1 for a run that cannot go on, 130 or 143 for a signal), never a traceback,
never a hang, and nothing of the user's written over.

The cheap ones run in-process through train.main; signals and torchrun need real processes, kept
few and bounded by timeouts (the suite's time is a budget)."""
import os
import signal
import subprocess
import sys
import time

import pytest

import train
from conftest import ROOT, kill_ranks, merged, ranks_of
from test_bad_input import TINY, ends_in_one_line, run_main


# ---------------------------------------------------------------- torchrun's environment

@pytest.mark.parametrize("env,words", [
    (dict(WORLD_SIZE="abc"), "WORLD_SIZE='abc' is not a count"),
    (dict(RANK="abc", WORLD_SIZE="2"), "RANK='abc' is not a count"),
    (dict(LOCAL_RANK="abc"), "LOCAL_RANK='abc' is not a count"),
    (dict(LOCAL_WORLD_SIZE="abc"), "LOCAL_WORLD_SIZE='abc' is not a count"),
    (dict(LOCAL_WORLD_SIZE="0"), "LOCAL_WORLD_SIZE=0: a run has at least one process"),
    (dict(WORLD_SIZE="0"), "WORLD_SIZE=0: a run has at least one process"),
    (dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="localhost", MASTER_PORT="29500"), "RANK=2 is not below WORLD_SIZE=2"),
    (dict(LOCAL_RANK="1", LOCAL_WORLD_SIZE="1"), "LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1"),
    (dict(RANK="0", WORLD_SIZE="2"), "RANK is set but MASTER_ADDR, MASTER_PORT are not"),
    (dict(WORLD_SIZE="2"), "WORLD_SIZE is set but RANK is not"),
])
def test_a_malformed_torchrun_environment_is_one_line(env, words, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path / 'out'}"), capsys)
    ends_in_one_line(code, err, 2, words)
    assert err.startswith("error: ") and "torchrun" in err, f"the line does not say who sets these: {err}"
    assert not (tmp_path / "out").exists(), "a refused run made out_dir"


# ---------------------------------------------------------------- data folders that loop

def test_a_data_folder_that_links_back_is_read_once(tmp_path):
    """d/self -> d, d/sub/up -> d and d/sub/again -> d/sub: a walk that follows links would read d's
    file ~40 times (the kernel's limit of links in a path) through d/self alone, and through two links
    back up it would never end. Each folder and each file is read once, whatever reaches it."""
    from data import text_files
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("a" * 1000)
    (d / "sub" / "b.txt").write_text("b" * 1000)
    (d / "self").symlink_to(".")
    (d / "sub" / "up").symlink_to("..")
    (d / "sub" / "again").symlink_to("../sub")
    (d / "also_a.txt").symlink_to("a.txt")  # one file by two names
    found = run_with_alarm(lambda: text_files(d), seconds=30)
    assert [p.name for p in found] == ["a.txt", "b.txt"], f"read {[str(p.relative_to(d)) for p in found]}, " \
                                                          f"not a.txt and sub/b.txt once each"


def run_with_alarm(call, seconds):
    """call(), or a test failure (not a hang) if it takes longer than `seconds`."""
    import signal

    def too_long(signum, frame):
        raise AssertionError(f"still running after {seconds} s: it loops")
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(seconds)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


# ---------------------------------------------------------------- the lock is the folder's own

@pytest.mark.parametrize("kind", ["a file", "a link"])
def test_the_lock_writes_no_file_so_none_of_the_users_is_touched(kind, tmp_path, capsys):
    """The lock is a flock on out_dir itself: no file of its own, so none of the user's can stand in its way,
    be written through (a link) or be taken for a stale one (the lock file an older version kept: .memtrain.lock)."""
    out = tmp_path / "out"
    out.mkdir()
    mine = tmp_path / "notes.txt"
    mine.write_text("my own notes\n")
    if kind == "a file":
        (out / ".memtrain.lock").write_text("my own notes\n")
    else:
        (out / ".memtrain.lock").symlink_to(mine)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out}"), capsys)
    assert code == 0, f"the run was refused:\n{err}"
    assert sorted(p.name for p in out.iterdir()) == [".memtrain.lock", "snapshot.pt"], sorted(out.iterdir())
    assert (out / ".memtrain.lock").read_text() == mine.read_text() == "my own notes\n", "the user's file changed"


def test_a_run_killed_leaves_no_lock_behind(tmp_path):
    """kill -9 of a run holding out_dir: the OS drops its flock with the process, and there is no file of it."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "train.py", *merged(*TINY, f"--out_dir={out}", "--max_iters=100000",
                                                                  "--log_interval=1")],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step     1 |"):
            break
    proc.kill()
    proc.communicate(timeout=60)
    code = train.main(merged(*TINY, f"--out_dir={out}", "--max_iters=2"))
    assert code == 0, "a run after a killed one failed (a stale lock?)"
    assert sorted(p.name for p in out.iterdir()) == ["snapshot.pt"], sorted(out.iterdir())


# ---------------------------------------------------------------- Ctrl-C, from the first instant to the last

def test_ctrl_c_while_torch_loads_is_one_line(tmp_path):
    """torch takes seconds to import, before any code of the program runs: Ctrl-C there was a
    KeyboardInterrupt traceback. The signal goes once torch's library is being mapped in."""
    proc = subprocess.Popen([sys.executable, "train.py", *merged(*TINY, f"--out_dir={tmp_path / 'out'}")], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while "libtorch" not in open(f"/proc/{proc.pid}/maps").read():  # importing torch now
        assert time.monotonic() < deadline and proc.poll() is None, "torch never started loading"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    ends_in_one_line(proc.returncode, err, 130, "stopped by Ctrl-C (SIGINT)")
    assert not (tmp_path / "out").exists(), "a run stopped while starting made out_dir"


TWICE = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
sys.argv = ["train.py", *{argv!r}]
import accumulate
real, calls = accumulate.accumulation_step, []
def step(*a, **kw):
    calls.append(1)
    if len(calls) == 3:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of step 3...
            return real(*a, **kw)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # ...and again while the first unwinds
    return real(*a, **kw)
accumulate.accumulation_step = step
runpy.run_path("train.py", run_name="__main__")
"""

AFTER = """
import os, runpy, signal, sys, time
sys.path.insert(0, {root!r})
sys.argv = ["train.py", *{argv!r}]
import accumulate
from guards import cli
real_step, real_say = accumulate.accumulation_step, cli.say
def step_then_ctrl_c(*a, **kw):
    out = real_step(*a, **kw)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the first step ends...
    return out
def say_then_ctrl_c(line, status):
    code = real_say(line, status)
    os.kill(os.getpid(), signal.SIGINT)  # ...and again once the program said its line, as it ends
    time.sleep(1)
    return code
accumulate.accumulation_step, cli.say = step_then_ctrl_c, say_then_ctrl_c
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("script,words", [
    (TWICE, "stopped by Ctrl-C (SIGINT); Ctrl-C (SIGINT) again: ended at once"),
    (AFTER, "stopped by Ctrl-C (SIGINT) at step 0 of 100000; no snapshot was written"),
])
def test_ctrl_c_twice_is_one_line(script, words, tmp_path):
    """A second Ctrl-C while the first unwinds ends the run at once; one after the program said its line
    (as Python shuts down, torch's libraries unloading) adds nothing. Both were KeyboardInterrupt tracebacks."""
    argv = merged(*TINY, f"--out_dir={tmp_path}", "--max_iters=100000")
    r = subprocess.run([sys.executable, "-c", script.format(root=str(ROOT), argv=argv)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    ends_in_one_line(r.returncode, r.stderr, 130, words)


# ---------------------------------------------------------------- torchrun: a rank, or torchrun itself, killed

def torchrun_started(tmp_path, until_step=3):
    """torchrun with 2 ranks of TINY, in a process group of its own, and {rank: pid} of its ranks: returned
    once rank 0 logged step `until_step`, or (None) once both ranks are loading torch. stdout is drained
    by a thread: a full pipe would stall the ranks."""
    import threading
    args = merged(*TINY, f"--out_dir={tmp_path}", "--max_iters=100000", "--log_interval=1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    ranks, deadline = {}, time.monotonic() + 120
    while until_step is None and not (len(ranks) == 2 and all(loading_torch(pid) for pid in ranks.values())):
        assert time.monotonic() < deadline and proc.poll() is None, f"torchrun's ranks never loaded torch: {ranks}"
        ranks = ranks_of(proc.pid)
        time.sleep(0.01)
    for line in proc.stdout if until_step else ():
        if line.startswith(f"step {until_step:5d} |"):
            break
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    ranks = ranks_of(proc.pid)
    assert sorted(ranks) == [0, 1], f"torchrun's ranks not found (the run ended early?): {ranks}"
    return proc, ranks


def loading_torch(pid):
    try:
        return "libtorch" in open(f"/proc/{pid}/maps").read()
    except OSError:
        return False


def job_processes(pids):
    """[(pid, state, command)] of those of `pids` still running (or zombies, not yet collected)."""
    out = []
    for pid in pids:
        try:
            state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
            out.append((pid, state, open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:60]))
        except OSError:
            pass
    return out


def running(pids):
    """Those of `pids` still running: not ended, nor a zombie its parent has not collected yet."""
    return [pid for pid, state, _ in job_processes(pids) if state not in ("Z", "X")]


def stopped_within(proc, seconds, ranks):
    """stderr once every process of the job has ended (they hold its pipe); kill them all if it takes longer."""
    try:
        return proc.communicate(timeout=seconds)[1]
    except subprocess.TimeoutExpired:
        left = job_processes([proc.pid, *ranks.values()])
        raise AssertionError(f"the job still ran {seconds} s later: it hangs; its processes then: {left}") from None
    finally:
        proc.kill()  # nothing of it may outlive the test
        kill_ranks(ranks.values())


def test_a_rank_killed_is_named_by_the_survivor(tmp_path):
    """kill -9 of rank 1: rank 0's next collective fails in gloo; it ended in a RuntimeError traceback."""
    proc, ranks = torchrun_started(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    err = stopped_within(proc, 60, ranks)
    said = [line for line in err.splitlines() if line.startswith("error: rank 0:")]
    assert len(said) == 1 and f"rank 1 (pid {ranks[1]}) is gone" in said[0], \
        f"rank 0 did not end in one line naming rank 1 (pid {ranks[1]}):\n{err[-3000:]}"
    assert "[rank0]" not in err and str(ROOT / "train.py") not in err, f"rank 0 printed a traceback:\n{err[-3000:]}"


def test_a_rank_notices_its_launcher_is_gone(tmp_path):
    """kill -9 of torchrun while its ranks load torch: orphaned, they went on to wait for torchrun's
    store in init_process_group until killed from outside (later in the run, they trained on). Each
    notices within a second and ends in one line."""
    proc, ranks = torchrun_started(tmp_path, until_step=None)
    os.kill(proc.pid, signal.SIGKILL)
    err = stopped_within(proc, 30, ranks)
    said = sorted(line for line in err.splitlines() if line.startswith("error: rank"))
    assert said == [f"error: rank {r}: its launcher (torchrun, pid {proc.pid}) is gone (killed?): this rank stops; "
                    f"the last snapshot written is kept" for r in (0, 1)], \
        f"not one line per rank saying its launcher is gone:\n{err[-3000:]}"
    assert "Traceback" not in err, f"a traceback:\n{err[-3000:]}"


@pytest.mark.parametrize("load", [False, True])
def test_torchrun_killed_mid_run_ends_every_rank_within_seconds(load, tmp_path):
    """kill -9 of torchrun while its ranks train: every rank ends within 10 s, even the one that waits in a
    collective for the other, and the last snapshot is kept; under load too (a CPU hog on each core, as a
    busy machine has: the ranks' watchers must still get their turn)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() if load else 0)]
    try:
        proc, ranks = torchrun_started(tmp_path)
        os.kill(proc.pid, signal.SIGKILL)
        started = time.monotonic()
        while running(ranks.values()) and time.monotonic() - started < 60:
            time.sleep(0.1)
        alive, took = job_processes(ranks.values()), time.monotonic() - started
        still = running(ranks.values())
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if still:  # what they said, then the verdict: they are killed, and the pipe closes
        kill_ranks(still)
    err = stopped_within(proc, 10, ranks)
    assert not still and took < 10, f"ranks still ran {took:.1f} s after torchrun's kill -9 (load: {load}); " \
                                    f"its processes then (pid, state, command): {alive}:\n{err[-3000:]}"
