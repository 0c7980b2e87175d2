"""FP8 training by hand: per-tensor scales, E4M3 quantization, an FP8 Linear.

Chapter section 1, its last bullet ("FP8 training: forward in FP8 with per-tensor
dynamic scaling, backward gradients in BF16"). Read first: `scale_from_amax` and
`quantize`, then `_FP8LinearFunction` (the matmul), then `FP8Linear` (where the scales
come from), then `fold_amax` (the once-per-step bookkeeping, the max over ranks included).

PRECISION=fp8 keeps BF16 parameters, master weights and the whole BF16 workflow of
precision.py; only the Linears' matmuls run in FP8. `precision.recipe()` decides that
and builds these layers (FP8_BACKEND=native) or Transformer Engine's (te, fp8_te.py).
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint


@dataclass(frozen=True)
class Settings:
    """The FP8 choices of a run, made once by precision.recipe() from the fp8_* keys."""
    backend: str = "native"  # native (this file) | te (Transformer Engine, fp8_te.py)
    recipe: str = "delayed"  # delayed (scale from an amax history) | current (from this tensor's amax)
    history: int = 16  # amax history length (delayed)
    margin: int = 0  # scale = fp8_max / amax / 2**margin
    grad: str = "bf16"  # bf16: BF16 backward (the chapter) | e5m2: output gradients in E5M2 (TE's HYBRID)

E4M3 = getattr(torch, "float8_e4m3fn", None)  # forward: 3 mantissa bits, max 448
E5M2 = getattr(torch, "float8_e5m2", None)  # gradients (TE's HYBRID): 2 mantissa bits, max 57344


def fp8_max(dtype):
    return torch.finfo(dtype).max


def scale_from_amax(amax, max_value, margin=0, previous=None):
    """Quantization scale that maps amax onto the FP8 max, as TE's DelayedScaling:
    scale = (fp8_max / amax) / 2**margin. Where amax is 0 or not finite the scale
    cannot be computed: keep `previous` (1 if none)."""
    scale = (max_value / amax) / 2.0 ** margin
    keep = previous if previous is not None else torch.ones_like(scale)
    return torch.where((amax > 0) & torch.isfinite(amax) & torch.isfinite(scale), scale, keep)


def quantize(x, scale, dtype):
    """x * scale rounded to FP8 `dtype`, saturating at its max (a CUDA cast would give NaN
    past it, and a delayed scale can be too large for this step's tensor)."""
    m = fp8_max(dtype)
    # one FP32 temporary; a copy even for FP32 x, which must not be scaled in place
    return x.to(torch.float32, copy=True).mul_(scale).clamp_(-m, m).to(dtype).contiguous()


def dequantize(q, scale, dtype):
    return (q.float() / scale).to(dtype)


def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    """a @ b for FP8 a (row-major, M x K) and b (column-major, K x N), times the
    *dequantization* scales scale_a * scale_b (fp32 scalars), plus bias.
    K and N must be multiples of 16. Works on CPU and sm89+ GPUs."""
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)


def fp8_matmul_error(device):
    """None where torch._scaled_mm runs on `device`, else why not (older torch on CPU,
    GPUs before sm89): one tiny E4M3 matmul tells."""
    if E4M3 is None:
        return f"torch {torch.__version__} has no float8 dtypes"
    try:
        a = torch.zeros(16, 16, device=device).to(E4M3)
        one = torch.ones((), device=device)
        scaled_mm(a, a.t(), one, one)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return f"torch._scaled_mm does not run on {device} with torch {torch.__version__} ({str(e).splitlines()[0][:80]})"
    return None


