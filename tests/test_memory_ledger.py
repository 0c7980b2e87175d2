"""The memory ledger: every formula against measured bytes, exact on CPU; MemTracker as a second counter;
what the ledger says when the model changes and its description does not."""
import contextlib
import functools
import itertools
from dataclasses import replace

import pytest
import torch

import torch.nn as nn

import accumulate
import checkpoint
import memory_ledger as ml
import model
import precision
import train
from config import Config
from guards.cli import parse_args
from conftest import merged
from ledger import explain, measure, papers, step
from ledger.ops import Ops
from ledger.shard import meta_model
from tools import ledger as tool

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--seed=3"]


def ledger(argv, device="cpu"):
    cfg = replace(parse_args(merged(*TINY, *argv)), device=device)
    meas = tool.run_config(cfg, torch.device(device))
    rows, ok = tool.compare(cfg, meas)
    return cfg, {r[0]: r for r in rows}, ok, meas


def combinations():
    """precision x ckpt x attn x dropout x bias; selective recomputes the manual core only. fp8 both
    ways: the BF16 backward and HYBRID's E5M2 one (fp8-e5m2 in the ids)."""
    for prec, ckpt, attn, drop, bias in itertools.product(("fp32", "bf16", "fp16", "fp8", "fp8e5m2"),
                                                         ("none", "full", "sqrt", "selective"), ("manual", "sdpa"),
                                                         ("0.0", "0.1"), ("true", "false")):
        if not (ckpt == "selective" and attn == "sdpa"):
            precision = ["--precision=fp8", "--fp8_grad=e5m2"] if prec == "fp8e5m2" else [f"--precision={prec}"]
            yield precision + [f"--ckpt={ckpt}", f"--attn={attn}", f"--dropout={drop}", f"--bias={bias}"]


@pytest.mark.parametrize("argv", list(combinations()), ids=lambda a: "-".join(x.partition("=")[2] for x in a))
def test_every_component_exact(argv):
    # the 'fp8' in an id lets conftest skip those where torch._scaled_mm cannot run on this CPU
    cfg, rows, ok, meas = ledger(argv)
    # measured == predicted, to the byte, the walk's peak too; and every saved tensor explained by a term
    exact = all(rows[k][2] == rows[k][1] for k in ml.COMPONENTS + ("peak",))
    assert exact and ok and not explain.report(cfg, meas), \
        tool.failure(cfg, rows.values(), meas)


def one_sequence():
    """b = 1, where reshaping (1, a, T, d) to (a, T, d) is a view: no Q, K, V copies."""
    for prec, ckpt, attn, drop in itertools.product(("fp32", "bf16", "fp8"), ("none", "full", "selective"),
                                                    ("manual", "sdpa"), ("0.0", "0.1")):
        if not (ckpt == "selective" and attn == "sdpa"):
            yield [f"--precision={prec}", f"--ckpt={ckpt}", f"--attn={attn}", f"--dropout={drop}"]


@pytest.mark.parametrize("argv", list(one_sequence()), ids=lambda a: "-".join(x.partition("=")[2] for x in a))
def test_every_component_exact_for_one_sequence(argv):
    cfg, rows, ok, meas = ledger(argv + ["--batch_size=1", "--block_size=32"])
    exact = all(rows[k][2] == rows[k][1] for k in ml.COMPONENTS + ("peak",))
    assert ok and exact, tool.failure(cfg, rows.values(), meas)


@pytest.mark.parametrize("argv", [["--fp32_grad_accum", "--precision=bf16"], ["--ckpt=sqrt", "--ckpt_segment=1"],
                                  ["--ckpt=sqrt", "--n_layer=5"], ["--precision=fp16", "--loss_scale=1024"],
                                  ["--fp32_grad_accum", "--precision=fp8", "--fp8_grad=e5m2"],
                                  ["--precision=fp8", "--fp8_recipe=current", "--ckpt=sqrt"],
                                  # 24 tokens: HYBRID's weight gradient dequantizes (FP8 GEMMs want multiples of 16)
                                  ["--precision=fp8", "--fp8_grad=e5m2", "--batch_size=1", "--block_size=24"]])
