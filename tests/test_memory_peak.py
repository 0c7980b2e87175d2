"""The step's peak and its timeline, traced (ledger/trace.py) against measured (ledger/measure.py): the live
bytes at the start of every phase, where the peak falls, and the timeline the planner reads."""
from dataclasses import replace

import pytest
import torch

from conftest import merged
from guards.cli import parse_args
from ledger import trace
from tools import ledger as tool

TINY = ["--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2", "--seed=3"]
CASES = [["--precision=bf16"], ["--precision=bf16", "--ckpt=full", "--dropout=0.1"], ["--precision=fp32", "--ckpt=sqrt"],
         ["--precision=fp16", "--ckpt=selective"], ["--precision=fp8"], ["--precision=fp8", "--fp8_grad=e5m2",
                                                                         "--ckpt=full"],
         ["--precision=bf16", "--accum=2"], ["--precision=bf16", "--fp32_grad_accum", "--accum=2"]]


@pytest.mark.parametrize("argv", CASES, ids=lambda a: "-".join(x.partition("=")[2] for x in a))
def test_every_phase_starts_with_the_measured_bytes(argv):
    """The live bytes as the step begins, as each micro-step's forward, the backward, the gradients and the
    optimizer's step begin, and at its end, traced as measured; the peak and the phase it falls in too."""
    cfg = replace(parse_args(merged(*TINY, *argv)), device="cpu")
    micro_steps = cfg.accum
    model, parts = tool.train.build(cfg, torch.device("cpu"))
    batch = tool.measure.random_batch(cfg, "cpu")
    tool.accumulate.accumulation_step(model, parts, [batch])
    measured = tool.measure.measure(model, parts, batch, "cpu", micro_steps)
    traced = trace.step(cfg, micro_steps=micro_steps)
    differ = {k: (traced["phase"].get(k), v) for k, v in measured["phase"].items() if traced["phase"].get(k) != v}
    assert not differ, f"{' '.join(argv)}: the live bytes at each phase's start (traced, measured): {differ}"
    assert (traced["peak"], traced["peak_phase"]) == (measured["peak"], measured["peak_phase"]), \
        f"{' '.join(argv)}: peak traced {traced['peak']:,} in {traced['peak_phase']}, measured " \
        f"{measured['peak']:,} in {measured['peak_phase']}"


def test_selective_peaks_in_backward():
    """Selective recompute's peak is in backward (the re-run core's softmax with the gradients), not in the
    forward, which keeps no s x s tensor."""
    cfg = replace(parse_args(merged(*TINY, "--precision=bf16", "--ckpt=selective", "--block_size=128")), device="cpu")
    assert trace.step(cfg)["peak_phase"] == "backward", trace.step(cfg)["peak_phase"]


@pytest.mark.parametrize("argv", [["--precision=bf16"], ["--precision=fp8", "--ckpt=full"], ["--shard=fsdp"]])
def test_the_planners_timeline_holds_the_peak(argv):
    """The planner's trace (its timeline: each allocation, where it happened) reaches the step's peak at one of
    its points, up to where the optimizer's step begins (FSDP's whole)."""
    cfg = replace(parse_args(merged(*TINY, *argv)), device="cpu")
    world = 2 if cfg.shard == "fsdp" else 1
    whole, planned = trace.step(cfg, world), trace.step(cfg, world, planned=True)
    highest = max(n for _, _, n, *_ in planned["points"])
    if cfg.shard == "fsdp" or whole["peak_phase"] != "step":
        assert highest == whole["peak"], f"the timeline's highest point {highest:,}, the peak {whole['peak']:,}"
    assert all(phase != "step" for (_, phase, _), *_ in planned["points"]) or cfg.shard == "fsdp"
    assert planned["flops"] > 0 and planned["peak"] <= whole["peak"]
