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

Then what a step sends (step_elements, step_bytes), and one rank's step as ledger/step.py walks it
(rank_static, optimizer_walk, zero_step): what ledger/plan.py's peaks are made of.
"""
import functools
import math

import torch

import fp8
import memory_ledger as ml
import precision
import zero
from config import Config
from ledger import step
import model
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
    return list(_param_shapes(tuple(getattr(cfg, k) for k in SHAPE_KEYS), blocks_only, _model_code()))


SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")


def _model_code():
    """What model.py's classes are now (a learner's edit, the tests' swaps): the caches below key on it."""
    return tuple(id(getattr(model, name)) for name in ("GPT", "Block", "CausalSelfAttention", "MLP", "nn")) + \
        (id(model.GPT.__init__), id(model.GPT.forward))


@functools.lru_cache(maxsize=16)  # seconds for a 70B shape, asked for by every rank and shard of a plan
def _param_shapes(shape, blocks_only, code):
    with torch.device("meta"):
        gpt = GPT(Config(**dict(zip(SHAPE_KEYS, shape))))
    return tuple(tuple(p.shape) for p in (gpt.h.parameters() if blocks_only else gpt.parameters()))


def param_sizes(cfg):
    """Each parameter's element count, in model.GPT's order (a tuple: the caches below key on it)."""
    return tuple(math.prod(s) for s in param_shapes(cfg))


@functools.lru_cache(maxsize=1024)  # a plan over N ranks asks for every rank's, for every configuration
def slice_pieces(sizes, world, rank):
    """zero.Shards(sizes, world, rank).pieces(), kept."""
    return tuple(zero.Shards(sizes, world, rank).pieces())


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
    sizes = param_sizes(cfg)
    P = sum(sizes)
    states = lambda elements, tensors: ml.optimizer_bytes(cfg, elements, tensors)  # noqa: E731  (the spec's)
    sums = cfg.fp32_grad_accum and master  # FP32 sums: .grad is added into them and released each micro-step
    whole_grad = 4 * P if sums else e * P  # what the micro-steps leave behind on every rank
    if shard == "none":
        return dict(parameters=e * P, master=4 * P if master else 0, optimizer=states(P, len(sizes)),
                    step_gradients=whole_grad, padding=0)
    if shard in zero.STAGES:
        shards = zero.Shards(sizes, world, rank)
        pieces = slice_pieces(sizes, world, rank)
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


def step_bytes(cfg, shard, world, micro_steps=1):
    """Bytes a step's collectives move per rank, the paper's volume (ledger/comm.py: an all-reduce
    counts twice), for step_elements' collectives in their dtypes: DDP all-reduces the gradient in its
    dtype (the FP32 sums with fp32_grad_accum); ZeRO reduce-scatters that and all-gathers the
    parameters; FSDP all-gathers in the parameters' 16-bit dtype and reduce-scatters in FP32, and
    gathers again every micro-step; each ZeRO and FSDP step all-reduces one FP64 squared norm."""
    if world == 1:
        return 0
    rec = precision.recipe(cfg)
    e = rec.element_bytes
    grad_e = 4 if (cfg.fp32_grad_accum and rec.master_weights) else e
    P = sum(math.prod(s) for s in param_shapes(cfg))
    if shard == "none":
        return 2 * P * grad_e
    if shard in zero.STAGES:
        return (P + zero.Shards([P], world, 0).padding) * (grad_e + e) + 2 * 8
    whole, blocks = (world * fsdp_padded(param_shapes(cfg, only), world) for only in (False, True))
    return micro_steps * (whole + blocks) * e + whole * 4 + 2 * 8


# ---------------------------------------------------------------- one rank's step, walked

