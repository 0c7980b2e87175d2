"""precision.py and fp8.py: the recipe, the loss scaler against torch.amp.GradScaler,
master weights, FP16's underflow, the native FP8 Linear (quantization, forward, backward,
training, recompute), the Transformer Engine backend's errors, and the dtype table demo.
CPU, tiny models: FP16 matmuls run at about 1 GFLOP/s on CPU."""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import accumulate
import checkpoint
import data
import fp8
import precision
import train
from config import Config, UsageError, parse_args
from conftest import ROOT, merged
from fp8 import E4M3, E5M2, FP8Linear
from precision import LossScaler, MasterWeightOptimizer
from tools import demos

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=8", "--warmup_iters=5",
        "--learning_rate=3e-3", "--eval_interval=100000", "--log_interval=100000", "--sample_tokens=0",
        "--ledger=false", "--peak_flops=1"]


def tiny_cfg(tmp_path, *extra):
    return parse_args(merged(*TINY, f"--out_dir={tmp_path}", *extra))


def run_losses(tmp_path, *extra):
    history = train.train(tiny_cfg(tmp_path, *extra), log=lambda s: None)
    return [r["loss"] for r in history], history


STEPS = 30  # enough for the byte-level loss to fall from ~5.5 (ln 256) by more than 1


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    """The BF16 run every low-precision run is compared with (same seed, data, steps)."""
    return run_losses(tmp_path_factory.mktemp("bf16"), "--precision=bf16", f"--max_iters={STEPS}")[0]


def tail(losses):
    return sum(losses[-5:]) / 5


def a_batch(cfg, seed=0):
    tokens = data.load_tokens("")
    return data.Batches(tokens, cfg.block_size, cfg.batch_size, seed, torch.device("cpu")).next()


# ---------------------------------------------------------------- the loss scaler

