"""What fp8.py stands on, and what the trainer builds on it: not read to learn the chapter. Read fp8.py first.

  fp8_gemm.py     the FP8 matmul: torch._scaled_mm on a GPU, an exact stand-in on CPU, and
                  the rules CUDA holds every call to
  fp8_refined.py  fp8.py's FP8Linear with its refinements, a flag each: the E4M3 weight quantized
                  once per optimizer step (FP8_KEEP_WEIGHT=true: micro-steps 2..K and recompute
                  re-runs reuse it) and HYBRID's E5M2 backward (FP8_GRAD=e5m2)
  fp8_te.py       NVIDIA Transformer Engine's Linear, FP8 autocast and recompute flags
                  (PRECISION=fp8 FP8_BACKEND=te), built from the same fp8.Settings
"""
