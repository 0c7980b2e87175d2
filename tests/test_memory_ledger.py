"""The memory ledger: model.py's step traced on fake tensors (ledger/trace.py) against the same step run
and measured, exact on CPU; every saved tensor put under a term of the chapter's formulas by the op and
module that saved it; MemTracker as an independent counter; what a learner's change reads like."""
import contextlib
import functools
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

import accumulate
import fp8
import memory_ledger as ml
import model
import precision
import train
from config import Config
from conftest import merged
from guards.cli import parse_args
from ledger import cuda_rules, measure, papers, trace
from ledger.loss import loss_at_most
from tools import ledger as tool

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--seed=3"]


def ledger(argv, device="cpu"):
    cfg = replace(parse_args(merged(*TINY, *argv)), device=device)
    meas = tool.run_config(cfg, torch.device(device))
    traced = trace.step(cfg)
    rows, ok = tool.compare(cfg, traced, meas)
    return cfg, {r[0]: r for r in rows}, ok, meas, traced


def combinations():
    """precision x ckpt x attn x dropout (bias off in a few); selective recomputes the manual core only. fp8
    both ways: fp8.py's layer alone, and with both refinements, HYBRID's E5M2 backward and the FP8 weight
    kept per step (fp8-e5m2-true in the ids)."""
    for prec, ckpt, attn, drop in itertools.product(("fp32", "bf16", "fp16", "fp8", "fp8e5m2"),
                                                    ("none", "full", "sqrt", "selective"), ("manual", "sdpa"),
                                                    ("0.0", "0.1")):
        if not (ckpt == "selective" and attn == "sdpa"):
            precision = ["--precision=fp8", "--fp8_grad=e5m2", "--fp8_keep_weight=true"] if prec == "fp8e5m2" \
                else [f"--precision={prec}"]
            bias = "false" if (prec, ckpt) in (("bf16", "sqrt"), ("fp32", "selective"), ("fp8", "full")) else "true"
            yield precision + [f"--ckpt={ckpt}", f"--attn={attn}", f"--dropout={drop}", f"--bias={bias}"]


@pytest.mark.parametrize("argv", list(combinations()), ids=lambda a: "-".join(x.partition("=")[2] for x in a))
def test_every_component_and_the_peak_traced_as_measured(argv):
    # the 'fp8' in an id lets conftest skip those where torch._scaled_mm cannot run on this CPU
    cfg, rows, ok, meas, _ = ledger(argv)
    assert ok, tool.failure(cfg, rows.values())


@pytest.mark.parametrize("shape", [dict(n_layer=1, n_embd=16, n_head=1, block_size=8, batch_size=1),
                                   dict(n_layer=3, n_embd=96, n_head=3, block_size=48, batch_size=5),
                                   dict(n_layer=4, n_embd=256, n_head=4, block_size=256, batch_size=8)])
def test_traced_is_measured_at_three_shapes(shape):
    """The issue's three shapes: the last is make train's default."""
    cfg, rows, ok, meas, _ = ledger([f"--{k}={v}" for k, v in shape.items()] + ["--precision=bf16"])
    assert ok, tool.failure(cfg, rows.values())


def one_sequence():
    """b = 1, where reshaping (1, a, T, d) to (a, T, d) is a view: no Q, K, V copies."""
    for prec, ckpt, attn, drop in itertools.product(("fp32", "bf16", "fp8"), ("none", "full", "selective"),
                                                    ("manual", "sdpa"), ("0.0", "0.1")):
        if not (ckpt == "selective" and attn == "sdpa"):
            yield [f"--precision={prec}", f"--ckpt={ckpt}", f"--attn={attn}", f"--dropout={drop}"]


@pytest.mark.parametrize("argv", list(one_sequence()), ids=lambda a: "-".join(x.partition("=")[2] for x in a))
def test_every_component_exact_for_one_sequence(argv):
    cfg, rows, ok, meas, _ = ledger(argv + ["--batch_size=1", "--block_size=32"])
    assert ok, tool.failure(cfg, rows.values())


