"""COMPILE=1 (build.compile_blocks): compiled blocks train as the eager ones, our recompute still
re-runs them (with the forward's dropout masks), full recompute keeps only the blocks' inputs, and
what cannot work is refused in one line.

Compiling is the cost here (Inductor writes and compiles C++ for every kernel: tens of seconds per
graph on CI's cores), so every test uses one shape, and a graph compiled once in this process serves
every test after it (dynamo caches by code and guards: a new model of the same config reuses it).
`make test` runs the FP32 tests (three groups of graphs: no dropout, with dropout, and selective's
pieces); BF16, sdpa and the naive recompute are marked slow: `pytest -m slow tests/test_compile.py`.

Compiled and eager are not bit-identical, and the tolerances below say why: Inductor fuses each
block's pointwise ops and computes LayerNorm's statistics and the softmax in fused kernels, so sums
are taken in another order (FP32: relative differences of about 1e-6 per op), and a fused kernel
keeps its intermediates in FP32 and rounds once at its output where eager BF16 rounds after every
op (BF16: about one BF16 ulp, 2^-8, per kernel). Compiled against compiled (full recompute against
none) is the same kernels on the same inputs: bit for bit.
"""
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import accumulate
import checkpoint
import data
import flops
import memory_ledger
import train
from config import Config, UsageError, validate
from guards import cli, compiling
from ledger import compiled as ledger_compiled
from conftest import ROOT
from ledger import measure, trace

SHAPE = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=2, device="cpu", max_iters=3,
             warmup_iters=0, learning_rate=3e-3)
STEPS = 3
# Gradients are compared at the seeded initial weights, the same for every run of a shape and precision.
# FP32: each parameter's gradient within 1e-5 of eager's, relative to its norm (measured: 5e-7 at most,
# LayerNorm's weight, whose gradient sums the most products). BF16: eager's own BF16 gradients are 2e-2
# off an FP32 computation on the same weights (measured), so compiled is held to the FP32 reference
# instead: within twice eager BF16's distance from it, per parameter (measured: 1.32 times at most).
GRAD_TOLERANCE = {"fp32": 1e-5, "bf16": 2.0}
# Losses over the steps move apart more than the gradients: AdamW's first update is +-lr whatever a
# gradient's size, so an element whose gradient is rounding noise (the key's bias: softmax ignores a
# constant added to a row of scores, so that gradient is 0 but for rounding) moves by lr with the
# noise's sign. Measured: 1.4e-4 relative at step 2 (FP32, sdpa).
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 1e-2}


@pytest.fixture(scope="module", autouse=True)
def compiler():
    """One thread, no pool of compile workers (it costs more than it saves for these few kernels), room
    for every config here to keep its graph (past dynamo's recompile limit, 8 by default, a block would
    run eagerly: the tests would see no compiled region and fail), and dynamo's caches emptied before and
    after this file: its graphs serve its tests only."""
    saved = torch.get_num_threads(), torch._inductor.config.compile_threads, torch._dynamo.config.recompile_limit
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    torch._dynamo.config.recompile_limit = 32
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(saved[0])
    torch._inductor.config.compile_threads, torch._dynamo.config.recompile_limit = saved[1:]


def config(**over):
    cfg = validate(Config(**{**SHAPE, **over}))
    checkpoint.policy(cfg)
    return cfg


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, 256, (SHAPE["batch_size"], SHAPE["block_size"]), generator=g) for _ in "xy")
            for _ in range(n)]


def compiled_nodes(loss):
    """The compiled graphs' backward nodes in loss's autograd graph: one per compiled region run."""
    seen, stack, found = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += type(node).__name__ == "CompiledFunctionBackward"
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def gradients(model, batch):
    loss = model(*batch)[1]
    regions = compiled_nodes(loss)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return grads, regions


