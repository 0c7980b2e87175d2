"""The experiments behind `make chapter`, sections 2-4: accumulation, checkpointing, the table.

A tool, not a chapter file. Read tools/chapter_runs.py first (the Claim record and the
section 1 experiments); the no_sync count runs in two processes under torchrun, through
`worker` below (tools/chapter.py starts it with --worker).
"""
import gc
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import accumulate  # noqa: E402
import precision  # noqa: E402
import train  # noqa: E402
from guards import cli  # noqa: E402
from config import UsageError  # noqa: E402
from ledger import comm  # noqa: E402
from ledger.measure import SavedBytes  # noqa: E402
from model import GPT  # noqa: E402
from guards.clean_end import check_writable  # noqa: E402
from tools import bench_loss, demos, ledger, ledger_ranks, plots  # noqa: E402
from tools.chapter_runs import Claim, machine, slow_because, step_seconds, tiny  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K = 4


def torchrun(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two ranks on two cores: no oversubscription
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- section 2: accumulation

def effective_batch(out):
    args = [f"--{k}={v}" for k, v in dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=4, accum=K,
                                          max_iters=1, sample_tokens=0, ledger="false", device="cpu",
                                          out_dir=out / "ddp").items()]
    r = torchrun(["train.py", *args])
    m = re.search(r"effective batch = micro-batch (\d+) x world_size (\d+) x accum (\d+) = (\d+) sequences", r.stdout)
    if r.returncode or not m:
        return Claim("2", "Effective batch size = per-GPU batch x world_size x accumulation_steps",
                     f"torchrun failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", "4 x 2 x 4 = 32", False,
                     "torchrun did not run here")
    b, world, k, seqs = map(int, m.groups())
    return Claim("2", "Effective batch size = per-GPU batch x world_size x accumulation_steps",
                 f"train.py under torchrun printed: micro-batch {b} x world_size {world} x accum {k} = {seqs}",
                 "4 x 2 x 4 = 32 sequences", (b, world, k, seqs) == (4, 2, K, 32))


def loss_over_k(device):
    """K micro-steps with loss / K against one big batch; and the same without the / K."""
    cfg = tiny(device, precision="fp32", grad_clip=0.0)
    gen = torch.Generator().manual_seed(0)
    micro = [tuple(torch.randint(0, 256, (2, cfg.block_size), generator=gen).to(device) for _ in range(2))
             for _ in range(K)]
    model, parts = train.build(cfg, device)
    seen = []
    step = parts.optimizer.step
    def seeing(grads=None, scaler=None):  # grads None: the parameters' .grad
        seen.append([g.clone() for g in grads or [p.grad for p in parts.optimizer.model_params]])
        return step(grads, scaler)
    parts.optimizer.step = seeing
    big, _ = train.build(cfg, device)
    big.load_state_dict(model.state_dict())
    accumulate.accumulation_step(model, parts, micro)
    big(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))[1].backward()
    want = [p.grad.clone() for p in big.parameters()]
    diff = max((a - b).abs().max().item() for a, b in zip(seen[0], want))
    big.zero_grad()
    for x, y in micro:  # the forgotten / K: each micro-batch's mean loss, summed
        big(x, y)[1].backward()
    norm = lambda gs: torch.linalg.vector_norm(torch.stack([g.norm() for g in gs])).item()
    ratio = norm([p.grad for p in big.parameters()]) / norm(want)
    return Claim("2", "The loss must be divided by K", f"K={K} micro-steps vs one batch of {K}x: max gradient "
                 f"difference {diff:.1e}; without the / K the gradient norm is {ratio:.3f}x",
                 f"the same gradient (FP32 rounding only); {K}x without / K", diff < 1e-5 and abs(ratio - K) < 1e-3)


def count_allreduces(out):
    r = torchrun([Path(__file__).resolve(), "--worker", out / "allreduces.json"])
    if r.returncode:
        return Claim("2", "use no_sync() during the intermediate micro-steps to skip their AllReduce",
                     f"torchrun failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", "", False,
                     "torchrun did not run here")
    counts = json.loads((out / "allreduces.json").read_text())
    saved = counts["sync"] - counts["no_sync"]
    return Claim("2", "use no_sync() during the intermediate micro-steps to skip their AllReduce",
                 f"all-reduces per optimizer step, 2 gloo ranks, K={K}, {counts['buckets']} DDP bucket(s): "
                 f"{counts['no_sync']} with no_sync, {counts['sync']} without (counted by a communication hook)",
                 f"K - 1 = {K - 1} fewer per bucket", saved == (K - 1) * counts["buckets"] and counts["no_sync"] > 0)


