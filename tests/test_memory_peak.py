"""The derived peak (memory_timeline.py's walk) against the measured CPU peak, and the walk's own bookkeeping."""
import itertools
from dataclasses import replace

import pytest
import torch

import fp8
import memory_ledger as ml
import memory_linear
import memory_measure
import memory_parallel as mp
import memory_timeline
import train
from config import Config, parse_args
from memory_ops import KEPT, SAVED
from tools import ledger as tool

# activation-heavy: the states are a few MB, the activations tens of MB (issue 10, defect 4)
HEAVY = ["--n_layer=4", "--n_embd=64", "--n_head=4", "--block_size=256", "--batch_size=4", "--seed=3"]


def peaks(argv):
    cfg = replace(parse_args(HEAVY + argv), device="cpu")
    return ml.peak_estimate(cfg)[0], tool.run_config(cfg, torch.device("cpu"))["peak"]


@pytest.mark.parametrize("dropout", ["0.0", "0.1"])
@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
def test_peak_exact_bf16(ckpt, dropout):
    predicted, measured = peaks(["--precision=bf16", f"--ckpt={ckpt}", f"--dropout={dropout}"])
    assert predicted == measured


@pytest.mark.parametrize("argv", [["--precision=fp32", "--ckpt=full"], ["--precision=fp32", "--ckpt=selective"],
                                  ["--attn=sdpa", "--ckpt=sqrt"], ["--attn=sdpa", "--dropout=0.1", "--ckpt=full"],
                                  ["--precision=fp16", "--ckpt=sqrt", "--ckpt_segment=3"],
                                  ["--fp32_grad_accum", "--ckpt=selective"], ["--bias=false", "--ckpt=full"]])
def test_peak_exact_variants(argv):
    predicted, measured = peaks(argv)
    assert predicted == measured


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
    predicted, measured = peaks(["--precision=fp8"] + argv)
    assert predicted == measured


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--fp8_grad=e5m2", "--ckpt=full"],
                                  ["--precision=fp8", "--ckpt=selective", "--bias=false"], ["--precision=fp16"]])
def test_the_walk_starts_backward_with_what_is_measured(argv):
    # the walk's first point is the live bytes when backward starts (memory_measure's "backward" reading), plus
    # the loss times its weight (and its scale) made right after: for FP8 every Linear's kept E4M3 weight is there
    cfg = replace(parse_args(HEAVY + argv), device="cpu")
    meas, walk = tool.run_config(cfg, torch.device("cpu")), ml.peak_walk(cfg)
    assert walk.steps[0] == "end of forward"
    assert walk.totals[0] == meas["phase"]["backward"] + 4 + (4 if ml.timeline_sizes(cfg).loss_scaled else 0)


def kept_at(cfg, where, monkeypatch):
    """Bytes of the kept FP8 weight copies alive at the walk's last step named `where` (its new ones too)."""
    found, real = [], memory_timeline.Walk.step

    def step(walk, at, new=(), free=()):
        if at == where:
            found.append(sum(n for n, kind in walk.alive.values() if kind == KEPT)
                         + sum(n for _, n, kind in new if kind == KEPT))
        real(walk, at, new, free)
    with monkeypatch.context() as m:
        m.setattr(memory_timeline.Walk, "step", step)
        ml.peak_walk(cfg)
    assert found, f"the walk has no step {where!r}"
    return found[-1]


@pytest.mark.parametrize("grad", ["bf16", "e5m2"])
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
def test_fp8_kept_weights_are_in_the_walk_until_released(grad, ckpt, monkeypatch):
    # every Linear's E4M3 weight from the forward (e5m2: its column-major twin from the backward) until just
    # before AdamW; what is released is the ledger's fp8_kept, which test_every_component_exact measures
    cfg = Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, precision="fp8", fp8_grad=grad,
                 ckpt=ckpt)
    L, h, kept = cfg.n_layer, cfg.n_embd, ml.state_bytes(cfg)["fp8_kept"]
    twins = 12 * h * h * L if grad == "e5m2" else 0
    shared_scales = 4 * 8 * L if ckpt != "full" else 0  # a saved tensor too, until its node's backward
    assert kept_at(cfg, "end of forward", monkeypatch) == kept - twins - shared_scales > 12 * h * h * L
    assert kept_at(cfg, "FP8 weight copies released", monkeypatch) == kept
    assert kept_at(cfg, "optimizer step: FP32 master gradients", monkeypatch) == 0
    assert kept_at(replace(cfg, precision="bf16"), "end of forward", monkeypatch) == 0