def test_variants_exact(argv):
    cfg, rows, ok, meas = ledger(argv)
    exact = all(rows[k][2] == rows[k][1] for k in ml.COMPONENTS + ("peak",))
    assert ok and exact, tool.failure(cfg, rows.values(), meas)


def test_fp8_sdpa_keeps_c_proj_input_apart():
    """Defect 1: with FP8Linear, c_proj saves its own E4M3 copy of its input, 1 byte per
    element, so the sdpa output is no longer c_proj's saved input: both are terms."""
    cfg, rows, _, meas = ledger(["--precision=fp8", "--attn=sdpa"])
    terms = {t.name: t.nbytes for t in ml.block_activation_terms(cfg)}
    bsh = cfg.batch_size * cfg.block_size * cfg.n_embd
    assert terms["attn.c_proj input"] == bsh and terms["attn.sdpa output"] == 2 * bsh
    assert rows["activations"][2] == rows["activations"][1], tool.failure(cfg, rows.values(), meas)


def test_cpu_comparison_has_no_tolerance(monkeypatch):
    """Defect 2: on CPU both sides count storages, so one byte off is a miss."""
    cfg, _, ok, meas = ledger(["--precision=bf16"])
    assert ok
    real = ml.activation_terms
    monkeypatch.setattr(ml, "activation_terms", lambda c: real(c) + [ml.Term("one byte too many", 1, "head", False)])
    rows, ok = tool.compare(cfg, meas)
    assert not ok and [r[0] for r in rows if not r[4]] == ["activations"]


# ---------------------------------------------------------------- a change the description does not know yet

class Gated(nn.Module):
    """A learner's change around whatever norm the block has: its output times its own sigmoid."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        return y * torch.sigmoid(y)


def swapped(monkeypatch, change):
    """Change model.py's block at test time, as a learner would, and leave the description alone.
    Each works on whatever block model.py has: "gate" wraps ln_1 (more saved), "no activation"
    takes the MLP's activation out (less saved): its modules run in the order it makes them, nothing
    between (whatever they are named)."""
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
def test_the_ledger_names_what_its_description_does_not_explain(monkeypatch, change):
    """A block that saves more or fewer tensors than memory_ledger.block says: the activations
    miss, and the report names each measured tensor no term accounts for (the module and autograd
    node that saved it, dtype, shape, bytes) and each term nothing matched, accounting for the
    whole difference; the tests' messages and `make ledger` say the same."""
    swapped(monkeypatch, change)
    cfg, rows, ok, meas = ledger(["--precision=bf16"])
    assert not ok and not rows["activations"][4]
    lines = explain.report(cfg, meas)
    said = "\n".join(lines)
    b, s, h, L = cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    bsh = f"bfloat16 ({b}, {s}, {h}), {2 * b * s * h:,} bytes (x{L})"
    if change == "gate":  # the sigmoid's output and the norm's output (now the product's operand): two more
        assert f"  unexplained, saved by h.*.ln_1 (MulBackward0, SigmoidBackward0): {bsh}" in lines, said
        assert f"  unexplained, saved by h.*.ln_1 (MulBackward0): {bsh}" in lines, said
        assert not any("described but not saved" in line for line in lines), said
    else:  # one term of each block's MLP is saved no more
        assert any(line.startswith("  described but not saved: mlp.") and "(in each block)" in line
                   for line in lines), said
    extra, missing, _ = explain.unexplained(cfg, meas["saved_tensors"])
    assert sum(s.nbytes for s in extra) - sum(t.nbytes for _, t in missing) == \
        rows["activations"][2] - rows["activations"][1]  # the report accounts for the whole difference
    words = tool.failure(cfg, rows.values(), meas)
    assert f"activations: predicted {rows['activations'][1]:,} bytes, measured {rows['activations'][2]:,}" in words
    assert said in words
    assert said in tool.format_comparison(cfg, list(rows.values()), meas)  # `make ledger` prints it too


