"""ZeRO-1 and ZeRO-2 by hand: the FP32 master copy and AdamW's states split over the ranks.

Chapter section 4 ("ZeRO/FSDP split states"). Read first: `Shards` (every parameter end to
end in one flat buffer, cut in N equal slices), then `ShardedOptimizer.step`, then the
snapshot half at the end. FSDP, PyTorch's own ZeRO-3, is fsdp.py.

DDP keeps all of the 16 bytes per parameter on every rank (memory_ledger.bytes_per_param).
12 of them, the FP32 master copy and AdamW's m and v, are only ever read by the optimizer
step, and each element's update needs only that element's gradient: so rank r can keep them
for its slice of the parameters only, step that slice, and send the result to the others.

  ZeRO-1  each rank keeps master, m and v of its 1/N slice (the states / N);
  ZeRO-2  and, from the reduce-scatter on, only its slice of the gradient: the full 16-bit
          .grad is released before the optimizer step.

One optimizer step, after the K micro-steps (which send nothing: there is no DDP wrapper,
so nothing to switch off; the micro-steps' gradients add up in .grad as in one process):
  1. one reduce-scatter sums the gradients over the ranks, each rank receiving its slice;
  2. the slice is unscaled and checked, and clipped by the norm of *all* slices (squared slice
     norms summed over the ranks), so every rank skips or clips alike;
  3. precision.MasterWeightOptimizer steps the slice: AdamW on its FP32 master slice, the
     result rounded into the rank's slice of the 16-bit flat buffer;
  4. one all-gather fills every rank's flat buffer (the parameters are views of it).
A reduce-scatter and an all-gather move what DDP's all-reduce moves (2 x the gradient bytes
for a ring, ZeRO paper sec. 7.2.1). Gradients are divided by N before they are summed, as
DDP does, so with two ranks the sum is DDP's to the bit (x/2 is exact, a + b = b + a).

What this does not do, and real ZeRO-2 does: reduce-scatter gradient buckets while backward
still runs. Here the reduce-scatter waits for the last backward to end, so the full 16-bit
gradient is alive at the end of backward on every rank, as in DDP; what ZeRO-2 saves is the
optimizer step's: the FP32 gradient the master slice reads is 1/N of it (memory_ledger.py).
"""
import torch
import torch.distributed as dist

import precision

STAGES = {"zero1": 1, "zero2": 2}  # the SHARD values this file implements (fsdp: fsdp.py)


class Shards:
    """Where each parameter lies in one flat buffer of P + padding elements, padded so the N
    ranks get equal slices of S elements; rank r owns [r*S, (r+1)*S). The padding (fewer than
    N elements, at the end of the last slice) belongs to no parameter: it has no master, no m, v."""

    def __init__(self, sizes, world, rank):
        self.sizes = list(sizes)  # each parameter's element count, in the model's order
        total = sum(self.sizes)
        self.padding = -total % world
        self.size = (total + self.padding) // world  # S
        self.start = rank * self.size

    def pieces(self):
        """[(parameter index, first element in the parameter, first element in my slice, length)]
        for every parameter that overlaps my slice, in flat order (they tile the slice)."""
        out, offset = [], 0
        for i, n in enumerate(self.sizes):
            lo, hi = max(offset, self.start), min(offset + n, self.start + self.size)
            if lo < hi:
                out.append((i, lo - offset, lo - self.start, hi - lo))
            offset += n
        return out


def flatten(params, padding):
    """One buffer holding every parameter end to end (and `padding` zeros); each parameter
    becomes a view of it, so one all-gather into the buffer updates them all."""
    flat = torch.zeros(sum(p.numel() for p in params) + padding, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.detach().reshape(-1))
        # .data: the Parameter object stays (the modules, the optimizer and the tied head hold it),
        # only its storage moves into the flat buffer
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    return flat


