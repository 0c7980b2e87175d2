"""Mixed precision by hand: the dtype table, FP32 master weights, the loss scaler.

Chapter section 1 ("Mixed-precision training"). Read first: `dtype_table`, then
`MasterWeightOptimizer` (the BF16 workflow: 16-bit model, FP32 master copy, AdamW on
the master copy), then `LossScaler` (why FP16 needs it and BF16 does not).

The workflow for PRECISION=bf16 (and fp16), one optimizer step:
  1. forward and backward run on 16-bit parameters, so activations and gradients are 16-bit;
  2. the 16-bit gradients are cast up (and unscaled) into FP32 gradients of the master copy;
  3. one reduction checks every gradient for inf/NaN and gives the norm for clipping;
  4. AdamW steps the FP32 master copy (its m and v are FP32 too);
  5. the master copy is rounded back down into the 16-bit parameters.
Why the master copy: an update smaller than half a 16-bit ulp of the weight rounds
to nothing when added in 16 bits; in FP32 it accumulates until it shows.

Run `python precision.py` for the dtype table computed from torch.finfo.
"""
import math
import sys
from contextlib import nullcontext

import torch

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
    """The callable model.py builds every Linear with, for cfg.precision (cfg: train.Config)."""
    param_dtype(cfg.precision)
    from model import default_linear
    return default_linear


# ---------------------------------------------------------------- loss scaling

class LossScaler:
    """Multiply the loss by `loss_scale` before backward so small FP16 gradients stay above
    FP16's smallest subnormal (6e-8); divide it out again in FP32.

    mode "dynamic": start at 2^16; on a step whose gradients hold inf/NaN, skip the step
    and halve the scale; after `growth_interval` clean steps in a row, double it (the same
    trajectory as torch.amp.GradScaler). `hysteresis` > 1 tolerates that many overflows
    before backing off, as Megatron-LM does; every overflowing step is still skipped.
    mode "static": a fixed scale. mode "none": scale 1.
    """

    def __init__(self, mode="none", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1):
        if mode not in ("dynamic", "static", "none"):
            raise ValueError(f"loss scale mode must be dynamic|static|none, got {mode!r}")
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
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.loss_scale *= self.backoff_factor
                self.overflows_left = self.hysteresis
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

    def set_lr(self, lr):
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def forward_context(self):
        """Entered around every micro-step's forward (FP8 backends hook in here)."""
        return nullcontext()

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


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(f"error: unknown argument {sys.argv[1]!r}; usage: python precision.py", file=sys.stderr)
        sys.exit(2)
    print(format_dtype_table())
