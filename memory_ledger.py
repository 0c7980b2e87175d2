"""The memory ledger: where every byte of a training step goes, as formulas.

Chapter section 4 ("The whole picture of memory optimisation"): the four memory
components (parameters, gradients, optimizer states, activations) for this model, under
the techniques of sections 1-3. Read first: `block` (model.Block, op by op: what each op
makes and what autograd keeps of it), then `state_bytes` (parameters, gradients, FP32
master weights, AdamW states), then `activation_terms` and `peak_estimate`.

Every fact about the model is written once: model.py is the code, and `embeddings`,
`block` and `head` below describe it, line by line, in the ops of ledger/ops.py. The
parameter count, the saved tensors (per recompute policy, precision, attention core,
dropout), the peak (ledger/walk.py runs the description like PyTorch runs the code), the
TP/SP/PP rows and the what-if (ledger/parallel.py) all derive from that description. Change
model.Block, change `block` beside it, and `make ledger` and the tests are exact again;
where they are not, `make ledger` names the saved tensors the description does not
explain (ledger/explain.py). The literature's own formula (Korthikanti et al., in
ledger/papers.py) stays an independent reference.

Config in, bytes out. The letters: b micro-batch, s context (block_size), h width (n_embd),
a heads, L layers, V vocab, P parameter count, e bytes per element of parameters,
activations and gradients (4 fp32, 2 bf16/fp16/fp8). cfg.device "cuda" selects CUDA's
saved dtypes and kernels (ledger/ops.py: Sizes), anything else CPU's.
  "activations" = the bytes autograd holds for backward once the forward has finished
  (distinct storages saved for backward; parameter and buffer storages excluded: a saved
  view of a parameter or buffer, like the causal mask, costs nothing new). Under recompute
  that is only the units' inputs; the internals of one unit come back during backward and
  are counted in the *peak*, not in "activations".
  "inputs" = the batch: token ids and targets, int64, 2 x b*s*8 bytes. Autograd holds
  references to them (the embedding saves the ids, the loss the targets), but the caller
  made them before the forward and holds them past the step: the step's input, never in
  "activations" (MemTracker files them as inputs too).
  "rng_states" = host memory: the RNG state each recompute unit keeps (checkpoint.Unit)
  so that dropout draws the same masks when re-run. Not device memory, not in the peak.
  "peak" = the most bytes alive at any moment of a steady-state step (optimizer states
  already exist), and where in the step it happens.
"""
import functools
from dataclasses import dataclass, replace

import torch

import checkpoint
import precision
from ledger import step
from ledger.ops import NORM, Ops, Sizes  # noqa: F401  (NORM: the papers' rows read it)
from ledger.walk import Walk

COMPONENTS = ("parameters", "buffers", "gradients", "master", "optimizer", "fp8_kept", "activations", "inputs",
              "rng_states")


# ---------------------------------------------------------------- the model, op by op

def embeddings(g):
    """GPT.forward up to the blocks: drop(wte(idx) + wpe(pos)), pos = torch.arange(T)."""
    z = g.sizes
    pos = g.positions("positions (wpe)", z.s * 8)
    return g.dropout("drop", g.add("wte + wpe", g.embedding("wte", z.V), g.embedding("wpe", z.s, ids=pos)))


def block(g, x):
    """model.Block.forward. Change it with model.Block: everything the ledger says follows."""
    x = g.add("x + attn", x, attention(g, g.layer_norm("ln_1", x)))
    return g.add("x + mlp", x, mlp(g, g.layer_norm("ln_2", x)))


def attention(g, x):
    """CausalSelfAttention.forward: c_attn, the heads, the core (through its runner: selective
    recompute makes it a unit), back to (B, T, C), c_proj, dropout. split: Megatron's TP."""
    z = g.sizes
    q, k, v = g.split_heads("attn.split", g.linear("attn.c_attn", x, 3 * z.h, split="column"))
    y = g.merge_heads("attn.merge", g.core_runner(core, q, k, v))
    return g.dropout("attn.resid_dropout", g.linear("attn.c_proj", y, z.h, split="row"))


