"""The derived peak (ledger/walk.py running memory_ledger's description) against the measured CPU peak,
and the walk's own bookkeeping."""
import itertools
from dataclasses import replace

import pytest
import torch

import accumulate
import fp8
import memory_ledger as ml
import train
from config import Config
from guards.cli import parse_args
from ledger import measure, plan, step
from ledger import parallel as mp
from ledger.ops import Ops
from ledger.walk import GRAD, KEPT, Walk
from model import GPT
from tools import ledger as tool

# activation-heavy: the states are a few MB, the activations tens of MB (issue 10, defect 4)
HEAVY = ["--n_layer=4", "--n_embd=64", "--n_head=4", "--block_size=256", "--batch_size=4", "--seed=3"]


def peaks(argv):
    cfg = replace(parse_args(HEAVY + argv), device="cpu")
    predicted, where, alive = ml.peak_estimate(cfg)
    measured = tool.run_config(cfg, torch.device("cpu"))
    assert predicted == measured["peak"], f"peak: predicted {predicted:,} bytes at {where} ({alive}), measured " \
                                          f"{measured['peak']:,} in {measured['peak_phase']}"


@pytest.mark.parametrize("dropout", ["0.0", "0.1"])
@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
def test_peak_exact_bf16(ckpt, dropout):
    peaks(["--precision=bf16", f"--ckpt={ckpt}", f"--dropout={dropout}"])


@pytest.mark.parametrize("argv", [["--precision=fp32", "--ckpt=full"], ["--precision=fp32", "--ckpt=selective"],
                                  ["--attn=sdpa", "--ckpt=sqrt"], ["--attn=sdpa", "--dropout=0.1", "--ckpt=full"],
                                  ["--precision=fp16", "--ckpt=sqrt", "--ckpt_segment=3"],
                                  ["--fp32_grad_accum", "--ckpt=selective"], ["--bias=false", "--ckpt=full"]])
def test_peak_exact_variants(argv):
    peaks(argv)


def fp8_peak_cases():
    """Both backwards (BF16, HYBRID's E5M2) under every policy, manual and sdpa, with and without dropout."""
    for grad, (attn, dropout) in itertools.product(("bf16", "e5m2"), (("manual", "0.1"), ("sdpa", "0.0"))):
        if grad == "e5m2":
            dropout = "0.0" if dropout == "0.1" else "0.1"
        for ckpt in ("none", "full", "sqrt", "selective"):
            if not (ckpt == "selective" and attn == "sdpa"):
                yield [f"--fp8_grad={grad}", f"--attn={attn}", f"--dropout={dropout}", f"--ckpt={ckpt}"]


@pytest.mark.parametrize("argv", list(fp8_peak_cases()), ids=lambda a: "-".join(x.partition("=")[2] for x in a))
def test_peak_exact_fp8(argv):
    # the kept E4M3 weights, the FP32 product of x on its way to E4M3, the CPU GEMM's int32 codes: all walked
    peaks(["--precision=fp8"] + argv)


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--fp8_grad=e5m2", "--ckpt=full"],
                                  ["--precision=fp8", "--ckpt=selective", "--bias=false"], ["--precision=fp16"]])
def test_the_walk_starts_backward_with_what_is_measured(argv):
    # at the end of the forward the walk holds the live bytes when the scaler's backward starts (ledger/measure's
    # "backward" reading: the loss times its weight made), plus the loss times its scale made inside it: for FP8
    # every kept E4M3 weight
    cfg = replace(parse_args(HEAVY + argv), device="cpu")
    meas, walk = tool.run_config(cfg, torch.device("cpu")), ml.peak_walk(cfg)
    at = walk.totals[walk.steps.index("end of forward")]
    scalars = 4 if ml.sizes(cfg).loss_scaled else 0
    assert at == meas["phase"]["backward"] + scalars, \
        f"end of forward: walked {at:,} bytes, measured {meas['phase']['backward']:,} + {scalars} for the loss"


