"""The trainer: it learns, BF16 with master weights tracks FP32, resume is bit-identical,
snapshots are atomic, and bad input is one line and exit status 2."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import accumulate
import data
import flops
import precision
import snapshot
import train
from config import Config
from guards.cli import parse_args
from conftest import ROOT, merged, scaled_backward

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=8", "--sample_tokens=0",
        "--ledger=false", "--log_interval=1000", "--eval_interval=1000"]


def run(tmp_path, *flags):
    cfg = parse_args(merged(*TINY, f"--out_dir={tmp_path}", *flags))
    return [h["loss"] for h in train.train(cfg, log=lambda s: None)]


def test_loss_falls_on_default_data(tmp_path):
    losses = run(tmp_path, "--max_iters=60", "--learning_rate=3e-3", "--precision=bf16")
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    # bytes start near ln(256) = 5.5; a model that learns byte statistics of Python is below 3.2
    assert first > 4.5
    assert last < 3.2 and first - last > 1.5, (first, last)


def test_bf16_master_weights_track_fp32(tmp_path):
    fp32 = run(tmp_path / "a", "--max_iters=30", "--precision=fp32")
    bf16 = run(tmp_path / "b", "--max_iters=30", "--precision=bf16")
    diff = np.abs(np.array(fp32) - np.array(bf16))
    # same seed, same batches: bf16 differs by rounding only (8-bit mantissa, ~0.4% per op)
    assert diff.max() < 0.05, diff.max()
    assert fp32[-1] < fp32[0] - 1.0


def test_bf16_params_and_fp32_master_after_steps(tmp_path):
    cfg = parse_args([*TINY, "--precision=bf16", f"--out_dir={tmp_path}"])
    model, parts = train.build(cfg, torch.device("cpu"))
    opt = parts.optimizer
    x = torch.randint(0, 256, (2, 64))
    before = [m.clone() for m in opt.master_params]
    for _ in range(2):
        scaled_backward(parts, model(x, x)[1])
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())  # 16-bit gradients
        assert accumulate.optimizer_step(parts)[0]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    assert any(not torch.equal(a, b) for a, b in zip(before, opt.master_params))
    # the model's weights are the master copy rounded to bf16
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(model.parameters(), opt.master_params))
    state = opt.torch_optimizer.state[opt.master_params[0]]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("prec", ["bf16", "fp16", "fp8"])
def test_resume_is_bit_identical(tmp_path, prec):
    # fp16 resumes its loss scaler, fp8 its amax histories and scales (model buffers)
    # a small batch: the equality is what is tested, not the shape
    flags = ["--max_iters=12", "--lr_decay_iters=12", "--dropout=0.1", f"--precision={prec}", "--accum=2",
             "--batch_size=2", "--block_size=32"]
    if prec == "fp16":
        flags += ["--loss_scale_hysteresis=2"]
    straight = run(tmp_path / "a", *flags)
    first = run(tmp_path / "b", *flags[1:], "--max_iters=6")
    resumed = run(tmp_path / "b", *flags, "--resume")
    assert len(first) == 6 and len(resumed) == 6
    assert first + resumed == straight  # exact float equality, step by step


def test_a_learners_growth_factor_resumes_its_own_snapshots(tmp_path):
    # growth x1.5 every 5 clean steps: the scale is no power of two, which the snapshot check once required
    flags = ["--max_iters=8", "--lr_decay_iters=8", "--precision=fp16", "--loss_scale_growth=1.5",
             "--loss_scale_interval=5", "--batch_size=2", "--block_size=32"]
    straight = run(tmp_path / "a", *flags)
    first = run(tmp_path / "b", *flags[1:], "--max_iters=6")
    scale = torch.load(tmp_path / "b" / "snapshot.pt", weights_only=True)["scaler"]["loss_scale"]
    assert scale != 2.0 ** round(np.log2(scale)), f"the snapshot's scale {scale:g} is a power of two: nothing tested"
    resumed = run(tmp_path / "b", *flags, "--resume")
    assert first + resumed == straight, f"losses straight {straight}, snapshot then resumed {first} + {resumed}"


def test_a_snapshot_from_an_older_torchs_adamw_resumes(tmp_path):
    # torch before 2.7 wrote AdamW's groups without decoupled_weight_decay: its load fills it in, so the
    # snapshot check must not ask for it (it asks for what such a group does carry: betas, eps, ...)
    flags = ["--max_iters=2", "--lr_decay_iters=4", "--batch_size=2", "--block_size=32"]
    run(tmp_path, *flags)
    path = tmp_path / "snapshot.pt"
    state = torch.load(path, weights_only=True)
    groups = state["optimizer"]["adamw"]["param_groups"]
    assert all("decoupled_weight_decay" in g for g in groups), "this torch writes no decoupled_weight_decay"
    for group in groups:
        del group["decoupled_weight_decay"]
    torch.save(state, path)
    assert len(run(tmp_path, *flags[1:], "--max_iters=4", "--resume")) == 2


def test_interrupted_snapshot_write_leaves_previous_loadable(tmp_path, monkeypatch):
    path = tmp_path / snapshot.FILE
    snapshot.save(path, {"step": 1, "w": torch.arange(4.0)})

    def crash(obj, fh, *a, **k):
        fh.write(b"half a snapshot")
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        snapshot.save(path, {"step": 2, "w": torch.zeros(4)})
    monkeypatch.undo()
    state = torch.load(path, weights_only=True)
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(4.0))


def test_default_data_is_stdlib_bytes_cached_once(tmp_path):
    tokens = data.load_tokens("", cache_dir=tmp_path)
    assert isinstance(tokens, np.ndarray) and tokens.dtype == np.uint8  # the cache, read whole (about 31 MB)
    files = data.stdlib_files()
    assert len(tokens) == sum(f.stat().st_size for f in files) > 10_000_000
    assert all("site-packages" not in f.parts for f in files)
    assert tokens[:100].tobytes() == files[0].read_bytes()[:100]
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1  # one cache file, no temporaries left
    cached[0].write_bytes(cached[0].read_bytes()[:1000])  # the cache is what is read: not written again
    assert len(data.load_tokens("", cache_dir=tmp_path)) == 1000


def test_batches_are_seeded_windows(tmp_path):
    tokens = np.arange(1000, dtype=np.uint8)
    a = data.Batches(tokens, 16, 4, seed=3, device=torch.device("cpu"))
    b = data.Batches(tokens, 16, 4, seed=3, device=torch.device("cpu"))
    (xa, ya), (xb, yb) = a.next(), b.next()
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(a.next()[0], xa)


def test_data_flag_reads_a_text_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello world " * 200)
    (tmp_path / "d" / "b.txt").write_text("second file " * 200)
    tokens = data.load_tokens(str(tmp_path / "d"))
    assert tokens.tobytes() == (("hello world " * 200) + ("second file " * 200)).encode()


BAD = [
    (["--bogus=1"], "unknown flag --bogus"),
    (["--n_layer=abc"], "--n_layer expects int"),
    (["--precision=fp64"], "--precision=fp64 is not one of"),
    (["--ckpt=sometimes"], "--ckpt=sometimes is not one of"),
    (["--n_head=3"], "n_head=3 does not divide n_embd=64"),
    (["--n_layer=-1"], "n_layer must be >= 1"),
    (["--data=/no/such/path"], "no such file or folder"),
    (["--resume"], "no snapshot at"),
    (["--beta1=1.5"], "beta parameter at index 0"),
    (["--accum=2", "--total_batch_tokens=1024"], "not both"),
    (["--ckpt=selective", "--attn=sdpa"], "use attn=manual"),
    (["--precision=fp8", "--n_embd=72", "--n_head=2"], "divisible by 16"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    code = train.main(merged(*TINY, f"--out_dir={out}", *flags))
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("error: ")
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("content", ["", "short text"])
def test_empty_or_short_data_is_rejected(tmp_path, capsys, content):
    data = tmp_path / "data.txt"
    data.write_text(content)
    code = train.main([*TINY, f"--out_dir={tmp_path / 'out'}", f"--data={data}"])
    assert code == 2 and "data too short" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_empty_data_folder_is_rejected(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = train.main([*TINY, f"--out_dir={tmp_path / 'out'}", f"--data={tmp_path / 'empty'}"])
    assert code == 2 and "the folder holds no files" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_resume_from_a_different_model_shape(tmp_path, capsys):
    run(tmp_path, "--max_iters=1")
    code = train.main(merged(*TINY, f"--out_dir={tmp_path}", "--n_layer=3", "--resume"))
    assert code == 2 and "different model: n_layer=2 (now 3)" in capsys.readouterr().err


def test_resume_with_another_fp8_history_length(tmp_path, capsys):
    run(tmp_path, "--max_iters=1", "--precision=fp8")
    code = train.main([*TINY, f"--out_dir={tmp_path}", "--precision=fp8", "--fp8_amax_history=4", "--resume"])
    assert code == 2 and "fp8_amax_history=16 (now 4)" in capsys.readouterr().err


def test_sample_uses_the_snapshot_shape(tmp_path, capsys):
    # trained as fp32 with 2 layers; `make sample` passes no flags, so the defaults differ
    run(tmp_path, "--max_iters=2", "--precision=fp32")
    assert train.main(["--sample_only", f"--out_dir={tmp_path}", "--sample_tokens=20"]) == 0
    assert len(capsys.readouterr().out) > 20


def test_bad_flag_from_the_command_line_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--precision=fp64", "--out_dir=o"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("error: --precision=fp64") and r.stderr.count("\n") == 1  # one line, no traceback
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_dtype_table_comes_from_finfo():
    rows = {r["name"]: r for r in precision.dtype_table()}
    assert (rows["FP32"]["exponent"], rows["FP32"]["mantissa"]) == (8, 23)
    assert (rows["FP16"]["exponent"], rows["FP16"]["mantissa"]) == (5, 10)
    assert (rows["BF16"]["exponent"], rows["BF16"]["mantissa"]) == (8, 7)
    assert rows["FP8 E4M3"]["max"] == 448 and rows["FP8 E5M2"]["max"] == 57344
    assert rows["BF16"]["max"] > 1e38 and rows["FP16"]["max"] == 65504  # bf16 keeps fp32's range


def test_model_flops_are_counted_from_the_model_and_equal_the_chapters_formula():
    # MFU's numerator, flops.per_token (model.py on fake tensors), against PyTorch's FlopCounterMode on one real
    # step of the manual attention (whose matmuls are ordinary ops the counter sees), and against the
    # chapter's 6N + 12Lhs per token (N the matmul weights, the tied head's too)
    from torch.utils.flop_counter import FlopCounterMode
    import flops
    from model import GPT
    cfg = Config(block_size=64, n_layer=2, n_head=2, n_embd=64, attn="manual")
    model = GPT(cfg)
    x = torch.randint(0, 256, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(x, x)[1].backward()
    per_token = flops.per_token(cfg)[0]
    assert counter.get_total_flops() == per_token * x.numel(), \
        f"FlopCounterMode counts {counter.get_total_flops() / x.numel():,.0f} FLOPs a token, flops.per_token {per_token:,.0f}"
    L, h, s, V = cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size
    assert per_token == 6 * (12 * L * h * h + V * h) + 12 * L * h * s, f"{per_token:,.0f} FLOPs a token, not 6N + 12Lhs"


def test_residual_projections_are_scaled_by_their_mark_not_their_name(monkeypatch):
    # GPT-2's init scales the projections into the residual stream by 1/sqrt(2L): the module says it
    # is one (residual_projection), so a learner's renamed MLP keeps the scaled init
    import torch.nn as nn
    import model

    class RenamedMLP(nn.Module):
        def __init__(self, cfg, linear_factory):
            super().__init__()
            self.up = linear_factory(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
            self.down = linear_factory(4 * cfg.n_embd, cfg.n_embd, cfg.bias)
            self.down.residual_projection = True

        def forward(self, x):
            return self.down(torch.nn.functional.gelu(self.up(x)))
    monkeypatch.setattr(model, "MLP", RenamedMLP)
    torch.manual_seed(0)
    gpt = model.GPT(Config(n_layer=8, n_embd=256, n_head=4, block_size=16))
    scaled = 0.02 / (2 * 8) ** 0.5
    for name, p in gpt.named_parameters():
        if name.endswith(("down.weight", "attn.c_proj.weight")):
            assert abs(p.std().item() / scaled - 1) < 0.05, f"{name}: std {p.std().item():.4f}, expected {scaled:.4f}"
        elif name.endswith("up.weight"):
            assert abs(p.std().item() / 0.02 - 1) < 0.05, f"{name}: std {p.std().item():.4f}, expected 0.02"


# ---------------------------------------------------------------- the learner's own machine

def test_auto_is_what_this_cpu_computes_and_an_emulated_precision_says_so(tmp_path):
    """PRECISION=auto (the default) is BF16 where torch reports the CPU computes it (AVX512-BF16 or AMX), FP32
    where it does not; BF16 asked for on a CPU that only emulates it runs, and says once what that costs,
    measured there. oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA) is such a CPU, whatever this one is."""
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert parse_args([]).precision == ("bf16" if native else "fp32"), "auto is not what this CPU computes"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    said = {}
    for asked in ([], ["--precision=bf16"]):
        r = subprocess.run([sys.executable, "train.py", *TINY, "--max_iters=1", f"--out_dir={tmp_path / str(len(asked))}",
                            *asked], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        said[bool(asked)] = r.stdout
    assert "precision fp32" in said[False] and "no BF16 instructions" in said[False], said[False][:600]
    assert "warning" not in said[False], f"the default run warns:\n{said[False][:600]}"
    warning = [line for line in said[True].splitlines() if line.startswith("warning: BF16 runs")]
    assert len(warning) == 1 and "slower than FP32 here" in warning[0] and "s a step" in warning[0] and \
        "PRECISION=auto is fp32 here" in warning[0], said[True][:800]


def test_mfu_divides_by_a_peak_no_matmul_of_the_model_beats():
    """MFU stays below 100%: on a CPU the peak is measured on the model's own largest matmul, forward and backward,
    in the run's dtype; the FLOP rate of that GEMM, timed here as the model's Linear runs it, is no higher."""
    cfg = parse_args(merged(*TINY, "--precision=fp32"))
    model, parts = train.build(cfg, torch.device("cpu"))
    peak, source = flops.peak(cfg, parts.precision, model, torch.device("cpu"))
    weight = max((p for p in model.parameters() if p.dim() == 2), key=torch.numel)
    x = torch.randn(cfg.batch_size * cfg.block_size, weight.shape[1])
    best = float("inf")
    for _ in range(9):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, weight.detach())
        best = min(best, time.perf_counter() - t0)
    rate = 2 * x.shape[0] * weight.numel() / best
    assert peak >= 0.8 * rate, f"the peak MFU divides by, {peak / 1e9:.1f} GFLOP/s ({source}), is below the " \
                               f"model's largest GEMM's own rate, {rate / 1e9:.1f} GFLOP/s"
    assert "measured" in source and "largest weight" in source, source


def test_a_resume_continues_the_runs_own_settings(tmp_path, capsys):
    """Resumed with no flag but how far to go, a run takes every key from its snapshot: FP16 with a learner's
    loss scaler (x1.5 every 2 clean steps), its shape and its schedule; its scale and weights after the resume
    are an uninterrupted run's, and it says which keys the flags changed."""
    flags = [*TINY, "--precision=fp16", "--loss_scale_growth=1.5", "--loss_scale_interval=2", "--lr_decay_iters=6",
             "--batch_size=2", "--block_size=32"]
    assert train.main(merged(*flags, f"--out_dir={tmp_path / 'a'}", "--max_iters=6")) == 0
    assert train.main(merged(*flags, f"--out_dir={tmp_path / 'b'}", "--max_iters=3")) == 0
    capsys.readouterr()
    assert train.main(["--resume", "--max_iters=6", f"--out_dir={tmp_path / 'b'}"]) == 0
    said = capsys.readouterr().out
    straight, resumed = (torch.load(tmp_path / d / "snapshot.pt", weights_only=True) for d in "ab")
    assert resumed["scaler"] == straight["scaler"], f"the scaler after the resume {resumed['scaler']}, " \
                                                    f"uninterrupted {straight['scaler']}"
    assert straight["scaler"]["loss_scale"] not in (2.0 ** 16, 2.0 ** 17), "the scale never grew: nothing tested"
    assert all(torch.equal(v, resumed["model"][k]) for k, v in straight["model"].items()), "the weights differ"
    assert "resumed at step 3: the flags given change max_iters 3 -> 6" in said, said[:1000]


def test_a_step_past_the_memory_is_one_line_not_the_oom_killer(tmp_path):
    """On a CPU the run may map what it maps at its start and what is free (RLIMIT_AS): a step that needs more
    fails in torch's allocator, and says so in one line, exit 2, where the kernel's OOM killer would kill -9 it.
    Here what is free is said to be 300 MiB; the step's attention scores alone take more."""
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from guards import clean_end\n"
              f"clean_end.memory_free = lambda device: (300 * 2 ** 20, 'of memory available (this test says)')\n"
              f"import train; sys.exit(train.main({merged(*TINY, '--precision=fp32', '--batch_size=64', '--block_size=1024', f'--out_dir={tmp_path}')!r}))")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(
        "error: this shape needs more than the 0.3 GiB of memory available (this test says) for one step"), \
        f"exit status {r.returncode}:\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr and not (tmp_path / "snapshot.pt").exists()
