"""The FP8 matmul: torch._scaled_mm on a GPU, an exact stand-in on CPU, and the rules
CUDA holds every call to.

Chapter section 1, FP8. Read fp8.py first: this file is the one GEMM its FP8Linear calls
three times (forward, input gradient, weight gradient). It is its own file because the
GEMM has two implementations and a page of rules that fp8.py's readers need not carry.

  GPU (sm89+): torch._scaled_mm, the FP8 tensor-core GEMM.
  CPU: dequantize to BF16 and one BF16 matmul with FP32 accumulation. E4M3 and E5M2
    values are exact in BF16 and the product of two is exact in FP32, and addmm applies
    the scales as its alpha before its single rounding to BF16: the same result as
    _scaled_mm up to summation order. (torch's own CPU _scaled_mm is exact too but, on
    CPUs with AMX, about 10,000x slower than this.)
"""
import functools

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

E4M3 = getattr(torch, "float8_e4m3fn", None)  # forward: 3 mantissa bits, max 448
E5M2 = getattr(torch, "float8_e5m2", None)  # gradients (TE's HYBRID): 2 mantissa bits, max 57344


def on_gpu(t):
    """Whether t's GEMMs take the GPU's path (ledger/trace.py says yes for a trace of a GPU's step on CPU)."""
    return t.device.type == "cuda"


def fp8_max(dtype):
    return torch.finfo(dtype).max


@functools.lru_cache(maxsize=None)
def _real_table(fp8_dtype, device):
    with unset_fake_temporarily():  # a constant, made once, real (a fake one would outlive its trace)
        return torch.arange(256, dtype=torch.uint8, device=device).view(fp8_dtype).float()


def _value_table(fp8_dtype, device, like):
    """The 256 values an FP8 byte can hold, in FP32: on CPU, looking values up in a table is
    ~6x faster than torch's FP8-to-BF16 conversion, and gives the same (exact) values. For the
    ledger's trace (`like` a fake tensor) the same table, as a fake one."""
    table = _real_table(fp8_dtype, device)
    return like.fake_mode.from_tensor(table) if is_fake(like) else table


def _look_up(table, q):
    """table[byte] for every byte of FP8 tensor q (a column-major q stays column-major)."""
    if q.dim() == 2 and not q.is_contiguous() and q.t().is_contiguous():
        return _look_up(table, q.t()).t()
    codes = q.contiguous().view(torch.uint8).reshape(-1).int()
    return table.index_select(0, codes).view(q.shape)


def fp8_values(q, dtype):
    """The values of FP8 tensor q, exactly, as `dtype` (BF16 or wider): no scale applied."""
    if on_gpu(q):
        return q.to(dtype)
    return _look_up(_value_table(q.dtype, q.device, q).to(dtype), q)


def dequantize(q, scale, dtype):
    """q / scale as `dtype`: each FP8 value divided by the scale in FP32, rounded once to dtype.
    On CPU the 256 possible results are computed once and looked up (the same bits)."""
    if on_gpu(q):
        return (q.float() / scale).to(dtype)
    return _look_up((_value_table(q.dtype, q.device, q) / scale).to(dtype), q)


