"""The memory ledger: where every byte of a training step goes, as formulas.

Chapter section 4 ("The whole picture of memory optimisation"): the four memory
components (parameters, gradients, optimizer states, activations) for this model, under
the techniques of sections 1-3. Read first: `state_bytes` (parameters, gradients, FP32
master weights, AdamW states), then `block_activation_terms` (what autograd keeps for
one block of *this* model, term by term), then `peak_estimate` (a walk over the step,
memory_timeline.py). The same numbers are measured by memory_measure.py; the parallel
techniques (ZeRO, TP, PP, CP, offload) and the big shapes are memory_parallel.py;
`make ledger` (tools/ledger.py) prints both.

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
  "inputs" = the batch: token ids and targets, int64, 2 x b*s*8 bytes. Autograd holds
  references to them (the embedding saves the ids, the loss the targets), but the caller
  made them before the forward and holds them past the step, so they are the step's
  input, not activations: their own line, never in "activations" (MemTracker files them
  as inputs too). memory_measure.random_batch gives x and y separate storages, as the
  trainer's batches on a GPU have (one b=1 row would otherwise hold both: defect 3 of issue 10).
  "rng_states" = host memory: the RNG state each recompute unit keeps (checkpoint.Recompute)
  so that dropout draws the same masks when re-run. Not device memory, not in the peak.
  "peak" = the most bytes alive at any moment of a steady-state step (optimizer states
  already exist), and where in the step it happens.
"""
import math
from dataclasses import replace

import torch

import checkpoint
import memory_timeline
import precision
from memory_ops import FP8_SCALES, Sizes

