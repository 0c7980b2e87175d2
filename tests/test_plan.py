"""Will it fit? (ledger/plan.py, `make plan`): the planner's peak is the walk's at every micro-batch,
its solve is the search's, and on CPU its micro-batch peaks at or under the budget and the next one
over it, as ledger/measure.py measures them (one process and ZeRO-2 over 2 gloo ranks)."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import accumulate
import memory_ledger as ml
import train
from config import Config
from conftest import ROOT, torchrun
from guards import cli
from ledger import measure, step
from ledger import plan as lp
from ledger import shard as ls
from tools import gpu_check, plan_check
from tools import plan as tool

TINY = dict(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=256, device="cpu")  # activations dominate


def walked(cfg, world, rank, micro_steps):
    """One rank's step walked whole (walk_step with its static bytes and optimizer step): the reference."""
    return ml.peak_walk(cfg, world if cfg.shard == "fsdp" else 1, static=ls.rank_static(cfg, cfg.shard, world, rank),
                        optimizer=ls.optimizer_walk(cfg, cfg.shard, world, rank), micro_steps=micro_steps)


@pytest.mark.parametrize("over", [dict(precision="fp32"), dict(precision="bf16", ckpt="full"),
                                  dict(precision="bf16", ckpt="selective", dropout=0.1),
                                  dict(precision="fp16", ckpt="sqrt", attn="sdpa"), dict(precision="fp8"),
                                  dict(precision="bf16", shard="zero1", fp32_grad_accum=True),
                                  dict(precision="bf16", shard="zero2", n_embd=40, bias=False),
                                  dict(precision="fp32", shard="fsdp", ckpt="full"),
                                  dict(precision="bf16", shard="none", device="cuda")])
@pytest.mark.parametrize("micro_steps", [1, 2])
def test_the_plans_peak_is_the_walks_at_every_micro_batch(over, micro_steps):
    # what the solve relies on: one shared walk plus each rank's tail is walk_step's walk, and its
    # points are x + b*y from b = 2 and 3 on (b = 1 walked on its own); one micro-step read off two
    cfg = Config(**{**TINY, **over})
    world = 1 if cfg.shard == "none" and over.get("device") != "cuda" else 2
    befores = {}
    if micro_steps == 1:  # the planner reads one micro-step off the walk of two where it has one
        lp.Peaks(cfg, world, 2, befores).lines  # noqa: B018
    peaks = lp.Peaks(cfg, world, micro_steps, befores)
    for b in range(1, 6):
        at_b = replace(cfg, batch_size=b)
        truth = max(walked(at_b, world, rank, micro_steps).peak for rank in peaks.ranks)
        got = peaks.at(b)[0]
        assert got == truth, f"{over}, {micro_steps} micro-step(s), b={b}: the plan says {got:,} bytes at its " \
                             f"highest rank, the whole walks {truth:,}"
        if micro_steps == 1:  # what lets the plan take K = 1 wherever K = 2 fits
            later = lp.Peaks(cfg, world, 2, befores).at(b)[0]
            assert got <= later, f"{over}, b={b}: one micro-step peaks at {got:,} bytes, two at {later:,}"
    assert peaks.lines is not None, f"{over}: the walks at b = 2 and 3 differ in their points"


def test_the_solve_is_the_search():
    # Peaks.largest, solved from the lines, against walking b = 1, 2, ... until the peak no longer fits
    cfg = Config(**TINY, precision="bf16", shard="zero2")
    peaks = lp.Peaks(cfg, 2, 2)
    steps = [max(walked(replace(cfg, batch_size=b), 2, rank, 2).peak for rank in (0, 1)) for b in range(1, 9)]
    for budget in [steps[0] - 1, steps[0], steps[1] - 1, steps[1], steps[4] + 1, steps[6], steps[7] - 1]:
        searched = sum(peak <= budget for peak in steps)
        assert peaks.largest(budget, limit=8) == searched, f"budget {budget:,}: solved {peaks.largest(budget, 8)}, " \
                                                           f"walked {searched}"


