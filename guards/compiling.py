"""What COMPILE=1 needs around the compiled blocks: the checks before a run, and `eagerly`.

Chapter: none (torch.compile is beside the chapter's mechanisms, train.compile_blocks). Read
train.compile_blocks first, then `compile_error` (what must be installed: the preflight asks it
on every rank before anything is built), then `eagerly`. docs/compile.md has the measurements.
"""
import torch

# torch.compiler.set_stance, which `eagerly` stands on, is new in torch 2.6
COMPILE_FLOOR = (2, 6)


def compile_error(device):
    """Why the blocks cannot be compiled here, or None. Inductor, torch.compile's default backend,
    writes C++ for the CPU (it needs a C++ compiler: $CXX or g++) and Triton for CUDA."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < COMPILE_FLOOR:
        return f"--compile needs torch >= {'.'.join(map(str, COMPILE_FLOOR))} (torch.compiler.set_stance), " \
               f"this is {torch.__version__}"
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        return None if has_triton() else "--compile on CUDA needs Triton (Inductor writes CUDA kernels in it): " \
                                         "install the triton that matches this torch"
    from torch._inductor import cpp_builder, exc
    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return "--compile on CPU needs a C++ compiler (Inductor compiles its CPU kernels): install g++ or set CXX"
    return None


def eagerly(fn):
    """fn runs the blocks eagerly, compiled or not: evaluation, the probe and sampling. Each would
    compile graphs of its own (eval mode and no grad: another graph; sampling: a new length per
    token) for a few forward passes; COMPILE compiles the training step, once."""
    stance = getattr(torch.compiler, "set_stance", None)  # torch < 2.6: compile_error refuses --compile
    return stance("force_eager")(fn) if stance else fn
