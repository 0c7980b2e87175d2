"""Will it fit? (ledger/plan.py, `make plan`): a big step from two small traces is the step traced whole,
at every micro-batch and on every rank; the solve is the search; on CPU the planned micro-batch peaks at or
under the budget and the next one over it, as ledger/measure.py measures them (one process and ZeRO-2 over
2 gloo ranks); BATCH_SIZE is a question the plan answers."""
import json
import os
import re
import subprocess
import sys
from dataclasses import astuple, replace

import pytest
import torch

import accumulate
import flops
import train
from config import Config
from conftest import ROOT, torchrun
from guards import cli
from ledger import comm, gpus, kept, measure, trace
from ledger import plan as lp
from tools import gpu_check, plan_check
from tools import plan as tool

TINY = dict(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=256, device="cpu")  # activations dominate


def traced_whole(cfg, world, micro_steps, b):
    """The highest rank's peak of cfg's step traced at its own depth and micro-batch: the reference."""
    at_b = replace(cfg, batch_size=b)
    ranks = range(world) if cfg.shard in ("zero1", "zero2") else [0]
    peak = max(trace.step(at_b, world if cfg.shard != "none" else 1, rank, micro_steps)["peak"] for rank in ranks)
    return peak + (trace.step(at_b, world, 0, micro_steps)["ddp_buckets"] if cfg.shard == "none" and world > 1 else 0)


DEEP = dict(n_layer=6, n_embd=32, n_head=2, block_size=64, vocab_size=256, device="cpu")  # more units than traced
READ = ("points", "phase", "inputs", "flops", "fp8_flops", "held", "buffer_counts", "buffers", "parameters", "sent",
        "gathered")  # what the extension reads of a trace
# one micro-step or two: one process, ZeRO and FSDP each meet both
CONFIGURATIONS = pytest.mark.parametrize("over,world,micro_steps", [
    (dict(precision="fp32"), 1, 1), (dict(precision="bf16", ckpt="full", attn="sdpa"), 1, 2),
    (dict(precision="bf16", ckpt="selective", dropout=0.1), 1, 1),
    (dict(precision="fp16", ckpt="sqrt", ckpt_segment=2, n_layer=9), 1, 1), (dict(precision="fp8"), 1, 2),
    (dict(precision="bf16", shard="none", fp32_grad_accum=True), 2, 2), (dict(precision="fp32", shard="zero1"), 2, 1),
    (dict(precision="bf16", shard="zero2", bias=False), 3, 2), (dict(precision="bf16", shard="fsdp", n_layer=7), 2, 1),
    (dict(precision="fp32", shard="fsdp", ckpt="full", n_layer=7), 2, 2),
    (dict(precision="bf16", shard="fsdp", ckpt="sqrt", ckpt_segment=2, n_layer=9), 2, 2),
    (dict(precision="bf16", loss_chunks=4, vocab_size=4096), 1, 2)])


@CONFIGURATIONS
def test_one_trace_at_the_marker_is_the_traces_at_two_and_three_sequences(over, world, micro_steps):
    # the planner's trace at marker(cfg) sequences, read at b = 2 and 3, is what a trace at b gives, figure by figure
    cfg = replace(Config(**{**DEEP, **over}), device="cuda")  # (a GPU's: its rules, FP8's GEMM, sdpa's kernels)
    read_as_traced(replace(cfg, n_layer=lp.units(cfg)[0] * 2 + lp.units(cfg)[2]), world, micro_steps)  # two units


def test_storages_over_a_mib_are_told_at_each_micro_batch():
    # FP32 attention scores of 512 KiB a sequence: 1 MiB at b = 2, not over it; over it at b = 3
    read_as_traced(Config(**{**TINY, "block_size": 256, "precision": "fp32", "device": "cuda"}), 1, 1)


def read_as_traced(cfg, world, micro_steps):
    if cfg.shard != "fsdp":  # as Peaks traces it: DDP's and ZeRO's forward and backward unsharded, two micro-steps
        cfg, world, micro_steps = replace(cfg, shard="none"), 1, 2
    marked = trace.step(replace(cfg, batch_size=trace.marker(cfg)), world, 0, micro_steps, True)
    for b in (2, 3):
        traced = trace.step(replace(cfg, batch_size=b), world, 0, micro_steps, True)
        read = trace.at_micro_batch(marked, b)
        differ = [name for name in READ if traced[name] != read[name]]
        assert not differ, f"{cfg.precision} {cfg.ckpt} {cfg.shard} at b={b}: " + "; ".join(
            f"{name}: traced at b {str(traced[name])[:200]}, read off the marker {str(read[name])[:200]}"
            for name in differ)


