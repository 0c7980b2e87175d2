"""Runs that end cleanly: a diverging run stops in one line and keeps the last good snapshot,
FP16's normal overflows do not stop it, Ctrl-C and SIGTERM are one line, one run per out_dir,
odd files (a pipe, a full disk, a truncated data file) end in one line and never hang.

Where a process or a signal is needed the program runs as a real process; the rest run
in-process through train.main, as tests/test_bad_input.py's table does."""
import errno
import io
import math
import os
import re
import runpy
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
from guards import clean_end as guard
import precision
import snapshot
from guards import clean_end as files
import train
from guards.cli import given, parse_args
from conftest import ROOT, merged
from test_bad_input import TINY, ends_in_one_line, good_run, listing, out_dir, run_main  # noqa: F401 (fixtures)

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def train_py(*args, timeout=300):
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def started(*args):
    """train.py as a process, returned once it has logged its third step."""
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step     3 |"):
            return proc
    proc.kill()
    raise AssertionError(f"the run ended before its third step:\n{proc.stderr.read()}")


# ---------------------------------------------------------------- divergence

@pytest.mark.parametrize("flags,cause", [
    (["--learning_rate=1e30"], "lower --learning_rate (its peak is 1e+30)"),
    (["--weight_decay=1e30"], "or --weight_decay (1e+30: lr x weight_decay >= 1"),
    (["--learning_rate=1e4", "--precision=fp32"], "lower --learning_rate (its peak is 10000)"),
    # FP16 weights that grew large but finite: the forward overflows, every step is skipped, and
    # the dynamic scaler would take 17 skips to run out of explanations; the loss stops it first
    (["--learning_rate=300", "--precision=fp16", "--warmup_iters=0"], "lower --learning_rate (its peak is 300)"),
])
def test_a_diverging_run_stops_within_a_log_interval_and_keeps_the_snapshot(flags, cause, out_dir, capsys):
    before = listing(out_dir)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out_dir}", "--max_iters=40", "--log_interval=5",
                                            *flags), capsys)
    ends_in_one_line(code, err, 1, cause)
    assert "stopping without writing a snapshot" in err and "this run wrote no snapshot" in err, \
        f"the line does not say that no snapshot was written:\n{err}"
    said = re.match(r"error: step (\d+): the run diverged: the loss is not finite \(step (\d+), loss nan\)", err)
    assert said, f"the line does not say the loss went non-finite, and when:\n{err}"
    stopped, first = map(int, said.groups())
    # caught at the first check after it: checks come once per log interval
    assert stopped == 5 * math.ceil(first / 5), f"the first non-finite loss was at step {first}, the stop at {stopped}"
    assert listing(out_dir) == before, "the good snapshot was overwritten"


def test_a_loss_scale_that_overflows_every_step_stops_naming_the_loss_scale(tmp_path, capsys):
    # 1e38: every FP16 gradient overflows; a scale that never falls explains 127 skips (log2 1e38)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path}", "--precision=fp16", "--max_iters=300",
                                            "--loss_scale=1e38", "--log_interval=10"), capsys)
    ends_in_one_line(code, err, 1, "lower --loss_scale=1e+38 (or use --loss_scale=dynamic)")
    assert "step 130: the run diverged: 128 steps in a row (to step 128) were skipped" in err, \
        f"not stopped at the first check after 128 skips in a row:\n{err}"
    assert not (tmp_path / snapshot.FILE).exists(), "a run that trained nothing wrote a snapshot"


def test_resuming_with_a_runaway_learning_rate_keeps_the_good_snapshot(out_dir, capsys):
    """The first update at lr 1e30 leaves finite weights and a finite loss: only the next forward
    shows they ran away. The snapshot due after that update is not written (the probe)."""
    before = listing(out_dir)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out_dir}", "--resume", "--max_iters=8",
                                            "--lr_decay_iters=2", "--learning_rate=1e30", "--snapshot_interval=1"),
                         capsys)
    ends_in_one_line(code, err, 1, "the last snapshot is")
    assert "(step 2, resumed from, untouched)" in err, f"the line does not name the resumed snapshot:\n{err}"
    assert listing(out_dir) == before, "the good snapshot was replaced by one whose weights ran away"


