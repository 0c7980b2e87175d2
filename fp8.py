"""FP8 training by hand: per-tensor scales, E4M3 quantization, an FP8 Linear.

Chapter section 1, its last bullet ("FP8 training: forward in FP8 with per-tensor
dynamic scaling, backward gradients in BF16"). Read first: `scale_from_amax` and
`quantize`, then `_FP8LinearFunction` (its three GEMMs), then `FP8Linear` (where the
scales and the FP8 weight come from), then `fold_amax` (the once-per-step bookkeeping,
the max over ranks included). The GEMM itself, torch._scaled_mm on a GPU and its exact
CPU stand-in, is backends/fp8_gemm.py.

PRECISION=fp8 keeps BF16 parameters, master weights and the whole BF16 workflow of
precision.py; only the Linears' matmuls run in FP8. `precision.recipe()` decides that
and builds these layers (FP8_BACKEND=native) or Transformer Engine's (te, backends/fp8_te.py).
"""
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from backends.fp8_gemm import (E4M3, E5M2, column_major, dequantize, fp8_matmul_error, fp8_max,  # noqa: F401
                               scaled_mm, scaled_mm_any_shape)


@dataclass(frozen=True)
class Settings:
    """The FP8 choices of a run, made once by precision.recipe() from the fp8_* keys."""
    backend: str = "native"  # native (this file) | te (Transformer Engine, backends/fp8_te.py)
    scaling: str = "delayed"  # FP8_RECIPE: delayed (scale from an amax history) | current (this tensor's amax)
    history: int = 16  # amax history length (delayed)
    margin: int = 0  # scale = fp8_max / amax / 2**margin
    grad: str = "bf16"  # bf16: BF16 backward (the chapter) | e5m2: output gradients in E5M2 (TE's HYBRID)


FP32_MAX = torch.finfo(torch.float32).max


def scale_from_amax(amax, max_value, margin=0, previous=None):
    """The quantization scale that maps amax onto the FP8 max, by Transformer Engine's rule
    (transformer_engine/common/recipe/delayed_scaling.cu, the amax-and-scale update kernel):
    scale = (fp8_max * 2**-margin) / amax where amax is finite and > 0; else `previous` (1 if
    none); a scale that overflows FP32 (a tiny amax) becomes FP32's largest value."""
    scale = (max_value * 2.0 ** -margin) / amax
    keep = previous if previous is not None else torch.ones_like(scale)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, keep)
    return torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)


def amax_of(t):
    """max |t| as an FP32 0-d tensor, in one pass (aminmax: no |t| temporary)."""
    low, high = torch.aminmax(t.detach())
    return torch.maximum(-low, high).float()


def quantize(x, scale, dtype, saturate=True):
    """x * scale rounded to FP8 `dtype`. saturate: clamp at the FP8 max first (a delayed scale can be
    too large for this step's tensor, and past the max a cast gives inf for E5M2, NaN for E4M3 in
    older torch); a current scale maps the tensor's own amax onto the max: no clamp, one pass fewer."""
    # a 1-element scale (not 0-d) makes the product FP32 in one pass: a 0-d FP32 tensor would
    # not promote a BF16 x, and the product would round to BF16 before its FP8 rounding
    scaled = x * scale.reshape(1)
    if saturate:
        scaled.clamp_(-fp8_max(dtype), fp8_max(dtype))
    return scaled.to(dtype)


# ---------------------------------------------------------------- which FP8 weight a forward uses

# Transformer Engine quantizes a weight once per optimizer step when its forward is told the
# micro-step: te.Linear's is_first_microbatch (transformer_engine/pytorch/module/linear.py: None
# caches nothing, True refreshes the cached FP8 weight, False reuses it). Both backends follow
# the same three modes, held by each FP8 Linear as its `weight_mode` and set around each
# forward by precision.Recipe.forward_context:
#   fresh    outside accumulation (evaluation, sampling): quantize W in every forward, keep nothing
#   refresh  micro-step 1 of an optimizer step: quantize W and keep the FP8 copy
#   reuse    micro-steps 2..K, and every recompute's re-run: the kept copy, unless W changed since
WEIGHT_MODES = ("fresh", "refresh", "reuse")


