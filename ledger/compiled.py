"""The ledger under COMPILE=1: what torch.compile's blocks save and the step's peak, measured.

Chapter section 4, with the blocks compiled (build.compile_blocks). Read ledger/measure.py first, then
`measure` here: measure.measure's step, counted again by the trackers below.

Why not LiveTensors: it is a TorchDispatchMode, and while one is active torch.compile runs every frame
eagerly (torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode present"): it would count the eager
step. Here none is active: saved-tensor hooks read what each block's CompiledFunction saves (they fire at
the compiled region's boundary), BlockPath names its block from outside the compiled code, and the CPU
allocator's own events (torch.profiler, profile_memory: Allocations) give the peak, a compiled kernel's
buffers included; on CUDA the caching allocator's counters. The states are the eager step's: compiling a
block does not change them.
"""
import functools
import math
import os
from contextlib import contextmanager

import torch

from ledger import measure as eager

PHASE = "ledger phase: "  # the profiler's marker events that say where a phase begins


class BlockPath(eager.ModulePath):
    """ModulePath for a model whose blocks are compiled: a hook inside a compiled block is traced into its
    graph (and adding one recompiles it), so each block is named around its compiled call instead."""

    def __init__(self, model):
        super().__init__(model, skip=lambda name: name == "h" or name.startswith("h."))
        self.blocks = list(model.h)
        self.compiled = [block._compiled_call_impl for block in self.blocks]  # what nn.Module.compile() put there
        for i, (block, compiled) in enumerate(zip(self.blocks, self.compiled)):
            if compiled is None:
                raise ValueError(f"block {i} is not compiled (build.compile_blocks): ledger.measure measures it")
            block._compiled_call_impl = functools.partial(self._named, f"h.{i}", compiled)

    def _named(self, name, compiled, *args, **kwargs):
        self.stack.append(name)
        try:
            return compiled(*args, **kwargs)
        finally:
            self.stack.pop()

    def remove(self):
        super().remove()
        for block, compiled in zip(self.blocks, self.compiled):
            block._compiled_call_impl = compiled


class Allocations:
    """The step's peak from the CPU allocator's own events (torch.profiler with profile_memory: every
    allocation and free, compiled kernels' buffers too) over the bytes adopted, and the phase it fell in:
    measure.measure's tracker for a compiled step on CPU. The live bytes are known only once the profile
    is read, at the end: `read` says nan."""

    def __init__(self, base_bytes=0):
        self.base, self.peak, self.peak_phase = base_bytes, base_bytes, "start"

    def adopt(self, tensors):
        self.base = self.peak = self.base + eager.storage_bytes(tensors, "cpu")

    def read(self):
        return math.nan

    def reset_peak(self):  # the peak is found in the events, over `base`
        pass

    def __enter__(self):
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with quiet():
            self.profile.__enter__()
        return self

    @staticmethod
    def start_phase(name):
        with torch.profiler.record_function(PHASE + name):
            pass

    def __exit__(self, *exc):
        with quiet():
            self.profile.__exit__(*exc)
        if exc[0] is not None:
            return False
        cpu = torch.autograd.DeviceType.CPU
        events = sorted((e.start_ns(), e.name(), e.nbytes() if e.name() == "[memory]" else 0)
                        for e in self.profile.profiler.kineto_results.events()
                        if (e.name() == "[memory]" and e.device_type() == cpu) or e.name().startswith(PHASE))
        live, phase = self.base, "start"
        for _, name, nbytes in events:
            if name.startswith(PHASE):
                phase = name.removeprefix(PHASE)
            live += nbytes
            if live > self.peak:
                self.peak, self.peak_phase = live, phase
        return False


@contextmanager
def quiet():
    """Kineto says "profiler_start" and "profiler_stop" on fd 2 whatever KINETO_LOG_LEVEL asks: not here."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def measure(model, parts, batch, device):
    """measure.measure's dict for a compiled model: the states from an eager step (compile does not change
    them), then activations, saved_tensors (each by its block: BlockPath), the peak and its phase from a
    compiled one, counted with no dispatch mode active."""
    device = torch.device(device)
    with torch.compiler.set_stance("force_eager"):  # LiveTensors' mode would make it eager anyway, less cleanly
        out = eager.measure(model, parts, batch, device)
    tracker = eager.CudaAllocator(device) if device.type == "cuda" else Allocations()
    compiled = eager.measure(model, parts, batch, device, tracker=tracker, module_path=BlockPath)
    return out | {key: compiled[key] for key in ("activations", "saved_tensors", "peak", "peak_phase")}


def block_bytes(saved_tensors, n_layer):
    """{block index or "outside": bytes} of the saved tensors, by the block that saved them."""
    out = {i: 0 for i in range(n_layer)} | {"outside": 0}
    for s in saved_tensors.values():
        block = s.modules[0].split(".")[1] if s.modules and s.modules[0].startswith("h.") else None
        out[int(block) if block else "outside"] += s.nbytes
    return out
