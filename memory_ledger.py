"""The memory ledger: where every byte of a training step goes, as formulas.

Chapter section 4 ("The whole picture of memory optimisation"): the four memory
components (parameters, gradients, optimizer states, activations) for this model, under
the techniques of sections 1-3. Read first: `state_bytes` (parameters, gradients, FP32
master weights, AdamW states), then `block_activation_terms` (what autograd keeps for
one block of *this* model, term by term), then `peak_estimate`. The same numbers are
measured by memory_measure.py; the parallel techniques (ZeRO, TP, PP, CP, offload) and
the big shapes are memory_parallel.py; `make ledger` (tools/ledger.py) prints both.

Config in, bytes out. The letters of the formulas (`dims`):
  b micro-batch, s context (block_size), h width (n_embd), a heads, L layers, V vocab,
  P parameter count, e bytes per activation element (4 for fp32, 2 for bf16/fp16/fp8).
  cfg.device "cuda" selects CUDA's saved dtypes (see block_activation_terms); anything
  else CPU's.
  "activations" = the bytes autograd holds for backward once the forward has finished
  (distinct storages saved for backward; parameter and buffer storages excluded: a saved
  view of a parameter or buffer, like the causal mask, costs nothing new). Under recompute
  that is only the units' inputs; the internals of one unit come back during backward and
  are counted in the *peak*, not in "activations".
  "peak" = the most bytes alive at any moment of a steady-state step (optimizer states
  already exist), and where in the step it happens.
"""
import math
from dataclasses import replace

import checkpoint
import precision

COMPONENTS = ("parameters", "gradients", "master", "optimizer", "activations", "buffers")


def dims(cfg):
    """(L, h, a, s, b, V): layers, width, heads, context, micro-batch, vocabulary."""
    return cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.batch_size, cfg.vocab_size


def on_cuda(cfg):
    return cfg.device == "cuda"


# ---------------------------------------------------------------- parameters, gradients, master, optimizer

def param_count(cfg):
    """(P, number of parameter tensors) of model.GPT, from its shape.

    wte V*h (also the output head: tied, counted once), wpe s*h, final LayerNorm h (+h bias).
    Per block: c_attn 3h^2 (+3h), attention c_proj h^2 (+h), c_fc 4h^2 (+4h), MLP c_proj
    4h^2 (+h), two LayerNorms 2h (+2h): 12h^2 + 13h with biases, 12h^2 + 2h without.
    Tensors: 2 embeddings + 12 per block + 2 (ln_f) with biases; 2 + 6L + 1 without.
    """
    L, h, _, s, _, V = dims(cfg)
    per_block = 12 * h * h + (13 * h if cfg.bias else 2 * h)
    n = V * h + s * h + L * per_block + (2 * h if cfg.bias else h)
    tensors = 2 + L * (12 if cfg.bias else 6) + (2 if cfg.bias else 1)
    return n, tensors