def kept_at(cfg, where, monkeypatch):
    """Bytes of the kept FP8 weight copies alive at the walk's last point named `where`."""
    found, real = [], Walk.mark

    def mark(walk, at):
        real(walk, at)
        if at == where:
            found.append(sum(e.nbytes for e in walk.live.values() if e.kind == KEPT))
    with monkeypatch.context() as m:
        m.setattr(Walk, "mark", mark)
        ml.peak_walk(cfg)
    assert found, f"the walk has no point {where!r}"
    return found[-1]


@pytest.mark.parametrize("grad", ["bf16", "e5m2"])
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
def test_fp8_kept_weights_are_in_the_walk_until_released(grad, ckpt, monkeypatch):
    # every Linear's E4M3 weight from the forward (e5m2: its column-major twin from the backward) until just
    # before AdamW; what is released is the ledger's fp8_kept, which test_every_component_exact measures
    cfg = Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, precision="fp8", fp8_grad=grad,
                 ckpt=ckpt)
    kept = ml.state_bytes(cfg)["fp8_kept"]
    with torch.device("meta"):  # the model's own Linears
        linears = [m.weight.numel() for m in GPT(cfg).modules() if isinstance(m, torch.nn.Linear)]
    twins = sum(linears) if grad == "e5m2" else 0
    # the scales storage a copy-making forward saves is the copy's: kept, counted once (issue 17)
    assert kept_at(cfg, "end of forward", monkeypatch) == kept - twins > sum(linears)
    assert kept_at(cfg, "FP8 weight copies released", monkeypatch) == kept
    assert kept_at(cfg, "optimizer step: FP32 master gradients", monkeypatch) == 0
    assert kept_at(replace(cfg, precision="bf16"), "end of forward", monkeypatch) == 0


def test_selective_peak_is_the_recomputed_core_in_backward():
    # the old estimate left out the softmax-gradient pair of the recomputed core (-13% here)
    cfg = replace(parse_args(HEAVY + ["--ckpt=selective"]), device="cpu")
    _, where, _ = ml.peak_estimate(cfg)
    assert "softmax backward" in where, where


CONFIGS = [dict(precision=p, ckpt=c, attn=a, dropout=d, bias=b, fp32_grad_accum=g, device=dev)
           for p, c, a, d, b, g, dev in itertools.product(("fp32", "bf16", "fp16", "fp8"),
                                                          ("none", "full", "sqrt", "selective"), ("manual", "sdpa"),
                                                          (0.0, 0.1), (True, False), (False, True), ("cpu", "cuda"))
           if not (c == "selective" and a == "sdpa")]


def test_the_walk_frees_everything_it_makes():
    # after the optimizer step nothing the walk made is alive: no tensor forgotten, none held by a stray reference
    for kw in CONFIGS:
        w = ml.peak_walk(Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, **kw))
        assert w.live == {} and w.total == w.static, f"{kw}: still alive after the step: {w.alive()}"


class EveryTotal(measure.LiveTensors):
    """LiveTensors that keeps its count after every op."""

    def __init__(self, device):
        super().__init__(device)
        self.totals = []

    def _count(self):
        self.totals.append(super()._count())
        return self.totals[-1]


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--attn=sdpa", "--dropout=0.1"],
                                  ["--precision=fp8", "--bias=false", "--fp8_recipe=current"],
                                  ["--precision=bf16", "--dropout=0.1"], ["--precision=fp32", "--attn=sdpa"],
                                  # torch's math path: its mask lives to the end, the scaled k goes after QK^T (at
                                  # HEAVY's shape the two weigh the same, b x h = s: a peak test cannot tell them)
                                  ["--precision=bf16", "--attn=sdpa", "--dropout=0.1"]])
