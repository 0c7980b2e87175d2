"""Mixed precision by hand: FP32 master weights, the loss scaler, and what PRECISION decides, decided once.

Chapter section 1. Read first: `MasterWeightOptimizer` (the BF16 workflow: forward and backward on
16-bit parameters, AdamW on an FP32 master copy), then `LossScaler` (why FP16 needs it and BF16 does
not: `make underflow` measures it), then `decide` (everything PRECISION decides, as one `Precision`).

One optimizer step: the 16-bit gradients are cast up into FP32 (FP16's loss scaler unscales them); one
reduction gives the norm for clipping and the inf/NaN check; AdamW steps the FP32 master copy; the master
copy is rounded back into the 16-bit parameters (FP16: the scaler backs off or grows). Why the master copy:
an update smaller than half a 16-bit ulp of the weight rounds to nothing when added in 16 bits; in FP32 it
adds up until it shows. FP8 (fp8.py) keeps BF16 parameters and this workflow; only the Linears' matmuls run
in FP8. PRECISION=auto is the fastest precision the device computes natively (`native`).
"""
import functools
import math
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import is_fake

from config import UsageError
from model import default_linear

# ---------------------------------------------------------------- master weights + optimizer

def host_value(t, assumed):
    """float(t): a host sync. A fake or meta tensor (the ledger's trace, ledger/trace.py: shapes, no values) has
    no value; it stands for `assumed`, which the caller states."""
    return assumed if t.is_meta or is_fake(t) else float(t)


def squared_sum(grads):
    """The sum of the squares of every element of `grads`, in FP64, chunk by chunk."""
    # fp64: a whole gradient (ddp) and its slices (zero.py) give the same fp32 norm, bit for bit; in chunks of
    # 2^20 elements, so the FP64 copy a norm makes of its input stays 8 MiB
    chunks = [c for g in grads for c in g.reshape(-1).split(1 << 20)]
    return torch.stack(torch._foreach_norm(chunks, 2, dtype=torch.float64)).square().sum()


