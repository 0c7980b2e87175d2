"""Mixed precision by hand: the dtype table, FP32 master weights, the loss scaler, FP8.

Chapter section 1 ("Mixed-precision training"). Read first: `dtype_table`, then
`MasterWeightOptimizer` (the BF16 workflow: 16-bit model, FP32 master copy, AdamW on
the master copy), then `LossScaler` (why FP16 needs it and BF16 does not, measured by
`underflow_demo`), then `FP8Linear` (E4M3 forward with per-tensor scales, BF16 backward).

The workflow for PRECISION=bf16 (and fp16), one optimizer step:
  1. forward and backward run on 16-bit parameters, so activations and gradients are 16-bit;
  2. the 16-bit gradients are cast up (and unscaled) into FP32 gradients of the master copy;
  3. one reduction checks every gradient for inf/NaN and gives the norm for clipping;
  4. AdamW steps the FP32 master copy (its m and v are FP32 too);
  5. the master copy is rounded back down into the 16-bit parameters.
Why the master copy: an update smaller than half a 16-bit ulp of the weight rounds
to nothing when added in 16 bits; in FP32 it accumulates until it shows.

PRECISION=fp16 is the same with FP16 parameters, the loss multiplied by the scaler's
scale before backward and divided out in step 2, and a step with inf/NaN skipped.
PRECISION=fp8 keeps BF16 parameters and the BF16 workflow; only the Linears' matmuls
run in FP8: our FP8Linear (FP8_BACKEND=native) or Transformer Engine's (te).

Run `python precision.py` for the dtype table computed from torch.finfo, and
`python precision.py --underflow` for the share of FP16 gradients lost without scaling.
"""
import functools
import math
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn

import checkpoint

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# the dtype the model's parameters (and so activations and gradients) are stored in.
# fp8 keeps bf16 parameters: only the matmul inputs are quantized to 8 bits.
PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def param_dtype(precision):
    if precision not in PARAM_DTYPE:
        raise ValueError(f"precision must be one of {'|'.join(PRECISIONS)}, got {precision!r}")
    return PARAM_DTYPE[precision]


# ---------------------------------------------------------------- the dtype table

def dtype_row(name, dtype):
    """Bits, exponent and mantissa widths, range and precision of one float dtype, from torch.finfo."""
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))  # eps = 2^-mantissa_bits
    return dict(name=name, bits=fi.bits, exponent=fi.bits - 1 - mantissa, mantissa=mantissa,
                max=fi.max, smallest_normal=fi.smallest_normal, eps=fi.eps)


def dtype_table():
    rows = [("FP32", torch.float32), ("FP16", torch.float16), ("BF16", torch.bfloat16)]
    rows += [(n, d) for n, d in (("FP8 E4M3", getattr(torch, "float8_e4m3fn", None)),
                                 ("FP8 E5M2", getattr(torch, "float8_e5m2", None))) if d is not None]
    return [dtype_row(n, d) for n, d in rows]


