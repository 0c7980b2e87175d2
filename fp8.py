"""FP8 training by hand: E4M3 forward with per-tensor delayed scaling, BF16 backward (chapter section 1).

Read first: `scale_from_amax` and `quantize`, then `_FP8LinearFunction` (its GEMMs), then `FP8Linear`
(where the scales come from), then `fold_amax` (once per optimizer step, the max over ranks included).
PRECISION=fp8 trains this FP8Linear; only the Linears' matmuls run in FP8 (the GEMM: backends/fp8_gemm.py).
Its refinements, a flag each (FP8_KEEP_WEIGHT, FP8_GRAD=e5m2): backends/fp8_refined.py. Why: docs/fp8.md.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from backends.fp8_gemm import E4M3, E5M2, dequantize, fp8_max, scaled_mm
from config import UsageError


@dataclass(frozen=True)
class Settings:
    """The FP8 choices of a run, made once by precision.decide() from the fp8_* keys."""
    backend: str = "native"  # native (this file) | te (Transformer Engine, backends/fp8_te.py)
    scaling: str = "delayed"  # FP8_RECIPE: delayed (scale from an amax history) | current (this tensor's amax)
    history: int = 16  # amax history length (delayed)
    margin: int = 0  # scale = fp8_max / amax / 2**margin
    grad: str = "bf16"  # bf16: BF16 backward (the chapter) | e5m2: output gradients in E5M2 (TE's HYBRID)
    keep_weight: bool = False  # W quantized once per optimizer step (backends/fp8_refined.py) | in every forward


def scale_from_amax(amax, max_value, margin=0, previous=None):
    """The scale that maps amax onto the FP8 max: (fp8_max * 2**-margin) / amax, Transformer Engine's rule.
    An amax that is 0, inf or NaN keeps `previous` (1 if none); a scale past FP32's range is FP32's max."""
    scale = (max_value * 2.0 ** -margin) / amax
    keep = previous if previous is not None else torch.ones_like(scale)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, keep)
    return torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)


def amax_of(t):
    """max |t| as an FP32 0-d tensor, in one pass (aminmax: no |t| temporary)."""
    low, high = torch.aminmax(t.detach())
    return torch.maximum(-low, high).float()


def quantize(x, scale, dtype, saturate=True):
    """x * scale rounded to FP8 `dtype`; saturate: clamp at the FP8 max first (delayed scaling)."""
    # a 1-element scale (not 0-d) makes a BF16 x's product FP32, rounded once: to FP8
    scaled = x * scale.reshape(1)
    if saturate:  # a delayed scale may be too large for this step's tensor: clamp, not inf or NaN
        scaled.clamp_(-fp8_max(dtype), fp8_max(dtype))
    return scaled.to(dtype)


class _FP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with x and W in E4M3 (w_fp8: W quantized with w_scale); backward in the parameters' BF16."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_scale, w_fp8, w_scale, saturate):
        x_fp8 = quantize(x.reshape(-1, x.shape[-1]), x_scale, E4M3, saturate)
        # the bias joins the sum before its one rounding to BF16, as TE's fused epilogue (CUDA: not with FP32 out)
        fused = bias if weight.dtype != torch.float32 else None
        # _scaled_mm wants a row-major and b column-major: W^T of a row-major W is just that
        y = scaled_mm(x_fp8, w_fp8.t(), x_scale.reciprocal(), w_scale.reciprocal(), fused, weight.dtype,
                      fast_accum=True)
        if bias is not None and fused is None:
            y = y + bias
        # backward needs x: save its 1-byte E4M3 copy, not the 2-byte BF16 x (W, a parameter, costs nothing)
        ctx.save_for_backward(x_fp8, x_scale, w_scale, weight)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, x_scale, _, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0]).contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight  # BF16 math with the BF16 weight, not its FP8 copy
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ dequantize(x_fp8, x_scale, weight.dtype)  # with the saved x, back in BF16
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32).to(weight.dtype)  # summed in FP32, without an FP32 copy of g
        return None if grad_x is None else grad_x.view(ctx.x_shape), grad_w, grad_b, None, None, None, None


class FP8Linear(nn.Module):
    """A Linear whose matmul runs in FP8 E4M3 with per-tensor scales: fp8_max / amax / 2**margin, the amax
      recipe "delayed": the max of an amax history of the last `amax_history` optimizer steps (TE's
        DelayedScaling), so the scale holds for a whole step; with no history yet, as "current";
      recipe "current": this very tensor's (one more reduction per tensor)."""

    def __init__(self, in_features, out_features, bias=True, recipe="delayed", amax_history=16, margin=0):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe, self.margin = recipe, margin
        self.saturate = recipe == "delayed"  # a current scale maps the tensor's own amax onto the max: no clamp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # nn.Linear's init, the same random numbers: one seed, the same weights as a bf16 model
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))
        # FP32 buffers, columns [input, weight, output gradient] (the last for the E5M2 backward)
        self.register_buffer("amax_history", torch.zeros(amax_history, 3))  # row 0 = the latest step
        self.register_buffer("scale", torch.ones(3))  # the delayed recipe's scales, fixed for a step
        self.register_buffer("step_amax", torch.zeros(3), persistent=False)  # max over this step's forwards
        self.register_buffer("fp8_max", torch.tensor([fp8_max(E4M3), fp8_max(E4M3), fp8_max(E5M2)]),
                             persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # model.to(dtype=bf16) casts every float buffer; amax and scales stay FP32 (only moved)
        before = dict(self._buffers)
        super()._apply(fn, *args, **kwargs)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    def _scales(self, amax, slots):
        """Quantization scales for `slots` given this tensor's amax (current) or the history (delayed)."""
        current = scale_from_amax(amax, self.fp8_max[slots], self.margin)
        if self.recipe == "current":
            return current
        seen = self.amax_history[:, slots].amax(0) > 0  # no history yet: fall back to current
        return torch.where(seen, self.scale[slots], current)

    def forward(self, x):
        with torch.no_grad():
            amax = torch.stack([amax_of(x), amax_of(self.weight)])
            scales = self._scales(amax, [0, 1])
            if self.training:  # evaluation records nothing; a recompute's re-run folds the same amax again: no change
                self.step_amax[:2] = torch.maximum(self.step_amax[:2], amax)
            w_fp8 = quantize(self.weight.detach(), scales[1], E4M3, self.saturate)
        return _FP8LinearFunction.apply(x, self.weight, self.bias, scales[0], w_fp8, scales[1], self.saturate)

    @torch.no_grad()
    def fold_amax(self):
        """Once per optimizer step: push this step's amax into the history, recompute the scales.
        An inf amax is kept (the scale then holds for the window), a zero one is not pushed."""
        amax = torch.nan_to_num(self.step_amax, nan=0.0, posinf=math.inf)  # NaN counts as 0, inf stays inf
        pushed = amax > 0
        rolled = torch.roll(self.amax_history, 1, dims=0)
        rolled[0] = amax
        self.amax_history.copy_(torch.where(pushed, rolled, self.amax_history))
        window = torch.where(pushed, self.amax_history.amax(0), torch.zeros_like(amax))
        self.scale.copy_(scale_from_amax(window, self.fp8_max, self.margin, previous=self.scale))
        self.step_amax.zero_()


def layers(module):
    """The FP8 Linears in `module`: ours, or Transformer Engine's (which hold a weight_mode, backends/fp8_te.py)."""
    return [m for m in module.modules() if isinstance(m, FP8Linear) or hasattr(m, "weight_mode")]


def release_weight_copies(fp8_layers):
    """Before the optimizer step changes the weights: drop the FP8 weights kept for its micro-steps."""
    for m in fp8_layers:
        if getattr(m, "weight_copy", None) is not None:  # FP8_KEEP_WEIGHT's (none here; TE keeps its own)
            m.weight_copy = None


@torch.no_grad()
def fold_amax(fp8_layers, across_ranks=False):
    """Once per optimizer step: every layer pushes the step's amax into its history and recomputes its
    scales. Under DDP every rank must quantize with the same scales: first the max over ranks (one all-reduce)."""
    fp8_layers = [m for m in fp8_layers if isinstance(m, FP8Linear)]  # Transformer Engine folds its own
    if across_ranks and fp8_layers:
        amax = torch.stack([m.step_amax for m in fp8_layers])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        for m, a in zip(fp8_layers, amax):
            m.step_amax.copy_(a)
    for m in fp8_layers:
        m.fold_amax()


def check_shapes(model):
    """Raise UsageError naming each FP8 Linear whose dimensions an FP8 GEMM cannot take (multiples of 16:
    torch._scaled_mm's rule, as cuBLASLt's FP8 kernels have it; backends/fp8_gemm.py checks it on every device)."""
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear) and (odd := [n for n in (m.in_features, m.out_features) if n % 16]):
            raise UsageError(f"precision=fp8 needs every FP8 Linear's dimensions divisible by 16 (an FP8 GEMM's "
                             f"rule): {name} is {m.in_features} -> {m.out_features}, and {odd[0]} is not")


def check_saved_scales(saved, model, margin, path):
    """Raise UsageError unless a snapshot's FP8 scales (`saved`: its model entries) are what their amax histories
    give with the snapshot's `margin` (what FP8Linear.fold_amax writes), and every amax is >= 0."""
    for prefix, layer in model.named_modules():
        history, scale = (saved.get(f"{prefix}.{k}") for k in ("amax_history", "scale"))
        if not isinstance(layer, FP8Linear) or history is None or scale is None:
            continue
        if not bool((history >= 0).all()):
            raise UsageError(f"snapshot {path} is not usable: model entry {prefix}.amax_history holds a negative "
                             f"amax (an amax is a largest absolute value)")
        expected = scale_from_amax(history.amax(0), layer.fp8_max.cpu(), margin)
        if not torch.allclose(scale, expected, rtol=1e-6, atol=0):
            raise UsageError(f"snapshot {path} is not usable: model entry {prefix}.scale is {scale.tolist()}, its "
                             f"amax history gives {expected.tolist()} (fp8_max / amax / 2**fp8_margin)")