@CONFIGURATIONS
def test_the_extended_step_is_the_step_traced_whole(over, world, micro_steps, monkeypatch):
    """What the plan relies on: traced at 2 and 3 units (4 and 5 blocks under FSDP), each at marker(cfg) sequences,
    every point of the step extends to the full depth and any micro-batch exactly (b = 1 from traces at b = 1).
    (Extended even where tracing the model whole would run fewer blocks: the extension is what is held here.)"""
    monkeypatch.setattr(lp.Extended, "whole_when_cheaper", False)
    cfg = Config(**{**DEEP, **over})
    for b in (1, 5) if micro_steps == 1 else (5,):  # b = 1, its own traces, where K = 1 (five of the twelve)
        peaks = lp.Peaks(cfg, world, micro_steps, (1,) if b == 1 else (2, 3))
        assert peaks.ext.depths[0] < lp.units(cfg)[1], f"{over}: traced at its own depth, nothing extended"
        got, truth = peaks.at(b)[0], traced_whole(cfg, world, micro_steps, b)
        assert got == truth, f"{over}, {micro_steps} micro-step(s), b={b}: the plan says {got:,} bytes at its " \
                             f"highest rank ({peaks.at(b)[1]}), the step traced whole {truth:,}"


def test_the_solve_is_the_search():
    # Peaks.largest, solved from the lines, against stepping b = 2, 3, ... until the peak no longer fits
    cfg = Config(**TINY, precision="bf16", shard="zero2")
    peaks = lp.Peaks(cfg, 2, 2)
    steps = [peaks.at(b)[0] for b in range(2, 10)]
    for budget in [steps[0] - 1, steps[0], steps[1] - 1, steps[1], steps[4] + 1, steps[6], steps[7] - 1]:
        searched = 1 + sum(peak <= budget for peak in steps)  # 1: not even b = 2 (b = 1 is asked apart)
        assert peaks.largest(budget, limit=9) == searched, f"budget {budget:,}: solved {peaks.largest(budget, 9)}, " \
                                                           f"searched {searched}"


