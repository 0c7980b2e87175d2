"""The rank-side half of tests/test_fsdp.py, run once by torchrun (gloo on CPU, 2 ranks).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_worker.py OUT

Every case builds its runs with train.build (shard=fsdp, or shard=none wrapped in DDP) and steps
them through accumulate.accumulation_step, on batches every rank can rebuild (ddp_worker's
make_batches); each rank writes OUT/fsdp-rank<r>.pt, a dict per case:
  recompute  the whole gradient the optimizer saw in each of two steps, per CKPT policy, and the
             reduce-scatters and all-gathers each step issued;
  accum      reduce-scatters and all-gathers per optimizer step, with and without set_requires_gradient_sync
             on the early micro-steps, and the gradients, for the big-batch oracle;
  no_sync    reduce-scatters of K-1 backwards with FSDP2's gradient sync off (accumulate.py's rule) and of one after;
  overflow   FP16, an inf planted in rank 1's gradient shard at step 1: stepped, norm, scale;
  clip       the norm every rank used vs the norm of the gathered gradient;
  parity     FP32/BF16/FP16 losses and whole parameters per step, FSDP and DDP on the same batches;
  resume     whole FP32 parameters after 4 steps straight, and after 2 + a snapshot + 2 (read back
             through snapshot.read/restore); the snapshot's path for the pytest side.
"""
import gc
import os
import sys
from pathlib import Path

import torch

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import accumulate  # noqa: E402
from conftest import loss_scale  # noqa: E402
import snapshot  # noqa: E402
import train  # noqa: E402
from ddp_worker import make_batches, rank_slice, tiny_config  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

K, B = 3, 2  # micro-steps per optimizer step, sequences per micro-batch
CPU = torch.device("cpu")
COLLECTIVES = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter"),
               "all_gather": ("all_gather_single", "all_gather_into_tensor")}
COUNTS = {kind: 0 for kind in COLLECTIVES}


def count_collectives():
    """Wrap torch.distributed's reduce-scatter and all-gather entry points (FSDP2 calls
    dist.reduce_scatter_single and dist.all_gather_single: torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py, DefaultReduceScatter and DefaultAllGather) so each call is counted."""
    for kind, names in COLLECTIVES.items():
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counted(*a, _original=original, _kind=kind, **kw):
                COUNTS[_kind] += 1
                return _original(*a, **kw)
            setattr(dist, name, counted)


def whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_params(model):
    return {k: whole(p).detach().float().clone() for k, p in model.named_parameters()}


def record_step(parts, sink):
    """Wrap the optimizer's step: the whole gradient it is about to use, and what it returned."""
    step = parts.optimizer.step

    def recording(grads=None, scaler=None):
        seen = grads if grads is not None else [p.grad for p in parts.optimizer.model_params]
        # None: no gradient reached this parameter (the optimizer would step it with zeros)
        grads_now = [None if g is None else whole(g).detach().float().clone() / (scaler.loss_scale if scaler else 1.0)
                     for g in seen]
        out = step(grads, scaler)
        sink.append(dict(grads=grads_now, stepped=out[0], norm=out[1]))
        return out
    parts.optimizer.step = recording


def build(rank, shard="fsdp", **kw):
    cfg = tiny_config(shard=shard, **kw)
    model, parts = train.build(cfg, CPU)
    if shard == "none":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    return cfg, model, parts


def steps(model, parts, rank, world, seed, n, k=K, no_sync=True):
    losses = []
    for s in range(n):
        batches = make_batches(seed + s, world * k, B, 16)
        losses.append(accumulate.accumulation_step(model, parts, rank_slice(batches, rank, world, k), "mean",
                                                   no_sync)[0])
    return losses


def case_recompute(rank, world):
    out = {}
    for ckpt, extra in (("none", {}), ("full", {}), ("sqrt", dict(ckpt_segment=2)), ("selective", {})):
        _, model, parts = build(rank, ckpt=ckpt, **extra)
        sink, counts = [], []
        record_step(parts, sink)
        for s in range(2):  # a second step: nothing the first left behind in FSDP's state
            COUNTS.update(reduce_scatter=0, all_gather=0)
            steps(model, parts, rank, world, seed=500 + s, n=1, k=1)
            counts.append(dict(COUNTS))
        out[ckpt] = dict(grads=[r["grads"] for r in sink], names=[k for k, _ in model.named_parameters()],
                         counts=counts)
    return out