class MasterWeightOptimizer:
    """An optimizer (AdamW unless OPTIMIZER names another spec) on an FP32 master copy of 16-bit model
    parameters. master_weights=False (fp32): the master copy *is* the model's parameters (nothing to
    copy), so every precision runs the same step. zero.py and fsdp.py override `decays` and `global_norm`."""

    def __init__(self, params, master_weights, spec, lr, weight_decay=0.1, grad_clip=1.0):
        self.grad_clip, self.master_weights, self.spec = grad_clip, master_weights, spec
        self.model_params = [p for p in params if p.requires_grad]
        self.master_params = [p.detach().float().clone().requires_grad_(True) for p in self.model_params] \
            if master_weights else self.model_params  # fp32: the parameters are the master copy, nothing to copy
        decays = self.decays(self.model_params)  # two groups: weight decay, none
        self.torch_optimizer = spec.build([dict(params=[m for m, d in zip(self.master_params, decays) if d == decay],
                                                weight_decay=weight_decay if decay else 0.0) for decay in (True, False)], lr)

    @staticmethod
    def decays(params):
        """Which parameters get weight decay: the matrices (embeddings, Linear weights), as nanoGPT's."""
        return [p.dim() >= 2 for p in params]

    def set_lr(self, lr):
        for g in self.torch_optimizer.param_groups:
            g["lr"] = lr

    def step(self, grads=None, scaler=None):
        """Unscale (FP16's loss scaler), skip on inf/NaN, clip, step the master copy, copy down. grads: one per
        model parameter (None in it: no gradient) or None (their .grad). Returns (stepped, grad_norm)."""
        grads = [p.grad for p in self.model_params] if grads is None else grads
        # a 16-bit gradient is cast up to its fp32 master's dtype (a copy); an fp32 one is used as is
        grads = [g.to(m.dtype) if g is not None else torch.zeros_like(m) for g, m in zip(grads, self.master_params)]
        if scaler:
            scaler.unscale_(grads)
        # one reduction, one host sync, for the clip and the check. A traced step assumes a finite norm under
        # the clip: it steps (clipping would scale in place: no bytes either way)
        grad_norm = host_value(self.global_norm(grads), assumed=0.0)
        if not math.isfinite(grad_norm):  # the norm is inf/NaN exactly when some element is: skip the step
            return False, grad_norm
        if self.grad_clip > 0 and grad_norm > self.grad_clip:
            torch._foreach_mul_(grads, self.grad_clip / (grad_norm + 1e-6))
        for m, g in zip(self.master_params, grads):
            m.grad = g
        self.torch_optimizer.step()
        if self.master_params is not self.model_params:
            with torch.no_grad():
                # not .data: the copy bumps the version counter, which tells fp8.py an fp8 copy is stale
                torch._foreach_copy_(self.model_params, self.master_params)
        return True, grad_norm

    def global_norm(self, grads):
        """The norm of every gradient of the step, FP32."""
        return squared_sum(grads).sqrt().float()

    def zero_grad(self):
        for p in self.model_params + (self.master_params if self.master_params is not self.model_params else []):
            p.grad = None

    def state_tensors(self):
        """The optimizer's state tensors (AdamW: m, v and the step counts): the optimizer-state component."""
        return [v for state in self.torch_optimizer.state.values() for v in state.values() if torch.is_tensor(v)]

    def state_dict(self):
        return {"master_params": [m.detach() for m in self.master_params] if self.master_weights else [],
                self.spec.name: self.torch_optimizer.state_dict()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for m, saved in zip(self.master_params if self.master_weights else [], state["master_params"]):
                m.copy_(saved)
        self.torch_optimizer.load_state_dict(state[self.spec.name])


def whole_groups(params):
    """The model's parameters in a whole-model optimizer's two groups (weight decay, none), in the order its
    state dict numbers them: a snapshot's format, whatever the run shards (zero.py, fsdp.py)."""
    decays = MasterWeightOptimizer.decays(params)
    return [[p for p, d in zip(params, decays) if d], [p for p, d in zip(params, decays) if not d]]


class AdamW:
    """The optimizer's state, said once: what memory_ledger counts, ZeRO splits, a snapshot saves and its
    checks read. OPTIMIZERS names the specs; another optimizer is one class like this one."""
    name = "adamw"  # OPTIMIZER's value, and the key of its state in a snapshot
    per_element = ("exp_avg", "exp_avg_sq")  # FP32 tensors shaped like each parameter: m and v
    per_tensor = ("step",)  # one FP32 count per parameter tensor, which torch keeps on the CPU
    nonnegative = ("exp_avg_sq",)  # v is a mean of squares

    def __init__(self, cfg):
        self.hyperparameters = dict(betas=(cfg.beta1, cfg.beta2))  # what each saved group must carry

    def build(self, groups, lr):
        return torch.optim.AdamW(groups, lr=lr, foreach=True, **self.hyperparameters)


OPTIMIZERS = {AdamW.name: AdamW}  # OPTIMIZER's choices


def optimizer_spec(cfg):
    """The spec cfg.optimizer names, or UsageError."""
    if cfg.optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer={cfg.optimizer} is not one of {'|'.join(OPTIMIZERS)}")
    return OPTIMIZERS[cfg.optimizer](cfg)


# ---------------------------------------------------------------- loss scaling

class LossScaler:
    """FP16's (BF16 and FP32 need none: Precision.loss_scaler is None). Multiply the loss by `loss_scale` before backward, so small FP16 gradients stay above FP16's smallest
    normal (6.1e-5; below 6e-8 they are 0), and divide it out in FP32; skip a step whose gradients hold inf/NaN.
    "dynamic": from 2^16, an overflow multiplies the scale by `backoff_factor`, `growth_interval` clean steps in a
    row by `growth_factor` (0.5 and 2: torch.amp.GradScaler's); `hysteresis` h > 1 (Megatron-LM's) tolerates
    h - 1 overflows and backs off at the h-th, restored by a growth. "static": a fixed scale. "none": 1."""

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

    def backward(self, loss):
        """Backward of loss * loss_scale: every gradient comes out multiplied by the scale."""
        (loss * self.loss_scale).backward()

    def step(self, optimizer, grads=None):
        """The optimizer's step (which calls the two below), then this step's back-off or growth."""
        stepped, grad_norm = optimizer.step(grads, self)
        self.update(found_inf=not stepped)
        return stepped, grad_norm

    def unscale_(self, grads):  # the FP32 gradients, in place
        torch._foreach_mul_(grads, 1.0 / self.loss_scale)

    def update(self, found_inf):
        """After a step: count a skip and back off on overflow; grow after a run of clean steps."""
        self.skipped_steps += bool(found_inf)
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
        self.__dict__.update(state)


def overflows_explained(scaler, scale):
    """Skipped steps in a row `scaler` explains from `scale` (guards/clean_end.check_diverged): hysteresis-1
    tolerated, then one back-off each until the scale is 1 (a static scale: alike, no hysteresis; no scaler: 0)."""
    if scaler is None:
        return 0
    skips = (scaler.hysteresis if scaler.mode == "dynamic" else 1) - 1
    while scale > 1:  # multiplied as `update` multiplies (a logarithm's rounding would miscount at 2^29)
        scale, skips = scale * scaler.backoff_factor, skips + 1
    return skips


def not_written_by(scaler, state, steps):
    """Why a saved state (a snapshot's, its form checked) is not one `scaler` writes in `steps` steps, or None."""
    scale, clean = state["loss_scale"], state["clean_steps"]
    if not 1 / 3.4028234663852886e38 <= scale <= 3.4028234663852886e38 or min(clean, state["overflows_left"]) < 0:
        return f"loss_scale={scale!r}, clean_steps={clean}, overflows_left={state['overflows_left']}: a scale within " \
               f"FP32's range and counts"
    if not 0 <= state["skipped_steps"] <= steps:
        return f"skipped_steps={state['skipped_steps']} is more than the {steps} steps taken (or negative)"
    if scaler.mode != "dynamic" and (scale != scaler.loss_scale or clean != 0):
        return f"loss_scale={scale!r}, clean_steps={clean}: loss scaling {scaler.mode} writes {scaler.loss_scale:g} and 0"
    if scaler.mode == "dynamic" and clean >= scaler.growth_interval:
        return f"clean_steps={clean}: {scaler.growth_interval} in a row grow the scale and start again at 0"
    # factors that are powers of two (2 and 0.5) keep 2^16 a power of two; others reach other numbers
    powers = all(math.frexp(f)[0] == 0.5 for f in (scaler.growth_factor, scaler.backoff_factor, scaler.loss_scale))
    if scaler.mode == "dynamic" and powers and math.frexp(scale)[0] != 0.5:
        return f"loss_scale={scale!r} is no power of two, and {scaler.loss_scale:g} grown by {scaler.growth_factor:g} " \
               f"and backed off by {scaler.backoff_factor:g} is always one"
    if state["overflows_left"] > scaler.hysteresis:
        return f"it tolerates {state['overflows_left']} more overflows, a hysteresis of {scaler.hysteresis} at most"
    return None


# ---------------------------------------------------------------- PRECISION, decided once

PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def native(device):
    """(PRECISION=auto's choice on `device`, why): the fastest precision it computes natively. A GPU: BF16 from
    compute capability 8.0, else FP16 with the dynamic loss scaler; a CPU: BF16 where torch reports AVX512-BF16
    or AMX (oneDNN's bf16), else FP32 (emulated BF16 runs tens of times slower: PyTorch's AMP docs, CPU ops)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():  # a GPU's step traced on a CPU (the ledger's): today's GPUs
            return "bf16", "a GPU (none here: as from compute capability 8.0)"
        capability = "{}.{}".format(*torch.cuda.get_device_capability(device))
        gpu = f"{torch.cuda.get_device_name(device)} (compute capability {capability})"
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return "bf16", f"{gpu} computes BF16"
        return "fp16", f"{gpu} has no BF16 (8.0 and up): FP16 with the dynamic loss scaler"
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bf16", "this CPU computes BF16 (AVX512-BF16 or AMX, as torch reports it)"
    return "fp32", "this CPU has no BF16 instructions (AVX512-BF16 or AMX, as torch reports it)"


def emulated(name, device):
    """Why `name` runs emulated on `device`, many times slower than FP32 (a string), or a falsy value where it
    computes it. FP8 on a GPU below compute capability 8.9 is refused instead (Precision.check_device)."""
    if device.type == "cuda":
        return name == "bf16" and native(device)[0] != "bf16" and native(device)[1]
    if name == "fp16":
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported() and \
            "this CPU has no FP16 instructions (AVX512-FP16 or AMX-FP16, as torch reports it)"
    return name in ("bf16", "fp8") and native(device)[0] != "bf16" and native(device)[1]


def decided_here(cfg):
    """cfg with PRECISION=auto decided for the device it runs on (`native`); any other precision as asked."""
    return cfg if cfg.precision != "auto" else replace(cfg, precision=native(torch.device(
        "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"))[0])


def decide(cfg):
    """The Precision of cfg: the one place that reads precision, loss_scale* and fp8_*."""
    cfg = decided_here(cfg)
    # FP16's range needs its loss scaled; BF16's (FP32's exponent) does not
    mode = {"auto": "dynamic" if cfg.precision == "fp16" else "none"}.get(cfg.loss_scale, cfg.loss_scale)
    scaling = None if mode == "none" else dict(
        mode="dynamic" if mode == "dynamic" else "static", init_scale=2.0 ** 16 if mode == "dynamic" else float(mode),
        growth_factor=cfg.loss_scale_growth, backoff_factor=cfg.loss_scale_backoff,
        growth_interval=cfg.loss_scale_interval, hysteresis=cfg.loss_scale_hysteresis)
    if cfg.precision == "fp8":
        import fp8
    return Precision(cfg.precision, PARAM_DTYPE[cfg.precision], cfg.precision != "fp32", scaling,
                     fp8.Settings(backend=cfg.fp8_backend, scaling=cfg.fp8_recipe, history=cfg.fp8_amax_history,
                                  margin=cfg.fp8_margin, grad=cfg.fp8_grad, keep_weight=cfg.fp8_keep_weight)
                     if cfg.precision == "fp8" else None)


@dataclass(frozen=True)
class Precision:
    """What a PRECISION means for every other file. Built once by `decide(cfg)`; nothing
    else reads the precision keys of the config."""
    name: str  # fp32|bf16|fp16|fp8, for the log
    param_dtype: torch.dtype  # parameters, so activations and gradients too
    master_weights: bool  # an FP32 master copy that AdamW updates (every 16-bit precision)
    scaling: dict = None  # LossScaler's settings (FP16's dynamic scale, or LOSS_SCALE's), or None: no scaling
    fp8: object = None  # the FP8 Linears' settings (fp8.Settings), or None: plain Linears

    @property
    def element_bytes(self):
        """Bytes per parameter, activation and gradient element."""
        return torch.empty((), dtype=self.param_dtype).element_size()

    def linear_factory(self):
        """What model.GPT builds each Linear with: under fp8, fp8.py's FP8Linear unless a refinement is on."""
        if self.fp8 is None:  # nn.Linear
            return default_linear
        import fp8
        from backends import fp8_refined, fp8_te
        if self.fp8.backend == "te":
            return fp8_te.linear_factory(self.fp8)
        scaling = dict(recipe=self.fp8.scaling, amax_history=self.fp8.history, margin=self.fp8.margin)
        # the refinements, a flag each (backends/fp8_refined.py); with neither, the chapter's own layer:
        #   FP8_KEEP_WEIGHT=true: W quantized once per optimizer step (forward_context, recompute_contexts)
        #   FP8_GRAD=e5m2: the output gradient in E5M2, both backward GEMMs in FP8 (TE's HYBRID)
        # not a refinement: the GEMM's CPU stand-in (fp8_gemm.scaled_mm) is how any FP8 matmul runs on a CPU
        if self.fp8.keep_weight or self.fp8.grad == "e5m2":
            return functools.partial(fp8_refined.FP8Linear, grad=self.fp8.grad, **scaling)
        return functools.partial(fp8.FP8Linear, **scaling)

    def forward_context(self, model, micro_step=None):
        """Entered around every forward of `model`, like torch.autocast. micro_step: its index in the
        optimizer step (None outside one: evaluation, sampling). FP8: TE's FP8 autocast (fp8_backend=te)
        and, with FP8_KEEP_WEIGHT, which FP8 weight each Linear uses (fp8_refined.WEIGHT_MODES)."""
        if self.fp8 is None:
            return nullcontext()
        import fp8
        from backends import fp8_refined, fp8_te
        te_autocast = fp8_te.autocast(self.fp8) if self.fp8.backend == "te" else nullcontext()
        if not self.fp8.keep_weight:  # every forward quantizes W afresh (te: is_first_microbatch=None)
            return te_autocast
        # FP8_KEEP_WEIGHT: W quantized at micro-step 0 and kept, reused by micro-steps 1..K-1
        mode = "fresh" if micro_step is None else "refresh" if micro_step == 0 else "reuse"
        return _all_of(fp8_refined.weight_copies(fp8.layers(model), mode), te_autocast)

    def recompute_contexts(self, modules):
        """(around a recompute unit's forward, around its re-run) for the unit made of `modules`. A re-run
        sees the forward's tensors and scales: it quantizes them to the same bytes. FP8_KEEP_WEIGHT: it
        uses the FP8 weight its forward used and records no amax (fp8_refined.Rerun). Under TE it
        re-enters TE's FP8 autocast with TE's recompute-phase flags (fp8_te.recompute_contexts)."""
        if self.fp8 is None:
            return nullcontext(), nullcontext()
        import fp8
        from backends import fp8_refined, fp8_te
        fp8_layers = [m for module in modules for m in fp8.layers(module)]
        if not fp8_layers:  # a unit with no FP8 Linear (the attention core) needs nothing
            return nullcontext(), nullcontext()
        rerun = fp8_refined.Rerun(fp8_layers) if self.fp8.keep_weight else nullcontext()
        if self.fp8.backend != "te":
            return nullcontext(), rerun
        around_forward, around_rerun = fp8_te.recompute_contexts(self.fp8)
        return around_forward, _all_of(rerun, *around_rerun)

    @property
    def rerun_stops_early(self):
        """May a recompute unit's re-run stop after the last tensor it saves? Not under Transformer
        Engine, which restores a module's FP8 scales only when its forward returns (docs/recompute.md)."""
        return self.fp8 is None or self.fp8.backend != "te"

    def loss_scaler(self):
        """FP16's LossScaler (or a static or dynamic scale asked for by LOSS_SCALE); None where nothing scales."""
        return LossScaler(**self.scaling) if self.scaling else None

    def check_device(self, device):
        """Raise ValueError where this precision cannot run on `device` (FP8 needs its matmul)."""
        if self.fp8 is None:
            return
        from backends import fp8_gemm, fp8_te
        if self.fp8.backend == "te":
            fp8_te.check_available(device)
        elif why := fp8_gemm.fp8_matmul_error(device):
            raise ValueError(f"precision=fp8 with fp8_backend=native: {why}")


@contextmanager
def _all_of(*contexts):
    """One context manager that enters `contexts` in order (and leaves them in reverse)."""
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


# ---------------------------------------------------------------- the dtype table


def dtype_row(name, dtype):
    """Bits, exponent and mantissa widths, range and precision of one float dtype, from torch.finfo."""
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))  # eps = 2^-mantissa_bits
    return dict(name=name, bits=fi.bits, exponent=fi.bits - 1 - mantissa, mantissa=mantissa,
                max=fi.max, smallest_normal=fi.smallest_normal, eps=fi.eps)


def dtype_table():
    """The chapter's table, computed: FP32, FP16, BF16 and the two FP8 formats (where torch has them)."""
    import fp8
    rows = [("FP32", torch.float32), ("FP16", torch.float16), ("BF16", torch.bfloat16),
            ("FP8 E4M3", fp8.E4M3), ("FP8 E5M2", fp8.E5M2)]
    return [dtype_row(name, dtype) for name, dtype in rows if dtype is not None]