def core(g, q, k, v):
    """CausalSelfAttention.core: softmax(QK^T / sqrt(d)) V, causal. The manual core keeps the
    (B, a, T, T) softmax, a*s^2*b elements: the chapter's s^2 term; sdpa keeps none."""
    z = g.sizes
    if z.attn == "sdpa":
        return g.sdpa("attn.sdpa", q, k, v)
    att = g.matmul("attn.QK^T", q, k, z.b * z.a * z.s * z.s * z.e, names=("q", "k"))
    att = g.pointwise("attn.scale", att, saves=None)  # * 1/sqrt(d)
    att = g.masked_fill("attn.masked_fill", att, "attn.future_mask", z.s * z.s)
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
                 rerun_stops_early=checkpoint.rerun_stops_early(cfg, rec))


def plan(cfg):
    """The recompute policy's units (checkpoint.py), as the walk runs them."""
    policy = checkpoint.policy(cfg)
    return step.Plan(cfg.n_layer, policy.block_units(cfg.n_layer), policy.own_cores(cfg.n_layer))


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


@functools.lru_cache(maxsize=256)
def _census(z, core_unit):
    """Run embeddings, one block (its core a recompute unit or not) and the head, forward only:
    (the saved Terms, what the ops declared, the bytes of a block's input)."""
    g = Ops(Walk(0), z)
    g.plan = step.Plan(1, [], [0] if core_unit else [])
    with g.within("", "embedding"):
        x = embeddings(g)
    block_input = x.nbytes
    with g.within("0.", 0):
        x = block(g, x)
    with g.within("", "head"):
        loss = head(g, x)
    del x
    terms = tuple(Term(e.term, e.nbytes, e.scope, e.region, e.role) for e in g.walk.live.values() if e.saved)
    del loss
    return terms, g.declared, block_input


def census(cfg, core_unit=False):
    return _census(sizes(cfg), core_unit)


def block_activation_terms(cfg, core_unit=False):
    """[Term] one block saves (its core recomputed by checkpoint.recompute, or not)."""
    return [t for t in census(cfg, core_unit)[0] if t.scope == 0]


def outside_terms(cfg):
    """[Term] saved outside the blocks: the embeddings' and the head's."""
    return [t for t in census(cfg)[0] if t.scope in ("embedding", "head")]


def activation_terms(cfg):
    """[Term] for the whole model after its forward under cfg.ckpt, alike ones counted together:
    plain blocks' terms times their number, core-recomputed blocks' likewise, one input per
    block unit. O(1) in L: one block is described, the policy says how many of each kind."""
    p = plan(cfg)
    in_units = {i for unit in p.units for i in unit}
    n_core = len(p.core_units)  # Policy.own_cores: none inside a unit
    n_plain = cfg.n_layer - len(in_units) - n_core
    out = {}
    for n, core_unit in ((n_plain, False), (n_core, True)):
        for t in block_activation_terms(cfg, core_unit) if n else ():
            count, total = out.get((t.name, "blocks"), (0, 0))
            out[(t.name, "blocks")] = (count + n, total + n * t.nbytes, t)
    terms = [Term(f"{name} (x{count} blocks)", total, "blocks", t.region, t.role) for (name, _), (count, total, t)
             in out.items()]
    if p.units:
        terms.append(Term(f"unit inputs ({len(p.units)} x bsh)", len(p.units) * census(cfg)[2], "units", False))
    return terms + outside_terms(cfg)


def activation_bytes(cfg):
    return sum(t.nbytes for t in activation_terms(cfg))


# ---------------------------------------------------------------- parameters, gradients, master, optimizer

def held(cfg, kind, scope):
    """[info] of what the description's ops hold of `kind` ("param", "buffer", "fp8 weight",
    "tied") in one scope: 0 (one block), "embedding" or "head"."""
    return [info for info in census(cfg)[1][kind].values() if info["scope"] == scope]


def held_count(cfg, kind, scope, keep=lambda info: True):
    return sum(info["numel"] for info in held(cfg, kind, scope) if keep(info))