COMPONENTS = ("parameters", "buffers", "gradients", "master", "optimizer", "fp8_kept", "activations", "inputs",
              "rng_states")


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
    fp8 is 2+2+4+8 as well (BF16 parameters, FP32 master), plus `fp8_weights` and `fp8_kept` below.
    buffers     L*s^2 bytes of future masks for attn=manual (bool (1,1,s,s) per block, model.py's
                `future_mask`; masked_fill saves a view of it, so it is never an activation), 0 for
                sdpa; fp8 (native) adds, per FP8Linear (4 per block), FP32 amax_history (H, 3),
                scale (3,), step_amax (3,) and fp8_max (3,): 12H + 36 bytes (see fp8.FP8Linear).
    fp8_weights the persistent FP8 weight copies: Transformer Engine's cached E4M3 weight and
                transpose (formula only); 0 for native (see fp8_weight_copies).
    fp8_kept    native FP8's E4M3 weight copies, kept from micro-step 1's forward until released
                before AdamW: alive during a step, not between steps (see fp8_weight_copies).
    """
    P, n_tensors = param_count(cfg)
    L, _, _, s, _, _ = dims(cfg)
    rec = precision.recipe(cfg)
    e = rec.element_bytes
    native_fp8, copies = rec.fp8 is not None and rec.fp8.backend == "native", fp8_weight_copies(cfg)
    return dict(parameters=e * P,
                gradients=e * P + (4 * P if (cfg.fp32_grad_accum and rec.master_weights) else 0),
                master=4 * P if rec.master_weights else 0,
                optimizer=8 * P + (0 if on_cuda(cfg) else 4 * n_tensors),
                buffers=(L * s * s if cfg.attn == "manual" else 0)
                + (L * 4 * (12 * rec.fp8.history + 36) if native_fp8 else 0),
                fp8_weights=copies["persistent"], fp8_kept=copies["kept"])


def fp8_weight_copies(cfg):
    """{persistent, kept, transient} bytes of FP8 weight copies beyond the 16-bit parameters: the
    one place their formulas live (the walk's op-by-op steps are memory_linear.py's). The FP8
    Linears are the 4 per block, 12h^2 weights (c_attn 3h^2, c_proj h^2, c_fc 4h^2, MLP c_proj
    4h^2); the tied head and the embeddings stay BF16.

    native (fp8.FP8Linear): nothing persistent. kept: micro-step 1's forward quantizes each weight
      once and keeps the E4M3 copy (out*in bytes) with its scale and amax (two 8-byte storages)
      until accumulate.optimizer_step releases them before AdamW: 12h^2 L + 64L bytes, alive
      during a step, never between steps (so not state: its own line); with fp8_grad=e5m2 each
      copy gets a column-major twin at the layer's first backward, 12h^2 L more. transient: a
      weight times its scale in FP32 while it is quantized, the largest (4h^2): 16h^2 bytes (in
      evaluation, which keeps nothing, its E4M3 copy too: 20h^2). On CPU every FP8 GEMM also
      looks its operands up as BF16 through int32 codes, 6 bytes per weight (fp8_gemm._look_up).
    te (Transformer Engine's Linear): its E4M3 weight and the transposed copy, cached across
      steps, persistent like a parameter: 2 * 12h^2 L. FORMULA ONLY: the ledger does not measure
      TE, and TE's own amax/scale state and cuBLAS workspace are not counted.
    """
    rec, L, h = precision.recipe(cfg), cfg.n_layer, cfg.n_embd
    if rec.fp8 is None or rec.fp8.backend == "te":
        return dict(persistent=2 * 12 * h * h * L if rec.fp8 else 0, kept=0, transient=0)
    twins = 2 if rec.fp8.grad == "e5m2" else 1
    return dict(persistent=0, kept=twins * 12 * h * h * L + 4 * 16 * L, transient=4 * 4 * h * h)


def input_bytes(cfg):
    """The batch, token ids x and targets y: int64, b*s each (see "inputs" above)."""
    return 2 * cfg.batch_size * cfg.block_size * 8


def rng_state_bytes(cfg):
    """Host bytes of the RNG states the recompute units keep (checkpoint.Recompute's ctx.rng,
    snapshot.rng_state): one per unit (full: L, sqrt: ceil(L/k), selective: one per block's
    core; none: 0), alive from the forward to the end of that unit's backward. The CPU
    generator's state is a byte tensor whose size torch decides (torch.get_rng_state(),
    read here, not assumed); on CUDA each unit also keeps the CUDA generator's state, seed
    and Philox offset, 8 + 8 bytes, also a CPU tensor (CUDAGeneratorImpl::get_state in
    aten/src/ATen/cuda/CUDAGeneratorImpl.cpp). Never on the device, so not in the peak."""
    n = len(units(cfg)) if cfg.ckpt in ("full", "sqrt") else cfg.n_layer if cfg.ckpt == "selective" else 0
    return n * (torch.get_rng_state().numel() + (8 + 8 if on_cuda(cfg) else 0))


def bytes_per_param(cfg):
    """(params, grads, master, optimizer) bytes per parameter: 4+4+0+8 or 2+2+4+8 (= 16, the ZeRO figure)."""
    one = replace(cfg, n_layer=1, n_embd=64, n_head=1, block_size=1, batch_size=1, vocab_size=1, device="cuda",
                  attn="sdpa")  # CUDA: no step scalars
    st, (P, _) = state_bytes(one), param_count(one)
    return tuple(st[k] / P for k in ("parameters", "gradients", "master", "optimizer"))


# ---------------------------------------------------------------- activations

def _stat_bytes(cfg):
    """LayerNorm saves mean and rstd per token: in the activation dtype on CPU (measured), FP32
    on CUDA: layer_norm_cuda allocates them in the accumulate type, float for half and bfloat16
    inputs (aten/src/ATen/native/cuda/layer_norm_kernel.cu)."""
    return 4 if on_cuda(cfg) else precision.recipe(cfg).element_bytes


def _mask_bytes(cfg):
    """Dropout's saved mask per element. CPU: dropout is input * (bernoulli noise / (1-p)) and the
    mul saves the noise, in the input dtype (measured). CUDA: the fused native_dropout saves a
    bool mask, 1 byte (native_dropout_cuda -> dropout_cuda<bool> in aten/src/ATen/native/cuda/Dropout.cu)."""
    return 1 if on_cuda(cfg) else precision.recipe(cfg).element_bytes


def _lse_rows(cfg):
    """Rows of sdpa's FP32 logsumexp per (b, a). CUDA fp32 runs the memory-efficient kernel, which
    pads them to 32*ceil(s/32) (kAlignLSE = 32, the block size of its backward: the logsumexp
    allocation in _efficient_attention_forward, aten/src/ATen/native/transformers/cuda/attention.cu);
    16-bit runs flash attention, whose softmax_lse is s rows; CPU's flash kernel keeps s rows."""
    s = cfg.block_size
    return 32 * math.ceil(s / 32) if (on_cuda(cfg) and precision.recipe(cfg).element_bytes == 4) else s


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
      two FP32 scales (one 8-byte storage); everything else stays BF16. So with sdpa, c_proj's
      saved input is its own E4M3 copy, not the sdpa output (which sdpa still saves).
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
        # one sequence (b = 1): (1, a, T, d) -> (a, T, d) is a view, so the matmuls save q, k, v
        # themselves, views of c_attn's output, instead of contiguous copies: the same bytes
        t += [("q,k,v (c_attn output)", 3 * bsh * e)] if b == 1 else [("Q, K copies for QK^T", 2 * bsh * e)]
        t += [("softmax output", a * s * s * b * e)]
        if drop:
            t += [("attention dropout mask", a * s * s * b * em), ("attention dropout output", a * s * s * b * e)]
        t += [] if b == 1 else [("V copy for att@V", bsh * e)]
    elif not cuda and drop:
        # CPU sdpa with dropout takes the math path, which upcasts 16-bit inputs to FP32 and
        # saves what the manual core saves (scaled Q, K copies, softmax, mask, dropout output, V);
        # for b = 1 and FP32 inputs v is not copied: a view of c_attn's output is saved, 3bsh
        v = ("q,k,v (c_attn output)", 3 * bsh * 4) if (b == 1 and e == 4) else ("sdpa-math V copy (fp32)", bsh * 4)
        t += [("sdpa-math Q, K copies (fp32)", 2 * bsh * 4), ("sdpa-math softmax (fp32)", a * s * s * b * 4),
              ("sdpa-math dropout mask (fp32)", a * s * s * b * 4),
              ("sdpa-math dropout output (fp32)", a * s * s * b * 4), v]
    else:
        # flash / memory-efficient sdpa: q, k, v (views of c_attn's output), the output,
        # and the FP32 log-sum-exp per (b, a, s) row; no s^2 tensor at all. The kernels write
        # their output in (b, s, a, d) layout, so y.transpose(1, 2).contiguous() copies nothing
        # and an nn.Linear c_proj saves that same storage as its input: one bsh term, not two
        t += [("q,k,v (c_attn output)", 3 * bsh * e), ("sdpa output", bsh * e),
              ("sdpa logsumexp (fp32)", b * a * _lse_rows(cfg) * 4)]
    if policy == "selective" or cfg.attn == "manual" or (not cuda and drop) or rec.fp8 is not None:
        t += [("c_proj input", bsh * el)]
    if drop:
        t += [("residual dropout mask", bsh * em)]
    t += [("ln_2 input", bsh * e), ("ln_2 mean+rstd", 2 * b * s * es), ("c_fc input", bsh * el),
          ("GELU input", 4 * bsh * e), ("MLP c_proj input (GELU output)", 4 * bsh * el)]
    if drop:
        t += [("MLP dropout mask", bsh * em)]
    if rec.fp8 is not None:
        t += [(name, 8) for name in FP8_SCALES.values()]
    return t


