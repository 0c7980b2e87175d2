"""ZeRO-1 and ZeRO-2 by hand: the FP32 master copy and AdamW's states split over the ranks.

Chapter section 4 ("ZeRO/FSDP split states"). Read first: `Shards` (every parameter end to end
in one flat buffer, cut in N equal slices), then `ShardedOptimizer.step`. FSDP (ZeRO-3) is fsdp.py.
  ZeRO-1  each rank keeps the FP32 master, m and v of its 1/N slice only (12 of DDP's 16 bytes / N);
  ZeRO-2  and, from the reduce-scatter on, only its slice of the gradient.
One optimizer step, after the K micro-steps (which send nothing: there is no DDP wrapper):
  1. one reduce-scatter sums the gradients over the ranks, each rank receiving its slice;
  2. the norm of *all* slices (squares summed over the ranks) decides skip and clip on every rank;
  3. precision.MasterWeightOptimizer steps the slice: AdamW on its FP32 master, copied down;
  4. one all-gather fills every rank's flat buffer (the parameters are views of it).
Why it equals DDP bit for bit, what it sends, and what real ZeRO-2 does that this does not: docs/zero.md.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist

import precision
from guards import sharded_snapshot

STAGES = {"zero1": 1, "zero2": 2}  # the SHARD values this file implements (fsdp: fsdp.py)


class Piece(NamedTuple):
    """The part of one parameter that lies in my slice."""
    index: int  # which parameter, in the model's order
    start_in_param: int
    start_in_slice: int
    length: int

    def of_slice(self, flat_slice):
        return flat_slice[self.start_in_slice:self.start_in_slice + self.length]


class Shards:
    """Where each parameter lies in one flat buffer of P + padding elements, padded so N ranks get equal
    slices of S; rank r owns [r*S, (r+1)*S). The padding (< N elements, ending the last slice) is no parameter's."""

    def __init__(self, sizes, world, rank):
        self.sizes = list(sizes)  # each parameter's element count, in the model's order
        self.padding = -sum(self.sizes) % world
        self.size = (sum(self.sizes) + self.padding) // world  # S
        self.start = rank * self.size

    def pieces(self):
        """A Piece for every parameter that overlaps my slice, in flat order (they tile the slice)."""
        out, offset = [], 0
        for i, n in enumerate(self.sizes):
            lo, hi = max(offset, self.start), min(offset + n, self.start + self.size)
            if lo < hi:
                out.append(Piece(i, lo - offset, lo - self.start, hi - lo))
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
        # .data: the modules, the optimizer and the tied head keep the parameter, its storage moves
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    return flat


def collective(*names):
    """The first of `names` dist has, read at each call (comm.Count wraps it): torch 2.13 deprecates *_tensor."""
    return next(getattr(dist, name) for name in names if hasattr(dist, name))


def norm_over_ranks(local_grads):
    """The FP32 norm of the whole gradient from each rank's part of it: squares summed over the ranks."""
    squares = precision.squared_sum(local_grads)  # fp64: the same fp32 norm as ddp's whole gradient gives
    dist.all_reduce(squares)
    return squares.sqrt().float()


class SliceOptimizer(precision.MasterWeightOptimizer):
    """MasterWeightOptimizer on one rank's slice, one flat piece per parameter it overlaps."""

    def __init__(self, views, piece_decays, *args, **kwargs):
        self.piece_decays = piece_decays
        super().__init__(views, *args, **kwargs)

    def decays(self, views):
        return self.piece_decays  # a flat piece has lost its shape: it decays as its parameter does

    def global_norm(self, grads):
        return norm_over_ranks(grads)  # every rank skips or clips alike