def format_dtype_table():
    lines = [f"{'type':9} {'bits':>4} {'exp':>3} {'mant':>4} {'max':>11} {'smallest normal':>15} {'epsilon':>10}"]
    for r in dtype_table():
        lines.append(f"{r['name']:9} {r['bits']:4d} {r['exponent']:3d} {r['mantissa']:4d} {r['max']:11.4g} "
                     f"{r['smallest_normal']:15.4g} {r['eps']:10.4g}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the Linear factory

def linear_factory(cfg):
    """The callable model.py builds every Linear with, for cfg.precision (cfg: train.Config).

    fp8 + native: our FP8Linear (below). fp8 + te: Transformer Engine's Linear. Anything
    else: a plain nn.Linear (cast to the parameter dtype by train.build)."""
    param_dtype(cfg.precision)
    from model import default_linear
    if cfg.precision != "fp8":
        return default_linear
    if cfg.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {'|'.join(FP8_RECIPES)}, got {cfg.fp8_recipe!r}")
    if cfg.fp8_amax_history < 1:
        raise ValueError(f"fp8_amax_history must be >= 1, got {cfg.fp8_amax_history}")
    if cfg.fp8_backend == "te":
        return te_linear_factory(cfg)
    if cfg.fp8_backend != "native":
        raise ValueError(f"fp8_backend must be native|te, got {cfg.fp8_backend!r}")
    if cfg.fp8_grad not in ("bf16", "e5m2"):
        raise ValueError(f"fp8_grad must be bf16|e5m2, got {cfg.fp8_grad!r}")
    return functools.partial(FP8Linear, recipe=cfg.fp8_recipe, amax_history=cfg.fp8_amax_history,
                             margin=cfg.fp8_margin, grad=cfg.fp8_grad)


# ---------------------------------------------------------------- FP8: quantize, scale, multiply

E4M3 = getattr(torch, "float8_e4m3fn", None)  # forward: 3 mantissa bits, max 448
E5M2 = getattr(torch, "float8_e5m2", None)  # gradients (TE's HYBRID): 2 mantissa bits, max 57344
FP8_RECIPES = ("delayed", "current")


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
    `fold_amax()`, called once per optimizer step by MasterWeightOptimizer.step(), pushes
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


# ---------------------------------------------------------------- FP8: Transformer Engine

def te_linear_factory(cfg):
    """te.pytorch.Linear for every Linear; the FP8 autocast context is attached to each
    module (`_te_autocast`) so MasterWeightOptimizer.forward_context() can enter it.

    TE imports only here: it is an optional extra (pip install --no-build-isolation 'transformer_engine[pytorch]'
    on a CUDA machine). Its recipe: DelayedScaling, HYBRID (E4M3 forward, E5M2 gradients),
    amax history FP8_AMAX_HISTORY, margin FP8_MARGIN, amax_compute_algo "max"; or
    Float8CurrentScaling for FP8_RECIPE=current. TE does its backward in FP8 (HYBRID), so
    FP8_GRAD does not apply. Its FP8 state lives inside TE's modules (`_extra_state`)."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except ImportError:
        raise ValueError("fp8_backend=te needs Transformer Engine (pip install --no-build-isolation 'transformer_engine[pytorch]', "
                         "on a CUDA machine); use --fp8_backend=native") from None
    if cfg.device == "cpu" or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise ValueError("fp8_backend=te needs an sm89+ GPU (Ada, Hopper or newer); use --fp8_backend=native")
    if cfg.ckpt != "none":
        # checkpoint.py re-runs the forward in backward, outside the FP8 autocast, so TE
        # would recompute in BF16 and its amax bookkeeping would not see the re-run
        raise ValueError(f"fp8_backend=te does not support ckpt={cfg.ckpt} here; use ckpt=none or fp8_backend=native")
    if cfg.fp8_recipe == "current":
        if not hasattr(te_recipe, "Float8CurrentScaling"):
            raise ValueError("fp8_recipe=current needs Transformer Engine >= 2.2; use fp8_recipe=delayed")
        recipe = te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    else:
        recipe = te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=cfg.fp8_amax_history,
                                          margin=cfg.fp8_margin, amax_compute_algo="max")
    if hasattr(te, "autocast"):  # TE >= 2.9
        autocast = functools.partial(te.autocast, enabled=True, recipe=recipe)
    else:
        autocast = functools.partial(te.fp8_autocast, enabled=True, fp8_recipe=recipe)

    def make(in_features, out_features, bias):
        if in_features % 16 or out_features % 16:
            raise ValueError(f"fp8 needs Linear dimensions divisible by 16, got {in_features} -> {out_features}")
        m = te.Linear(in_features, out_features, bias=bias, params_dtype=torch.bfloat16)
        m._te_autocast = autocast
        return m
    return make


# ---------------------------------------------------------------- loss scaling

class LossScaler:
    """Multiply the loss by `loss_scale` before backward so small FP16 gradients stay above
    FP16's smallest normal (6.1e-5; below it they lose bits, below 6e-8 they are 0);
    divide it out again in FP32. `python precision.py --underflow` measures the effect.

    mode "dynamic": start at 2^16; on a step whose gradients hold inf/NaN, skip the step
    and halve the scale; after `growth_interval` clean steps in a row, double it (the same
    trajectory as torch.amp.GradScaler). `hysteresis` > 1 tolerates that many overflows
    before backing off, as Megatron-LM does: they count up between two growths (a growth
    restores the tolerance) and, once it is used up, every overflow backs off. Every
    overflowing step is still skipped.
    mode "static": a fixed scale. mode "none": scale 1.
    """

    def __init__(self, mode="none", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1):
        if mode not in ("dynamic", "static", "none"):
            raise ValueError(f"loss scale mode must be dynamic|static|none, got {mode!r}")
        if hysteresis < 1:
            raise ValueError(f"loss_scale_hysteresis must be >= 1, got {hysteresis}")
        self.mode = mode
        self.loss_scale = float(init_scale) if mode != "none" else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.clean_steps = 0  # clean steps in a row since the last change of scale
        self.overflows_left = hysteresis  # overflows still tolerated before backing off
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, loss_scale, precision, hysteresis=1):
        """`loss_scale` is "auto" (dynamic for fp16, none otherwise), "dynamic", "none" or a number."""
        if loss_scale == "auto":
            loss_scale = "dynamic" if precision == "fp16" else "none"
        if loss_scale in ("dynamic", "none"):
            return cls(loss_scale, hysteresis=hysteresis)
        try:
            value = float(loss_scale)
        except ValueError:
            raise ValueError(f"loss_scale must be auto|dynamic|none|<number>, got {loss_scale!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"a static loss_scale must be a positive finite number, got {loss_scale!r}")
        return cls("static", init_scale=value)

    def update(self, found_inf):
        """After a step: count a skip and back off on overflow; grow after a run of clean steps."""
        if found_inf:
            self.skipped_steps += 1
        if self.mode != "dynamic":
            return
        if found_inf:
            self.clean_steps = 0
            self.overflows_left = max(self.overflows_left - 1, 0)
            if self.overflows_left == 0:
                self.loss_scale *= self.backoff_factor
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.loss_scale *= self.growth_factor
                self.clean_steps = 0
                self.overflows_left = self.hysteresis

    def state_dict(self):
        return dict(loss_scale=self.loss_scale, clean_steps=self.clean_steps,
                    overflows_left=self.overflows_left, skipped_steps=self.skipped_steps)

    def load_state_dict(self, state):
        for k, v in state.items():
            setattr(self, k, v)


# ---------------------------------------------------------------- master weights + optimizer

class MasterWeightOptimizer:
    """AdamW on an FP32 master copy of 16-bit model parameters, with loss scaling.

    For fp32 the master copy *is* the model's parameters (nothing to copy), so every
    precision runs the same step. Call `backward(loss)` once per micro-step and `step()`
    once per optimizer step.
    """

    def __init__(self, model, precision, lr, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0,
                 loss_scaler=None, fp32_grad_accum=False):
        self.precision, self.grad_clip = precision, grad_clip
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.low_precision = param_dtype(precision) != torch.float32
        if self.low_precision:
            self.master_params = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        else:
            self.master_params = self.model_params
        # weight decay on matrices only (embeddings and Linear weights), as nanoGPT does
        decay = [m for m in self.master_params if m.dim() >= 2]
        no_decay = [m for m in self.master_params if m.dim() < 2]
        self.optimizer = torch.optim.AdamW([dict(params=decay, weight_decay=weight_decay),
                                            dict(params=no_decay, weight_decay=0.0)], lr=lr, betas=betas,
                                           foreach=True)
        self.scaler = loss_scaler or LossScaler("none")
        # fp32 gradient accumulation: the sum over micro-steps lives in FP32 buffers, so
        # K 16-bit gradients are not rounded to 16 bits K times. See accumulate.py.
        self.fp32_grad_accum = fp32_grad_accum and self.low_precision
        self.grad_buffers = [torch.zeros_like(m) for m in self.master_params] if self.fp32_grad_accum else None
        # fp8: our FP8Linears fold their amax once per step here; TE's modules bring their autocast
        self.fp8_modules = [m for m in model.modules() if isinstance(m, FP8Linear)]
        self.te_autocast = next((m._te_autocast for m in model.modules() if hasattr(m, "_te_autocast")), None)

    def set_lr(self, lr):
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def forward_context(self):
        """Entered around every micro-step's forward: TE's FP8 autocast for fp8_backend=te."""
        return self.te_autocast() if self.te_autocast is not None else nullcontext()

    def backward(self, loss):
        (loss * self.scaler.loss_scale).backward() if self.scaler.loss_scale != 1.0 else loss.backward()

    def move_grads_to_fp32_buffers(self):
        """After a micro-step's backward: add its 16-bit gradients into the FP32 buffers."""
        grads = [p.grad for p in self.model_params]
        torch._foreach_add_(self.grad_buffers, [g.float() for g in grads])
        for p in self.model_params:
            p.grad = None

    def _master_grads(self):
        """Cast (or take) the accumulated gradients as FP32 and unscale them: master grads."""
        inv_scale = 1.0 / self.scaler.loss_scale
        if self.fp32_grad_accum:
            grads = self.grad_buffers
        elif self.low_precision:
            grads = [p.grad.float() if p.grad is not None else torch.zeros_like(m)
                     for p, m in zip(self.model_params, self.master_params)]
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model_params]
        if inv_scale != 1.0:
            torch._foreach_mul_(grads, inv_scale)
        return grads

    def step(self):
        """Unscale, check for inf/NaN, clip, step AdamW on the master copy, copy down.
        Returns (stepped, grad_norm); stepped is False when the step was skipped."""
        grads = self._master_grads()
        # one reduction gives both the clipping norm and the overflow check: the norm of
        # all gradients is inf/NaN exactly when some element is (one host sync per step)
        grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).item()
        found_inf = not math.isfinite(grad_norm)
        if not found_inf:
            if self.grad_clip > 0 and grad_norm > self.grad_clip:
                torch._foreach_mul_(grads, self.grad_clip / (grad_norm + 1e-6))
            if self.master_params is not self.model_params:
                for m, g in zip(self.master_params, grads):
                    m.grad = g
            self.optimizer.step()
            if self.low_precision:
                with torch.no_grad():
                    torch._foreach_copy_([p.data for p in self.model_params], self.master_params)
        self.scaler.update(found_inf)
        # the FP8 amax history moves once per optimizer step, whatever recompute re-ran
        for m in self.fp8_modules:
            m.fold_amax()
        self.zero_grad()
        return not found_inf, grad_norm

    def zero_grad(self):
        for p in self.model_params:
            p.grad = None
        if self.low_precision:
            for m in self.master_params:
                m.grad = None
        if self.fp32_grad_accum:
            torch._foreach_zero_(self.grad_buffers)

    def state_dict(self):
        return dict(master_params=[m.detach() for m in self.master_params] if self.low_precision else [],
                    optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict())

    def load_state_dict(self, state):
        with torch.no_grad():
            for m, saved in zip(self.master_params if self.low_precision else [], state["master_params"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])


