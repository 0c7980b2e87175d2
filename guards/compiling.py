"""What COMPILE=1 needs installed: a C++ compiler that works (CPU) or Triton (CUDA).

Chapter: none (torch.compile is beside the chapter's mechanisms, build.compile_blocks). Read
build.compile_blocks first, then `compile_error` (train.py asks it on every rank before anything is
built; train.eager keeps evaluation and sampling eager). docs/compile.md has the measurements.
"""
import subprocess
import tempfile
from pathlib import Path

import torch

# torch.compiler.set_stance, which train.eager stands on, is new in torch 2.6
COMPILE_FLOOR = (2, 6)


def compile_error(device):
    """Why the blocks cannot be compiled here, or None. Inductor, torch.compile's default backend,
    writes C++ for the CPU (it needs a C++ compiler that works: $CXX or g++) and Triton for CUDA."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < COMPILE_FLOOR:
        return f"--compile needs torch >= {'.'.join(map(str, COMPILE_FLOOR))} (torch.compiler.set_stance), " \
               f"this is {torch.__version__}"
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        return None if has_triton() else "--compile on CUDA needs Triton (Inductor writes CUDA kernels in it): " \
                                         "install the triton that matches this torch"
    return cxx_error()


def cxx_error():
    """Why Inductor's C++ compiler cannot build a program here, or None: it must exist, run and write one."""
    from torch._inductor import cpp_builder, exc
    try:
        cxx = cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        named = [c for c in torch._inductor.config.cpp.cxx if c][-1:] or ["g++"]
        return f"--compile on CPU needs a C++ compiler (Inductor compiles its CPU kernels): {named[0]!r} " \
               f"is none it can use; install g++ or set CXX to a compiler's path"
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "a.out"
        try:
            done = subprocess.run([cxx, "-x", "c++", "-", "-o", str(program)], input=b"int main() { return 0; }\n",
                                  capture_output=True, timeout=60)
            built = done.returncode == 0 and program.is_file()
        except (OSError, subprocess.TimeoutExpired):
            built = False
    return None if built else f"--compile on CPU needs a working C++ compiler: {cxx} did not build a " \
                              f"one-line program; install g++ or set CXX to one that works"