def test_the_rule_allows_what_the_dynamic_scaler_explains():
    """A real dynamic scaler falling from 2^16: 16 halvings (+ hysteresis-1 tolerated overflows)
    reach scale 1; a run of skips one longer overflowed at scale 1 and stops the run."""
    for hysteresis in (1, 3):
        prec = precision.decide(parse_args(["--precision=fp16", f"--loss_scale_hysteresis={hysteresis}"]))
        scaler, watch = prec.loss_scaler(), guard.Divergence(prec)
        explained = 16 + hysteresis - 1
        for step in range(1, explained + 1):
            scale = scaler.loss_scale
            scaler.update(found_inf=True)
            watch.after_step(step, 5.0, False, scale)
        assert watch.too_many is None, f"hysteresis {hysteresis}: stopped after {explained} skips the scaler explains"
        assert scaler.loss_scale == 1.0, f"the scale is {scaler.loss_scale} after {explained} skips, not 1"
        watch.after_step(explained + 1, 5.0, False, scaler.loss_scale)
        assert watch.too_many == (explained + 1, explained + 1, 2.0 ** 16), \
            f"hysteresis {hysteresis}: a skip at scale 1 did not stop it (too_many={watch.too_many})"
        # a step that steps ends the run of skips: a new run counts from its own scale
        fresh = guard.Divergence(prec)
        for step, stepped in enumerate([False] * explained + [True] + [False] * explained, 1):
            fresh.after_step(step, 5.0, stepped, 2.0 ** 16)
        assert fresh.too_many is None, "two runs of skips, each explained, were added up"


def test_normal_fp16_overflows_never_stop_a_run(tmp_path, capsys):
    # micro-batch 1 x 8 tokens: a few early overflows at 2^16, each backed off
    history = train.train(parse_args(merged(*TINY, f"--out_dir={tmp_path / 'a'}", "--batch_size=1", "--block_size=8",
                                            "--precision=fp16", "--max_iters=12", "--warmup_iters=0",
                                            "--log_interval=1")), log=lambda line: None)
    assert len(history) == 12 and not all(h["stepped"] for h in history), "no overflow: the test shows nothing"
    # a scale far too high (2^40, as a snapshot may carry it): ~24 skips in a row while it falls, more
    # than a rule counting from 2^16 would allow, all explained by the fall
    assert train.main(merged(*TINY, f"--out_dir={tmp_path / 'b'}", "--precision=fp16")) == 0
    state = torch.load(tmp_path / "b" / snapshot.FILE, weights_only=True)
    state["scaler"]["loss_scale"] = 2.0 ** 40
    torch.save(state, tmp_path / "b" / snapshot.FILE)
    history = train.train(parse_args(merged(*TINY, f"--out_dir={tmp_path / 'b'}", "--precision=fp16", "--resume",
                                            "--max_iters=40", "--lr_decay_iters=2", "--log_interval=1")),
                          log=lambda line: None)
    run = next(i for i, h in enumerate(history) if h["stepped"])
    assert run > 16 and all(h["stepped"] for h in history[run:run + 5]), \
        f"expected more than 16 skips in a row, then steps; stepped: {[h['stepped'] for h in history]}"
    assert capsys.readouterr().err == "", "the runs printed an error"


# ---------------------------------------------------------------- --loss_scale and AdamW's flags on a resume

def test_flags_given_on_a_resume_apply(out_dir, capsys):
    """--loss_scale (and the AdamW flags) given on a resume are applied, and the log says so for the
    scaler; the same flags as before restore the saved scaler (test_train's bit-identical resume)."""
    lines, argv = [], merged(*TINY, f"--out_dir={out_dir}", "--resume", "--max_iters=4", "--lr_decay_iters=2",
                             "--loss_scale=1024", "--weight_decay=0.5")
    # the keys named as train.main names them: PRECISION=auto, decided here, is not a flag given
    history = train.train(parse_args(argv), log=lines.append, given=given(argv))
    scales = [h["loss_scale"] for h in history]
    assert scales == [1024.0, 1024.0], f"the resumed run's loss scales are {scales}, not --loss_scale=1024"
    said = [line for line in lines if line.startswith("resumed at step 2: the flags given change ")]
    assert len(said) == 1 and "loss_scale auto -> 1024" in said[0] and "weight_decay 0.1 -> 0.5" in said[0] and \
        "its loss scaler starts fresh" in said[0], f"the log does not say what the flags changed:\n" + "\n".join(lines)
    saved = torch.load(out_dir / snapshot.FILE, weights_only=True)
    assert saved["scaler"]["loss_scale"] == 1024.0, f"the new snapshot's loss scale is {saved['scaler']['loss_scale']}"
    decay = saved["optimizer"]["adamw"]["param_groups"][0]["weight_decay"]
    assert decay == 0.5, f"AdamW's weight decay is {decay} after a resume with --weight_decay=0.5"


