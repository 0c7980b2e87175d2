"""MFU and HFU: how much of the machine's peak FLOP/s the training step uses.

Chapter section 3's cost side ("full checkpointing costs about 33% more compute"): MFU counts the
model's FLOPs only, HFU adds the FLOPs that recompute spends again. Read first: `per_token_formula` (the
chapter's 6N + 12Lhs, what a run's MFU counts) and `peak` (what it divides by: a GPU's datasheet, or this
CPU's own matmul of the model's largest weight, measured), then `utilization`. After them, the counts the
tools make: `per_token` runs model.py's forward and backward on fake tensors (no memory, no time) and
`Counted` counts each matmul's FLOPs by torch's own formulas, recompute's too (`make flops`, `make bench`).
"""
import dataclasses
import functools
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import model as model_py
from model import GPT


def per_token_formula(model, cfg):
    """Model FLOPs per token of a training step, the chapter's (PaLM's, nanoGPT's estimate_mfu): 6N + 12Lhs.
    N: the parameters' matrices (each a token multiplies by, the position table too); a matmul is 2 FLOPs a
    weight forward and 4 backward; 12Lhs: attention's QK^T and its product with V, causal or not."""
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # a DTensor counts its whole
    return 6 * matrices + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def peak(cfg, prec, model, device):
    """(FLOP/s that MFU divides by, where it comes from): --peak_flops; a GPU's dense datasheet figure in the
    run's precision (ledger/gpus.py, each with its source); on a CPU, measured (`gemm_rate`)."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops, "--peak_flops"
    if device.type == "cuda":
        from ledger import gpus
        name = gpus.of_device(torch.cuda.get_device_name(device))
        figure = (gpus.tflops(name) or {}).get(prec.name) if name else None
        return (figure or 0.0) * 1e12, f"{name}'s datasheet, {prec.name} dense" if figure else "no figure for this GPU"
    rate, shape = gemm_rate(model, cfg.batch_size * cfg.block_size, prec.param_dtype, device)
    return rate, f"measured: this CPU's {prec.param_dtype} matmul of the model's largest weight, {shape}, its " \
                 f"forward and backward GEMMs, best of 3 each"


@functools.cache  # once per process and shape: the machine does not change, and emulated BF16 takes seconds
def _gemm_rate(rows, out_features, in_features, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG alone
    x, w, g = (torch.randn(*shape, generator=gen, device=device).to(dtype)
               for shape in ((rows, in_features), (out_features, in_features), (rows, out_features)))
    # y = xW^T, then backward's dx = gW and dW = g^T x; a CUDA matmul is timed once it has run (synchronize)
    seconds = min(timed(torch.mm, a, b) for a, b in ((x, w.t()), (g, w), (g.t(), x)) for _ in range(3))
    return 2 * rows * out_features * in_features / seconds


def timed(fn, *args):
    t0 = time.perf_counter()
    if fn(*args).is_cuda:
        torch.cuda.synchronize()  # a GPU's queue done
    return time.perf_counter() - t0


def gemm_rate(model, tokens, dtype, device):
    """(FLOP/s, in words) of the model's largest matrix as its Linear runs it on `tokens` rows (at most 4096),
    in `dtype`: the fastest of its forward GEMM and its two backward ones, each the best of 3. No matmul of
    the model's runs faster, so MFU stays below 100%; the ratio of two dtypes is the emulation's cost."""
    out_features, in_features = max((p.shape for p in model.parameters() if p.dim() == 2), key=lambda s: s.numel())
    rows = min(tokens, 4096)
    return _gemm_rate(rows, out_features, in_features, dtype, device.type), \
        f"{rows} x {in_features} by {in_features} x {out_features}"


def hardware_per_token(model, cfg, prec):
    """HFU's FLOPs per token: what a step runs, recompute's re-runs and the loss in pieces' re-run head GEMM
    included, counted by torch's FlopCounterMode on one forward and backward of the run's own model (a
    micro-batch of zeros: FLOPs do not depend on values). In eval mode: no dropout stream drawn, no FP8 amax
    recorded; its gradients are dropped after. Under COMPILE, on fake tensors (`per_token`): a compiled block
    saves its tensors at its end, so a unit of blocks re-runs whole, which a counter would run eagerly."""
    if cfg.compile:
        import checkpoint
        whole = cfg.ckpt != "none" and checkpoint.policy(cfg).block_units(1)
        return sum(per_token(cfg, checkpoint.rerun_stops_early(cfg, prec) and not whole))
    x = torch.zeros(cfg.batch_size, cfg.block_size, dtype=torch.long, device=next(model.parameters()).device)
    model.eval()
    with FlopCounterMode(display=False, custom_mapping=cpu_attention()) as counter, prec.forward_context(model):
        model(x, x)[1].backward()
    model.train()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / x.numel()


def utilization(tokens_per_s_per_device, flops_per_token, peak_flops):
    """MFU (model FLOPs) or HFU (with recompute's FLOPs): achieved FLOP/s over the peak; None without a peak."""
    return tokens_per_s_per_device * flops_per_token / peak_flops if peak_flops else None


# ---------------------------------------------------------------- counted, for the tools

def _attention(query, key, value, *rest, out_val=None, backward=False, **kwargs):
    """CPU's fused attention, which torch's table leaves out: QK^T and its product with V, 2 x 2bas_qs_kd
    FLOPs forward (causal or not, as the table counts CUDA's kernels), twice that backward."""
    if backward:  # (grad_out, query, key, value, ...)
        query, key, value = key, value, rest[0]
    b, a, s_q, d = query.shape
    return 4 * b * a * s_q * key.shape[-2] * d * (2 if backward else 1)


@functools.cache
def cpu_attention():
    """{op: its FLOP formula} for CPU's fused attention, forward and backward."""
    return {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: functools.partial(_attention,
                                                                                                  backward=True)}


class Counted(TorchDispatchMode):
    """FLOPs of what runs inside, op by op, by the formulas torch's FlopCounterMode counts with (torch.
    utils.flop_counter.flop_registry: matmuls and attention; elementwise ops count none), and per op.
    A mode of its own: FlopCounterMode's module hooks would change what autograd keeps."""

    def __init__(self):
        super().__init__()
        self.total, self.by_op = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return self.count(func, args, kwargs, out)

    def count(self, func, args, kwargs, out):
        """Add op func's FLOPs; returns its outputs (ledger/trace.py counts inside its census's mode)."""
        count = flop_registry.get(func._overloadpacket) or cpu_attention().get(func._overloadpacket)
        if count is not None:
            n = count(*args, **(kwargs or {}), out_val=out)
            name = func._overloadpacket.__name__
            self.total, self.by_op[name] = self.total + n, self.by_op.get(name, 0) + n
        return out


_COUNTED = {}  # (config, stop_early, what model.py holds) -> FLOPs per token: a run asks once


def model_code():
    """What model.py holds now, its classes' methods too (a learner's edit, a test's): counts and traces are
    kept per version (ledger/trace.py keys its traces by it too)."""
    return tuple(id(v) for v in vars(model_py).values()) + \
        tuple(id(f) for v in vars(model_py).values() if isinstance(v, type) for f in vars(v).values())


def _counted(cfg, stop_early):
    key = (repr(cfg), stop_early, model_code())
    if key not in _COUNTED:
        _COUNTED[key] = _count(cfg, stop_early)
    return _COUNTED[key]


def _count(cfg, stop_early):
    with FakeTensorMode():  # an FP32 model, as built: the FLOPs are the same in every precision
        model = GPT(cfg)
        if cfg.ckpt != "none":
            import checkpoint
            checkpoint.apply_policy(model, checkpoint.policy(cfg), stop_early=stop_early)
        x = torch.zeros(1, cfg.block_size, dtype=torch.long)
        with Counted() as counted:
            model(x, x)[1].backward()
    return counted.total / cfg.block_size


def per_token(cfg, stop_early=True):
    """(model FLOPs, the FLOPs recompute adds) per token of a training step: model.py forward and backward
    on one sequence of fake tensors, counted without recompute and with cfg's policy (stop_early: its
    re-runs stop after a unit's last saved tensor, checkpoint.rerun_stops_early). The loss in pieces re-runs
    the head's GEMM in backward: recompute's FLOPs too."""
    whole = dataclasses.replace(cfg, ckpt="none", ckpt_segment=0, ckpt_impl="hooks", loss_chunks=1)
    model_flops = _counted(whole, True)
    return model_flops, _counted(cfg, stop_early) - model_flops
