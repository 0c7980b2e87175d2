"""The memory ledger: where every byte of a training step goes, as formulas.

Chapter section 4 ("The whole picture"): the four memory components (parameters, gradients,
optimizer states, activations) under the techniques of sections 1-3. Read first: the chapter's
closed forms just below (16 bytes per parameter, sbh(34 + 5as/h) per layer, 2sbh under full
recompute, L/k + k under sqrt, ZeRO's bytes per rank), then `block` (model.Block op by op: what
each op makes and what autograd keeps of it), then `state_bytes` and `activation_terms`.

The closed forms are the papers' arithmetic; the op-by-op description (`embeddings`, `block`,
`head`) is what makes the ledger exact: the parameter count, the saved tensors, the peak
(ledger/walk.py) and the parallel rows all derive from it. Change model.Block, change `block`
beside it; until then `make ledger` names what the description does not explain.

Letters: b micro-batch, s context, h width, a heads, L layers, V vocabulary, P parameters, e bytes
per element (4 fp32, 2 bf16/fp16/fp8). "activations": what autograd holds for backward once the
forward has finished; "peak": the most bytes alive in a steady-state step. More: docs/ledger.md.
"""
import functools
import math
from dataclasses import dataclass

import torch

import checkpoint
import precision
from ledger import step
from ledger.ops import NORM, Ops, Sizes  # noqa: F401  (NORM: the papers' rows read it)
from ledger.walk import Walk

COMPONENTS = ("parameters", "buffers", "gradients", "master", "optimizer", "fp8_kept", "activations", "inputs",
              "rng_states")


# ---------------------------------------------------------------- the chapter's closed forms, first

def bytes_per_param_closed(precision_name, moments=2):
    """(parameters, gradients, master, optimizer) bytes per parameter, with an optimizer keeping `moments`
    FP32 values per parameter (AdamW: m and v). FP32: 4 + 4 + 0 + 8; mixed precision: 2 + 2 + 4 + 8, the
    ZeRO paper's 2 + 2 + K with K = 12. Both are 16: mixed precision shrinks activations and time, not states."""
    if precision_name == "fp32":
        return 4, 4, 0, 4 * moments  # the parameters are the master copy
    return 2, 2, 4, 4 * moments  # 16-bit parameters and gradients; the FP32 master copy; FP32 moments


def layer_activations_closed(s, b, h, a, e=2, dropout=True, sdpa=False):
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, eq. 1): with e = 2 and
    dropout, sbh(34 + 5as/h); without dropout, sbh(32 + 2as/h); with a fused attention kernel (sdpa),
    which keeps no s x s tensor, 34sbh and 32sbh. Masks are 1 byte per element."""
    sbh, as2b = s * b * h, a * s * s * b
    kept = 16 * sbh * e  # the Linears' and norms' inputs, q, k, v, the GELU's input: 16sbh elements
    if not sdpa:
        kept += as2b * e  # the softmax output, which att @ V keeps
    if dropout:
        kept += 2 * sbh  # the 1-byte masks of the attention output's and the MLP's dropout
        if not sdpa:
            kept += as2b + as2b * e  # the softmax dropout's 1-byte mask and its output
    return kept


def full_recompute_layer_closed(s, b, h, e=2):
    """Bytes a layer keeps under full recompute: its input only, 2sbh at 16 bits."""
    return s * b * h * e


def sqrt_units_closed(n_layer, k):
    """Layers' worth of activations alive at sqrt recompute's peak: L/k kept unit inputs, plus the k
    blocks of the one unit being re-run. Smallest at k = sqrt(L), where it is 2 sqrt(L): O(sqrt(L))."""
    return math.ceil(n_layer / k) + k


def zero_bytes_per_rank(n_params, ranks, stage, precision_name="bf16"):
    """Bytes of model states per rank (ZeRO, Rajbhandari et al. 2020, Table 1): stage 0 (DDP) keeps all
    16 bytes per parameter; ZeRO-1 splits the master copy and AdamW's states over the N ranks, ZeRO-2
    the gradients too, ZeRO-3 (FSDP) the parameters too."""
    params, grads, master, adamw = (n * n_params for n in bytes_per_param_closed(precision_name))
    split = [master + adamw, grads, params][:stage]
    return params + grads + master + adamw - sum(split) + sum(split) / ranks


# ---------------------------------------------------------------- the model, op by op

def embeddings(g):
    """GPT.forward up to the blocks: drop(wte(idx) + wpe(pos)), pos = torch.arange(T)."""
    z = g.sizes
    pos = g.positions("positions (wpe)", z.s * 8)
    return g.dropout("drop", g.add("wte + wpe", g.embedding("wte", z.V), g.embedding("wpe", z.s, ids=pos)))


def block(g, x):
    """model.Block.forward. Change it with model.Block: everything the ledger says follows. Each
    submodule goes through g.module(path, ...), a recompute unit where the policy makes it one."""
    x = g.add("x + attn", x, g.module("attn", attention, g.module("ln_1", norm, x)))
    return g.add("x + mlp", x, g.module("mlp", mlp, g.module("ln_2", norm, x)))


def norm(g, x):
    """nn.LayerNorm, named by its module's path."""
    return g.layer_norm(g.path, x)