def head_activation_terms(cfg):
    """[(term, bytes)] saved outside the blocks: embeddings, final LayerNorm, tied head, loss.
    The loss is computed on logits.float(), so log-softmax keeps b*s*V FP32 values whatever
    the precision -- at V=50257 that is the largest single activation of a small GPT.
    The token ids (saved by wte) and targets (by the loss) are the batch: `input_bytes`."""
    _, h, _, s, b, V = dims(cfg)
    e = precision.recipe(cfg).element_bytes
    t = [("positions (wpe)", s * 8)]
    if cfg.dropout > 0:
        t += [("embedding dropout mask", b * s * h * _mask_bytes(cfg))]
    t += [("ln_f input", b * s * h * e), ("ln_f mean+rstd", 2 * b * s * _stat_bytes(cfg)),
          ("head input (ln_f output)", b * s * h * e), ("log-softmax output (fp32)", b * s * V * 4),
          ("loss total_weight", 4)]
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

def timeline_sizes(cfg):
    """memory_ops.Sizes for cfg: what the walk over a step needs to know."""
    L, h, a, s, b, V = dims(cfg)
    rec = precision.recipe(cfg)
    core = "manual" if cfg.attn == "manual" else "math" if (not on_cuda(cfg) and cfg.dropout > 0) else "sdpa"
    return Sizes(L=L, b=b, s=s, h=h, a=a, V=V, e=rec.element_bytes, fp8=rec.fp8 is not None,
                 fp8_te=rec.fp8 is not None and rec.fp8.backend == "te",
                 fp8_e5m2=rec.fp8 is not None and rec.fp8.grad == "e5m2",
                 loss_scaled=rec.loss_scaling != "none", bias=cfg.bias,
                 drop=cfg.dropout > 0, cuda=on_cuda(cfg), core=core)


def peak_walk(cfg, shard=1):
    """memory_timeline.walk_step for cfg: the Walk over one steady-state step.
    shard=N: ZeRO-3 over N ranks: every per-parameter state and gradient / N, plus one block's
    parameters gathered (and its gradient before the reduce-scatter); buffers, kept FP8 copies whole."""
    L, h, _, _, _, V = dims(cfg)
    st, rec, (P, _) = state_bytes(cfg), precision.recipe(cfg), param_count(cfg)
    e, low = rec.element_bytes, rec.master_weights
    fp32_sums = st["gradients"] - e * P  # the FP32 accumulation buffers, alive all step
    per_param = st["parameters"] + st["fp8_weights"] + st["master"] + st["optimizer"] + fp32_sums
    if shard > 1:
        per_param = per_param // shard + 2 * e * (12 * h * h)
    static = per_param + st["buffers"] + input_bytes(cfg)
    matrices = V * h + cfg.block_size * h + 12 * h * h * L  # AdamW's weight-decay group: the 2-D parameters
    terms = dict(block_activation_terms(cfg, "none"))
    kept = dict(block_activation_terms(cfg, cfg.ckpt)) if cfg.ckpt == "selective" else terms
    return memory_timeline.walk_step(timeline_sizes(cfg), static, terms, kept, dict(head_activation_terms(cfg)),
                                     cfg.ckpt, units(cfg), [matrices, P - matrices], 4 * P if low else 0,
                                     bool(fp32_sums), shard)


def peak_estimate(cfg, shard=1):
    """(bytes, where, what is alive) at the highest point of a steady-state step, from
    memory_timeline's walk (the optimizer states exist already; .grad is None at the start)."""
    w = peak_walk(cfg, shard)
    alive = ", ".join(f"{k} {v:,}" for k, v in sorted(w.parts.items()))
    return w.peak, w.where, f"states, buffers and the batch {w.static:,}" + (f" + {alive}" if alive else "")
