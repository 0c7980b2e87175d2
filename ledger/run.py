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
    on CPU a pointer to `make ledger`. Reads counters only: nothing is copied or run again."""
    if device.type != "cuda":
        return "memory: `make ledger` prints predicted vs measured bytes per component for this config"
    ledger_cfg = dataclasses.replace(cfg, device="cuda")
    st = memory_ledger.state_bytes(ledger_cfg)
    states = sum(st[k] for k in ("parameters", "buffers", "master", "optimizer", "fp8_weights")) \
        + st["gradients"] - st["parameters"]  # FP32 gradient buffers stay; .grad is freed after the step
    peak, where, _ = memory_ledger.peak_estimate(ledger_cfg)
    return (f"memory after step 1 (ledger vs CUDA allocator): states {states / MiB:.1f} vs allocated "
            f"{torch.cuda.memory_allocated(device) / MiB:.1f} MiB (+ the batch); steady-state peak "
            f"{peak / MiB:.1f} MiB ({where}) vs max allocated {torch.cuda.max_memory_allocated(device) / MiB:.1f} "
            f"MiB (step 1 also creates AdamW's states); `make ledger` for every component")


def start_history():
    """Record every CUDA allocation and free, with its stack (--memory_snapshot)."""
    torch.cuda.memory._record_memory_history(max_entries=100_000)


def save_history(path):
    """Write the recorded history where PyTorch's visualiser (pytorch.org/memory_viz) opens it, and stop."""
    history = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    write_atomically(path, lambda fh: pickle.dump(history, fh))