def drive_gradscaler(overflows, growth_interval):
    """torch.amp.GradScaler (the oracle) through steps whose gradient is inf where overflows[i]."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
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


def drive_ours(overflows, growth_interval, hysteresis=1):
    """Our scaler beside MasterWeightOptimizer (so its one-reduction inf check is exercised)."""
    model = torch.nn.Linear(4, 4).half()
    scaler = LossScaler("dynamic", growth_interval=growth_interval, hysteresis=hysteresis)
    recipe = precision.recipe(Config(precision="fp16"))
    parts = accumulate.StepParts(recipe, scaler, MasterWeightOptimizer(model.parameters(), True, lr=0.1))
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


def test_scaler_trajectory_matches_gradscaler():
    want_scales, want_skipped = drive_gradscaler(OVERFLOWS, growth_interval=3)
    scales, skipped, stepped = drive_ours(OVERFLOWS, growth_interval=3)
    assert scales == want_scales
    assert skipped == want_skipped == sum(OVERFLOWS)
    assert stepped == [not b for b in OVERFLOWS]
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


def test_scaler_from_config_modes():
    scaler = lambda loss_scale, prec: precision.recipe(Config(loss_scale=loss_scale, precision=prec)).loss_scaler()
    assert scaler("auto", "fp16").mode == "dynamic"
    assert scaler("auto", "bf16").loss_scale == 1.0
    assert scaler("1024", "fp16").loss_scale == 1024.0
    for bad in ("-1", "inf", "big"):
        with pytest.raises(UsageError):
            parse_args([f"--loss_scale={bad}", "--precision=fp16"])


def state_of(model, opt):
    return ([p.detach().clone() for p in model.parameters()], [m.detach().clone() for m in opt.master_params],
            copy.deepcopy(opt.adamw.state_dict()["state"]))


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
        with parts.recipe.forward_context():
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
    opt = MasterWeightOptimizer(model.parameters(), True, lr=lr, weight_decay=0.0, grad_clip=0.0)
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
        with parts.recipe.forward_context():
            _, loss = model(x, y)
        parts.scaler.backward(loss)  # the trainer's own path: loss * scale, backward in FP16
        shares[mode] = lost_share([p.grad for p in model.parameters()], ref, torch.float16)
        # the demonstration measures the same thing for the same model and batch
        demo = demos.gradient_underflow(ref_model, x, y, torch.float16, parts.scaler.loss_scale, ref)
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


# ---------------------------------------------------------------- native FP8

def test_fp8_round_trip_error_within_e4m3_precision():
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.exp(2 * torch.randn(4096))  # a wide dynamic range
    scale = fp8.scale_from_amax(x.abs().amax(), torch.finfo(E4M3).max)
    q = fp8.quantize(x, scale, E4M3)
    back = fp8.dequantize(q, scale, torch.float32)
    fi = torch.finfo(E4M3)
    assert q.dtype == E4M3 and q.element_size() == 1
    assert q.float().abs().max() == fi.max  # amax maps onto the FP8 max
    normal = (x * scale).abs() >= fi.smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= fi.eps / 2  # round to nearest: half an ulp, 2^-4 for 3 mantissa bits
    assert rel.max() > fi.eps / 8  # and it really rounded to 3 bits
    # below the smallest normal the spacing is fixed: smallest_normal * eps
    assert ((back - x).abs()[~normal] * scale <= fi.smallest_normal * fi.eps / 2).all()


def fp8_layer(recipe="current", grad="bf16", seed=0):
    torch.manual_seed(seed)
    layer = FP8Linear(64, 96, bias=True, recipe=recipe, grad=grad).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    torch.nn.init.normal_(layer.bias, std=0.02)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    return layer, x


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_forward_matches_bf16_reference(recipe):
    layer, x = fp8_layer(recipe)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 8, 96)
    assert layer.amax_history.dtype == layer.scale.dtype == torch.float32  # .to(bf16) left them FP32
    ref = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    # each operand element carries at most E4M3's relative rounding 2^-4 (about 0.036 rms);
    # over a dot product of two such operands that is ~0.05 normwise: allow 2 * 2^-4
    err = rel_err(y, ref)
    assert 0 < err < 2 * torch.finfo(E4M3).eps / 2
    # against the same product of the dequantized operands, only BF16 output rounding remains
    amax_x, amax_w = x.detach().abs().amax().float(), layer.weight.abs().amax().float()
    sx, sw = (fp8.scale_from_amax(a, torch.finfo(E4M3).max) for a in (amax_x, amax_w))
    xq = fp8.dequantize(fp8.quantize(x.detach(), sx, E4M3), sx, torch.float32)
    wq = fp8.dequantize(fp8.quantize(layer.weight.detach(), sw, E4M3), sw, torch.float32)
    assert rel_err(y, F.linear(xq, wq, layer.bias.float())) < torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("grad", ["bf16", "e5m2"])
def test_fp8_linear_backward_close_to_bf16(grad):
    layer, x = fp8_layer(grad=grad)
    ref_layer = torch.nn.Linear(64, 96).to(torch.bfloat16)
    ref_layer.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(4, 8, 96, dtype=torch.bfloat16)
    layer(x).backward(g)
    ref_layer(x_ref).backward(g)
    # bf16: dgrad is exact BF16 math, wgrad sees the E4M3 input; e5m2 adds 2-bit-mantissa gradients
    tol = {"bf16": torch.finfo(E4M3).eps, "e5m2": torch.finfo(E5M2).eps}[grad]
    assert rel_err(x.grad, x_ref.grad) < tol
    assert rel_err(layer.weight.grad, ref_layer.weight.grad) < tol
    assert rel_err(layer.bias.grad, ref_layer.bias.grad) < torch.finfo(torch.bfloat16).eps
    if grad == "e5m2":
        assert layer.step_amax[2] == g.abs().amax().float()  # backward recorded the gradient's amax


def test_fp8_saves_one_byte_input_for_backward():
    layer, x = fp8_layer()
    y = layer(x)
    saved = y.grad_fn.saved_tensors
    x_saved = [t for t in saved if t.shape == (32, 64)]
    assert len(x_saved) == 1 and x_saved[0].dtype == E4M3
    # nothing of BF16 activation size is saved: the only other tensors are 0-d scales and the weight
    others = [t for t in saved if t.shape != (32, 64)]
    assert all(t.dim() == 0 or t is layer.weight or t.data_ptr() == layer.weight.data_ptr() for t in others)


def test_fp8_rejects_dims_not_multiple_of_16(tmp_path, capsys):
    with pytest.raises(ValueError, match="divisible by 16"):
        FP8Linear(40, 64)
    rc = train.main(merged(*TINY, f"--out_dir={tmp_path}", "--precision=fp8", "--n_embd=40", "--max_iters=1"))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "16" in err


def test_fp8_model_gradients_reach_every_parameter(tmp_path):
    grads = {}
    for prec in ("bf16", "fp8"):
        cfg = tiny_cfg(tmp_path, f"--precision={prec}")
        model, parts = train.build(cfg, torch.device("cpu"))
        if prec == "fp8":
            n_fp8 = sum(isinstance(m, FP8Linear) for m in model.modules())
            assert n_fp8 == 4 * cfg.n_layer and n_fp8 == len(parts.fp8_layers)
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            assert all(m.dtype == torch.float32 for m in parts.optimizer.master_params)
        x, y = a_batch(cfg)
        with parts.recipe.forward_context():
            _, loss = model(x, y)
        parts.scaler.backward(loss)
        grads[prec] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["fp8"].items():
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
        # same direction as the BF16 gradient
        assert F.cosine_similarity(g.float().flatten(), grads["bf16"][name].float().flatten(), dim=0) > 0.95, name


@pytest.mark.parametrize("extra", [[], ["--fp8_recipe=current", "--fp8_grad=e5m2"]])
def test_fp8_training_reduces_loss_and_tracks_bf16(tmp_path, bf16_losses, extra):
    fp8, _ = run_losses(tmp_path, "--precision=fp8", f"--max_iters={STEPS}", *extra)
    assert tail(fp8) < fp8[0] - 1.0
    assert fp8 != bf16_losses  # the same seed and data: only the FP8 matmuls differ
    # E4M3's 3 mantissa bits cost a little: within 0.1 nats of BF16 over a short run
    assert abs(tail(fp8) - tail(bf16_losses)) < 0.1


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_recompute_identical_grads_and_amax_once_per_step(tmp_path, recipe):
    runs = {}
    for ckpt in ("none", "full"):
        cfg = tiny_cfg(tmp_path, "--precision=fp8", f"--fp8_recipe={recipe}", "--fp8_margin=1", f"--ckpt={ckpt}")
        model, parts = train.build(cfg, torch.device("cpu"))
        calls = []  # (module, recomputing?, output) per FP8Linear forward
        for m in parts.fp8_layers:
            m.register_forward_hook(lambda mod, inp, out: calls.append((mod, checkpoint.is_recomputing(), out)))
        batches = data.Batches(data.load_tokens(""), cfg.block_size, cfg.batch_size, 0, torch.device("cpu"))
        grads, records = [], []
        for step in range(3):
            calls.clear()
            x, y = batches.next()
            with parts.recipe.forward_context():
                _, loss = model(x, y)
            parts.scaler.backward(loss)
            grads.append([p.grad.clone() for p in model.parameters()])
            records.append([m.recorded_forwards for m in parts.fp8_layers])
            if ckpt == "full":
                assert len(calls) == 2 * len(parts.fp8_layers)  # every FP8 forward ran twice
                first = {id(m): out for m, rec, out in calls if not rec}
                again = {id(m): out for m, rec, out in calls if rec}
                assert first.keys() == again.keys()
                for k in first:  # the recomputed forward used the same scales: same bits
                    assert torch.equal(first[k], again[k])
            accumulate.optimizer_step(parts)
        runs[ckpt] = (grads, records, [{k: v.clone() for k, v in m.state_dict().items()} for m in parts.fp8_layers],
                      parts.fp8_layers)
    for g_none, g_full in zip(runs["none"][0], runs["full"][0]):
        assert all(torch.equal(a, b) for a, b in zip(g_none, g_full))
    # one recorded forward per module per step, with or without recompute
    assert runs["none"][1] == runs["full"][1] == [[1] * len(runs["none"][3])] * 3
    for s_none, s_full in zip(runs["none"][2], runs["full"][2]):
        assert all(torch.equal(s_none[k], s_full[k]) for k in s_none)
    # the history moved once per step: 3 rows filled, and the delayed scale is TE's formula
    m = runs["full"][3][0]
    assert (m.amax_history[:, :2] > 0).all(1).sum() == 3
    amax = m.amax_history.amax(0)[:2]
    assert torch.allclose(m.scale[:2], (torch.finfo(E4M3).max / amax) / 2 ** 1)


def test_fp8_buffers_go_in_snapshots(tmp_path):
    cfg = tiny_cfg(tmp_path, "--precision=fp8")
    model, parts = train.build(cfg, torch.device("cpu"))
    x, y = a_batch(cfg)
    _, loss = model(x, y)
    parts.scaler.backward(loss)
    accumulate.optimizer_step(parts)
    sd = model.state_dict()
    keys = [k for k in sd if k.endswith(("amax_history", "scale"))]
    assert len(keys) == 2 * len(parts.fp8_layers)
    assert all(sd[k].dtype == torch.float32 for k in keys)
    fresh, _ = train.build(cfg, torch.device("cpu"))
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.h[0].mlp.c_fc.scale, model.h[0].mlp.c_fc.scale)
    assert not torch.equal(model.h[0].mlp.c_fc.scale, torch.ones(3))  # the fold did change it


# ---------------------------------------------------------------- Transformer Engine

def te_usable():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(te_usable(), reason="Transformer Engine and an sm89+ GPU are present here")
def test_te_backend_without_te_or_gpu_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "train.py", *TINY, f"--out_dir={tmp_path}", "--precision=fp8",
                        "--fp8_backend=te", "--max_iters=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: fp8_backend=te needs") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


@pytest.mark.cuda
def test_te_backend_trains_on_gpu(tmp_path):
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("TE FP8 needs an sm89+ GPU")
    import transformer_engine.pytorch as te
    cfg = tiny_cfg(tmp_path, "--precision=fp8", "--fp8_backend=te", "--device=cuda", "--n_embd=64", "--max_iters=30")
    model, parts = train.build(cfg)
    assert any(isinstance(m, te.Linear) for m in model.modules()) and parts.recipe.fp8.backend == "te"
    losses, _ = run_losses(tmp_path, "--precision=fp8", "--fp8_backend=te", "--device=cuda", "--n_embd=64",
                           "--max_iters=30")
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.cuda
def test_native_fp8_on_gpu_matches_cpu():
    layer, x = fp8_layer()
    y_cpu = layer(x)
    g = torch.randn_like(y_cpu)
    y_cpu.backward(g)
    gl, gx = copy.deepcopy(layer).cuda(), x.detach().cuda().requires_grad_(True)
    y = gl(gx)
    y.backward(g.cuda())
    assert rel_err(y.cpu(), y_cpu) < torch.finfo(torch.bfloat16).eps  # same bytes, another kernel
    assert rel_err(gl.weight.grad.cpu(), layer.weight.grad) < torch.finfo(torch.bfloat16).eps


# ---------------------------------------------------------------- the demo

def test_dtype_table_cli_prints_finfo_values():
    r = subprocess.run([sys.executable, "tools/demos.py", "dtypes"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    rows = {line[:9].strip(): line.split() for line in r.stdout.splitlines()[1:]}
    for name, dtype in (("FP16", torch.float16), ("BF16", torch.bfloat16), ("FP8 E4M3", E4M3), ("FP8 E5M2", E5M2)):
        assert float(rows[name][-3]) == pytest.approx(torch.finfo(dtype).max, rel=1e-3), name
    assert float(rows["FP8 E4M3"][-3]) == torch.finfo(E4M3).max  # 448 exactly


def test_cli_bad_argument_exits_2():
    r = subprocess.run([sys.executable, "tools/demos.py", "--bogus"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error:") and r.stderr.count("\n") == 1