@pytest.mark.parametrize("argv", [["--fp32_grad_accum", "--precision=bf16"], ["--ckpt=sqrt", "--ckpt_segment=1"],
                                  ["--ckpt=sqrt", "--n_layer=5"], ["--precision=fp16", "--loss_scale=1024"],
                                  ["--fp32_grad_accum", "--precision=fp8", "--fp8_grad=e5m2"],
                                  ["--precision=fp8", "--fp8_recipe=current", "--ckpt=sqrt"],
                                  ["--precision=fp8", "--fp8_keep_weight=true", "--ckpt=sqrt"],
                                  ["--precision=fp8", "--fp8_grad=e5m2", "--ckpt=full"],
                                  ["--ckpt=full", "--ckpt_impl=naive"], ["--ckpt=sqrt", "--ckpt_impl=naive"],
                                  # 24 tokens: HYBRID's weight gradient dequantizes (FP8 GEMMs want multiples of 16)
                                  ["--precision=fp8", "--fp8_grad=e5m2", "--batch_size=1", "--block_size=24"],
                                  # the loss in pieces, 5 of 32 rows (uneven) and one row each
                                  ["--loss_chunks=5", "--precision=fp32", "--ckpt=selective"],
                                  ["--loss_chunks=32", "--precision=fp8", "--ckpt=full", "--accum=2"],
                                  ["--loss_chunks=4", "--precision=fp16", "--ckpt=sqrt", "--dropout=0.1"]])
def test_variants_exact(argv):
    cfg, rows, ok, meas, _ = ledger(argv)
    assert ok, tool.failure(cfg, rows.values())


def test_cpu_comparison_has_no_tolerance():
    """On CPU both sides count storages: one byte off in any component, or in the peak, is a miss."""
    cfg, _, ok, meas, traced = ledger(["--precision=bf16"])
    assert ok
    for component in ("activations", "peak"):
        rows, ok = tool.compare(cfg, dict(traced, **{component: traced[component] + 1}), meas)
        assert not ok and [r[0] for r in rows if not r[3]] == [component]
        assert f"{component}: traced" in tool.failure(cfg, rows)


# ---------------------------------------------------------------- every byte under a term of the formula

def test_the_default_models_bytes_are_the_papers_terms():
    """Korthikanti's per-layer terms hold to the byte for what they count (the Linears' inputs, q, k and v,
    the softmax output, the GELU's input), the norms' 16-bit inputs are there with LayerNorm's statistics
    beside them, the head keeps its input and FP32 log-softmax, and what no term has is wpe's positions."""
    cfg = Config(device="cpu", n_layer=3, n_embd=64, n_head=2, block_size=32, batch_size=2, precision="bf16")
    traced = trace.step(cfg)
    terms, unmatched = ml.account(traced["saved_tensors"], traced["kinds"])
    closed = ml.closed_terms(cfg)
    got = {term: sum(s.nbytes for s in tensors) for term, tensors in terms.items()}
    for term in ("linears", "qkv", "softmax", "activation", "masks", "units"):
        assert got[term] == closed[term], f"{term}: traced {got[term]:,} bytes, the formula {closed[term]:,}"
    b, s = cfg.batch_size, cfg.block_size
    assert got["norms"] - closed["norms"] == (2 * cfg.n_layer + 1) * 2 * b * s * 2  # mean and rstd, bf16 on CPU
    assert got["head"] - closed["head"] == 4  # NLL's total weight
    found = [({node for node, *_ in s.inputs}, s.nbytes) for s in unmatched]
    assert found == [({"EmbeddingBackward0"}, 8 * s)], f"not in the formulas: {found}, not wpe's positions alone"
    differences = {term: lines for term, _, _, lines in ml.differences(cfg, terms, unmatched)}
    assert any("result1" in line and line.startswith("not as the formula counts it") for line in differences["norms"])


def test_terms_are_told_by_op_and_module_not_by_size():
    """Under sdpa the fused kernel keeps q, k and v and its statistics: no s x s term; under selective the
    core's unit keeps its inputs (q, k, v); under full recompute only the units' inputs; FP8's Linears keep
    their inputs at one byte, named so."""
    def got(**over):
        cfg = Config(device="cpu", n_layer=2, n_embd=64, n_head=2, block_size=32, batch_size=2,
                     **{"precision": "bf16", **over})  # auto would be fp32 on a CPU without BF16
        traced = trace.step(cfg)
        terms, _ = ml.account(traced["saved_tensors"], traced["kinds"])
        return cfg, {term: sum(s.nbytes for s in tensors) for term, tensors in terms.items()}, terms
    cfg, sdpa, _ = got(attn="sdpa")
    assert sdpa["qkv"] == ml.closed_terms(cfg)["qkv"] and sdpa["softmax"] == 2 * (2 * 2 * 32 * 4)  # FP32 logsumexp
    cfg, selective, _ = got(ckpt="selective")
    assert selective["qkv"] == ml.closed_terms(cfg)["qkv"] and selective["softmax"] == 0
    cfg, full, _ = got(ckpt="full")
    assert full["units"] == 2 * 2 * 32 * 64 * 2 and full["linears"] == full["qkv"] == 0
    cfg, fp8, terms = got(precision="fp8")
    assert fp8["linears"] * 2 == ml.closed_terms(cfg)["linears"]
    assert all(s.dtype == "float8_e4m3fn" for s in terms["linears"])