def attention(g, x):
    """CausalSelfAttention.forward: c_attn, the heads, the core, back to (B, T, C), c_proj, dropout.
    split: Megatron's TP."""
    z = g.sizes
    q, k, v = g.split_heads("attn.split", g.linear("attn.c_attn", x, 3 * z.h, split="column"))
    y = g.merge_heads("attn.merge", g.module("attn.core", core, q, k, v))
    return g.dropout("attn.resid_dropout", g.linear("attn.c_proj", y, z.h, split="row"))


def core(g, q, k, v):
    """AttentionCore.forward: softmax(QK^T / sqrt(d)) V, causal. The manual core keeps the
    (B, a, T, T) softmax, a*s^2*b elements: the chapter's s^2 term; sdpa keeps none."""
    z = g.sizes
    if z.attn == "sdpa":
        return g.sdpa("attn.sdpa", q, k, v)
    att = g.matmul("attn.QK^T", q, k, z.b * z.a * z.s * z.s * z.e, names=("q", "k"))
    att = g.pointwise("attn.scale", att, saves=None)  # * 1/sqrt(d)
    att = g.masked_fill("attn.masked_fill", att, "attn.core.future_mask", z.s * z.s)
    att = g.softmax("attn.softmax", att)
    att = g.dropout("attn.dropout", att)
    return g.matmul("attn.att@V", att, v, z.bsh * z.e, names=("attention weights", "v"))


def mlp(g, x):
    """MLP.forward: dropout(c_proj(gelu(c_fc(x))))."""
    z = g.sizes
    return g.dropout("mlp.dropout", g.linear("mlp.c_proj", g.gelu("mlp.gelu", g.linear("mlp.c_fc", x, 4 * z.h,
                                                                                        split="column")),
                                             z.h, split="row"))


def head(g, x):
    """GPT.forward after the blocks: ln_f, the tied output head x @ wte^T, the loss on FP32 logits
    (the logits go when forward returns: nothing in backward needs them)."""
    z = g.sizes
    x = g.layer_norm("ln_f", x)
    logits = g.tied_head("head", x, "wte.weight", z.V)
    return g.cross_entropy("loss", g.to_fp32("logits.float()", logits))


MODEL = step.Description(embeddings=embeddings, block=block, head=head)


# ---------------------------------------------------------------- what the description says

def sizes(cfg):
    """ledger/ops.Sizes for cfg: what the ops need to know of the run."""
    rec = precision.recipe(cfg)
    return Sizes(L=cfg.n_layer, b=cfg.batch_size, s=cfg.block_size, h=cfg.n_embd, a=cfg.n_head, V=cfg.vocab_size,
                 e=rec.element_bytes, attn=cfg.attn, bias=cfg.bias, drop=cfg.dropout > 0, cuda=cfg.device == "cuda",
                 loss_scaled=rec.loss_scaling != "none", fp8=rec.fp8.backend if rec.fp8 else None,
                 fp8_e5m2=rec.fp8 is not None and rec.fp8.grad == "e5m2",
                 fp8_history=rec.fp8.history if rec.fp8 else 16,
                 rerun_stops_early=checkpoint.rerun_stops_early(cfg, rec), dtype=str(rec.param_dtype)[len("torch."):])