def state_bytes(cfg):
    """Bytes of the four non-activation components (and the model's buffers) for cfg's precision.

    parameters  e*P       the model in its own dtype (fp8 keeps bf16 parameters)
    gradients   e*P       .grad has the parameter's dtype (+4P FP32 buffers with fp32_grad_accum)
    master      4P        the FP32 copy AdamW updates; 0 for fp32 (the parameters are the master)
    optimizer   8P        AdamW's m and v, FP32, on the master copy; plus one FP32 `step` scalar
                          per tensor, which torch keeps on the CPU (so a CUDA ledger leaves it out)
    So fp32 is 4+4+0+8 = 16 bytes/param, and bf16/fp16 2+2+4+8 = 16 bytes/param: mixed
    precision does not shrink the states (ZeRO paper, sec. 3.1), it shrinks activations and time.
    fp8 is 2+2+4+8 as well (BF16 parameters, FP32 master), plus `fp8_weights` below.
    buffers     L*s^2 bytes of future masks for attn=manual (bool (1,1,s,s) per block, model.py's
                `future_mask`; masked_fill saves a view of it, so it is never an activation), 0 for
                sdpa; fp8 (native) adds, per FP8Linear (4 per block), FP32 amax_history (H, 3),
                scale (3,), step_amax (3,) and fp8_max (3,): 12H + 36 bytes (see fp8.FP8Linear).
    fp8_weights the persistent FP8 weight copies: see fp8_weight_copies (0 for native; Transformer
                Engine's cached E4M3 weight + transpose, formula only).
    """
    P, n_tensors = param_count(cfg)
    L, _, _, s, _, _ = dims(cfg)
    rec = precision.recipe(cfg)
    e = rec.element_bytes
    native_fp8 = rec.fp8 is not None and rec.fp8.backend == "native"
    return dict(parameters=e * P,
                gradients=e * P + (4 * P if (cfg.fp32_grad_accum and rec.master_weights) else 0),
                master=4 * P if rec.master_weights else 0,
                optimizer=8 * P + (0 if on_cuda(cfg) else 4 * n_tensors),
                buffers=(L * s * s if cfg.attn == "manual" else 0)
                + (L * 4 * (12 * rec.fp8.history + 36) if native_fp8 else 0),
                fp8_weights=fp8_weight_copies(cfg)[0])


def fp8_weight_copies(cfg):
    """(persistent, transient) bytes of FP8 weight copies beyond the BF16 parameters ("FP8's extra
    weight copies"). The FP8 Linears are the 4 per block: c_attn 3h*h, c_proj h*h, c_fc 4h*h and
    the MLP c_proj h*4h, 12h^2 weights per block; the tied head and the embeddings stay BF16.

    native (fp8.FP8Linear): no persistent FP8 weight. Each forward quantizes W afresh:
      an FP32 temporary of W (4*out*in bytes) and then its E4M3 copy (out*in bytes), both freed
      once the matmul has run. Transient: at most one Linear's, the largest (4h^2 weights):
      5 * 4h^2 = 20h^2 bytes on top of whatever else is alive in that forward (or recompute).
    te (Transformer Engine's Linear): keeps, per Linear, its E4M3 weight and the transposed
      E4M3 copy its backward GEMM wants, cached across steps: 2 * 12h^2 * L bytes, alive always
      (like a parameter). FORMULA ONLY: the ledger does not measure TE, and TE's own
      amax/scale state and cuBLAS workspace are not counted.
    Not fp8: (0, 0).
    """
    rec = precision.recipe(cfg)
    L, h = cfg.n_layer, cfg.n_embd
    if rec.fp8 is None:
        return 0, 0
    if rec.fp8.backend == "te":
        return 2 * 12 * h * h * L, 0
    return 0, 5 * 4 * h * h


def bytes_per_param(cfg):
    """(params, grads, master, optimizer) bytes per parameter: 4+4+0+8 or 2+2+4+8 (= 16, the ZeRO figure)."""
    one = replace(cfg, n_layer=1, n_embd=64, n_head=1, block_size=1, batch_size=1, vocab_size=1, device="cuda",
                  attn="sdpa")  # CUDA: no step scalars
    st, (P, _) = state_bytes(one), param_count(one)
    return tuple(st[k] / P for k in ("parameters", "gradients", "master", "optimizer"))


# ---------------------------------------------------------------- activations

def _stat_bytes(cfg):
    """LayerNorm saves mean and rstd per token: in the activation dtype on CPU, FP32 on CUDA."""
    return 4 if on_cuda(cfg) else precision.recipe(cfg).element_bytes


def _mask_bytes(cfg):
    """Dropout's saved mask per element: CPU's dropout is input * (bernoulli noise / (1-p)) and
    the mul saves the noise in the input dtype; CUDA's fused native_dropout saves a bool mask."""
    return 1 if on_cuda(cfg) else precision.recipe(cfg).element_bytes