class Gated(nn.Module):
    """A learner's change around whatever norm the block has: its output times its own sigmoid."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        return y * torch.sigmoid(y)


def swapped(monkeypatch, change):
    """Change model.py's block at test time, as a learner would: "gate" wraps ln_1 (more saved), "no
    activation" takes the MLP's activation out (less saved)."""
    if change == "gate":
        real = model.Block.__init__

        def init(self, cfg, linear_factory):
            real(self, cfg, linear_factory)
            self.ln_1 = Gated(self.ln_1)
        monkeypatch.setattr(model.Block, "__init__", init)
    elif change == "no activation":
        monkeypatch.setattr(model.MLP, "forward", lambda self, x: functools.reduce(lambda y, m: m(y), self.children(),
                                                                                    x))


@pytest.mark.parametrize("change", ["gate", "no activation"])
def test_a_change_to_model_py_is_exact_and_named(monkeypatch, change):
    """model.py changed, nothing else: traced and measured agree to the byte, and the closed forms say
    what the change keeps beyond or below them: the gate's sigmoid and product, or no GELU input."""
    swapped(monkeypatch, change)
    cfg, rows, ok, meas, traced = ledger(["--precision=bf16"])
    assert ok, tool.failure(cfg, rows.values())
    terms, unmatched = ml.account(traced["saved_tensors"], traced["kinds"])
    said = {term: lines for term, _, _, lines in ml.differences(cfg, terms, unmatched)}
    if change == "gate":
        assert any("h.*.ln_1 " in line and "SigmoidBackward0" in line for line in said["activation"]), said
    else:
        assert "activation" in said and said["activation"][0].startswith("as the formula counts them, 0 bytes"), said


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--fp8_grad=e5m2", "--ckpt=full",
                                                     "--fp8_keep_weight=true"],
                                  ["--precision=bf16", "--ckpt=sqrt"], ["--precision=fp32", "--attn=sdpa"]])
def test_activations_are_saved_bytes_and_the_forward_leaves_nothing_else(argv):
    """The activations are the storages saved for backward (SavedBytes), less the FP8 weight copies the
    forward kept: those are fp8_kept's, counted once. What the forward leaves alive is exactly those, the
    kept copies and the loss (and the loss times its weight): LiveTensors' growth over the forward."""
    cfg, rows, ok, meas, _ = ledger(argv)
    assert ok, tool.failure(cfg, rows.values())
    kept = ledger([a for a in argv if "e5m2" not in a])[3]["fp8_kept"]  # HYBRID's twins come in backward
    assert meas["forward_growth"] == sum(meas["forward_storages"]) == meas["activations"] + kept + 4 + 4


def test_allocator_bounds_follow_the_caching_allocators_rules():
    """c10/cuda/CUDACachingAllocator.cpp: every request rounded up to 512 bytes; up to 1 MiB from the
    small pool, split to the rounded size; past it a cached block up to 1 MiB larger may serve it whole."""
    one_mib = 2 ** 20
    assert measure.allocator_bounds([4]) == (512, 512)  # the loss's 4 bytes hold a 512-byte block
    assert measure.allocator_bounds([512, 513]) == (512 + 1024, 512 + 1024)
    assert measure.allocator_bounds([one_mib]) == (one_mib, one_mib)  # the small pool's largest
    assert measure.allocator_bounds([one_mib + 1]) == (one_mib + 512, 2 * one_mib + 512)
    assert measure.allocator_bounds([0]) == (0, 0)