def plan_row(cfg, world, budget, n=6, batch=None, whole_loss=False):
    """The plan's one row for cfg's precision, ckpt, shard and attn (and the whole loss, LOSS_CHUNKS=1) on CPU
    against `budget` bytes, n sequences per rank per step."""
    fixed = {k: getattr(cfg, k) for k in ("precision", "ckpt", "shard", "attn")} | ({"loss_chunks": 1} if whole_loss else {})
    rows = lp.plan(cfg, gpus.GPU("budget", budget, 0, None, "the test"), world, n * world * cfg.block_size, fixed,
                   context=0, batch=batch)
    assert len(rows) == 1, rows
    return rows[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
def test_planned_micro_batch_fits_and_the_next_does_not_as_measured(precision, ckpt):
    # a budget where 3 sequences fit (K = 2 of 6): the planned micro-batch measured at or under it, one more over
    cfg = Config(**TINY, precision=precision, ckpt=ckpt)
    budget = lp.Peaks(cfg, 1, 2).at(3)[0]
    row = plan_row(cfg, 1, budget)
    assert (row.b, row.accum) == (3, 2) and row.why is None, f"planned b={row.b} K={row.accum} ({row.why})"
    model, parts = train.build(replace(cfg, batch_size=row.b), torch.device("cpu"))
    accumulate.accumulation_step(model, parts, [measure.random_batch(cfg, "cpu", row.b)])  # the optimizer states
    fits, over = (measure.measure(model, parts, measure.random_batch(cfg, "cpu", b), "cpu",
                                  micro_steps=row.accum)["peak"] for b in (row.b, row.b + 1))
    assert fits == row.peak == row.reserved <= budget < over, \
        f"{precision} {ckpt}: planned b={row.b} peaks at {row.peak:,} bytes, measured {fits:,}; b={row.b + 1} " \
        f"measured {over:,}; budget {budget:,}"


def test_traced_in_parallel_as_in_one_process():
    """trace.rounds: the plan's rows are the same whether its traces are made in forked processes or here, and
    nothing is left noted after it; its progress hears of every trace the workers make, as they come."""
    rows, heard = {}, []
    for workers, seed in ((2, 13), (1, 14)):  # (a seed each: nothing cached, the same shapes)
        cfg = Config(**TINY, seed=seed)
        made = kept.COUNTS["traced"]
        rows[workers] = [astuple(r) for r in lp.plan(cfg, gpus.find_gpu("1GiB"), 2, 6 * 2 * cfg.block_size,
                                                     dict(precision="bf16", attn="manual", ckpt="none"),
                                                     workers=workers, progress=lambda *now: heard.append(now))]
        if workers == 2:
            made = kept.COUNTS["traced"] - made
            assert heard == [(done, heard[done - 1][1]) for done in range(1, made + 1)] and \
                heard[-1][1] == made and all(a[1] <= b[1] for a, b in zip(heard, heard[1:])), \
                f"{made} traces made in the workers; the progress heard (done, asked so far): {heard}"
    assert rows[2] == rows[1], "\n".join(f"forked {a}\nhere   {b}" for a, b in zip(rows[2], rows[1]) if a != b)
    assert not trace._ASKED, "rounds left a list of missing traces behind"


def test_states_over_the_budget_stop_a_row_before_its_step_is_traced(monkeypatch):
    """What a rank holds all step, traced in its optimizer step alone, over the budget: the row says so, and
    none of its forward and backward is traced (no activation can make it fit)."""
    cfg = Config(**TINY, precision="bf16", ckpt="none", seed=11)  # (a seed of its own: no trace cached)
    held = lp.optimizer_steps(cfg, 1)[0]["held"][0]
    steps, real = [], trace.KINDS["step"]
    monkeypatch.setitem(trace.KINDS, "step", lambda c, *a: steps.append(c) or real(c, *a))
    row = plan_row(cfg, 1, held - 1)
    assert row.why == f"its states alone, held all step (buffers aside), are {held / 2 ** 30:.1f} GiB" and \
        row.states == held, \
        f"a budget of {held - 1:,} bytes under the states' {held:,}: {row.why}"
    assert not steps, f"its step was traced {len(steps)} times, though nothing could fit"


def test_a_planned_trace_counts_every_flop_of_the_step():
    """The FLOPs behind a row's step time (FP8's GEMMs at FP8's rate, the rest at BF16's), counted in the trace's
    census, against flops.per_token's own count of model.py: the same, the FP8 GEMMs (a GPU's) among them."""
    cfg = Config(**TINY, precision="fp8", batch_size=2)
    for device in ("cpu", "cuda"):
        traced = trace.step(replace(cfg, device=device), 1, 0, 1, True)
        model_flops = int(flops.per_token(cfg)[0]) * cfg.batch_size * cfg.block_size
        assert traced["flops"] == model_flops, f"{device}: the trace counts {traced['flops']:,} FLOPs, " \
                                               f"flops.per_token {model_flops:,}"
        assert (traced["fp8_flops"] > 0) == (device == "cuda"), f"{device}: {traced['fp8_flops']:,} FP8 FLOPs"


def test_fsdp_recompute_is_what_fsdp_runs():
    """Under FSDP a unit's re-run does not stop early (checkpoint.rerun_stops_early): the plan's recompute share
    is FSDP's own traced FLOPs, more than ZeRO's, which runs the unsharded step's."""
    cfg = Config(**TINY, precision="bf16", ckpt="full")
    budget = lp.Peaks(replace(cfg, shard="fsdp"), 2, 2).at(3)[0] * 4
    fsdp_row, zero_row = (plan_row(replace(cfg, shard=shard), 2, budget) for shard in ("fsdp", "zero1"))
    assert fsdp_row.recompute > zero_row.recompute > 0, \
        f"full recompute: FSDP's {fsdp_row.recompute:+.1%} of the model's FLOPs, ZeRO-1's {zero_row.recompute:+.1%}"


def test_the_loss_goes_in_pieces_where_it_does_not_fit_whole():
    """A vocabulary whose logits outweigh the rest: whole, b=1 does not fit; in 4 pieces it does, measured."""
    cfg = Config(**{**TINY, "vocab_size": 8192}, precision="bf16", ckpt="none")
    budget = lp.Peaks(replace(cfg, loss_chunks=4), 1, 1, (1,)).at(1)[0]
    assert lp.Peaks(cfg, 1, 1, (1,)).at(1)[0] > budget, "the whole loss fits too: no question asked"
    row = plan_row(cfg, 1, budget, n=1)
    assert (row.loss_chunks, row.b, row.why) == (4, 1, None), f"planned {row.loss_chunks} pieces, b={row.b} ({row.why})"
    assert "LOSS_CHUNKS=4" in tool.command(cfg, row, 1)
    model, parts = train.build(replace(cfg, batch_size=1, loss_chunks=4), torch.device("cpu"))
    accumulate.accumulation_step(model, parts, [measure.random_batch(cfg, "cpu", 1)])  # the optimizer states
    measured = measure.measure(model, parts, measure.random_batch(cfg, "cpu", 1), "cpu")["peak"]
    assert measured == row.peak <= budget, f"in 4 pieces the plan says {row.peak:,} bytes, measured {measured:,}"


def test_batch_size_is_asked_not_lowered():
    # BATCH_SIZE=b: does this micro-batch fit? The row keeps b, or says it does not fit; never another b
    cfg = Config(**TINY, precision="bf16", ckpt="none")
    budget = lp.Peaks(cfg, 1, 2).at(3)[0]
    fits, over = plan_row(cfg, 1, budget, batch=2), plan_row(cfg, 1, budget, batch=6, whole_loss=True)
    assert (fits.b, fits.accum, fits.why) == (2, 3, None)
    assert over.b == 0 and over.why.startswith("b=6 peaks at"), over.why
    # the loss in pieces (vocabulary 256 against width 32: the loss is most of this step) makes b=6 fit, still b=6
    in_pieces = plan_row(cfg, 1, budget, batch=6)
    assert (in_pieces.b, in_pieces.loss_chunks, in_pieces.why) == (6, 64, None), \
        f"BATCH_SIZE=6, the loss in pieces: b={in_pieces.b}, {in_pieces.loss_chunks} pieces ({in_pieces.why})"
    model, parts = train.build(replace(cfg, batch_size=6, loss_chunks=64), torch.device("cpu"))
    accumulate.accumulation_step(model, parts, [measure.random_batch(cfg, "cpu", 6)])  # the optimizer states
    measured = measure.measure(model, parts, measure.random_batch(cfg, "cpu", 6), "cpu")["peak"]
    assert measured == in_pieces.peak <= budget, f"b=6 in 64 pieces: planned {in_pieces.peak:,}, measured {measured:,}"
    assert plan_row(cfg, 1, budget, batch=4).why.startswith("BATCH_SIZE=4 does not divide the 6 sequences")


def test_zero2_over_two_gloo_ranks_as_measured(tmp_path):
    # the same on 2 ranks, measured by the ledger's own sharded runs (tools/ledger_ranks.measure_shard): where
    # the peak is the forward's or the backward's (gloo's asynchronous collectives move the optimizer step's)
    cfg = Config(**TINY, precision="bf16", shard="zero2")
    budget = lp.Peaks(cfg, 2, 2).at(3)[0]
    row = plan_row(cfg, 2, budget)
    assert (row.b, row.accum) == (3, 2), f"planned b={row.b} K={row.accum}"
    assert not row.where.startswith("step"), f"the peak falls in the optimizer step ({row.where})"
    out = tmp_path / "sharded.json"
    r = torchrun([ROOT / "tests" / "plan_worker.py", out, json.dumps([dict(batch_size=b, accum=2)
                                                                      for b in (row.b, row.b + 1)]), *cli.flags(cfg)])
    assert r.returncode == 0, r.stderr[-2000:]
    fits, over = json.loads(out.read_text())
    fits_peak, over_peak = max(peak for peak, _ in fits), max(peak for peak, _ in over)
    assert fits_peak == row.peak <= budget < over_peak, f"zero2 over 2 ranks: planned b={row.b} peaks at " \
        f"{row.peak:,} bytes, measured {fits_peak:,}; b={row.b + 1} measured {over_peak:,}"
    assert {sent for _, sent in fits} == {row.sent}, f"a step sent {fits} (peak, bytes) per rank, the plan " \
                                                     f"says {row.sent:,}"


def test_one_trace_serves_every_sharding_and_rank(monkeypatch):
    # the plan's cost: per precision, ckpt and attn two small traces (one a depth) shared by DDP, ZeRO-1/2 and all 4
    # ranks, two more under FSDP; each kind of ZeRO rank's optimizer step once, whatever the policy
    steps, optimizers = [], []
    real_step, real_optimizer = trace.KINDS["step"], trace.KINDS["optimizer step"]
    monkeypatch.setitem(trace.KINDS, "step", lambda cfg, *a: steps.append(cfg.shard) or real_step(cfg, *a))
    monkeypatch.setitem(trace.KINDS, "optimizer step", lambda cfg, *a: optimizers.append(cfg.shard) or
                        real_optimizer(cfg, *a))
    cfg = Config(n_layer=6, n_embd=64, n_head=2, block_size=32, device="cuda")
    policies = ("none", "selective")
    rows = [row for ckpt in policies for row in
            lp.plan(cfg, gpus.find_gpu("24GiB"), 4, 16 * 4 * 32, dict(precision="bf16", attn="manual", ckpt=ckpt))]
    assert len(rows) == 2 * 4 and all(r.why is None and r.b > 1 for r in rows), [(r.shard, r.why) for r in rows]
    # a trace a depth (at marker(cfg) sequences: every micro-batch), one where the model is traced at its own depth
    # (no deeper than the two) (FSDP's one micro-step is traced apart from its two: where a row takes K = 1, twice)
    once = {r.ckpt: r.accum == 1 for r in rows if r.shard == "fsdp"}
    traces = {shard: sum(len(set(lp.Extended.depths_of(replace(cfg, ckpt=ckpt, shard=shard))[1]))
                         * (1 + (shard == "fsdp" and once[ckpt])) for ckpt in policies) for shard in ("none", "fsdp")}
    assert steps.count("none") == traces["none"] and steps.count("fsdp") == traces["fsdp"], (traces, steps)
    kinds = len(lp.differing_ranks(replace(cfg, shard="zero1"), 4))
    assert sorted(optimizers) == sorted(["none"] + ["zero1"] * kinds + ["zero2"] * kinds), optimizers


def test_the_gpu_table_and_sizes():
    h100 = gpus.find_gpu("h100")
    assert h100.total == int(79.11 * 2 ** 30) and h100.total + h100.driver == 81559 * 2 ** 20
    assert gpus.find_gpu("24GiB").total == 24 * 2 ** 30 and gpus.find_gpu("80GB").total == 80 * 10 ** 9
    assert gpus.find_gpu("A100-40GB").tflops["fp8"] is None  # no FP8 units: its fp8 rows do not run
    assert gpus.find_gpu("V100-16GB").tflops["bf16"] is None and gpus.find_gpu("A10G").tflops is None  # none published
    for name in gpus.GPUS:
        gpu = gpus.find_gpu(name)
        assert 15 * 2 ** 30 < gpu.total < 200 * 2 ** 30 and gpu.source, name
    for near in ("H10", "RTX 3080", "A100", "MI250X"):  # a name not in the table is refused, never another's
        with pytest.raises(Exception, match="is no GPU of the table"):
            gpus.find_gpu(near)


def test_the_command_prints_the_table_the_best_line_and_the_picture(tmp_path, capsys):
    # the best row is the table's first, and the make line printed under it runs exactly that row
    out_dir = tmp_path / "out"
    argv = ["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=32", "--nproc=2", "--gpu=1GiB",
            "--precision=bf16", "--total_batch_tokens=1048576"]
    status = tool.main(argv + [f"--out_dir={out_dir}"])
    text = capsys.readouterr().out
    assert status == 0 and "configurations fit, least recompute first" in text and "does not fit or run" in text
    lines = text.splitlines()
    head = lines[next(i for i, line in enumerate(lines) if line.startswith("precision "))]
    assert all(word in head for word in ("allocated", "reserved", "nvidia-smi")), head
    first = lines[lines.index(head) + 1].split()
    best = next(line.strip() for line in lines if line.strip().startswith("make ddp NPROC=2 "))
    flags = [f"--{word.split('=')[0].lower()}={word.split('=')[1]}" for word in best.split()[3:]]
    cfg = cli.parse_args(flags)  # a run train.py accepts
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size) == (2, 64, 2, 32)
    ran = [cfg.precision, cfg.ckpt, cfg.shard, cfg.attn, str(cfg.loss_chunks), str(cfg.batch_size), str(cfg.accum)]
    assert ran == first[:7], f"the table's best row {first[:7]}, the command runs {flags}"
    assert cfg.accum > 1 and cfg.batch_size * cfg.accum * 2 * cfg.block_size == 2 ** 20  # the target, on 2 GPUs
    assert (out_dir / "plan.svg").read_text().startswith("<svg")