def plan(cfg):
    """The recompute policy's units (checkpoint.py), as the walk runs them."""
    policy = checkpoint.policy(cfg)
    return step.Plan(cfg.n_layer, policy.block_units(cfg.n_layer), frozenset(policy.own_submodules(cfg.n_layer)))


def unit_paths(cfg, block_index):
    """The submodule paths of one block that the policy recomputes as units of their own, sorted."""
    return tuple(sorted(path for i, path in plan(cfg).submodule_units if i == block_index))


@dataclass(frozen=True)
class Term:
    """One saved tensor of the description (or several alike: `count`), after the forward.
    scope: a block's index, "embedding", "head" or "units" (a recompute unit's input); region:
    made inside a tensor-parallel region (split over TP's t); role: ops.NORM for what a norm keeps."""
    name: str
    nbytes: int
    scope: object
    region: bool
    role: str = None
    dtype: str = None  # torch's name for it: what ledger/explain.py matches a measured tensor by, with its module


@functools.lru_cache(maxsize=256)
def _census(z, paths):
    """Run embeddings, one block (its submodules at `paths` recompute units) and the head, forward only:
    (the saved Terms, what the ops declared, the bytes of a block's input)."""
    g = Ops(Walk(0), z)
    g.plan = step.Plan(1, [], frozenset((0, path) for path in paths))
    with g.within("", "embedding"):
        x = embeddings(g)
    block_input = x.nbytes
    with g.within("0.", 0):
        x = block(g, x)
    with g.within("", "head"):
        loss = head(g, x)
    del x
    terms = tuple(Term(e.term, e.nbytes, e.scope, e.region, e.role, e.dtype) for e in g.walk.live.values() if e.saved)
    del loss
    return terms, g.declared, block_input


def census(cfg, paths=()):
    return _census(sizes(cfg), tuple(paths))


def block_activation_terms(cfg, paths=()):
    """[Term] one block saves, its submodules at `paths` recomputed (unit_paths: as cfg's policy says)."""
    return [t for t in census(cfg, paths)[0] if t.scope == 0]


def outside_terms(cfg):
    """[Term] saved outside the blocks: the embeddings' and the head's."""
    return [t for t in census(cfg)[0] if t.scope in ("embedding", "head")]


def activation_terms(cfg):
    """[Term] for the whole model after its forward under cfg.ckpt, alike ones counted together:
    the blocks of each kind (which submodules are units: block_kinds) times their number, one input per
    block unit. One block is described per kind, the policy says how many of each."""
    p = plan(cfg)
    out, blocks = {}, {}
    for paths, n in block_kinds(cfg).items():
        for t in block_activation_terms(cfg, paths):
            count, total, _ = out.get(t.name, (0, 0, t))  # a name may hold two storages of a block
            out[t.name] = (count + n, total + n * t.nbytes, t)
            blocks.setdefault(t.name, {})[paths] = n
    terms = [Term(f"{name} (x{count} blocks)" if count == sum(blocks[name].values()) else
                  f"{name} (x{count} in {sum(blocks[name].values())} blocks)", total, "blocks", t.region, t.role)
             for name, (count, total, t) in out.items()]
    if p.units:
        terms.append(Term(f"unit inputs ({len(p.units)} x bsh)", len(p.units) * census(cfg)[2], "units", False))
    return terms + outside_terms(cfg)


def block_kinds(cfg):
    """{submodule unit paths: how many blocks} over the blocks outside block units: () for a plain
    block, ("attn.core",) for one whose core the selective policy recomputes."""
    p = plan(cfg)
    in_units = {i for unit in p.units for i in unit}
    paths = {}
    for i, path in p.submodule_units:
        paths.setdefault(i, []).append(path)
    kinds = {}
    for i in range(cfg.n_layer):
        if i not in in_units:
            kind = tuple(sorted(paths.get(i, ())))
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def activation_bytes(cfg):
    return sum(t.nbytes for t in activation_terms(cfg))


# ---------------------------------------------------------------- parameters, gradients, master, optimizer