def test_batch_of_one_row_has_two_storages():
    """For b = 1, x and y must not be views of one (s+1)-token storage."""
    cfg = parse_args(merged(*TINY, "--batch_size=1"))
    x, y = measure.random_batch(cfg, "cpu")
    assert measure.storage_key(x) != measure.storage_key(y)
    cfg, rows, ok, meas, _ = ledger(["--batch_size=1"])
    assert rows["inputs"][2] == rows["inputs"][1] == 2 * cfg.block_size * 8
    assert ok, tool.failure(cfg, rows.values())


def test_saved_views_of_buffers_and_the_batch_are_not_activations():
    # the same forward with the buffers' and the batch's storages NOT excluded: they show up
    cfg = parse_args(TINY + ["--precision=fp32"])
    gpt, _ = train.build(cfg, torch.device("cpu"))
    x, y = measure.random_batch(cfg, "cpu")
    params = list(gpt.parameters())
    counts = []
    for static in (params, params + list(gpt.buffers()), params + list(gpt.buffers()) + [x, y]):
        with measure.SavedBytes(static) as saved:
            gpt(x, y)
        counts.append(saved.total)
    # every buffer's storage is saved (masked_fill keeps a view of each block's causal mask)
    assert counts[0] - counts[1] == sum(b.untyped_storage().nbytes() for b in gpt.buffers())
    assert counts[1] - counts[2] == 2 * cfg.batch_size * cfg.block_size * 8  # the embedding saves x, the loss y


@pytest.mark.parametrize("ckpt,n_units", [("none", 0), ("full", 3), ("sqrt", 2), ("selective", 3)])
def test_recompute_rng_states_are_counted(ckpt, n_units):
    """Each recompute unit keeps the CPU generator's state (host memory)."""
    cfg, rows, _, _, _ = ledger([f"--ckpt={ckpt}", "--n_layer=3"])
    assert rows["rng_states"][2] == rows["rng_states"][1] == n_units * torch.get_rng_state().numel()


def test_sixteen_bytes_per_param_for_mixed_precision_adam():
    # ZeRO (Rajbhandari et al. 2020), sec. 3.1: 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter, traced
    per_param = lambda prec: papers.bytes_per_param(Config(precision=prec))  # noqa: E731
    assert per_param("bf16") == (2, 2, 4, 8)
    assert sum(per_param("fp16")) == 16
    assert per_param("fp32") == (4, 4, 0, 8)
    assert per_param("fp8")[:3] == (2, 2, 4)  # fp8 keeps BF16 parameters and an FP32 master


def linear_weights(cfg):
    """(elements of every FP8 Linear's weight, how many) of model.GPT as precision.decide(cfg) builds it, on the meta
    device: the Linears the FP8 factory made (an untied head a learner adds stays a BF16 nn.Linear)."""
    with torch.device("meta"):
        gpt = model.GPT(cfg, precision.decide(cfg).linear_factory())
    sizes = [m.weight.numel() for m in fp8.layers(gpt)]
    return sum(sizes), len(sizes)


@pytest.mark.parametrize("keep", ["false", "true"])
@pytest.mark.parametrize("grad", ["bf16", "e5m2"])
def test_fp8_weight_copies(grad, keep):
    """FP8_KEEP_WEIGHT: native FP8Linear keeps each E4M3 weight (with its 8-byte scale and amax storages) for
    one step, not as state; HYBRID adds a column-major twin in backward. Without it nothing is kept."""
    cfg, rows, ok, meas, _ = ledger(["--n_embd=64", "--n_head=4", "--block_size=32", "--precision=fp8",
                                     f"--fp8_grad={grad}", f"--fp8_keep_weight={keep}"])
    weights, n = linear_weights(cfg)
    want = ((2 if grad == "e5m2" else 1) * weights + 16 * n) * (keep == "true")
    assert meas["fp8_kept"] == want and ok, f"FP8 copies kept with FP8_KEEP_WEIGHT={keep}: measured " \
        f"{meas['fp8_kept']:,} bytes, where {n} FP8 Linears of {weights:,} weight elements make {want:,} (with the " \
        f"flag {'two copies' if grad == 'e5m2' else 'one copy'} of 1 byte an element and 16 bytes of scale and amax " \
        f"each, without it none); the ledger's checks pass: {ok}"


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--fp8_keep_weight=true"],
                                  ["--precision=fp8", "--fp8_keep_weight=true", "--fp8_grad=e5m2", "--ckpt=full"],
                                  ["--precision=fp8", "--fp8_keep_weight=true", "--fp32_grad_accum"]])