class SliceOptimizer(precision.MasterWeightOptimizer):
    """MasterWeightOptimizer on one rank's slice: its norm is the norm over all ranks' slices."""

    def global_norm(self, grads):
        squares = precision.squared_sum(grads)  # FP64: the same FP32 norm as DDP's whole gradient gives
        dist.all_reduce(squares)
        return squares.sqrt().float()


class ShardedOptimizer:
    """ZeRO-1 (stage 1) or ZeRO-2 (stage 2) over the default process group; the same methods
    as precision.MasterWeightOptimizer, whose step it runs on this rank's slice.

    model_params: the whole model's parameters (views of `flat`, whole on every rank);
    master_params and adamw: this rank's slice's (FP32 pieces, one per parameter it overlaps)."""

    def __init__(self, params, master_weights, stage, lr, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=1.0):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}")
        self.stage, self.master_weights = stage, master_weights
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.model_params = [p for p in params if p.requires_grad]
        self.shards = Shards([p.numel() for p in self.model_params], self.world, self.rank)
        self.flat = flatten(self.model_params, self.shards.padding)
        self.my_slice = self.flat[self.shards.start:self.shards.start + self.shards.size]
        self.pieces = self.shards.pieces()
        # one leaf view of my slice per parameter it overlaps: the slice optimizer's "model parameters"
        views = [self.my_slice[at:at + n].detach().requires_grad_(True) for _, _, at, n in self.pieces]
        self.slice = SliceOptimizer(views, master_weights, lr, weight_decay, betas, grad_clip,
                                    decay=[self.model_params[i].dim() >= 2 for i, *_ in self.pieces])
        self.master_params, self.adamw = self.slice.master_params, self.slice.adamw
        self.grad_slice = None  # this step's reduced gradient slice, until zero_grad (the ledger reads it)

    def set_lr(self, lr):
        self.slice.set_lr(lr)

    def step(self, grads=None, loss_scale=1.0):
        """Reduce-scatter, step my slice, all-gather. grads: accumulate.py's FP32 sums, or None:
        the parameters' .grad (ZeRO-2 releases them once they are in the flat copy). Returns
        (stepped, grad_norm), the same on every rank."""
        own = grads is None
        grads = [p.grad for p in self.model_params] if own else grads
        parts = [g.reshape(-1) if g is not None else torch.zeros(p.numel(), dtype=self.flat.dtype,
                                                                    device=self.flat.device)
                 for g, p in zip(grads, self.model_params)]
        flat_grad = torch.cat(parts + [parts[0].new_zeros(self.shards.padding)])
        del parts, grads
        if own and self.stage == 2:
            for p in self.model_params:
                p.grad = None  # ZeRO-2: no rank keeps the whole gradient past this point
        flat_grad /= self.world  # before the sum, as DDP divides: the mean over ranks
        self.grad_slice = flat_grad.new_empty(self.shards.size)
        dist.reduce_scatter_tensor(self.grad_slice, flat_grad)
        del flat_grad
        piece_grads = [self.grad_slice[at:at + n] for _, _, at, n in self.pieces]
        stepped, grad_norm = self.slice.step(piece_grads, loss_scale)
        if stepped:  # every rank decided alike (the norm is global): all of them gather, or none
            dist.all_gather_into_tensor(self.flat, self.my_slice)
        return stepped, grad_norm

    def zero_grad(self):
        self.slice.zero_grad()
        self.grad_slice = None
        for p in self.model_params:
            p.grad = None

    def state_tensors(self):
        return self.slice.state_tensors()

    # ------------------------------------------------------------ snapshots: in DDP's format

    def _order(self):
        """The model parameters' indices in MasterWeightOptimizer's AdamW order: matrices first."""
        return _decayed_first([p.dim() >= 2 for p in self.model_params])

    def _slice_order(self):
        """Positions in self.pieces in the slice AdamW's order (the same rule, per piece)."""
        return _decayed_first([self.model_params[i].dim() >= 2 for i, *_ in self.pieces])

    def _gather_flat(self, pieces):
        """My slice's FP32 pieces end to end (the padding as zeros), gathered on rank 0 into the
        whole flat buffer, split per parameter; None on the other ranks. A collective."""
        mine = torch.zeros(self.shards.size, dtype=torch.float32, device=self.flat.device)
        for (_, _, at, n), t in zip(self.pieces, pieces):
            mine[at:at + n] = t.detach().reshape(-1)
        full = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(mine, full, dst=0)
        if full is None:
            return None
        whole = torch.cat(full)[:sum(self.shards.sizes)]  # the padding is no parameter's
        return [t.view_as(p).clone().cpu() for t, p in zip(whole.split(self.shards.sizes), self.model_params)]

    def state_dict(self):
        """The state MasterWeightOptimizer.state_dict() of one DDP rank would give (every rank
        calls it; rank 0 gets it, the others None), so a ZeRO snapshot is an ordinary snapshot:
        it resumes under DDP, ZeRO-1 or ZeRO-2 alike."""
        masters = self._gather_flat(self.master_params)  # the slice's FP32 master, or its FP32 parameters
        state = self.adamw.state
        moments = {}
        for name in ("exp_avg", "exp_avg_sq"):
            by_piece = [state[m][name] if m in state else torch.zeros(n, device=self.flat.device)
                        for m, (_, _, _, n) in zip(self.master_params, self.pieces)]
            moments[name] = self._gather_flat(by_piece)
        steps = [state[m]["step"] for m in self.master_params if m in state]
        if self.rank != 0:
            return None
        adamw = dict(state={}, param_groups=[])
        order = self._order()
        if steps:  # AdamW made its states at its first step: before it there are none to keep
            adamw["state"] = {k: dict(step=steps[0].clone(), exp_avg=moments["exp_avg"][i],
                                      exp_avg_sq=moments["exp_avg_sq"][i]) for k, i in enumerate(order)}
        n_decay = sum(p.dim() >= 2 for p in self.model_params)
        for group, ids in zip(self.adamw.param_groups, (range(n_decay), range(n_decay, len(order)))):
            adamw["param_groups"].append({**{k: v for k, v in group.items() if k != "params"}, "params": list(ids)})
        return dict(master_params=masters if self.master_weights else [], adamw=adamw)

    def whole_groups(self):
        """The AdamW groups a whole-model optimizer would have (for the snapshot's shape checks)."""
        order = [self.model_params[i] for i in self._order()]
        n_decay = sum(p.dim() >= 2 for p in self.model_params)
        return [dict(params=order[:n_decay]), dict(params=order[n_decay:])]

    def load_state_dict(self, state):
        """Take my slice of a whole-model optimizer state (state_dict's format, DDP's too)."""
        pieces = self.pieces
        with torch.no_grad():
            for m, (i, first, _, n) in zip(self.master_params if self.master_weights else [], pieces):
                m.copy_(state["master_params"][i].reshape(-1)[first:first + n])
        saved = state["adamw"]
        position = {i: k for k, i in enumerate(self._order())}  # parameter index -> saved state key
        mine = {}
        for k, piece in enumerate(self._slice_order()):
            i, first, _, n = pieces[piece]
            entry = saved["state"].get(position[i])
            if entry is not None:
                mine[k] = {name: (v.reshape(-1)[first:first + n].clone() if name != "step" else v.clone())
                           for name, v in entry.items()}
        # the saved groups' hyperparameters, with the ids of my slice's AdamW
        groups = [dict(g, params=own["params"]) for g, own in
                  zip(saved["param_groups"], self.adamw.state_dict()["param_groups"])]
        self.adamw.load_state_dict(dict(state=mine, param_groups=groups))


def _decayed_first(decayed):
    """Indices of `decayed` with the True ones first: the order MasterWeightOptimizer's two AdamW
    groups (weight decay, none) number their parameters in."""
    return [k for k, d in enumerate(decayed) if d] + [k for k, d in enumerate(decayed) if not d]
