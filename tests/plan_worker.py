"""The rank-side half of tests/test_plan.py's ZeRO check, run by torchrun (gloo on CPU, 2 ranks).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/plan_worker.py OUT B1,B2 [train.py flags]

tools/ledger_ranks.measure_shard (the ledger's own sharded measurement) at each micro-batch B, with
the flags' SHARD and ACCUM micro-steps: each rank's measured peak and the bytes its step sent.
Rank 0 writes OUT as JSON: {B: [[peak, bytes sent] per rank]}.
"""
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from guards import cli  # noqa: E402
from tools.ledger_ranks import measure_shard  # noqa: E402


def main(out, batch_sizes, argv):
    cfg = replace(cli.parse_args(argv), device="cpu")
    dist.init_process_group("gloo")
    try:
        rank, world, figures = dist.get_rank(), dist.get_world_size(), {}
        for b in map(int, batch_sizes.split(",")):
            mine = measure_shard(replace(cfg, batch_size=b), cfg.shard, rank, world)
            every = [None] * world
            dist.all_gather_object(every, [mine["measured"]["peak"], mine["volume"]])
            figures[b] = every
        if rank == 0:
            Path(out).write_text(json.dumps(figures))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