def block_activation_terms(cfg, policy="none"):
    """[(term, bytes)] autograd saves for ONE block's forward, for this code (model.Block).

    Derived from the ops in model.py, and checked against saved_tensors_hooks by the tests:
      LayerNorm saves its input and its mean/rstd;  Linear (addmm) saves its input;
      matmul on the (B, a, T, d) head views makes contiguous copies and saves those;
      masked_fill saves its mask, future_mask[:, :, :T, :T]: a view of the block's buffer, whose
        storage is counted once under "buffers" (state_bytes), so no term here;
      softmax saves its output; GELU saves its input; dropout saves its mask.
    policy "selective": the attention core runs inside checkpoint.Recompute, which saves
      only q, k, v (three views of c_attn's output: one 3bsh storage) and nothing inside.
    Differences from Korthikanti et al. (memory_parallel.korthikanti_layer_terms): the paper
    drops the LayerNorm statistics (we keep 2 x 2bs of them per block); it counts "Q and K" and
    "V" as 4sbh + 2sbh, which here are the copies matmul makes, so the totals agree. The causal
    mask is in neither: here it is a buffer (state, L*s^2 bytes for the model), not an activation.
    fp8: every Linear (fp8.FP8Linear) saves its input as E4M3, 1 byte per element, plus its
      two FP32 scales (one 8-byte storage); everything else stays BF16.
    """
    _, h, a, s, b, _ = dims(cfg)
    rec = precision.recipe(cfg)
    e, es, em = rec.element_bytes, _stat_bytes(cfg), _mask_bytes(cfg)
    el = 1 if rec.fp8 is not None else e  # bytes per element of a saved Linear input
    bsh, drop, cuda = b * s * h, cfg.dropout > 0, on_cuda(cfg)
    t = [("ln_1 input", bsh * e), ("ln_1 mean+rstd", 2 * b * s * es), ("c_attn input", bsh * el)]
    if policy == "selective":
        t += [("q,k,v (recompute inputs)", 3 * bsh * e)]
    elif cfg.attn == "manual":
        t += [("Q, K copies for QK^T", 2 * bsh * e), ("softmax output", a * s * s * b * e)]
        if drop:
            t += [("attention dropout mask", a * s * s * b * em), ("attention dropout output", a * s * s * b * e)]
        t += [("V copy for att@V", bsh * e)]
    elif not cuda and drop:
        # CPU sdpa with dropout takes the math path, which upcasts 16-bit inputs to FP32 and
        # saves what the manual core saves (scaled Q, K copies, softmax, mask, dropout output, V)
        t += [("sdpa-math Q, K copies (fp32)", 2 * bsh * 4), ("sdpa-math softmax (fp32)", a * s * s * b * 4),
              ("sdpa-math dropout mask (fp32)", a * s * s * b * 4),
              ("sdpa-math dropout output (fp32)", a * s * s * b * 4), ("sdpa-math V copy (fp32)", bsh * 4)]
    else:
        # flash / memory-efficient sdpa: q, k, v (views of c_attn's output), the output,
        # and the FP32 log-sum-exp per (b, a, s) row; no s^2 tensor at all. The kernels write
        # their output in (b, s, a, d) layout, so y.transpose(1, 2).contiguous() copies nothing
        # and c_proj's input is that same storage: one bsh term, not two.
        lse_s = 32 * math.ceil(s / 32) if (cuda and e == 4) else s  # CUDA mem-efficient pads
        t += [("q,k,v (c_attn output)", 3 * bsh * e), ("sdpa output = c_proj input", bsh * e),
              ("sdpa logsumexp (fp32)", b * a * lse_s * 4)]
    if policy == "selective" or cfg.attn == "manual" or (not cuda and drop):
        t += [("c_proj input", bsh * el)]
    if drop:
        t += [("residual dropout mask", bsh * em)]
    t += [("ln_2 input", bsh * e), ("ln_2 mean+rstd", 2 * b * s * es), ("c_fc input", bsh * el),
          ("GELU input", 4 * bsh * e), ("MLP c_proj input (GELU output)", 4 * bsh * el)]
    if drop:
        t += [("MLP dropout mask", bsh * em)]
    if rec.fp8 is not None:
        t += [("FP8 scales (x_scale, w_scale) x 4 Linears", 4 * 8)]
    return t


