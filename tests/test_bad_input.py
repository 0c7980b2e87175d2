"""Bad input never costs a run or a snapshot: every input below, given to every program that
takes it, ends in exit status 2, exactly one line on stderr that names the problem, no
traceback, nothing new in out_dir, and the snapshot already there byte-identical.

The programs run in-process through their `main` (fast); a few run as real processes,
through make too, to show that what reaches the terminal is the same."""
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import snapshot
import train
from conftest import ROOT, merged
from tools import bench, demos, ledger

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--max_iters=2",
        "--sample_tokens=0", "--log_interval=1000", "--eval_interval=1000", "--ledger=false"]
ROOT_USER = os.geteuid() == 0  # root reads and writes through any permission bits


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """An out_dir holding a real snapshot of TINY (the one every bad command must leave alone)."""
    out = tmp_path_factory.mktemp("good")
    assert train.main(merged(*TINY, f"--out_dir={out}")) == 0
    return out


@pytest.fixture
def out_dir(good_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(good_run, out)
    return out


def listing(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def broken_snapshot(out, change):
    """Overwrite out's snapshot with a damaged copy of it: change(state) -> what to save."""
    state = torch.load(out / snapshot.FILE, weights_only=True)
    torch.save(change(state), out / snapshot.FILE)


def without(key):
    return lambda state: {k: v for k, v in state.items() if k != key}


def with_(key, value):
    return lambda state: {**state, key: value}


def nan_weights(state):
    state["model"]["wte.weight"][0, 0] = float("nan")
    return state


def shorter_masters(state):
    state["optimizer"]["master_params"] = state["optimizer"]["master_params"][:-1]
    return state


# (flags, words the error names, how to damage the snapshot first or None)
CASES = [
    (["--learning_rate=inf"], "--learning_rate must be a finite number", None),
    (["--learning_rate=1e39"], "--learning_rate must be a finite number within FP32's range", None),
    (["--min_lr=nan"], "--min_lr must be a finite number", None),
    (["--min_lr=inf"], "--min_lr must be a finite number", None),
    (["--weight_decay=nan"], "--weight_decay must be a finite number", None),
    (["--weight_decay=inf"], "--weight_decay must be a finite number", None),
    (["--peak_flops=inf"], "--peak_flops must be a finite number", None),
    (["--fp8_margin=100000"], "--fp8_margin must be <= 16", None),
    (["--n_layer= 2"], "--n_layer expects int", None),
    (["--n_layer=1_0"], "--n_layer expects int", None),
    (["--n_layer=2", "--n_layer=3"], "--n_layer is given twice", None),
    (["--ckpt=sqrt", "--ckpt_segment=5"], "ckpt_segment=5 is more blocks than n_layer=1", None),
    (["--ckpt_segment=1"], "applies to ckpt=sqrt only", None),
    (["--out_dir="], "--out_dir must name a folder", None),
    (["--n_embd=1000000"], "GiB for one step", None),
    (["--block_size=1000000"], "GiB for one step", None),
    (["--batch_size=1000000"], "GiB for one step", None),
    (["--n_layer=100000"], "GiB for one step", None),
    (["--data=/dev/null"], "not a regular file or a folder", None),
    (["--bogus=1"], "unknown flag --bogus", None),
    (["--precision=fp64"], "--precision=fp64 is not one of", None),
    (["--resume"], "is not usable: it holds a list", lambda state: [1, 2]),
    (["--resume"], "'config' is a str", with_("config", "n_layer=1")),
    (["--resume"], "it has no 'rng'", without("rng")),
    (["--resume"], "it has no 'step'", without("step")),
    (["--resume"], "'step' is a str", with_("step", "2")),
    (["--resume"], "step=-5 is negative", with_("step", -5)),
    (["--resume"], "model entry wte.weight holds inf or NaN", nan_weights),
    (["--resume"], "the snapshot holds", shorter_masters),
    (["--resume", "--max_iters=4"], "pass --lr_decay_iters=2", None),
    (["--resume"], "config entry n_layer='1' is not Config's n_layer (int)", lambda st: {**st, "config": {**st["config"], "n_layer": "1"}}),
    (["--resume", "--vocab_size=300"], "vocab_size=256 (now 300)", None),
    (["--loss_scale=1e39"], "within FP32's range", None),
    (["--loss_scale=1e-320"], "within FP32's range", None),
    (["--seed=99999999999999999999"], "--seed must be <=", None),
    (["--fp8_backend=te"], "applies to precision=fp8 only", None),
    (["--loss_scale_hysteresis=2"], "applies to dynamic loss scaling", None),
    (["--precision=fp32", "--fp32_grad_accum"], "with precision=fp32 they already are", None),
]


def run_main(main, argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


PROGRAMS = {"train.py": train.main, "tools/demos.py flops": lambda argv: demos.main(["flops", *argv]),
            "tools/ledger.py": ledger.main, "tools/bench.py": bench.main}


@pytest.mark.parametrize("flags,words,damage", CASES, ids=[" ".join(c[0]) + (" +damaged" if c[2] else "")
                                                            for c in CASES])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_bad_input_leaves_everything_alone(program, flags, words, damage, out_dir, capsys):
    reads_data = program in ("train.py", "tools/bench.py")
    if (program != "train.py" and "--resume" in flags) or (not reads_data and any(f.startswith("--data=") for f in flags)):
        pytest.skip(f"{program} reads no snapshot{'' if reads_data else ' and no data'}: it refuses the flag itself "
                    f"(test_programs_refuse_flags_they_would_ignore)")
    if damage is not None:
        broken_snapshot(out_dir, damage)
    before = listing(out_dir)
    named = {f.partition("=")[0] for f in flags}  # the case's own flags go in as given (twice, if so)
    if program == "tools/ledger.py":  # it refuses the training loop's keys: it runs no loop
        named |= {"--max_iters", "--sample_tokens", "--log_interval", "--eval_interval", "--ledger"}
    argv = [f for f in merged(*TINY, f"--out_dir={out_dir}") if f.partition("=")[0] not in named] + flags
    code, err = run_main(PROGRAMS[program], argv, capsys)
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert "Traceback" not in err
    assert listing(out_dir) == before  # nothing new, the snapshot byte-identical


@pytest.mark.parametrize("where", ["a file", "below a file", "under /proc"])
def test_an_out_dir_that_cannot_be_written_is_found_before_training(where, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    target = {"a file": afile, "below a file": afile / "out", "under /proc": "/proc/no/such/out"}[where]
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={target}"), capsys)
    assert code == 2 and err.startswith(f"error: --out_dir={target} cannot be written") and err.count("\n") == 1
    assert afile.read_text() == "not a folder"


@pytest.mark.skipif(ROOT_USER, reason="as root, permission bits do not stop a read or a write")
def test_read_only_out_dir_and_unreadable_data(tmp_path, capsys):
    ro, data = tmp_path / "ro", tmp_path / "data.txt"
    ro.mkdir()
    ro.chmod(0o555)
    data.write_text("x" * 10_000)
    data.chmod(0)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={ro}"), capsys)
    assert code == 2 and "cannot be written" in err and err.count("\n") == 1
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path / 'o'}", f"--data={data}"), capsys)
    assert code == 2 and "cannot be read" in err and err.count("\n") == 1


def test_an_out_dir_the_system_refuses_is_found_before_training(tmp_path, capsys, monkeypatch):
    """A read-only folder, as a non-root user meets it: the probe write is refused."""
    real = type(tmp_path).write_bytes

    def refused(path, data):
        if ".probe." in path.name:
            raise PermissionError(13, "Permission denied")
        return real(path, data)
    monkeypatch.setattr(type(tmp_path), "write_bytes", refused)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path / 'ro'}"), capsys)
    assert code == 2 and err == f"error: --out_dir={tmp_path / 'ro'} cannot be written: Permission denied\n"
    assert not (tmp_path / "ro").exists()  # the folder made for the probe is gone again


def test_files_of_the_user_are_not_taken_for_leftovers(out_dir):
    for name in ("results.tmp4000000", "draft.tmp99999", "notes.partial-memtrain"):
        (out_dir / name).write_text("mine")
    assert train.main(merged(*TINY, f"--out_dir={out_dir}", "--max_iters=3", "--lr_decay_iters=2", "--resume")) == 0
    assert all((out_dir / n).read_text() == "mine" for n in ("results.tmp4000000", "draft.tmp99999",
                                                            "notes.partial-memtrain"))


def test_a_pipe_as_data_is_refused_without_reading_it(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for data in (fifo, tmp_path):  # the pipe itself, and a folder holding only the pipe
        code, err = run_main(train.main, merged(*TINY, f"--out_dir={tmp_path / 'o'}", f"--data={data}"), capsys)
        assert code == 2 and err.count("\n") == 1
        assert "not a regular file" in err or "holds no files" in err


@pytest.mark.parametrize("program,flag,words", [
    ("train.py", "--data=/tmp", "--data and --resume do not apply"),  # with --sample_only
    ("tools/demos.py flops", "--ckpt=full", "the FLOP count sets these itself"),
    ("tools/ledger.py", "--data=/tmp", "the ledger measures one step on random tokens"),
    ("tools/ledger.py", "--resume", "the ledger measures one step on random tokens"),
    ("tools/ledger.py", "--tp=1000", "--tp=1000 must divide n_head=2"),
    ("tools/ledger.py", "--cp=5", "--cp=5 must divide block_size=32"),
    ("tools/bench.py", "--resume", "the benchmark times fresh runs"),
    ("tools/bench.py", "--sections=everything", "--sections takes"),
])
def test_programs_refuse_flags_they_would_ignore(program, flag, words, out_dir, capsys):
    before = listing(out_dir)
    extra = ["--sample_only"] if program == "train.py" else []
    code, err = run_main(PROGRAMS[program], merged(*TINY, f"--out_dir={out_dir}", *extra, flag), capsys)
    assert code == 2 and words in err and err.count("\n") == 1 and err.startswith("error: "), err
    assert listing(out_dir) == before


def test_weights_that_go_non_finite_stop_the_run_and_keep_the_snapshot(out_dir, capsys):
    """FP16 weights overflow when the FP32 master copy passes 65504 (here after one update at
    lr 1e5): the run stops with one line and status 1, and the good snapshot stays."""
    before = listing(out_dir)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out_dir}", "--precision=fp16", "--learning_rate=1e5",
                                            "--warmup_iters=0"), capsys)
    assert code == 1 and err.startswith("error: step 2: the weights hold inf or NaN") and err.count("\n") == 1
    assert listing(out_dir) == before


