"""FSDP2 (PyTorch's ZeRO-3): parameters, gradients and optimizer states all split over the ranks.

Chapter section 4 ("ZeRO/FSDP split states"). Read first: `apply_fsdp` (one fully_shard per
block and one for the rest), then `ShardOptimizer` (precision.py's optimizer on the shards),
then the snapshot half.
zero.py, ZeRO-1 and ZeRO-2 by hand, is the one to read before this.

What differs from zero.py's ZeRO:
  - the parameters are sharded too (ZeRO-3): each rank keeps 1/N of every parameter, as a
    DTensor (Shard(0): rows r*ceil(n/N) .. of each one), and nothing else of it;
  - a block's parameters are all-gathered just before its forward and freed right after it,
    then gathered again in backward (the block's backward needs them): 2 all-gathers of the
    parameters per step where zero.py does 1 (ZeRO paper sec. 7.2.1: 1.5 x DDP's traffic);
  - the gradients are reduce-scattered one block at a time *during* backward, as soon as the
    block's backward ends: no rank ever holds the whole gradient (zero.py's wait for the end);
  - the FP32 shards *are* the master weights (PyTorch's own way): the model is built in FP32,
    and MixedPrecisionPolicy casts each gathered block to the run's 16-bit dtype for its
    forward and backward, and reduce-scatters its gradient in FP32 (reduce_dtype). So AdamW
    steps the FP32 shards in place, with no copy to keep in step (precision.py's
    master_weights=False path), and a 16-bit copy of a parameter lives only while gathered.
Not here: FP8 (config.py refuses it: fp8.py keeps whole FP8 weight copies and an amax per
weight) and fp32_grad_accum (refused too: FSDP already sums the micro-steps' gradients in FP32).

A snapshot is an ordinary one, as zero.py's: the model's state dict gathered whole in the run's
dtype and the optimizer in MasterWeightOptimizer's format, so DDP, ZeRO and `--sample_only`
read it; loading it cuts each tensor into this rank's shard again.
"""

import torch

try:  # public since torch 2.6; an older torch runs every SHARD but this one (apply_fsdp says so)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:
    fully_shard = DTensor = None

import zero


def apply_fsdp(model, recipe):
    """Shard `model` (built in FP32) over the default process group: each block is one unit of
    gathering (its parameters gathered together, its gradient reduce-scattered together), and
    the root holds the rest (the embeddings, tied to the head, and ln_f). In place; returns model."""
    if fully_shard is None:
        raise ValueError(f"shard=fsdp needs torch >= 2.6 (torch.distributed.fsdp.fully_shard), this is "
                         f"{torch.__version__}")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("apply_fsdp shards an FP32 model: the FP32 shards are the master weights")
    # 16-bit precisions: gathered in that dtype for compute, gradients reduced in FP32; fp32: as is
    mixed = MixedPrecisionPolicy(param_dtype=recipe.param_dtype, reduce_dtype=torch.float32) \
        if recipe.master_weights else MixedPrecisionPolicy()
    for block in model.h:
        fully_shard(block, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    # snapshot.py calls model.state_dict() on every rank and load_state_dict with whole tensors:
    # gather on the way out, cut on the way in, so its format stays DDP's
    model.register_state_dict_post_hook(_gathered(recipe.param_dtype))
    model.register_load_state_dict_pre_hook(_cut_into_shards)
    return model


# ---------------------------------------------------------------- the optimizer on the shards

class ShardOptimizer(zero.SliceOptimizer):
    """precision.MasterWeightOptimizer on this rank's FP32 shards (DTensors), which are the master
    weights: AdamW steps them in place (no master copy, no copy down). master_weights says whether
    the run's precision has master weights, for the snapshot's format only. Its norm is zero.py's:
    each rank's squared shard norms (precision.squared_sum takes a DTensor's local shard), summed over
    the ranks, so every rank skips an overflowing step and clips by the same factor."""

    def __init__(self, params, master_weights, lr, **adamw):
        super().__init__(params, False, lr, **adamw)  # the shards are FP32: they are the masters
        self.master_weights = master_weights  # master_params is model_params: step copies nothing

    def state_dict(self):
        """MasterWeightOptimizer.state_dict()'s format for the whole model (a collective: every rank
        calls it and gets it): the FP32 parameters gathered as the master weights, AdamW's moments
        gathered. AdamW's ids already are the whole model's (it steps every parameter's shard)."""
        adamw = self.adamw.state_dict()
        adamw["state"] = {k: {name: _whole(v) for name, v in entry.items()} for k, entry in adamw["state"].items()}
        masters = [_whole(p).float() for p in self.model_params] if self.master_weights else []
        return dict(master_params=masters, adamw=adamw)

    def load_state_dict(self, state):
        """Take this rank's shard of a whole-model optimizer state (state_dict's format, DDP's)."""
        with torch.no_grad():
            for p, saved in zip(self.model_params if self.master_weights else [], state["master_params"]):
                p.copy_(_shard_like(saved, p))  # exact FP32: the 16-bit model state dict was not
        order = [p for group in self.adamw.param_groups for p in group["params"]]  # AdamW's ids
        saved = state["adamw"]
        cut = {k: {name: _shard_like(v, order[k]) if name != "step" else v for name, v in entry.items()}
               for k, entry in saved["state"].items()}
        self.adamw.load_state_dict(dict(state=cut, param_groups=saved["param_groups"]))


# ---------------------------------------------------------------- whole tensors <-> shards

def _whole(t):
    """A DTensor gathered whole on every rank (a collective), on the CPU; anything else as is."""
    return t.full_tensor().cpu() if isinstance(t, DTensor) else t


def _shard_like(whole, param):
    """This rank's shard of `whole`, placed as `param` is (each rank cuts its own: no communication)."""
    if not isinstance(param, DTensor):
        return whole
    whole = whole.to(device=param.device, dtype=param.dtype)
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def _gathered(dtype):
    """model.state_dict()'s post-hook: every sharded floating tensor gathered whole, in `dtype`
    (what a DDP run of that precision saves)."""
    def hook(module, state, prefix, local_metadata):
        for k, v in state.items():
            if isinstance(v, DTensor):
                v = v.full_tensor().cpu()
                state[k] = v.to(dtype) if v.is_floating_point() else v
    return hook


def _cut_into_shards(module, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """model.load_state_dict()'s pre-hook: a whole tensor for a sharded parameter becomes its shard."""
    live = dict(module.named_parameters())
    for k, v in list(state.items()):
        name = k[len(prefix):]
        if name in live and torch.is_tensor(v) and not isinstance(v, DTensor):
            if tuple(v.shape) == tuple(live[name].shape):  # a wrong shape: load_state_dict says so
                state[k] = _shard_like(v, live[name])