def head_activation_terms(cfg):
    """[(term, bytes)] saved outside the blocks: embeddings, final LayerNorm, tied head, loss.
    The loss is computed on logits.float(), so log-softmax keeps b*s*V FP32 values whatever
    the precision -- at V=50257 that is the largest single activation of a small GPT."""
    _, h, _, s, b, V = dims(cfg)
    e = precision.recipe(cfg).element_bytes
    t = [("token ids (wte)", b * s * 8), ("positions (wpe)", s * 8)]
    if cfg.dropout > 0:
        t += [("embedding dropout mask", b * s * h * _mask_bytes(cfg))]
    t += [("ln_f input", b * s * h * e), ("ln_f mean+rstd", 2 * b * s * _stat_bytes(cfg)),
          ("head input (ln_f output)", b * s * h * e), ("log-softmax output (fp32)", b * s * V * 4),
          ("targets", b * s * 8), ("loss total_weight", 4)]
    return t


def units(cfg):
    """Recompute units (lists of block indices) for full/sqrt; checkpoint.segments decides."""
    return checkpoint.segments(cfg.n_layer, cfg.ckpt, cfg.ckpt_segment)


def activation_terms(cfg):
    """[(term, bytes)] for the whole model after forward, under cfg.ckpt."""
    head = head_activation_terms(cfg)
    if cfg.ckpt in ("full", "sqrt"):
        n = len(units(cfg))  # Recompute keeps each unit's input, b*s*h values, and nothing else
        e = precision.recipe(cfg).element_bytes
        blocks = [(f"unit inputs ({n} x bsh)", n * cfg.batch_size * cfg.block_size * cfg.n_embd * e)]
    else:
        per = block_activation_terms(cfg, cfg.ckpt)
        blocks = [(f"{name} (x{cfg.n_layer} blocks)", cfg.n_layer * v) for name, v in per]
    return blocks + head


def activation_bytes(cfg):
    return sum(v for _, v in activation_terms(cfg))


def predicted(cfg):
    """{component: bytes} for the components memory_measure.measure counts."""
    st = state_bytes(cfg)
    return dict(parameters=st["parameters"], gradients=st["gradients"], master=st["master"],
                optimizer=st["optimizer"], activations=activation_bytes(cfg), buffers=st["buffers"])


def components(cfg):
    """The chapter's four components (master weights folded into optimizer states; buffers and
    any persistent FP8 weight copies into parameters)."""
    st = state_bytes(cfg)
    return dict(parameters=st["parameters"] + st["buffers"] + st["fp8_weights"], gradients=st["gradients"],
                optimizer=st["master"] + st["optimizer"], activations=activation_bytes(cfg))


# ---------------------------------------------------------------- the peak

