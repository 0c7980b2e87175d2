"""The memory ledger: where every byte of a training step goes, predicted and measured.

Chapter section 4 ("The whole picture of memory optimisation"): the four memory
components (parameters, gradients, optimizer states, activations) x the techniques of
sections 1-3 and of the parallel dimensions. Read first: `state_bytes` (parameters,
gradients, FP32 master weights, AdamW states), then `block_activation_terms` (what
autograd keeps for one block of *this* model, term by term), then `measure` (how the
same numbers are counted from live tensors), then `technique_table`.

    python memory_ledger.py --precision=bf16 --ckpt=full      (make ledger PRECISION=bf16 CKPT=full)

Words used throughout:
  b micro-batch, s context (block_size), h width (n_embd), a heads, L layers, V vocab,
  P parameter count, e bytes per activation element (4 for fp32, 2 for bf16/fp16/fp8).
  "activations" = the bytes autograd holds for backward once the forward has finished
  (distinct storages saved for backward; parameter and buffer storages excluded: a saved
  view of a parameter or buffer, like the causal mask, costs nothing new). Under recompute that is
  only the units' inputs; the internals of one unit come back during backward and are
  counted in the *peak*, not in "activations".
  "peak" = the most bytes alive at any moment of a steady-state step (optimizer states
  already exist), and where in the step it happens.

Ledger-only flags (not train.py keys): --ranks=N (ZeRO/data parallel), --tp=t, --pp=p,
--cp=c (sequence/context parallel), --gpu_gib=G (what-if GPU size), --table=measure|formula.
"""
import copy
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import checkpoint
import precision
import train
from model import GPT, GPTConfig

COMPONENTS = ("parameters", "gradients", "master", "optimizer", "activations")
EXACT = ("parameters", "gradients", "master", "optimizer")  # storage sizes: must match to the byte
ACT_TOL = {"cpu": 0.02, "cuda": 0.05}  # activations: saved-tensor bytes (CPU), allocator deltas (CUDA)
PEAK_TOL = 0.10  # the peak is an estimate of a timeline: shown, not part of the exit status


# ---------------------------------------------------------------- shapes

@dataclass
class Shape:
    """Everything the formulas need: the model's shape, the micro-batch, the run's choices."""
    L: int
    h: int
    a: int
    s: int
    b: int
    V: int = 256
    bias: bool = True
    dropout: float = 0.0
    attn: str = "manual"
    precision: str = "bf16"
    ckpt: str = "none"
    segment: int = 0
    fp32_grad_accum: bool = False
    device: str = "cpu"  # cpu|cuda: a few saved dtypes differ by device (see block_activation_terms)
    fp8_history: int = 16  # precision.FP8Linear's amax history length (fp8 only)
    fp8_backend: str = "native"  # native (measured here) | te (Transformer Engine: formula only)

    @classmethod
    def from_config(cls, cfg, device="cpu", **over):
        shape = cls(L=cfg.n_layer, h=cfg.n_embd, a=cfg.n_head, s=cfg.block_size, b=cfg.batch_size, V=256,
                    bias=cfg.bias, dropout=cfg.dropout, attn=cfg.attn, precision=cfg.precision, ckpt=cfg.ckpt,
                    segment=cfg.ckpt_segment, fp32_grad_accum=cfg.fp32_grad_accum, device=str(device).split(":")[0],
                    fp8_history=cfg.fp8_amax_history, fp8_backend=cfg.fp8_backend)
        return replace(shape, **over)


def act_bytes(precision_name):
    """e: bytes per element of the model's activations (= its parameter dtype; fp8 keeps bf16 params)."""
    return torch.empty((), dtype=precision.param_dtype(precision_name)).element_size()


# ---------------------------------------------------------------- parameters, gradients, master, optimizer

def param_count(sh):
    """(P, number of parameter tensors) of model.GPT, from its shape.

    wte V*h (also the output head: tied, counted once), wpe s*h, final LayerNorm h (+h bias).
    Per block: c_attn 3h^2 (+3h), attention c_proj h^2 (+h), c_fc 4h^2 (+4h), MLP c_proj
    4h^2 (+h), two LayerNorms 2h (+2h): 12h^2 + 13h with biases, 12h^2 + 2h without.
    Tensors: 2 embeddings + 12 per block + 2 (ln_f) with biases; 2 + 6L + 1 without.
    """
    per_block = 12 * sh.h * sh.h + (13 * sh.h if sh.bias else 2 * sh.h)
    n = sh.V * sh.h + sh.s * sh.h + sh.L * per_block + (2 * sh.h if sh.bias else sh.h)
    tensors = 2 + sh.L * (12 if sh.bias else 6) + (2 if sh.bias else 1)
    return n, tensors


def state_bytes(sh):
    """Bytes of the four non-activation components (and the model's buffers) for sh.precision.

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
                scale (3,), step_amax (3,) and fp8_max (3,): 12H + 36 bytes (see precision.FP8Linear).
    fp8_weights the persistent FP8 weight copies: see fp8_weight_copies (0 for native; Transformer
                Engine's cached E4M3 weight + transpose, formula only).
    """
    P, n_tensors = param_count(sh)
    e = act_bytes(sh.precision)
    low = e != 4
    return dict(parameters=e * P,
                gradients=e * P + (4 * P if (sh.fp32_grad_accum and low) else 0),
                master=4 * P if low else 0,
                optimizer=8 * P + (4 * n_tensors if sh.device == "cpu" else 0),
                buffers=(sh.L * sh.s * sh.s if sh.attn == "manual" else 0)
                + (sh.L * 4 * (12 * sh.fp8_history + 36) if sh.precision == "fp8" and sh.fp8_backend == "native"
                   else 0),
                fp8_weights=fp8_weight_copies(sh)[0])