def layers(module):
    """The FP8 Linears in `module`, ours or Transformer Engine's: both hold a weight_mode."""
    return [m for m in module.modules() if hasattr(m, "weight_mode")]


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
    forward. Made at the unit's forward (precision.Recipe.recompute_contexts), so it knows the
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


class _FP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with x and W in E4M3 (w8: the weight's FP8 copy). Backward in the parameter
    dtype (BF16), or with the output gradient quantized to E5M2 (module.grad == "e5m2")."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_scale, w8, module):
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8 = quantize(x2, x_scale, E4M3, module.saturate)
        out_dtype = weight.dtype
        # the bias joins the GEMM's output before its one rounding to BF16, as TE fuses it into
        # cuBLASLt's epilogue (module/linear.py); rounding first and adding after would move about
        # 30% of the outputs by an ulp (tests/test_fp8.py). CUDA refuses a bias with an FP32
        # output (backends/fp8_gemm.py), and there adding it after costs one FP32 rounding: we do that
        fused = bias if out_dtype != torch.float32 else None
        # _scaled_mm wants a row-major and b column-major: W^T of a row-major W is just that
        y = scaled_mm(x_fp8, w8.data.t(), x_scale.reciprocal(), w8.scale.reciprocal(), fused, out_dtype,
                      fast_accum=True)
        if bias is not None and fused is None:
            y = y + bias
        # save the 1-byte FP8 input for backward (wgrad needs x), not the 2-byte BF16 one: FP8
        # halves this layer's saved activation too. W is a parameter: saving it costs nothing.
        ctx.save_for_backward(x_fp8, x_scale, w8.scale, weight)
        # a kept FP8 weight is the layer's state, referenced here; a fresh one is not held till backward
        ctx.w8 = w8 if module.grad == "e5m2" and module.weight_copy is w8 else None
        ctx.module, ctx.has_bias, ctx.x_shape = module, bias is not None, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, x_scale, w_scale, weight = ctx.saved_tensors
        dtype, module = weight.dtype, ctx.module
        g = grad_out.reshape(-1, weight.shape[0]).contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        if module.grad == "bf16":  # the chapter's: dgrad with the BF16 weight, wgrad with the saved x
            if need_x:
                grad_x = g @ weight
            if need_w:
                grad_w = g.t() @ dequantize(x_fp8, x_scale, dtype)
        else:
            # TE's HYBRID: the output gradient in E5M2, both GEMMs in FP8 (shapes allowing), exact accumulation
            g_scale = module.grad_scale(g)
            g_fp8 = quantize(g, g_scale, E5M2, module.saturate)
            if need_x:
                if ctx.w8 is None:  # no kept copy: the forward's bytes again (same W, same scale)
                    w_cm = column_major(quantize(weight, w_scale, E4M3, module.saturate))
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
        return None if grad_x is None else grad_x.view(ctx.x_shape), grad_w, grad_b, None, None, None


class FP8Linear(nn.Module):
    """A Linear whose matmul runs in FP8 E4M3 with per-tensor scales (PRECISION=fp8, FP8_BACKEND=native).

    forward: x and W are each multiplied by a quantization scale, rounded to E4M3 and
    multiplied by fp8_gemm.scaled_mm with the reciprocal (dequantization) scales, output
    and accumulation in BF16/FP32. The scale of a tensor is fp8_max / amax / 2**margin:
      recipe "current": amax of this very tensor (one extra reduction per tensor);
      recipe "delayed": the max of an amax history of the last `amax_history` optimizer
        steps (TE's DelayedScaling, amax_compute_algo="max"): the scale is fixed for the
        whole step. Until a first amax has been recorded, a tensor uses current scaling.
    W is quantized once per optimizer step under accumulation (see WEIGHT_MODES) and
    reused by micro-steps 2..K and by recomputes; in evaluation, in every forward.
    backward: BF16 (grad="bf16"), or the output gradient in E5M2 (grad="e5m2", TE's HYBRID).

    Recompute (checkpoint.py): a forward only max-folds its amax into `step_amax`, and not
    in a re-run (`recording` is off there: Rerun); `fold_amax()`, once per optimizer step,
    pushes it into the history and recomputes the scales: a re-run uses the forward's scales
    (same bits), the history moves once.

    What it stores (for memory_ledger.py), per layer of shape in -> out, history length H:
      parameters: weight (out, in) and bias (out,) in BF16 (FP32 master and AdamW state in
        MasterWeightOptimizer); FP32 buffers (kept FP32 by model.to(bf16)): amax_history (H, 3)
        and scale (3,) in the state_dict, columns [input, weight, output gradient], and
        step_amax (3,) and fp8_max (3,) not in it;
      the kept FP8 weight (accumulation_step only): E4M3 (out, in), out*in bytes, from the
        layer's forward in micro-step 1 until accumulate.optimizer_step releases it before
        AdamW; with grad="e5m2" also its column-major twin (out*in bytes more) from the
        layer's first backward; none outside accumulation (evaluation, sampling);
      saved for backward per call (M = tokens in the call, B*T): x_fp8 (M, in)
        float8_e4m3fn, 1 byte per element where nn.Linear saves x at 2 bytes (BF16);
        x_scale and w_scale, 0-d FP32; a reference to the weight parameter (no new memory);
      transient in forward: the FP32 product x*scale (M*in*4 bytes) while quantizing x; when W
        is quantized (refresh, fresh), its FP32 product (4*out*in) and, fresh only, its E4M3 copy;
      transient in backward (grad="bf16"): x dequantized to BF16 (M*in*2 bytes) for wgrad;
        grad="e5m2" instead: E5M2 copies of the output gradient (M*out bytes, and a
        transposed one) and a column-major copy of x_fp8; where M is not a multiple of 16,
        both operands as FP32 values (4 bytes per element) and the FP32 weight gradient.

    Dimensions: in and out features divisible by 16 (an FP8 GEMM rule), else ValueError at
    build. Only the Linears are FP8 (embeddings, LayerNorms, attention core, head stay BF16).
    """
    def __init__(self, in_features, out_features, bias=True, recipe="delayed", amax_history=16, margin=0,
                 grad="bf16"):
        super().__init__()
        if E4M3 is None:
            raise ValueError(f"precision=fp8 needs torch with float8 dtypes (>= 2.1), this is {torch.__version__}")
        if in_features % 16 or out_features % 16:
            raise ValueError(f"fp8 needs Linear dimensions divisible by 16 (an FP8 GEMM requirement), got "
                             f"{in_features} -> {out_features}: use an n_embd that is a multiple of 16")
        self.in_features, self.out_features = in_features, out_features
        self.recipe, self.margin, self.grad = recipe, margin, grad
        self.saturate = recipe == "delayed"  # see quantize
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # nn.Linear's init, the same random numbers: one seed, the same weights as a bf16 model
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))
        self.register_buffer("amax_history", torch.zeros(amax_history, 3))  # row 0 = the latest step
        self.register_buffer("scale", torch.ones(3))  # quantization scales for the delayed recipe
        self.register_buffer("step_amax", torch.zeros(3), persistent=False)  # max over this step's forwards
        self.register_buffer("fp8_max", torch.tensor([fp8_max(E4M3), fp8_max(E4M3), fp8_max(E5M2)]),
                             persistent=False)
        self.recorded_forwards = 0  # forwards that recorded an amax since the last fold (recomputes excluded)
        self.weight_copy = None  # WeightCopy kept for this optimizer step, or None
        self.weight_mode = "fresh"  # which FP8 weight a forward uses (WEIGHT_MODES), set around each forward
        self.recording = True  # a forward records its amax (not a recompute's re-run: Rerun)

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, recipe={self.recipe}, "
                f"amax_history={self.amax_history.shape[0]}, margin={self.margin}, grad={self.grad}")

    def _apply(self, fn, *args, **kwargs):
        # model.to(dtype=bf16) casts every float buffer; amax and scales stay FP32 (only moved)
        before = dict(self._buffers)
        super()._apply(fn, *args, **kwargs)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        self.weight_copy = None  # made from the weight as it was, where it was
        return self

    def _scales(self, amax, slots):
        """Quantization scales for `slots` given this tensor's amax (current) or the history (delayed)."""
        current = scale_from_amax(amax, self.fp8_max[slots], self.margin)
        if self.recipe == "current":
            return current
        seen = self.amax_history[:, slots].amax(0) > 0  # no history yet: fall back to current
        return torch.where(seen, self.scale[slots], current)

    def _reusable_copy(self):
        """The kept FP8 weight, where this forward may use it: mode "reuse", W unchanged since."""
        copy = self.weight_copy
        if self.weight_mode != "reuse" or copy is None or copy.version != self.weight._version:
            return None
        return copy

    def forward(self, x):
        w8 = self._reusable_copy()
        with torch.no_grad():
            amax = torch.stack([amax_of(x), w8.amax if w8 is not None else amax_of(self.weight)])
            scales = self._scales(amax, [0, 1])
            # record once per real forward: a recomputed forward (in backward) sees the same
            # tensors and must neither move the state nor change the scales it uses
            if self.training and self.recording:
                self.step_amax[:2] = torch.maximum(self.step_amax[:2], amax)
                self.recorded_forwards += 1
            if w8 is None:
                w8 = WeightCopy(quantize(self.weight.detach(), scales[1], E4M3, self.saturate), scales[1],
                                amax[1], self.weight._version)
                if self.weight_mode != "fresh":
                    self.weight_copy = w8
        return _FP8LinearFunction.apply(x, self.weight, self.bias, scales[0], w8, self)

    @torch.no_grad()
    def grad_scale(self, g):
        """E5M2 scale for the output gradient g (called from backward, once per micro-step)."""
        amax = amax_of(g).reshape(1)
        self.step_amax[2:] = torch.maximum(self.step_amax[2:], amax)
        return self._scales(amax, [2])[0]

    @torch.no_grad()
    def fold_amax(self):
        """Once per optimizer step: push this step's amax into the history, recompute the scales.

        As TE's DelayedScaling (delayed_scaling.cu, bulk update kernel): an inf amax is kept (the
        scale then holds for the window), a zero amax is not pushed and leaves the scale alone.
        Different, on purpose: our history moves once per optimizer step, TE's once per forward
        (each micro-step) and once per backward: with ACCUM=K one FP8_AMAX_HISTORY covers K times
        more forwards here, and our scales hold for a whole step (so recompute and the kept FP8
        weight reuse the forward's bytes); a NaN amax counts as 0 (TE's kernels skip NaN elements);
        with no history yet we use current scaling where TE starts from scale 1; evaluation
        records nothing (TE's does, backends/fp8_te.py)."""
        if self.recorded_forwards == 0:
            return  # no training forward since the last fold (nothing to push)
        amax = torch.nan_to_num(self.step_amax, nan=0.0, posinf=math.inf)
        pushed = amax > 0
        rolled = torch.roll(self.amax_history, 1, dims=0)
        rolled[0] = amax
        self.amax_history.copy_(torch.where(pushed, rolled, self.amax_history))
        window = torch.where(pushed, self.amax_history.amax(0), torch.zeros_like(amax))
        self.scale.copy_(scale_from_amax(window, self.fp8_max, self.margin, previous=self.scale))
        self.step_amax.zero_()
        self.recorded_forwards = 0


def release_weight_copies(fp8_layers):
    """Before the optimizer step changes the weights: drop the FP8 copies kept for this step
    (stale after it, and they would only add to the optimizer step's peak). Transformer
    Engine keeps its own cache."""
    for m in fp8_layers:
        if isinstance(m, FP8Linear):
            m.weight_copy = None


@torch.no_grad()
def fold_amax(fp8_layers, across_ranks=False):
    """Once per optimizer step: every layer pushes the step's amax into its history and
    recomputes its scales. Under DDP every rank must quantize with the same scales, so
    first the max amax over ranks (one all-reduce for all layers), as Transformer Engine does."""
    fp8_layers = [m for m in fp8_layers if isinstance(m, FP8Linear)]  # Transformer Engine folds its own
    if not fp8_layers:
        return
    if across_ranks:
        amax = torch.stack([m.step_amax for m in fp8_layers])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        for m, a in zip(fp8_layers, amax):
            m.step_amax.copy_(a)
    for m in fp8_layers:
        m.fold_amax()
