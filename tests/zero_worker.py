"""The rank-side half of tests/test_zero.py, run by torchrun (gloo on CPU, 2 ranks).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/zero_worker.py cases OUT
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/zero_worker.py overflow OUT
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/zero_worker.py all OUT   (every mode)

"cases": the same batches through DDP, ZeRO-1 and ZeRO-2 for each precision, with and without
clipping and FP32 gradient sums; per case the parameters after STEPS optimizer steps, what each
step returned, the collectives each phase issued (ledger/comm.Count) and this rank's state bytes.
"overflow": FP16, an inf planted in rank 1's gradient where only rank 1's slice holds it.
"fp8": native FP8 through DDP and ZeRO-2, each rank's whole model state (amax histories too).
Each rank writes OUT/<mode>-rank<r>.pt.
"""
import gc
import sys
from pathlib import Path

import torch

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import accumulate  # noqa: E402
from conftest import loss_scale  # noqa: E402
import train  # noqa: E402
from ddp_worker import make_batches, tiny_config  # noqa: E402
from ledger import comm, measure  # noqa: E402
from ledger.measure import storage_bytes  # noqa: E402

K, B, STEPS = 2, 2, 3  # micro-steps, sequences per micro-batch, optimizer steps per case
SHAPE = dict(n_layer=2, n_embd=35, n_head=5, block_size=17)  # P = 39,935 is odd: the flat buffer is padded
CASES = [dict(precision=p, grad_clip=c) for p in ("fp32", "bf16", "fp16") for c in (0.0, 0.5)] + \
        [dict(precision="bf16", grad_clip=0.5, fp32_grad_accum=True)]


def key(case, shard):
    return ",".join(f"{k}={v}" for k, v in sorted(case.items())) + f",shard={shard}"


def run_case(case, shard, rank, world):
    cfg = tiny_config(**SHAPE, **case, shard=shard)
    model, parts = train.build(cfg, torch.device("cpu"))
    with comm.Count() as count:
        run = train.wrap_ddp(model, torch.device("cpu")) if shard == "none" else model
        if shard == "none":
            count.ddp_hook(run)
        batches = make_batches(11, STEPS * world * K, B, cfg.block_size)
        steps, phases, after = [], [], []
        for step in range(STEPS):
            marks = []
            observe = lambda name, *_: marks.append((name, len(count.calls)))  # noqa: E731
            first = (step * world + rank) * K
            with measure.phases(model, parts, observe):
                loss, stepped, norm = accumulate.accumulation_step(run, parts, batches[first:first + K])
            marks.append(("end", len(count.calls)))
            steps.append(dict(loss=loss, stepped=stepped, grad_norm=norm))
            after.append([p.detach().clone() for p in model.parameters()])
            # the collectives between one phase mark and the next: [(phase, {name: count}, volume)]
            phases.append([(name, dict(comm.kinds(count.calls[at:nxt])), comm.volume(count.calls[at:nxt]))
                           for (name, at), (_, nxt) in zip(marks, marks[1:])])
    opt = parts.optimizer
    states = dict(parameters=storage_bytes(list(model.parameters())),
                  master=storage_bytes(opt.master_params, exclude=()) if opt.master_weights else 0,
                  optimizer=storage_bytes(opt.state_tensors()), n_params=sum(p.numel() for p in model.parameters()))
    del run
    return dict(params=after, steps=steps, phases=phases, states=states)


def cases(rank, world):
    return {key(case, shard): run_case(case, shard, rank, world) for case in CASES
            for shard in ("none", "zero1", "zero2")}


def overflow(rank, world):
    """FP16 ZeRO: at step 2 rank 1 finds an inf in the last element of its .grad, which the
    reduce-scatter puts into rank 1's slice only. Every rank must skip the step and back off."""
    out = {}
    for shard in ("zero1", "zero2"):
        cfg = tiny_config(**SHAPE, precision="fp16", shard=shard, grad_clip=1.0)
        model, parts = train.build(cfg, torch.device("cpu"))
        step_fn, seen = parts.optimizer.step, []

        def planting_step(grads=None, scaler=None):
            if len(seen) == 1 and rank == world - 1:
                last = parts.optimizer.model_params[-1]
                last.grad.view(-1)[-1] = float("inf")
            seen.append(parts.optimizer.shards.start)
            return step_fn(grads, scaler)
        parts.optimizer.step = planting_step
        batches = make_batches(5, 3 * world * K, B, cfg.block_size)
        record = []
        for step in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            first = (step * world + rank) * K
            _, stepped, norm = accumulate.accumulation_step(model, parts, batches[first:first + K])
            changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
            record.append(dict(stepped=stepped, changed=changed, scale=loss_scale(parts), grad_norm=norm))
        out[shard] = dict(steps=record, slice=(parts.optimizer.shards.start, parts.optimizer.shards.size),
                          n_params=sum(p.numel() for p in model.parameters()))
    return out


def fp8(rank, world):
    """FP8 (native, delayed scaling) through DDP and ZeRO-2: each rank's model state after 2 steps,
    amax histories and scales included."""
    out = {}
    for shard in ("none", "zero2"):
        cfg = tiny_config(n_layer=2, n_embd=32, n_head=2, block_size=16, precision="fp8", shard=shard)
        model, parts = train.build(cfg, torch.device("cpu"))
        run = train.wrap_ddp(model, torch.device("cpu")) if shard == "none" else model
        batches = make_batches(3, 2 * world * K, B, cfg.block_size)
        for step in range(2):
            first = (step * world + rank) * K
            accumulate.accumulation_step(run, parts, batches[first:first + K])
        out[shard] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del run
    return out


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = dict(cases=cases, overflow=overflow, fp8=fp8)
    for name in modes if mode == "all" else (mode,):  # "all": one launch for every mode
        torch.save(modes[name](rank, world), out_dir / f"{name}-rank{rank}.pt")
    gc.collect()  # the DDP wrappers (reference cycles) freed while the process group lives, as train.py does
    dist.barrier()
    dist.destroy_process_group()
