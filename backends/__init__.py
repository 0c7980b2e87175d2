"""What fp8.py stands on, not read to learn the chapter. Read fp8.py first.

  fp8_gemm.py  the FP8 matmul: torch._scaled_mm on a GPU, an exact stand-in on CPU, and
               the rules CUDA holds every call to
  fp8_te.py    NVIDIA Transformer Engine's Linear, FP8 autocast and recompute flags
               (PRECISION=fp8 FP8_BACKEND=te), built from the same fp8.Settings
"""