def plan_row(cfg, world, budget, n=6):
    """The plan's one row for cfg's precision, ckpt, shard and attn on CPU against `budget` bytes, n
    sequences per rank per step."""
    fixed = {k: getattr(cfg, k) for k in ("precision", "ckpt", "shard", "attn")}
    rows = lp.plan(cfg, lp.GPU("budget", budget, 0, None, "the test"), world, n * world * cfg.block_size, fixed,
                   context=0)
    assert len(rows) == 1 and rows[0].why is None, rows
    return rows[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
def test_planned_micro_batch_fits_and_the_next_does_not_as_measured(precision, ckpt):
    # a budget where 3 sequences fit (K = 2 of 6): the planned micro-batch measured at or under it, one more over
    cfg = Config(**TINY, precision=precision, ckpt=ckpt)
    budget = lp.Peaks(cfg, 1, 2).at(3)[0]
    row = plan_row(cfg, 1, budget)
    assert (row.b, row.accum) == (3, 2), f"planned b={row.b} K={row.accum} against {budget:,} bytes"
    model, parts = train.build(replace(cfg, batch_size=row.b), torch.device("cpu"))
    accumulate.accumulation_step(model, parts, [measure.random_batch(cfg, "cpu", row.b)])  # the optimizer states
    fits, over = (measure.measure(model, parts, measure.random_batch(cfg, "cpu", b), "cpu",
                                  micro_steps=row.accum)["peak"] for b in (row.b, row.b + 1))
    assert fits == row.peak <= budget < over, f"{precision} {ckpt}: planned b={row.b} peaks at {row.peak:,} bytes, " \
                                              f"measured {fits:,}; b={row.b + 1} measured {over:,}; budget {budget:,}"


# where the optimizer step peaks (context 16): DDP's buckets, ZeRO-1's whole .grad, ZeRO-2's slice and gloo's copy
OPTIMIZER_PEAKS = [dict(shard="none", precision="bf16"), dict(shard="zero1", precision="fp32"),
                   dict(shard="zero2", precision="fp32")]


def test_zero2_over_two_gloo_ranks_as_measured(tmp_path):
    # the same on 2 ranks: each rank's static bytes and optimizer step (ZeRO-2's slice, gloo's copy),
    # measured by the ledger's own sharded runs (tools/ledger_ranks.measure_shard); what a step sends too;
    # and where the optimizer step is the peak, each rank of DDP, ZeRO-1 and ZeRO-2 as walked
    cfg = Config(**TINY, precision="bf16", shard="zero2")
    budget = lp.Peaks(cfg, 2, 2).at(3)[0]
    row = plan_row(cfg, 2, budget)
    assert (row.b, row.accum) == (3, 2), f"planned b={row.b} K={row.accum}"
    assert "ZeRO" not in row.where, f"the peak falls in the optimizer step ({row.where}), where gloo frees its " \
                                    f"buffer when its thread lets go: the measurement may read it late"
    tails = [replace(cfg, block_size=16, batch_size=2, **over) for over in OPTIMIZER_PEAKS]
    cases = [dict(batch_size=b, accum=2) for b in (row.b, row.b + 1)] + \
        [dict(block_size=16, batch_size=2, **over) for over in OPTIMIZER_PEAKS]
    out = tmp_path / "sharded.json"
    r = torchrun([ROOT / "tests" / "plan_worker.py", out, json.dumps(cases), *cli.flags(cfg)])
    assert r.returncode == 0, r.stderr[-2000:]
    fits, over, *optimizer_peaks = json.loads(out.read_text())
    fits_peak, over_peak = max(peak for peak, _ in fits), max(peak for peak, _ in over)
    assert fits_peak == row.peak <= budget < over_peak, f"zero2 over 2 ranks: planned b={row.b} peaks at " \
        f"{row.peak:,} bytes, measured {fits_peak:,}; b={row.b + 1} measured {over_peak:,}"
    assert {sent for _, sent in fits} == {row.sent}, f"a step sent {fits} (peak, bytes) per rank, the plan " \
                                                     f"says {row.sent:,}"
    for one, ranks in zip(tails, optimizer_peaks):
        for rank, (peak, _) in enumerate(ranks):
            w = walked(one, 2, rank, 1)
            assert "optimizer step" in w.where or "ZeRO" in w.where, f"{one.shard}: peaks at {w.where}"
            assert peak == w.peak, f"{one.shard} {one.precision}, rank {rank}: walked {w.peak:,} bytes " \
                                   f"(at {w.where}), measured {peak:,}"


def test_one_walk_serves_every_sharding_and_rank(monkeypatch):
    # the plan's cost: per precision, ckpt and attn one walk at b = 2 and one at 3 shared by DDP, ZeRO-1/2
    # and all 8 ranks, one pair more for fsdp's ZeRO-3 walk, and b = 1 only where b = 2 does not fit
    walks = []
    real = step.walk_before
    monkeypatch.setattr(step, "walk_before", lambda walk_it: walks.append(1) or real(walk_it))
    cfg = Config(n_layer=2, n_embd=64, n_head=2, block_size=32, device="cuda")
    rows = lp.plan(cfg, lp.find_gpu("24GiB"), 8, 16 * 8 * 32, dict(precision="bf16", attn="manual"))
    assert len(rows) == 4 * 4 and all(r.why is None and r.b > 1 for r in rows), [(r.shard, r.why) for r in rows]
    assert len(walks) == 4 * 2 * 2, f"{len(walks)} walks for 4 policies: 2 b's, shared and fsdp's"


def test_a_70b_shape_needs_no_walk_where_its_states_do_not_fit(monkeypatch):
    # 70B on 8 H100s: 16 bytes per parameter over 8 ranks is more than a GPU: said without walking
    monkeypatch.setattr(step, "walk_before", lambda walk_it: pytest.fail("walked a step whose states do not fit"))
    cfg = Config(n_layer=80, n_embd=8192, n_head=64, block_size=4096, vocab_size=32000, device="cuda")
    rows = lp.plan(cfg, lp.find_gpu("H100"), 8, 2 ** 19, dict(precision="bf16", attn="sdpa", ckpt="full"))
    assert rows and all(r.why.startswith("states alone") for r in rows), [r.why for r in rows]


def test_the_gpu_table_and_sizes():
    h100 = lp.find_gpu("h100")
    assert h100.total == int(79.11 * 2 ** 30) and h100.total + h100.driver == 81559 * 2 ** 20
    assert lp.find_gpu("24GiB").total == 24 * 2 ** 30 and lp.find_gpu("80GB").total == 80 * 10 ** 9
    assert lp.find_gpu("A100-40GB").tflops["fp8"] is None  # no FP8 units: its fp8 rows do not run
    for name in lp.GPUS:
        gpu = lp.find_gpu(name)
        assert 20 * 2 ** 30 < gpu.total < 141 * 2 ** 30 and set(gpu.tflops) == {"fp32", "bf16", "fp16", "fp8"}, name


def test_the_command_prints_the_table_the_best_line_and_the_picture(tmp_path, capsys):
    # the best row is the table's first, and the make line printed under it runs exactly that row
    out_dir = tmp_path / "out"
    argv = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=32", "--nproc=2", "--gpu=1GiB",
            "--precision=bf16", "--total_batch_tokens=1048576"]
    status = tool.main(argv + [f"--out_dir={out_dir}"])
    text = capsys.readouterr().out
    assert status == 0 and "configurations fit, least recompute first" in text and "does not fit or run" in text
    lines = text.splitlines()
    first = lines[next(i for i, line in enumerate(lines) if line.startswith("precision ")) + 1].split()
    best = next(line.strip() for line in lines if line.strip().startswith("make ddp NPROC=2 "))
    flags = [f"--{word.split('=')[0].lower()}={word.split('=')[1]}" for word in best.split()[3:]]
    cfg = cli.parse_args(flags)  # a run train.py accepts
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size) == (2, 64, 2, 32)
    assert [cfg.precision, cfg.ckpt, cfg.shard, cfg.attn, str(cfg.batch_size), str(cfg.accum)] == first[:6], \
        f"the table's best row {first[:6]}, the command runs {flags}"
    assert cfg.accum > 1 and cfg.batch_size * cfg.accum * 2 * cfg.block_size == 2 ** 20  # the target, on 2 GPUs
    assert (out_dir / "plan.svg").read_text().startswith("<svg")