# ---------------------------------------------------------------- the underflow demonstration

def gradient_underflow(model, x, y, dtype, loss_scale=1.0, reference=None):
    """Backward of loss * loss_scale through `model` cast to `dtype`; measure its parameter gradients.

    The metric, per gradient element whose FP32 reference gradient is non-zero: the
    16-bit gradient as stored (still scaled: that is the number that must fit in 16
    bits) is zero ("zero", it underflowed entirely) or below the dtype's smallest normal
    ("subnormal", it kept only a few significant bits). `lost` = zero + subnormal, as a
    share of those elements. Returns a dict with the shares and `overflow` (any inf/NaN).
    """
    import copy
    m = copy.deepcopy(model).to(dtype)
    _, loss = m(x, y)
    (loss * loss_scale).backward()
    grads = [p.grad for p in m.parameters()]
    tiny = torch.finfo(dtype).smallest_normal
    ref = reference or [g.float() for g in grads]
    counted = zero = subnormal = 0
    for g, r in zip(grads, ref):
        live = r != 0  # exact zeros in FP32 too (e.g. embedding rows of unseen bytes) are not underflow
        counted += int(live.sum())
        zero += int((live & (g == 0)).sum())
        subnormal += int((live & (g != 0) & (g.abs() < tiny)).sum())
    overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
    return dict(dtype=str(dtype).replace("torch.", ""), loss_scale=loss_scale, zero=zero / counted,
                subnormal=subnormal / counted, lost=(zero + subnormal) / counted, overflow=overflow, grads=grads)