def test_a_blocks_forward_is_walked_as_measured(argv):
    """One block's forward with autograd recording, counted op by op and walked from memory_ledger.block:
    the same peak and the same bytes left, to the byte, and every point where a Linear's walk allocates
    (1 KiB or more) is a measured point, in order. FP8 twice: micro-step 1 (W times its scale in FP32,
    its E4M3 copy kept), then micro-step 2, which reuses the copy as a recompute's re-run does."""
    cfg = replace(parse_args(["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=64", "--batch_size=2"] + argv),
                  device="cpu")
    gpt, parts = train.build(cfg, torch.device("cpu"))
    x = torch.randn(cfg.batch_size, cfg.block_size, cfg.n_embd, dtype=parts.recipe.param_dtype, requires_grad=True)
    z = ml.sizes(cfg)
    g = Ops(Walk(0), z)
    g.plan = step.Plan(1, [], [])
    walked_x = g.new("input", "block input", x.nelement() * z.e)
    # the block's Linears, whatever model.py names them: its modules with a 2-D weight
    linears = [name for name, m in gpt.h[0].named_modules() if getattr(m, "weight", torch.ones(1)).dim() == 2]
    for micro_step in (0, 1):
        copies = [m.weight_copy for m in fp8.layers(gpt.h[0]) if m.weight_copy is not None]
        tracker = EveryTotal("cpu")
        with tracker:
            tracker.adopt(list(gpt.parameters()) + list(gpt.buffers()) + [x]
                          + [t for c in copies for t in (c.data, c.scale, c.amax)])
            tracker.reset_peak()
            start = tracker.read()
            with parts.recipe.forward_context(gpt, micro_step=micro_step):
                y = gpt.h[0](x)
            measured = (tracker.peak - start, tracker.read() - start)
        del y
        walk = g.walk
        first, before = len(walk.steps), walk.total
        walk.peak = before
        with g.within("0.", 0):
            out = ml.block(g, walked_x)
        walked = (walk.peak - before, walk.total - before)
        del out
        assert walked == measured, f"micro-step {micro_step}: walked (peak, left) {walked}, measured {measured}"
        assert len(copies) == (len(fp8.layers(gpt.h[0])) if z.fp8 and micro_step else 0)  # every FP8 Linear's, kept
        points, at = [t - start for t in tracker.totals], 0
        for i in range(first + 1, len(walk.steps)):
            linear = any(walk.steps[i].startswith(f"0.{name} ") for name in linears)
            if linear and walk.totals[i] - walk.totals[i - 1] >= 1024:
                assert walk.totals[i] - before in points[at:], \
                    f"micro-step {micro_step}: {walk.steps[i]} walks to {walk.totals[i] - before:,}, never measured"
                at = points.index(walk.totals[i] - before, at)
        g.grads.clear()


def test_every_gradient_is_counted_once(monkeypatch):
    # when backward is done, the parameter gradients the walk has made add up to e*P, once each
    at_end, real = [], Walk.mark

    def spy(walk, where):
        real(walk, where)
        if where == "backward done":
            at_end.append(sum(e.nbytes for e in walk.live.values() if e.kind == GRAD))
    monkeypatch.setattr(Walk, "mark", spy)
    for kw in CONFIGS[::5]:
        cfg = Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, **kw)
        ml.peak_walk(cfg)
        P = ml.param_count(cfg)[0]
        assert at_end[-1] == ml.sizes(cfg).e * P, f"{kw}: .grad bytes {at_end[-1]:,}, e*P {ml.sizes(cfg).e * P:,}"


def test_largest_micro_batch_is_the_walks():
    # the planner's solve (two walks, ledger/plan.py) agrees with walking at b and b+1; ZeRO-3 over 8 is its fsdp row
    for name, ckpt, shard in [("GPT-2 XL", "full", 1), ("GPT-2 XL", "selective", 8), ("7B", "full", 8)]:
        cfg = mp.big_config(name, ckpt=ckpt, shard="fsdp" if shard > 1 else "none")
        b = plan.largest_micro_batch(cfg, 80 * 2 ** 30, world=shard)
        assert b > 0
        assert ml.peak_estimate(replace(cfg, batch_size=b), shard)[0] <= 80 * 2 ** 30 < \
            ml.peak_estimate(replace(cfg, batch_size=b + 1), shard)[0]
    assert plan.largest_micro_batch(mp.big_config("175B (GPT-3)"), 80 * 2 ** 30) == 0  # 2.79 TB of states alone