def train_steps(cfg, monkeypatch):
    """From the seeded initial weights, one forward and backward, then STEPS optimizer steps: (gradients
    {name: FP32} of the first, compiled regions in its graph, the steps' losses, recompute re-runs in all)."""
    reruns = []
    rerun = checkpoint.Unit.rerun
    monkeypatch.setattr(checkpoint.Unit, "rerun", lambda unit, saved: (reruns.append(1), rerun(unit, saved))[1])
    model, parts = train.build(cfg, torch.device("cpu"))
    first, *steps = batches(STEPS + 1)
    grads, regions = gradients(model, first)
    torch.manual_seed(7)  # dropout's stream
    losses = [accumulate.accumulation_step(model, parts, [b])[0] for b in steps]
    monkeypatch.undo()
    return grads, regions, losses, len(reruns)


def fp32_reference(cfg):
    """The gradients of cfg's initial weights computed in FP32, eagerly: BF16's yardstick."""
    weights = train.build(cfg, torch.device("cpu"))[0].state_dict()
    model, _ = train.build(replace(cfg, precision="fp32", compile=False), torch.device("cpu"))
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()})
    return gradients(model, batches(1)[0])[0]


def assert_close(cfg, compiled, eager):
    rel = lambda a, b: ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # noqa: E731
    reference = fp32_reference(cfg) if cfg.precision == "bf16" else None
    for name, e in eager[0].items():
        c = compiled[0][name]
        if reference is None:
            assert rel(c, e) <= GRAD_TOLERANCE["fp32"], \
                f"{name}'s gradient: compiled differs from eager by {rel(c, e):.2e} of its norm ({e.norm():.4g}), " \
                f"more than {GRAD_TOLERANCE['fp32']:g} (fp32, ckpt={cfg.ckpt})"
        else:
            off_c, off_e = rel(c, reference[name]), rel(e, reference[name])
            assert off_c <= GRAD_TOLERANCE["bf16"] * off_e + 1e-3, \
                f"{name}'s gradient: compiled BF16 is {off_c:.2e} of its norm off the FP32 computation, eager BF16 " \
                f"{off_e:.2e}: more than {GRAD_TOLERANCE['bf16']:g} times eager's (ckpt={cfg.ckpt})"
    tol = LOSS_TOLERANCE[cfg.precision]
    for i, (c, e) in enumerate(zip(compiled[2], eager[2])):
        assert abs(c - e) <= tol * abs(e), f"step {i + 1}: loss compiled {c:.6f}, eager {e:.6f}, more than {tol:g} apart"


def check_against_eager(monkeypatch, **over):
    cfg = config(**over)
    eager = train_steps(cfg, monkeypatch)
    compiled = train_steps(config(compile=True, **over), monkeypatch)
    # one compiled region per block; selective's eager core splits a block's graph in pieces around it
    split = cfg.ckpt == "selective"
    assert (compiled[1] > cfg.n_layer if split else compiled[1] == cfg.n_layer) and eager[1] == 0, \
        f"compiled regions in the first step's graph: {compiled[1]} for {cfg.n_layer} blocks, eager {eager[1]}"
    units = {"none": 0, "full": cfg.n_layer, "selective": cfg.n_layer}[cfg.ckpt] * (STEPS + 1)  # and the first
    assert compiled[3] == eager[3] == units, \
        f"recompute re-runs in {STEPS + 1} backward passes: compiled {compiled[3]}, eager {eager[3]}, expected {units}"
    assert_close(cfg, compiled, eager)


@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
def test_compiled_blocks_train_as_eager_fp32(monkeypatch, ckpt):
    check_against_eager(monkeypatch, precision="fp32", ckpt=ckpt)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["none", "full", "selective"])
def test_compiled_blocks_train_as_eager_bf16(monkeypatch, ckpt):
    check_against_eager(monkeypatch, precision="bf16", ckpt=ckpt)


@pytest.mark.slow
def test_compiled_blocks_train_as_eager_with_sdpa(monkeypatch):
    check_against_eager(monkeypatch, precision="fp32", attn="sdpa", ckpt="full")