def case_accum(rank, world):
    out = {}
    for no_sync in (True, False):
        _, model, parts = build(rank)
        sink, counts, params = [], [], []
        record_step(parts, sink)
        for s in range(2):
            params.append(whole_params(model))
            COUNTS.update(reduce_scatter=0, all_gather=0)
            steps(model, parts, rank, world, seed=700 + s, n=1, no_sync=no_sync)
            counts.append(dict(COUNTS))
        out[no_sync] = dict(counts=counts, grads=[r["grads"] for r in sink], params=params,
                            groups=1 + len(model.h))
    return out


def case_no_sync(rank, world):
    _, model, _ = build(rank)
    batches = rank_slice(make_batches(750, world * K, B, 16), rank, world, K)
    COUNTS.update(reduce_scatter=0, all_gather=0)
    model.set_requires_gradient_sync(False)  # what accumulate.py sets on micro-steps 1..K-1
    for x, y in batches[:-1]:
        model(x, y)[1].backward()
    model.set_requires_gradient_sync(True)
    inside = COUNTS["reduce_scatter"]
    x, y = batches[-1]
    model(x, y)[1].backward()
    return dict(inside=inside, after=COUNTS["reduce_scatter"] - inside, groups=1 + len(model.h))


def case_overflow(rank, world):
    _, model, parts = build(rank, precision="fp16", grad_clip=1.0)
    sink, planted = [], [False]
    step = parts.optimizer.step

    def planting(grads=None, scaler=None):
        if not planted[0]:
            planted[0] = True
            if rank == 1:  # one element of rank 1's own shard: no other rank sees it in its .grad
                parts.optimizer.model_params[0].grad.to_local().view(-1)[0] = float("inf")
        out = step(grads, scaler)
        sink.append(dict(stepped=out[0], norm=out[1], scale=loss_scale(parts)))
        return out
    parts.optimizer.step = planting
    before = whole_params(model)
    steps(model, parts, rank, world, seed=900, n=1)
    after_skip = whole_params(model)
    steps(model, parts, rank, world, seed=901, n=1)
    return dict(record=sink, unchanged=all(torch.equal(before[k], after_skip[k]) for k in before),
                moved=any(not torch.equal(after_skip[k], v) for k, v in whole_params(model).items()),
                scales=[r["scale"] for r in sink])


def case_clip(rank, world):
    _, model, parts = build(rank, grad_clip=1e-3)
    sink = []
    record_step(parts, sink)
    steps(model, parts, rank, world, seed=950, n=1)
    true = torch.cat([g.reshape(-1) for g in sink[0]["grads"]]).double().norm().item()
    return dict(norm=sink[0]["norm"], true=true)


def case_parity(rank, world):
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        for shard in ("fsdp", "none"):
            _, model, parts = build(rank, shard=shard, precision=precision)
            inner = model.module if shard == "none" else model
            losses, params = [], []
            for s in range(3):
                losses += steps(model, parts, rank, world, seed=1100 + s, n=1)
                params.append(whole_params(inner) if precision == "fp32" else None)
            out[(precision, shard)] = dict(losses=losses, params=params)
    return out


class Stream:
    """What snapshot.capture/restore read of a data stream: its generator."""
    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)


def case_resume(rank, world, out_dir):
    kw = dict(precision="fp16", ckpt="full", dropout=0.1)
    _, model, parts = build(rank, **kw)
    torch.manual_seed(1234 + rank)  # dropout's stream, each rank its own, after build as train_loop seeds it
    steps(model, parts, rank, world, seed=1300, n=4)
    straight = whole_params(model)
    cfg, model, parts = build(rank, **kw)
    torch.manual_seed(1234 + rank)
    steps(model, parts, rank, world, seed=1300, n=2)
    state = snapshot.capture(cfg, model, parts, Stream(), 2, CPU, world)  # every rank: a collective
    path = out_dir / snapshot.FILE
    if rank == 0:
        snapshot.save(path, state)
    dist.barrier()
    snap = snapshot.read(path)
    _, model, parts = build(rank, **kw)
    torch.manual_seed(999)  # the restore must bring back each rank's own stream
    snapshot.restore(snap, model, parts, Stream(), rank, world, CPU)
    restored = whole_params(model)
    steps(model, parts, rank, world, seed=1302, n=2)
    return dict(straight=straight, resumed=whole_params(model), restored=restored, path=str(path))


def main(argv):
    out = Path(argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    count_collectives()
    results = dict(recompute=case_recompute(rank, world), accum=case_accum(rank, world),
                   no_sync=case_no_sync(rank, world), overflow=case_overflow(rank, world), clip=case_clip(rank, world),
                   parity=case_parity(rank, world), resume=case_resume(rank, world, out))
    torch.save(results, out / f"fsdp-rank{rank}.pt")
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
