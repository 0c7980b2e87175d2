"""The ledger's sharded rows, measured: each rank's states under DDP, ZeRO-1, ZeRO-2 and FSDP.

Run by tools/ledger.py (and tools/chapter.py) under torchrun, gloo on CPU:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tools/ledger_ranks.py [train.py flags] --into=F

For each SHARD: build the run, one step (AdamW makes its states), then one step of ACCUM
micro-steps measured on every rank (ledger/measure.measure: the storages, as the single-process ledger counts them)
with its collectives counted (ledger/comm.Count). Rank 0 gathers every rank's figures, with
the formula's (ledger/shard.rank_states), and writes F as JSON.
"""
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import accumulate  # noqa: E402
import train  # noqa: E402
from guards import cli  # noqa: E402
from config import UsageError, key  # noqa: E402
from ledger import comm, measure  # noqa: E402
from ledger import shard as ls  # noqa: E402
from guards.files import write_atomically  # noqa: E402

MEASURED = ("parameters", "buffers", "master", "optimizer", "step_gradients", "fp8_kept", "activations", "peak")


@dataclass
class RankOptions:
    into: str = key("", "the JSON file rank 0 writes")
    shards: str = key("none,zero1,zero2,fsdp", "the SHARD values to measure, comma-separated")


def measure_shard(cfg, shard, rank, world):
    cfg = replace(cfg, shard=shard)
    device = torch.device("cpu")
    model, parts = train.build(cfg, device)
    run_model = train.wrap_ddp(model, device) if shard == "none" else model
    if shard == "none":
        comm.Count.ddp_hook(run_model)
    batch = measure.random_batch(cfg, device)
    accumulate.accumulation_step(run_model, parts, [batch])  # AdamW's states exist from here: the steady state
    with comm.Count() as count:
        meas = measure.measure(run_model, parts, batch, device, micro_steps=cfg.accum)
    return dict(rank=rank, measured={k: meas.get(k) for k in MEASURED},
                formula=ls.rank_states(cfg, shard, world, rank), calls=dict(count.kinds()), volume=count.volume(),
                elements=count.elements(), elements_formula=ls.step_elements(cfg, shard, world))


def program(argv):
    cfg, opts = cli.parse_args(argv, RankOptions)
    if not opts.into:
        raise UsageError("--into=FILE is needed: where rank 0 writes the figures")
    cfg = replace(cfg, device="cpu")
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        figures = {}
        for shard in opts.shards.split(","):
            mine = measure_shard(cfg, shard, rank, world)
            every = [None] * world
            dist.all_gather_object(every, mine)
            figures[shard] = every
        if rank == 0:
            text = json.dumps(dict(world=world, figures=figures), indent=1)
            write_atomically(opts.into, lambda fh: fh.write(text.encode()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(cli.run(program, sys.argv[1:]))