def test_every_component_that_differs_is_named(monkeypatch):
    """Recompute units the description's plan does not have (its plan says none; the model runs ckpt=full):
    the RNG states they keep are named with their count, and the unit inputs the units keep are saved."""
    real = ml.plan
    monkeypatch.setattr(ml, "plan", lambda cfg: real(replace(cfg, ckpt="none")))
    cfg, rows, ok, meas = ledger(["--precision=bf16", "--ckpt=full"])
    per_state = torch.get_rng_state().numel()
    lines = explain.report(cfg, meas)
    assert not ok and f"  rng_states: predicted 0 bytes, measured {cfg.n_layer * per_state:,}: the step's graph " \
        f"holds {cfg.n_layer} RNG states of {per_state:,} bytes (checkpoint.Unit.rng: one per recompute unit); the " \
        f"description's plan (memory_ledger.plan) 0" in lines, "\n".join(lines)
    assert any(line.startswith("  unexplained, saved by GPT.forward (RerunNodeBackward)") for line in lines), lines


def test_a_description_that_follows_the_change_is_exact_again(monkeypatch):
    """The loop the report is for: change model.Block (its ln_1 gated by its own sigmoid), change the
    description beside it (the same two ops after the norm: the sigmoid saves its output, the
    product both operands), and the ledger is exact again, every component and the peak."""
    swapped(monkeypatch, "gate")

    def gated(norm):
        def run(g, name, x):
            y = norm(g, name if name != "ln_1" else "ln_1.inner", x)
            if name != "ln_1":
                return y
            return g.mul("ln_1.gate", y, g.pointwise("ln_1.sigmoid", y, saves="output"))
        return run
    for norm in ("layer_norm", "rms_norm"):  # whichever model.py's block uses
        monkeypatch.setattr(Ops, norm, gated(getattr(Ops, norm)))
    ml._census.cache_clear()
    try:
        for argv in (["--precision=bf16"], ["--precision=fp32", "--ckpt=full", "--dropout=0.1"]):
            cfg, rows, ok, meas = ledger(argv)
            assert ok and rows["peak"][1] == rows["peak"][2], tool.failure(cfg, rows.values(), meas)
            assert not explain.report(cfg, meas)
    finally:
        ml._census.cache_clear()


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--fp8_grad=e5m2", "--ckpt=full"],
                                  ["--precision=bf16", "--ckpt=sqrt"], ["--precision=fp32", "--attn=sdpa"]])
def test_activations_are_saved_bytes_and_the_forward_leaves_nothing_else(argv):
    """Issue 17, defects 1 and 3: the activations are the storages saved for backward (SavedBytes,
    which reads storages on any device), less the FP8 weight copies the forward kept: those are
    fp8_kept's, counted once. What the forward leaves alive is exactly those activations, the kept
    copies and the loss (and the loss times its weight, made before the
    scaler's backward, where the reading is): LiveTensors' growth over the forward (exact on CPU) is their sum, which is
    what CUDA's allocator figure is bounded by (measure.allocator_bounds)."""
    cfg, rows, ok, meas = ledger(argv)
    assert ok, tool.failure(cfg, rows.values(), meas)
    # what the forward kept: the E4M3 copies (HYBRID's column-major twins come in backward)
    kept_at_forward = ml.fp8_weight_copies(replace(cfg, fp8_grad="bf16"))["kept"]
    assert meas["forward_growth"] == sum(meas["forward_storages"]) == \
        meas["activations"] + kept_at_forward + 4 + 4, \
        f"the forward grew the live bytes by {meas['forward_growth']:,}; activations {meas['activations']:,} + " \
        f"kept FP8 copies {kept_at_forward:,} + the 4-byte loss and the 4-byte loss x weight = " \
        f"{meas['activations'] + kept_at_forward + 8:,}"


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
    """Defect 3: for b = 1, x and y must not be views of one (s+1)-token storage."""
    cfg = parse_args(merged(*TINY, "--batch_size=1"))
    x, y = measure.random_batch(cfg, "cpu")
    assert measure.storage_key(x) != measure.storage_key(y)
    cfg, rows, ok, meas = ledger(["--batch_size=1"])
    assert rows["inputs"][2] == rows["inputs"][1] == 2 * cfg.block_size * 8
    assert ok, tool.failure(cfg, rows.values(), meas)


