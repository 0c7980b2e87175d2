"""The GPUs `make plan` fits into and MFU is measured against: memory and peak FLOP/s, each with its source.

Chapter section 4 (what fits where) and section 1 (what a precision's units can do). Read first the
fields below; ledger/plan.py reads this table, flops.py too (for MFU on a GPU, by its device name).

  smi_mib      memory.total as nvidia-smi prints it (MI300X: rocm-smi's VRAM total), recent drivers
  cuda_gib     what CUDA gives a process (torch's total_memory, or an out-of-memory message's "total
               capacity"); None where no public log shows it: smi less the largest reserve seen (GH200's)
  tflops       dense peak TFLOP/s (a datasheet's "with sparsity" halved) for fp32 (not TF32), bf16, fp16, fp8;
               None for a precision: no such units; tflops None: no figure published (A10G)
  blas         cuBLAS's workspaces per handle and stream (aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB
               on sm90 (and on Blackwell from pytorch/pytorch#175344), else 2 x 4 MiB + 8 x 16 KiB; ROCm's
               hipBLAS 128 MiB on MI300X plus a hipBLASLt one of 76 MiB
  name         a pattern of torch.cuda.get_device_name that picks the row
Where public figures disagree the smaller memory is taken ("will it fit" errs toward no).
"""
import difflib
import re
from dataclasses import dataclass

from config import UsageError

MIB, GIB = 2 ** 20, 2 ** 30
BLAS = {"sm90": 32 * MIB, "other": 2 * 4 * MIB + 8 * 16 * 1024, "rocm": (128 + 76) * MIB}
UNKNOWN_RESERVE_MIB = 1104  # the largest driver reserve seen (GH200: 97871 MiB in nvidia-smi, 94.50 GiB in CUDA)

GPUS = {  # name: (smi_mib, cuda_gib, (fp32, bf16, fp16, fp8) TFLOP/s, blas, device-name pattern, sources)
    "V100-16GB": (16384, 15.78, (15.7, None, 125, None), "other", r"V100.*16GB",
                  "smi: recent-driver logs (16160 on drivers <= 440: 4paradigm/k8s-vgpu-scheduler#7); CUDA: "
                  "kchengiva/Shift-GCN#34; V100 SXM2 datasheet (no BF16, no FP8 units)"),
    "V100-32GB": (32768, 31.74, (15.7, None, 125, None), "other", r"V100.*32GB",
                  "smi: Wan-Video/Wan2.1#5; CUDA: liucongg/ChatGLM-Finetuning#73; V100 SXM2 datasheet"),
    "RTX3090": (24576, 23.69, (35.6, 71, 71, None), "other", r"RTX 3090",
                "smi: noonghunna/club-3090#390; CUDA: ucwxb/GraphAvatar#4; GA102 whitepaper App. A (FP32 accumulate)"),
    "RTX4090": (24564, 23.68, (82.6, 165.2, 165.2, 330.3), "other", r"RTX 4090",
                "smi: RLinf/RLinf#255; CUDA: zai-org/CogVideo#36; Ada whitepaper v2.1 App. A (FP32 accumulate)"),
    "A10G": (23028, 22.19, None, "other", r"A10G",
             "smi: NVIDIA/DCGM#232, modal-labs/modal-client#2797; CUDA: vllm-project/vllm#372; no A10G datasheet"),
    "L4": (23034, 22.03, (30.3, 121, 121, 242.5), "other", r"\bL4\b",
           "smi: modal-labs/modal-client#2797; CUDA: ArcInstitute/evo2#190; L4 datasheet, sparsity halved"),
    "L40S": (46068, 44.42, (91.6, 362.05, 362.05, 733), "other", r"L40S",
             "smi: modal-labs/modal-client#2797; CUDA: stepfun-ai/Step-Video-T2V#8; L40S datasheet"),
    "A100-40GB": (40960, 39.50, (19.5, 312, 312, None), "other", r"A100.*40GB",
                  "smi: modal-labs/modal-client#2797; CUDA: TianheWu/CoSeR#10; A100 datasheet (no FP8 units)"),
    "A100-80GB": (81920, 79.14, (19.5, 312, 312, None), "other", r"A100.*80GB",
                  "smi: modal-labs/modal-client#2797; CUDA: lianqi1008/Control-GIC#6 (79.25 in "
                  "levihsu/OOTDiffusion#235); A100 datasheet"),
    "H100": (81559, 79.11, (67, 989.5, 989.5, 1979), "sm90", r"H100(?!.*NVL)",
             "smi: modal-labs/modal-client#2797; CUDA: vllm-project/vllm#27508; H100 SXM datasheet, sparsity halved"),
    "H100-NVL": (95830, 93.00, (60, 835.5, 835.5, 1670.5), "sm90", r"H100.*NVL",
                 "smi: NVIDIA/gpu-admin-tools#4; CUDA: ali-vilab/VACE#56; H100 NVL datasheet, sparsity halved"),
    "H200": (143771, 139.81, (67, 989.5, 989.5, 1979), "sm90", r"H200",
             "smi: thundergolfer.com/blog/nvidia-gpu-memory-capacity (Modal); CUDA: public logs; H200 datasheet"),
    "GH200": (97871, 94.50, (67, 990, 990, 1979), "sm90", r"GH200(?!.*144)",
              "96 GB HBM3. smi: Slusheeking/gh200-trading-system docs/SYSTEM_HARDWARE.md; CUDA: "
              "vllm-project/vllm#9630; GH200 datasheet, sparsity halved"),
    "GH200-144GB": (146831, None, (67, 990, 990, 1979), "sm90", r"GH200.*144",
                    "HBM3e. smi: a public setup log (driver 580.173.02); CUDA: not found; GH200 datasheet"),
    "B200": (183359, 178.35, (75, 2250, 2250, 4500), "sm90", r"B200",
             "smi: NVIDIA/TensorRT-LLM#10278; CUDA: pytorch/ao#4002; HGX B200 spec, sparsity halved"),
    "MI300X": (196592, 191.98, (163.4, 1307.4, 1307.4, 2614.9), "rocm", r"MI300X",
               "rocm-smi: ROCm/legacy-rocm-build#4750; HIP: vllm-project/vllm#7951; AMD MI300X datasheet (dense)"),
}
PRECISION_ORDER = ("fp32", "bf16", "fp16", "fp8")