def held(cfg, kind, scope):
    """[info] of what the description's ops hold of `kind` ("param", "buffer", "fp8 weight",
    "tied") in one scope: 0 (one block), "embedding" or "head"."""
    return [info for info in census(cfg)[1][kind].values() if info["scope"] == scope]


def held_count(cfg, kind, scope, keep=lambda info: True):
    return sum(info["numel"] for info in held(cfg, kind, scope) if keep(info))


block_held = functools.partial(held, scope=0)  # what one block holds


def _total(cfg, kind, keep=lambda info: True):
    """Over the model: L blocks' and the embeddings' and the head's."""
    return cfg.n_layer * held_count(cfg, kind, 0, keep) + held_count(cfg, kind, "embedding", keep) \
        + held_count(cfg, kind, "head", keep)


def param_count(cfg):
    """(P, number of parameter tensors) of model.GPT, from the description: the embeddings (wte
    V*h, also the output head: tied, counted once; wpe s*h), each block's norms and Linears, ln_f.
    The tests hold it to model.GPT built on the meta device."""
    tensors = cfg.n_layer * len(held(cfg, "param", 0)) + len(held(cfg, "param", "embedding")) \
        + len(held(cfg, "param", "head"))
    return _total(cfg, "param"), tensors


def block_param_count(cfg, keep=lambda info: True):
    return held_count(cfg, "param", 0, keep)


def matrix_param_count(cfg):
    """Parameters of the 2-D tensors (embeddings, Linear weights): AdamW's weight-decay group."""
    return _total(cfg, "param", lambda info: info.get("matrix"))


def split_param_count(cfg):
    """Parameters tensor parallelism splits over its ranks (the description's `split` ones)."""
    return _total(cfg, "param", lambda info: info.get("split"))


def state_bytes(cfg):
    """Bytes of the non-activation components (and the model's buffers) for cfg's precision: e*P
    parameters, e*P gradients (+4P FP32 sums with fp32_grad_accum), a 4P FP32 master copy (none for
    fp32), the optimizer's state (optimizer_bytes: AdamW's m and v 8P, + a 4-byte step count per tensor on
    the CPU); buffers (the causal masks, FP8's amax history and scales); FP8 weight copies
    (fp8_weight_copies). docs/ledger.md#states says each in full."""
    P, n_tensors = param_count(cfg)
    rec = precision.recipe(cfg)
    e, copies = rec.element_bytes, fp8_weight_copies(cfg)
    return dict(parameters=e * P,
                gradients=e * P + (4 * P if (cfg.fp32_grad_accum and rec.master_weights) else 0),
                master=4 * P if rec.master_weights else 0,
                optimizer=optimizer_bytes(cfg, P, n_tensors),
                buffers=_total(cfg, "buffer"), fp8_weights=copies["persistent"], fp8_kept=copies["kept"])


def optimizer_bytes(cfg, elements, tensors):
    """The optimizer's state for `elements` parameters in `tensors` tensors, by its spec (precision.OPTIMIZERS):
    FP32 per element (AdamW: m and v, 8 bytes), and its FP32 counts per tensor, which torch keeps on the CPU."""
    spec = precision.OPTIMIZERS[cfg.optimizer]
    return 4 * len(spec.per_element) * elements + (0 if cfg.device == "cuda" else 4 * len(spec.per_tensor) * tensors)


def fp8_weight_copies(cfg):
    """{persistent, kept, transient} bytes of FP8 weight copies beyond the 16-bit parameters. Native
    FP8 keeps each Linear's E4M3 weight (out*in bytes, + 16 for its scale and amax) from micro-step 1
    to the optimizer step (a twin with fp8_grad=e5m2), and quantizes with a 4*out*in FP32 product;
    Transformer Engine caches an E4M3 weight and its transpose across steps (docs/ledger.md#fp8)."""
    rec = precision.recipe(cfg)
    weights = [info["numel"] for info in block_held(cfg, "fp8 weight")]
    if rec.fp8 is None or rec.fp8.backend == "te":
        return dict(persistent=2 * cfg.n_layer * sum(weights) if rec.fp8 else 0, kept=0, transient=0)
    twins = 2 if rec.fp8.grad == "e5m2" else 1
    return dict(persistent=0, kept=cfg.n_layer * (twins * sum(weights) + 16 * len(weights)),
                transient=4 * max(weights))