def column_major(t):
    """The same matrix laid out column-major (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def scaled_mm_error(a, b, scale_a, scale_b, bias, out_dtype):
    """Why CUDA's torch._scaled_mm would refuse these arguments, or None. The rules are those of
    _scaled_mm_out_cuda and _scaled_gemm (aten/src/ATen/native/cuda/Blas.cpp up to torch 2.8,
    ScaledBlas.cpp after), tensorwise scaling: CPU's _scaled_mm accepts more, so we check here,
    on every device, and a CPU run fails where a GPU run would."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return f"shapes {tuple(a.shape)} @ {tuple(b.shape)} are not a matrix product"
    if not a.is_contiguous():  # cuBLASLt: "Only multiplication of row-major and column-major matrices"
        return "the first operand must be row-major"
    if not b.t().is_contiguous():
        return "the second operand must be column-major"
    if b.shape[0] % 16 or b.shape[1] % 16:  # "mat2 shape (KxN) must be divisible by 16" (and mat1's K)
        return f"K={b.shape[0]} and N={b.shape[1]} must be multiples of 16"
    if a.dtype == b.dtype == E5M2:  # "Multiplication of two Float8_e5m2 matrices is not supported"
        return "E5M2 x E5M2 is not supported"
    for s in (scale_a, scale_b):  # tensorwise: "scale_a must be float scalar" (a 0-d FP32 tensor here)
        if s.dim() != 0 or s.dtype != torch.float32:
            return f"scales must be 0-d float32 tensors, got {s.dtype} of shape {tuple(s.shape)}"
    if bias is not None and out_dtype == torch.float32:  # "Bias is not supported when out_dtype is ... Float32"
        return "a bias with FP32 output is not supported"
    if bias is not None and bias.dtype != out_dtype:  # "Bias must be BFloat16 to compute BFloat16 output"
        return f"bias must be {out_dtype}, got {bias.dtype}"
    return None


def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, fast_accum=False):
    """(a @ b) * scale_a * scale_b + bias, rounded once to out_dtype: a (M x K, row-major) and
    b (K x N, column-major) in FP8, scale_a and scale_b the *dequantization* scales (0-d FP32).
    fast_accum: Hopper's faster FP8 accumulation (fewer bits kept along K), which TE and
    torchao use for the forward GEMM only (transformer_engine/pytorch/module/base.py,
    _2X_ACC_FPROP = False: no split accumulator in fprop); the gradient GEMMs keep exact
    accumulation. Ignored on CPU, which always accumulates in FP32."""
    why = scaled_mm_error(a, b, scale_a, scale_b, bias, out_dtype)
    if why:
        raise ValueError(f"FP8 GEMM: {why} (torch._scaled_mm on CUDA refuses it)")
    if on_gpu(a):
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
        return out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)
    # BF16 operands for a BF16 result, FP32 otherwise (a BF16 sum would lose FP16's or FP32's bits)
    compute = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    alpha = scale_a * scale_b  # CPU: no device to wait for; a fake tensor (the ledger's trace) has no value
    alpha = 1.0 if is_fake(alpha) else alpha.item()
    start = bias.to(compute) if bias is not None else torch.zeros((), dtype=compute)
    out = torch.addmm(start, fp8_values(a, compute), fp8_values(b, compute), beta=1 if bias is not None else 0,
                      alpha=alpha)
    return out.to(out_dtype)


def scaled_mm_any_shape(a, b, scale_a, scale_b, out_dtype=torch.bfloat16):
    """scaled_mm's product for the shapes CUDA's _scaled_mm refuses (HYBRID's weight gradient where
    the token count, its K, is not a multiple of 16): the FP8 values exactly in FP32 (2-4 significant
    bits: a product of two is exact in FP32, and in TF32 too), one FP32 matmul, the scales applied to
    the FP32 sum as _scaled_mm applies its alpha, one rounding to out_dtype. No layout rules.
    (Dequantizing each operand to BF16 first would round every element before the sum is rounded
    again: tests/test_fp8.py holds this one to an FP64 product rounded once.)"""
    out = torch.mm(fp8_values(a, torch.float32), fp8_values(b, torch.float32))
    return out.mul_(scale_a * scale_b).to(out_dtype)


def fp8_matmul_error(device):
    """None where the FP8 matmul runs on `device`, else why not (torch without float8 dtypes,
    GPUs before sm89): one tiny E4M3 matmul tells."""
    if E4M3 is None:
        return f"torch {torch.__version__} has no float8 dtypes"
    try:
        a = torch.zeros(16, 16, device=device).to(E4M3)
        one = torch.ones((), device=device)
        scaled_mm(a, a.t(), one, one)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        return f"the FP8 matmul does not run on {device} with torch {torch.__version__} " \
               f"({str(e).splitlines()[0][:80]})"
    return None
