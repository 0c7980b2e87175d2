"""precision.py: decide (a run's Precision), the loss scaler against torch.amp.GradScaler, master weights,
FP16's underflow, and the dtype table demo (FP8 is tests/test_fp8.py).
CPU, tiny models: FP16 matmuls run at about 1 GFLOP/s on CPU."""
import copy

import pytest
import torch

import accumulate
import data
import precision
import train
from config import Config, UsageError
from guards.cli import parse_args
from conftest import loss_scale, merged, scaled_backward
from fp8 import E4M3, E5M2
from precision import LossScaler, MasterWeightOptimizer
from tools import demos
from backends import fp8_refined
from model import default_linear
import fp8

# make test gives each file to one xdist worker (--dist loadfile), and the fixtures here are
# session-wide: a worker runs other files' tests in between, which would end a module's

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8", "--warmup_iters=5",
        "--learning_rate=3e-3", "--eval_interval=100000", "--log_interval=100000", "--sample_tokens=0",
        "--ledger=false", "--peak_flops=1"]


def tiny_cfg(tmp_path, *extra):
    return parse_args(merged(*TINY, f"--out_dir={tmp_path}", *extra))


def run_losses(tmp_path, *extra):
    history = train.train(tiny_cfg(tmp_path, *extra), log=lambda s: None)
    return [r["loss"] for r in history], history


STEPS = 30  # enough for the byte-level loss to fall from ~5.5 (ln 256) by more than 1


@pytest.fixture(scope="session")
def bf16_losses(tmp_path_factory):
    """The BF16 run every low-precision run is compared with (same seed, data, steps)."""
    return run_losses(tmp_path_factory.mktemp("bf16"), "--precision=bf16", f"--max_iters={STEPS}")[0]


def tail(losses):
    return sum(losses[-5:]) / 5


def a_batch(cfg, seed=0):
    tokens = data.load_tokens("")
    return data.Batches(tokens, cfg.block_size, cfg.batch_size, seed, torch.device("cpu")).next()


# ---------------------------------------------------------------- the loss scaler