def underflow_demo(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, seed=1337, tokens=None):
    """The same model and batch, backward in FP16 without scaling, FP16 with the dynamic
    scaler's scale, BF16 without scaling; rows for `format_underflow`.

    FP16 with dynamic scaling: the scale the scaler settles on for this batch, i.e. 2^16
    halved once per overflowing (skipped) step until the gradients are finite.
    """
    import train
    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size))
    tokens = train.load_tokens("") if tokens is None else tokens
    x, y = train.Batches(tokens, block_size, batch_size, seed, torch.device("cpu")).next()
    ref = gradient_underflow(model, x, y, torch.float32)["grads"]
    rows = [dict(name="fp16, no scaling", **gradient_underflow(model, x, y, torch.float16, 1.0, ref))]
    scaler = LossScaler("dynamic")
    while True:
        row = gradient_underflow(model, x, y, torch.float16, scaler.loss_scale, ref)
        if not row["overflow"]:
            break
        scaler.update(found_inf=True)
    rows.append(dict(name=f"fp16, dynamic scaling ({scaler.skipped_steps} skipped)", **row))
    rows.append(dict(name="bf16, no scaling", **gradient_underflow(model, x, y, torch.bfloat16, 1.0, ref)))
    for r in rows:
        del r["grads"]
    return rows


def format_underflow(rows):
    lines = ["share of gradient elements (non-zero in FP32) that are zero or subnormal in 16 bits",
             f"{'':36} {'scale':>7} {'zero':>8} {'subnormal':>10} {'lost':>8}"]
    for r in rows:
        lines.append(f"{r['name']:36} {r['loss_scale']:7g} {100 * r['zero']:7.2f}% {100 * r['subnormal']:9.2f}% "
                     f"{100 * r['lost']:7.2f}%")
    return "\n".join(lines)


def main(argv):
    if argv == ["--underflow"]:
        print(format_underflow(underflow_demo()))
    elif not argv:
        print(format_dtype_table())
    else:
        print(f"error: unknown argument {argv[0]!r}; usage: python precision.py [--underflow]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