def peak_estimate(cfg, shard=1):
    """(bytes, where, alive) of the highest point of a steady-state step, from a walk over
    the step's timeline (the optimizer states already exist; .grad is None at the start).

    static  parameters + buffers + master + AdamW states (+ FP32 grad buffers, + TE's cached FP8
      weights, fp8_weight_copies): alive always.
    backward start  all activations + the FP32 gradients of log-softmax and of the logits (2 x 4bsV).
    backward, unit u (last to first)  activations of units < u (and u's own), gradients of the head and
      of units > u, plus what a recomputed unit brings back (its blocks' internals; the attention
      core for selective) and the b*s*h gradient flowing in; for native fp8 under full/sqrt, the
      recomputed forward also quantizes W again: fp8_weight_copies' transient (20h^2) on top.
      (Not modelled: native fp8's backward dequantizes x to BF16 for wgrad, M*in*2 bytes, which
      lives next to dgrad's output of the same size; grad_flow's largest pair stands for both.)
    optimizer step  the 16-bit gradients, their FP32 master copies (low precision only) and AdamW's
      FP32 temporary sqrt(v) (torch's foreach AdamW), 4P each.
    shard=N: ZeRO-3 over N ranks, every per-parameter byte / N (plus one gathered block, 2x).
    """
    L, h, a, s, b, V = dims(cfg)
    st, rec = state_bytes(cfg), precision.recipe(cfg)
    e, (P, _), low = rec.element_bytes, param_count(cfg), rec.master_weights
    static = (st["parameters"] + st["buffers"] + st["fp8_weights"] + st["master"] + st["optimizer"]
              + (st["gradients"] - e * P))
    if shard > 1:
        static = static // shard + 2 * e * (12 * h * h)  # + one block gathered (and its grad)
    P_here = P // shard
    block_params = 12 * h * h + (13 * h if cfg.bias else 2 * h)
    head = sum(v for _, v in head_activation_terms(cfg))
    # in flight inside one block's backward: the incoming b*s*h gradient plus the largest pair of
    # gradients alive together: softmax's input and output gradients (manual attention,
    # a*s^2*b each) or GELU's (4bsh each)
    core_grads = 2 * a * s * s * b * e if cfg.attn == "manual" else 0
    # (measured to matter under full/sqrt, where the recomputed internals sit on top of it;
    # without recompute the block frees its saved tensors as fast as these appear)
    grad_flow = b * s * h * e
    if cfg.ckpt in ("full", "sqrt"):
        grad_flow += max(core_grads, 8 * b * s * h * e)
    points = [(static + activation_bytes(cfg) + 2 * 4 * b * s * V,
               "start of backward", "static + all activations + FP32 logit gradients")]
    none_block = sum(v for _, v in block_activation_terms(cfg, "none"))
    grads_head = e * (P - L * block_params) // shard
    if cfg.ckpt in ("full", "sqrt"):
        groups = units(cfg)
        kept = [b * s * h * e] * len(groups)
        extra = [len(g) * none_block + fp8_weight_copies(cfg)[1] for g in groups]
    else:
        groups = [[i] for i in range(L)]
        kept = [sum(v for _, v in block_activation_terms(cfg, cfg.ckpt))] * L
        core = none_block - sum(v for _, v in block_activation_terms(cfg, "selective")) + 3 * b * s * h * e
        extra = [core if cfg.ckpt == "selective" else 0] * L
    done = grads_head
    for u in reversed(range(len(groups))):
        alive = static + sum(kept[:u + 1]) + done + extra[u] + grad_flow + (head - head_activation_terms_tail(cfg))
        points.append((alive, f"backward through unit {u}" if len(groups) > 1 else "backward through block 0",
                       "static + activations of earlier units + gradients so far + recomputed internals"))
        done += e * len(groups[u]) * block_params // shard
    # with FP32 accumulation the master gradients *are* the buffers (already in static)
    grads_at_step = 0 if (cfg.fp32_grad_accum and low) else e * P_here + (4 * P_here if low else 0)
    step = static + grads_at_step + 4 * P_here
    points.append((step, "optimizer step (AdamW)",
                   "static + gradients" + (" + FP32 master gradients" if low else "") + " + AdamW temporaries"))
    return max(points, key=lambda p: p[0])


def head_activation_terms_tail(cfg):
    """The part of head_activation_terms freed once backward has left the head (all but the embedding's)."""
    keep = ("token ids (wte)", "positions (wpe)", "embedding dropout mask")
    return sum(v for n, v in head_activation_terms(cfg) if n not in keep)
