"""MFU and HFU: how much of the machine's peak FLOP/s the training step uses.

Chapter section 3's cost side ("full checkpointing costs about 33% more compute"): MFU counts the
model's FLOPs only (model.GPT.flops_per_token), HFU adds the FLOPs that recompute spends again
(checkpoint.recompute_flops_per_token). Read first: `utilization`.
"""
import functools
import time

import torch

# dense TFLOP/s per GPU (the sparse figures are twice these), from NVIDIA's datasheets (SXM parts) and, for
# the RTX 4090, the Ada whitepaper's appendix (FP32 accumulate); fp32 is plain FP32 (TF32 is not enabled
# here); None: no such units. Keyed by a word of torch.cuda.get_device_name
CUDA_PEAK_TFLOPS = {
    "H200": {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979},  # H200 datasheet: the H100 SXM's compute
    "H100": {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979},  # H100 SXM datasheet
    "A100": {"fp32": 19.5, "bf16": 312, "fp16": 312, "fp8": None},  # A100 datasheet: no FP8 tensor cores
    "L40S": {"fp32": 91.6, "bf16": 362.05, "fp16": 362.05, "fp8": 733},  # L40S datasheet
    "4090": {"fp32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3},  # GeForce RTX 4090
    "L4": {"fp32": 30.3, "bf16": 121, "fp16": 121, "fp8": 242.5},  # L4 datasheet
}


def peak_flops(cfg, recipe, device):
    """FLOP/s that MFU is measured against: cfg.peak_flops, a table on CUDA, or measured on CPU."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops
    if device.type == "cuda":
        words = torch.cuda.get_device_name(device).replace("-", " ").split()
        for name, table in CUDA_PEAK_TFLOPS.items():
            if name in words:
                return (table[recipe.name] or 0.0) * 1e12
        return 0.0  # unknown GPU (or no units for this precision): MFU not shown
    return _cpu_peak(recipe.param_dtype)


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


def utilization(tokens_per_s_per_device, flops_per_token, peak):
    """MFU (model FLOPs) or HFU (with recompute's FLOPs): achieved FLOP/s over the peak; None without a peak."""
    return tokens_per_s_per_device * flops_per_token / peak if peak else None
