"""The memory ledger beside a live run on a GPU: what train.py says of memory after its first step there.

Not read to learn the chapter: train.py's Report makes one `Live` where the device is a GPU; a CPU run runs
nothing of it (`make ledger` says it all there). Read first: `Live`, then `ledger_line_text` (the traced step
beside the CUDA allocator's figures), `blas_workspaces` and the allocator's history (`start_history`,
`save_history`).
"""
import dataclasses
import pickle
from pathlib import Path

import torch

from guards.clean_end import MEMORY_HISTORY, write_atomically
from ledger import trace

MiB = 2 ** 20
HISTORY_STEPS = 3  # --memory_snapshot records the first steps: the first creates AdamW's states


class Live:
    """After the first step: the ledger's line (rank 0), and --memory_snapshot's history of the first steps."""

    def __init__(self, cfg, model, parts, device, world_size, start_step, log):
        self.cfg, self.model, self.parts, self.device, self.world_size = cfg, model, parts, device, world_size
        self.start, self.log = start_step, log
        if log and cfg.memory_snapshot:
            start_history()

    def after_step(self, step):
        cfg, first = self.cfg, step == self.start
        if self.log and first and cfg.ledger:
            self.log(ledger_line(cfg, self.device))
        if self.log and cfg.memory_snapshot and step + 1 == min(self.start + HISTORY_STEPS, cfg.max_iters):
            path = Path(cfg.out_dir) / MEMORY_HISTORY
            save_history(path)
            self.log(f"wrote {path}: the allocator's history of the first steps; open it at "
                     f"https://pytorch.org/memory_viz")


def ledger_line(cfg, device):
    """After the first step on a GPU: the ledger's prediction beside the allocator's own figures. Reads counters
    and runs two tiny matmuls (blas_workspaces): the model is not copied and no step runs again."""
    if device.type != "cuda":
        return "memory: `make ledger` prints predicted vs measured bytes per component for this config"
    max_allocated = torch.cuda.max_memory_allocated(device)
    workspaces = blas_workspaces(device)
    return ledger_line_text(cfg, torch.cuda.memory_allocated(device), max_allocated, workspaces)


def ledger_line_text(cfg, allocated, max_allocated, workspaces):
    """The line, from the allocator's readings and the measured workspaces ({} where not measured)."""
    step = trace.step(dataclasses.replace(cfg, device="cuda"))
    states = sum(step[k] for k in ("parameters", "buffers", "master", "optimizer"))  # .grad goes after a step
    peak = step["peak"]
    blas = sum(workspaces.values())
    if workspaces:
        each = ", ".join(f"{who} {n / MiB:.1f}" for who, n in workspaces.items())
        named = f" + cuBLAS workspaces {blas / MiB:.1f} ({each}) = {(states + blas) / MiB:.1f}"
    else:
        named = " (+ cuBLAS's workspaces: this torch cannot clear them to measure)"
    return (f"memory after step 1 (traced vs CUDA allocator): states {states / MiB:.1f}{named} vs allocated "
            f"{allocated / MiB:.1f} MiB (+ the batch); steady-state peak {peak / MiB:.1f} MiB ({step['peak_phase']})"
            f"{f' + workspaces = {(peak + blas) / MiB:.1f}' if blas else ''} vs max allocated "
            f"{max_allocated / MiB:.1f} MiB (step 1 also creates AdamW's states); `make ledger` for every component")


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