@pytest.mark.slow
def test_compiled_blocks_under_the_naive_recompute(monkeypatch):
    # NaiveRecompute runs a unit's forward under no_grad (an inference graph of its own: no node in the
    # outer graph) and its backward re-runs the unit with grad (the training graph)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cfg = config(precision="fp32", ckpt="full", ckpt_impl="naive")
    eager, compiled = train_steps(cfg, monkeypatch), train_steps(replace(cfg, compile=True), monkeypatch)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 2, "no graphs compiled for the naive run"
    assert_close(cfg, compiled, eager)


def test_the_rerun_draws_the_forwards_dropout_masks_under_compile(monkeypatch):
    # compiled dropout draws from Inductor's own generator, seeded from torch's at each call: the re-run
    # finds the forward's masks only because our recompute restores the RNG state (checkpoint.Unit.rerun)
    none = train_steps(config(precision="fp32", dropout=0.1, compile=True), monkeypatch)
    full = train_steps(config(precision="fp32", dropout=0.1, compile=True, ckpt="full"), monkeypatch)
    assert full[3] == SHAPE["n_layer"] * (STEPS + 1), f"re-runs: {full[3]}"
    assert full[2] == none[2], f"losses with full recompute {full[2]}, without {none[2]}"
    for name, g in none[0].items():
        assert torch.equal(full[0][name], g), \
            f"{name}: compiled full recompute's gradient differs from compiled no-recompute's by " \
            f"{(full[0][name] - g).abs().max():.3g} (the re-run's dropout masks are not the forward's)"


def test_full_recompute_under_compile_keeps_only_the_blocks_inputs():
    peaks, saved = {}, {}
    for compiled in (False, True):
        cfg = config(precision="fp32", ckpt="full", compile=compiled)
        model, parts = train.build(cfg, torch.device("cpu"))
        batch = measure.random_batch(cfg, "cpu")
        accumulate.accumulation_step(model, parts, [batch])
        static = measure.resident(model, parts) + list(batch)
        counter = measure.SavedBytes(static)
        with counter:
            loss = model(*batch)[1]
        saved[compiled] = counter.total
        del loss
        # the same yardstick for both: the CPU allocator's events (a dispatch mode would run compiled code eagerly)
        with ledger_compiled.Allocations(measure.storage_bytes(static)) as allocations:
            accumulate.accumulation_step(model, parts, [batch])
        peaks[compiled] = allocations.peak
    traced = trace.step(config(precision="fp32", ckpt="full"))["activations"]  # the units' inputs, the rest
    assert saved[True] == saved[False] == traced, \
        f"bytes saved by the forward with full recompute: compiled {saved[True]:,}, eager {saved[False]:,}, " \
        f"the ledger's trace {traced:,}"
    assert peaks[True] <= peaks[False], \
        f"a step's peak with full recompute: compiled {peaks[True]:,} bytes, above eager's {peaks[False]:,}"