def test_fp8_copies_are_kept_across_micro_steps(argv):
    """K = 2: micro-step 2 starts with what micro-step 1 started with, plus micro-step 1's .grad (not where
    FP32 sums took them), the FP8 copies it kept (e5m2: the twins its backward made too), and two 4-byte
    scalars (micro-step 1's loss, the running total); after the optimizer step nothing is left."""
    cfg, _, _, meas, traced = ledger(argv)
    gpt, parts = train.build(cfg, torch.device("cpu"))
    batches = [measure.random_batch(replace(cfg, seed=seed), "cpu") for seed in (3, 4)]
    accumulate.accumulation_step(gpt, parts, batches)  # AdamW's states appear
    opt, tracker, forwards = parts.optimizer, measure.LiveTensors("cpu"), []
    static = list(gpt.parameters()) + list(gpt.buffers()) + opt.master_params + opt.state_tensors()
    with tracker:
        tracker.adopt(static + (parts.grad_buffers or []) + [t for batch in batches for t in batch])
        start = tracker.read()
        with measure.phases(gpt, parts, lambda phase, *_: forwards.append(tracker.read()) if phase == "forward" else 0):
            accumulate.accumulation_step(gpt, parts, batches)
        end = tracker.read()
    grads = 0 if cfg.fp32_grad_accum else meas["gradients"]
    assert forwards[0] == start and forwards[1] - forwards[0] == grads + meas["fp8_kept"] + 2 * 4
    assert end == start and all(getattr(m, "weight_copy", None) is None for m in parts.fp8_layers)


def memtracker():
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # torch before 2.5 has no MemTracker
        return None
    return MemTracker


@pytest.mark.skipif(memtracker() is None, reason="this torch has no torch.distributed._tools.mem_tracker")
@pytest.mark.parametrize("argv", [["--precision=fp32"], ["--precision=bf16", "--ckpt=full"],
                                  ["--precision=bf16", "--ckpt=selective", "--dropout=0.1"], ["--precision=fp8"]])
