"""What a run says while it runs: the header, the progress line (loss, ms/step, tokens/s, MFU and HFU,
memory, the loss scale), evaluation's line, and memory as the trainer sees it (the traced step beside the
CUDA allocator's figures, each rank's states, the allocator's history).

Chapter: sections 1 and 3's costs, read off a live run (flops.py's MFU and HFU). Read train.py first
(`train_loop` makes one Report and calls it after each step), then `Report.progress_line`.
"""
import dataclasses
import os
import pickle
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import accumulate
import checkpoint
import flops
import memory_ledger
from guards.files import write_atomically
from ledger import measure, trace

MiB = 2 ** 20
HISTORY_STEPS = 3  # --memory_snapshot records the first steps: the first creates AdamW's states
MEMORY_HISTORY = "memory_snapshot.pickle"  # --memory_snapshot's file in out_dir


class Report:
    """What the trainer says while it runs, behind one name for train.train_loop: the header, the
    progress line (loss, ms/step, tokens/s, MFU and HFU, memory, the loss scale), the ledger's line
    after the first step, each rank's states under SHARD, the allocator's history (--memory_snapshot).
    Only rank 0 speaks; `log` is called with each line."""

    def __init__(self, cfg, model, parts, device, world_size, accum, start_step, data_bytes, log, rank=0):
        self.cfg, self.model, self.parts, self.device, self.world_size = cfg, model, parts, device, world_size
        self.start_step, self.log, self.master = start_step, log, rank == 0
        seqs, self.tokens_per_step = accumulate.effective_batch(cfg.batch_size, world_size, accum, cfg.block_size)
        # a compiled block saves its tensors at its end, so a unit of blocks re-runs whole (a core stays eager)
        stop_early = checkpoint.rerun_stops_early(cfg, parts.precision) and not (cfg.compile and
                                                                             checkpoint.policy(cfg).block_units(1))
        self.flops_per_token, again = flops.per_token(cfg, stop_early)
        self.hw_flops_per_token = self.flops_per_token + again
        self.peak = flops.peak_flops(cfg, parts.precision, device)
        if self.master:
            log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {cfg.n_layer} layers, width {cfg.n_embd}, "
                f"precision {parts.precision.name}, ckpt {cfg.ckpt}, attn {cfg.attn}, device {device}"
                + (", each block compiled (torch.compile)" if cfg.compile else ""))
            log(f"effective batch = micro-batch {cfg.batch_size} x world_size {world_size} x accum {accum} "
                f"= {seqs} sequences = {self.tokens_per_step} tokens per optimizer step")
            log(f"data: {data_bytes[0]:,} train / {data_bytes[1]:,} val bytes; "
                f"peak for MFU {self.peak / 1e12:.3g} TFLOP/s")
            if cfg.memory_snapshot:
                start_history()
        self.t_last, self.tokens_since = time.perf_counter(), 0

    def after_step(self, step, loss):
        """step: 0-based, just done."""
        cfg, master, first = self.cfg, self.master, step == self.start_step
        self.tokens_since += self.tokens_per_step
        if first and cfg.compile:  # its own line: compiling is not training speed
            self.compiled_line(step, loss)
        if master and first and cfg.ledger:
            self.log(ledger_line(cfg, self.device))
        if first and cfg.shard != "none" and (line := states_line(cfg, self.model, self.parts, self.world_size)):
            self.log(line)  # every rank measured its share; rank 0 says it
        if master and cfg.memory_snapshot and step + 1 == min(self.start_step + HISTORY_STEPS, cfg.max_iters):
            path = Path(cfg.out_dir) / MEMORY_HISTORY
            path.parent.mkdir(parents=True, exist_ok=True)
            save_history(path)
            self.log(f"wrote {path}: the allocator's history of the first steps; open it at "
                     f"https://pytorch.org/memory_viz")
        if master and ((step + 1) % cfg.log_interval == 0 or step + 1 == cfg.max_iters) and self.tokens_since:
            self.log(self.progress_line(step, loss))

    def compiled_line(self, step, loss):
        """COMPILE: the first step compiles the blocks (build.compile_blocks) as it runs; its time is
        said on a line of its own, and tokens/s, MFU and ms/step count from the step after it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - self.t_last
        if self.master:
            self.log(f"step {step + 1:5d} | loss {loss:.4f} | {took:7.1f} s: torch.compile compiled {self.cfg.n_layer} "
                     f"blocks in this step (not in the timings below, which start at step {step + 2})")
        self.t_last, self.tokens_since = time.perf_counter(), 0

    def progress_line(self, step, loss):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - self.t_last
        tok_s = self.tokens_since / dt  # all ranks together
        per_device = tok_s / self.world_size  # MFU compares one device's work with one device's peak
        mfu, hfu = (flops.utilization(per_device, f, self.peak) for f in (self.flops_per_token,
                                                                           self.hw_flops_per_token))
        pct = lambda u: "n/a" if u is None else f"{100 * u:.1f}%"  # noqa: E731
        ms = 1000 * dt / (self.tokens_since // self.tokens_per_step)
        scaler = self.parts.scaler
        self.t_last, self.tokens_since = time.perf_counter(), 0
        return (f"step {step + 1:5d} | loss {loss:.4f} | lr {self.parts.optimizer.torch_optimizer.param_groups[0]['lr']:.2e} | {ms:7.1f} ms/step"
                f" | {tok_s / 1e3:7.1f}k tok/s | MFU {pct(mfu)} HFU {pct(hfu)} | mem {now(self.device)[0]}"
                f" | scale {scaler.loss_scale:g} skipped {scaler.skipped_steps}")

    @contextmanager
    def evaluation(self, step):
        """Around an evaluation: its time is not training time. Yields a list for the loss."""
        t_eval, val = time.perf_counter(), []
        yield val
        if self.master:
            self.log(f"step {step + 1:5d} | val loss {val[0]:.4f}")
        self.t_last += time.perf_counter() - t_eval


# ---------------------------------------------------------------- memory as the trainer sees it

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


def states_line(cfg, model, parts, world_size):
    """Under SHARD (zero.py, fsdp.py), after the first step: what each rank holds of the states,
    measured (the storages alive now), beside what every DDP rank would hold (ZeRO's closed form: 16
    bytes a parameter). A collective (every rank calls it); rank 0's return is the line, the others' None."""
    opt = parts.optimizer
    params = list(model.parameters())
    mine = [measure.storage_bytes(params),
            measure.storage_bytes(opt.master_params, exclude=measure.storage_ids(params)) if opt.master_weights else 0,
            measure.storage_bytes(opt.state_tensors())]
    every = [None] * world_size
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() != 0:
        return None
    show = lambda p, m, o: f"parameters {p / MiB:.2f}, master {m / MiB:.2f}, AdamW {o / MiB:.2f}"  # noqa: E731
    ranks = "; ".join(f"rank {r}: {show(*figures)}" for r, figures in enumerate(every))
    P = sum(p.numel() for p in params)  # (a DTensor's numel is the whole parameter's)
    parameters, _, master, adamw = (n * P for n in memory_ledger.bytes_per_param_closed(parts.precision.name))
    return (f"states per rank, MiB, shard={cfg.shard} over {world_size} ranks (measured): {ranks}; "
            f"every DDP rank (16 bytes a parameter): {show(parameters, master, adamw)}")


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