def rank_static(cfg, shard, world, rank):
    """Bytes rank `rank` holds all step long (the walk's static): its states as rank_states counts
    them, the buffers, the batch, the FP32 sums (whole on every rank); under DDP (world > 1) its
    gradient buckets too, a copy of every gradient that the reducer makes when DDP wraps the model
    (torch/csrc/distributed/c10d/reducer.cpp, initialize_buckets). fsdp: the textbook ZeRO-3
    estimate (memory_ledger.static_bytes(cfg, world)), not FSDP2's own buffers."""
    if shard == "fsdp":
        return ml.static_bytes(cfg, world)
    rec = precision.recipe(cfg)
    if shard == "none":
        return ml.static_bytes(cfg) + (rec.element_bytes * ml.param_count(cfg)[0] if world > 1 else 0)
    st = rank_states(cfg, shard, world, rank)
    sums = 4 * ml.param_count(cfg)[0] if (cfg.fp32_grad_accum and rec.master_weights) else 0
    return st["parameters"] + st["master"] + st["optimizer"] + sums + ml.state_bytes(cfg)["buffers"] + \
        ml.input_bytes(cfg)


def optimizer_walk(cfg, shard, world, rank):
    """callable(g): rank `rank`'s optimizer step for ledger/step.py's walk. DDP: the FP32 sums
    all-reduced through one flat copy first (accumulate.all_reduce_mean), then every rank's whole
    step; ZeRO-1/2: zero_step; fsdp: the ZeRO-3 estimate's (gradients / world)."""
    rec, (P, _), matrices = precision.recipe(cfg), ml.param_count(cfg), ml.matrix_param_count(cfg)
    sums, master = cfg.fp32_grad_accum and rec.master_weights, 4 * P if rec.master_weights else 0
    if shard in zero.STAGES:
        shapes, sizes = param_shapes(cfg), param_sizes(cfg)
        shards = zero.Shards(sizes, world, rank)
        groups = [sum(p.length for p in slice_pieces(sizes, world, rank) if (len(shapes[p.index]) >= 2) == decays)
                  for decays in (True, False)]  # AdamW's two groups: the matrices decay
        temporaries = precision.OPTIMIZERS[cfg.optimizer].step_temporaries(groups, [cfg.weight_decay, 0.0])
        return lambda g: zero_step(g, 4 if sums else rec.element_bytes, shards, zero.STAGES[shard], groups,
                                   temporaries, rec.master_weights and not sums, gloo=cfg.device != "cuda")

    def whole(g):
        if sums and shard == "none" and world > 1:
            flat = g.new("DDP: the FP32 sums all-reduced in one flat copy", "flat sums", 4 * P)
            del flat
        step.optimizer_step(g, ml.step_temporaries(cfg), master, sums, world if shard == "fsdp" else 1)
    return whole


def zero_step(g, e, shards, stage, groups, temporaries, fp32_copies, gloo=False):
    """zero.ShardedOptimizer.step as the walk runs it: the kept FP8 copies released; every gradient
    (e bytes each) and the padding's zeros into one flat buffer; ZeRO-2 lets .grad go; my slice of
    the reduce-scatter (gloo, on CPU, all-reduces a copy of the whole buffer and copies my slice
    out; NCCL allocates nothing through PyTorch); the flat buffer goes; the FP32 copies of my
    slice's pieces (16-bit precisions); the optimizer's temporaries on my slice (the spec's: AdamW's sqrt(v)
    per group); zero_grad frees the rest."""
    if g.kept:
        g.mark("FP8 weight copies released")
        g.kept.clear()
    padding = g.new("ZeRO: the padding's zeros", "padding", e * shards.padding)
    flat = g.new("ZeRO: every gradient in one flat buffer", "flat gradient", e * (sum(shards.sizes) + shards.padding))
    del padding
    if stage == 2:
        g.grads.clear()  # no rank keeps the whole gradient past this point (with FP32 sums there is none)
    mine = g.new("ZeRO: my slice of the reduce-scatter", "gradient slice", e * shards.size)
    if gloo:
        copy = g.new("ZeRO: gloo's reduce-scatter, a copy of the flat buffer", "gloo buffer", flat.nbytes)
        del copy
    del flat
    copies = g.new("ZeRO: my slice's gradients in FP32", "master grads", 4 * sum(groups)) if fp32_copies else None
    for what, nbytes in temporaries:
        temporary = g.new(f"ZeRO: {what} of my slice", what, nbytes)
        del temporary
    g.grads.clear()
    del copies, mine