@pytest.mark.parametrize("argv, says", [
    (["--gpu=H10"], "the nearest is H100"),
    (["--gpu=300MiB"], "not more than the CUDA context"),
    (["--nproc=0"], "--nproc must be >= 1"),
    (["--nproc=100000"], "--nproc must be <= 16384"),
    (["--gpu=9000000000GiB"], "a GPU of at most 1,048,576 GiB"),
    (["--gpu=1" + "0" * 400 + "GiB"], "a GPU of at most 1,048,576 GiB"),
    (["--gpu=-5GiB"], "a size is a positive number and GiB, GB, MiB or MB"),
    (["--gpu=24G"], "a size is a positive number and GiB, GB, MiB or MB"),
    (["--n_embd=100", "--n_head=3"], "n_head=3 does not divide n_embd=100"),
    (["--batch_size=4"], "does not apply"),
])
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, argv, says):
    status = tool.main(argv + [f"--out_dir={tmp_path / 'out'}"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err
    assert captured.out == "" and not (tmp_path / "out").exists()


def test_make_plan_passes_nproc():
    # NPROC is no config key: make hands it to the plan as its own flag, quoted as every value
    r = subprocess.run(["make", "-n", "plan", f"PYTHON={sys.executable}", "NPROC=8", "N_LAYER=2"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "'--nproc=8'" in r.stdout and "'--n_layer=2'" in r.stdout, r.stdout + r.stderr


def test_gpu_check_carries_the_plans_cuda_check(tmp_path, capsys):
    # it runs on a GPU only: here its command line, its one line without one, the summary's reading of its figures
    plan_steps = [s for s in gpu_check.steps("python", ["--precision=fp16"], tmp_path) if s.name == "plan"]
    assert len(plan_steps) == 1 and plan_steps[0].argv[1:] == ["tools/plan_check.py", "--precision=fp16",
                                                               "--device=cuda", f"--out_dir={tmp_path / 'plan'}"]
    if not torch.cuda.is_available():
        assert plan_check.main([f"--out_dir={tmp_path / 'plan'}"]) == 2
        assert capsys.readouterr().err.strip() == "error: no CUDA device here: the plan's check runs on a GPU " \
                                                  "(make gpu-check)"
    figures = dict(device="NVIDIA H200", cuda_total=150 * 2 ** 30, free=149 * 2 ** 30, context=2 ** 29,
                   workspace=2 ** 25, smi_total=151 * 2 ** 30, driver=2 ** 30, emulated=10 * 2 ** 30,
                   cap=19 * 2 ** 29, bound=2 ** 28, b=4, predicted=9 * 2 ** 30, predicted_next=11 * 2 ** 30,
                   recipe="bf16", ckpt="none", attn="manual", allocated=9 * 2 ** 30 + 2 ** 25,
                   reserved=9 * 2 ** 30 + 2 ** 26, next_fits=False, next_allocated=None, ok=True)
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan_check.json").write_text(json.dumps(figures))
    text = "\n".join(plan_steps[0].figures())
    assert "the CUDA context 512 MiB" in text and "slack 32 MiB (bound 256 MiB)" in text and \
        "micro-batch 5 (predicted 11,811,160,064): out of memory, as planned" in text, text


@pytest.mark.parametrize("shard", ["zero1", "zero2"])
def test_one_rank_of_each_kind_is_walked_for_all(shard):
    """Ranks whose slices cut the same pieces walk alike (lp.differing_ranks): the peak and the largest
    micro-batch over them are those over every rank."""
    cfg, world = Config(n_layer=2, n_embd=64, n_head=2, block_size=32, shard=shard, seed=3), 12
    kinds = lp.Peaks(cfg, world)
    every = lp.Peaks(cfg, world)
    every.ranks = list(range(world))
    assert len(kinds.ranks) < world, f"every one of the {world} ranks is a kind of its own: {kinds.ranks}"
    for b in (1, 2, 5):
        assert kinds.at(b)[0] == every.at(b)[0], f"b={b}: peak {kinds.at(b)} over the kinds, {every.at(b)} over all"
    budget = kinds.at(4)[0]
    assert kinds.largest(budget) == every.largest(budget) and kinds.storages() == every.storages()