def fp8_weight_copies(sh):
    """(persistent, transient) bytes of FP8 weight copies beyond the BF16 parameters ("FP8's extra
    weight copies"). The FP8 Linears are the 4 per block: c_attn 3h*h, c_proj h*h, c_fc 4h*h and
    the MLP c_proj h*4h, 12h^2 weights per block; the tied head and the embeddings stay BF16.

    native (precision.FP8Linear): no persistent FP8 weight. Each forward quantizes W afresh:
      an FP32 temporary of W (4*out*in bytes) and then its E4M3 copy (out*in bytes), both freed
      once the matmul has run. Transient: at most one Linear's, the largest (4h^2 weights):
      5 * 4h^2 = 20h^2 bytes on top of whatever else is alive in that forward (or recompute).
      Measured: these are the allocations of the forward; they never outlive it.
    te (Transformer Engine's Linear): keeps, per Linear, its E4M3 weight and the transposed
      E4M3 copy its backward GEMM wants, cached across steps: 2 * 12h^2 * L bytes, alive always
      (like a parameter). FORMULA ONLY: the ledger does not measure TE (main rejects
      --fp8_backend=te), and TE's own amax/scale state and cuBLAS workspace are not counted.
    Not fp8: (0, 0).
    """
    if sh.precision != "fp8":
        return 0, 0
    w = 12 * sh.h * sh.h * sh.L
    if sh.fp8_backend == "te":
        return 2 * w, 0
    return 0, 5 * 4 * sh.h * sh.h


def bytes_per_param(precision_name, fp32_grad_accum=False):
    """(params, grads, master, optimizer) bytes per parameter: 4+4+0+8 or 2+2+4+8 (= 16, the ZeRO figure)."""
    sh = Shape(L=1, h=64, a=1, s=1, b=1, V=1, precision=precision_name, device="cuda",
               fp32_grad_accum=fp32_grad_accum, attn="sdpa")  # no step scalars on CUDA
    st, (P, _) = state_bytes(sh), param_count(sh)
    return tuple(st[k] / P for k in ("parameters", "gradients", "master", "optimizer"))


# ---------------------------------------------------------------- activations

def _stat_bytes(sh):
    """LayerNorm saves mean and rstd per token: in the activation dtype on CPU, FP32 on CUDA."""
    return act_bytes(sh.precision) if sh.device == "cpu" else 4


def _mask_bytes(sh):
    """Dropout's saved mask per element: CPU's dropout is input * (bernoulli noise / (1-p)) and
    the mul saves the noise in the input dtype; CUDA's fused native_dropout saves a bool mask."""
    return act_bytes(sh.precision) if sh.device == "cpu" else 1


def block_activation_terms(sh, policy="none"):
    """[(term, bytes)] autograd saves for ONE block's forward, for this code (model.Block).

    Derived from the ops in model.py, and checked against saved_tensors_hooks by the tests:
      LayerNorm saves its input and its mean/rstd;  Linear (addmm) saves its input;
      matmul on the (B, a, T, d) head views makes contiguous copies and saves those;
      masked_fill saves its mask, future_mask[:, :, :T, :T]: a view of the block's buffer, whose
        storage is counted once under "buffers" (state_bytes), so no term here;
      softmax saves its output; GELU saves its input; dropout saves its mask.
    policy "selective": the attention core runs inside checkpoint.Recompute, which saves
      only q, k, v (three views of c_attn's output: one 3bsh storage) and nothing inside.
    Differences from Korthikanti et al. (see korthikanti_layer_terms): the paper drops the
    LayerNorm statistics (we keep 2 x 2bs of them per block); it counts "Q and K" and "V" as
    4sbh + 2sbh, which here are the copies matmul makes, so the totals agree. The causal mask
    is in neither: here it is a buffer (state, L*s^2 bytes for the model), not an activation.
    fp8: every Linear (precision.FP8Linear) saves its input as E4M3, 1 byte per element, plus its
      two FP32 scales (one 8-byte storage); everything else stays BF16.
    """
    b, s, h, a = sh.b, sh.s, sh.h, sh.a
    e, es, em = act_bytes(sh.precision), _stat_bytes(sh), _mask_bytes(sh)
    el = 1 if sh.precision == "fp8" else e  # bytes per element of a saved Linear input
    bsh, drop = b * s * h, sh.dropout > 0
    t = [("ln_1 input", bsh * e), ("ln_1 mean+rstd", 2 * b * s * es), ("c_attn input", bsh * el)]
    if policy == "selective":
        t += [("q,k,v (recompute inputs)", 3 * bsh * e)]
    elif sh.attn == "manual":
        t += [("Q, K copies for QK^T", 2 * bsh * e), ("softmax output", a * s * s * b * e)]
        if drop:
            t += [("attention dropout mask", a * s * s * b * em), ("attention dropout output", a * s * s * b * e)]
        t += [("V copy for att@V", bsh * e)]
    elif sh.device == "cpu" and drop:
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
        lse_s = s if (sh.device == "cpu" or e != 4) else 32 * math.ceil(s / 32)  # CUDA mem-efficient pads
        t += [("q,k,v (c_attn output)", 3 * bsh * e), ("sdpa output = c_proj input", bsh * e),
              ("sdpa logsumexp (fp32)", b * a * lse_s * 4)]
    if policy == "selective" or sh.attn == "manual" or (sh.device == "cpu" and drop):
        t += [("c_proj input", bsh * el)]
    if drop:
        t += [("residual dropout mask", bsh * em)]
    t += [("ln_2 input", bsh * e), ("ln_2 mean+rstd", 2 * b * s * es), ("c_fc input", bsh * el),
          ("GELU input", 4 * bsh * e), ("MLP c_proj input (GELU output)", 4 * bsh * el)]
    if drop:
        t += [("MLP dropout mask", bsh * em)]
    if sh.precision == "fp8":
        t += [("FP8 scales (x_scale, w_scale) x 4 Linears", 4 * 8)]
    return t