def test_selective_peak_is_the_recomputed_core_in_backward():
    # the old estimate left out the softmax-gradient pair of the recomputed core (-13% here)
    cfg = replace(parse_args(HEAVY + ["--ckpt=selective"]), device="cpu")
    _, where, _ = ml.peak_estimate(cfg)
    assert "softmax backward" in where


CONFIGS = [dict(precision=p, ckpt=c, attn=a, dropout=d, bias=b, fp32_grad_accum=g, device=dev)
           for p, c, a, d, b, g, dev in itertools.product(("fp32", "bf16", "fp16", "fp8"),
                                                          ("none", "full", "sqrt", "selective"), ("manual", "sdpa"),
                                                          (0.0, 0.1), (True, False), (False, True), ("cpu", "cuda"))
           if not (c == "selective" and a == "sdpa")]


def test_the_walk_frees_everything_it_makes():
    # after the optimizer step nothing the walk made is alive: no tensor forgotten, none freed twice
    for kw in CONFIGS:
        w = ml.peak_walk(Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, **kw))
        assert w.alive == {} and w.total == w.static, kw


@pytest.mark.parametrize("kw", [dict(), dict(attn="sdpa", dropout=0.1), dict(precision="fp8", attn="sdpa"),
                                dict(precision="fp32", attn="sdpa", dropout=0.1), dict(dropout=0.1, device="cuda")])
def test_the_walks_forward_saves_the_ledgers_terms(kw):
    # a block's forward in the walk leaves alive exactly block_activation_terms (names and bytes); with FP8 also
    # each Linear's kept E4M3 weight and amax: made by the step's first forward, reused by a recompute's re-run
    cfg = Config(n_layer=2, n_embd=32, n_head=2, block_size=16, batch_size=2, **kw)
    z, terms = ml.timeline_sizes(cfg), dict(ml.block_activation_terms(cfg))
    kept = {name: n for name, n, _ in memory_linear.kept_copies(replace(z, L=1), with_scales=False)} if z.fp8 else {}
    for rerun in (False, True):
        w = memory_timeline.Walk(0)
        w.step("input", new=[("0.ln_1 input", terms["ln_1 input"], SAVED)]
               + [(name, n, KEPT) for name, n in kept.items() if rerun])
        memory_timeline.block_forward(w, "0.", z, terms, "0.ln_1 input", "1.ln_1 input")
        saved = {name[2:]: n for name, (n, kind) in w.alive.items() if name.startswith("0.") and kind == SAVED}
        assert saved == terms
        assert {name: n for name, (n, kind) in w.alive.items() if kind == KEPT} == kept
        assert set(w.alive) == {"1.ln_1 input"} | {"0." + name for name in terms} | set(kept)


class EveryTotal(memory_measure.LiveTensors):
    """LiveTensors that keeps its count after every op."""

    def __init__(self, device):
        super().__init__(device)
        self.totals = []

    def _count(self):
        self.totals.append(super()._count())
        return self.totals[-1]


@pytest.mark.parametrize("argv", [["--precision=fp8"], ["--precision=fp8", "--attn=sdpa", "--dropout=0.1"],
                                  ["--precision=fp8", "--bias=false", "--fp8_recipe=current"],
                                  ["--precision=bf16", "--dropout=0.1"], ["--precision=fp32", "--attn=sdpa"]])
