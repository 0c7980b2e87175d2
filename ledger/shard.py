"""What one rank holds under SHARD (zero.py, fsdp.py), as formulas: what `make ledger`'s
sharded rows, measured in two gloo processes (tools/ledger_ranks.py), are held against.

Chapter section 4. Read zero.py first. ledger/parallel.py's zero_components is the textbook's
division by N for any N; this is the exact figure for the runs this project makes: the flat
buffer's padding, AdamW's per-tensor step counts (one per parameter piece of a slice) and the
gradients the step holds (ZeRO-1 keeps the whole .grad beside its reduced slice, ZeRO-2 only
the slice), per rank.

Components (bytes), as ledger/measure.measure counts them, after a steady-state step:
  parameters      the parameters' storages (ZeRO: the padded flat buffer, whole on every rank;
                  FSDP: this rank's FP32 shards, which are the master weights too)
  master          the FP32 master copy (a slice of it under ZeRO; 0 for fp32 and FSDP: the
                  parameters are it)
  optimizer       AdamW's m and v, FP32, plus its FP32 step count per tensor (CPU only)
  step_gradients  the gradients alive while AdamW steps: .grad, the reduced slice, the FP32 sums
"""
import math

import torch

import fp8
import memory_ledger as ml
import precision
import zero
from model import GPT


def meta_model(cfg):
    """model.GPT as cfg's run builds it (its precision's Linears), on the meta device: no memory."""
    with torch.device("meta"):
        return GPT(cfg, linear_factory=precision.recipe(cfg).linear_factory())


def param_shapes(cfg, blocks_only=False):
    """Each parameter's shape in model.GPT's order (the model itself, not the description: what the
    ranks hold is the model's); the order decides which parameters a ZeRO slice cuts through, the
    first dimension how FSDP cuts. blocks_only: the blocks' parameters (fsdp.py shards each block
    on its own, the rest as the root)."""
    model = meta_model(cfg)
    return [tuple(p.shape) for p in (model.h.parameters() if blocks_only else model.parameters())]


def fsdp_padded(shapes, world):
    """Elements of one rank's FSDP shards of `shapes`: ceil(d0/N) rows of each, padding included."""
    return sum(-(-s[0] // world) * (math.prod(s) // s[0]) for s in shapes)


def step_collectives(cfg, shard, world):
    """[(what, elements)]: the collectives one step issues, in the ZeRO paper's terms (ledger/comm.py:
    an all-reduce counts twice), per rank; Psi = P parameters.
      DDP     all-reduce of the gradient: 2 Psi
      ZeRO    reduce-scatter of the gradient + all-gather of the weights, both padded flat
              buffers: 2 (Psi + padding); the all-reduce of one FP64 squared norm: 2
      FSDP    each block all-gathered in forward and again in backward, the root (embeddings, the
              tied head, ln_f) once: FSDP2 keeps the root gathered from forward to backward; every
              gradient reduce-scattered; padded per parameter: 2 Psi_all + Psi_blocks; the norm: 2
    The paper's 3 Psi for ZeRO-3 is the FSDP line with every parameter in a block. What a precision
    adds, whatever the sharding: FP8's amax all-reduce (fp8.fold_amax: the max over ranks of each FP8
    Linear's step_amax, 3 per layer). (The ledger's step averages the loss per micro-step, as
    accumulate.accumulation_step does by default: no token count is all-reduced.)"""
    P = sum(math.prod(s) for s in param_shapes(cfg))
    if shard == "none":
        out = [("the gradient's all-reduce", 2 * P)]
    elif shard in zero.STAGES:
        padded = P + zero.Shards([P], world, 0).padding
        out = [("the gradient's reduce-scatter and the weights' all-gather", 2 * padded),
               ("the squared norm's all-reduce", 2)]
    elif shard == "fsdp":
        whole, blocks = (world * fsdp_padded(param_shapes(cfg, only), world) for only in (False, True))
        out = [("the weights' all-gathers and the gradient's reduce-scatter", 2 * whole + blocks),
               ("the squared norm's all-reduce", 2)]
    else:
        raise ValueError(f"no volume formula for shard={shard}")
    if world > 1:
        amax = sum(m.step_amax.numel() for m in fp8.layers(meta_model(cfg)) if isinstance(m, fp8.FP8Linear))
        out += [("FP8's amax all-reduce", 2 * amax)] if amax else []
    return out


def step_elements(cfg, shard, world):
    """Elements a step's collectives move per rank: step_collectives' sum."""
    return sum(n for _, n in step_collectives(cfg, shard, world))


def rank_states(cfg, shard, world, rank):
    """{component: bytes} for rank `rank` of `world` under SHARD=shard (none: DDP's whole copy)."""
    rec = precision.recipe(cfg)
    e, master = rec.element_bytes, rec.master_weights
    shapes = param_shapes(cfg)
    sizes = [math.prod(s) for s in shapes]
    P = sum(sizes)
    states = lambda elements, tensors: ml.optimizer_bytes(cfg, elements, tensors)  # noqa: E731  (the spec's)
    sums = cfg.fp32_grad_accum and master  # FP32 sums: .grad is added into them and released each micro-step
    whole_grad = 4 * P if sums else e * P  # what the micro-steps leave behind on every rank
    if shard == "none":
        return dict(parameters=e * P, master=4 * P if master else 0, optimizer=states(P, len(sizes)),
                    step_gradients=whole_grad, padding=0)
    if shard in zero.STAGES:
        shards = zero.Shards(sizes, world, rank)
        pieces = shards.pieces()
        real = sum(n for *_, n in pieces)  # elements of parameters in my slice (the padding is none's)
        keeps_whole = zero.STAGES[shard] == 1 or sums  # ZeRO-1's .grad, or the FP32 sums: both whole
        return dict(parameters=e * (P + shards.padding), master=4 * real if master else 0,
                    optimizer=states(real, len(pieces)),
                    step_gradients=(4 if sums else e) * shards.size + (whole_grad if keeps_whole else 0),
                    padding=shards.padding)
    if shard == "fsdp":
        # FSDP2 cuts each parameter along its first dimension into N pieces of ceil(d0/N) rows and
        # keeps this rank's piece in a buffer of that many rows, padded on the last ranks
        # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): the parameter and its gradient (FP32,
        # the reduce dtype) take the padded size; AdamW's m and v, made like the local shard, not
        rows = [-(-s[0] // world) for s in shapes]
        rest = [n // s[0] for n, s in zip(sizes, shapes)]
        padded = fsdp_padded(shapes, world)
        mine = sum(max(0, min(r, s[0] - rank * r)) * k for r, s, k in zip(rows, shapes, rest))
        return dict(parameters=4 * padded, master=0, optimizer=states(mine, len(shapes)),
                    step_gradients=4 * padded, padding=world * padded - P)
    raise ValueError(f"no per-rank formula for shard={shard}")