def head_activation_terms(sh):
    """[(term, bytes)] saved outside the blocks: embeddings, final LayerNorm, tied head, loss.
    The loss is computed on logits.float(), so log-softmax keeps b*s*V FP32 values whatever
    the precision -- at V=50257 that is the largest single activation of a small GPT."""
    b, s, h, V = sh.b, sh.s, sh.h, sh.V
    e = act_bytes(sh.precision)
    t = [("token ids (wte)", b * s * 8), ("positions (wpe)", s * 8)]
    if sh.dropout > 0:
        t += [("embedding dropout mask", b * s * h * _mask_bytes(sh))]
    t += [("ln_f input", b * s * h * e), ("ln_f mean+rstd", 2 * b * s * _stat_bytes(sh)),
          ("head input (ln_f output)", b * s * h * e), ("log-softmax output (fp32)", b * s * V * 4),
          ("targets", b * s * 8), ("loss total_weight", 4)]
    return t


def units(sh):
    """Recompute units (lists of block indices) for full/sqrt; checkpoint.segments decides."""
    return checkpoint.segments(sh.L, sh.ckpt, sh.segment)


def activation_terms(sh):
    """[(term, bytes)] for the whole model after forward, under sh.ckpt."""
    head = head_activation_terms(sh)
    if sh.ckpt in ("full", "sqrt"):
        n = len(units(sh))  # Recompute keeps each unit's input, b*s*h values, and nothing else
        blocks = [(f"unit inputs ({n} x bsh)", n * sh.b * sh.s * sh.h * act_bytes(sh.precision))]
    else:
        per = block_activation_terms(sh, sh.ckpt)
        blocks = [(f"{name} (x{sh.L} blocks)", sh.L * v) for name, v in per]
    return blocks + head


def activation_bytes(sh):
    return sum(v for _, v in activation_terms(sh))


def korthikanti_layer_terms(s, b, h, a):
    """The literature's per-layer breakdown (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", sec. 4.1): 16-bit activations, 1-byte dropout
    masks, LayerNorm statistics ignored. Sum: s*b*h*(34 + 5*a*s/h)."""
    return [("attention: QKV input", 2 * s * b * h), ("attention: Q and K", 4 * s * b * h),
            ("attention: softmax output", 2 * a * s * s * b), ("attention: softmax dropout mask", a * s * s * b),
            ("attention: dropout output", 2 * a * s * s * b), ("attention: V", 2 * s * b * h),
            ("attention: output-projection input", 2 * s * b * h), ("attention: dropout mask", s * b * h),
            ("MLP: first Linear input", 2 * s * b * h), ("MLP: GELU input", 8 * s * b * h),
            ("MLP: second Linear input", 8 * s * b * h), ("MLP: dropout mask", s * b * h),
            ("LayerNorms: inputs", 4 * s * b * h)]


# the paper's attention-core terms, the ones that grow with a*s^2: what selective recompute drops
KORTHIKANTI_CORE = frozenset({"attention: softmax output", "attention: softmax dropout mask",
                              "attention: dropout output"})


def korthikanti_layer_bytes(s, b, h, a, policy="none"):
    """Per-layer bytes from korthikanti_layer_terms: none = all terms, sbh(34 + 5as/h); selective =
    all but the a*s^2 attention-core terms (KORTHIKANTI_CORE), 34sbh; full = the layer's 16-bit
    input only, 2sbh. (Our block: the LayerNorm statistics on top, and no mask term: model.py's
    future_mask is a buffer, so the saved mask of masked_fill is a view of it, not an activation.)"""
    if policy == "full":
        return 2 * s * b * h
    terms = korthikanti_layer_terms(s, b, h, a)
    assert KORTHIKANTI_CORE <= {n for n, _ in terms}
    return sum(v for n, v in terms if policy != "selective" or n not in KORTHIKANTI_CORE)


# ---------------------------------------------------------------- the peak

def peak_estimate(sh, shard=1):
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
    st = state_bytes(sh)
    e, (P, _) = act_bytes(sh.precision), param_count(sh)
    low = e != 4
    static = (st["parameters"] + st["buffers"] + st["fp8_weights"] + st["master"] + st["optimizer"]
              + (st["gradients"] - e * P))
    if shard > 1:
        static = static // shard + 2 * e * (12 * sh.h * sh.h)  # + one block gathered (and its grad)
    P_here = P // shard
    block_params = 12 * sh.h * sh.h + (13 * sh.h if sh.bias else 2 * sh.h)
    head = sum(v for _, v in head_activation_terms(sh))
    # in flight inside one block's backward: the incoming b*s*h gradient plus the largest pair of
    # gradients alive together: softmax's input and output gradients (manual attention,
    # a*s^2*b each) or GELU's (4bsh each)
    core_grads = 2 * sh.a * sh.s * sh.s * sh.b * e if sh.attn == "manual" else 0
    # (measured to matter under full/sqrt, where the recomputed internals sit on top of it;
    # without recompute the block frees its saved tensors as fast as these appear)
    grad_flow = sh.b * sh.s * sh.h * e
    if sh.ckpt in ("full", "sqrt"):
        grad_flow += max(core_grads, 8 * sh.b * sh.s * sh.h * e)
    points = [(static + activation_bytes(sh) + 2 * 4 * sh.b * sh.s * sh.V,
               "start of backward", "static + all activations + FP32 logit gradients")]
    none_block = sum(v for _, v in block_activation_terms(sh, "none"))
    grads_head = e * (P - sh.L * block_params) // shard
    if sh.ckpt in ("full", "sqrt"):
        groups = units(sh)
        kept = [sh.b * sh.s * sh.h * e] * len(groups)
        extra = [len(g) * none_block + fp8_weight_copies(sh)[1] for g in groups]
    else:
        groups = [[i] for i in range(sh.L)]
        kept = [sum(v for _, v in block_activation_terms(sh, sh.ckpt))] * sh.L
        core = none_block - sum(v for _, v in block_activation_terms(sh, "selective")) + 3 * sh.b * sh.s * sh.h * e
        extra = [core if sh.ckpt == "selective" else 0] * sh.L
    done = grads_head
    for u in reversed(range(len(groups))):
        alive = static + sum(kept[:u + 1]) + done + extra[u] + grad_flow + (head - head_activation_terms_tail(sh))
        points.append((alive, f"backward through unit {u}" if len(groups) > 1 else "backward through block 0",
                       "static + activations of earlier units + gradients so far + recomputed internals"))
        done += e * len(groups[u]) * block_params // shard
    # with FP32 accumulation the master gradients *are* the buffers (already in static)
    grads_at_step = 0 if (sh.fp32_grad_accum and low) else e * P_here + (4 * P_here if low else 0)
    step = static + grads_at_step + 4 * P_here
    points.append((step, "optimizer step (AdamW)",
                   "static + gradients" + (" + FP32 master gradients" if low else "") + " + AdamW temporaries"))
    return max(points, key=lambda p: p[0])