def test_activation_terms_are_what_autograd_saves():
    # the measured number comes from saved_tensors_hooks; removing one term must break the match
    sh, rows, _, meas = ledger(["--precision=bf16"])
    terms = ml.block_activation_terms(sh)
    softmax = {t.name: t.nbytes for t in terms}["attn.softmax output"]
    assert softmax == sh.n_head * sh.block_size * sh.block_size * sh.batch_size * 2
    assert meas["activations"] - softmax * sh.n_layer != ml.activation_bytes(sh)
    assert meas["activations"] == ml.activation_bytes(sh)
    # masked_fill saves a view of the future_mask buffer: state (buffers), not an activation
    assert not any("mask" in t.name and "dropout" not in t.name for t in terms)
    # model.py's, on the meta device, in the run's dtype (as train.build casts them): the causal masks
    buffers = sum(b.nbytes for b in meta_model(sh).to(dtype=precision.recipe(sh).param_dtype).buffers())
    assert meas["buffers"] == rows["buffers"][1] == buffers


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
    assert counts[1] - counts[2] == ml.input_bytes(cfg)  # the embedding saves x, the loss y


def test_a_name_that_holds_two_storages_of_a_block_is_counted_twice(monkeypatch):
    """A block may save two storages under one name (a learner's op named like another): activation_terms
    adds both, in every kind of block (plain and core-recomputed), and says so in the term's name."""
    cfg = Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, ckpt="selective")
    twice = [ml.Term("mlp.twice", 100, 0, False), ml.Term("mlp.twice", 60, 0, False)]
    monkeypatch.setattr(ml, "block_activation_terms", lambda c, paths=(): twice)
    monkeypatch.setattr(ml, "plan", lambda c: step.Plan(3, [], frozenset({(0, "attn.core")})))  # one core unit
    terms = [t for t in ml.activation_terms(cfg) if t.scope == "blocks"]
    assert [(t.name, t.nbytes) for t in terms] == [("mlp.twice (x6 in 3 blocks)", 3 * 160)], terms


def test_recompute_keeps_only_unit_inputs():
    _, _, _, m_none = ledger(["--precision=fp32", "--n_layer=4"])
    sh_full, _, _, m_full = ledger(["--precision=fp32", "--n_layer=4", "--ckpt=full"])
    head = sum(t.nbytes for t in ml.outside_terms(sh_full))
    assert m_full["activations"] - head == 4 * sh_full.batch_size * sh_full.block_size * sh_full.n_embd * 4  # L inputs
    assert m_full["activations"] < m_none["activations"]


@pytest.mark.parametrize("ckpt,n_units", [("none", 0), ("full", 3), ("sqrt", 2), ("selective", 3)])
def test_recompute_rng_states_are_counted(ckpt, n_units):
    """Defect 8: each recompute unit keeps the CPU generator's state (host memory)."""
    cfg, rows, _, _ = ledger([f"--ckpt={ckpt}", "--n_layer=3"])
    assert len(ml.plan(cfg).units) == n_units or ckpt == "selective"
    assert rows["rng_states"][2] == rows["rng_states"][1] == n_units * torch.get_rng_state().numel()