def drive_gradscaler(overflows, growth_interval, factors=(2.0, 0.5)):
    """torch.amp.GradScaler (the oracle) through steps whose gradient is inf where overflows[i]."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_factor=factors[0], backoff_factor=factors[1],
                              growth_interval=growth_interval)
    scales, skipped = [], 0
    for bad in overflows:
        before = p.detach().clone()
        c = torch.full((4,), 1e-3)
        if bad:
            c[2] = float("inf")
        opt.zero_grad()
        gs.scale((p * c).sum()).backward()  # grad = c * scale
        gs.step(opt)
        gs.update()
        skipped += torch.equal(before, p.detach())
        scales.append(gs.get_scale())
    return scales, skipped


def drive_ours(overflows, growth_interval, hysteresis=1, factors=(2.0, 0.5)):
    """Our scaler, as the config builds it, beside MasterWeightOptimizer (so its one-reduction inf check runs)."""
    model = torch.nn.Linear(4, 4).half()
    prec = precision.decide(Config(precision="fp16", loss_scale_hysteresis=hysteresis, loss_scale_growth=factors[0],
                                     loss_scale_backoff=factors[1], loss_scale_interval=growth_interval))
    scaler = prec.loss_scaler()
    parts = accumulate.StepParts(prec, scaler, MasterWeightOptimizer(model.parameters(), True, precision.AdamW(Config()), lr=0.1))
    scales, stepped_flags = [], []
    for bad in overflows:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3 * scaler.loss_scale)
        if bad:
            model.weight.grad[1, 2] = float("inf")  # one element of one gradient
        stepped, _ = accumulate.optimizer_step(parts)
        stepped_flags.append(stepped)
        scales.append(scaler.loss_scale)
    return scales, scaler.skipped_steps, stepped_flags


OVERFLOWS = [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("factors", [(2.0, 0.5), (1.5, 0.25)])  # the config's growth and back-off factors
def test_scaler_trajectory_matches_gradscaler(factors):
    want_scales, want_skipped = drive_gradscaler(OVERFLOWS, growth_interval=3, factors=factors)
    scales, skipped, stepped = drive_ours(OVERFLOWS, growth_interval=3, factors=factors)
    differ = [(i, ours, theirs) for i, (ours, theirs) in enumerate(zip(scales, want_scales)) if ours != theirs]
    assert not differ, "the loss scale after step i: ours, GradScaler's (same factors " + str(factors) + "): " + \
        "; ".join(f"step {i}: {ours:g}, {theirs:g}" for i, ours, theirs in differ)
    assert skipped == want_skipped == sum(OVERFLOWS), f"skipped steps: ours {skipped}, GradScaler's {want_skipped}, " \
                                                      f"overflows planted {sum(OVERFLOWS)}"
    assert stepped == [not b for b in OVERFLOWS], f"steps taken {stepped}, overflows planted {OVERFLOWS}"
    assert len(set(scales)) > 2  # the sequence both grows and backs off


def test_scaler_hysteresis_tolerates_overflows_before_backing_off():
    # hysteresis=2 (Megatron-LM's rule): the first overflow since the last growth is skipped
    # but keeps the scale; from the second on, each one backs off until a growth restores it
    s0 = 2.0 ** 16
    scales, skipped, stepped = drive_ours([0, 1, 0, 1, 1, 0], growth_interval=100, hysteresis=2)
    assert scales == [s0, s0, s0, s0 / 2, s0 / 4, s0 / 4]
    assert skipped == 3 and stepped == [True, False, True, False, False, True]
    scales, _, _ = drive_ours([1, 0, 0, 1, 1], growth_interval=2, hysteresis=2)
    assert scales == [s0, s0, 2 * s0, 2 * s0, s0]
    # hysteresis=1 is GradScaler's behaviour (checked against it above)
    assert drive_ours([1, 1], growth_interval=100, hysteresis=1)[0] == [s0 / 2, s0 / 4]


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_the_overflows_a_scaler_explains_are_its_own_count(hysteresis):
    # the oracle: the scaler itself, overflowing until its scale is 1 and its next overflow is a back-off
    # (2^29: where a logarithm's rounding once counted one more)
    for exponent in (0, 1, 16, 29, 31, 62):
        scaler = LossScaler("dynamic", init_scale=2.0 ** exponent, hysteresis=hysteresis)
        explained, skips = precision.overflows_explained(scaler, scaler.loss_scale), 0
        while scaler.loss_scale > 1 or scaler.overflows_left > 1:
            scaler.update(found_inf=True)
            skips += 1
        assert explained == skips, f"from 2^{exponent}, hysteresis {hysteresis}: the allowance says {explained} " \
                                   f"skips, the scaler reached 1 with no tolerance left after {skips}"


def test_scaler_from_config_modes():
    scaler = lambda loss_scale, prec: precision.decide(Config(loss_scale=loss_scale, precision=prec)).loss_scaler()
    assert scaler("auto", "fp16").mode == "dynamic"
    assert scaler("auto", "bf16") is None, "BF16 scales no loss"
    assert scaler("1024", "fp16").loss_scale == 1024.0
    for bad in ("-1", "inf", "big"):
        with pytest.raises(UsageError):
            parse_args([f"--loss_scale={bad}", "--precision=fp16"])


def state_of(model, opt):
    return ([p.detach().clone() for p in model.parameters()], [m.detach().clone() for m in opt.master_params],
            copy.deepcopy(opt.torch_optimizer.state_dict()["state"]))


def assert_same_state(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        for name in a[2][k]:
            assert torch.equal(torch.as_tensor(a[2][k][name]), torch.as_tensor(b[2][k][name]))


def test_injected_inf_skips_exactly_that_step(tmp_path):
    cfg = tiny_cfg(tmp_path, "--precision=fp16", "--n_layer=1", "--n_embd=16", "--block_size=16", "--batch_size=2")
    model, parts = train.build(cfg, torch.device("cpu"))
    opt = parts.optimizer
    x, y = a_batch(cfg)
    stepped, states, scales = [], [], [parts.scaler.loss_scale]
    for step in range(4):
        with parts.precision.forward_context(model):
            _, loss = model(x, y)
        parts.scaler.backward(loss)
        if step == 2:
            model.h[0].mlp.c_fc.weight.grad[0, 0] = float("inf")
        states.append(state_of(model, opt))
        stepped.append(accumulate.optimizer_step(parts)[0])
        scales.append(parts.scaler.loss_scale)
    after = state_of(model, opt)
    assert stepped == [True, True, False, True]
    assert parts.scaler.skipped_steps == 1
    s0 = scales[0]
    assert scales == [s0, s0, s0, s0 / 2, s0 / 2]  # backed off at the skip only (growth needs 2000 clean)
    # step 2 changed nothing: weights, master weights, AdamW's m, v and step count
    assert_same_state(states[2], states[3])
    with pytest.raises(AssertionError):  # while a clean step does change them
        assert_same_state(states[3], after)


# ---------------------------------------------------------------- master weights

def test_bf16_master_weights_keep_updates_too_small_for_bf16():
    torch.manual_seed(0)
    model = torch.nn.LayerNorm(64).to(torch.bfloat16)  # weight = 1.0: BF16 spacing below 1 is 2^-8
    naive = copy.deepcopy(model)
    lr, steps = 1e-3, 6
    opt = MasterWeightOptimizer(model.parameters(), True, precision.AdamW(Config()), lr=lr, weight_decay=0.0,
                                 grad_clip=0.0)
    naive_opt = torch.optim.AdamW(naive.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        for m in (model, naive):
            for p in m.parameters():
                p.grad = torch.full_like(p, 1e-2)  # a constant gradient: AdamW moves each weight by ~lr
        opt.step([p.grad for p in opt.model_params])
        naive_opt.step()
        naive_opt.zero_grad()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    # each update (1e-3) is below half a BF16 ulp at 1.0 (2^-9): BF16 AdamW never moves
    assert lr < torch.finfo(torch.bfloat16).eps / 4
    assert torch.equal(naive.weight, torch.ones_like(naive.weight))
    # the FP32 master copy accumulated them, and the BF16 weight is its rounding
    master_w = opt.master_params[0]
    assert torch.allclose(master_w, torch.full_like(master_w, 1 - steps * lr), atol=1e-5)
    assert torch.equal(model.weight, master_w.to(torch.bfloat16))
    assert (model.weight < 1).all()


# ---------------------------------------------------------------- FP16

def test_fp16_dynamic_scaling_trains_and_tracks_bf16(tmp_path, bf16_losses):
    fp16, hist = run_losses(tmp_path, "--precision=fp16", f"--max_iters={STEPS}")
    assert hist[0]["loss_scale"] == 2.0 ** 16
    assert tail(fp16) < fp16[0] - 1.0  # it learns (byte-level loss starts near ln 256 = 5.5)
    # the same run to within what 16-bit rounding moves a short loss curve
    assert abs(tail(fp16) - tail(bf16_losses)) < 0.05


def lost_share(grads, ref, dtype):
    """Independent count: share of non-zero reference elements whose 16-bit gradient is zero or subnormal."""
    tiny = torch.finfo(dtype).smallest_normal
    live = torch.cat([(r != 0).flatten() for r in ref])
    small = torch.cat([(g.float().abs() < tiny).flatten() for g in grads])
    return (live & small).sum().item() / live.sum().item()


def test_fp16_without_scaling_underflows_as_the_demo_reports(tmp_path):
    common = ["--n_layer=1", "--n_embd=32", "--block_size=32"]
    cfg32 = tiny_cfg(tmp_path, "--precision=fp32", *common)
    ref_model, _ = train.build(cfg32, torch.device("cpu"))
    x, y = a_batch(cfg32)
    ref_model(x, y)[1].backward()
    ref = [p.grad.clone() for p in ref_model.parameters()]
    ref_model.zero_grad()
    shares = {}
    for mode in ("none", "dynamic"):
        model, parts = train.build(tiny_cfg(tmp_path, "--precision=fp16", f"--loss_scale={mode}", *common))
        with parts.precision.forward_context(model):
            _, loss = model(x, y)
        scaled_backward(parts, loss)  # the trainer's own path: loss * scale, backward in FP16
        shares[mode] = lost_share([p.grad for p in model.parameters()], ref, torch.float16)
        # the demonstration measures the same thing for the same model and batch
        demo = demos.gradient_underflow(ref_model, x, y, torch.float16, loss_scale(parts), ref)
        assert demo["lost"] == pytest.approx(shares[mode], abs=1e-12)
    bf16 = demos.gradient_underflow(ref_model, x, y, torch.bfloat16, 1.0, ref)
    assert shares["none"] > 0.01  # a visible share of the gradient is gone or nearly so
    assert shares["dynamic"] < shares["none"] / 10
    assert bf16["lost"] < shares["none"] / 10


def test_underflow_demo_rows_and_table():
    rows = demos.underflow_demo(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4)
    none, dynamic, bf16 = rows
    assert [r["dtype"] for r in rows] == ["float16", "float16", "bfloat16"]
    assert dynamic["loss_scale"] > 1 and not dynamic["overflow"]
    assert none["lost"] > dynamic["lost"] and none["lost"] > bf16["lost"]
    assert none["lost"] == pytest.approx(none["zero"] + none["subnormal"])
    table = demos.format_underflow(rows)
    assert f"{100 * none['lost']:.2f}%" in table and "bf16, no scaling" in table


# ---------------------------------------------------------------- the demo

def test_dtype_table_cli_prints_finfo_values(capsys):
    assert demos.main(["dtypes"]) == 0
    rows = {line[:9].strip(): line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    for name, dtype in (("FP16", torch.float16), ("BF16", torch.bfloat16), ("FP8 E4M3", E4M3), ("FP8 E5M2", E5M2)):
        assert float(rows[name][-3]) == pytest.approx(torch.finfo(dtype).max, rel=1e-3), name
    assert float(rows["FP8 E4M3"][-3]) == torch.finfo(E4M3).max  # 448 exactly


def test_cli_bad_argument_exits_2(capsys):
    status, err = demos.main(["--bogus"]), capsys.readouterr().err
    assert status == 2 and err.startswith("error:") and err.count("\n") == 1, err


# ---------------------------------------------------------------- what PRECISION decides, once

@pytest.mark.parametrize("prec,dtype,master,scaler,linear", [
    ("fp32", torch.float32, False, None, torch.nn.Linear),
    ("bf16", torch.bfloat16, True, None, torch.nn.Linear),
    ("fp16", torch.float16, True, "dynamic", torch.nn.Linear),
    ("fp8", torch.bfloat16, True, None, fp8.FP8Linear),  # fp8.py's own: no refinement is on
])
def test_what_each_precision_decides(prec, dtype, master, scaler, linear):
    decided = precision.decide(Config(precision=prec))
    assert decided.param_dtype == dtype and decided.master_weights == master
    assert getattr(decided.loss_scaler(), "mode", None) == scaler, "FP16 scales its loss; BF16, FP32 and FP8 need not"
    assert decided.element_bytes == torch.empty((), dtype=dtype).element_size()
    layer = decided.linear_factory()(32, 16, True)
    assert type(layer) is linear
    assert (decided.fp8 is not None) == (prec == "fp8")
    if prec != "fp8":
        assert decided.linear_factory() is default_linear


@pytest.mark.parametrize("flags,linear", [({}, fp8.FP8Linear), (dict(fp8_keep_weight=True), fp8_refined.FP8Linear),
                                          (dict(fp8_grad="e5m2"), fp8_refined.FP8Linear)])
def test_fp8_builds_fp8pys_layer_unless_a_refinement_is_on(flags, linear):
    """The plain path is the default path: PRECISION=fp8 alone builds the layer fp8.py's reader reads."""
    layer = precision.decide(Config(precision="fp8", **flags)).linear_factory()(32, 16, True)
    built, wanted = (f"{c.__module__}.{c.__name__}" for c in (type(layer), linear))
    assert built == wanted, f"precision=fp8 with {flags or 'no other flag'} built {built}, not {wanted}"


def test_a_precision_is_decided_once_from_the_loss_scale_keys():
    assert precision.decide(Config(precision="bf16", loss_scale="dynamic")).loss_scaler().mode == "dynamic"
    static = precision.decide(Config(precision="fp16", loss_scale="1024")).loss_scaler()
    assert static.mode == "static" and static.loss_scale == 1024.0
    te = precision.decide(Config(precision="fp8", fp8_backend="te", fp8_recipe="current", fp8_amax_history=4))
    assert te.fp8 == fp8.Settings(backend="te", scaling="current", history=4, margin=0, grad="bf16")
