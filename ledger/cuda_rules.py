"""What a GPU's kernels keep that a CPU's do not, for a GPU's step traced on CPU tensors (ledger/trace.py).

Chapter section 4. Read `CUDA` first (each rule and the file of torch it comes from), then `cuda_rules`,
which puts them in place while a trace runs, and `emulated`, which says when they apply: where torch has
no CUDA, or where tools/plan_check.py asks (`rules_forced`) to check them against a GPU's own.
"""
import contextlib

import torch
import torch.nn.functional as F

import model
from backends import fp8_gemm

CUDA = [  # what a GPU's kernels keep that a CPU's do not: (rule, source); all unverified until make gpu-check
    ("LayerNorm's mean and rstd in FP32 for 16-bit inputs", "aten/src/ATen/native/cuda/layer_norm_kernel.cu"),
    ("dropout one fused kernel saving a bool mask", "aten/src/ATen/native/cuda/Dropout.cu, native_dropout_cuda"),
    ("sdpa: flash attention (16-bit) or memory-efficient (FP32), with dropout too, keeping its output and an FP32 "
     "logsumexp (padded to 32 rows by the memory-efficient one)", "aten/src/ATen/native/transformers/cuda/"
     "attention.cu; torch/_meta_registrations.py"),
    ("the FP8 GEMM is torch._scaled_mm, its operands not copied to BF16", "backends/fp8_gemm.py's GPU path"),
    ("AdamW's per-tensor step counts stay in host memory", "torch/optim/adamw.py (capturable=False)"),
    ("LOSS_CHUNKS: a piece's weight gradient is one 16-bit GEMM with an FP32 output, no FP32 copies of its "
     "operands", "model.sum_in_fp32's GPU branch; torch.mm's out_dtype (aten/src/ATen/native/cuda/Blas.cpp)"),
]


def _dropout(x, p=0.5, training=True, inplace=False):
    return torch.ops.aten.native_dropout(x, p, True)[0] if training and 0 < p < 1 else x


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    if attn_mask is not None or kwargs:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    if q.dtype == torch.float32:
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                      scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]


def cuda_dtypes(func, args, kwargs, out):
    """An op's outputs in the dtypes CUDA's kernel gives them (LayerNorm's, above), as the census counts them
    (measure.LiveTensors' `outputs`: in its own mode, as a mode more would cost every op 10-20%)."""
    if func is torch.ops.aten.native_layer_norm.default and out[1].dtype != torch.float32:
        return out[0], out[1].float(), out[2].float()
    return out


@contextlib.contextmanager
def cuda_rules(on):
    """CUDA's rules (above) for what runs inside, where `on`, but LayerNorm's dtypes (cuda_dtypes)."""
    if not on:
        yield
        return
    # functions, not a torch-function mode: autograd runs a recompute's re-run in backward without one
    saved = fp8_gemm.on_gpu, vars(model).get("on_gpu"), F.dropout, F.scaled_dot_product_attention
    fp8_gemm.on_gpu = model.on_gpu = lambda t: True  # (model.py's, if a learner's model.py still has it)
    F.dropout, F.scaled_dot_product_attention = _dropout, _attention
    try:
        yield
    finally:
        fp8_gemm.on_gpu, model.on_gpu, F.dropout, F.scaled_dot_product_attention = saved


_FORCED = []  # rules_forced(): a GPU's step traced on fake CPU tensors with CUDA's rules, where CUDA is here


def emulated(cfg):
    """Whether cfg's step is a GPU's traced on CPU tensors: CUDA's rules stand in for its kernels where torch has
    no CUDA (or where `rules_forced` asks, to check the rules against a GPU's own: tools/plan_check.py)."""
    return cfg.device == "cuda" and (_FORCED or not torch.cuda.is_available())


@contextlib.contextmanager
def rules_forced():
    _FORCED.append(True)
    try:
        yield
    finally:
        _FORCED.pop()