def test_sixteen_bytes_per_param_for_mixed_precision_adam():
    # ZeRO (Rajbhandari et al. 2020), sec. 3.1: 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter
    per_param = lambda prec: papers.bytes_per_param(Config(precision=prec))
    assert per_param("bf16") == (2, 2, 4, 8)
    assert sum(per_param("fp16")) == 16
    assert per_param("fp32") == (4, 4, 0, 8)
    assert per_param("fp8")[:3] == (2, 2, 4)  # fp8 keeps BF16 parameters and an FP32 master


def linear_weights(cfg):
    """(elements of every Linear weight, how many Linears, the largest) of model.GPT, built on the meta device."""
    with torch.device("meta"):
        gpt = model.GPT(cfg)
    sizes = [m.weight.numel() for m in gpt.modules() if isinstance(m, nn.Linear)]
    return sum(sizes), len(sizes), max(sizes)


def test_fp8_weight_copies():
    # native FP8Linear keeps each E4M3 weight (with its 8-byte scale and amax storages) for one step, not as
    # state; HYBRID adds a column-major twin; TE caches E4M3 W and W^T per Linear, persistent like a parameter
    sh = Config(n_layer=3, n_embd=64, n_head=4, block_size=32, batch_size=2, precision="fp8")
    weights, n, largest = linear_weights(sh)
    assert ml.fp8_weight_copies(sh) == dict(persistent=0, kept=weights + 16 * n, transient=4 * largest)
    assert ml.fp8_weight_copies(replace(sh, fp8_grad="e5m2"))["kept"] == 2 * weights + 16 * n
    assert ml.components(sh)["fp8_kept"] == ml.state_bytes(sh)["fp8_kept"] == weights + 16 * n
    assert ml.components(sh)["parameters"] == ml.state_bytes(sh)["parameters"]  # not a parameter: freed before AdamW
    te = replace(sh, fp8_backend="te")
    assert ml.fp8_weight_copies(te) == dict(persistent=2 * weights, kept=0, transient=0)
    assert ml.components(te)["parameters"] == ml.state_bytes(sh)["parameters"] + 2 * weights
    assert ml.components(te)["buffers"] == ml.state_bytes(te)["buffers"]  # a line of their own
    assert ml.fp8_weight_copies(replace(sh, precision="bf16")) == dict(persistent=0, kept=0, transient=0)


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--fp8_grad=e5m2", "--ckpt=full"],
                                  ["--precision=fp8", "--fp32_grad_accum"]])
def test_fp8_copies_are_kept_across_micro_steps(argv):
    """K = 2 (the walk and ledger/measure.py take one micro-batch): micro-step 2 starts with what
    micro-step 1 started with, plus micro-step 1's .grad (not where FP32 sums took them), the FP8
    copies it kept, state_bytes' fp8_kept (e5m2: the twins its backward made too), and two 4-byte
    scalars (micro-step 1's loss, the running total); after the optimizer step nothing is left."""
    cfg = replace(parse_args(merged(*TINY, *argv)), device="cpu")
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
    grads = 0 if cfg.fp32_grad_accum else ml.state_bytes(cfg)["gradients"]
    assert forwards[0] == start and forwards[1] - forwards[0] == grads + ml.state_bytes(cfg)["fp8_kept"] + 2 * 4
    assert end == start and all(m.weight_copy is None for m in parts.fp8_layers)


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
    """PyTorch's own MemTracker, an independent counter: the states, buffers, gradients and the
    batch to the byte; the activations as its Pre-Backward reading of the model, which also
    holds three 4-byte scalars (the loss, the loss times its weight, backward's seed) and, for
    fp8, the weight copies the forward kept (fp8_kept: each storage counted once, the scales
    every FP8 Linear saves for backward and keeps with its copy included: issue 17); the peak
    within 8 bytes (the optimizer step's 4-byte scalars are read at other moments)."""
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
    pred = ml.predicted(cfg)
    assert (peak["PARAM"], peak["BUFFER"], peak["GRAD"]) == (pred["parameters"], pred["buffers"], pred["gradients"])
    assert acts == pred["activations"] + pred["fp8_kept"] + 3 * 4, \
        f"MemTracker's activations {acts:,} bytes, the ledger's {pred['activations']:,} + fp8 kept " \
        f"{pred['fp8_kept']:,} + 12 (three 4-byte scalars)"
    master = pred["master"]  # MemTracker does not know the FP32 master copy: it counts the rest of the step
    assert abs(peak["Total"] + master - ml.peak_estimate(cfg)[0]) <= 8


