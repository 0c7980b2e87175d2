"""FP8's two refinements, a flag each, each as Transformer Engine has it: the FP8Linear built when one is on.

Chapter section 1, FP8. Read fp8.py first: PRECISION=fp8 alone trains its FP8Linear. This file subclasses
it and its autograd Function; the scales, the amax history and the forward GEMM are fp8.py's, unchanged.
  FP8_KEEP_WEIGHT=true: the FP8 weight, once per optimizer step: quantized at micro-step 1 and reused by
    micro-steps 2..K and by every recompute's re-run (TE's is_first_microbatch): ACCUM=K quantizes W once.
  FP8_GRAD=e5m2 (HYBRID, TE's format): the output gradient in E5M2, the two backward GEMMs in FP8.
precision.Precision builds this FP8Linear where either is on (linear_factory); FP8_KEEP_WEIGHT sets its
weight_mode around every forward (forward_context: weight_copies) and every re-run (recompute_contexts:
Rerun), else it stays "fresh", fp8.py's quantization in every forward. docs/fp8.md: the memory.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import fp8
from backends.fp8_gemm import E4M3, E5M2, column_major, scaled_mm, scaled_mm_any_shape

# which FP8 weight a forward uses, held by each FP8 Linear (ours and TE's) as its `weight_mode`:
#   fresh    outside accumulation (evaluation, sampling): quantize W in every forward, keep nothing
#   refresh  micro-step 1 of an optimizer step: quantize W and keep the FP8 copy
#   reuse    micro-steps 2..K, and every recompute's re-run: the kept copy, unless W changed since
WEIGHT_MODES = ("fresh", "refresh", "reuse")


@contextmanager
def weight_copies(fp8_layers, mode):
    """Forwards inside use the FP8 weight as `mode` says (one of WEIGHT_MODES), on each layer.
    A context manager, as torch.autocast is: it holds for everything the forward calls, and the
    layers are as they were after it."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"FP8 weight mode must be one of {'|'.join(WEIGHT_MODES)}, got {mode!r}")
    previous = [m.weight_mode for m in fp8_layers]
    for m in fp8_layers:
        m.weight_mode = mode
    try:
        yield
    finally:
        for m, was in zip(fp8_layers, previous):
            m.weight_mode = was


class Rerun:
    """Around a recompute unit's re-run in backward (checkpoint.Unit.rerun): each FP8 Linear of the
    unit uses the weight its forward used (the kept copy, or a fresh one where the forward
    quantized afresh) and records no amax: the same bits, and the state moves once per real
    forward. Made at the unit's forward (precision.Precision.recompute_contexts), so it knows the
    mode each layer had then; entered in backward, when the forward's context is long closed."""

    def __init__(self, fp8_layers):
        self.layers = fp8_layers
        self.modes = ["fresh" if m.weight_mode == "fresh" else "reuse" for m in fp8_layers]

    def __enter__(self):
        self.previous = [(m.weight_mode, m.recording) for m in self.layers]
        for m, mode in zip(self.layers, self.modes):
            m.weight_mode, m.recording = mode, False

    def __exit__(self, *exc):
        for m, (mode, recording) in zip(self.layers, self.previous):
            m.weight_mode, m.recording = mode, recording


@dataclass
class WeightCopy:
    """A weight in E4M3, kept from micro-step 1's forward to the optimizer step (state, like a parameter)."""
    data: torch.Tensor  # (out, in) row-major E4M3: the forward GEMM's second operand is data.t()
    scale: torch.Tensor  # the quantization scale it was made with (0-d FP32)
    amax: torch.Tensor  # the weight's amax then
    version: int  # weight._version then: every in-place change of the weight bumps it
    column_major: torch.Tensor = None  # data again, column-major, for HYBRID's input-gradient GEMM