def block_held(cfg, kind):
    return held(cfg, kind, 0)


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
    """Bytes of the four non-activation components (and the model's buffers) for cfg's precision.

    parameters  e*P       the model in its own dtype (fp8 keeps bf16 parameters)
    gradients   e*P       .grad has the parameter's dtype (+4P FP32 buffers with fp32_grad_accum)
    master      4P        the FP32 copy AdamW updates; 0 for fp32 (the parameters are the master)
    optimizer   8P        AdamW's m and v, FP32, on the master copy; plus one FP32 `step` scalar
                          per tensor, which torch keeps on the CPU (so a CUDA ledger leaves it out)
    So fp32 is 4+4+0+8 = 16 bytes/param, and bf16/fp16 2+2+4+8 = 16 bytes/param: mixed
    precision does not shrink the states (ZeRO paper, sec. 3.1), it shrinks activations and time.
    fp8 is 2+2+4+8 as well (BF16 parameters, FP32 master), plus `fp8_weights` and `fp8_kept` below.
    buffers     what the description's ops hold beside parameters: each manual core's future mask
                (bool (1,1,s,s) per block, model.py's `future_mask`; masked_fill saves a view of
                it, so it is never an activation), 0 for sdpa; native FP8's FP32 amax history and
                scales per FP8Linear, 12H + 36 bytes (see fp8.FP8Linear).
    fp8_weights the persistent FP8 weight copies: Transformer Engine's cached E4M3 weight and
                transpose (formula only); 0 for native (see fp8_weight_copies).
    fp8_kept    native FP8's E4M3 weight copies, kept from micro-step 1's forward until released
                before AdamW: alive during a step, not between steps (see fp8_weight_copies).
    """
    P, n_tensors = param_count(cfg)
    rec = precision.recipe(cfg)
    e, copies = rec.element_bytes, fp8_weight_copies(cfg)
    return dict(parameters=e * P,
                gradients=e * P + (4 * P if (cfg.fp32_grad_accum and rec.master_weights) else 0),
                master=4 * P if rec.master_weights else 0,
                optimizer=8 * P + (0 if cfg.device == "cuda" else 4 * n_tensors),
                buffers=_total(cfg, "buffer"), fp8_weights=copies["persistent"], fp8_kept=copies["kept"])


def fp8_weight_copies(cfg):
    """{persistent, kept, transient} bytes of FP8 weight copies beyond the 16-bit parameters: the
    one place their formulas live (the walk's op-by-op steps are ledger/fp8_ops.py's). The FP8
    Linears are the description's Linears (4 per block here: 12h^2 weights); the tied head and
    the embeddings stay BF16.

    native (fp8.FP8Linear): nothing persistent. kept: micro-step 1's forward quantizes each weight
      once and keeps the E4M3 copy (out*in bytes) with its scale and amax (two 8-byte storages)
      until accumulate.optimizer_step releases them before AdamW: sum(out*in) L + 16 L bytes per
      Linear, alive during a step, never between steps (so not state: its own line); with
      fp8_grad=e5m2 each copy gets a column-major twin at the layer's first backward. transient:
      the largest weight times its scale in FP32 while it is quantized: 4 x out*in bytes. On CPU
      every FP8 GEMM also looks its operands up as BF16 through int32 codes (fp8_gemm._look_up).
    te (Transformer Engine's Linear): its E4M3 weight and the transposed copy, cached across
      steps, persistent like a parameter: 2 sum(out*in) L. FORMULA ONLY: the ledger does not
      measure TE, and TE's own amax/scale state and cuBLAS workspace are not counted.
    """
    rec = precision.recipe(cfg)
    weights = [info["numel"] for info in block_held(cfg, "fp8 weight")]
    if rec.fp8 is None or rec.fp8.backend == "te":
        return dict(persistent=2 * cfg.n_layer * sum(weights) if rec.fp8 else 0, kept=0, transient=0)
    twins = 2 if rec.fp8.grad == "e5m2" else 1
    return dict(persistent=0, kept=cfg.n_layer * (twins * sum(weights) + 16 * len(weights)),
                transient=4 * max(weights))


def input_bytes(cfg):
    """The batch, token ids x and targets y: int64, b*s each (see "inputs" above)."""
    return 2 * cfg.batch_size * cfg.block_size * 8


