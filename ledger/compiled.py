"""The ledger under COMPILE=1: what torch.compile's blocks save and the step's peak, measured.

Chapter section 4, with the blocks compiled (build.compile_blocks). Read ledger/measure.py
first (SavedBytes, ModulePath, LiveTensors), then `measure`.

Why measure.measure alone will not do: its op-by-op tracker (LiveTensors) is a
TorchDispatchMode, and torch.compile runs every frame eagerly while such a mode is active
(torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode present"), so it would count
the eager step and call it compiled. Here nothing of that kind is active: the saved tensors are
read by saved-tensor hooks, which fire at the compiled region's boundary (each block's
CompiledFunction saves what its partitioner chose), and the step's peak by the CPU allocator's
own allocation events (torch.profiler, profile_memory), which see the buffers a compiled kernel
allocates; on CUDA the caching allocator's counters, as always. The states (parameters,
gradients, master, AdamW) are measure.measure's: compiling a block does not change them.
"""
import os
from contextlib import contextmanager

import torch

import accumulate
from ledger import measure as eager

PHASE = "ledger phase: "  # the profiler's marker events that say where a phase begins


class BlockPath(eager.ModulePath):
    """ModulePath for a model whose blocks are compiled: a hook inside a compiled block is traced
    into its graph (and adding one recompiles it), so each block is named from outside its compiled
    code, around its compiled call; the modules outside the blocks get ModulePath's own hooks."""

    def __init__(self, model):
        super().__init__(model, skip=lambda name: name == "h" or name.startswith("h."))
        self.blocks = list(model.h)
        for i, block in enumerate(self.blocks):
            compiled = block._compiled_call_impl  # what nn.Module.compile() put there (None: not compiled)
            if compiled is None:
                raise ValueError(f"block {i} is not compiled (build.compile_blocks): ledger.measure measures it")
            block._compiled_call_impl = self._named(f"h.{i}", compiled)

    def _named(self, name, compiled):
        def call(*args, **kwargs):
            self.stack.append(name)
            try:
                return compiled(*args, **kwargs)
            finally:
                self.stack.pop()
        call.compiled = compiled
        return call

    def remove(self):
        super().remove()
        for block in self.blocks:
            block._compiled_call_impl = block._compiled_call_impl.compiled


class Allocations:
    """The step's peak from the CPU allocator's own events (torch.profiler with profile_memory: every
    allocation and free, the compiled kernels' buffers too), over the bytes adopted at the start;
    `mark(phase)` says where a phase begins, so the peak's phase is known. On CUDA: measure.CudaAllocator."""

    def __init__(self, base_bytes):
        self.base, self.peak, self.peak_phase = base_bytes, base_bytes, "start"

    def __enter__(self):
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with quiet():
            self.profile.__enter__()
        return self

    @staticmethod
    def mark(phase):
        with torch.profiler.record_function(PHASE + phase):
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
    """measure.measure's dict for a compiled model: the states from it (exact, compile does not change
    them), then one more step with no dispatch mode active for what compile does change: activations
    and saved_tensors (each attributed to its block, by BlockPath), and the step's peak and its phase.
    eager_activations and eager_peak keep what measure.measure counted, which is the eager step's."""
    device = torch.device(device)
    with torch.compiler.set_stance("force_eager"):  # LiveTensors' mode would make it eager anyway, less cleanly
        out = eager.measure(model, parts, batch, device)
    out["eager_activations"], out["eager_peak"] = out["activations"], out["peak"]
    static = eager.resident(model, parts)
    adopted = static + (parts.grad_buffers or []) + list(batch)
    where = BlockPath(model)
    saved, losses = eager.SavedBytes(static + list(batch), where=where), []
    hook = model.register_forward_hook(lambda module, args, output: losses.append(output[1]))
    cuda = device.type == "cuda"
    tracker = eager.CudaAllocator(device) if cuda else Allocations(eager.storage_bytes(adopted, device))

    def observe(name, weighted_loss=None):
        if name == "backward":  # what the forward saved, before any recompute re-run
            out["activations"] = saved.total
            out["saved_tensors"] = dict(saved.found)
            eager.saving_nodes(losses[-1], out["saved_tensors"])
        if cuda:
            tracker.start_phase(name)
        else:
            tracker.mark(name)

    try:
        with tracker, saved, eager.phases(model, parts, observe):
            if cuda:
                tracker.reset_peak()
            accumulate.accumulation_step(model, parts, [batch])
            if cuda:
                tracker.read()  # the last phase's high-water mark, folded in
    finally:
        hook.remove()
        where.remove()
    out["peak"], out["peak_phase"] = tracker.peak, tracker.peak_phase
    return out


def block_bytes(saved_tensors, n_layer):
    """{block index or "outside": bytes} of the saved tensors, by the block that saved them."""
    out = {i: 0 for i in range(n_layer)} | {"outside": 0}
    for s in saved_tensors.values():
        group = s.modules[0].split(".")[1] if s.modules and s.modules[0].startswith("h.") else "outside"
        out[int(group) if group != "outside" else group] += s.nbytes
    return out
