"""The CUDA paths a first GPU user meets (issue 17), shown on CPU with stand-ins: make gpu-check's
runner, the allocator history's Python stacks, one rank per GPU, a broken Transformer Engine, the
torch floor, the cuBLAS workspaces in the ledger's line, the fast configuration."""
import inspect
import json
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flops
import precision
import train
from guards import cli
from backends import fp8_te
from guards.cli import parse_args
from conftest import ROOT, merged
from ledger import gpus
from ledger import live as ledger_run
from tools import bench, gpu_check

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2", "--max_iters=1",
        "--eval_interval=100000", "--log_interval=100000", "--sample_tokens=0"]


def one_error_line(err):
    return err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------- make gpu-check: every step, the worst status

def stand_in(name, code, cap_s=60, figures=None):
    return gpu_check.Step(name, [sys.executable, "-c", code], cap_s, figures)


def test_gpu_check_runs_every_step_and_exits_with_the_worst_status(tmp_path, capsys):
    """A failing step does not hide the ones after it: each runs, each keeps its log, the summary
    names every status, and the run exits with the worst one."""
    plan = [stand_in("first", "print('one')"),
            stand_in("fails", "import sys; print('broken'); sys.exit(3)"),
            stand_in("after a failure", "print('still ran')", figures=lambda: ["| a figure |"]),
            stand_in("fails less", "import sys; sys.exit(1)")]
    rc = gpu_check.program([f"--out_dir={tmp_path}"], plan=plan)
    out = tmp_path / "gpu-check"
    assert rc == 3, f"exit status {rc}, the worst step's is 3"
    logs = {p.name: p.read_text() for p in out.glob("*.log")}
    assert logs["first.log"] == "one\n" and logs["fails.log"] == "broken\n" and logs["after-a-failure.log"] == "still ran\n"
    text = (out / "summary.md").read_text()
    for line in ("| first | ok |", "| fails | FAILED (3) |", "| after a failure | ok |", "| fails less | FAILED (1) |"):
        assert line in text, f"the summary does not say {line!r}:\n{text}"
    assert "torch " + torch.__version__ in text and "## after a failure" in text and "| a figure |" in text
    assert "exit status 3 (the worst step's)" in capsys.readouterr().out


def test_gpu_check_stops_a_step_at_its_time_and_goes_on(tmp_path):
    plan = [stand_in("hangs", "import time; time.sleep(60)", cap_s=1), stand_in("next", "print('ran')")]
    rc = gpu_check.program([f"--out_dir={tmp_path}"], plan=plan)
    text = (tmp_path / "gpu-check" / "summary.md").read_text()
    assert rc == 124 and "| hangs | FAILED (124) |" in text and "| next | ok |" in text
    assert "its time limit" in (tmp_path / "gpu-check" / "hangs.log").read_text()


def test_gpu_check_without_a_gpu_is_one_message_and_exit_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.program([f"--out_dir={tmp_path}"]) == 0
    assert capsys.readouterr().out == gpu_check.NO_GPU + "\n" and not (tmp_path / "gpu-check").exists()


def test_gpu_check_plans_every_step_with_the_flags_given(tmp_path):
    """The real plan: the CUDA tests, the ledger, the plan's check, each bench section (fast first among
    them), all on CUDA, into their own folders; the flags given reach the ledger, the plan's check and
    the benchmark, ours replacing theirs."""
    plan = gpu_check.steps("python", ["--precision=fp16", "--device=cpu"], tmp_path)
    assert [s.name for s in plan] == ["tests", "ledger", "plan", "bench fast", "bench compile", "bench precision",
                                      "bench fp8wide", "bench ckpt", "bench memory"]
    assert plan[0].argv[1:6] == ["-m", "pytest", "-q", "-m", "cuda"]
    for step in plan[1:]:
        assert "--device=cuda" in step.argv and "--device=cpu" not in step.argv and "--precision=fp16" in step.argv
    assert sum(s.cap_s for s in plan) >= gpu_check.BUDGET_S  # the run's budget, not the caps, is the limit
    assert gpu_check.BUDGET_S < 8 * 60