def test_param_count_matches_meta_model():
    from ledger.parallel import meta_param_count
    for L, h, a, s, V in [(2, 32, 2, 16, 256), (48, 1600, 25, 1024, 50257)]:
        for bias in (True, False):
            cfg = Config(n_layer=L, n_embd=h, n_head=a, block_size=s, vocab_size=V, bias=bias)
            assert ml.param_count(cfg)[0] == meta_param_count(cfg)


def test_recompute_rng_state_is_what_checkpoint_keeps():
    # the formula's per-unit size is the state checkpoint.Unit stores, read from torch
    assert sum(t.numel() for t in checkpoint.rng_state(torch.device("cpu")).values()) == \
        ml.rng_state_bytes(Config(n_layer=1, ckpt="full"))


def test_train_time_ledger_line_runs_nothing(tmp_path):
    """The line train.py prints after step 1 reads counters (CUDA) or points to `make ledger`
    (CPU): no copy of the model, no extra forward, the run identical with it or without it."""
    flags = TINY + ["--precision=bf16", "--dropout=0.1", "--max_iters=3", "--sample_tokens=0", "--log_interval=100",
                    "--eval_interval=100"]
    forwards, lines, histories, params = [], [], [], []
    real_forward = train.GPT.forward
    for ledger in ("true", "false"):
        cfg = parse_args(flags + [f"--ledger={ledger}", f"--out_dir={tmp_path / ledger}"])
        forwards.append(0)

        def counting(self, *a, **kw):
            forwards[-1] += 1
            return real_forward(self, *a, **kw)
        train.GPT.forward = counting
        try:
            histories.append(train.train(cfg, log=lines.append))
        finally:
            train.GPT.forward = real_forward
        params.append(torch.load(tmp_path / ledger / "snapshot.pt", weights_only=True)["model"])
    assert forwards[0] == forwards[1] == 3
    assert [h["loss"] for h in histories[0]] == [h["loss"] for h in histories[1]]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert sum("make ledger" in line for line in lines) == 1  # CPU: the pointer, once, only with --ledger=true



# ---------------------------------------------------------------- CUDA (make gpu-check)

@pytest.mark.cuda
@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16", "fp8"])
def test_cuda_allocator_matches_formulas(prec, ckpt):
    if prec == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"native FP8 (torch._scaled_mm) needs sm89+, this GPU is sm"
                    f"{''.join(map(str, torch.cuda.get_device_capability()))}")
    cfg = parse_args(["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=8",
                      f"--precision={prec}", f"--ckpt={ckpt}", "--device=cuda"])
    meas = tool.run_config(cfg, torch.device("cuda"))
    rows, ok = tool.compare(cfg, meas)
    # every component is storage sizes (the activations: saved_tensors_hooks), exact on CUDA too
    assert ok, tool.failure(cfg, rows, meas)
    # only the allocator's own figure has a slack, the one its block sizes allow
    low, high = measure.allocator_bounds(meas["forward_storages"])
    assert low <= meas["forward_growth"] <= high, \
        f"the CUDA allocator grew by {meas['forward_growth']:,} bytes over the forward; the storages it left " \
        f"alive ({sum(meas['forward_storages']):,} bytes) allow {low:,} to {high:,}"


