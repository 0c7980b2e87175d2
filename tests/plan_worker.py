"""The rank-side half of tests/test_plan.py's sharded checks, run by torchrun (gloo on CPU, 2 ranks).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/plan_worker.py OUT CASES [train.py flags]

CASES: a JSON list of {config key: value}, each on top of the flags (SHARD, ACCUM, BATCH_SIZE...).
Each is measured by tools/ledger_ranks.measure_shard, the ledger's own sharded measurement (ACCUM
micro-steps). Rank 0 writes OUT as JSON: per case, [[peak, bytes sent] per rank].
"""
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from guards import cli  # noqa: E402
from ledger import comm  # noqa: E402
from tools.ledger_ranks import measure_shard  # noqa: E402


def main(out, cases, argv):
    cfg = replace(cli.parse_args(argv), device="cpu")
    dist.init_process_group("gloo")
    try:
        rank, world, figures = dist.get_rank(), dist.get_world_size(), []
        for case in json.loads(cases):
            one = replace(cfg, **case)
            mine = measure_shard(one, one.shard, rank, world)
            every = [None] * world
            dist.all_gather_object(every, [mine["measured"]["peak"], comm.volume(mine["calls"])])
            figures.append(every)
        if rank == 0:
            Path(out).write_text(json.dumps(figures))
        gc.collect()  # the DDP wrappers (reference cycles) freed while the process group lives, as train.py does
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
