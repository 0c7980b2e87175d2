"""SHARD=fsdp (fsdp.py): FSDP2 through real torchrun/gloo processes on CPU, two ranks.

One launch of tests/fsdp_worker.py runs every case and each test reads its part; one launch
of train.py --shard=fsdp checks the command line. The oracles: the same run with ckpt=none
(recompute), DDP on the same batches (parity), one process on the big batch (accumulation),
the run without a snapshot (resume), and the gradient gathered whole (the norm).
"""
from pathlib import Path

import pytest
import torch

import snapshot
import train
from config import UsageError
from guards.cli import parse_args
from conftest import torchrun
from ddp_worker import make_batches, tiny_config
from fsdp_worker import B, K, Stream

WORKER = Path(__file__).resolve().parent / "fsdp_worker.py"
WORLD = 2
# FSDP vs DDP, FP32, 3 steps of K=3 micro-steps on 2 ranks: measured max |difference| of any parameter 0.0
# (2 ranks: a reduce-scatter's mean and an all-reduce's mean add the same two numbers), asserted with margin
FP32_PARITY = 1e-6
# BF16/FP16: FSDP's FP32 shards start unrounded, DDP's master copy starts from 16-bit weights, and the 16-bit
# compute differs with it: measured |loss difference| <= 2.6e-4 (BF16) and 2.4e-5 (FP16) over 3 steps
LOSS_TRACKS = 2e-3