def test_gpu_check_summary_reads_the_ledger_and_bench_files(tmp_path):
    (tmp_path / "bench.jsonl").write_text(json.dumps(dict(
        label="bf16 sdpa L12 h768", precision="bf16", ckpt="none", tokens_per_s=123456.0, ms_per_step=132.7,
        mfu=0.41, peak_flops=989e12, peak_flops_source="NVIDIA H200, dense bf16 (ledger/gpus.py)",
        peak_mem_bytes=2 ** 30)) + "\n")
    row = gpu_check.bench_figures(tmp_path / "bench.jsonl")[2]
    assert "123,456.0" in row and "41.0%" in row and "989 TFLOP/s (NVIDIA H200" in row
    (tmp_path / "memory_ledger.json").write_text(json.dumps(dict(
        device="cuda", ok=True, allocator="CUDA allocator's growth ...",
        rows=[dict(component="activations", traced=10, measured=10, ok=True, rule="exact")])))
    assert "| activations | 10 | 10 | ok (exact) |" in gpu_check.ledger_figures(tmp_path / "memory_ledger.json")
    assert gpu_check.bench_figures(tmp_path / "missing.jsonl") == ["no rows written (see the log)"]
    # the compile section's row holds two models: a line for each, the ratio on both
    (tmp_path / "bench.jsonl").write_text(json.dumps(dict(
        section="compile", label="bf16 sdpa L12 h768 full", ckpt="full", speedup=1.5, peak_flops=989e12,
        **{f"{k}_{who}": v for who, vs in (("eager", (1e5, 160.0, 0.3, 2 ** 31)), ("compiled", (1.5e5, 107.0, 0.45,
                                                                                              2 ** 30)))
           for k, v in zip(("tokens_per_s", "ms_per_step", "mfu", "peak"), vs)})) + "\n")
    eager, compiled = gpu_check.bench_figures(tmp_path / "bench.jsonl")[2:]
    assert "full eager (compiled x1.50" in eager and "100,000.0" in eager and "30.0%" in eager and "2048 MiB" in eager
    assert "full compiled (compiled x1.50" in compiled and "45.0%" in compiled and "1024 MiB" in compiled


def test_the_fast_configuration_names_the_peak_its_mfu_divides_by(monkeypatch):
    cfg = cli.parse_args(bench.FAST)
    assert (cfg.precision, cfg.attn, cfg.n_layer, cfg.n_embd, cfg.block_size) == ("bf16", "sdpa", 12, 768, 1024)
    prec, small = precision.decide(cfg), torch.nn.Linear(8, 8)  # the CPU's rate is measured on the model's weights
    assert "measured" in flops.peak(cfg, prec, small, torch.device("cpu"))[1]
    assert flops.peak(parse_args(["--peak_flops=1e15"]), prec, small, torch.device("cpu")) == (1e15, "--peak_flops")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    peak, source = flops.peak(cfg, prec, small, torch.device("cuda"))
    assert peak == gpus.tflops("H200")["bf16"] * 1e12, f"H200's bf16 peak {peak:,} FLOP/s, not ledger/gpus.py's"
    assert source == "H200's datasheet, bf16 dense", source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert flops.peak(cfg, prec, small, torch.device("cuda"))[0] == gpus.tflops("H100-NVL")["bf16"] * 1e12, \
        "an H100 NVL read as another card"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Made-Up 9000")
    assert flops.peak(cfg, prec, small, torch.device("cuda"))[0] == 0.0, "an unknown GPU given another's peak"


# ---------------------------------------------------------------- the allocator's history: Python stacks

def test_memory_history_records_python_stacks_only(monkeypatch):
    """stacks="all" (the default) makes _snapshot() symbolize C++ frames with addr2line: minutes.
    The call's keywords are bound to the installed torch's own signature (torch/cuda/memory.py)."""
    real = inspect.signature(torch.cuda.memory._record_memory_history)
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **kw: calls.append(real.bind(*a, **kw).arguments))
    ledger_run.start_history()
    assert calls == [dict(enabled="all", context="all", stacks="python", max_entries=100_000)]


