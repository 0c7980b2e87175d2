"""Shared test setup: the repo root on sys.path, the `cuda` marker, a tiny data file."""
import os
import signal
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on CI's two cores: one thread each, and the same for the
    # programs a test starts, since two processes of two threads on two cores slow each other
    # many times over (and torch reads OMP_NUM_THREADS at import)
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (run by make gpu-check; skipped without one)")
    config.addinivalue_line("markers", "slow: minutes of compiling; skipped unless asked for by name: pytest -m slow")


def pytest_collection_modifyitems(config, items):
    from backends import fp8_gemm
    no_cuda = pytest.mark.skip(reason="no CUDA device on this machine (make gpu-check runs these on a GPU)")
    # the native FP8 matmul needs torch's float8 dtypes (on CPU it runs as a BF16 matmul,
    # backends/fp8_gemm.py): where they are missing, skip the tests that build FP8 models, which carry
    # "fp8" in their names
    fp8_error = fp8_gemm.fp8_matmul_error("cpu")
    no_fp8 = pytest.mark.skip(reason=f"native FP8 cannot run here: {fp8_error}")
    asked = "slow" in (config.getoption("markexpr") or "")
    too_slow = pytest.mark.skip(reason="slow (minutes of torch.compile on CPU): run with pytest -m slow")
    for item in items:
        if "slow" in item.keywords and not asked:
            item.add_marker(too_slow)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        elif fp8_error and "fp8" in item.nodeid and "cuda" not in item.keywords:
            item.add_marker(no_fp8)


def torchrun(args, world=2, timeout=180):
    """`python -m torch.distributed.run --standalone --nproc_per_node=world ARGS` from the repo root,
    one thread per rank: two ranks on two cores, and no oversubscription stalls."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_ranks(ranks_of(proc.pid).values())  # (killing torchrun would leave them running)
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ranks_of(launcher):
    """{rank: pid} of the processes `launcher` (torchrun) started: their RANK in their environment."""
    ranks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1]) == launcher:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                ranks[int(next(e for e in env if e.startswith(b"RANK="))[5:])] = int(pid)
        except (OSError, StopIteration):
            pass
    return ranks


def kill_ranks(pids):
    """kill -9 of torchrun's ranks: each runs in a session of its own (torchrun's workers are started with
    start_new_session), so killing torchrun's process group does not reach them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def merged(*flags):
    """One list of --key=value flags where a later flag replaces an earlier one with the same key
    (the programs refuse a key given twice)."""
    out = {}
    for flag in flags:
        out[flag.partition("=")[0]] = flag
    return list(out.values())


def in_backward():
    """True inside a backward pass, where a recompute's re-run runs (ours and torch.utils.checkpoint's alike):
    autograd's current graph task, -1 outside one."""
    import torch
    return torch._C._current_graph_task_id() != -1


def scaled_backward(parts, loss):
    """A micro-step's backward as accumulate.py runs it: FP16's loss scaler scales the loss first; BF16 and FP32
    have no scaler (parts.scaler is None) and run the loss's own."""
    parts.scaler.backward(loss) if parts.scaler else loss.backward()


def loss_scale(parts):
    """The loss scale a step runs with: FP16's scaler's, 1 where there is none."""
    return parts.scaler.loss_scale if parts.scaler else 1.0
