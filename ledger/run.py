"""Memory as the trainer sees it: will this run fit, how much does it hold now, what did
the ledger predict, and the allocator's own history for PyTorch's memory visualiser.

Chapter section 4, applied to a live run. Read memory_ledger.py first (the formulas);
this file only puts them beside what the machine reports, cheaply: nothing here copies
the model or runs a step again. train.py calls `check_fits` before building anything,
`ledger_line` after the first step, `now` in every progress line.
"""
import dataclasses
import os
import pickle

import torch

import memory_ledger
from config import UsageError
from data import host_memory_available
from snapshot import write_atomically

MiB, GiB = 2 ** 20, 2 ** 30
HISTORY_STEPS = 3  # --memory_snapshot records the first steps: the first creates AdamW's states


def check_fits(cfg, device):
    """Raise UsageError when the ledger's estimate of a step's peak exceeds what this device has
    free (CPU: available memory shared by this node's ranks): refused before anything is built."""
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"free on {torch.cuda.get_device_name(device)}"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        free = host_memory_available() // ranks
        where = "of memory available" + (f" per rank ({ranks})" if ranks > 1 else "")
    ledger_cfg = dataclasses.replace(cfg, device=device.type)
    # a lower bound first, in O(1): the states and activations alone; the op-by-op peak walk,
    # O(L), only where the bound leaves room
    need = sum(memory_ledger.components(ledger_cfg).values())
    if need <= free:
        need = memory_ledger.peak_estimate(ledger_cfg)[0]
    if need > free:
        raise UsageError(f"this shape needs about {need / GiB:,.1f} GiB for one step (the memory ledger's estimate), "
                         f"{free / GiB:,.1f} GiB {where}: make it smaller")


def now(device):
    """(text, bytes) for the progress line: CUDA allocated/peak, or this process's RSS."""
    if device.type == "cuda":
        alloc, peak = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
        return f"{alloc / MiB:.0f}/{peak / MiB:.0f} MiB", peak
    try:
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return f"{rss / MiB:.0f} MiB rss", rss


def ledger_line(cfg, device):
    """After the first step: the ledger's prediction beside the allocator's own figures (CUDA);
    on CPU a pointer to `make ledger`. Reads counters and runs two tiny matmuls (blas_workspaces):
    the model is not copied and no step runs again."""
    if device.type != "cuda":
        return "memory: `make ledger` prints predicted vs measured bytes per component for this config"
    max_allocated = torch.cuda.max_memory_allocated(device)
    workspaces = blas_workspaces(device)
    return ledger_line_text(cfg, torch.cuda.memory_allocated(device), max_allocated, workspaces)


def ledger_line_text(cfg, allocated, max_allocated, workspaces):
    """The line, from the allocator's readings and the measured workspaces ({} where not measured)."""
    ledger_cfg = dataclasses.replace(cfg, device="cuda")
    st = memory_ledger.state_bytes(ledger_cfg)
    states = sum(st[k] for k in ("parameters", "buffers", "master", "optimizer", "fp8_weights")) \
        + st["gradients"] - st["parameters"]  # FP32 gradient buffers stay; .grad is freed after the step
    peak, where, _ = memory_ledger.peak_estimate(ledger_cfg)
    blas = sum(workspaces.values())
    if workspaces:
        each = ", ".join(f"{who} {n / MiB:.1f}" for who, n in workspaces.items())
        named = f" + cuBLAS workspaces {blas / MiB:.1f} ({each}) = {(states + blas) / MiB:.1f}"
    else:
        named = " (+ cuBLAS's workspaces: this torch cannot clear them to measure)"
    return (f"memory after step 1 (ledger vs CUDA allocator): states {states / MiB:.1f}{named} vs allocated "
            f"{allocated / MiB:.1f} MiB (+ the batch); steady-state peak {peak / MiB:.1f} MiB ({where})"
            f"{f' + workspaces = {(peak + blas) / MiB:.1f}' if blas else ''} vs max allocated "
            f"{max_allocated / MiB:.1f} MiB (step 1 also creates AdamW's states); `make ledger` for every component")


def states_line(cfg, model, parts, world_size):
    """Under SHARD (zero.py, fsdp.py), after the first step: what each rank holds of the states,
    measured (the storages alive now), beside what every DDP rank would hold (ledger/shard.py's
    formula). A collective (every rank calls it); rank 0's return is the line, the others' None."""
    from ledger import measure, shard  # measure imports accumulate and checkpoint: loaded when asked
    opt = parts.optimizer
    params = list(model.parameters())
    mine = [measure.storage_bytes(params),
            measure.storage_bytes(opt.master_params, exclude=measure.storage_ids(params)) if opt.master_weights else 0,
            measure.storage_bytes(opt.state_tensors())]
    every = [None] * world_size
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() != 0:
        return None
    # counted as measured here, every storage on any device: AdamW's CPU step counts too
    ddp = shard.rank_states(dataclasses.replace(cfg, device="cpu"), "none", world_size, 0)
    show = lambda p, m, o: f"parameters {p / MiB:.2f}, master {m / MiB:.2f}, AdamW {o / MiB:.2f}"  # noqa: E731
    ranks = "; ".join(f"rank {r}: {show(*figures)}" for r, figures in enumerate(every))
    return (f"states per rank, MiB, shard={cfg.shard} over {world_size} ranks (measured): {ranks}; "
            f"every DDP rank: {show(ddp['parameters'], ddp['master'], ddp['optimizer'])}")


def blas_workspaces(device):
    """{thread: bytes} of the cuBLAS and cuBLASLt workspaces, which the caching allocator holds for
    the process's life: one per (handle, stream), a handle per thread, and backward runs in
    autograd's own device thread (aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB each on sm90 by
    default, cuBLASLt's apart). Measured, not assumed: cleared (clearCublasWorkspaces, as CUDA graph
    capture does; the next matmul makes them again), then memory_allocated before and after a
    first matmul in each thread. {} where this torch has no way to clear them."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return {}
    torch.cuda.synchronize(device)
    clear()
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(64, device=device, dtype=torch.bfloat16)
    start = torch.cuda.memory_allocated(device)
    with torch.no_grad():  # a Linear's forward: addmm with a bias runs through cuBLASLt, a matmul through cuBLAS
        outputs = torch.nn.functional.linear(a, a, bias), a @ a
    del outputs
    main = torch.cuda.memory_allocated(device) - start
    grad, = torch.autograd.grad((a @ a).sum(), a)  # the backward's matmuls run in autograd's thread
    del grad
    return {"main thread": main, "autograd thread": torch.cuda.memory_allocated(device) - start - main}


def start_history():
    """Record every CUDA allocation and free, with its Python stack (--memory_snapshot). Python
    frames only: with stacks="all", the default, _snapshot() symbolizes every C++ frame with
    addr2line, minutes for a few steps. The keywords are torch/cuda/memory.py's
    (_record_memory_history_impl(enabled, context, stacks, max_entries, device, ...), the same in
    every torch this project runs on: tests/test_gpu_paths.py binds them to the installed one)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=100_000)


def save_history(path):
    """Write the recorded history where PyTorch's visualiser (pytorch.org/memory_viz) opens it, and stop."""
    history = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    write_atomically(path, lambda fh: pickle.dump(history, fh))