def test_a_blocks_forward_is_walked_as_measured(argv):
    """One block's forward with autograd recording, counted op by op and walked by block_forward: the
    same peak and the same bytes left, to the byte, and every point where a Linear's walk allocates
    (1 KiB or more) is a measured point, in order. FP8 twice: micro-step 1 (W times its scale in FP32,
    its E4M3 copy kept), then micro-step 2, which reuses the copy as a recompute's re-run does."""
    cfg = replace(parse_args(["--n_layer=2", "--n_embd=64", "--n_head=2", "--block_size=64", "--batch_size=2"] + argv),
                  device="cpu")
    model, parts = train.build(cfg, torch.device("cpu"))
    x = torch.randn(cfg.batch_size, cfg.block_size, cfg.n_embd, dtype=parts.recipe.param_dtype, requires_grad=True)
    z, terms = ml.timeline_sizes(cfg), dict(ml.block_activation_terms(cfg))
    kept = memory_linear.kept_copies(replace(z, L=1), with_scales=True) if z.fp8 else []
    for micro_step in (0, 1):
        copies = [m.weight_copy for m in fp8.layers(model.h[0]) if m.weight_copy is not None]
        tracker = EveryTotal("cpu")
        with tracker:
            tracker.adopt(list(model.parameters()) + list(model.buffers()) + [x]
                          + [t for c in copies for t in (c.data, c.scale, c.amax)])
            tracker.reset_peak()
            start = tracker.read()
            with parts.recipe.forward_context(micro_step=micro_step):
                y = model.h[0](x)
            measured = (tracker.peak - start, tracker.read() - start)
        del y
        walk = memory_timeline.Walk(0)
        walk.step("input", new=[("0.ln_1 input", terms["ln_1 input"], SAVED)] + (kept if micro_step else []))
        before = walk.total
        memory_timeline.block_forward(walk, "0.", z, terms, "0.ln_1 input", "1.ln_1 input")
        assert (walk.peak - before, walk.total - before) == measured, micro_step
        assert len(copies) == (4 if z.fp8 and micro_step else 0)
        points, at = [t - start for t in tracker.totals], 0
        for i in range(1, len(walk.steps)):
            linear = any(f".{m}.c_" in walk.steps[i] for m in ("attn", "mlp"))
            if linear and walk.totals[i] - walk.totals[i - 1] >= 1024:
                assert walk.totals[i] - before in points[at:], (walk.steps[i], micro_step)
                at = points.index(walk.totals[i] - before, at)


def test_every_gradient_is_counted_once(monkeypatch):
    # when backward is done, the parameter gradients the walk has made add up to e*P, once each
    at_end, real = [], memory_timeline.Walk.step

    def spy(w, where, new=(), free=()):
        if where == "backward done":
            at_end.append(sum(n for n, kind in w.alive.values() if kind == memory_timeline.GRAD))
        return real(w, where, new, free)
    monkeypatch.setattr(memory_timeline.Walk, "step", spy)
    for kw in CONFIGS[::5]:
        cfg = Config(n_layer=3, n_embd=32, n_head=2, block_size=16, batch_size=2, **kw)
        ml.peak_walk(cfg)
        assert at_end[-1] == ml.timeline_sizes(cfg).e * ml.param_count(cfg)[0], kw


def test_largest_micro_batch_is_the_walks():
    # the linear solve (two walks) agrees with walking at b and b+1
    for name, ckpt, shard in [("GPT-2 XL", "full", 1), ("GPT-2 XL", "selective", 8), ("7B", "full", 8)]:
        cfg = mp.big_config(name, ckpt=ckpt)
        b = mp.largest_micro_batch(cfg, 80 * 2 ** 30, shard)
        assert b > 0
        assert ml.peak_estimate(replace(cfg, batch_size=b), shard)[0] <= 80 * 2 ** 30 < \
            ml.peak_estimate(replace(cfg, batch_size=b + 1), shard)[0]
    assert mp.largest_micro_batch(mp.big_config("175B (GPT-3)"), 80 * 2 ** 30) == 0  # 2.79 TB of states alone