def tflops(name):
    """{precision: dense TFLOP/s or None} of a GPU of the table, or None where no figure is published."""
    figures = GPUS[name][2]
    return None if figures is None else dict(zip(PRECISION_ORDER, figures))


def of_device(device_name):
    """The table's name for torch.cuda.get_device_name's, by its pattern, or None: an unknown GPU is no other."""
    return next((name for name, row in GPUS.items() if re.search(row[4], device_name)), None)


SIZE = re.compile(r"([0-9]+(?:[.][0-9]+)?)(GiB|GB|MiB|MB)", re.IGNORECASE)
UNITS = {"gib": GIB, "gb": 10 ** 9, "mib": MIB, "mb": 10 ** 6}
LARGEST = 2 ** 50  # bytes: a GPU given by size is at most 1 PiB


@dataclass(frozen=True)
class GPU:
    """A GPU the plan fits into: its name, the bytes CUDA reports (total), what the driver keeps beyond that
    (driver), its peak TFLOP/s per precision (None: given by size), the figures' source, and its BLAS
    workspaces: one per thread that runs GEMMs, the main one's and autograd's (guards/report.blas_workspaces)."""
    name: str
    total: int
    driver: int
    tflops: dict
    source: str
    workspace: int = 2 * BLAS["sm90"]


def find_gpu(text):
    """A GPU of ledger/gpus.py by name (any case), or one given by its size ("24GiB": what CUDA reports).
    A name not in the table is refused, never taken for another card."""
    size = SIZE.fullmatch(text.replace(" ", ""))
    if size:
        nbytes = float(size.group(1)) * UNITS[size.group(2).lower()]
        if nbytes > LARGEST:  # (a number past float's range is inf: refused too)
            raise UsageError(f"--gpu={text}: this planner takes a GPU of at most {LARGEST // GIB:,} GiB")
        return GPU(text, int(nbytes), 0, None, "given")
    if re.fullmatch(r"[-+.0-9eE]+\s*[A-Za-z]*", text.strip()):
        raise UsageError(f"--gpu={text}: a size is a positive number and GiB, GB, MiB or MB (24GiB, 80GB), "
                         f"or name a GPU of the table ({', '.join(GPUS)})")
    name = {name.lower(): name for name in GPUS}.get(text.lower().replace(" ", ""))
    if name is None:
        nearest = difflib.get_close_matches(text.upper(), list(GPUS), 2, 0.5)
        raise UsageError(f"--gpu={text} is no GPU of the table ({', '.join(GPUS)}), nor a size such as 24GiB"
                         + (f"; the nearest names: {' or '.join(nearest)}" if nearest else ""))
    smi_mib, cuda_gib, _, blas, _, source = GPUS[name]
    total = int(cuda_gib * GIB) if cuda_gib else (smi_mib - UNKNOWN_RESERVE_MIB) * MIB
    return GPU(name, total, smi_mib * MIB - total, tflops(name), source, 2 * BLAS[blas])
