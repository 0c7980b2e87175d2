"""The plan's check on a GPU (`make gpu-check`'s step "plan"): the margin measured, and the planned
micro-batch trains where the next one runs out of memory, on a smaller GPU emulated.

A tool, not a chapter file. Read ledger/plan.py first (the planner, its `budget`). Two parts:
  1. the margin on this GPU: CUDA's total (torch), nvidia-smi's total (what the driver keeps is the
     difference), cuBLAS's workspaces (guards/report.blas_workspaces) and the CUDA context: what a
     process holds beyond PyTorch's allocator once CUDA and cuBLAS are up (total - free - reserved);
  2. ledger/cuda_rules.CUDA's rules, which stand in for a GPU's kernels where torch has no CUDA, against
     this GPU's: the same step traced both ways;
  3. a GPU of --emulate bytes (auto: the size at which the plan's micro-batch is --micro_batch exactly,
     so that one sequence more is a whole sequence's activations over): the allocator is capped at
     that size less the measured context (torch.cuda.set_per_process_memory_fraction), the plan's
     micro-batch trains two steps of two micro-steps (allocated and reserved peaks read, the slack
     between them against the plan's bound), then the next micro-batch, which must run out of memory.
Writes OUT_DIR/plan_check.json; exit status 0 when both held, 1 when one did not, 2 for bad input
(no CUDA device: one line, as every step of make gpu-check without a GPU).

    python tools/plan_check.py --out_dir=out/gpu-check/plan [--emulate=24GiB] [train.py shape keys]
"""
import gc
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import accumulate  # noqa: E402
import precision  # noqa: E402
import train  # noqa: E402
from config import UsageError, key  # noqa: E402
from guards import cli  # noqa: E402
from guards.clean_end import check_writable, write_atomically  # noqa: E402
from ledger import cuda_rules, gpus, measure, trace  # noqa: E402
from ledger import plan as lp  # noqa: E402
from ledger import live as ledger_run  # noqa: E402
from ledger.measure import MIN_BLOCK, SMALL_SIZE  # noqa: E402

# GPT-2 small's blocks at context 2048: a sequence's activations (~2 GiB in bf16) dwarf the allocator's bound
CHECK_SHAPE = dict(n_layer=12, n_embd=768, n_head=12, block_size=2048)


@dataclass
class CheckOptions:
    emulate: str = key("auto", "the GPU to emulate: a size (24GiB) or auto: the size where the plan's micro-batch "
                               "is --micro_batch")
    micro_batch: int = key(4, "with --emulate=auto, the micro-batch the emulated GPU fits exactly", at_least=1)


def smi_total():
    """nvidia-smi's memory.total of GPU 0 in bytes, or None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=30)
        return int(r.stdout.split()[0]) * lp.MIB if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def margin(device):
    """What this GPU gives a process: CUDA's total, free once CUDA and cuBLAS are up, the context."""
    workspaces = ledger_run.blas_workspaces(device)  # the main thread's and autograd's: every run has both
    free, total = torch.cuda.mem_get_info(device)
    context = total - free - torch.cuda.memory_reserved(device)
    workspace = sum(workspaces.values()) if workspaces else torch.cuda.memory_allocated(device)
    smi = smi_total()
    return dict(device=torch.cuda.get_device_name(device), cuda_total=total, free=free, context=context,
                workspace=workspace, smi_total=smi, driver=smi - total if smi else None)


def train_steps(cfg, b, micro_steps, device):
    """Two optimizer steps of micro_steps x b sequences; (allocated peak, reserved peak) of the second,
    or None where it ran out of memory."""
    model = parts = None
    try:
        model, parts = train.build(replace(cfg, batch_size=b), device)
        batches = [measure.random_batch(cfg, device, b)] * micro_steps
        accumulate.accumulation_step(model, parts, batches)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        accumulate.accumulation_step(model, parts, batches)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    except torch.OutOfMemoryError:
        return None
    finally:
        del model, parts
        gc.collect()
        torch.cuda.empty_cache()


