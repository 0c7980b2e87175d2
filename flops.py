"""MFU and HFU: how much of the machine's peak FLOP/s the training step uses.

Chapter section 3's cost side ("full checkpointing costs about 33% more compute"): MFU counts the
model's FLOPs only, HFU adds the FLOPs that recompute spends again. Read first: `per_token` (model.py's
forward and backward run on fake tensors, no memory and no time, and `Counted` counts each matmul's
FLOPs by torch's own formulas), then `utilization`. An edit to model.py moves them with it.
"""
import dataclasses
import functools
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import checkpoint
import model as model_py
from ledger import gpus
from model import GPT

def peak_flops(cfg, prec, device):
    """FLOP/s that MFU is measured against: cfg.peak_flops, the GPU's dense peak (ledger/gpus.py, each figure
    with its source), or measured on CPU."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops
    if device.type == "cuda":
        name = gpus.of_device(torch.cuda.get_device_name(device))
        table = gpus.tflops(name) if name else None
        return (table[prec.name] or 0.0) * 1e12 if table else 0.0  # unknown GPU, or no such units: no MFU
    return _cpu_peak(prec.param_dtype)


# once per process and dtype: the machine does not change, and a BF16 timing takes seconds
# on CPUs without BF16 instructions
@functools.cache
def _cpu_peak(dtype):
    """Time the kernel the model's Linears run (x @ W^T + b) in the parameter dtype, at a size
    past cache effects. fp8's matmuls are measured as bf16, its backward's dtype. (A square
    `a @ a` in fp16 takes a far slower path on CPU than addmm does.)"""
    n = 512 if dtype == torch.float16 else 1024  # fp16 matmuls crawl on CPU
    gen = torch.Generator().manual_seed(0)  # leaves the global RNG alone
    x, w, b = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((2048, n), (n, n), (n,)))
    best = float("inf")
    for _ in range(5):  # the best of several: the machine's peak, not its noise
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * n * n / best


def _attention(query, key, value, *rest, out_val=None, backward=False, **kwargs):
    """CPU's fused attention, which torch's table leaves out: QK^T and its product with V, 2 x 2bas_qs_kd
    FLOPs forward (causal or not, as the table counts CUDA's kernels), twice that backward."""
    if backward:  # (grad_out, query, key, value, ...)
        query, key, value = key, value, rest[0]
    b, a, s_q, d = query.shape
    return 4 * b * a * s_q * key.shape[-2] * d * (2 if backward else 1)


CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
                     functools.partial(_attention, backward=True)}


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
        count = flop_registry.get(func._overloadpacket) or CPU_ATTENTION.get(func._overloadpacket)
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


def utilization(tokens_per_s_per_device, flops_per_token, peak):
    """MFU (model FLOPs) or HFU (with recompute's FLOPs): achieved FLOP/s over the peak; None without a peak."""
    return tokens_per_s_per_device * flops_per_token / peak if peak else None