@pytest.mark.parametrize("stops", [True, False])
@pytest.mark.parametrize("ckpt, prec", [("full", "fp32"), ("selective", "fp32"), ("full", "fp8")])
def test_each_rerun_adds_what_the_walk_says(ckpt, prec, stops, monkeypatch):
    # the re-run's own bytes, unit by unit: the most it adds over what was alive when it started,
    # measured (LiveTensors inside checkpoint.Unit.rerun) and walked (inside ledger/walk._rerun).
    # A step's peak never falls inside a re-run here, so this is what holds the early stop to the
    # byte: where it stops (before an op that saves its inputs first: Walk.undo), or that it does not
    # (precision.Recipe.rerun_stops_early, off for Transformer Engine); fp8's Function saves after it ran
    import checkpoint
    import precision
    from ledger import walk as walk_module
    monkeypatch.setattr(precision.Recipe, "rerun_stops_early", property(lambda self: stops))
    # wide and short, so a re-run's last ops (not the s x s softmax) would be its most: where it stops shows
    wide = ["--n_layer=2", "--n_embd=128", "--n_head=2", "--block_size=16", "--batch_size=8", "--seed=3"]
    cfg = replace(parse_args(wide + [f"--precision={prec}", f"--ckpt={ckpt}", "--dropout=0.0"]), device="cpu")
    measured, walked = [], []
    model, parts = train.build(cfg, torch.device("cpu"))
    tracker, rerun = measure.LiveTensors("cpu"), checkpoint.Unit.rerun

    def measured_rerun(unit, saved_inputs):
        start = tracker.read()
        tracker.reset_peak()
        rerun(unit, saved_inputs)
        measured.append(tracker.peak - start)
    monkeypatch.setattr(checkpoint.Unit, "rerun", measured_rerun)
    x, y = measure.random_batch(cfg, "cpu")
    with tracker:  # the step the ledger walks (micro-step 1: FP8 keeps its weight copies)
        tracker.adopt([*model.parameters(), *model.buffers(), x, y])
        accumulate.accumulation_step(model, parts, [(x, y)])
    real_rule = walk_module._rerun

    def walked_rerun(g, node, grads):
        start, first = g.walk.total, len(g.walk.totals)
        out = real_rule(g, node, grads)
        walked.append(max(g.walk.totals[first:], default=start) - start)
        return out
    monkeypatch.setattr(walk_module, "_rerun", walked_rerun)
    ml.peak_estimate(cfg)
    assert measured == walked and len(measured) == cfg.n_layer, f"bytes each re-run added: measured {measured}, " \
                                                                 f"walked {walked}"


@pytest.mark.parametrize("bias", [True, False])
def test_a_units_linear_lets_its_input_go_before_the_bias_gradient(bias):
    """Inside a recompute unit a Linear's saved input comes back through the unit's unpack hook and dies
    with AddmmBackward0's apply, before the engine sums the bias gradient down to its shape: the walk
    frees it there too. Two Linears (4 -> 64 -> 16 features) in one unit, so the second one's backward
    is the highest point: measured (LiveTensors) and walked, the backward's peak to the byte."""
    import checkpoint
    b, s, widths, dtype = 2, 8, (4, 64, 16), torch.bfloat16
    lins = [torch.nn.Linear(n, m, bias=bias).to(dtype) for n, m in zip(widths, widths[1:])]
    x = torch.randn(b, s, widths[0], dtype=dtype, requires_grad=True)
    tracker = measure.LiveTensors("cpu")
    with tracker:
        tracker.adopt([p for lin in lins for p in lin.parameters()] + [x])
        y = checkpoint.recompute(lambda t: lins[1](lins[0](t)), x)
        seed = torch.ones_like(y)
        start = tracker.read()
        tracker.reset_peak()
        y.backward(seed)
        measured = tracker.peak - start
    z = ml.sizes(Config(n_layer=1, n_embd=widths[0], n_head=1, block_size=s, batch_size=b, bias=bias))
    g = Ops(Walk(0), z)
    g.plan = step.Plan(1, [], [])
    walked_x = g.new("input", "x", x.nbytes)
    out = g.unit("unit", lambda t: g.linear("lin2", g.linear("lin1", t, widths[1]), widths[2]), walked_x,
                 term="unit input", scope="units")
    walked_seed = g.new("seed", "seed", seed.nbytes)
    start, first = g.walk.total, len(g.walk.totals)
    g.backward([(out, walked_seed)])
    walked = max(g.walk.totals[first:]) - start
    assert walked == measured, f"a unit's backward through two Linears (bias={bias}): walked peak {walked:,} " \
                               f"bytes over its start, measured {measured:,}"
