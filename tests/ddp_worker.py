"""The rank-side half of tests/test_accumulate.py, run by torchrun (gloo on CPU).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_worker.py grads OUT
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/ddp_worker.py train OUT -- --key=value ...

"grads": accumulation steps through accumulate.py on a DDP model, recording per optimizer
step the gradients the optimizer saw, the parameters before the step, and how many
all-reduces DDP issued (a communication hook counts them). The test computes the
big-batch oracle itself from the same batches (`make_batches`) in one process.
"train": train.py's own main() under torchrun, then every rank saves its parameters.
Each rank writes OUT/<mode>-rank<r>.pt.
"""
import gc
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import accumulate  # noqa: E402
import train  # noqa: E402
from config import Config  # noqa: E402

K, B, STEPS = 3, 2, 2  # micro-steps, sequences per micro-batch, optimizer steps per case


def tiny_config(**kw):
    """A model that runs a step in milliseconds on one CPU core; no clipping, so the
    optimizer sees the raw accumulated gradient."""
    base = dict(n_layer=2, n_embd=32, n_head=2, block_size=16, precision="fp32", grad_clip=0.0,
                dropout=0.0, device="cpu", learning_rate=1e-2, warmup_iters=0)
    base.update(kw)
    return Config(**base)


def make_batches(seed, n, batch, block, pad=None):
    """n micro-batches of (x, y) random bytes, the same on every rank for a seed.
    pad(j) -> how many trailing targets of micro-batch j are padding (-100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(n):
        x = torch.randint(0, 256, (batch, block), generator=g)
        y = torch.randint(0, 256, (batch, block), generator=g)
        if pad is not None and pad(j):
            y[:, block - pad(j):] = accumulate.IGNORE_INDEX
        out.append((x, y))
    return out


def rank_slice(batches, rank, world, k):
    """This rank's k micro-batches of one optimizer step: rank r takes r*k .. r*k+k-1."""
    return batches[rank * k:(rank + 1) * k]


def record_grads(parts, sink):
    """Wrap the optimizer's step so the gradients it is about to use are copied into sink first."""
    step = parts.optimizer.step

    def recording_step(grads=None, scaler=None):
        seen = grads if grads is not None else [p.grad for p in parts.optimizer.model_params]  # None: the .grad
        sink.append([g.detach().float().clone() for g in seen])
        return step(grads, scaler)
    parts.optimizer.step = recording_step


def count_allreduces(ddp, counter):
    """A DDP communication hook: the default all-reduce, counted (one call per bucket)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        counter[0] += 1
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, hook)


def n_buckets(ddp):
    """How many buckets DDP has now, from its own logging data (rebuilt after the first backward)."""
    d = ddp._get_ddp_logging_data()
    sizes = d.get("rebuilt_bucket_sizes") or d["bucket_sizes"]
    return len(str(sizes).split(","))


# the cases of the "grads" mode: config overrides, accumulation_step arguments, padding
CASES = {
    "no_sync": dict(cfg={}, loss_norm="mean", no_sync=True, pad=None),
    "sync_every_micro_step": dict(cfg={}, loss_norm="mean", no_sync=False, pad=None),
    # rank 1's micro-batches are mostly padding: per-rank normalisation would be wrong
    "tokens": dict(cfg={}, loss_norm="tokens", no_sync=True, pad=lambda j: [0, 3, 9, 12, 14, 15][j % 6]),
    "fp32_grad_accum": dict(cfg=dict(precision="bf16", fp32_grad_accum=True), loss_norm="mean", no_sync=True,
                            pad=None),
}


def seed_of(case, step):
    return 1000 * list(CASES).index(case) + step


def run_grads(out, rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    results = {}
    for name, case in CASES.items():
        cfg = tiny_config(**case["cfg"])
        model, parts = train.build(cfg, torch.device("cpu"))
        # a small bucket cap gives several buckets even for this tiny model
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        counter, grads, rec = [0], [], dict(grads=[], params=[], allreduces=[], buckets=[])
        count_allreduces(ddp, counter)
        record_grads(parts, grads)
        for step in range(STEPS):
            batches = make_batches(seed_of(name, step), world * K, B, cfg.block_size, case["pad"])
            rec["params"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
            counter[0] = 0
            accumulate.accumulation_step(ddp, parts, rank_slice(batches, rank, world, K), case["loss_norm"],
                                         case["no_sync"])
            rec["allreduces"].append(counter[0])
            rec["buckets"].append(n_buckets(ddp))
        rec["grads"] = grads
        results[name] = rec
    # the claim in accumulate.py's comment: no_sync around the backward only is not enough
    cfg = tiny_config()
    model, parts = train.build(cfg, torch.device("cpu"))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    counter = [0]
    count_allreduces(ddp, counter)
    x, y = make_batches(7, 1, B, cfg.block_size)[0]
    _, loss = ddp(x, y)
    with ddp.no_sync():
        loss.backward()
    results["forward_outside_no_sync"] = dict(allreduces=counter[0], buckets=n_buckets(ddp))
    torch.save(results, out / f"grads-rank{rank}.pt")


def run_train(out, rank, argv):
    """train.main(argv) as `python train.py` runs it, keeping the model and the history."""
    kept = {}
    build, train_loop = train.build, train.train

    def keep_build(*a, **kw):
        kept["model"], parts = build(*a, **kw)
        return kept["model"], parts

    def keep_train(cfg, log=print, given=None):
        kept["history"] = train_loop(cfg, log, given)
        return kept["history"]
    train.build, train.train = keep_build, keep_train
    rc = train.main(argv)
    if rc == 0:
        state = {k: v.detach().clone() for k, v in kept["model"].state_dict().items()}
        torch.save(dict(params=state, history=kept["history"]), out / f"train-rank{rank}.pt")
    return rc


def main(argv):
    mode, out = argv[0], Path(argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if mode == "grads":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        run_grads(out, rank, world)
        gc.collect()  # free the DDP wrappers (reference cycles) while the process group lives, as train.py does
        dist.barrier()
        dist.destroy_process_group()
        return 0
    if mode == "train":
        return run_train(out, rank, argv[3:] if argv[2:3] == ["--"] else argv[2:])
    print(f"error: unknown mode {mode!r}; use grads|train", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