def test_the_ledger_names_what_compiled_blocks_save(capsys, tmp_path, monkeypatch):
    from tools import ledger
    monkeypatch.setattr(ledger, "papers_text", lambda: ("the published figures: not run by this test", True))
    flags = [f"--{k}={v}" for k, v in SHAPE.items() if k not in ("max_iters", "warmup_iters", "learning_rate")]
    status = ledger.main(flags + ["--precision=fp32", "--dropout=0.1", "--compile", "--table=formula",
                                  f"--out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert status == 1 and "Traceback" not in err, err
    assert "compiled blocks saved" in out and "tensors held by compiled graphs" in out, out
    # eager dropout on CPU saves its mask in the activation dtype (4 bytes here), a compiled block a bool
    lines = out.splitlines()
    assert any(line.strip().startswith("h.* (CompiledFunctionBackward") and ": bool (" in line for line in lines), out
    assert any("h.*.mlp.dropout (MulBackward0 other): float32" in line for line in lines), out
    assert "the compiled blocks save other tensors than the eager trace" in err, err


def test_the_first_step_is_timed_on_its_own_line(tmp_path):
    lines = []
    history = train.train(config(precision="fp32", compile=True, log_interval=1, eval_interval=2, eval_iters=1,
                                 sample_tokens=8, ledger=False, out_dir=str(tmp_path)), log=lines.append)
    assert len(history) == STEPS
    first = next(line for line in lines if line.startswith("step     1"))
    assert "torch.compile compiled 2 blocks in this step" in first and "tok/s" not in first, lines
    assert any(line.startswith("step     2") and "tok/s" in line for line in lines), lines


def test_what_cannot_compile_is_refused_in_one_line(monkeypatch):
    with pytest.raises(UsageError, match="--compile does not run precision=fp8: every hand-written FP8 Linear"):
        cli.parse_args(["--compile", "--precision=fp8"])
    # config.patch, not monkeypatch: under torch 2.11 a config set by setattr and set back breaks later compiles
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        assert "needs a C++ compiler" in compiling.compile_error(torch.device("cpu"))
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/true")}):  # runs, builds nothing
        assert "/bin/true did not build" in compiling.compile_error(torch.device("cpu"))
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    assert "needs torch >= 2.6" in compiling.compile_error(torch.device("cpu"))


@pytest.mark.parametrize("ckpt", ["full", "selective"])
def test_hfu_counts_what_a_compiled_rerun_runs(ckpt):
    # a compiled block saves its tensors at the end of its forward, so our re-run's early stop skips nothing
    # inside it (HFU counts the whole block again); a recomputed core stays eager and still stops early
    from train import Report
    reports = {}
    for compiled in (False, True):
        cfg = config(precision="fp32", ckpt=ckpt, compile=compiled, peak_flops=1e12)
        model, parts = train.build(cfg, torch.device("cpu"))
        reports[compiled] = Report(cfg, model, parts, torch.device("cpu"), 1, 1, 0, log=None)
    whole = sum(flops.per_token(cfg, stop_early=False))  # the model's FLOPs and a whole re-run of every unit
    if ckpt == "full":
        assert reports[True].hw_flops_per_token == whole > reports[False].hw_flops_per_token, \
            f"HFU's FLOPs per token: compiled {reports[True].hw_flops_per_token:,}, eager " \
            f"{reports[False].hw_flops_per_token:,}, a whole re-run of every block {whole:,}"
    else:
        assert reports[True].hw_flops_per_token == reports[False].hw_flops_per_token < whole, \
            f"HFU's FLOPs per token with selective: compiled {reports[True].hw_flops_per_token:,}, eager " \
            f"{reports[False].hw_flops_per_token:,}"


def test_a_cache_folder_torch_cannot_make_is_refused_in_one_line(monkeypatch, tmp_path):
    # torch.optim imports the compiler, which makes TORCHINDUCTOR_CACHE_DIR: every run needs it, compiled or not
    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a file"))
    with pytest.raises(UsageError, match="TORCHINDUCTOR_CACHE_DIR=.*a file, not a folder"):
        cli.parse_args(["--n_layer=1"])
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "a file"))  # and --help never meets it
    done = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "usage" in done.stdout, f"train.py --help: {done.returncode}, {done.stderr[-300:]}"


def test_evaluation_and_sampling_run_eagerly():
    # each would compile graphs of its own (eval mode, no grad; sampling a new length per token)
    from torch._dynamo.utils import counters
    cfg = config(compile=True)
    model, parts = train.build(cfg, torch.device("cpu"))
    accumulate.accumulation_step(model, parts, batches(1))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0, "the training step compiled no graph"

    train.estimate_loss(model, data.load_tokens(""), cfg, parts.precision, iters=1)
    train.sample(model, torch.device("cpu"), 3, compiled=True)
    assert counters["stats"]["unique_graphs"] == graphs, \
        f"evaluation and sampling compiled {counters['stats']['unique_graphs'] - graphs} graphs of their own"