def head_activation_terms_tail(sh):
    """The part of head_activation_terms freed once backward has left the head (all but the embedding's)."""
    keep = ("token ids (wte)", "positions (wpe)", "embedding dropout mask")
    return sum(v for n, v in head_activation_terms(sh) if n not in keep)


# ---------------------------------------------------------------- measuring on CPU: live tensors

class LiveTensors(TorchDispatchMode):
    """Counts the bytes of distinct live storages on one device, op by op, like CUDA's
    memory_allocated: every op's outputs are registered by storage, and storages whose last
    tensor has died are dropped (checked through weak references before each count)."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.live = {}  # storage id -> (weak ref, bytes)
        self.now = self.peak = 0
        self.phase = self.peak_phase = "start"

    def adopt(self, tensors):
        """Start counting storages made before the tracker was switched on."""
        for t in tensors:
            self._add(t)
        self._count()

    def _add(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != self.device.type or t.is_meta:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ref = StorageWeakRef(st)
        old = self.live.get(ref.cdata)
        if old is None or old[0].expired():
            self.live[ref.cdata] = (ref, st.nbytes())

    def _count(self):
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.now = sum(n for _, n in self.live.values())
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
        return self.now

    def start_phase(self, name):
        self.phase = name

    def reset_peak(self):
        self.peak, self.peak_phase = self._count(), self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_leaves(out):
            self._add(t)
        self._count()
        return out


class CudaAllocator:
    """The same interface on CUDA: the caching allocator's own counters.

    reset=True (memory_ledger.py on its own): every phase starts with reset_peak_memory_stats,
    so max_memory_allocated is that phase's peak.
    reset=False (the summary train.py prints): the process's peak statistics are left alone.
    A phase's peak is then seen only where it lifts max_memory_allocated above everything
    before it, the run's own earlier peak included; once the ledger has lifted it, `peak` is the
    ledger's exact peak. If it never does, `peak` is the highest memory_allocated read at a
    phase boundary, a lower bound, and `hidden` stays True.
    """

    def __init__(self, device, reset=True):
        self.device = torch.device(device)
        self.reset = reset
        self.phase = self.peak_phase = "start"
        self.peak = self.high = 0
        self.hidden = False

    def adopt(self, tensors):
        pass

    def _fold(self):
        hw = torch.cuda.max_memory_allocated(self.device)
        if hw > (self.peak if self.reset else self.high):
            self.peak, self.peak_phase, self.high, self.hidden = hw, self.phase, hw, False

    def start_phase(self, name):
        torch.cuda.synchronize(self.device)
        self._fold()
        self.phase = name
        if self.reset:
            torch.cuda.reset_peak_memory_stats(self.device)

    def reset_peak(self):
        torch.cuda.synchronize(self.device)
        if self.reset:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak, self.peak_phase = torch.cuda.memory_allocated(self.device), self.phase
        self.high = torch.cuda.max_memory_allocated(self.device)
        self.hidden = self.high > self.peak

    @property
    def now(self):
        torch.cuda.synchronize(self.device)
        self._fold()
        allocated = torch.cuda.memory_allocated(self.device)
        if allocated > self.peak:  # only while hidden: a boundary reading is all there is
            self.peak, self.peak_phase = allocated, self.phase
        return allocated

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def storage_bytes(tensors, device=None, exclude=()):
    """Bytes of the distinct storages behind `tensors` (on `device`), skipping ids in `exclude`."""
    seen = {}
    for t in tensors:
        if t is None or (device is not None and t.device.type != torch.device(device).type):
            continue
        st = t.untyped_storage()
        key = StorageWeakRef(st).cdata
        if key not in exclude:
            seen[key] = st.nbytes()
    return sum(seen.values())


def storage_ids(tensors):
    return {StorageWeakRef(t.untyped_storage()).cdata for t in tensors if t is not None}


@contextmanager
def saved_for_backward(exclude):
    """Bytes of the distinct storages autograd saves, skipping the storage ids in `exclude`
    (measure passes those of the parameters, buffers, master weights and optimizer states:
    a saved view of one of them, e.g. masked_fill's view of future_mask, is no activation)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        key = StorageWeakRef(st).cdata
        if key not in exclude:
            seen[key] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def optimizer_tensors(opt):
    return [v for state in opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def measure(model, opt, batch, device, reset_peak_stats=True, baseline=0):
    """Run one forward, backward and optimizer step of (model, opt) on batch, and count.

    Mirrors accumulate.accumulation_step for one micro-step on one rank. Call it when the
    optimizer states already exist (after a first step): that is the steady state.
    Returns measured bytes per component, the phase readings and the peak with its phase.
    parameters, master, optimizer, buffers and gradients are storage sizes on every device
    (gradients: the distinct storages of the .grad tensors, plus the FP32 buffers with
    fp32_grad_accum), so they can match the formulas to the byte. activations: saved-tensor
    storages on CPU, the allocator's growth over the forward on CUDA. Storages of parameters
    and buffers never count as activations.
    CUDA only: reset_peak_stats=False leaves the process's peak statistics alone (see
    CudaAllocator; out["peak_hidden"] says whether the peak is only a lower bound), and
    `baseline` bytes (memory that is not this model's) are taken off the reported peak.
    """
    device = torch.device(device)
    x, y = batch
    params = [p for p in model.parameters()]
    buffers = [bf for bf in model.buffers()]
    # parameter AND buffer storages: a saved view of either (masked_fill's future_mask) is not an activation
    static_ids = storage_ids(params + buffers + opt.master_params + optimizer_tensors(opt))
    cuda = device.type == "cuda"
    tracker = CudaAllocator(device, reset=reset_peak_stats) if cuda else LiveTensors(device)
    out = dict(parameters=storage_bytes(params, device),
               buffers=storage_bytes(buffers, device, exclude=storage_ids(params)),
               master=storage_bytes(opt.master_params, device, exclude=storage_ids(params)) if opt.low_precision else 0,
               optimizer=storage_bytes(optimizer_tensors(opt), device))
    with tracker:
        tracker.adopt(params + buffers + opt.master_params + optimizer_tensors(opt)
                      + (opt.grad_buffers or []) + [x, y])
        tracker.reset_peak()
        before = tracker.now
        tracker.start_phase("forward")
        with saved_for_backward(static_ids) as saved:
            with opt.forward_context():
                logits, loss = model(x, y)
        out_bytes = storage_bytes([logits, loss], device)
        after_fwd = tracker.now
        del logits
        tracker.start_phase("backward")
        opt.backward(loss)
        del loss
        if opt.fp32_grad_accum:
            grads = storage_bytes([p.grad for p in params], device)  # the micro-step's 16-bit grads
            opt.move_grads_to_fp32_buffers()
        after_bwd = tracker.now
        grad_bytes = storage_bytes([p.grad for p in params] + (opt.grad_buffers or []), device)
        if opt.fp32_grad_accum:
            grad_bytes += grads
        tracker.start_phase("optimizer step")
        opt.step()
        end = tracker.now
    out["saved"] = sum(saved.values())
    out["phase"] = dict(before=before, after_forward=after_fwd, after_backward=after_bwd, after_step=end)
    out["gradients"] = grad_bytes  # exact storage sizes, on CUDA too
    if cuda:  # the allocator's deltas: activations are measured by them, the rest is a cross-check
        out["activations"] = after_fwd - before - out_bytes
        out["gradients_allocated"] = after_bwd - before  # ~0 with fp32_grad_accum: the buffers predate it
    else:
        out["activations"] = out["saved"]
    out["peak"], out["peak_phase"] = tracker.peak - baseline, tracker.peak_phase
    out["peak_hidden"] = cuda and tracker.hidden
    return out


# ---------------------------------------------------------------- one ledger run

def random_batch(cfg, device, b=None):
    g = torch.Generator().manual_seed(cfg.seed)
    b = b or cfg.batch_size
    xy = torch.randint(0, 256, (b, cfg.block_size + 1), generator=g)
    return xy[:, :-1].contiguous().to(device), xy[:, 1:].contiguous().to(device)


def run_config(cfg, device):
    """Build cfg's model and optimizer, take one step (the optimizer states appear), measure the second."""
    import accumulate
    model, opt = train.build(cfg, device)
    batch = random_batch(cfg, device)
    accumulate.accumulation_step(model, opt, [batch])
    return measure(model, opt, batch, device)


def predicted(sh):
    st = state_bytes(sh)
    return dict(parameters=st["parameters"], gradients=st["gradients"], master=st["master"],
                optimizer=st["optimizer"], activations=activation_bytes(sh), buffers=st["buffers"])


def compare(sh, meas):
    """[(component, predicted, measured, relative error, ok)] and whether all passed."""
    pred, rows, tol = predicted(sh), [], ACT_TOL[sh.device]
    for k in COMPONENTS + ("buffers",):
        p, m = pred[k], meas[k]
        err = abs(m - p) / max(p, 1)
        ok = m == p if k in EXACT or k == "buffers" else err <= tol
        rows.append((k, p, m, err, ok))
    return rows, all(r[4] for r in rows)


def fmt_bytes(n):
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def format_comparison(sh, rows, meas):
    tol = ACT_TOL[sh.device]
    lines = [f"memory ledger: precision {sh.precision}, ckpt {sh.ckpt}, attn {sh.attn}, L={sh.L} h={sh.h} "
             f"a={sh.a} s={sh.s} b={sh.b} dropout={sh.dropout}, device {sh.device}",
             f"{'component':12} {'predicted':>14} {'measured':>14} {'rel.err':>8}  check"]
    for k, p, m, err, ok in rows:
        rule = "exact" if k in EXACT or k == "buffers" else f"<= {100 * tol:g}%"
        lines.append(f"{k:12} {p:14,d} {m:14,d} {100 * err:7.2f}%  {'ok' if ok else 'MISS'} ({rule})")
    pk, where, alive = peak_estimate(sh)
    err = abs(meas["peak"] - pk) / max(pk, 1)
    seen = ("at least (hidden under the run's earlier peak), last read in: " if meas.get("peak_hidden")
            else "measured in: ")
    lines.append(f"{'peak':12} {pk:14,d} {meas['peak']:14,d} {100 * err:7.2f}%  estimate, not checked "
                 f"({seen}{meas['peak_phase']}; predicted at {where}: {alive})")
    return "\n".join(lines)


def summary_after_first_step(cfg, model, opt, batch, device):
    """train.py calls this once after the first optimizer step: the ledger on a deep copy of
    (model, optimizer), so the run's weights, gradients, optimizer and RNG states are untouched.

    Its cost: while it runs, the copy's parameters, master weights and optimizer states sit
    next to the run's own (twice the static memory; train.report_memory catches the OOM).
    CUDA: the peak statistics are NOT reset (CudaAllocator(reset=False)); the ledger's peak is
    read from max_memory_allocated as it rises and reported relative to what was allocated
    before the copy (the batch excepted, which the copy uses too). What cannot be avoided
    without a reset: if the ledger rose above the run's earlier peak, max_memory_allocated --
    the progress line's peak -- now holds the ledger's (copy included) for the rest of the
    run; the returned text says so with both numbers. If it did not, the ledger's own peak is
    hidden and shown as a lower bound. On CPU nothing global is read or changed.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
    baseline = run_peak = 0
    if cuda:
        torch.cuda.synchronize(device)
        run_peak = torch.cuda.max_memory_allocated(device)
        baseline = torch.cuda.memory_allocated(device) - storage_bytes(list(batch), device)
    model2 = opt2 = None
    try:
        model2, opt2 = copy.deepcopy((model, opt))  # one memo: the copy's optimizer holds the copy's params
        meas = measure(model2, opt2, batch, device, reset_peak_stats=False, baseline=baseline)
    finally:
        model2 = opt2 = None  # free the copy before anything else (an OOM handler included)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
    sh = Shape.from_config(cfg, device, b=batch[0].shape[0], s=batch[0].shape[1])
    rows, _ = compare(sh, meas)
    text = format_comparison(sh, rows, meas)
    if cuda:
        after = torch.cuda.max_memory_allocated(device)
        if after > run_peak:
            text += (f"\nnote: peak stats not reset; CUDA max_memory_allocated (the progress line's peak) rose "
                     f"from {fmt_bytes(run_peak)} (the run) to {fmt_bytes(after)} (the run + this ledger's "
                     f"copy) and stays there")
        else:
            text += f"\nnote: peak stats not reset; max_memory_allocated stays the run's {fmt_bytes(run_peak)}"
    return text


# ---------------------------------------------------------------- the chapter's table

def components(sh):
    """The chapter's four components for sh (master weights folded into optimizer states;
    buffers and any persistent FP8 weight copies into parameters)."""
    st = state_bytes(sh)
    return dict(parameters=st["parameters"] + st["buffers"] + st["fp8_weights"], gradients=st["gradients"],
                optimizer=st["master"] + st["optimizer"], activations=activation_bytes(sh))


def _measured_components(m):
    return dict(parameters=m["parameters"] + m["buffers"], gradients=m["gradients"],
                optimizer=m["master"] + m["optimizer"], activations=m["activations"])


def technique_rows(cfg, device, ranks=8, tp=8, pp=8, cp=4, measure_runs=True):
    """[(technique, {component: bytes per GPU}, how)] for cfg's shape. how: "measured" when
    this project runs the technique (one ledger run on this machine), else "formula".

    Gradient accumulation: K = cfg.accum when > 1 (else 4); the row is the same batch of
    b sequences taken in K micro-batches of ceil(b/K), so only the activations shrink.
    FP8: native is measured (whatever cfg.fp8_backend says) where torch._scaled_mm runs on the
    device, else a formula row; Transformer Engine is a formula row: native's activations
    (an approximation: TE's saved tensors are its own) plus its cached FP8 weight copies
    (fp8_weight_copies), counted under parameters.

    Formulas for the techniques run elsewhere (per GPU, N = ranks, P parameters):
      ZeRO-1 optimizer states / N; ZeRO-2 also gradients / N; ZeRO-3 (FSDP) also parameters / N.
      TP t: block weights / t (embeddings vocab-parallel / t too); activations per Korthikanti:
        the terms inside the column/row-parallel regions / t, the rest (LayerNorm and Linear
        inputs, dropout masks) replicated. SP on top of TP: the replicated ones / t as well.
      PP p: parameters, gradients, optimizer / p (L/p layers per stage); activations: with 1F1B
        the first stage holds p micro-batches of L/p layers = L layers' worth: unchanged.
      CP c: every activation term scales with s, each rank holds s/c of the sequence: / c.
      CPU offload (ZeRO-Offload): FP32 master, AdamW states and the gradients live in CPU memory.
    """
    base = Shape.from_config(cfg, device)
    runs = {}

    def row(name, sh, runnable=True):
        pred = components(sh)
        if measure_runs and runnable:
            key = (sh.precision, sh.ckpt, sh.b)
            if key not in runs:
                c = replace(cfg, precision=sh.precision, ckpt=sh.ckpt, batch_size=sh.b, ledger=False,
                            fp8_backend="native")
                runs[key] = _measured_components(run_config(c, torch.device(device)))
            return (name, runs[key], "measured")
        return (name, pred, "formula")

    fp8_ok = cfg.n_embd % 16 == 0 and precision.E4M3 is not None
    rows = [row("FP32 baseline", replace(base, precision="fp32", ckpt="none", fp32_grad_accum=False)),
            row("BF16 mixed precision", replace(base, precision="bf16", ckpt="none"))]
    if fp8_ok:
        fp8_runs = precision.fp8_matmul_error(torch.device(device)) is None  # e.g. False on a pre-sm89 GPU
        rows.append(row("FP8 (native)", replace(base, precision="fp8", ckpt="none", fp8_backend="native"),
                        runnable=fp8_runs))
        rows.append(row("FP8 (Transformer Engine)", replace(base, precision="fp8", ckpt="none", fp8_backend="te"),
                        runnable=False))
    cur = replace(base, ckpt="none")
    accum = cfg.accum if cfg.accum > 1 else 4
    if cfg.batch_size > 1:
        micro = -(-cfg.batch_size // accum)
        rows.append(row(f"grad accumulation K={accum} (micro-b {micro})", replace(cur, b=micro)))
    rows.append(row("full checkpointing", replace(cur, ckpt="full")))
    rows.append(row("sqrt checkpointing", replace(cur, ckpt="sqrt")))
    if cfg.attn == "manual":
        rows.append(row("selective checkpointing", replace(cur, ckpt="selective")))
    c = components(cur)
    z = dict(c)
    z["optimizer"] //= ranks
    rows.append((f"ZeRO-1 over {ranks}", dict(z), "formula"))
    z["gradients"] //= ranks
    rows.append((f"ZeRO-2 over {ranks}", dict(z), "formula"))
    z["parameters"] //= ranks
    rows.append((f"ZeRO-3 over {ranks}", dict(z), "formula"))
    rows.append((f"tensor parallel t={tp}", tp_components(cur, tp, sp=False), "formula"))
    rows.append((f"TP t={tp} + sequence parallel", tp_components(cur, tp, sp=True), "formula"))
    rows.append((f"pipeline parallel p={pp}", dict(parameters=c["parameters"] // pp, gradients=c["gradients"] // pp,
                                                  optimizer=c["optimizer"] // pp, activations=c["activations"]),
                 "formula"))
    rows.append((f"context parallel c={cp}", dict(c, activations=c["activations"] // cp), "formula"))
    rows.append(("CPU offload (ZeRO-Offload)", dict(c, gradients=0, optimizer=0), "formula"))
    return rows


# block_activation_terms by name, for TP: inside the column/row-parallel regions (split over t)
# or replicated on every rank. Every term must be in exactly one set: tp_components raises on a
# term it cannot place, so renaming or adding a term cannot silently change the TP numbers.
TP_SPLIT = frozenset({
    "Q, K copies for QK^T", "softmax output", "attention dropout mask", "attention dropout output",
    "V copy for att@V", "q,k,v (recompute inputs)", "q,k,v (c_attn output)", "sdpa output = c_proj input",
    "sdpa logsumexp (fp32)", "sdpa-math Q, K copies (fp32)", "sdpa-math softmax (fp32)",
    "sdpa-math dropout mask (fp32)", "sdpa-math dropout output (fp32)", "sdpa-math V copy (fp32)",
    "c_proj input", "GELU input", "MLP c_proj input (GELU output)"})
TP_REPLICATED = frozenset({
    "ln_1 input", "ln_1 mean+rstd", "c_attn input", "residual dropout mask", "ln_2 input", "ln_2 mean+rstd",
    "c_fc input", "MLP dropout mask", "FP8 scales (x_scale, w_scale) x 4 Linears"})


def tp_components(sh, t, sp):
    """Per-GPU components under tensor parallelism t (Megatron), with or without sequence parallel."""
    c = components(sh)
    P, _ = param_count(sh)
    split = 12 * sh.h * sh.h * sh.L + sh.V * sh.h  # Linear weights and the vocab-parallel embedding
    frac = (split / t + (P - split)) / P
    acts = 0
    for name, v in block_activation_terms(sh, sh.ckpt if sh.ckpt == "selective" else "none"):
        if name not in TP_SPLIT and name not in TP_REPLICATED:
            raise KeyError(f"block term {name!r} is in neither TP_SPLIT nor TP_REPLICATED")
        acts += v // t if (sp or name in TP_SPLIT) else v
    acts *= sh.L
    if sh.ckpt in ("full", "sqrt"):
        acts = len(units(sh)) * sh.b * sh.s * sh.h * act_bytes(sh.precision) // (t if sp else 1)
    acts += sum(v for _, v in head_activation_terms(sh)) // t  # vocab-parallel logits
    return dict(parameters=int(c["parameters"] * frac), gradients=int(c["gradients"] * frac),
                optimizer=int(c["optimizer"] * frac), activations=acts)


def format_table(rows):
    lines = [f"{'technique':34} {'parameters':>12} {'gradients':>12} {'optim+master':>12} {'activations':>12} "
             f"{'total':>12}  how"]
    for name, c, how in rows:
        total = sum(c[k] for k in ("parameters", "gradients", "optimizer", "activations"))
        lines.append(f"{name:34} " + " ".join(f"{fmt_bytes(c[k]):>12}" for k in
                                              ("parameters", "gradients", "optimizer", "activations"))
                     + f" {fmt_bytes(total):>12}  {how}")
    return "\n".join(lines)


# ---------------------------------------------------------------- what-if: shapes that do not fit here

BIG_SHAPES = {  # name: (L, h, a, s, V), GPT-2-style blocks as in model.py
    "GPT-2 XL": (48, 1600, 25, 1024, 50257),
    "7B": (32, 4096, 32, 4096, 32000),
    "175B (GPT-3)": (96, 12288, 96, 2048, 50257),
}


def meta_param_count(L, h, a, s, V, bias=True):
    """P of model.GPT built on the meta device (no memory): the cross-check of param_count."""
    with torch.device("meta"):
        m = GPT(GPTConfig(block_size=s, vocab_size=V, n_layer=L, n_head=a, n_embd=h, bias=bias))
    return sum(p.numel() for p in m.parameters())


def largest_micro_batch(sh, gpu_bytes, shard=1, limit=1 << 16):
    """Largest b whose estimated peak fits gpu_bytes (0 if not even b=1 fits)."""
    fits = lambda b: peak_estimate(replace(sh, b=b), shard)[0] <= gpu_bytes
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def what_if(gpu_gib=80, ranks=8, precision_name="bf16"):
    """[(shape, P, meta P, ckpt, zero, per-GPU static bytes, activations at b=1, largest b)] on CUDA."""
    out = []
    for name, (L, h, a, s, V) in BIG_SHAPES.items():
        for ckpt in ("none", "selective", "full"):
            for zero in (0, 3):
                sh = Shape(L=L, h=h, a=a, s=s, b=1, V=V, precision=precision_name, ckpt=ckpt, attn="manual",
                           device="cuda")
                c = components(sh)
                static = (c["parameters"] + c["gradients"] + c["optimizer"]) // (ranks if zero else 1)
                b = largest_micro_batch(sh, gpu_gib * 2 ** 30, shard=ranks if zero else 1)
                out.append((name, param_count(sh)[0], ckpt, f"ZeRO-3/{ranks}" if zero else "none", static,
                            c["activations"], b))
    return out


def format_what_if(rows, gpu_gib):
    lines = [f"what-if (bf16 + AdamW, manual attention, CUDA dtypes; largest micro-batch on a {gpu_gib} GiB GPU):",
             f"{'shape':14} {'params':>9} {'ckpt':>9} {'states':>9} {'per-GPU states':>15} "
             f"{'activations b=1':>16} {'max b':>6}"]
    for name, P, ckpt, zero, static, act, b in rows:
        lines.append(f"{name:14} {P / 1e9:8.2f}B {ckpt:>9} {zero:>9} {fmt_bytes(static):>15} "
                     f"{fmt_bytes(act):>16} {b:6d}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the picture

COLORS = dict(parameters="#4e79a7", gradients="#f28e2b", optimizer="#e15759", activations="#59a14f")


def svg(rows, title):
    """Stacked horizontal bars, one per technique, hand-written SVG."""
    keys = ("parameters", "gradients", "optimizer", "activations")
    total = lambda c: sum(c[k] for k in keys)
    top = max(total(c) for _, c, _ in rows) or 1
    W, left, bar, gap, head = 900, 260, 18, 8, 50
    H = head + len(rows) * (bar + gap) + 40
    scale = (W - left - 120) / top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<text x="10" y="20" font-size="14" font-weight="bold">{_esc(title)}</text>']
    x = 10
    for k in keys:
        out.append(f'<rect x="{x}" y="30" width="12" height="12" fill="{COLORS[k]}"/>'
                   f'<text x="{x + 16}" y="40">{k}</text>')
        x += 120
    for i, (name, c, how) in enumerate(rows):
        y = head + i * (bar + gap)
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_esc(name)}'
                   f'{"" if how == "measured" else " *"}</text>')
        x = left
        for k in keys:
            w = c[k] * scale
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{COLORS[k]}">'
                       f'<title>{k}: {fmt_bytes(c[k])}</title></rect>')
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + 13}">{fmt_bytes(total(c))}</text>')
    out.append(f'<text x="10" y="{H - 12}">* computed from formulas (not run here); the rest measured. '
               f'Bytes per GPU.</text></svg>')
    return "\n".join(out) + "\n"


def _esc(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ---------------------------------------------------------------- main

LEDGER_FLAGS = dict(ranks=8, tp=8, pp=8, cp=4, gpu_gib=80, table="measure")


def split_args(argv):
    """(ledger options, the rest for train.parse_args)."""
    opts, rest = dict(LEDGER_FLAGS), []
    for arg in argv:
        key, eq, text = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key in LEDGER_FLAGS:
            if key == "table":
                if text not in ("measure", "formula"):
                    raise train.UsageError(f"--table expects measure|formula, got {text!r}")
                opts[key] = text
                continue
            try:
                opts[key] = int(text)
            except ValueError:
                raise train.UsageError(f"--{key} expects an integer, got {text!r}") from None
            if opts[key] < 1:
                raise train.UsageError(f"--{key} must be >= 1, got {opts[key]}")
        else:
            rest.append(arg)
    return opts, rest


def main(argv):
    """Bad input of any kind (flags, config, an fp8 setting the FP8 row would trip on, an
    unwritable out_dir) is one line 'error: ...' on stderr and exit status 2; all measuring
    happens before anything is printed, so such an error leaves stdout empty."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        opts, rest = split_args(argv)
        cfg = train.parse_args(rest)
        if cfg.precision == "fp8" and cfg.fp8_backend == "te":
            raise train.UsageError("the ledger measures fp8_backend=native only (Transformer Engine's cached FP8 "
                                   "weights are a formula row of its table); use --fp8_backend=native")
        if cfg.n_embd % 16 == 0 and precision.E4M3 is not None:  # the table's FP8 row: fail now, not midway
            precision.linear_factory(replace(cfg, precision="fp8", fp8_backend="native"))
        device = train.pick_device(cfg)
        meas = run_config(cfg, device)
        table = technique_rows(cfg, device, opts["ranks"], opts["tp"], opts["pp"], opts["cp"],
                               measure_runs=opts["table"] == "measure")
        path = Path(cfg.out_dir) / "memory_ledger.svg"
        picture = svg(table, f"memory per GPU by technique: L={cfg.n_layer} h={cfg.n_embd} "
                             f"s={cfg.block_size} b={cfg.batch_size}")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        train.write_atomically(path, lambda fh: fh.write(picture.encode()))
    except (train.UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the SVG under --out_dir: {e}", file=sys.stderr)
        return 2
    sh = Shape.from_config(cfg, device)
    rows, ok = compare(sh, meas)
    print(format_comparison(sh, rows, meas))
    print()
    print("activations, term by term (bytes after forward):")
    for name, v in activation_terms(sh):
        print(f"  {name:48} {v:14,d}")
    print()
    print(f"four components x techniques (per GPU, this config, precision {cfg.precision} unless named):")
    print(format_table(table))
    print()
    wi = what_if(opts["gpu_gib"], opts["ranks"])
    print(format_what_if(wi, opts["gpu_gib"]))
    for name, (L, h, a, s, V) in BIG_SHAPES.items():
        n, m = param_count(Shape(L=L, h=h, a=a, s=s, b=1, V=V))[0], meta_param_count(L, h, a, s, V)
        print(f"  {name}: formula {n:,} parameters, model.GPT on the meta device {m:,}: "
              f"{'same' if n == m else 'DIFFERENT'}")
        ok = ok and n == m
    print(f"\nwrote {path}")
    if not ok:
        print("ledger: some component missed its tolerance", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
