"""A learner's edits, tried as `make ledger` (tools/ledger.py) answers them: another norm (nn.RMSNorm), a
SwiGLU MLP, grouped-query attention, rotary embeddings in place of wpe (tests/learner_edits.py applies
each at test time, never shipped). model.py's edit alone is a finding: exit status 1, the component
table printed, the change named, no traceback. With the description edited too, exact again.

Both run with --table=formula: the table's measured rows and the ranks' processes are machinery
tests/test_memory_cli.py holds (the ranks would run model.py as it is on disk, not as edited here);
and the what-if is not rerun here (it walks the big shapes: seconds each; tools/ledger.py caches it
per process, which an edit made in-process would leave stale).
"""
import pytest
import torch

import accumulate
import memory_ledger as ml
import train
from config import Config
from ledger import measure
from conftest import merged
from guards.cli import parse_args
from learner_edits import EDITS
from tools import ledger as tool

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--seed=3"]
# where a step's peak falls in backward, inside the blocks' own ops, not in the optimizer step
HEAVY = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--block_size=128", "--batch_size=2", "--seed=3"]
DESCRIBED = [["--precision=bf16"], ["--precision=fp32", "--ckpt=full", "--dropout=0.1"],
             ["--precision=fp8", "--ckpt=selective"],
             ["--precision=fp16", "--attn=sdpa", "--ckpt=sqrt", "--dropout=0.1"]]


@pytest.fixture(autouse=True)
def ledger_here(monkeypatch):
    """The what-if left out (see above); the description's census forgotten after each edit."""
    monkeypatch.setattr(tool, "what_if_text", lambda opts: ("the what-if: not run by this test", True))
    yield
    ml._census.cache_clear()  # (the edits are undone after this: nothing is cached in between)


def ledger(argv, tmp_path, capsys):
    rc = tool.main(argv + ["--table=formula", f"--out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "error" not in err, f"make ledger answered with an error:\n{out}{err}"
    return rc, out, err


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_to_model_py_alone_is_named(edit, monkeypatch, tmp_path, capsys):
    edit_model, _, named = EDITS[edit]
    edit_model(monkeypatch)
    argv = TINY + ["--precision=bf16"]
    rc, out, err = ledger(argv, tmp_path, capsys)
    lines = out.splitlines()
    assert rc == 1 and err == "ledger: some check missed\n", f"exit status {rc}, stderr {err!r}"
    assert lines[1].split()[:3] == ["component", "predicted", "measured"], f"no component table first:\n{out}"
    unnamed = [line for line in named(parse_args(argv)) if line not in lines]
    assert not unnamed, "make ledger does not say:\n" + "\n".join(unnamed) + "\nit says:\n" + out


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_described_too_is_exact_again(edit, monkeypatch, tmp_path, capsys):
    edit_model, edit_description, _ = EDITS[edit]
    edit_model(monkeypatch)
    edit_description(monkeypatch)
    for argv in DESCRIBED:
        rc, out, err = ledger(merged(*HEAVY, *argv), tmp_path, capsys)
        peak = next(line.split() for line in out.splitlines() if line.startswith("peak "))
        assert rc == 0 and err == "" and peak[1] == peak[2], \
            f"{' '.join(argv)}: exit status {rc}, the peak predicted {peak[1]} and measured {peak[2]} bytes:\n{out}"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_rmsnorm_peak_in_its_own_backward_is_walked_exactly(precision, monkeypatch):
    """A shape (width = vocabulary) where the step's peak is ln_f's backward: pow's backward keeps
    its three temporaries alive together (one C++ expression), and the walk must too."""
    edit_model, edit_description, _ = EDITS["rmsnorm"]
    edit_model(monkeypatch)
    edit_description(monkeypatch)
    cfg = Config(device="cpu", precision=precision, n_layer=1, n_embd=256, n_head=2, block_size=64, batch_size=32)
    model, parts = train.build(cfg, torch.device("cpu"))
    batch = measure.random_batch(cfg, torch.device("cpu"))
    accumulate.accumulation_step(model, parts, [batch])
    measured = measure.measure(model, parts, batch, torch.device("cpu"))
    predicted, where, _ = ml.peak_estimate(cfg)
    assert (predicted, where) == (measured["peak"], "ln_f pow backward"), \
        f"{precision}: the walk's peak {predicted:,} bytes at {where}, measured {measured['peak']:,} " \
        f"in {measured['peak_phase']}"