@pytest.mark.parametrize("argv, says", [
    (["--gpu=H10"], "the nearest names: H100"),
    (["--gpu=300MiB"], "not more than the CUDA context"),
    (["--nproc=0"], "--nproc must be >= 1"),
    (["--nproc=100000"], "--nproc must be <= 16384"),
    (["--gpu=9000000000GiB"], "a GPU of at most 1,048,576 GiB"),
    (["--gpu=1" + "0" * 400 + "GiB"], "a GPU of at most 1,048,576 GiB"),
    (["--gpu=-5GiB"], "a size is a positive number and GiB, GB, MiB or MB"),
    (["--gpu=24G"], "a size is a positive number and GiB, GB, MiB or MB"),
    (["--n_embd=100", "--n_head=3"], "n_head=3 does not divide n_embd=100"),
    (["--batch_size=3"], f"--batch_size=3 does not divide the {lp.TARGET_TOKENS // Config().block_size} "
                         f"sequences"),
    (["--max_iters=4"], "does not apply"),
    (["--loss_chunks=7"], "--loss_chunks=7 does not divide block_size=256"),
    (["--loss_chunks=100", "--block_size=32"], "--loss_chunks=100 does not divide block_size=32"),
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
    rule = dict(peak=5, ruled_peak=5, activations=3, ruled_activations=3)
    figures = dict(device="NVIDIA H200", cuda_total=150 * 2 ** 30, free=149 * 2 ** 30, context=2 ** 29,
                   workspace=2 ** 25, smi_total=151 * 2 ** 30, driver=2 ** 30, emulated=10 * 2 ** 30,
                   cap=19 * 2 ** 29, bound=2 ** 28, b=4, predicted=9 * 2 ** 30, predicted_next=11 * 2 ** 30,
                   precision="bf16", ckpt="none", attn="manual", allocated=9 * 2 ** 30 + 2 ** 25,
                   reserved=9 * 2 ** 30 + 2 ** 26, next_fits=False, next_allocated=None, ok=True,
                   rules=dict(fp32=rule, bf16=rule, fp8=rule, same=True))
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "plan_check.json").write_text(json.dumps(figures))
    text = "\n".join(plan_steps[0].figures())
    assert "the CUDA context 512 MiB" in text and "slack 32 MiB (bound 256 MiB)" in text and \
        "micro-batch 5 (predicted 11,811,160,064): out of memory, as planned" in text and ": the same" in text, text


@pytest.mark.parametrize("shard", ["zero1", "zero2"])
def test_one_rank_of_each_kind_is_traced_for_all(shard):
    """Ranks whose slices cut the same pieces trace alike (lp.differing_ranks): the peak and the largest
    micro-batch over them are those over every rank."""
    cfg, world = Config(n_layer=2, n_embd=64, n_head=2, block_size=32, shard=shard, seed=3, device="cpu"), 12
    kinds = lp.Peaks(cfg, world)
    every = lp.Peaks(cfg, world)
    every.ranks = list(range(world))
    every.steps = dict(enumerate(trace.all_of([("optimizer step", trace.optimizer_config(cfg), world, rank)
                                               for rank in every.ranks])))
    every.lines = every._lines()
    assert len(kinds.ranks) < world, f"every one of the {world} ranks is a kind of its own: {kinds.ranks}"
    for b in (2, 5):
        assert kinds.at(b)[0] == every.at(b)[0], f"b={b}: peak {kinds.at(b)} over the kinds, {every.at(b)} over all"
    budget = kinds.at(4)[0]
    assert kinds.largest(budget) == every.largest(budget)


def test_a_second_question_reads_the_kept_traces_and_an_edit_of_model_py_makes_new_ones(tmp_path, monkeypatch, capsys):
    # make plan keeps its traces on disk: asked again (another GPU, a new process: the memo empty) it traces nothing
    # and answers alike; an edit of model.py's text names new files; a file that cannot be read is traced again
    argv = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--precision=bf16", "--attn=sdpa",
            f"--out_dir={tmp_path / 'out'}", f"--trace_cache={tmp_path / 'traces'}"]

    def asked(*more):
        monkeypatch.setattr(trace, "_TRACED", {})
        assert tool.main(argv + list(more)) in (0, 1)
        text = capsys.readouterr().out
        made, read = re.search(r"(\d+) traces made, (\d+) read from ", text).groups()
        return int(made), int(read), [line for line in text.splitlines() if line.startswith("bf16 ")]
    made, read, rows = asked("--gpu=1GiB")
    files = sorted((tmp_path / "traces").rglob("*.marshal"))
    assert made == len(files) > 0 and read == 0, (made, read, files)
    assert asked("--gpu=1GiB") == (0, made, rows), "asked again, the plan traced anew or answered otherwise"
    assert asked("--gpu=2GiB")[:2] == (0, made), "another GPU's size needs no trace of its own"
    files[0].write_bytes(b"not a trace")
    assert asked("--gpu=1GiB") == (1, made - 1, rows), "a kept file that cannot be read is not traced again"
    # an edit of model.py (a comment will do): its text is part of every name
    copy = tmp_path / "project"
    for source in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py")]:
        (copy / source.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (copy / source.relative_to(ROOT)).write_bytes(source.read_bytes())
    (copy / "model.py").write_text((copy / "model.py").read_text() + "# a learner's note\n")
    monkeypatch.setattr(kept, "ROOT", copy)
    monkeypatch.setattr(kept, "_CODE", [])
    assert asked("--gpu=1GiB") == (made, 0, rows), "model.py edited, the kept traces were read as they were"
    # a new version keeps the VERSIONS newest versions' folders, and nothing else of the folder goes
    versions = sorted((tmp_path / "traces").iterdir())
    assert len(versions) == 2, versions
    (tmp_path / "traces" / "notes").mkdir()
    for i in range(kept.VERSIONS):
        (tmp_path / "traces" / f"{i:016x}").mkdir()
        os.utime(tmp_path / "traces" / f"{i:016x}", (i, i))  # older than the two above
    (copy / "model.py").write_text((copy / "model.py").read_text() + "# another\n")
    monkeypatch.setattr(kept, "_CODE", [])
    asked("--gpu=1GiB")
    left = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert left == sorted(["notes", kept._CODE[0], *(p.name for p in versions), f"{kept.VERSIONS - 1:016x}"]), left
    (tmp_path / "a file").write_text("")
    assert tool.main(argv[:-1] + [f"--trace_cache={tmp_path / 'a file'}"]) == 2
    assert capsys.readouterr().err.startswith("error: --trace_cache=")


def below_its_neighbour(more, fewer):
    """Whether `more` is `fewer` with points added, each below the point before it (so never the highest)."""
    matched, last = 0, None
    for point in more:
        if matched < len(fewer) and point == fewer[matched]:
            matched, last = matched + 1, point
        elif last is None or point[0] >= last[0]:
            return False
    return matched == len(fewer)


@pytest.mark.parametrize("precision,fp32_grad_accum",
                         [("fp32", False), ("bf16", True), ("fp16", False), ("fp8", False)])
def test_a_gpus_optimizer_step_on_the_meta_device_is_its_fake_step(precision, fp32_grad_accum):
    # the meta device stands in for fake tensors in a GPU's optimizer step: every figure alike, and its timeline
    # the same but for what the code makes on the CPU by name (a constant's copy), which a GPU's memory never holds
    cfg = Config(n_layer=3, n_embd=64, n_head=2, block_size=32, vocab_size=256, device="cuda", precision=precision,
                 fp32_grad_accum=fp32_grad_accum)
    for shard, world in (("none", 1), ("zero1", 3), ("zero2", 3)):
        for rank in range(world):
            at = trace.optimizer_config(replace(cfg, shard=shard))
            fake, meta = trace._optimizer_step(at, world, rank, meta=False), trace._optimizer_step(at, world, rank)
            differ = [name for name in fake if name != "points" and fake[name] != meta[name]]
            assert not differ, f"{precision} {shard} rank {rank}: " + "; ".join(
                f"{name} fake {fake[name]}, meta {meta[name]}" for name in differ)
            assert below_its_neighbour(fake["points"], meta["points"]), \
                f"{precision} {shard} rank {rank}: the meta step's timeline is not the fake one's, less low points"