class _FP8LinearFunction(fp8._FP8LinearFunction):
    """fp8's Function; backward in BF16 as there (module.grad == "bf16"), or HYBRID's with the output
    gradient in E5M2 (module.grad == "e5m2")."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_scale, w_fp8, w_scale, module):
        y = fp8._FP8LinearFunction.forward(ctx, x, weight, bias, x_scale, w_fp8, w_scale, module.saturate)
        kept = module.weight_copy
        # a kept FP8 weight is the layer's state, referenced here; a fresh one is not held till backward
        ctx.w8 = kept if module.grad == "e5m2" and kept is not None and kept.data is w_fp8 else None
        ctx.module = module
        return y

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        if module.grad == "bf16":
            return fp8._FP8LinearFunction.backward(ctx, grad_out)
        # TE's HYBRID: the output gradient in E5M2, both GEMMs in FP8 (shapes allowing), exact accumulation
        x_fp8, x_scale, w_scale, weight = ctx.saved_tensors
        dtype = weight.dtype
        g = grad_out.reshape(-1, weight.shape[0]).contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        g_scale = module.grad_scale(g)
        g_fp8 = fp8.quantize(g, g_scale, E5M2, module.saturate)
        if need_x:
            if ctx.w8 is None:  # no kept copy: the forward's bytes again (same W, same scale)
                w_cm = column_major(fp8.quantize(weight, w_scale, E4M3, module.saturate))
            else:  # the kept copy's column-major twin, made once per step as TE keeps W^T
                if ctx.w8.column_major is None:
                    ctx.w8.column_major = column_major(ctx.w8.data)
                # the graph outlives backward (till the step's last loss goes): let go of the copy
                w_cm, ctx.w8 = ctx.w8.column_major, None
            grad_x = scaled_mm(g_fp8, w_cm, g_scale.reciprocal(), w_scale.reciprocal(), None, dtype)
        if need_w:
            if g.shape[0] % 16 == 0:  # here the token count is the inner dimension
                grad_w = scaled_mm(g_fp8.t().contiguous(), column_major(x_fp8), g_scale.reciprocal(),
                                   x_scale.reciprocal(), None, dtype)
            else:  # the same GEMM accumulated in FP32 and rounded once (fp8_gemm.scaled_mm_any_shape)
                grad_w = scaled_mm_any_shape(g_fp8.t(), x_fp8, g_scale.reciprocal(), x_scale.reciprocal(), dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32).to(dtype)  # summed in FP32, without an FP32 copy of g
        return None if grad_x is None else grad_x.view(ctx.x_shape), grad_w, grad_b, None, None, None, None


class FP8Linear(fp8.FP8Linear):
    """fp8.FP8Linear with its E4M3 weight kept for an optimizer step where `weight_mode` says (WEIGHT_MODES,
    set under FP8_KEEP_WEIGHT only) and, with grad="e5m2", HYBRID's backward."""

    def __init__(self, in_features, out_features, bias=True, recipe="delayed", amax_history=16, margin=0,
                 grad="bf16"):
        super().__init__(in_features, out_features, bias, recipe, amax_history, margin)
        self.grad = grad  # bf16: fp8.py's backward | e5m2: the output gradient in E5M2 (TE's HYBRID)
        self.recorded_forwards = 0  # forwards that recorded an amax since the last fold (recomputes excluded)
        self.weight_copy = None  # WeightCopy kept for this optimizer step, or None
        self.weight_mode = "fresh"  # which FP8 weight a forward uses (WEIGHT_MODES), set around each forward
        self.recording = True  # a forward records its amax (not a recompute's re-run: Rerun)

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, recipe={self.recipe}, "
                f"amax_history={self.amax_history.shape[0]}, margin={self.margin}, grad={self.grad}")

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self.weight_copy = None  # made from the weight as it was, where it was
        return self

    def _reusable_copy(self):
        """The kept FP8 weight, where this forward may use it: mode "reuse", W unchanged since."""
        copy = self.weight_copy
        if self.weight_mode != "reuse" or copy is None or copy.version != self.weight._version:
            return None
        return copy

    def forward(self, x):
        # fp8.FP8Linear.forward, but W's E4M3 bytes (and its amax) come from the kept copy where there is one
        w8 = self._reusable_copy()
        with torch.no_grad():
            amax = torch.stack([fp8.amax_of(x), w8.amax if w8 is not None else fp8.amax_of(self.weight)])
            scales = self._scales(amax, [0, 1])
            if self.training and self.recording:  # once per real forward: a re-run moves no state
                self.step_amax[:2] = torch.maximum(self.step_amax[:2], amax)
                self.recorded_forwards += 1
            if w8 is None:
                w8 = WeightCopy(fp8.quantize(self.weight.detach(), scales[1], E4M3, self.saturate), scales[1],
                                amax[1], self.weight._version)
                if self.weight_mode != "fresh":
                    self.weight_copy = w8
        return _FP8LinearFunction.apply(x, self.weight, self.bias, scales[0], w8.data, w8.scale, self)

    @torch.no_grad()
    def grad_scale(self, g):
        """E5M2 scale for the output gradient g (called from backward, once per micro-step)."""
        amax = fp8.amax_of(g).reshape(1)
        self.step_amax[2:] = torch.maximum(self.step_amax[2:], amax)
        return self._scales(amax, [2])[0]

    @torch.no_grad()
    def fold_amax(self):
        if self.recorded_forwards == 0:
            return  # no training forward since the last fold (nothing to push)
        super().fold_amax()
        self.recorded_forwards = 0