def input_bytes(cfg):
    """The batch, token ids x and targets y: int64, b*s each."""
    return 2 * cfg.batch_size * cfg.block_size * 8


def rng_state_bytes(cfg):
    """Host bytes of the RNG states the recompute units keep (checkpoint.Unit.rng): one per unit, the
    CPU generator's state as torch sizes it, and on CUDA 16 bytes more (seed and Philox offset)."""
    p = plan(cfg)
    n = len(p.units) + len(p.submodule_units)
    return n * (torch.get_rng_state().numel() + (8 + 8 if cfg.device == "cuda" else 0))


def predicted(cfg):
    """{component: bytes} for the components ledger/measure.py counts."""
    st = state_bytes(cfg)
    return dict(parameters=st["parameters"], buffers=st["buffers"], gradients=st["gradients"], master=st["master"],
                optimizer=st["optimizer"], fp8_kept=st["fp8_kept"], activations=activation_bytes(cfg),
                inputs=input_bytes(cfg), rng_states=rng_state_bytes(cfg))


def components(cfg):
    """The chapter's four components, buffers apart (FSDP shards parameters, not buffers): the master copy
    in the optimizer's states, TE's FP8 weights in the parameters, native FP8's kept copies apart."""
    st = state_bytes(cfg)
    return dict(parameters=st["parameters"] + st["fp8_weights"], buffers=st["buffers"], gradients=st["gradients"],
                optimizer=st["master"] + st["optimizer"], fp8_kept=st["fp8_kept"], activations=activation_bytes(cfg))


# ---------------------------------------------------------------- the peak

def static_bytes(cfg, shard=1):
    """Bytes alive all step long (the walk's `static`): the states, the buffers, the batch.
    shard=N: ZeRO-3 over N ranks: every per-parameter state and gradient / N, plus one block's
    matrices gathered (and their gradient before the reduce-scatter); buffers, kept FP8 copies whole."""
    st, (P, _), e = state_bytes(cfg), param_count(cfg), precision.recipe(cfg).element_bytes
    fp32_sums = st["gradients"] - e * P  # the FP32 accumulation buffers, alive all step
    per_param = st["parameters"] + st["fp8_weights"] + st["master"] + st["optimizer"] + fp32_sums
    if shard > 1:
        per_param = per_param // shard + 2 * e * block_param_count(cfg, lambda info: info.get("matrix"))
    return per_param + st["buffers"] + input_bytes(cfg)


def peak_walk(cfg, shard=1, static=None, optimizer=None, micro_steps=1):
    """ledger/step.walk_step for cfg: the Walk over one steady-state step (static_bytes alive
    throughout). static, optimizer: one rank's under DDP or ZeRO (ledger/shard.py);
    micro_steps=2: a later micro-step walked too (gradient accumulation, K > 1)."""
    rec, (P, _) = precision.recipe(cfg), param_count(cfg)
    fp32_sums = state_bytes(cfg)["gradients"] > rec.element_bytes * P
    return step.walk_step(MODEL, sizes(cfg), plan(cfg), static_bytes(cfg, shard) if static is None else static,
                          step_temporaries(cfg), 4 * P if rec.master_weights else 0, fp32_sums, shard, optimizer,
                          micro_steps)


def step_temporaries(cfg):
    """[(what, bytes)] the optimizer's foreach step holds for a moment, by its spec (precision.OPTIMIZERS),
    over the two groups (weight decay on the matrices, none on the rest)."""
    P, matrices = param_count(cfg)[0], matrix_param_count(cfg)
    return precision.OPTIMIZERS[cfg.optimizer].step_temporaries([matrices, P - matrices], [cfg.weight_decay, 0.0])


def peak_estimate(cfg, shard=1):
    """(bytes, where, what is alive) at the highest point of a steady-state step, from the
    walk (the optimizer states exist already; .grad is None at the start)."""
    w = peak_walk(cfg, shard)
    alive = ", ".join(f"{k} {v:,}" for k, v in sorted(w.parts.items()))
    return w.peak, w.where, f"states, buffers and the batch {w.static:,}" + (f" + {alive}" if alive else "")
