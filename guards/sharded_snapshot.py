"""Snapshots of sharded state in DDP's format, so one resumes under DDP, ZeRO-1, ZeRO-2 or FSDP alike.

Not read to learn the chapter: zero.py's and fsdp.py's optimizers delegate their state_dict() and
load_state_dict() here, and fsdp.py's model its state dict. Read first: `optimizer_order` and `whole_groups`
(how a whole-model optimizer numbers its parameters), then `gather_slice` and `cut_slice` (ZeRO), then
`gather_shards`, `cut_shards` and `whole_model_state` (FSDP).

The format is precision.MasterWeightOptimizer.state_dict()'s on one DDP rank:
  master_params  one FP32 tensor per model parameter, in the model's order ([] without master weights);
  <spec.name>    the optimizer's state dict over the whole model ("adamw" for AdamW, precision.OPTIMIZERS):
                 two groups (weight decay, none), the ids numbering the parameters decayed first, each group
                 in the model's order; per parameter the spec's per-element tensors and per-tensor counts.
Gathering is a collective (every rank calls it); cutting needs no communication (each rank cuts its own).
"""
import torch
import torch.distributed as dist

try:  # an older torch has no public DTensor, nor FSDP2 (fsdp.apply_fsdp says so)
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:
    DTensor = ()  # isinstance(t, ()) is False: nothing is a DTensor

import precision

def optimizer_order(params):
    """Indices of the model's `params` in a whole-model optimizer's ids: the decayed ones first."""
    decays = precision.MasterWeightOptimizer.decays(params)
    return [i for i, d in enumerate(decays) if d] + [i for i, d in enumerate(decays) if not d]


def _hyperparameters(group):
    return {k: v for k, v in group.items() if k != "params"}


def _ids(torch_optimizer):
    """The optimizer's parameters in the order its state dict numbers them."""
    return [p for group in torch_optimizer.param_groups for p in group["params"]]


# ---------------------------------------------------------------- ZeRO: one flat slice per rank

def _of_param(whole, piece):
    """The elements of one whole parameter's tensor that lie in my slice (zero.Piece)."""
    return whole.reshape(-1)[piece.start_in_param:piece.start_in_param + piece.length]


def _gather_flat(opt, tensors):
    """One FP32 tensor per piece of my slice, laid end to end (the padding as zeros), gathered on rank 0
    into the whole flat buffer and split per parameter; None on the other ranks. A collective."""
    mine = torch.zeros(opt.shards.size, dtype=torch.float32, device=opt.flat.device)
    for piece, t in zip(opt.pieces, tensors):
        piece.of_slice(mine)[:] = t.detach().reshape(-1)
    full = [torch.empty_like(mine) for _ in range(opt.world)] if opt.rank == 0 else None
    dist.gather(mine, full, dst=0)
    if full is None:
        return None
    whole = torch.cat(full)[:sum(opt.shards.sizes)]  # the padding is no parameter's
    return [t.view_as(p).clone().cpu() for t, p in zip(whole.split(opt.shards.sizes), opt.model_params)]


def gather_slice(opt):
    """zero.ShardedOptimizer.state_dict(): the whole-model state from every rank's slice. Every rank
    calls it (a collective); rank 0 gets the state, the others None."""
    masters = _gather_flat(opt, opt.master_params)  # the slice's FP32 master, or its FP32 parameters
    state, spec = opt.torch_optimizer.state, opt.spec
    per_element = {}
    for name in spec.per_element:  # a piece the optimizer has not stepped yet: zeros
        by_piece = [state[m][name] if m in state else torch.zeros(piece.length, device=opt.flat.device)
                    for m, piece in zip(opt.master_params, opt.pieces)]
        per_element[name] = _gather_flat(opt, by_piece)
    stepped = [state[m] for m in opt.master_params if m in state]
    if opt.rank != 0:
        return None
    whole = dict(state={}, param_groups=[])
    if stepped:  # the optimizer makes its states at its first step: before it there are none to keep
        counts = {name: stepped[0][name].clone() for name in spec.per_tensor}  # one count, alike on every piece
        whole["state"] = {k: dict(counts, **{name: per_element[name][i] for name in spec.per_element})
                          for k, i in enumerate(optimizer_order(opt.model_params))}
    first = 0
    for group, whole_group in zip(opt.torch_optimizer.param_groups, precision.whole_groups(opt.model_params)):
        n = len(whole_group)
        whole["param_groups"].append(dict(_hyperparameters(group), params=list(range(first, first + n))))
        first += n
    return {"master_params": masters if opt.master_weights else [], spec.name: whole}