class ShardedOptimizer:
    """ZeRO-1 or ZeRO-2 (stage): precision.MasterWeightOptimizer's methods, its step run on my slice. model_params:
    the whole model's (views of `flat`); master_params, torch_optimizer: my slice's (a piece per parameter)."""

    def __init__(self, params, master_weights, spec, stage, lr, weight_decay=0.1, grad_clip=1.0):
        self.stage, self.master_weights, self.spec = stage, master_weights, spec
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.model_params = [p for p in params if p.requires_grad]
        self.shards = Shards([p.numel() for p in self.model_params], self.world, self.rank)
        self.flat = flatten(self.model_params, self.shards.padding)
        self.my_slice = self.flat[self.shards.start:self.shards.start + self.shards.size]
        self.pieces = self.shards.pieces()
        # one leaf view of my slice per parameter it overlaps: the slice optimizer's "model parameters"
        views = [piece.of_slice(self.my_slice).detach().requires_grad_(True) for piece in self.pieces]
        decays = precision.MasterWeightOptimizer.decays(self.model_params)
        self.slice = SliceOptimizer(views, [decays[piece.index] for piece in self.pieces], master_weights, spec, lr,
                                    weight_decay, grad_clip)
        self.master_params, self.torch_optimizer = self.slice.master_params, self.slice.torch_optimizer
        self.grad_slice = None  # this step's reduced gradient slice, until zero_grad (the ledger reads it)

    def set_lr(self, lr):
        self.slice.set_lr(lr)

    def step(self, grads=None, scaler=None):
        """Reduce-scatter, step my slice, all-gather. grads: accumulate.py's FP32 sums, or None: the parameters'
        .grad (ZeRO-2 releases them once in the flat copy). Returns (stepped, grad_norm), alike on every rank."""
        own = grads is None
        grads = [p.grad for p in self.model_params] if own else grads
        parts = [g.reshape(-1) if g is not None else p.new_zeros(p.numel()) for g, p in zip(grads, self.model_params)]
        flat_grad = torch.cat(parts + [parts[0].new_zeros(self.shards.padding)])
        del parts, grads
        if own and self.stage == 2:
            for p in self.model_params:
                p.grad = None  # zero-2: no rank keeps the whole gradient past this point
        flat_grad /= self.world  # before the sum, as ddp divides: the mean over ranks
        self.grad_slice = flat_grad.new_empty(self.shards.size)
        collective("reduce_scatter_single", "reduce_scatter_tensor")(self.grad_slice, flat_grad)
        del flat_grad
        stepped, grad_norm = self.slice.step([piece.of_slice(self.grad_slice) for piece in self.pieces], scaler)
        if stepped:  # the norm is global: every rank gathers, or none
            collective("all_gather_single", "all_gather_into_tensor")(self.flat, self.my_slice)
        return stepped, grad_norm

    def zero_grad(self):
        self.slice.zero_grad()
        self.grad_slice = None
        for p in self.model_params:
            p.grad = None

    def state_tensors(self):
        return self.slice.state_tensors()

    def state_dict(self):
        return sharded_snapshot.gather_slice(self)  # ddp's format, on rank 0: a collective

    def load_state_dict(self, state):
        sharded_snapshot.cut_slice(self, state)


def states_line(cfg, model, parts, world_size):
    """Under SHARD, after the first step: what each rank holds of the states, measured (the bytes of its own
    tensors: a DTensor's local shard), beside what every DDP rank holds (16 bytes a parameter in BF16: ZeRO's
    Table 1). A collective (every rank calls it); rank 0's return is the line, the others' None."""
    opt, prec = parts.optimizer, parts.precision
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]
    mine = [sum(t.numel() * t.element_size() for t in ts) for ts in
            (local, opt.master_params if opt.master_weights and opt.master_params is not opt.model_params else [],
             opt.state_tensors())]
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    P = sum(p.numel() for p in model.parameters())  # (a DTensor's numel is the whole parameter's)
    ddp = [P * prec.element_bytes, P * 4 * prec.master_weights, P * 4 * len(opt.spec.per_element)]
    show = lambda p, m, o: f"parameters {p / 2**20:.2f}, master {m / 2**20:.2f}, AdamW {o / 2**20:.2f}"  # noqa: E731
    ranks = "; ".join(f"rank {r}: {show(*figures)}" for r, figures in enumerate(every))
    return f"states per rank, MiB, shard={cfg.shard} over {world_size} ranks (measured): {ranks}; every DDP rank: " \
           f"{show(*ddp)}"