def column_major(t):
    """The same matrix laid out column-major (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


class _FP8LinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with x and W quantized to E4M3. Backward in the parameter dtype
    (BF16), or with the output gradient quantized to E5M2 (module.grad == "e5m2")."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_scale, w_scale, module):
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8 = quantize(x2, x_scale, E4M3)
        w_fp8 = quantize(weight, w_scale, E4M3)
        # _scaled_mm wants a row-major and b column-major: W^T of a row-major W is just that
        y = scaled_mm(x_fp8, w_fp8.t(), x_scale.reciprocal(), w_scale.reciprocal(), bias, weight.dtype)
        # save the 1-byte FP8 input for backward (wgrad needs x), not the 2-byte BF16 one:
        # so FP8 halves this layer's saved activation as well as speeding up its matmul.
        # W is a parameter (kept anyway), not an activation: saving it costs nothing.
        ctx.save_for_backward(x_fp8, x_scale, w_scale, weight)
        ctx.module, ctx.has_bias, ctx.x_shape = module, bias is not None, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, x_scale, w_scale, weight = ctx.saved_tensors
        dtype = weight.dtype
        g = grad_out.reshape(-1, weight.shape[0]).contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = grad_w = grad_b = None
        if ctx.module.grad == "bf16":
            # the chapter's recipe: FP8 forward, BF16 backward (dgrad with the BF16 weight,
            # wgrad with the input dequantized from its saved FP8 bytes)
            if need_x:
                grad_x = g @ weight
            if need_w:
                grad_w = g.t() @ dequantize(x_fp8, x_scale, dtype)
        else:
            # TE's HYBRID: the output gradient in E5M2 (more range, less precision), both
            # backward GEMMs in FP8 where their shapes allow
            g_scale = ctx.module.grad_scale(g)
            g_fp8 = quantize(g, g_scale, E5M2)
            if need_x:
                w_fp8 = quantize(weight, w_scale, E4M3)  # the forward's bytes again: same W, same scale
                grad_x = scaled_mm(g_fp8, column_major(w_fp8), g_scale.reciprocal(), w_scale.reciprocal(),
                                   None, dtype)
            if need_w:
                if g.shape[0] % 16 == 0:  # here the token count is the inner dimension
                    grad_w = scaled_mm(g_fp8.t().contiguous(), column_major(x_fp8), g_scale.reciprocal(),
                                       x_scale.reciprocal(), None, dtype)
                else:
                    grad_w = dequantize(g_fp8, g_scale, dtype).t() @ dequantize(x_fp8, x_scale, dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.float().sum(0).to(dtype)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        return grad_x, grad_w, grad_b, None, None, None


class FP8Linear(nn.Module):
    """A Linear whose matmul runs in FP8 E4M3 with per-tensor scales (PRECISION=fp8, FP8_BACKEND=native).

    forward: x and W are each multiplied by a quantization scale, rounded to E4M3 and
    multiplied by torch._scaled_mm with the reciprocal (dequantization) scales, output
    and accumulation in BF16/FP32. The scale of a tensor is fp8_max / amax / 2**margin:
      recipe "current": amax of this very tensor (one extra reduction per tensor);
      recipe "delayed": the max of an amax history of the last `amax_history` optimizer
        steps (TE's DelayedScaling, amax_compute_algo="max"): the scale is fixed for the
        whole step. Until a first amax has been recorded, a tensor uses current scaling.
    backward: BF16 (grad="bf16"), or the output gradient in E5M2 (grad="e5m2", TE's HYBRID).

    Recompute (checkpoint.py): during a step the forward only folds this tensor's amax into
    `step_amax` with a max, and only outside a recomputation (checkpoint.is_recomputing());
    `fold_amax()`, called once per optimizer step (fp8.fold_amax, from accumulate.py), pushes
    it into the history and recomputes the scales. So a recomputed forward uses the same
    scales as the original one (bit-identical output) and the history moves once per step.

    What it stores (for memory_ledger.py), per layer of shape in -> out, history length H:
      parameters: weight (out, in) and bias (out,), in the model's dtype (BF16), with the
        FP32 master copy and AdamW state held by MasterWeightOptimizer as for any parameter;
      buffers, FP32 (kept FP32 by model.to(bf16)), in the state_dict: amax_history (H, 3)
        and scale (3,), columns/entries [input, weight, output gradient]; not in the
        state_dict: step_amax (3,) and fp8_max (3,);
      saved for backward per call (M = tokens in the call, B*T): x_fp8 (M, in)
        float8_e4m3fn, 1 byte per element where nn.Linear saves x at 2 bytes (BF16);
        x_scale and w_scale, 0-d FP32; a reference to the weight parameter (no new memory);
      transient in forward: |x| for its amax (M*in, BF16), one FP32 temporary of x then of
        W while quantizing (4 bytes per element), the E4M3 copy of W (out*in bytes);
      transient in backward (grad="bf16"): x dequantized to BF16 (M*in*2 bytes) for wgrad;
        grad="e5m2" instead: E5M2 copies of the output gradient (M*out bytes, and a
        transposed one), the E4M3 weight again and a column-major copy of x_fp8.

    Dimensions: FP8 GEMMs need in and out features divisible by 16; other shapes raise
    ValueError at model build (for this GPT: n_embd a multiple of 16). Only the Linears are
    FP8: embeddings, LayerNorms, the attention core and the tied output head stay BF16,
    as with Transformer Engine.
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
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        # nn.Linear's init, drawing the same random numbers: with one seed an fp8 model starts
        # from the same weights as a bf16 one (GPT re-initialises the weight anyway)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))
        self.register_buffer("amax_history", torch.zeros(amax_history, 3))  # row 0 = the latest step
        self.register_buffer("scale", torch.ones(3))  # quantization scales for the delayed recipe
        self.register_buffer("step_amax", torch.zeros(3), persistent=False)  # max over this step's forwards
        self.register_buffer("fp8_max", torch.tensor([fp8_max(E4M3), fp8_max(E4M3), fp8_max(E5M2)]),
                             persistent=False)
        self.recorded_forwards = 0  # forwards that recorded an amax since the last fold (recomputes excluded)

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
            amax = torch.stack([x.detach().abs().amax(), self.weight.detach().abs().amax()]).float()
            scales = self._scales(amax, [0, 1])
            # record once per real forward: a recomputed forward (in backward) sees the same
            # tensors and must neither move the state nor change the scales it uses
            if self.training and not checkpoint.is_recomputing():
                self.step_amax[:2] = torch.maximum(self.step_amax[:2], amax)
                self.recorded_forwards += 1
        return _FP8LinearFunction.apply(x, self.weight, self.bias, scales[0], scales[1], self)

    @torch.no_grad()
    def grad_scale(self, g):
        """E5M2 scale for the output gradient g (called from backward, once per micro-step)."""
        amax = g.abs().amax().float().reshape(1)
        self.step_amax[2:] = torch.maximum(self.step_amax[2:], amax)
        return self._scales(amax, [2])[0]

    @torch.no_grad()
    def fold_amax(self):
        """Once per optimizer step: push this step's amax into the history, recompute the scales."""
        if self.recorded_forwards == 0:
            return  # no training forward since the last fold (nothing to push)
        amax = torch.where(torch.isfinite(self.step_amax), self.step_amax, torch.zeros_like(self.step_amax))
        self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=0))
        self.amax_history[0] = amax
        self.scale.copy_(scale_from_amax(self.amax_history.amax(0), self.fp8_max, self.margin, previous=self.scale))
        self.step_amax.zero_()
        self.recorded_forwards = 0



def layers(model):
    """The native FP8 Linears of a model (their amax is folded once per optimizer step)."""
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


@torch.no_grad()
def fold_amax(fp8_layers, across_ranks=False):
    """Once per optimizer step: every layer pushes the step's amax into its history and
    recomputes its scales. Under DDP every rank must quantize with the same scales, so
    first the max amax over ranks (one all-reduce for all layers), as Transformer Engine does."""
    if not fp8_layers:
        return
    if across_ranks:
        amax = torch.stack([m.step_amax for m in fp8_layers])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        for m, a in zip(fp8_layers, amax):
            m.step_amax.copy_(a)
    for m in fp8_layers:
        m.fold_amax()