def worker_program(argv):
    """`--worker PATH`, as torchrun starts it (count_allreduces): bad arguments are one line."""
    if len(argv) != 1:
        raise UsageError(f"--worker takes one argument, the JSON file rank 0 writes; got {len(argv)}")
    if "RANK" not in os.environ:
        raise UsageError("--worker is one rank of the torchrun job `make chapter` starts; run make chapter")
    check_writable(Path(argv[0]).parent, "--worker")
    return worker(argv[0])


def worker(path):
    """One rank of the no_sync count: all-reduces per optimizer step with and without no_sync."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    counts = {}
    for name, use_no_sync in (("no_sync", True), ("sync", False)):
        model, parts = train.build(tiny(torch.device("cpu"), precision="fp32"), torch.device("cpu"))
        ddp = DistributedDataParallel(model)
        calls = [0]

        def hook(state, bucket, calls=calls):
            calls[0] += 1
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())  # counted only: one rank's own gradients are the same here
            return fut
        ddp.register_comm_hook(None, hook)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for step in range(2):  # the second step, after DDP has rebuilt its buckets
            calls[0] = 0
            micro = [tuple(torch.randint(0, 256, (2, 64), generator=gen) for _ in range(2)) for _ in range(K)]
            accumulate.accumulation_step(ddp, parts, micro, use_no_sync=use_no_sync)
        counts[name] = calls[0]
        counts["buckets"] = len(str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes") or "1").split(","))
        del ddp
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(counts))
    gc.collect()  # the DDP wrappers (reference cycles) freed while the process group lives, as train.py does
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- section 3: checkpointing

LAYERS = (4, 9, 16, 25)


def saved_bytes_vs_depth(out):
    """The most saved-activation bytes alive at once in a step, per policy and depth: the log-log slopes."""
    peaks = {}
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 16, (2, 16), generator=gen) for _ in range(2))
    for policy in ("none", "full", "sqrt", "selective"):
        for L in LAYERS:
            cfg = tiny(torch.device("cpu"), precision="fp32", ckpt=policy, n_layer=L, n_embd=16, block_size=16)
            cfg = replace(cfg, vocab_size=16)  # a small head, so that the blocks' bytes set the slope
            model, _ = train.build(cfg, torch.device("cpu"))
            with SavedBytes([*model.parameters(), *model.buffers()]) as counter:
                model(x, y)[1].backward()
            peaks.setdefault(policy, []).append(counter.peak)
    slope = {p: fit_slope([math.log(L) for L in LAYERS], [math.log(v) for v in vs]) for p, vs in peaks.items()}
    series = [(f"{p} (slope {slope[p]:.2f})", list(zip(LAYERS, vs))) for p, vs in peaks.items()]
    (out / "saved_vs_depth.svg").write_text(plots.line_chart(series, "saved activations at their peak vs depth",
                                                             "layers L", "bytes", log=True))
    holds = abs(slope["none"] - 1) < 0.1 and abs(slope["sqrt"] - 0.5) < 0.1
    return Claim("3", "activation memory from O(L) to O(sqrt(L)) (one checkpoint every sqrt(L) layers)",
                 "log-log slope of the peak saved bytes, L = 4, 9, 16, 25: " + ", ".join(f"{p} {s:.2f}" for p, s in
                                                                                       slope.items()),
                 "none about 1, sqrt about 0.5 (full: its L inputs grow as L, one block's internals do not)", holds,
                 figure="saved_vs_depth.svg")


def fit_slope(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def recompute_cost(device, steps, shape):
    flags = ["--n_layer=4", "--batch_size=4"] + [f"--{k}={v}" for k, v in shape.items()]
    counted = demos.counted_step_flops(flags)
    flops = {p: counted[p] / counted["none"] - 1 for p in ("full", "selective")}
    secs = {p: step_seconds(tiny(device, precision="bf16", ckpt=p, n_layer=4, batch_size=4, **shape), steps)
            for p in ("none", "full", "selective")}
    times = {p: secs[p] / secs["none"] - 1 for p in ("full", "selective")}
    near = abs(times["full"] - flops["full"]) < 0.1
    return Claim("3", "Cost: about 33% more forward compute", f"counted FLOPs full +{100 * flops['full']:.1f}%, "
                 f"selective +{100 * flops['selective']:.1f}%; time full {100 * times['full']:+.0f}%, selective "
                 f"{100 * times['selective']:+.0f}% on {machine(device)}", "+33% of the blocks' work at most (the "
                 "embeddings and head dilute it, and a re-run stops at the last tensor its unit saves: without "
                 "dropout a unit's last MLP projection is not re-run); time near the FLOP ratio on a GPU",
                 0.15 < flops["full"] <= 1 / 3 and near, "" if near else f"{slow_because(device)} is not the FLOP ratio: the recomputed softmax, GELU and "
                 "LayerNorm are elementwise work that the FLOP count leaves out")


def loss_in_pieces(device, rounds, shape):
    """Selective recompute applied to the head: the loss in 16 pieces (LOSS_CHUNKS, model.ChunkedLoss)
    against whole, at GPT-2's vocabulary, both in one process (tools/bench_loss.py). In the precision this
    device computes (precision.native): the loss is FP32 in any, and emulated BF16 takes minutes at V=50,304."""
    computes = precision.native(device)[0]
    flags = [f"--device={device.type}", f"--precision={computes}"] + \
        [f"--{k}={v}" for k, v in {"n_layer": 4, "batch_size": 8, **shape}.items()]
    rows = {row["loss_chunks"]: row for row in bench_loss.measure_pieces(flags, rounds, 1)}
    whole, pieces = rows[1], rows[16]
    peak, speed = pieces["peak_bytes"] / whole["peak_bytes"], pieces["speed_vs_whole"]
    return Claim("3", "Selective checkpointing: recompute only the ops that are cheap but have large activations "
                 "(here the loss's FP32 logits, LOSS_CHUNKS=16)",
                 f"V={bench_loss.VOCAB:,}, {computes.upper()}: the step's peak x{peak:.2f} ({pieces['peak_bytes']:,} of "
                 f"{whole['peak_bytes']:,} bytes; the loss at its most {whole['loss_share']:.0%} of the peak whole, "
                 f"{pieces['loss_share']:.0%} in pieces), tokens/s x{speed:.3f} (median of {rounds} paired steps) on "
                 f"{machine(device)}", "peak x0.55 at most; tokens/s x0.95 at least (one head GEMM more, the logits "
                 "written in pieces)", peak <= 0.55 and speed >= 0.95,
                 "" if speed >= 0.95 else f"{slow_because(device)}: the re-run GEMM costs more than the pieces save")


# ---------------------------------------------------------------- section 4: the whole picture

def components_table(device):
    cfg = table_config(device)
    rows = ledger.technique_rows(cfg, device, ledger.check_options(cfg, ledger.LedgerOptions(), []))
    table = {name: c for name, c, _ in rows}
    measured = sum(how == "measured" for _, _, how in rows)
    base = table["BF16 mixed precision"]
    checks = [table["FP32 baseline"]["activations"] > base["activations"],
              table["full checkpointing"]["activations"] < base["activations"],
              table["ZeRO-1 over 8 (rank 0)"]["optimizer"] < base["optimizer"],
              table["FSDP (ZeRO-3) over 8 (rank 0)"]["parameters"] < base["parameters"],
              table["CPU offload (ZeRO-Offload)"]["optimizer"] == 0]
    return Claim("4", "One table: four memory components x which technique shrinks which",
                 f"{len(rows)} techniques, {measured} measured on {machine(device)}, the rest traced or formulas on the "
                 f"trace (the table below)", "each technique shrinks the component it names", all(checks)), rows


def table_config(device):
    """The shape of section 4's table and of its sharded runs (cached: measured once per process)."""
    return tiny(device, precision="bf16", batch_size=4)