def test_memory_snapshot_on_cpu_is_refused_in_one_line(tmp_path, capsys):
    rc = train.main([*TINY, f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--memory_snapshot"])
    err = capsys.readouterr().err
    assert rc == 2 and one_error_line(err) and "needs a CUDA device" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- one rank per GPU

def test_more_ranks_than_gpus_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """torchrun --nproc_per_node=2 on one GPU (make ddp's default NPROC): rank 1 would get cuda:1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # torchrun sets these too (cli.run refuses RANK without them)
    monkeypatch.setenv("MASTER_PORT", "29500")
    rc = train.main([*TINY, "--precision=fp32", f"--out_dir={tmp_path / 'out'}"])  # (auto would ask the GPU)
    err = capsys.readouterr().err
    assert rc == 2 and one_error_line(err), err
    assert "LOCAL_RANK=1" in err and "1 CUDA device" in err and "NPROC=1" in err
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert train.pick_device(parse_args([*TINY, "--precision=fp32"]), 0) == torch.device("cuda", 0)  # rank 0's GPU


# ---------------------------------------------------------------- a Transformer Engine that does not import

@pytest.mark.parametrize("error,words", [
    ("OSError('/usr/lib/libtransformer_engine.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev')",
     "OSError: /usr/lib/libtransformer_engine.so: undefined symbol"),
    ("ImportError('transformer_engine_torch.so: undefined symbol: _ZNK3c105Error4whatEv')",
     "ImportError: transformer_engine_torch.so: undefined symbol"),
    ("RuntimeError('cudnn shared object not found.')", "RuntimeError: cudnn shared object not found."),
    ("ModuleNotFoundError(\"No module named 'transformer_engine_torch'\", name='transformer_engine_torch')",
     "ModuleNotFoundError: No module named 'transformer_engine_torch'")])
def test_a_broken_transformer_engine_is_refused_in_one_line(tmp_path, monkeypatch, capsys, error, words):
    """TE built against another torch fails in its own import: one line naming the cause, exit 2."""
    fake = tmp_path / "fake" / "transformer_engine"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise {error}\n")
    monkeypatch.syspath_prepend(str(fake.parent))  # found first, as an installed TE would be
    for name in [m for m in sys.modules if m.partition(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    status = train.main([*TINY, f"--out_dir={tmp_path / 'out'}", "--precision=fp8", "--fp8_backend=te"])
    err = capsys.readouterr().err
    assert status == 2 and one_error_line(err), err
    assert "Transformer Engine is installed but does not import" in err and words in err
    assert "--fp8_backend=native" in err and not (tmp_path / "out").exists()


def test_transformer_engine_not_installed_still_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ModuleNotFoundError for it
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    with pytest.raises(ValueError, match="needs Transformer Engine") as e:
        fp8_te._te()
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the torch floor

@pytest.mark.parametrize("version,refused", [("2.3.1+cu121", True), ("1.13.1", True), ("2.4.0", False),
                                             ("2.11.0+cu130", False), ("2.15.0a0+git1234", False)])
def test_torch_floor(version, refused):
    assert (cli.torch_floor_error(version) is not None) == refused


def test_a_torch_below_the_floor_is_refused_at_start_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    rc = train.main([*TINY, f"--out_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert rc == 2 and one_error_line(err) and "torch 2.3.1" in err and ">= 2.4" in err
    assert not (tmp_path / "out").exists()


def test_the_floor_is_the_api_it_names():
    """checkpoint.py calls torch.get_autocast_dtype(device_type), which torch 2.4 added."""
    assert "torch.get_autocast_dtype(self.device.type)" in (ROOT / "checkpoint.py").read_text()
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16


# ---------------------------------------------------------------- the cuBLAS workspaces in the ledger's line

def test_the_ledger_line_names_the_workspaces_so_it_adds_up():
    cfg = parse_args(["--precision=bf16", "--device=cpu"])
    mib = 2 ** 20
    line = ledger_run.ledger_line_text(cfg, allocated=150 * mib, max_allocated=300 * mib,
                                       workspaces={"main thread": 33 * mib, "autograd thread": 32 * mib})
    states = float(line.split("states ")[1].split()[0])
    assert "cuBLAS workspaces 65.0 (main thread 33.0, autograd thread 32.0)" in line
    assert f"= {states + 65:.1f} vs allocated 150.0 MiB" in line
    unmeasured = ledger_run.ledger_line_text(cfg, 150 * mib, 300 * mib, {})
    assert "cannot clear them" in unmeasured and "+ workspaces" not in unmeasured


def test_workspaces_are_not_guessed_where_torch_cannot_clear_them(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    assert ledger_run.blas_workspaces(torch.device("cpu")) == {}


def test_workspaces_are_measured_thread_by_thread(monkeypatch):
    """A stand-in allocator: each thread's first matmul adds its workspace (as a cuBLAS handle per
    thread does); the probe attributes the growth to the thread whose matmul made it."""
    import threading
    made, sizes, main = set(), {}, threading.get_ident()

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("mm", "addmm")) and threading.get_ident() not in made:
                made.add(threading.get_ident())
                sizes[threading.get_ident()] = 32 if threading.get_ident() == main else 16
            return func(*args, **(kwargs or {}))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: (made.clear(), sizes.clear()),
                        raising=False)
    sizes[main] = 99  # a workspace from before the probe: cleared first, so it is not counted
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: sum(sizes.values()))
    with Counting():
        got = ledger_run.blas_workspaces(torch.device("cpu"))
    # on CPU autograd's backward runs in the calling thread: its matmuls find the workspace made
    assert got == {"main thread": 32, "autograd thread": 0}
