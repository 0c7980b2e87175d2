"""What COMPILE=1 needs around the compiled blocks: the checks before a run, and `eagerly`.

Chapter: none (torch.compile is beside the chapter's mechanisms, build.compile_blocks). Read
build.compile_blocks first, then `compile_error` (what must be installed: the preflight asks it
on every rank before anything is built), then `eagerly`. docs/compile.md has the measurements.
"""
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# torch.compiler.set_stance, which `eagerly` stands on, is new in torch 2.6
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


def cache_folder_error():
    """Why torch could not make its compile cache folder (TORCHINDUCTOR_CACHE_DIR), or None. Not only
    COMPILE needs it: torch.optim imports torch._dynamo, which makes the folder at import."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        why = "a file, not a folder" if os.path.exists(folder) and not os.path.isdir(folder) else e.strerror
        return f"TORCHINDUCTOR_CACHE_DIR={folder}: {why}; torch keeps its compile cache there " \
               f"(its optimizers import the compiler): set it to a folder it can make, or unset it"
    return None


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


def eagerly(fn):
    """fn runs the blocks eagerly, compiled or not: evaluation, the probe and sampling. Each would
    compile graphs of its own (eval mode and no grad: another graph; sampling: a new length per
    token) for a few forward passes; COMPILE compiles the training step, once."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:  # nothing was compiled (and importing it has a cost)
            return fn(*args, **kwargs)
        with torch.compiler.set_stance("force_eager"):
            return fn(*args, **kwargs)
    return run