def states_split(device):
    """ZeRO/FSDP split states: each rank's share, measured in 2 gloo processes (tools/ledger.py's run)."""
    cfg = replace(table_config(device), ckpt="none")
    figures = ledger.measure_ranks(cfg)
    rank0 = {shard: ranks[0]["measured"] for shard, ranks in figures.items()}
    exact = not any(ledger_ranks.misses(cfg, shard, r)[0] for shard, ranks in figures.items() for r in ranks)
    opt = {shard: m["master"] + m["optimizer"] for shard, m in rank0.items()}
    states = {shard: m["parameters"] + m["master"] + m["optimizer"] for shard, m in rank0.items()}
    share = lambda shard, key: rank0[shard][key] / rank0["none"][key]  # noqa: E731
    # FSDP's FP32 shards are its parameters and master weights at once: 4/N bytes where DDP keeps 2 + 4
    ratios = (f"master+AdamW ZeRO-1 {opt['zero1'] / opt['none']:.2f}x DDP's, gradients held in the step ZeRO-2 "
              f"{share('zero2', 'step_gradients'):.2f}x, parameters+master+AdamW FSDP "
              f"{states['fsdp'] / states['none']:.2f}x")
    n = ledger.RANKS
    holds = exact and opt["zero1"] < 1.01 * opt["none"] / n and share("zero2", "step_gradients") <= 1.01 / n \
        and states["fsdp"] < 1.01 * states["none"] / n
    return Claim("4", "ZeRO/FSDP split states", f"rank 0 of {ledger.RANKS}: {ratios}; every rank exact against "
                 f"its trace" if exact else f"rank 0 of {ledger.RANKS}: {ratios}; some rank MISSES its trace",
                 "each split component / N on every rank, to the byte", holds,
                 "" if exact else "a rank's storages differ from its trace: make ledger names which")


