"""A learner's edits to model.py alone (tests/learner_edits.py: RMSNorm, SwiGLU, grouped-query attention,
rotary embeddings, no position embeddings, an untied head, SiLU), each applied at test time, never shipped.
Each trains, and `make ledger` (tools/ledger.py) answers for it with no second edit: exit status 0, the
trace of the edited model equal to its measured step to the byte, and the closed-form column naming how
the edit departs from the chapter's formula.

`make ledger` runs with --table=formula: the table's measured rows and the ranks' processes are machinery
tests/test_memory_cli.py holds (the ranks would run model.py as it is on disk, not as edited here); the
published figures are not rerun here (their shapes are the papers' GPT whatever the edit).
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import flops
import model
import train
from conftest import merged
from learner_edits import EDITS, SwiGLU
from guards.cli import parse_args
from tools import ledger as tool

TRAIN = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--max_iters=3",
         "--sample_tokens=0", "--log_interval=1", "--eval_interval=1000", "--ledger=false", "--peak_flops=1e12"]
# where a step's peak falls in backward, inside the blocks' own ops, not in the optimizer step
HEAVY = ["--n_layer=2", "--n_embd=64", "--n_head=4", "--block_size=128", "--batch_size=2", "--seed=3"]
CONFIGS = [["--precision=bf16"], ["--precision=fp32", "--ckpt=full", "--dropout=0.1"],
           ["--precision=fp8", "--ckpt=selective"], ["--precision=fp16", "--attn=sdpa", "--ckpt=sqrt", "--dropout=0.1"]]


@pytest.fixture(autouse=True)
def no_papers(monkeypatch):
    monkeypatch.setattr(tool, "papers_text", lambda: ("the published figures: not run by this test", True))


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_to_model_py_alone_trains(edit, monkeypatch, tmp_path, capsys):
    edit_model, _ = EDITS[edit]
    edit_model(monkeypatch)
    rc = train.main(merged(*TRAIN, f"--out_dir={tmp_path}"))
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out + err, f"{edit}: train.py exit status {rc}:\n{out}{err}"
    assert (tmp_path / "snapshot.pt").exists(), f"{edit}: no snapshot after training"
    # MFU's FLOPs (flops.per_token, counted on fake tensors) are the edited model's: PyTorch's FlopCounterMode
    # on a real forward and backward of it, the oracle
    cfg = parse_args(TRAIN)
    torch.manual_seed(0)
    real = model.GPT(cfg)
    x = torch.zeros(1, cfg.block_size, dtype=torch.long)
    with FlopCounterMode(display=False) as counter:
        real(x, x)[1].backward()
    assert flops.per_token(cfg)[0] * cfg.block_size == counter.get_total_flops(), \
        f"{edit}: MFU's FLOPs per token {flops.per_token(cfg)[0]:,.0f}, FlopCounterMode's " \
        f"{counter.get_total_flops() / cfg.block_size:,.0f}"


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_to_model_py_alone_is_exact_and_named(edit, monkeypatch, tmp_path, capsys):
    edit_model, departs = EDITS[edit]
    edit_model(monkeypatch)
    # bf16 for every edit (the closed forms read there), and one of the others in turn: each met by two edits or more
    other = CONFIGS[1 + list(EDITS).index(edit) % (len(CONFIGS) - 1)]
    for i, argv in enumerate([CONFIGS[0], other]):
        argv = merged(*HEAVY, *argv)
        rc = tool.main(argv + ["--table=formula", f"--out_dir={tmp_path}"])
        out, err = capsys.readouterr()
        peak = next(line.split() for line in out.splitlines() if line.startswith("peak "))
        assert rc == 0 and err == "" and peak[1] == peak[2], \
            f"{edit}, {' '.join(argv)}: exit status {rc}, the peak traced {peak[1]} and measured {peak[2]} " \
            f"bytes:\n{out}{err}"
        if i == 0:
            closed = out.split("the chapter's closed forms", 1)[1].split("four components", 1)[0]
            unsaid = [line for line in departs(parse_args(argv)) if line not in closed]
            assert not unsaid, f"{edit}: make ledger's closed forms do not say:\n" + "\n".join(unsaid) + \
                "\nthey say:\n" + closed


def test_swiglu_at_eight_thirds_leaves_the_fp8_rows_out_in_words(monkeypatch, tmp_path, capsys):
    """SwiGLU at 8/3 of the width (170 at n_embd=64) trains in BF16, and FP8's rule (multiples of 16) rules out
    its FP8 rows: `make ledger` says so, naming the Linear and its dimension, and still exits 0."""
    monkeypatch.setattr(SwiGLU, "width", 8 / 3)
    monkeypatch.setattr(model, "MLP", SwiGLU)
    rc = tool.main(merged(*HEAVY, "--precision=bf16", "--table=formula", f"--out_dir={tmp_path}"))
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", f"make ledger on SwiGLU at 8/3: exit status {rc}:\n{out}{err}"
    for backend in ("native", "Transformer Engine"):
        assert f"FP8 ({backend}): does not apply to this model: precision=fp8 needs every FP8 Linear's dimensions " \
               f"divisible by 16 (an FP8 GEMM's rule): h.0.mlp.w1 is 64 -> 170, and 170 is not" in out, \
            f"the FP8 ({backend}) row does not say why it is left out:\n{out}"
