"""FSDP2 (PyTorch's ZeRO-3): parameters, gradients and optimizer states all split over the ranks.

Chapter section 4 ("ZeRO/FSDP split states"). Read zero.py (ZeRO-1 and ZeRO-2 by hand) before this.
Read first: `apply_fsdp` (one fully_shard per block and one for the rest), then `ShardOptimizer`
(precision.py's optimizer on the shards). What differs from zero.py:
  - the parameters are sharded too: each rank keeps 1/N of every parameter (a DTensor), nothing more;
  - a block's parameters are all-gathered just before its forward, and again in backward;
  - each block's gradient is reduce-scattered as soon as its backward ends: no rank holds the whole;
  - the FP32 shards *are* the master weights: each gathered block is cast to the run's 16-bit dtype,
    its gradient reduce-scattered in FP32, and AdamW steps the shards in place.
Its costs, and why FP8 and fp32_grad_accum are refused: docs/zero.md; snapshots: guards/sharded_snapshot.py.
"""
import torch
import torch.distributed as dist

try:  # public since torch 2.6; an older torch runs every SHARD but this one (apply_fsdp says so)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:
    fully_shard, FSDPModule = None, ()  # (isinstance of an empty tuple: False)

import precision
import zero
from guards import sharded_snapshot


def apply_fsdp(model, prec):
    """Shard `model` (built in FP32) over the default process group: each block is one unit of
    gathering (its parameters gathered together, its gradient reduce-scattered together), and
    the root holds the rest (the embeddings, tied to the head, and ln_f). In place; returns model."""
    if fully_shard is None:
        raise ValueError(f"shard=fsdp needs torch >= 2.6 (torch.distributed.fsdp.fully_shard), this is "
                         f"{torch.__version__}")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("apply_fsdp shards an FP32 model: the FP32 shards are the master weights")
    # 16-bit precisions: gathered in that dtype for compute, gradients reduced in fp32; fp32: as is
    mixed = MixedPrecisionPolicy(param_dtype=prec.param_dtype, reduce_dtype=torch.float32) \
        if prec.master_weights else MixedPrecisionPolicy()
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))  # all the ranks
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=mixed)
    fully_shard(model, mesh=mesh, mp_policy=mixed)
    sharded_snapshot.whole_model_state(model, prec.param_dtype)  # snapshot.py sees whole tensors, as ddp's
    return model


class ShardOptimizer(precision.MasterWeightOptimizer):
    """precision.MasterWeightOptimizer on this rank's FP32 shards (DTensors), which are the master
    weights: the optimizer steps them in place (no master copy, no copy down). master_weights says whether
    the run's precision has master weights, for the snapshot's format only."""

    def __init__(self, params, master_weights, spec, lr, **settings):
        super().__init__(params, False, spec, lr, **settings)  # the shards are fp32: they are the masters
        self.master_weights = master_weights  # master_params is model_params: step copies nothing

    def global_norm(self, grads):
        return zero.norm_over_ranks([g.to_local() for g in grads])  # my shards' squares, summed over the ranks

    def state_dict(self):
        return sharded_snapshot.gather_shards(self)  # ddp's format, on every rank: a collective

    def load_state_dict(self, state):
        sharded_snapshot.cut_shards(self, state)