def program(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\n" + cli.usage("tools/plan_check.py", CheckOptions))
        return 0
    cfg, opts = cli.parse_args(argv, CheckOptions)
    if not torch.cuda.is_available():
        raise UsageError("no CUDA device here: the plan's check runs on a GPU (make gpu-check)")
    given = cli.given(argv)
    cfg = replace(cfg, **{k: v for k, v in CHECK_SHAPE.items() if k not in given}, device="cuda", shard="none",
                  accum=1, total_batch_tokens=0)
    out = Path(cfg.out_dir)
    check_writable(out, "--out_dir")
    device = torch.device("cuda", 0)
    found = margin(device)
    peaks = lp.Peaks(cfg, 1, 2)  # two micro-steps: the plan's K > 1
    peak, _, _, storages, large = peaks.at(opts.micro_batch)
    bound = (MIN_BLOCK - 1) * storages + SMALL_SIZE * large  # the allocator's rounding and block slack there
    size = peak + bound + found["context"] + found["workspace"] \
        if opts.emulate == "auto" else gpus.find_gpu(opts.emulate).total
    b = peaks.largest(size - found["context"] - found["workspace"] - bound)
    if b < 2 and peaks.at(2)[0] + bound + found["context"] + found["workspace"] > size:
        raise UsageError(f"--emulate={opts.emulate}: not even two sequences fit {size / lp.GIB:.2f} GiB")
    rules = rules_check(cfg, b)
    cap = size - found["context"]
    torch.cuda.set_per_process_memory_fraction(cap / found["cuda_total"], device)
    fits, next_one = train_steps(cfg, b, 2, device), train_steps(cfg, b + 1, 2, device)
    figures = dict(found, emulated=size, cap=cap, bound=bound, b=b, predicted=peaks.at(b)[0],
                   predicted_next=peaks.at(b + 1)[0], precision=precision.decide(cfg).name, ckpt=cfg.ckpt, attn=cfg.attn,
                   allocated=fits and fits[0], reserved=fits and fits[1], next_fits=next_one is not None,
                   next_allocated=next_one and next_one[0], rules=rules,
                   ok=fits is not None and next_one is None and rules["same"])
    text = json.dumps(figures, indent=1)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "plan_check.json", lambda fh: fh.write(text.encode()))
    print("\n".join(summary(figures)))
    return 0 if figures["ok"] else 1


def rules_check(cfg, b):
    """ledger/cuda_rules.CUDA's rules against this GPU's own kernels: the step traced on fake CUDA tensors, and
    again on fake CPU tensors with the rules (what a CPU-only machine traces), at every precision; the same
    peak and saved bytes verify them."""
    out = {}
    for name in ("fp32", "bf16", "fp8"):
        one = replace(cfg, precision=name, batch_size=b, dropout=0.1, n_layer=2)
        real = trace.step(one)
        with cuda_rules.rules_forced():
            ruled = trace.step(one)
        out[name] = dict(peak=real["peak"], ruled_peak=ruled["peak"], activations=real["activations"],
                         ruled_activations=ruled["activations"])
    out["same"] = all(v["peak"] == v["ruled_peak"] and v["activations"] == v["ruled_activations"]
                      for v in out.values())
    return out


def summary(f):
    """The check's figures in words (make gpu-check's summary prints these lines)."""
    mib = lambda n: f"{n / lp.MIB:,.0f} MiB" if n is not None else "-"  # noqa: E731
    lines = [f"{f['device']}: CUDA's total {mib(f['cuda_total'])}, nvidia-smi's {mib(f['smi_total'])} (the driver "
             f"keeps {mib(f['driver'])}); the CUDA context {mib(f['context'])} (the plan assumes "
             f"{lp.CONTEXT_MIB} MiB); cuBLAS's workspaces {mib(f['workspace'])}",
             f"emulated GPU {mib(f['emulated'])}: the allocator capped at {mib(f['cap'])}; {f['precision']} "
             f"{f['ckpt']} {f['attn']}, planned micro-batch {f['b']} (2 micro-steps), peak predicted "
             f"{f['predicted']:,} bytes, the plan's allocator bound {mib(f['bound'])}"]
    if f["allocated"] is None:
        lines.append(f"FAILED: micro-batch {f['b']} ran out of memory")
    else:
        lines.append(f"micro-batch {f['b']} trained: allocated peak {f['allocated']:,} "
                     f"({f['allocated'] - f['predicted']:+,} vs predicted), reserved peak {f['reserved']:,}: slack "
                     f"{mib(f['reserved'] - f['allocated'])} (bound {mib(f['bound'])})")
    lines.append(f"micro-batch {f['b'] + 1} (predicted {f['predicted_next']:,}): "
                 + (f"FAILED: it trained too (allocated {f['next_allocated']:,})" if f["next_fits"]
                    else "out of memory, as planned"))
    rules = {k: v for k, v in f["rules"].items() if k != "same"}
    lines.append("ledger/cuda_rules.CUDA's rules against this GPU's kernels (peak, activations; traced on fake CUDA, then on "
                 "fake CPU with the rules): " + "; ".join(
                     f"{k} {v['peak']:,} / {v['ruled_peak']:,}, {v['activations']:,} / {v['ruled_activations']:,}"
                     for k, v in rules.items()) + (": the same" if f["rules"]["same"] else ": DIFFERENT"))
    return lines


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