def cut_slice(opt, state):
    """zero.ShardedOptimizer.load_state_dict(): my slice of a whole-model state (gather_slice's, DDP's)."""
    with torch.no_grad():
        for m, piece in zip(opt.master_params if opt.master_weights else [], opt.pieces):
            m.copy_(_of_param(state["master_params"][piece.index], piece))
    saved = state[opt.spec.name]
    key = {i: k for k, i in enumerate(optimizer_order(opt.model_params))}  # parameter index -> saved state key
    piece_of = dict(zip(opt.master_params, opt.pieces))  # my optimizer's tensors -> the pieces they step
    cut = {}
    for k, m in enumerate(_ids(opt.torch_optimizer)):
        piece = piece_of[m]
        entry = saved["state"].get(key[piece.index])
        if entry is not None:
            cut[k] = {name: v.clone() if name in opt.spec.per_tensor else _of_param(v, piece).clone()
                      for name, v in entry.items()}
    # the saved groups' hyperparameters, with the ids of my slice's optimizer
    groups = [dict(g, params=own["params"]) for g, own in
              zip(saved["param_groups"], opt.torch_optimizer.state_dict()["param_groups"])]
    opt.torch_optimizer.load_state_dict(dict(state=cut, param_groups=groups))


# ---------------------------------------------------------------- FSDP: a DTensor shard of every parameter

def _whole(t):
    """A DTensor gathered whole on every rank (a collective), on the CPU; anything else as is."""
    return t.full_tensor().cpu() if isinstance(t, DTensor) else t


def _shard_like(whole, param):
    """This rank's shard of `whole`, placed as `param` is (each rank cuts its own: no communication)."""
    if not isinstance(param, DTensor):
        return whole
    whole = whole.to(device=param.device, dtype=param.dtype)
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def gather_shards(opt):
    """fsdp.ShardOptimizer.state_dict() (a collective: every rank calls it and gets it): the FP32 shards
    gathered as the master weights, the optimizer's states gathered. Its ids already are a whole model's:
    it steps every parameter's shard."""
    whole = opt.torch_optimizer.state_dict()
    whole["state"] = {k: {name: _whole(v) for name, v in entry.items()} for k, entry in whole["state"].items()}
    masters = [_whole(p).float() for p in opt.model_params] if opt.master_weights else []
    return {"master_params": masters, opt.spec.name: whole}


def cut_shards(opt, state):
    """fsdp.ShardOptimizer.load_state_dict(): this rank's shard of a whole-model state (DDP's format)."""
    with torch.no_grad():
        for p, saved in zip(opt.model_params if opt.master_weights else [], state["master_params"]):
            p.copy_(_shard_like(saved, p))  # exact fp32: the 16-bit model state dict was not
    ids = _ids(opt.torch_optimizer)
    saved = state[opt.spec.name]
    cut = {k: {name: _shard_like(v, ids[k]) if name not in opt.spec.per_tensor else v for name, v in entry.items()}
           for k, entry in saved["state"].items()}
    opt.torch_optimizer.load_state_dict(dict(state=cut, param_groups=saved["param_groups"]))


def whole_model_state(model, dtype):
    """Make an FSDP model's state dict DDP's: model.state_dict() gathers every sharded tensor whole in
    `dtype` (what a DDP run of that precision saves), load_state_dict() cuts a whole tensor into the shard."""
    model.register_state_dict_post_hook(_gathered(dtype))
    model.register_load_state_dict_pre_hook(_cut_into_shards)


def _gathered(dtype):
    def hook(module, state, prefix, local_metadata):
        for k, v in state.items():
            if isinstance(v, DTensor):
                v = v.full_tensor().cpu()
                state[k] = v.to(dtype) if v.is_floating_point() else v
    return hook


def _cut_into_shards(module, state, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    live = dict(module.named_parameters())
    for k, v in list(state.items()):
        name = k[len(prefix):]
        if name in live and torch.is_tensor(v) and not isinstance(v, DTensor):
            if tuple(v.shape) == tuple(live[name].shape):  # a wrong shape: load_state_dict says so
                state[k] = _shard_like(v, live[name])