def test_memtracker_agrees(argv):
    """PyTorch's own MemTracker, an independent counter of a real step, against the trace: the states,
    buffers, gradients and the batch to the byte; the activations as its Pre-Backward reading of the model,
    which also holds three 4-byte scalars (the loss, the loss times its weight, backward's seed) and, for
    fp8, the weight copies the forward kept; the peak within 8 bytes (the optimizer step's 4-byte scalars
    are read at other moments), the FP32 master copy, which MemTracker does not see, aside."""
    cfg = replace(parse_args(merged(*TINY, *argv)), device="cpu")
    gpt, parts = train.build(cfg, torch.device("cpu"))
    batch = measure.random_batch(cfg, "cpu")
    accumulate.accumulation_step(gpt, parts, [batch])
    tracker = memtracker()()
    if not (hasattr(tracker, "memory_tracking") and hasattr(tracker, "get_tracker_snapshot")):
        pytest.skip("this torch's MemTracker keeps its per-module snapshots elsewhere")
    tracker.track_external(gpt, parts.optimizer.torch_optimizer, *batch)
    with tracker:
        accumulate.accumulation_step(gpt, parts, [batch])
    peak = {str(k).rsplit(".", 1)[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    pre_backward = tracker.memory_tracking[gpt].snapshots["Pre-Backward"][-1][torch.device("cpu")]
    acts = {str(k).rsplit(".", 1)[-1]: v for k, v in pre_backward.items()}["ACT"]
    traced = trace.step(cfg)
    assert (peak["PARAM"], peak["BUFFER"], peak["GRAD"]) == (traced["parameters"], traced["buffers"],
                                                             traced["gradients"])
    assert acts == traced["activations"] + traced["fp8_kept"] + 3 * 4, \
        f"MemTracker's activations {acts:,} bytes, the trace's {traced['activations']:,} + fp8 kept " \
        f"{traced['fp8_kept']:,} + 12 (three 4-byte scalars)"
    assert abs(peak["Total"] + traced["master"] - traced["peak"]) <= 8


def test_param_count_is_model_pys():
    for L, h, a, s, V in [(2, 32, 2, 16, 256), (3, 48, 3, 32, 300)]:
        for bias in (True, False):
            cfg = Config(n_layer=L, n_embd=h, n_head=a, block_size=s, vocab_size=V, bias=bias, device="cpu")
            with torch.device("meta"):
                assert trace.step(cfg)["params"][0] == sum(p.numel() for p in model.GPT(cfg).parameters())


def test_train_time_ledger_line_runs_nothing(tmp_path):
    """The line train.py prints after step 1 reads counters (CUDA) or points to `make ledger`
    (CPU): no copy of the model, no extra forward, the run identical with it or without it."""
    flags = TINY + ["--precision=bf16", "--dropout=0.1", "--max_iters=3", "--sample_tokens=0", "--log_interval=100",
                    "--eval_interval=100"]
    forwards, lines, histories, params = [], [], [], []
    real_forward = model.GPT.forward
    for ledger_flag in ("true", "false"):
        cfg = parse_args(flags + [f"--ledger={ledger_flag}", f"--out_dir={tmp_path / ledger_flag}"])
        forwards.append(0)

        def counting(self, idx, *a, **kw):
            forwards[-1] += not is_fake(idx)  # flops.per_token counts FLOPs on fake tensors: no memory, no time
            return real_forward(self, idx, *a, **kw)
        model.GPT.forward = counting
        try:
            histories.append(train.train(cfg, log=lines.append))
        finally:
            model.GPT.forward = real_forward
        params.append(torch.load(tmp_path / ledger_flag / "snapshot.pt", weights_only=True)["model"])
    assert forwards[0] == forwards[1] == 3
    assert [h["loss"] for h in histories[0]] == [h["loss"] for h in histories[1]]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert sum("make ledger" in line for line in lines) == 2  # CPU: a pointer in each header (the line is CUDA's)


# ---------------------------------------------------------------- CUDA (make gpu-check)

@pytest.mark.cuda
@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16", "fp8"])
def test_cuda_traced_as_measured(prec, ckpt):
    if prec == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"native FP8 (torch._scaled_mm) needs sm89+, this GPU is sm"
                    f"{''.join(map(str, torch.cuda.get_device_capability()))}")
    cfg, rows, ok, meas, traced = ledger(["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=256",
                                          "--batch_size=8", f"--precision={prec}", f"--ckpt={ckpt}"], "cuda")
    # every component is storage sizes (the activations: saved_tensors_hooks), exact on CUDA too
    assert ok, tool.failure(cfg, rows.values())
    # only the allocator's own figures have a slack, the one its block sizes allow
    low, high = measure.allocator_bounds(meas["forward_storages"])
    assert low <= meas["forward_growth"] <= high, \
        f"the CUDA allocator grew by {meas['forward_growth']:,} bytes over the forward; the storages it left " \
        f"alive ({sum(meas['forward_storages']):,} bytes) allow {low:,} to {high:,}"


@pytest.mark.cuda
def test_cuda_loss_in_pieces_traced_as_measured():
    """The FP32 sum of the pieces' weight gradients: one cuBLAS GEMM with an FP32 output (cuda_rules.CUDA's rule)."""
    argv = ["--n_layer=2", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=8", "--vocab_size=50304",
            "--precision=bf16", "--loss_chunks=16"]
    cfg, rows, ok, meas, traced = ledger(argv, "cuda")
    assert ok, tool.failure(cfg, rows.values())


@pytest.mark.cuda
@pytest.mark.parametrize("argv", [["--precision=bf16", "--dropout=0.1"], ["--precision=fp32", "--attn=sdpa",
                                                                             "--dropout=0.1"],
                                  ["--precision=bf16", "--attn=sdpa", "--ckpt=full"], ["--precision=fp8"]])
def test_cuda_rules_are_this_gpus_kernels(argv):
    """ledger/cuda_rules.CUDA's rules (what a CPU-only machine traces for a GPU) against this GPU's own kernels,
    traced on fake CUDA tensors: the same activations and peak."""
    cfg = replace(parse_args(merged(*TINY, "--n_embd=64", *argv)), device="cuda")
    real = trace.step(cfg)
    with cuda_rules.rules_forced():
        ruled = trace.step(cfg)
    assert (ruled["activations"], ruled["peak"]) == (real["activations"], real["peak"]), \
        f"{' '.join(argv)}: the rules trace {ruled['activations']:,} bytes of activations and a peak of " \
        f"{ruled['peak']:,}; this GPU's kernels {real['activations']:,} and {real['peak']:,}"


def test_a_gpus_step_traced_here_keeps_layernorms_statistics_in_fp32():
    """CUDA's LayerNorm keeps its mean and rstd in FP32 for 16-bit inputs, CPU's in the input's dtype: a GPU's
    step traced on a CPU-only torch (cuda_rules.CUDA's rules) counts them as the GPU keeps them."""
    cfg = parse_args(merged(*TINY, "--precision=bf16", "--device=cpu"))
    statistics = {("NativeLayerNormBackward0", "result1"), ("NativeLayerNormBackward0", "result2")}
    dtypes = {device: sorted({t.dtype for t in trace.step(replace(cfg, device=device))["saved_tensors"].values()
                              if statistics & {pair[:2] for pair in t.inputs}}) for device in ("cpu", "cuda")}
    assert dtypes == {"cpu": ["bfloat16"], "cuda": ["float32"]}, f"LayerNorm's saved mean and rstd: {dtypes}"


def test_a_gpus_loss_in_pieces_traced_here_sums_each_piece_in_one_gemm_into_fp32():
    """model.sum_in_fp32's GPU branch: cuBLAS multiplies a piece's 16-bit operands into an FP32 output, where a CPU
    copies both to FP32 first. A GPU's step traced on a CPU-only torch runs that branch (cuda_rules.CUDA's rules): at
    the loss's most (wide enough that the weight's sum is it), the GEMM's FP32 output beside the FP32 sum."""
    cfg = Config(n_layer=1, n_embd=512, n_head=2, block_size=64, vocab_size=256, batch_size=2, precision="bf16",
                 loss_chunks=4)
    weight = ("float32", (256, 512), 4 * 256 * 512)
    weight_sized = {device: loss_at_most(replace(cfg, device=device))[1].count(weight)
                    for device in ("cpu", "cuda")}
    assert weight_sized == {"cpu": 1, "cuda": 2}, f"FP32 tensors of the head's weight's size alive at the loss's " \
                                                  f"most: {weight_sized} (the sum, and on a GPU the GEMM's output)"


@pytest.mark.cuda
def test_cuda_train_time_ledger_line_keeps_peak_stats(tmp_path):
    cfg = parse_args(TINY + ["--precision=bf16", "--device=cuda", "--max_iters=2", "--sample_tokens=0",
                             f"--out_dir={tmp_path}"])
    lines = []
    train.train(cfg, log=lines.append)
    line = next(line for line in lines if line.startswith("memory after step 1"))
    assert "vs allocated" in line and "vs max allocated" in line
    assert "cuBLAS workspaces" in line and "main thread" in line and "autograd thread" in line, line


def saved_by(fn, *args):
    """[(dtype, shape)] of every tensor autograd saves while fn(*args) runs."""
    out = []

    def pack(t):
        out.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return out


@pytest.mark.cuda
def test_cuda_layernorm_and_dropout_rules():
    """Two of ledger/cuda_rules.CUDA's rules, on this GPU's own kernels: layer_norm_cuda keeps mean and rstd in
    FP32 for BF16 inputs; native_dropout keeps a bool mask."""
    x = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ln = torch.nn.LayerNorm(64).to("cuda", torch.bfloat16)
    assert [d for d, shape in saved_by(ln, x) if shape[:2] == (2, 8) and shape[-1] == 1] == [torch.float32] * 2
    assert [d for d, _ in saved_by(torch.nn.functional.dropout, x, 0.1, True)] == [torch.bool]


def sdpa_statistics(dtype, backend=None, b=2, a=4, s=40, d=32):
    """Bytes of the FP32 storages sdpa saves beside q, k, v and its output (its softmax statistics)."""
    from torch.nn.attention import sdpa_kernel
    q, k, v = (torch.randn(b, a, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    found = {}

    def pack(t):
        found[measure.storage_key(t)] = (t.dtype, t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    mine = {measure.storage_key(t) for t in (q, k, v, out)}
    return sum(n for key, (dt, n) in found.items() if key not in mine and dt == torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,rows", [(torch.float32, 64), (torch.bfloat16, 40)])
def test_cuda_sdpa_logsumexp_bytes(dtype, rows):
    """The rule's kernels: the memory-efficient one (FP32's) pads its logsumexp to 32*ceil(s/32) rows,
    flash keeps (b, a, s)."""
    assert sdpa_statistics(dtype) == 2 * 4 * rows * 4