def rng_state_bytes(cfg):
    """Host bytes of the RNG states the recompute units keep (checkpoint.Unit.rng,
    snapshot.rng_state): one per unit of the policy (a run of blocks, or one block's core),
    alive from the forward until backward is done (its RerunNode holds it). The CPU generator's state is a
    byte tensor whose size torch decides (torch.get_rng_state(), read here, not assumed); on
    CUDA each unit also keeps the CUDA generator's state, seed and Philox offset, 8 + 8 bytes,
    also a CPU tensor (CUDAGeneratorImpl::get_state in aten/src/ATen/cuda/CUDAGeneratorImpl.cpp).
    Never on the device, so not in the peak."""
    p = plan(cfg)
    n = len(p.units) + len(p.core_units)
    return n * (torch.get_rng_state().numel() + (8 + 8 if cfg.device == "cuda" else 0))


def bytes_per_param(cfg):
    """(params, grads, master, optimizer) bytes per parameter: 4+4+0+8 or 2+2+4+8 (= 16, the ZeRO figure)."""
    one = replace(cfg, n_layer=1, n_embd=64, n_head=1, block_size=1, batch_size=1, vocab_size=1, device="cuda",
                  attn="sdpa", ckpt="none", ckpt_segment=0)  # CUDA: no step scalars
    st, (P, _) = state_bytes(one), param_count(one)
    return tuple(st[k] / P for k in ("parameters", "gradients", "master", "optimizer"))


def predicted(cfg):
    """{component: bytes} for the components ledger/measure.py counts."""
    st = state_bytes(cfg)
    return dict(parameters=st["parameters"], buffers=st["buffers"], gradients=st["gradients"], master=st["master"],
                optimizer=st["optimizer"], fp8_kept=st["fp8_kept"], activations=activation_bytes(cfg),
                inputs=input_bytes(cfg), rng_states=rng_state_bytes(cfg))


def components(cfg):
    """The chapter's four components, and buffers on their own line (ZeRO-3/FSDP shards
    parameters, not buffers): master weights fold into optimizer states, TE's persistent
    FP8 weight copies into parameters (per parameter, so they shard with them); native FP8's
    weight copies kept during a step (freed before AdamW: not a parameter) on a line of their own."""
    st = state_bytes(cfg)
    return dict(parameters=st["parameters"] + st["fp8_weights"], buffers=st["buffers"], gradients=st["gradients"],
                optimizer=st["master"] + st["optimizer"], fp8_kept=st["fp8_kept"], activations=activation_bytes(cfg))


# ---------------------------------------------------------------- the peak

def peak_walk(cfg, shard=1):
    """ledger/step.walk_step for cfg: the Walk over one steady-state step.
    shard=N: ZeRO-3 over N ranks: every per-parameter state and gradient / N, plus one block's
    matrices gathered (and their gradient before the reduce-scatter); buffers, kept FP8 copies whole."""
    st, rec, (P, _) = state_bytes(cfg), precision.recipe(cfg), param_count(cfg)
    e = rec.element_bytes
    fp32_sums = st["gradients"] - e * P  # the FP32 accumulation buffers, alive all step
    per_param = st["parameters"] + st["fp8_weights"] + st["master"] + st["optimizer"] + fp32_sums
    if shard > 1:
        per_param = per_param // shard + 2 * e * block_param_count(cfg, lambda info: info.get("matrix"))
    static = per_param + st["buffers"] + input_bytes(cfg)
    matrices = matrix_param_count(cfg)
    return step.walk_step(MODEL, sizes(cfg), plan(cfg), static, [matrices, P - matrices],
                          4 * P if rec.master_weights else 0, bool(fp32_sums), shard)


def peak_estimate(cfg, shard=1):
    """(bytes, where, what is alive) at the highest point of a steady-state step, from the
    walk (the optimizer states exist already; .grad is None at the start)."""
    w = peak_walk(cfg, shard)
    alive = ", ".join(f"{k} {v:,}" for k, v in sorted(w.parts.items()))
    return w.peak, w.where, f"states, buffers and the batch {w.static:,}" + (f" + {alive}" if alive else "")