# ---------------------------------------------------------------- Ctrl-C and SIGTERM

@pytest.mark.parametrize("sig,status,name", [(signal.SIGINT, 130, "Ctrl-C (SIGINT)"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_mid_run_is_one_line_and_keeps_the_last_snapshot(sig, status, name, tmp_path):
    proc = started(*merged(*TINY, f"--out_dir={tmp_path}", "--max_iters=100000", "--log_interval=1",
                           "--snapshot_interval=2"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    ends_in_one_line(proc.returncode, err, status, f"stopped by {name} at step ")
    reached, saved = map(int, re.search(r"at step (\d+) of 100000; the last snapshot is .*\(step (\d+)\)",
                                        err).groups())
    # 2: a signal during step 4's write leaves step 2's snapshot
    assert saved >= 2 and reached - saved <= 2, f"reached step {reached}, last snapshot at step {saved}:\n{err}"
    on_disk = torch.load(tmp_path / snapshot.FILE, weights_only=True)["step"]
    assert on_disk == saved, f"the line names the snapshot of step {saved}, the file holds step {on_disk}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [snapshot.FILE], "a temporary or the lock file was left"


INTERRUPTED_WRITE = """
import io, os, signal, sys
sys.path.insert(0, {root!r})
import train
from guards import clean_end as files
class Interrupting(io.FileIO):
    calls = 0
    def write(self, b):
        Interrupting.calls += 1
        if Interrupting.calls == 2:  # Ctrl-C (or SIGTERM) while torch.save's C++ writer calls this
            os.kill(os.getpid(), signal.{sig})
        return super().write(b)
files.open = lambda path, mode: (Interrupting if "snapshot.pt" in str(path) else io.FileIO)(path, "w")
sys.exit(train.main({argv!r}))
"""


@pytest.mark.parametrize("sig,status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_mid_snapshot_unwinds_the_write(sig, status, out_dir):
    """The signal comes while torch.save's C++ writer runs: the Interrupted raised in its callback
    comes out of C as a RuntimeError, which was reported as a full disk."""
    before = listing(out_dir)
    script = INTERRUPTED_WRITE.format(root=str(ROOT), sig=sig, argv=merged(*TINY, f"--out_dir={out_dir}"))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    ends_in_one_line(r.returncode, r.stderr, status, "at step 2 of 2; this run wrote no snapshot")
    assert listing(out_dir) == before, "the write was not unwound: the old snapshot changed or a temporary stayed"


# ---------------------------------------------------------------- one run per out_dir

def test_a_second_run_on_the_same_out_dir_is_refused(out_dir, capsys):
    with guard.out_dir_held(out_dir):
        held = listing(out_dir)
        for extra in ([], ["--resume", "--max_iters=3", "--lr_decay_iters=2"]):
            code, err = run_main(train.main, merged(*TINY, f"--out_dir={out_dir}", *extra), capsys)
            ends_in_one_line(code, err, 2, f"--out_dir={out_dir} is in use by another run (pid {os.getpid()})")
            assert listing(out_dir) == held, "the refused run changed out_dir"
    assert listing(out_dir) == held, "the lock left something in out_dir"


def test_the_lock_lives_as_long_as_the_process_and_no_longer(tmp_path):
    args = merged(*TINY, f"--out_dir={tmp_path}", "--max_iters=100000", "--log_interval=1")
    first = started(*args)
    first.send_signal(signal.SIGSTOP)  # it keeps its lock, stopped: the core is the other tests'
    try:
        second = train_py(*args)
        ends_in_one_line(second.returncode, second.stderr, 2, f"is in use by another run (pid {first.pid})")
    finally:
        first.kill()  # kill -9: the OS drops its lock
        first.communicate(timeout=60)
    third = train_py(*merged(*args, "--max_iters=2"))
    assert third.returncode == 0, f"a run after the holder's kill -9 failed (a stale lock?):\n{third.stderr}"


# ---------------------------------------------------------------- odd files

@pytest.mark.parametrize("flags", [["--resume"], ["--sample_only"]])
def test_a_pipe_as_the_snapshot_is_refused_without_waiting(flags, tmp_path):
    os.mkfifo(tmp_path / snapshot.FILE)
    r = train_py(*(merged(*TINY, f"--out_dir={tmp_path}") if "--resume" in flags else [f"--out_dir={tmp_path}"]),
                 *flags, timeout=120)
    ends_in_one_line(r.returncode, r.stderr, 2, "is not a regular file (a pipe, a device or a folder)")


def test_a_raw_pickle_snapshot_prints_only_the_one_line(out_dir):
    import pickle
    (out_dir / snapshot.FILE).write_bytes(pickle.dumps({"step": 1}))
    r = train_py(*merged(*TINY, f"--out_dir={out_dir}", "--resume"))
    ends_in_one_line(r.returncode, r.stderr, 2, f"cannot read snapshot {out_dir / snapshot.FILE}")
    assert "Warning" not in r.stderr, f"torch's warnings reached the terminal:\n{r.stderr}"


class FullDisk(io.FileIO):
    """A file on a disk that fills up after 1000 bytes: writes then fail with ENOSPC."""

    def write(self, b):
        if self.tell() + len(b) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(b)


def test_a_disk_that_fills_mid_snapshot_keeps_the_previous_one(out_dir, capsys, monkeypatch):
    # the real torch.save, on a file that runs out of space: torch reports it as RuntimeError
    monkeypatch.setattr(files, "open", lambda path, mode: FullDisk(path, "w"), raising=False)
    before = listing(out_dir)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out_dir}"), capsys)
    ends_in_one_line(code, err, 1, "(is the disk full?)")
    assert "; the previous snapshot is kept" in err, f"the line does not say the snapshot is kept:\n{err}"
    assert listing(out_dir) == before, "the old snapshot changed or the temporary file stayed"


@pytest.mark.parametrize("exists", [True, False])
def test_a_disk_with_no_space_leaves_no_probe_behind(exists, tmp_path, capsys, monkeypatch):
    real = type(tmp_path).write_bytes

    def no_space(path, content):
        if ".probe." in path.name:
            real(path, b"")  # created, then nothing fits
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, content)
    monkeypatch.setattr(type(tmp_path), "write_bytes", no_space)
    out = tmp_path / "out"
    if exists:
        out.mkdir()
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out}"), capsys)
    ends_in_one_line(code, err, 2, f"--out_dir={out} cannot be written: No space left on device")
    assert (list(out.iterdir()) == []) if exists else not out.exists(), "the probe (or its folder) was left"


def test_only_our_own_temporaries_are_removed(out_dir):
    dead = 4_000_000  # above any pid this test machine hands out, within Linux's largest
    mine = {"notes.partial-memtrain-12345": "a user's file", f"results.partial-memtrain-{dead}": "a user's file",
            f"snapshot.pt.partial-memtrain-{10 ** 30}": "no pid: not ours"}
    for name, text in mine.items():
        (out_dir / name).write_text(text)
    os.symlink(out_dir / "notes.partial-memtrain-12345", out_dir / f"snapshot.pt.partial-memtrain-{dead - 1}")
    (out_dir / f"snapshot.pt.partial-memtrain-{dead}").write_bytes(b"half a snapshot")  # a killed run's
    (out_dir / f".probe.partial-memtrain-{dead}").write_bytes(b"")  # a probe killed mid-write
    assert train.main(merged(*TINY, f"--out_dir={out_dir}", "--max_iters=3", "--lr_decay_iters=2", "--resume")) == 0
    names = set(os.listdir(out_dir))
    assert all((out_dir / n).read_text() == t for n, t in mine.items()), "a file of the user's was changed"
    assert f"snapshot.pt.partial-memtrain-{dead - 1}" in names, "a link (not a file we write) was removed"
    assert not names & {f"snapshot.pt.partial-memtrain-{dead}", f".probe.partial-memtrain-{dead}"}, names


TRUNCATED = """
import sys
sys.path.insert(0, {root!r})
import train
real_build = train.build
def build_then_truncate(*a, **kw):
    built = real_build(*a, **kw)
    open({data!r}, "r+b").truncate(100)  # another program cuts the data file under the run
    return built
train.build = build_then_truncate
sys.exit(train.main({argv!r}))
"""


def test_data_truncated_under_a_run_is_one_line(tmp_path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"def f(x):\n    return x + 1\n" * 4000)
    argv = merged(*TINY, f"--out_dir={tmp_path / 'out'}", f"--data={path}")
    script = TRUNCATED.format(root=str(ROOT), data=str(path), argv=argv)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != -signal.SIGBUS, "killed by SIGBUS: the data is read through a memory map"
    ends_in_one_line(r.returncode, r.stderr, 1, f"--data={path} changed while the run read it: it is 100 bytes now")


def test_an_unlistable_data_subfolder_is_refused_like_an_unreadable_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("x" * 10_000)
    (tmp_path / "d" / "sub" / "b.txt").write_text("y" * 10_000)
    real = os.scandir

    def denied(path="."):  # what a folder without read permission gives a non-root user
        if str(path).endswith("sub"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", denied)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path / 'o'}", f"--data={tmp_path / 'd'}"), capsys)
    ends_in_one_line(code, err, 2, f"{tmp_path / 'd' / 'sub'} cannot be read (Permission denied)")


@pytest.mark.skipif(os.geteuid() == 0, reason="as root, permission bits do not stop a read")
def test_an_unreadable_data_subfolder_is_refused(tmp_path, capsys):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text("x" * 10_000)
    (tmp_path / "d" / "sub").chmod(0)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path / 'o'}", f"--data={tmp_path / 'd'}"), capsys)
    ends_in_one_line(code, err, 2, "cannot be read")


def test_micro_batches_are_drawn_as_used():
    """K micro-batches of a step are K draws, each made when accumulation_step reaches it: one micro-batch in
    memory at a time (K may be 2^24), and the same batches, in order, as drawn all at once."""
    tokens = np.arange(1000, dtype=np.uint8)
    batches = data.Batches(tokens, 16, 4, seed=3, device=torch.device("cpu"))
    lazy, state = batches.micro_batches(2 ** 20), batches.gen.get_state()
    assert len(lazy) == 2 ** 20 and torch.equal(batches.gen.get_state(), state), "micro-batches drawn before used"
    first = lazy[0]()
    upfront = data.Batches(tokens, 16, 4, seed=3, device=torch.device("cpu")).micro_batches(3, all_at_once=True)
    drawn = [draw() for draw in data.Batches(tokens, 16, 4, seed=3, device=torch.device("cpu")).micro_batches(3)]
    assert torch.equal(first[0], upfront[0][0]), "a lazily drawn micro-batch differs from the list's"
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(drawn, upfront)), \
        "micro-batches drawn as used differ from those drawn all at once"


# ---------------------------------------------------------------- internal entry points

@pytest.mark.parametrize("argv,words", [
    (["tools/chapter.py", "--worker"], "--worker takes one argument"),
    (["tools/chapter.py", "--worker", "/tmp/x.json"], "--worker is one rank of the torchrun job"),
    (["tools/chapter_runs_memory.py", "--bogus"], "started by make chapter as --worker PATH"),
    (["tools/bench.py", "--row", "{not json"], "--row takes one JSON job"),
    (["tools/bench.py", "--row", '{"flags": [1], "steps": 1, "warmup": 0, "autocast_reference": false}'],
     "--row takes one JSON job"),
])
def test_internal_entry_points_give_one_line(argv, words, monkeypatch, capsys):
    # each script run as `python script args` runs it, here in this process (no torch to import again)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(ROOT / argv[0]), *argv[1:]])
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    ends_in_one_line(ended.value.code, capsys.readouterr().err, 2, words)
