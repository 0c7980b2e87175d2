"""Activation checkpointing (checkpoint.py): exact gradients, the RNG, FLOPs, saved bytes.

torch.utils.checkpoint (use_reentrant=False) is the oracle here, never the implementation.
Everything runs in FP32 (or BF16) on CPU, where recompute must be bit-exact: the re-run
forward does the same ops on the same inputs with the same dropout masks.
"""
from conftest import in_backward
import gc
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

import accumulate
import checkpoint
import flops
import memory_ledger
import precision
from config import Config, UsageError
from guards import cli
from ledger import trace
from ledger.measure import LiveTensors, SavedBytes
from model import GPT, run_blocks_in_order
from tools.demos import counted_step_flops

B, T = 2, 32
SMALL = dict(block_size=T, n_layer=4, n_head=2, n_embd=32)
# (policy, ckpt_segment): sqrt with 3 blocks per unit over 4 layers leaves an uneven last unit
POLICIES = [("full", 0), ("sqrt", 0), ("sqrt", 3), ("selective", 0)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one thread beats two fighting over two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(policy="none", segment=0, dtype=torch.float32, **cfg):
    torch.manual_seed(0)
    config = Config(**{**SMALL, **cfg, "ckpt": policy, "ckpt_segment": segment})
    model = GPT(config).to(dtype)
    return checkpoint.apply_policy(model, checkpoint.policy(config))


def units(policy, n_layer, segment=0):
    """The runs of blocks a policy recomputes as units."""
    return checkpoint.POLICIES[policy](segment).block_units(n_layer)


def batch(vocab=256, seed=1, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def train_step(model, x, y, seed=123):
    """One forward+backward. Returns loss, {name: grad}, and the RNG state before and after backward."""
    torch.manual_seed(seed)
    _, loss = model(x, y)
    rng_after_forward = torch.get_rng_state()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, rng_after_forward, torch.get_rng_state()


def apply_oracle(model, policy, segment=0):
    """The same recompute units as apply_policy, with torch.utils.checkpoint doing the work."""
    checkpoint.apply_policy(model, checkpoint.NoRecompute())
    if policy in ("full", "sqrt"):
        groups = units(policy, len(model.h), segment)

        def run(blocks, x):
            for unit in groups:
                x = torch_checkpoint(run_blocks_in_order, [blocks[i] for i in unit], x, use_reentrant=False)
            return x
        model.block_runner = run
    elif policy == "selective":
        for block in model.h:
            core = block.attn.core
            core.forward = lambda *a, forward=core.forward: torch_checkpoint(forward, *a, use_reentrant=False)
    return model


@pytest.mark.parametrize("policy", ["full", "sqrt", "selective"])
def test_the_torch_reference_runs_the_policys_units(policy):
    # apply_policy with torch_recompute (make bench's reference row): PyTorch's checkpoint on our units,
    # the same gradients as the hand-written oracle above, and as ours
    x, y = batch()
    config = Config(**{**SMALL, "dropout": 0.2, "ckpt": policy})
    torch.manual_seed(0)
    reference = checkpoint.apply_policy(GPT(config), checkpoint.policy(config), recompute_fn=checkpoint.torch_recompute)
    theirs = train_step(reference, x, y)
    assert_same(theirs, train_step(apply_oracle(make_model(dropout=0.2), policy), x, y))
    assert_same(theirs, train_step(make_model(policy, dropout=0.2), x, y))


def test_the_benchmarks_pair_runs_both_recomputes_alike(monkeypatch):
    # make bench's ckpt reference (tools/bench.measure_pair): one model runs ours, the other PyTorch's own on
    # every unit; both save only the units' inputs, end at the same weights, and peak under a step without recompute
    from tools import bench
    flags = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=32", "--batch_size=2", "--precision=fp32",
             "--attn=manual", "--data=" + str(memory_ledger.__file__)]
    cpu = torch.device("cpu")
    full, none = cli.parse_args(flags + ["--ckpt=full"]), cli.parse_args(flags)
    runs = dict(bench.pair_models(full, cpu), none=bench.train.build(none, cpu))
    calls, real = [], torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    saved = {}
    for who, (model, _) in runs.items():
        counter = SavedBytes([*model.parameters(), *model.buffers()])
        with counter:
            model(*batch(t=full.block_size))
        saved[who] = counter.total
        assert len(calls) == (full.n_layer if who == "torch" else 0), \
            f"{who}: {len(calls)} torch.utils.checkpoint units, {full.n_layer if who == 'torch' else 0} expected"
        calls.clear()
    # torch.utils.checkpoint's own hooks keep a unit's insides from the counter: it sees the units' inputs, as ours
    assert saved["ours"] == saved["torch"] < saved["none"] / 2, f"bytes saved in forward: {saved}"
    monkeypatch.undo()
    row = bench.measure_pair(flags + ["--ckpt=full"], pairs=2, warmup=1)
    assert row["same_weights"], "ours and torch.utils.checkpoint's runs ended with different weights"
    assert len(row["time_ratios"]) == 2 and all(r > 0 for r in row["time_ratios"])
    micro = [tuple(torch.randint(0, 256, (2, 32)) for _ in range(2))]
    kept_all = bench.step_peak(*runs["none"], micro, none, cpu)
    for who in ("ours", "torch"):
        assert 0 < row[f"peak_{who}"] < kept_all, \
            f"{who}: a step with full recompute peaked at {row[f'peak_{who}']:,} bytes, without it {kept_all:,}"


def assert_same(a, b):
    """Loss and every parameter gradient equal, bit for bit."""
    assert torch.equal(a[0], b[0]), f"loss {a[0].item()!r} != {b[0].item()!r}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        ga, gb = a[1][name], b[1][name]
        assert ga is not None and gb is not None, name
        assert ga.dtype == gb.dtype and torch.equal(ga, gb), \
            f"{name}: max |diff| {(ga.float() - gb.float()).abs().max().item():.3g}"


# ---------------------------------------------------------------- the peak against PyTorch's own

# two shapes (n_layer=4, vocab 16, so the blocks' backward is the peak): one whose peak falls in a
# block's MLP backward, one whose peak falls in the attention's softmax backward
MLP_PEAK = dict(n_layer=4, n_embd=64, n_head=2, block_size=32, vocab_size=16, batch=4)
CORE_PEAK = dict(n_layer=4, n_embd=16, n_head=2, block_size=64, vocab_size=16, batch=2)


def peak_added(model, x, y):
    """Bytes a forward and backward add at their highest, every storage counted op by op."""
    tracker = LiveTensors("cpu")
    with tracker:
        tracker.adopt([*model.parameters(), *model.buffers(), x, y])
        tracker.reset_peak()
        start = tracker.read()
        _, loss = model(x, y)
        loss.backward()
    return tracker.peak - start


@pytest.mark.parametrize("policy, shape, under", [
    ("full", MLP_PEAK, 0), ("sqrt", MLP_PEAK, 0), ("selective", MLP_PEAK, 0),
    ("full", CORE_PEAK, 0), ("sqrt", CORE_PEAK, 0), ("selective", CORE_PEAK, 3)])
def test_our_peak_is_pytorchs_or_under(policy, shape, under):
    # the same saved-tensor hooks and early stop as torch.utils.checkpoint, so the same peak; except
    # that ours lets the unit's inputs go once its output node has re-run it (checkpoint.recompute's
    # docstring), where PyTorch's keep them to the unit's end: a core's q, k and v are views of
    # c_attn's (b, s, 3h) output, which its matmuls do not save (they copy the head views), so
    # under selective, where the softmax backward is the peak, ours is 3 b*s*h lower
    shape = dict(shape)
    b = shape.pop("batch")
    x, y = batch(vocab=shape["vocab_size"], b=b, t=shape["block_size"])
    peaks = {}
    for who, fn in (("ours", checkpoint.recompute), ("torch", checkpoint.torch_recompute)):
        torch.manual_seed(0)
        config = Config(**shape, ckpt=policy)
        peaks[who] = peak_added(checkpoint.apply_policy(GPT(config), checkpoint.policy(config), recompute_fn=fn), x, y)
    gradient = b * shape["block_size"] * shape["n_embd"] * 4  # one FP32 b*s*h tensor
    assert peaks["torch"] - peaks["ours"] == under * gradient, \
        f"peak ours {peaks['ours']:,} vs torch's {peaks['torch']:,} bytes: " \
        f"{(peaks['ours'] - peaks['torch']) / gradient:+g} b*s*h tensors, -{under} expected"


# ---------------------------------------------------------------- exactness

@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("policy,segment", POLICIES)
def test_gradients_equal_none_and_torch_checkpoint(policy, segment, dropout):
    x, y = batch()
    ref = train_step(make_model("none", dropout=dropout), x, y)
    ours = train_step(make_model(policy, segment, dropout=dropout), x, y)
    oracle = train_step(apply_oracle(make_model(dropout=dropout), policy, segment), x, y)
    assert_same(ours, ref)
    assert_same(ours, oracle)
    # backward must not disturb the caller's random stream: the RNG after backward is where
    # the forward left it, as in the none run (the re-run draws from a restored copy)
    assert torch.equal(ours[2], ref[2]) and torch.equal(ours[3], ref[3])
    assert torch.equal(ours[3], ours[2])
    if dropout:  # and the masks really are random: another seed gives another loss
        other = train_step(make_model(policy, segment, dropout=dropout), x, y, seed=7)
        assert not torch.equal(other[0], ours[0])


@pytest.mark.parametrize("policy,segment", POLICIES + [("none", 0)])
def test_the_naive_recompute_gives_the_real_ones_gradients(policy, segment):
    # the textbook Function (checkpoint.NaiveRecompute) beside the real one, every policy, with dropout:
    # the same loss and gradients bit for bit, the caller's random stream untouched by its re-run
    x, y = batch()
    torch.manual_seed(0)
    config = Config(**{**SMALL, "dropout": 0.2, "ckpt": policy, "ckpt_segment": segment, "ckpt_impl": "naive"})
    naive = checkpoint.apply_policy(GPT(config), checkpoint.policy(config),
                                    recompute_fn=checkpoint.IMPLEMENTATIONS[config.ckpt_impl])
    calls = []
    apply = checkpoint.NaiveRecompute.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint.NaiveRecompute, "apply", lambda *a: (calls.append(1), apply(*a))[1])
        theirs = train_step(naive, x, y)
    real = train_step(make_model(policy, segment, dropout=0.2), x, y)
    expected_units = len(units(policy, 4, segment)) + len(checkpoint.POLICIES[policy](segment).own_submodules(4))
    assert len(calls) == expected_units, f"{len(calls)} naive units ran, {expected_units} expected"
    assert_same(theirs, real)
    assert torch.equal(theirs[3], real[3]), "the naive re-run moved the caller's random stream"