def communication_volume(device):
    """The ZeRO paper's volume claim (sec. 7.2.1): ZeRO-1/2 move what DDP moves, ZeRO-3 1.5x."""
    cfg = replace(table_config(device), ckpt="none")
    figures = ledger.measure_ranks(cfg)
    elements = {shard: comm.elements(ranks[0]["calls"]) for shard, ranks in figures.items()}
    volume = {shard: comm.volume(ranks[0]["calls"]) for shard, ranks in figures.items()}
    exact = not any(ledger_ranks.misses(cfg, shard, r)[0] for shard, ranks in figures.items() for r in ranks)
    with torch.device("meta"):
        named = [(n, p.numel()) for n, p in GPT(cfg).named_parameters()]
    blocks = sum(k for n, k in named if n.startswith("h.")) / sum(k for _, k in named)
    ratio = {shard: elements[shard] / elements["none"] for shard in elements}
    same = all(abs(ratio[s] - 1) < 0.01 for s in ("zero1", "zero2"))
    # what a step sends besides the gradient and the weights (the norm's sum, a precision's own: FP8's amax)
    also = {}
    for shard, ranks in figures.items():
        for what, _, n in ranks[0]["calls"]:
            if n < 0.01 * elements["none"]:
                also.setdefault(f"{what} of {n:,}", []).append(ledger_ranks.SHARD_NAMES[shard])
    measured = (f"per step, in elements (bytes): DDP {elements['none']:,} ({volume['none']:,}), "
                f"ZeRO-1 x{ratio['zero1']:.3f}, ZeRO-2 x{ratio['zero2']:.3f}, FSDP x{ratio['fsdp']:.3f} "
                f"(x{volume['fsdp'] / volume['none']:.2f} in bytes: it reduce-scatters in FP32), each count with "
                + "; ".join([f"{what} ({', '.join(names)})" for what, names in also.items()] or ["nothing else"])
                + f"; the blocks hold {100 * blocks:.0f}% of the parameters")
    if not exact:
        why = "a count differs from the trace's (ledger/trace.py): make ledger names which"
    elif not same:
        why = f"ZeRO-1 moved x{ratio['zero1']:.3f} and ZeRO-2 x{ratio['zero2']:.3f} of DDP's elements"
    else:  # the paper counts every parameter gathered twice; FSDP2 leaves the root gathered through backward
        why = (f"FSDP2 gathers each block twice (forward, backward) but the root (embeddings, head, ln_f: "
               f"{100 * (1 - blocks):.0f}% of the parameters here) once: 1 + {blocks:.2f}/2 = x{1 + blocks / 2:.3f} "
               f"predicted, not 1.5; every count matches the step's trace under a fake process group")
    return Claim("4", "ZeRO-1 and ZeRO-2 communicate what DDP does (2 Psi), ZeRO-3 about 1.5x that",
                 measured, "ZeRO-1/2 x1.00 (a reduce-scatter and an all-gather); ZeRO-3 x1.5", same and exact and
                 abs(ratio["fsdp"] - 1.5) < 0.05, why)


def program(argv):
    if argv[:1] != ["--worker"]:
        raise UsageError("tools/chapter_runs_memory.py is started by make chapter as --worker PATH; run make chapter")
    return worker_program(argv[1:])


if __name__ == "__main__":
    sys.exit(cli.run(program, sys.argv[1:]))