@pytest.fixture(scope="session")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    r = torchrun([WORKER, out])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [torch.load(out / f"fsdp-rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="session")
def cli(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-cli")
    args = ["train.py", "--shard=fsdp", "--precision=fp16", "--ckpt=full", "--n_layer=2", "--n_embd=32",
            "--n_head=2", "--block_size=16", "--batch_size=2", "--accum=2", "--max_iters=2", "--log_interval=1",
            "--eval_interval=2", "--eval_iters=1", "--sample_tokens=4", "--device=cpu", f"--out_dir={out}"]
    return torchrun(args), out


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------- recompute: FSDP gathers the re-run's blocks

@pytest.mark.parametrize("ckpt", ["full", "sqrt", "selective"])
def test_recompute_gradients_equal_no_recompute(ranks, ckpt):
    """In each of two steps, every policy's whole gradient is ckpt=none's (FP32): our re-run's gradients
    reach FSDP's reduce-scatter (under the old one-node recompute, which differentiated its re-run with
    autograd.grad, the blocks' gradients were silently None). Each step issues the reduce-scatters and
    all-gathers ckpt=none does: the re-run gathers no block a second time, and the first step leaves
    nothing behind in FSDP's state that changes the second."""
    for rank in range(WORLD):
        got, want = ranks[rank]["recompute"][ckpt], ranks[rank]["recompute"]["none"]
        for step in range(2):
            for name, g, w in zip(want["names"], got["grads"][step], want["grads"][step]):
                assert w is not None and w.abs().sum() > 0, f"ckpt=none left {name}'s gradient missing or zero"
                assert g is not None, f"ckpt={ckpt}, rank {rank}: no gradient reached {name} (the re-run's was lost)"
                assert torch.equal(g, w), (f"ckpt={ckpt}, rank {rank}, step {step + 1}: the gradient of {name} "
                                           f"differs from ckpt=none's by up to {(g - w).abs().max().item():.3g}")
            mine, none = got["counts"][step], want["counts"][step]
            assert mine["reduce_scatter"] == none["reduce_scatter"], (
                f"ckpt={ckpt}, step {step + 1}: {mine['reduce_scatter']} reduce-scatters, ckpt=none "
                f"{none['reduce_scatter']}: a block's gradient is lost or reduced twice")
            assert mine["all_gather"] == none["all_gather"], (
                f"ckpt={ckpt}, step {step + 1}: {mine['all_gather']} all-gathers, ckpt=none {none['all_gather']}")


# ---------------------------------------------------------------- accumulation: one reduce-scatter per group per step

def test_early_micro_steps_do_not_reduce_scatter(ranks):
    """With no_sync (the default), an optimizer step of K micro-steps reduce-scatters once per FSDP
    group (each block, and the root); with it off, K times as often."""
    for rank in range(WORLD):
        accum = ranks[rank]["accum"]
        groups = accum[True]["groups"]
        for step, counts in enumerate(accum[True]["counts"]):
            assert counts["reduce_scatter"] == groups, (
                f"rank {rank}, step {step}: {counts['reduce_scatter']} reduce-scatters for {groups} FSDP groups: "
                f"the early micro-steps reduce-scattered (set_requires_gradient_sync(False) not in effect)")
        for step, counts in enumerate(accum[False]["counts"]):
            assert counts["reduce_scatter"] == K * groups, (
                f"rank {rank}, step {step}, no_sync off: {counts['reduce_scatter']} reduce-scatters, expected one "
                f"per group per micro-step, {K * groups}")


def test_no_sync_turns_the_reduce_scatter_off_for_its_body_and_on_after(ranks):
    """FSDP2's gradient sync off (accumulate.py's rule, DDP's no_sync): K-1 backwards reduce-scatter nothing,
    the one after them reduce-scatters once per FSDP group (the switch set back on)."""
    for rank in range(WORLD):
        r = ranks[rank]["no_sync"]
        assert r["inside"] == 0, (f"rank {rank}: {r['inside']} reduce-scatters in {K - 1} backwards inside "
                                  f"model.no_sync(): it did not turn gradient sync off")
        assert r["after"] == r["groups"], (f"rank {rank}: the backward after model.no_sync() reduce-scattered "
                                           f"{r['after']} times for {r['groups']} FSDP groups: sync was not back on")


@pytest.mark.parametrize("no_sync", [True, False])
def test_accumulated_gradient_is_the_big_batch_gradient(ranks, no_sync):
    """K micro-steps on each of 2 ranks under FSDP == one process on the 2 x K micro-batches."""
    rec = ranks[0]["accum"][no_sync]
    for step in range(2):
        model, _ = train.build(tiny_config(), torch.device("cpu"))
        model.load_state_dict(rec["params"][step])
        batches = make_batches(700 + step, WORLD * K, B, 16)
        x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        model(x, y)[1].backward()
        for (name, p), g in zip(model.named_parameters(), rec["grads"][step]):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"step {step}, no_sync={no_sync}: {name}'s accumulated gradient "
                                                     f"is not the big batch's: {m}")


# ---------------------------------------------------------------- FP16: one overflow decision, one norm

def test_inf_in_one_ranks_shard_skips_the_step_on_every_rank(ranks):
    """An inf planted in rank 1's gradient shard only: both ranks see an inf norm, skip, keep
    their weights, and halve the scale; the next clean step steps on both."""
    for rank in range(WORLD):
        o = ranks[rank]["overflow"]
        first, second = o["record"]
        assert not first["stepped"], (f"rank {rank} stepped although rank 1's shard held an inf (norm "
                                      f"{first['norm']}): the overflow decision is not global")
        assert o["unchanged"], f"rank {rank}'s weights changed in the skipped step"
        assert second["stepped"] and o["moved"], f"rank {rank} did not step on the clean step after the skip"
        assert o["scales"] == [65536.0, 32768.0], f"rank {rank}'s loss scale went {o['scales']}, not 2^16 then 2^15"


def test_clip_norm_is_the_whole_gradients(ranks):
    """The norm each rank clips by is the norm of the gradient gathered whole, the same on both ranks."""
    for rank in range(WORLD):
        c = ranks[rank]["clip"]
        assert c["norm"] == pytest.approx(c["true"], rel=1e-6), (
            f"rank {rank} clipped by a norm of {c['norm']}, the whole gradient's is {c['true']}: a shard's norm?")
    assert ranks[0]["clip"]["norm"] == ranks[1]["clip"]["norm"], "the ranks clipped by different norms"


# ---------------------------------------------------------------- numerics: FSDP vs DDP

def test_fp32_parameters_match_ddp(ranks):
    p = ranks[0]["parity"]
    for step, (f, d) in enumerate(zip(p[("fp32", "fsdp")]["params"], p[("fp32", "none")]["params"])):
        worst = max((f[k] - d[k]).abs().max().item() for k in d)
        assert worst <= FP32_PARITY, f"FP32 step {step + 1}: FSDP's parameters differ from DDP's by up to {worst:.3g}"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_losses_track_ddp(ranks, precision):
    p = ranks[0]["parity"]
    f, d = p[(precision, "fsdp")]["losses"], p[(precision, "none")]["losses"]
    assert f[0] == pytest.approx(d[0], abs=1e-5), f"{precision}: the first loss differs: FSDP {f[0]}, DDP {d[0]}"
    worst = max(abs(a - b) for a, b in zip(f, d))
    assert worst <= LOSS_TRACKS, f"{precision}: FSDP's losses {f} drift from DDP's {d} by {worst:.3g}"


# ---------------------------------------------------------------- snapshots

def test_resume_is_bit_exact(ranks):
    """FP16, ckpt=full, dropout: 4 steps straight == 2 steps, a snapshot, a fresh run restored, 2 steps."""
    for rank in range(WORLD):
        r = ranks[rank]["resume"]
        for k, v in r["straight"].items():
            assert torch.equal(v, r["resumed"][k]), (f"rank {rank}: {k} after a resume differs from the straight "
                                                     f"run by {(v - r['resumed'][k]).abs().max().item():.3g}")


def test_snapshot_is_ddps_format(ranks):
    """The snapshot holds the whole model in FP16 and FP32 masters, and a DDP-style run (shard=none)
    restores it: its master weights are the FSDP run's restored FP32 shards, gathered."""
    snap = snapshot.read(ranks[0]["resume"]["path"])
    for k, v in snap["model"].items():
        assert v.dtype == torch.float16, f"the snapshot's {k} is {v.dtype}, not the run's FP16"
    cfg = tiny_config(precision="fp16", ckpt="full", dropout=0.1)
    model, parts = train.build(cfg, torch.device("cpu"))
    snapshot.restore(snap, model, parts, Stream(), 0, WORLD, torch.device("cpu"))
    restored = ranks[0]["resume"]["restored"]
    for (name, _), m in zip(model.named_parameters(), parts.optimizer.master_params):
        assert torch.equal(m, restored[name]), f"the master of {name} a DDP run reads is not the FSDP run's FP32 shard"
    assert snap["optimizer"]["adamw"]["state"], "the snapshot holds no AdamW moments"


# ---------------------------------------------------------------- the command line

def test_train_py_runs_fsdp(cli):
    r, out = cli
    assert r.returncode == 0, f"train.py --shard=fsdp failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    for line in ("step     2 | loss", "val loss", "sample:"):  # evaluation and sampling: forwards on every rank
        assert line in r.stdout, f"train.py --shard=fsdp printed no '{line}' line:\n{r.stdout[-2000:]}"
    assert (out / snapshot.FILE).exists(), "train.py --shard=fsdp wrote no snapshot"


@pytest.mark.parametrize("flags, says", [(["--precision=fp8"], "does not run precision=fp8"),
                                         (["--precision=bf16", "--fp32_grad_accum"], "FSDP already")])
def test_refused_with_fsdp(flags, says):
    with pytest.raises(UsageError, match=says):
        parse_args(["--shard=fsdp", *flags])


def test_fp8_refusal_is_one_line(capsys):
    import train
    assert train.main(["--shard=fsdp", "--precision=fp8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, f"not one line, exit 2:\n{err}"