def test_a_full_disk_mid_snapshot_keeps_the_previous_one(out_dir, capsys, monkeypatch):
    def full(obj, fh, *a, **kw):
        fh.write(b"half a snapshot")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    before = listing(out_dir)
    code, err = run_main(train.main, merged(*TINY, f"--out_dir={out_dir}"), capsys)
    assert code == 1 and "No space left on device; the previous snapshot is kept" in err and err.count("\n") == 1
    assert listing(out_dir) == before


# ---------------------------------------------------------------- real processes, make, kills

def test_the_terminal_sees_one_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--learning_rate=inf", f"--out_dir={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "error: --learning_rate must be a finite number, got 'inf'\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target,variables,words", [
    ("train", ["ARGS=--min_lr=nan"], "error: --min_lr must be a finite number"),
    ("ddp", ["NPROC=0"], "NPROC=0 must be a positive integer"),
    ("ddp", ["NPROC=abc"], "NPROC=abc must be a positive integer"),
])
def test_make_targets_exit_2(target, variables, words, tmp_path):
    r = subprocess.run(["make", "-s", target, f"PYTHON={sys.executable}", f"OUT_DIR={tmp_path / 'o'}", *variables],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and words in lines[0] and "Traceback" not in r.stderr, r.stderr
    # the program's own line; make may add its own last line ("make: *** [train] Error 2", or
    # "make[1]: ***" when this runs under `make test`)
    assert len(lines) == 1 or (len(lines) == 2 and re.match(r"make(\[\d+\])?: \*\*\*", lines[1])), lines
    assert not (tmp_path / "o").exists()


KILLER = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
import train
real_save = torch.save
def save_then_die(obj, fh, *a, **kw):
    fh.write(b"the first bytes of a snapshot")
    fh.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write, as by kill -9
torch.save = save_then_die
train.main({argv!r})
"""


def test_a_run_killed_mid_snapshot_leaves_no_temp_file_after_the_next_start(out_dir):
    argv = merged(*TINY, f"--out_dir={out_dir}")
    killed = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT), argv=argv)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    temps = [p.name for p in out_dir.iterdir() if snapshot.TEMP.fullmatch(p.name)]
    assert len(temps) == 1  # what the kill left behind
    good = (out_dir / snapshot.FILE).read_bytes()
    assert train.main(merged(*TINY, f"--out_dir={out_dir}", "--max_iters=3", "--lr_decay_iters=2", "--resume")) == 0
    assert [p.name for p in out_dir.iterdir() if snapshot.TEMP.fullmatch(p.name)] == []
    assert (out_dir / snapshot.FILE).read_bytes() != good  # and the run went on and saved