@pytest.mark.cuda
def test_cuda_fp32_grad_accum_gradients_are_exact():
    # the allocator barely grows in backward here (the FP32 buffers exist already): storage sizes count
    cfg = parse_args(["--n_layer=2", "--n_embd=128", "--n_head=4", "--block_size=128", "--batch_size=4",
                      "--precision=bf16", "--fp32_grad_accum", "--device=cuda"])
    meas = tool.run_config(cfg, torch.device("cuda"))
    assert meas["gradients"] == ml.predicted(cfg)["gradients"] == 6 * ml.param_count(cfg)[0]


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
def test_cuda_layernorm_saves_fp32_statistics():
    # memory_ledger._stat_bytes: layer_norm_cuda keeps mean and rstd in the accumulate type
    x = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ln = torch.nn.LayerNorm(64).to("cuda", torch.bfloat16)
    stats = [d for d, shape in saved_by(ln, x) if shape[:2] == (2, 8) and shape[-1] == 1]
    assert stats == [torch.float32, torch.float32]
    assert ml.sizes(Config(device="cuda")).stat_bytes == 4


@pytest.mark.cuda
def test_cuda_dropout_saves_a_one_byte_mask():
    # memory_ledger._mask_bytes: native_dropout on CUDA saves a bool mask
    x = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    masks = [d for d, _ in saved_by(torch.nn.functional.dropout, x, 0.1, True)]
    assert masks == [torch.bool]
    assert ml.sizes(Config(device="cuda", precision="bf16")).mask_bytes == 1


def sdpa_statistics_bytes(dtype, backend=None, b=2, a=4, s=40, d=32):
    """Bytes of the FP32 storages sdpa saves beside q, k, v and its output (its softmax statistics),
    under `backend` (torch.nn.attention.SDPBackend, pinned with sdpa_kernel) or torch's own choice."""
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
@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "EFFICIENT_ATTENTION"), (torch.bfloat16, "FLASH_ATTENTION"),
                                          (torch.bfloat16, "CUDNN_ATTENTION"), (torch.bfloat16, None)])
def test_cuda_sdpa_logsumexp_bytes(dtype, kernel):
    """memory_ledger's sdpa statistics (ops.Sizes.lse_rows), pinned per kernel and compared by bytes, not
    shapes: the memory-efficient kernel (FP32's) pads its logsumexp to 32*ceil(s/32) rows, flash keeps
    (b, a, s), cuDNN (torch 2.10+ prefers it on sm90 with a recent cuDNN) its (b, a, s, 1) statistics:
    the same bytes. None: whichever kernel this torch picks, as the model's F.scaled_dot_product_attention."""
    from torch.nn.attention import SDPBackend
    backend = getattr(SDPBackend, kernel, None) if kernel else None
    if kernel and backend is None:
        pytest.skip(f"torch {torch.__version__} has no SDPBackend.{kernel}")
    try:
        got = sdpa_statistics_bytes(dtype, backend)
    except RuntimeError as e:  # sdpa_kernel: "No available kernel" where this GPU or build lacks it
        pytest.skip(f"{kernel} does not run here: {str(e).splitlines()[0][:120]}")
    cfg = Config(device="cuda", block_size=40, precision="fp32" if dtype == torch.float32 else "bf16")
    rows = ml.sizes(cfg).lse_rows
    assert got == 2 * 4 * rows * 4, f"{kernel or 'the default kernel'} keeps {got:,} bytes of FP32 statistics; " \
                                    f"the ledger predicts {2 * 4 * rows * 4:,} ({rows} rows of b=2 x a=4 x 4 bytes)"


@pytest.mark.cuda
def test_cuda_train_time_ledger_line_keeps_peak_stats(tmp_path):
    cfg = parse_args(TINY + ["--precision=bf16", "--device=cuda", "--max_iters=2", "--sample_tokens=0",
                             f"--out_dir={tmp_path}"])
    lines = []
    train.train(cfg, log=lines.append)
    line = next(line for line in lines if line.startswith("memory after step 1"))
    assert "vs allocated" in line and "vs max allocated" in line
    assert "cuBLAS workspaces" in line and "main thread" in line and "autograd thread" in line, line