def test_the_naive_recompute_keeps_only_its_inputs():
    # after the forward, a unit of the naive recompute holds what the real one holds: its input
    x, y = batch()
    saved = {}
    for impl in checkpoint.IMPLEMENTATIONS:
        torch.manual_seed(0)
        model = checkpoint.apply_policy(GPT(Config(**{**SMALL, "ckpt": "full"})), checkpoint.Full(),
                                        recompute_fn=checkpoint.IMPLEMENTATIONS[impl])
        with SavedBytes([*model.parameters(), *model.buffers()]) as counter:
            model(x, y)
        saved[impl] = counter.total
    assert saved["naive"] == saved["hooks"], f"bytes kept by the forward: {saved}"


def test_the_ckpt_impl_choices_are_checkpoints():
    from config import choices
    assert set(choices("ckpt_impl")) == set(checkpoint.IMPLEMENTATIONS)


@pytest.mark.parametrize("policy,segment", [("full", 0), ("sqrt", 0), ("selective", 0)])
def test_recomputed_dropout_masks_equal_the_forward_masks(policy, segment, monkeypatch):
    p = 0.5
    masks = []  # (recomputing?, which positions were dropped)
    dropout = F.dropout

    def recording_dropout(input, p=0.5, training=True, inplace=False):
        out = dropout(input, p, training, inplace)
        masks.append((in_backward(), out == 0))
        return out
    monkeypatch.setattr(F, "dropout", recording_dropout)  # nn.Dropout and model.core both call F.dropout
    model = make_model(policy, segment, dropout=p)
    x, y = batch()
    train_step(model, x, y)
    forward = [m for r, m in masks if not r]
    rerun = [m for r, m in masks if r]
    # forward order: embedding dropout, then (core, resid, mlp) per block
    per_block = [forward[1 + 3 * i: 4 + 3 * i] for i in range(len(model.h))]
    if policy == "selective":
        expected = [per_block[i][0] for i in reversed(range(len(model.h)))]  # the core alone, last block first
    else:  # a unit's last dropout draws its noise, saves it, and there the re-run stops (Unit.pack_rerun)
        expected = [m for unit in reversed(units(policy, len(model.h), segment))
                    for m in [m for i in unit for m in per_block[i]][:-1]]
    assert len(forward) == 1 + 3 * len(model.h) and len(rerun) == len(expected)
    for got, want in zip(rerun, expected):
        assert torch.equal(got, want)
    # the comparison means something: masks drop about p of the values and differ from block to block
    resid = [blk[1] for blk in per_block]
    assert 0.4 < resid[0].float().mean().item() < 0.6
    assert not torch.equal(resid[0], resid[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy,segment", [("full", 0), ("sqrt", 0), ("selective", 0)])
def test_16bit_params_gradients_equal_none(policy, segment, dtype):
    x, y = batch()
    ref = train_step(make_model("none", dtype=dtype, dropout=0.1), x, y)
    ours = train_step(make_model(policy, segment, dtype=dtype, dropout=0.1), x, y)
    assert ours[1]["h.0.mlp.c_fc.weight"].dtype == dtype
    assert_same(ours, ref)


def test_autocast_region_is_recomputed_under_autocast():
    # forward under autocast, backward outside it (the usual pattern): the re-run must
    # still run in BF16, or its activations, and so the gradients, would differ
    x, y = batch()

    def step(model):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    ref = step(make_model("none"))
    assert_same(step(make_model("full")), ref)
    assert_same(step(make_model("selective")), ref)


@pytest.mark.parametrize("precision_name,policy", [("fp32", "full"), ("fp32", "sqrt"), ("bf16", "full")])
def test_accumulation_steps_equal_none(precision_name, policy):
    prec = precision.decide(Config(precision=precision_name))
    micro = [batch(seed=s, b=1) for s in range(3)]  # K = 3

    def run(policy):
        model = make_model(policy, dtype=prec.param_dtype, dropout=0.1)
        opt = precision.MasterWeightOptimizer(model.parameters(), prec.master_weights, precision.AdamW(Config()),
                                                 lr=1e-2)
        buffers = accumulate.fp32_grad_buffers(model.parameters()) if prec.master_weights else None
        parts = accumulate.StepParts(prec, prec.loss_scaler(), opt, buffers)
        torch.manual_seed(5)
        losses = [accumulate.accumulation_step(model, parts, micro)[0] for _ in range(2)]
        return losses, [p.detach().clone() for p in model.parameters()]
    (ref_losses, ref_params), (losses, params) = run("none"), run(policy)
    assert losses == ref_losses and losses[1] < losses[0]
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_ddp_no_sync_accumulation_equals_none():
    """Under DDP every parameter's gradient must reach its reducer hook exactly once per
    backward, through the recompute unit's own nodes; with no_sync the earlier micro-steps skip it."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        micro = [batch(seed=s, b=1) for s in range(2)]
        results = []
        for policy in ("none", "full"):
            model = make_model(policy)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            prec = precision.decide(Config(precision="fp32"))
            opt = precision.MasterWeightOptimizer(model.parameters(), prec.master_weights, precision.AdamW(Config()),
                                                 lr=1e-2)
            parts = accumulate.StepParts(prec, prec.loss_scaler(), opt)
            loss = accumulate.accumulation_step(ddp, parts, micro, use_no_sync=True)[0]
            results.append((loss, [p.detach().clone() for p in model.parameters()]))
    finally:
        ddp = None  # (its last wrapper: freed below, before the group goes)
        gc.collect()  # the DDP wrappers (reference cycles) freed while the process group lives, as train.py does
        dist.destroy_process_group()
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


# ---------------------------------------------------------------- recompute() on its own

def grads_of(fn, args, leaves, runner):
    for t in leaves:
        t.grad = None
    torch.manual_seed(0)
    out = runner(fn, *args)
    out.sum().backward()
    return out.detach(), [t.grad for t in leaves]


def ours(fn, *args):
    return checkpoint.recompute(fn, *args)


def oracle(fn, *args):
    return torch_checkpoint(fn, *args, use_reentrant=False)


def direct(fn, *args):
    return fn(*args)


def test_recompute_non_tensor_args_and_a_closed_over_weight():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    seen = []

    def fn(x, scale, act, bias, mode):
        seen.append(in_backward())
        h = act(F.dropout(x @ w, 0.3) * scale)
        return h + 1.0 if (bias is None and mode == "plus") else h

    args = (x, 0.5, torch.tanh, None, "plus")
    want = grads_of(fn, args, [x, w], direct)
    for runner in (ours, oracle):
        got = grads_of(fn, args, [x, w], runner)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(g, r) for g, r in zip(got[1], want[1]))
    assert seen[:3] == [False, False, True]  # direct, our forward, our re-run (then the oracle's)


def test_recompute_input_that_does_not_require_grad():
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)  # data, not a parameter: no gradient wanted

    def fn(x):
        return (x @ w).sin()

    want = grads_of(fn, (x,), [w], direct)
    got = grads_of(fn, (x,), [w], ours)
    assert torch.equal(got[1][0], want[1][0]) and x.grad is None
    # nothing requires grad at all: no graph, and nothing to recompute
    out = checkpoint.recompute(lambda x: x * 2, x)
    assert not out.requires_grad and torch.equal(out, x * 2)


def test_recompute_tuple_output_with_an_unused_output():
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)

    def fn(x):
        return x.exp(), x.cos()

    a, _ = checkpoint.recompute(fn, x)
    a.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())
    # a 1-tuple stays a tuple, as fn returned it; an output that did not require grad still does not
    (one,) = checkpoint.recompute(lambda x: (x.sin(),), x)
    y, frozen = checkpoint.recompute(lambda x: (x.sin(), x.detach().cos()), x)
    assert one.requires_grad and y.requires_grad and not frozen.requires_grad


@pytest.mark.parametrize("outer", ["ours", "torch"])
def test_recompute_inside_a_recomputed_unit(outer):
    # the inner unit's inputs are saved through the outer unit's hooks, so the outer re-run files them
    # and the inner unit's output node takes them once (reading them twice would fail the second time)
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    inner = lambda h: (F.dropout(h @ w, 0.3) * 2).tanh()  # noqa: E731
    fn = lambda x: inner(x.sin()).cos() + 1  # noqa: E731
    nested = lambda x: checkpoint.recompute(inner, x.sin()).cos() + 1  # noqa: E731
    want = grads_of(fn, (x,), [x, w], direct)
    got = grads_of(nested, (x,), [x, w], ours if outer == "ours" else oracle)
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, r) for g, r in zip(got[1], want[1]))


def test_recompute_refuses_a_gradient_that_bypasses_its_outputs():
    # ours re-runs at the unit's output node: a tensor made inside and used outside would need its
    # saved tensors first (PyTorch's re-runs at the first unpack instead), so it is refused in one line
    x = torch.randn(5, requires_grad=True)
    inside = []

    def fn(x):
        inside.append(x.exp())  # exp saves its output: a slot of the unit
        return x.sin()

    checkpoint.recompute(fn, x)
    with pytest.raises(RuntimeError, match="used outside it"):
        inside[0].sum().backward()  # the unit's output node never runs: nothing was re-run


def test_recompute_contexts_wrap_the_forward_and_the_rerun():
    # what a precision needs around a unit (TE's recompute flags, fp8's weight mode): one context
    # around the forward, one around the re-run, made per unit from the callable the caller passes
    log, state = [], []

    class Tag:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            state.append(self.name)

        def __exit__(self, *exc):
            state.pop()

    def make():
        log.append("made")
        return Tag("forward"), Tag("rerun")

    x = torch.randn(4, requires_grad=True)
    fn = lambda t: (log.append((list(state), in_backward())) or t.sin())  # noqa: E731
    out = checkpoint.recompute(fn, x, contexts=make)
    core = checkpoint.recompute(fn, x)  # selective's unit: no precision context
    (out + core).sum().backward()
    assert log[0] == "made" and log[1] == (["forward"], False) and log[2] == ([], False)
    assert sorted(map(str, log[3:])) == sorted(map(str, [([], True), (["rerun"], True)]))
    assert torch.equal(x.grad, 2 * x.detach().cos())
    with torch.no_grad():  # evaluation: nothing is recomputed, so no context is made
        checkpoint.recompute(fn, x, contexts=make)
    assert log.count("made") == 1


# ---------------------------------------------------------------- policies

def test_each_policy_says_its_units():
    assert units("full", 4) == [[0], [1], [2], [3]]
    assert units("sqrt", 9) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert units("sqrt", 4, 3) == [[0, 1, 2], [3]]
    assert units("sqrt", 2, 5) == [[0, 1]]
    assert units("none", 4) == [] and units("selective", 4) == []
    assert checkpoint.Selective().submodule_units(3) == [(0, "attn.core"), (1, "attn.core"), (2, "attn.core")]
    assert checkpoint.Full().submodule_units(3) == []


def test_bad_policies_are_refused_in_words():
    with pytest.raises(UsageError, match="attn=manual"):
        make_model("selective", attn="sdpa")
    with pytest.raises(UsageError, match="none|full|sqrt|selective"):
        make_model("every_other")  # a policy nobody wrote cannot be asked for
    with pytest.raises(UsageError, match="ckpt_segment applies to ckpt=sqrt"):
        make_model("full", segment=2)
    with pytest.raises(UsageError, match="more blocks than n_layer"):
        make_model("sqrt", segment=5)
    make_model("full", attn="sdpa")  # whole blocks recompute fine around sdpa


class Scattered(checkpoint.Policy):
    name = "scattered"

    def block_units(self, n_layer):
        return [[2, 0]]


def test_a_policys_units_must_be_runs_of_blocks(monkeypatch):
    monkeypatch.setitem(checkpoint.POLICIES, "scattered", Scattered)
    with pytest.raises(ValueError, match="consecutive"):
        make_model("scattered")


class EveryOther(checkpoint.Policy):
    """A policy a learner might add: every other block recomputed (0, 2, ...), the rest kept."""
    name, help = "every_other", "blocks 0, 2, 4, ... recomputed, the others kept"

    def block_units(self, n_layer):
        return [[i] for i in range(0, n_layer, 2)]


def test_a_new_policy_is_one_class(monkeypatch, tmp_path):
    """Registered in checkpoint.POLICIES and nowhere else, a policy trains, its gradients equal
    ckpt=none's and torch.utils.checkpoint's on the same units bit for bit, its HFU counts its
    re-runs, `--help` lists it, and the ledger predicts what it saves and its peak to the byte."""
    import train
    from tools import ledger as tool
    monkeypatch.setitem(checkpoint.POLICIES, "every_other", EveryOther)
    x, y = batch()
    ref = train_step(make_model("none", dropout=0.2), x, y)
    ours = train_step(make_model("every_other", dropout=0.2), x, y)
    assert_same(ours, ref)
    oracle = make_model(dropout=0.2)
    inner = oracle.block_runner

    def run(blocks, h):
        for i, block in enumerate(blocks):
            h = torch_checkpoint(block, h, use_reentrant=False) if i % 2 == 0 else block(h)
        return h
    oracle.block_runner = run
    assert_same(ours, train_step(oracle, x, y))
    assert inner is run_blocks_in_order
    per_token = flops.per_token(Config(**SMALL, ckpt="every_other"))[1]
    assert per_token * 2 == flops.per_token(Config(**SMALL, ckpt="full"))[1], "HFU's extra FLOPs of every other block"
    assert "every_other" in cli.usage()
    flags = ["--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--max_iters=2",
             "--sample_tokens=0", "--ledger=false", "--ckpt=every_other", f"--out_dir={tmp_path}"]
    assert train.main(flags) == 0 and (tmp_path / "snapshot.pt").exists()
    cfg = cli.parse_args(flags[:5] + ["--ckpt=every_other", "--dropout=0.1", "--device=cpu"])
    meas, traced = tool.run_config(cfg, torch.device("cpu")), trace.step(cfg)
    rows, ok = tool.compare(cfg, traced, meas)
    assert ok, tool.failure(cfg, rows)
    assert traced["rng_states"] == 2 * torch.get_rng_state().numel(), "one RNG state each for units 0 and 2"


# ---------------------------------------------------------------- FLOPs

def step_flops(model, x, y):
    with FlopCounterMode(display=False) as counter:
        train_step(model, x, y)
    return counter.get_total_flops()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_flops(dropout):
    x, y = batch()
    models = {p: make_model(p, dropout=dropout) for p in ("none", "full", "sqrt", "selective")}
    total = {p: step_flops(m, x, y) for p, m in models.items()}
    m = models["none"]
    # the blocks alone: one forward, and one forward + backward
    h = torch.randn(B, T, SMALL["n_embd"], requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            run_blocks_in_order(m.h, h)
    with FlopCounterMode(display=False) as fwd_bwd:
        run_blocks_in_order(m.h, h).sum().backward()
    blocks_fwd, blocks_fwd_bwd = fwd.get_total_flops(), fwd_bwd.get_total_flops()
    assert blocks_fwd_bwd == 3 * blocks_fwd  # backward of a matmul is two matmuls of its size
    # the attention core alone (QK^T and @V), times the layers
    q, k, v = torch.randn(3, B, SMALL["n_head"], T, SMALL["n_embd"] // SMALL["n_head"]).unbind(0)
    with FlopCounterMode(display=False) as core:
        m.h[0].attn.core(q, k, v)
    core_flops = SMALL["n_layer"] * core.get_total_flops()
    assert core_flops == SMALL["n_layer"] * 2 * (2 * B * T * T * SMALL["n_embd"])
    with FlopCounterMode(display=False) as proj:  # a block's MLP output projection
        with torch.no_grad():
            m.h[0].mlp.c_proj(torch.randn(B, T, 4 * SMALL["n_embd"]))

    # every block re-runs once, but each re-run stops at the last tensor its unit saves: before the
    # unit's last MLP projection (which saves its input first) unless a dropout after it saves its noise
    for policy in ("full", "sqrt"):
        n_units = len(units(policy, SMALL["n_layer"]))
        skipped = 0 if dropout else n_units * proj.get_total_flops()
        assert total[policy] - total["none"] == blocks_fwd - skipped, policy
    # a core's re-run stops before att @ v (it saves att and v first): QK^T alone, half the core
    assert total["selective"] - total["none"] == core_flops // 2
    step_ratio = (total["full"] - total["none"]) / total["none"]
    assert 0.15 < step_ratio < 1 / 3  # the embedding/head, not recomputed, dilute the 33%
    # without the early stop (precision.Precision.rerun_stops_early: TE) every re-run runs to its unit's end,
    # ours and PyTorch's alike, with the same gradients
    for recompute_fn in (checkpoint.recompute, checkpoint.torch_recompute):
        for policy, extra in (("full", blocks_fwd), ("selective", core_flops)):
            whole = [checkpoint.apply_policy(make_model(dropout=dropout), checkpoint.POLICIES[policy](),
                                             recompute_fn=recompute_fn, stop_early=False) for _ in range(2)]
            assert step_flops(whole[0], x, y) - total["none"] == extra, (recompute_fn.__name__, policy)
            assert flops.per_token(Config(**SMALL, ckpt=policy, dropout=dropout), stop_early=False)[1] * B * T \
                == extra, f"{policy}: HFU's extra FLOPs without the early stop"
            assert_same(train_step(whole[1], x, y), train_step(make_model(dropout=dropout), x, y))
    for policy in ("none", "full", "sqrt", "selective"):  # HFU's extra term is the counted extra
        per_token = flops.per_token(Config(**SMALL, ckpt=policy, dropout=dropout))[1]
        assert per_token * B * T == total[policy] - total["none"], \
            f"{policy}: HFU's extra FLOPs {per_token * B * T:,.0f}, FlopCounterMode's {total[policy] - total['none']:,}"


# ---------------------------------------------------------------- saved activations

LAYERS = (4, 9, 16, 25)
MEM = dict(vocab_size=16, block_size=16, n_head=2, n_embd=16)  # tiny, so the head does not dominate
MB = 2


@pytest.fixture(scope="module")
def saved():
    """{policy: {L: (forward bytes, backward re-run bytes, peak live bytes)}}."""
    out = {}
    x, y = batch(vocab=MEM["vocab_size"], b=MB, t=MEM["block_size"])
    for policy in ("none", "full", "sqrt", "selective"):
        out[policy] = {}
        for L in LAYERS:
            model = make_model(policy, n_layer=L, **MEM)
            # state and the batch (memory_ledger's "inputs"), not activations
            counter = SavedBytes([*model.parameters(), *model.buffers(), x, y])
            with counter:
                _, loss = model(x, y)
            forward = counter.total
            with counter:
                loss.backward()
            assert counter.live == 0  # everything saved was released by the end of backward
            out[policy][L] = (forward, counter.total - forward, counter.peak)
    return out


def fit(xs, ys):
    """Least-squares line through (xs, ys): slope, intercept, largest residual."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    icpt = my - slope * mx
    return slope, icpt, max(abs(b - (slope * a + icpt)) for a, b in zip(xs, ys))


def exponent(xs, ys):
    return fit([math.log(a) for a in xs], [math.log(b) for b in ys])[0]


INPUT = MB * MEM["block_size"] * MEM["n_embd"] * 4  # one block input, (B, T, h) FP32


def test_saved_bytes_none_grows_linearly(saved):
    fwd = [saved["none"][L][0] for L in LAYERS]
    per_layer, rest, err = fit(LAYERS, fwd)
    assert err < 1e-6 * fwd[-1] and per_layer > 10 * INPUT  # a block keeps far more than its input
    assert 0.95 < exponent(LAYERS, fwd) <= 1.0
    assert all(saved["none"][L][1] == 0 for L in LAYERS)  # nothing re-run
    assert all(saved["none"][L][2] == saved["none"][L][0] for L in LAYERS)  # peak: end of forward


def test_saved_bytes_full_one_input_per_layer_plus_one_live_block(saved):
    per_layer, rest, _ = fit(LAYERS, [saved["none"][L][0] for L in LAYERS])
    for L in LAYERS:
        forward, rerun, peak = saved["full"][L]
        # the forward keeps exactly one block input per layer, beside what none keeps outside the blocks
        assert forward == round(rest) + L * INPUT
        # backward re-runs every block once; each re-run saves a block's internals, its
        # input already being held (so none's per-layer bytes less one input)
        assert rerun == L * (per_layer - INPUT)
        # at the peak, the L inputs and one block's internals are live: never two blocks
        one_block = peak - L * INPUT
        assert per_layer - INPUT <= one_block < per_layer
    slope, _, err = fit(LAYERS, [saved["full"][L][2] for L in LAYERS])
    assert slope == pytest.approx(INPUT) and err < 1e-6 * INPUT


def test_saved_bytes_sqrt_grows_as_sqrt_L(saved):
    per_layer, rest, _ = fit(LAYERS, [saved["none"][L][0] for L in LAYERS])
    for L in LAYERS:
        k = math.isqrt(L)  # L is a square, so L/k = k units of k blocks
        forward, rerun, peak = saved["sqrt"][L]
        assert forward == round(rest) + k * INPUT  # one input per unit: sqrt(L) of them
        segment = rerun // k  # what one unit's re-run saves: k blocks, less its held input
        assert rerun == k * segment and segment == k * per_layer - INPUT
        assert 0 <= peak - (k * INPUT + segment) < INPUT  # k inputs + one live unit
    peaks = [saved["sqrt"][L][2] for L in LAYERS]
    assert 0.45 < exponent(LAYERS, peaks) < 0.55
    _, _, err = fit([math.sqrt(L) for L in LAYERS], peaks)
    assert err < 1e-6 * peaks[-1]  # exactly a line in sqrt(L)


def test_saved_bytes_selective_drops_the_attention_matrix(saved):
    c = MEM
    softmax = MB * c["n_head"] * c["block_size"] ** 2 * 4  # (B, heads, T, T) FP32 probabilities
    none_per_layer = fit(LAYERS, [saved["none"][L][0] for L in LAYERS])[0]
    sel_per_layer, _, err = fit(LAYERS, [saved["selective"][L][0] for L in LAYERS])
    assert err < 1e-6 * saved["selective"][LAYERS[-1]][0]
    assert none_per_layer - sel_per_layer == pytest.approx(softmax)  # the mask is a view of a buffer
    for L in LAYERS:
        assert saved["selective"][L][2] < saved["none"][L][2]


def test_saved_bytes_equal_the_memory_ledger_formulas(saved):
    # the ledger's formulas are derived from model.py's ops; here both are held to the bytes
    for policy in saved:
        for L in LAYERS:
            shape = Config(n_layer=L, batch_size=MB, precision="fp32", ckpt=policy, **MEM)
            traced = trace.step(shape)["activations"]
            assert saved[policy][L][0] == traced, f"{policy}, L={L}: saved {saved[policy][L][0]:,}, traced {traced:,}"


@pytest.mark.parametrize("policy", ["full", "sqrt", "selective"])
def test_no_grad_evaluation_equals_none(policy):
    # estimate_loss and generate run the policy's model under no_grad: same logits, no graph
    x, _ = batch()
    with torch.no_grad():
        want, _ = make_model("none", dropout=0.1).eval()(x)
        got, _ = make_model(policy, dropout=0.1).eval()(x)
    assert torch.equal(got, want) and not got.requires_grad


def test_counted_step_flops_cli_agrees_with_the_formula():
    flags = ["--n_layer=3", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2"]
    counted = counted_step_flops(flags)
    shape, tokens = dict(n_layer=3, n_embd=32, n_head=2, block_size=16), 2 * 16
    for policy in ("full", "sqrt", "selective"):
        extra = flops.per_token(Config(**shape, ckpt=policy))[1]
        assert counted[policy] - counted["none"] == extra * tokens, f"{policy}: HFU's extra FLOPs"
    assert counted["none"] == flops.per_token(Config(**shape))[0] * tokens, "MFU's FLOPs"


class MLPOnly(checkpoint.Policy):
    """A learner's policy: each block's MLP a unit of its own (its input kept, the MLP re-run in backward)."""
    name, help = "mlp", "each block's MLP a unit: its input kept, the MLP re-run in backward"

    def submodule_units(self, n_layer):
        return [(i, "mlp") for i in range(n_layer)]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_an_mlp_only_policy_is_one_class(monkeypatch, dropout):
    """Registered in checkpoint.POLICIES and nowhere else, a policy whose unit is a submodule (the MLP)
    trains with ckpt=none's and torch.utils.checkpoint's gradients, its HFU counts what FlopCounterMode
    counts, and the ledger (every component, the RNG states, the peak, the TP rows) follows it exactly."""
    from tools import ledger as tool
    from ledger import parallel
    monkeypatch.setitem(checkpoint.POLICIES, "mlp", MLPOnly)
    x, y = batch()
    ours = train_step(make_model("mlp", dropout=dropout), x, y)
    assert_same(ours, train_step(make_model("none", dropout=dropout), x, y))
    oracle = make_model(dropout=dropout)
    for block in oracle.h:
        block.mlp.forward = lambda h, forward=block.mlp.forward: torch_checkpoint(forward, h, use_reentrant=False)
    assert_same(ours, train_step(oracle, x, y))
    # the re-run stops after the last tensor the MLP saves: its c_proj's input without dropout, the mask with it
    extra = step_flops(make_model("mlp", dropout=dropout), x, y) - step_flops(make_model("none", dropout=dropout), x, y)
    assert flops.per_token(Config(**SMALL, ckpt="mlp", dropout=dropout))[1] * B * T == extra, "HFU's extra FLOPs"
    for prec in ("fp32", "bf16"):
        cfg = cli.parse_args(["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2",
                              f"--precision={prec}", f"--dropout={dropout}", "--ckpt=mlp", "--device=cpu"])
        meas, traced = tool.run_config(cfg, torch.device("cpu")), trace.step(cfg)
        rows, ok = tool.compare(cfg, traced, meas)
        assert ok, tool.failure(cfg, rows)
        assert meas["rng_states"] == cfg.n_layer * torch.get_rng_state().numel(), "one RNG state per MLP unit"
        # the TP rows follow the policy: at t = 1 they are what was measured, at t = 2 the split part halves
        tp = {t: parallel.tp_components(cfg, t, sp=False)["activations"] for t in (1, 2)}
        assert tp[1] == meas["activations"], f"TP t=1 activations {tp[1]:,}, measured {meas['activations']:,}"
        assert tp[2] < tp[1]
