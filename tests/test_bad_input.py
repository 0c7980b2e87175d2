"""Bad input never costs a run or a snapshot: every input below, given to every program that
takes it, ends in exit status 2, exactly one line on stderr that names the problem, no
traceback, nothing new in out_dir, and the snapshot already there byte-identical.

The programs run in-process through their `main` (fast); a few run as real processes,
through make too, to show that what reaches the terminal is the same."""
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import snapshot
from guards import clean_end as files
from guards.cli import parse_args
import train
from conftest import ROOT, merged
from tools import bench, demos, ledger

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--max_iters=2",
        "--sample_tokens=0", "--log_interval=1000", "--eval_interval=1000", "--ledger=false"]
ROOT_USER = os.geteuid() == 0  # root reads and writes through any permission bits


@pytest.fixture(scope="session")
def good_run(tmp_path_factory):
    """An out_dir holding a real snapshot of TINY (the one every bad command must leave alone), in BF16: master
    weights to damage whatever PRECISION=auto is on this CPU."""
    out = tmp_path_factory.mktemp("good")
    assert train.main(merged(*TINY, "--precision=bf16", f"--out_dir={out}")) == 0
    return out


@pytest.fixture
def out_dir(good_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(good_run, out)
    return out


def listing(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def broken_snapshot(out, change):
    """Overwrite out's snapshot with a damaged copy of it: change(state) -> what to save (bytes: as they are)."""
    state = torch.load(out / snapshot.FILE, weights_only=True)
    damaged = change(state)
    if isinstance(damaged, bytes):
        (out / snapshot.FILE).write_bytes(damaged)
    else:
        torch.save(damaged, out / snapshot.FILE)


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


def nested(*keys, value):
    """Set state[k1][k2]... = value (an index for a list or a tuple)."""
    def change(state):
        inner = state
        for k in keys[:-1]:
            inner = inner[k]
        if isinstance(inner, tuple):
            raise TypeError("nested() cannot set inside a tuple")
        inner[keys[-1]] = value(inner[keys[-1]]) if callable(value) else value
        return state
    return change


def model_entry(name, value):
    return nested("model", name, value=value)


def in_config(**entries):
    return lambda state: {**state, "config": {**state["config"], **entries}}


def moment(pid, name, value):
    return nested("optimizer", "adamw", "state", pid, name, value=value)


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
    (["--block_size=1000000"], "for one step", None),  # train.py: the causal mask's allocation fails (within_memory)
    (["--batch_size=1000000"], "GiB for one step", None),
    (["--n_layer=100000", "--n_embd=256"], "GiB for one step", None),
    (["--data=/dev/null"], "not a regular file or a folder", None),
    (["--bogus=1"], "unknown flag --bogus", None),
    (["--precision=fp64"], "--precision=fp64 is not one of", None),
    (["--resume"], "is not usable: it is a list, not a dict", lambda state: [1, 2]),
    (["--resume"], "its config is a str, not a dict", with_("config", "n_layer=1")),
    (["--resume"], "it lacks rng", without("rng")),
    (["--resume"], "it lacks step", without("step")),
    (["--resume"], "its step='2' is no count of steps", with_("step", "2")),
    (["--resume"], "its step=-5 is no count of steps", with_("step", -5)),
    (["--resume"], "model['wte.weight'] holds inf or NaN", nan_weights),
    (["--resume"], "optimizer['master_params'] holds 15, this run writes a list of 16", shorter_masters),
    (["--resume", "--max_iters=4"], "pass --lr_decay_iters=2", None),
    (["--resume"], "its config['n_layer'] is '1', this run writes a int", lambda st: {**st, "config": {**st["config"], "n_layer": "1"}}),
    (["--resume", "--vocab_size=300"], "vocab_size=256 (now 300)", None),
    (["--loss_scale=1e39"], "within FP32's range", None),
    (["--loss_scale=1e-320"], "within FP32's range", None),
    (["--seed=99999999999999999999"], "--seed must be <=", None),
    (["--fp8_backend=te"], "applies to precision=fp8 only", None),
    (["--fp8_keep_weight"], "--fp8_keep_weight applies to precision=fp8 only, this run has precision=", None),
    (["--precision=fp8", "--fp8_keep_weight=maybe"], "--fp8_keep_weight expects true or false", None),
    (["--loss_scale_hysteresis=2"], "applies to dynamic loss scaling", None),
    (["--loss_scale_growth=1.5"], "--loss_scale_growth applies to dynamic loss scaling", None),
    (["--precision=fp16", "--loss_scale_growth=1"], "--loss_scale_growth must be in (1, 2^24], got 1.0", None),
    (["--precision=fp16", "--loss_scale_growth=1e30"], "--loss_scale_growth must be in (1, 2^24], got 1e+30", None),
    (["--precision=fp16", "--loss_scale_backoff=1.5"], "--loss_scale_backoff must be in [2^-24, 1), got 1.5", None),
    (["--precision=fp16", "--loss_scale_backoff=1e-300"], "--loss_scale_backoff must be in [2^-24, 1)", None),
    (["--precision=fp16", "--loss_scale_interval=0"], "--loss_scale_interval must be >= 1", None),
    (["--precision=fp32", "--fp32_grad_accum"], "with precision=fp32 they already are", None),
    # numbers: ASCII digits only, in every key (loss_scale is a string key, parsed by validate)
    (["--loss_scale=1_000"], "loss_scale must be auto|dynamic|none|<number>, got '1_000'", None),
    (["--loss_scale= 5"], "loss_scale must be auto|dynamic|none|<number>, got ' 5'", None),
    (["--loss_scale=\u0665"], "loss_scale must be auto|dynamic|none|<number>", None),  # an Arabic-Indic 5
    (["--n_layer=\u0665"], "--n_layer expects int", None),
    (["--learning_rate=1e-\u0663"], "--learning_rate expects float", None),
    # a value (or a name) with a newline is echoed escaped: still one line
    (["--precision=fp\n16"], "--precision=fp\\n16 is not one of", None),
    (["--bogus\nerror: forged=1"], "unknown flag --bogus\\nerror: forged", None),
    # integers of hundreds of digits (an OverflowError in float arithmetic): every int key holds an int64,
    # and one past Python's 4,300-digit limit on int() is refused before int() is asked
    *[([f"--{key}={'9' * 300}"], f"--{key} must be <= 9223372036854775807", None)
      for key in ("n_layer", "block_size", "vocab_size", "batch_size", "warmup_iters")],
    ([f"--n_layer={'9' * 5000}"], "--n_layer expects an int64, got an integer of 5000 digits", None),
    # AdamW's first step moves by lr / (1 - beta1): at FP32's largest lr that is no FP32 number
    (["--learning_rate=3.4028234663852886e38"], "AdamW's first step moves by lr / (1 - beta1) = 3.40282e+39", None),
    (["--min_lr=1e38", "--beta1=0.99"], "--min_lr=1e+38 is too large", None),
]

# inputs that only train.py takes: snapshots to resume, --data and --out_dir names, K
TRAIN_CASES = [
    # AdamW's state: a negative or fractional step count, a moment of another shape, NaN in a moment (its groups'
    # hyperparameters are the run's own: test_a_snapshots_optimizer_settings_never_reach_the_run)
    (["--resume"], "step is no whole number in [0, 2]", moment(0, "step", torch.tensor(-1.0))),
    (["--resume"], "step is no whole number in [0, 2]", moment(0, "step", torch.tensor(2.5))),
    (["--resume"], "optimizer['adamw']['state'][0]['exp_avg'] is a torch.float32 tensor of shape (3,)",
     moment(0, "exp_avg", torch.zeros(3))),
    (["--resume"], "optimizer['adamw']['state'][1]['exp_avg_sq'] holds inf or NaN",
     moment(1, "exp_avg_sq", lambda t: t * float("nan"))),
    (["--resume"], "exp_avg_sq is negative", moment(1, "exp_avg_sq", lambda t: -1 - t)),
    (["--resume"], "optimizer['adamw']['state'] holds 99, which this run does not write",
     nested("optimizer", "adamw", "state", 99, value={"step": torch.tensor(1.0)})),
    (["--resume"], "optimizer['master_params'][0] is a torch.float16 tensor",
     nested("optimizer", "master_params", 0, value=lambda t: t.half())),
    (["--resume"], "its random streams[0]['cpu'] is a torch.float32 tensor", nested("rng", 0, "cpu",
                                                                                   value=lambda t: t.float())),
    (["--resume"], "optimizer['adamw']['param_groups'][1] is not this run's group of parameters",
     nested("optimizer", "adamw", "param_groups", 1, "params", value=lambda ids: ids[::-1])),
    # the saved config, through config.validate: for --resume and --sample_only alike
    *[(flags, words, in_config(**entry)) for flags in (["--resume"], ["--sample_only"]) for entry, words in [
        (dict(n_head=3), "its config: n_head=3 does not divide n_embd=32"),
        (dict(n_head=0), "its config: --n_head must be >= 1, got 0"),
        (dict(block_size=-1), "its config: --block_size must be >= 1, got -1"),
        (dict(attn="flash"), "its config: --attn=flash is not one of manual|sdpa"),
        (dict(precision="fp64"), "its config: --precision=fp64 is not one of"),
        (dict(warmup_iters=10 ** 300), "its config: --warmup_iters must be <= 9223372036854775807"),
        (dict(n_layer=10 ** 300), "its config: --n_layer must be <= 9223372036854775807, got an integer of 301 digits"),
    ]],
    # a raw pickle (no code runs) and no torch warning before the one line
    (["--resume"], "cannot read snapshot", lambda state: pickle.dumps({"step": 1})),
    (["--sample_only"], "cannot read snapshot", lambda state: pickle.dumps([1, 2])),
    # names longer than the file system takes
    ([f"--out_dir=/tmp/{'o' * 300}"], "cannot be written: File name too long", None),
    ([f"--data=/tmp/{'d' * 300}"], "File name too long", None),
    # K: past 2^24 micro-steps nothing adds up; micro-batches held at once must fit in memory
    (["--accum=100000000"], "--accum must be <= 16777216, got 100000000", None),
    (["--total_batch_tokens=10000000000"], "total_batch_tokens=10000000000 is accum=156250000 micro-steps", None),
    (["--accum=16000000", "--loss_norm=tokens", "--batch_size=100"], "GiB at once, more than half the", None),
    # --sample_only reads the model from the snapshot: the training flags are refused, named
    (["--sample_only", "--n_layer=2"], "--n_layer would be ignored; only --device, --out_dir, --sample_tokens", None),
    # the model's tensors, against what this run writes: dtype (copy_ would cast them silently), layout
    # (a sparse tensor was a dispatcher traceback), and the optimizer's moments alike
    *[(flags, f"model['wte.weight'] is a {dtype} tensor of shape (256, 32), this run writes",
       model_entry("wte.weight", lambda t, d=dtype: (t * 3).to(d)))
      for dtype in (torch.int64, torch.uint8, torch.bool, torch.complex64)
      for flags in (["--resume"], ["--sample_only"])],
    *[(flags, "model['wte.weight'] is torch.sparse_coo, not a dense tensor",
       model_entry("wte.weight", lambda t: t.to_sparse())) for flags in (["--resume"], ["--sample_only"])],
    (["--resume"], "optimizer['adamw']['state'][0]['exp_avg'] is torch.sparse_coo, not a dense tensor",
     moment(0, "exp_avg", lambda t: t.to_sparse())),
    (["--resume"], "optimizer['adamw']['state'][0]['exp_avg'] is a torch.bfloat16 tensor",
     moment(0, "exp_avg", lambda t: t.bfloat16())),
    # the config holds every key (the learning rate's schedule too)
    (["--resume"], "its config lacks lr_decay_iters, max_iters, warmup_iters", lambda st: {**st, "config": {
        k: v for k, v in st["config"].items() if k not in ("max_iters", "lr_decay_iters", "warmup_iters")}}),
    # a loss scaler's state where this run keeps none (BF16, FP32; FP16's: test_bad_scaler_state_leaves_everything_alone)
    (["--resume"], "its loss scaler is {'loss_scale': 1024.0}, this run writes a NoneType",
     with_("scaler", {"loss_scale": 1024.0})),
    # finite weights whose logits overflow: torch.multinomial's RuntimeError was the traceback of `make sample`
    (["--sample_only"], "is not usable: no sample: the weights give inf or NaN probabilities",
     lambda st: {**st, "model": {k: v * 1e30 if v.is_floating_point() else v for k, v in st["model"].items()}}),
]


def run_main(main, argv, capsys):
    code = main(argv)
    return code, capsys.readouterr().err


def ends_in_one_line(code, err, status, words):
    """A failure message in words: which of the promises (status, one line, the words) broke."""
    assert "Traceback" not in err, f"a traceback instead of one line:\n{err}"
    assert code == status, f"exit status {code}, expected {status}; stderr:\n{err}"
    assert err.count("\n") == 1, f"stderr has {err.count(chr(10))} lines, expected one:\n{err}"
    assert words in err, f"the line does not say {words!r}:\n{err}"


PROGRAMS = {"train.py": train.main, "tools/demos.py flops": lambda argv: demos.main(["flops", *argv]),
            "tools/ledger.py": ledger.main, "tools/bench.py": bench.main}


def case_ids(cases):
    return [" ".join(flags)[:40] + (" +damaged" if damage else "") + f" -> {words[:50]}"
            for flags, words, damage in cases]


@pytest.mark.parametrize("flags,words,damage", CASES, ids=case_ids(CASES))
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_bad_input_leaves_everything_alone(program, flags, words, damage, out_dir, capsys):
    reads_data = program in ("train.py", "tools/bench.py")
    if (program != "train.py" and "--resume" in flags) or (not reads_data and any(f.startswith("--data=") for f in flags)):
        pytest.skip(f"{program} reads no snapshot{'' if reads_data else ' and no data'}: it refuses the flag itself "
                    f"(test_programs_refuse_flags_they_would_ignore)")
    refused_as_given(program, flags, words, damage, out_dir, capsys)


@pytest.mark.parametrize("flags,words,damage", TRAIN_CASES, ids=case_ids(TRAIN_CASES))
def test_bad_input_to_train_leaves_everything_alone(flags, words, damage, out_dir, capsys):
    refused_as_given("train.py", flags, words, damage, out_dir, capsys)


def refused_as_given(program, flags, words, damage, out_dir, capsys):
    if damage is not None:
        broken_snapshot(out_dir, damage)
    before = listing(out_dir)
    named = {f.partition("=")[0] for f in flags}  # the case's own flags go in as given (twice, if so)
    if program in ("tools/ledger.py", "tools/demos.py flops"):  # they refuse the training loop's keys: no loop
        named |= {"--max_iters", "--sample_tokens", "--log_interval", "--eval_interval", "--ledger"}
    if program == "tools/demos.py flops":  # and it writes nothing
        named |= {"--out_dir"}
    argv = [f for f in merged(*TINY, f"--out_dir={out_dir}") if f.partition("=")[0] not in named] + flags
    if "--sample_only" in flags:  # it takes its model from the snapshot, and refuses training flags
        argv = [f"--out_dir={out_dir}", *flags]
    code, err = run_main(PROGRAMS[program], argv, capsys)
    ends_in_one_line(code, err, 2, words)
    assert err.startswith("error: "), err
    assert listing(out_dir) == before, "out_dir changed: something new in it, or the snapshot rewritten"


def fp8_buffer(suffix, value):
    """Set the first element of the first FP8 Linear's buffer named `suffix` (scale, amax_history)."""
    def change(state):
        name = next(k for k in state["model"] if k.endswith(f".{suffix}"))
        state["model"][name] = state["model"][name].clone()
        state["model"][name].view(-1)[0] = value
        return state
    return change


# FP8's scales and amax, against what its amax history gives (a run with them went on and wrote a snapshot)
FP8_CASES = [
    (["--resume"], "scale is [-2.0, ", fp8_buffer("scale", -2.0)),
    (["--resume"], "scale is [3.0000000054977558e+38, ", fp8_buffer("scale", 3e38)),
    (["--sample_only"], "scale is [3.0000000054977558e+38, ", fp8_buffer("scale", 3e38)),
    (["--resume"], "amax_history holds a negative amax", fp8_buffer("amax_history", -5.0)),
    (["--resume"], "amax_history'] is a torch.bfloat16 tensor of shape (16, 3), this run writes torch.float32",
     lambda st: fp8_buffer("amax_history", 1.0)(st) and {**st, "model": {
         k: v.bfloat16() if k.endswith("amax_history") else v for k, v in st["model"].items()}}),
]


@pytest.fixture(scope="session")
def good_fp8_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("good_fp8")
    assert train.main(merged(*TINY, f"--out_dir={out}", "--precision=fp8")) == 0
    return out


@pytest.mark.parametrize("flags,words,damage", FP8_CASES, ids=case_ids(FP8_CASES))
def test_bad_fp8_state_leaves_everything_alone(flags, words, damage, good_fp8_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(good_fp8_run, out)
    refused_as_given("train.py", flags + (["--precision=fp8"] if "--resume" in flags else []), words, damage, out,
                     capsys)


# FP16's loss scaler: its state, against what the run's scaler writes (the scale within FP32's range, the counts)
SCALER_CASES = [
    *[(["--resume"], f"its loss scaler['loss_scale'] is {v!r}, this run writes a float", nested("scaler", "loss_scale",
                                                                                              value=v))
      for v in (float("inf"), float("nan"))],
    *[(["--resume"], f"loss_scale={v!r}, clean_steps=2, overflows_left=2: a scale within FP32's range",
       nested("scaler", "loss_scale", value=v)) for v in (1e300, 0.0)],
    (["--resume"], "its loss scaler holds backward, which this run does not write", nested("scaler", "backward",
                                                                                         value=1)),
    (["--resume"], "its loss scaler['skipped_steps'] is '3', this run writes a int",
     nested("scaler", "skipped_steps", value="3")),
    (["--resume"], "it tolerates 5 more overflows, a hysteresis of 2 at most", nested("scaler", "overflows_left",
                                                                                      value=5)),
    (["--resume"], "loss_scale=1000.0 is no power of two", nested("scaler", "loss_scale", value=1000.0)),
    (["--resume"], "clean_steps=2000: 2000 in a row grow the scale", nested("scaler", "clean_steps", value=2000)),
    (["--resume"], "skipped_steps=3 is more than the 2 steps taken", nested("scaler", "skipped_steps", value=3)),
]


@pytest.fixture(scope="session")
def good_fp16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("good_fp16")
    assert train.main(merged(*TINY, f"--out_dir={out}", "--precision=fp16", "--loss_scale_hysteresis=2")) == 0
    return out


@pytest.mark.parametrize("flags,words,damage", SCALER_CASES, ids=case_ids(SCALER_CASES))
def test_bad_scaler_state_leaves_everything_alone(flags, words, damage, good_fp16_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(good_fp16_run, out)
    refused_as_given("train.py", flags, words, damage, out, capsys)


def test_a_snapshots_optimizer_settings_never_reach_the_run(out_dir):
    """AdamW's saved groups carry its hyperparameters (betas, eps, amsgrad, lr); the resumed run's own, from its
    config, replace them: a damaged group's settings (a string for betas, a negative eps, AMSGrad on) never
    reach the optimizer, and the run goes on as its config says."""
    def damage(state):
        for group in state["optimizer"]["adamw"]["param_groups"]:
            group.update(betas="0.9, 0.95", eps=-1e-8, amsgrad=True, lr="fast")
        return state
    broken_snapshot(out_dir, damage)
    history = train.train(parse_args(merged(*TINY, "--precision=bf16", f"--out_dir={out_dir}", "--resume", "--max_iters=3",
                                            "--lr_decay_iters=2")), log=lambda line: None)
    groups = torch.load(out_dir / snapshot.FILE, weights_only=True)["optimizer"]["adamw"]["param_groups"]
    assert [h["step"] for h in history] == [3] and all(
        tuple(g["betas"]) == (0.9, 0.95) and g["eps"] == 1e-8 and g["amsgrad"] is False for g in groups), \
        f"the resumed run took the snapshot's damaged settings: {groups}"


@pytest.mark.parametrize("flags", [["--resume"], ["--sample_only"]])
def test_a_folder_where_the_snapshot_goes_is_refused(flags, tmp_path, capsys):
    (tmp_path / snapshot.FILE).mkdir()
    argv = merged(*TINY, f"--out_dir={tmp_path}", *flags) if "--resume" in flags else [f"--out_dir={tmp_path}", *flags]
    code, err = run_main(train.main, argv, capsys)
    ends_in_one_line(code, err, 2, "is not a regular file (a pipe, a device or a folder)")
    assert [p.name for p in tmp_path.iterdir()] == [snapshot.FILE], "out_dir changed"


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
    ("train.py", "--data=/tmp", "--data would be ignored"),  # with --sample_only
    ("train.py", "--resume", "--resume would be ignored"),  # with --sample_only
    ("train.py", "--learning_rate=1", "--learning_rate would be ignored"),  # with --sample_only
    ("tools/demos.py flops", "--ckpt=full", "the FLOP count sets these itself"),
    *[("tools/demos.py flops", f, "the FLOP count runs one forward and backward of a fresh model, nothing else "
                                  "applies") for f in ("--max_iters=3", "--data=/tmp", "--resume", "--out_dir=o")],
    ("tools/ledger.py", "--data=/tmp", "the ledger measures one step on random tokens"),
    ("tools/ledger.py", "--resume", "the ledger measures one step on random tokens"),
    ("tools/ledger.py", "--tp=1000", "--tp=1000 must divide n_head=2"),
    ("tools/ledger.py", "--cp=5", "--cp=5 must divide block_size=32"),
    ("tools/bench.py", "--resume", "the benchmark times fresh runs"),
    ("tools/bench.py", "--sections=everything", "--sections takes"),
    ("tools/bench.py", "--compile", "the compile section compiles one of its two models itself"),  # before any row
    ("tools/bench.py", "--loss_chunks=4", "the loss section sets LOSS_CHUNKS itself"),  # before any row too
])
def test_programs_refuse_flags_they_would_ignore(program, flag, words, out_dir, capsys):
    before = listing(out_dir)
    argv = merged(*TINY, f"--out_dir={out_dir}", flag)
    if program == "train.py":
        argv = [f"--out_dir={out_dir}", "--sample_only", flag]
    elif program == "tools/demos.py flops":  # TINY's loop keys and out_dir would be refused too: give only `flag`
        argv = [flag]
    code, err = run_main(PROGRAMS[program], argv, capsys)
    ends_in_one_line(code, err, 2, words)
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
    # bounded before torchrun starts a rank: one per core here (no GPU)
    ("ddp", ["NPROC=100000"], f"NPROC=100000 is more ranks than this machine's {len(os.sched_getaffinity(0))} CPU cores"),
    # a capitalised variable that is no key is refused, not dropped
    ("train", ["N_LAYERS=8"], "N_LAYERS is not a config key (the nearest is N_LAYER)"),
    ("ledger", ["TP=3"], "TP is not a config key nor NPROC, PYTHON or ARGS; a tool's own flags go in ARGS='--tp=...'"),
    ("bench", ["SECTIONS=foo"], "SECTIONS is not a config key"),
    ("train", ["PYTHON=/nonexistent/python"], "PYTHON=/nonexistent/python is not an interpreter that runs here"),
    # a value reaches the program as one word, spaces and all
    ("train", ["DATA=/no such/file"], "error: --data=/no such/file: no such file or folder"),
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


def test_make_passes_values_to_the_program_not_to_the_shell(tmp_path):
    ran = tmp_path / "ran"
    for value in (f"N_LAYER=2;touch {ran}", f"N_LAYER=$(shell touch {ran})", f"ARGS=--n_layer=2 ;touch {ran}"):
        r = subprocess.run(["make", "-s", "train", f"PYTHON={sys.executable}", f"OUT_DIR={tmp_path / 'o'}", value],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, f"make train {value!r}: exit {r.returncode}\n{r.stderr}"
        assert not ran.exists(), f"make train {value!r} ran a command of the value"
        assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


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
    temps = [p.name for p in out_dir.iterdir() if files.TEMP.fullmatch(p.name)]
    assert len(temps) == 1  # what the kill left behind
    good = (out_dir / snapshot.FILE).read_bytes()
    assert train.main(merged(*TINY, f"--out_dir={out_dir}", "--max_iters=3", "--lr_decay_iters=2", "--resume")) == 0
    assert [p.name for p in out_dir.iterdir() if files.TEMP.fullmatch(p.name)] == []
    assert (out_dir / snapshot.FILE).read_bytes() != good  # and the run went on and saved
