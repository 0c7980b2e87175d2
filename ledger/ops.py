"""The ops a description of the model is written in: what each of PyTorch's ops allocates and
saves for backward, forward and backward, on CPU and on CUDA.

Chapter sections 3 and 4 (activation memory; the ledger's peak). Read memory_ledger.py
first (the model, described in these ops), then ledger/walk.py (how a description runs).
This file knows PyTorch, not our model: that native_layer_norm keeps its input, mean and
rstd; that torch.matmul on (B, a, T, d) head views copies them; what each sdpa kernel keeps;
where CUDA's dtypes differ from CPU's. Each op's steps were read op by op off LiveTensors
(ledger/measure.py), and the tests hold the walk's peak to the measured one.

An op allocates its outputs (a point of the walk), records a Node saving what PyTorch's
saves (with grad enabled), and returns its outputs' Tensors; each `_..._backward` is its
Node's rule: it allocates the input gradients and returns them. Parameters and buffers an
op holds are declared as it runs (memory_ledger's parameter count and buffers sum them).
"""
import math
from dataclasses import dataclass

from ledger import fp8_ops, sdpa_math
from ledger.pointwise import NORM, Pointwise, _pointwise_backward


@dataclass(frozen=True)
class Sizes:
    """What the ops need to know of a run (memory_ledger.sizes builds it from a Config)."""
    L: int
    b: int
    s: int
    h: int
    a: int
    V: int
    e: int  # bytes per parameter, activation and gradient element
    attn: str  # "manual" | "sdpa"
    bias: bool
    drop: bool  # dropout > 0
    cuda: bool  # CUDA's dtypes and kernels (else CPU's)
    loss_scaled: bool  # the loss scaler multiplies the loss
    fp8: str = None  # None | "native" (fp8_refined.FP8Linear) | "te" (Transformer Engine's Linear, walked as ours)
    fp8_e5m2: bool = False  # the FP8 backward quantizes the output gradient to E5M2 (fp8_grad=e5m2)
    fp8_history: int = 16  # amax history length of our FP8Linear's buffers
    rerun_stops_early: bool = True  # a recompute unit's re-run stops after its last saved tensor
    dtype: str = None  # the activations' dtype, by torch's name ("float32", "bfloat16", "float16")

    @property
    def bsh(self):
        return self.b * self.s * self.h

    @property
    def core(self):
        """The attention kernel: "manual" (model.py's own ops), "sdpa" (a fused kernel: flash or
        memory-efficient) or "math" (CPU sdpa with dropout: torch's math path, in FP32)."""
        if self.attn == "manual":
            return "manual"
        return "math" if (not self.cuda and self.drop) else "sdpa"

    @property
    def stat_bytes(self):
        """LayerNorm's mean and rstd per token: the activation dtype on CPU (measured), FP32 on
        CUDA: layer_norm_cuda allocates them in the accumulate type, float for half and bfloat16
        inputs (aten/src/ATen/native/cuda/layer_norm_kernel.cu)."""
        return 4 if self.cuda else self.e

    @property
    def mask_bytes(self):
        """Dropout's saved mask per element. CPU: dropout is input * (bernoulli noise / (1-p)) and
        the mul saves the noise, in the input dtype (measured). CUDA: the fused native_dropout
        saves a bool mask (native_dropout_cuda -> dropout_cuda<bool>, aten/src/ATen/native/cuda/Dropout.cu)."""
        return 1 if self.cuda else self.e

    @property
    def lse_rows(self):
        """Rows of sdpa's FP32 logsumexp per (b, a). CUDA fp32 runs the memory-efficient kernel,
        which pads them to 32*ceil(s/32) (kAlignLSE = 32, the block size of its backward: the
        logsumexp allocation in _efficient_attention_forward, aten/src/ATen/native/transformers/
        cuda/attention.cu); 16-bit runs flash attention, whose softmax_lse is s rows; CPU's flash
        kernel keeps s rows."""
        return 32 * math.ceil(self.s / 32) if (self.cuda and self.e == 4) else self.s


class Ops(Pointwise):
    """The Graph with PyTorch's ops: the description calls these (g.layer_norm(...), ...); the
    elementwise ones (add, dropout, gelu, mul, nn.RMSNorm's, ...) are ledger/pointwise.py's."""

    # ---------------------------------------------------------------- the norm

    def layer_norm(self, name, x):
        """nn.LayerNorm: native_layer_norm saves its input and the per-token mean and rstd."""
        z = self.sizes
        self.declare("param", name + ".weight", z.h)
        if z.bias:
            self.declare("param", name + ".bias", z.h)  # vectors: replicated under TP, no weight decay
        stats, stat = z.b * z.s * z.stat_bytes, "float32" if z.cuda else x.dtype
        mean, rstd, out = self.alloc(name, (name + " mean", stats, stat), (name + " rstd", stats, stat),
                                     (name + " output", x.nbytes), region=x.region, dtype=x.dtype)
        with self.kept_by(NORM):
            self.record(name, [x], [out], _norm_backward, saved=[(x, name + " input"), (mean, name + " mean"),
                                                                  (rstd, name + " rstd")], nbytes=x.nbytes)
        return out

    # ---------------------------------------------------------------- Linears

    def linear(self, name, x, n_out, split=None):
        """nn.Linear, x (M, n_in) -> (M, n_out): addmm saves x itself. Our FP8Linear instead (fp8_ops.py)
        where the run is fp8. split: how Megatron's TP splits it, "column" (its output and bias)
        or "row" (its input; the output is whole again, all-reduced)."""
        z = self.sizes
        M = z.b * z.s
        n_in = x.nbytes // (M * z.e)
        self.declare("param", name + ".weight", n_in * n_out, matrix=True, split=bool(split))
        if z.bias:
            self.declare("param", name + ".bias", n_out, split=split == "column")
        region = x.region if split is None else split == "column"
        if z.fp8:
            return fp8_ops.linear(self, name, x, n_in, n_out, region)
        out = self.new(name + " forward", name + " output", M * n_out * z.e, region=region)
        self.record(name, [x], [out], _linear_backward, saved=[(x, name + " input")], n_in=n_in, n_out=n_out)
        return out

    def tied_head(self, name, x, weight, n_out):
        """x @ weight.t() with a weight another module owns (the output head is wte): saves x."""
        z = self.sizes
        self.declare("tied", weight, n_out * z.h)
        out = self.new(name, name + " output", z.b * z.s * n_out * z.e, region=True)  # vocab-parallel under TP
        self.record(name, [x], [out], _tied_head_backward, saved=[(x, name + " input")], weight=weight,
                    n_out=n_out, nbytes=x.nbytes)
        return out

    # ---------------------------------------------------------------- attention

    def split_heads(self, name, qkv, sizes=None):
        """qkv.split(C, dim=2) and each .view(B, T, a, d).transpose(1, 2): three (B, a, T, d) views.
        sizes: the three's bytes where they differ (grouped-query attention's k and v: fewer heads)."""
        sizes = sizes or (qkv.nbytes // 3,) * 3
        q, k, v = (qkv.view(n, "heads") for n in sizes)
        self.record(name, [qkv], [q, k, v], _split_heads_backward, sizes=sizes)
        return q, k, v

    def repeat_heads(self, name, x, times, heads):
        """x.repeat_interleave(times, dim=1) of `heads` (B, heads, T, d) heads: a head-major copy,
        nothing saved; backward sums the copies' gradients back to x's size (ExpandBackward0)."""
        out = self.new(name, name + " output", x.nbytes * times, region=x.region, layout="head-major", dtype=x.dtype)
        self.record(name, [x], [out], _repeat_heads_backward, nbytes=x.nbytes, heads=heads)
        return out

    def merge_heads(self, name, y):
        """y.transpose(1, 2).contiguous().view(B, T, C): a copy of a head-major output; sdpa's
        kernels lay theirs out as (B, T, a, d) already, and contiguous() copies nothing."""
        if y.layout == "sdpa":
            out = y.view(layout="rows")
        else:
            out = self.new(name + " y contiguous", name + " y contiguous", y.nbytes, region=y.region, dtype=y.dtype)
        self.record(name, [y], [out], _merge_heads_backward)
        return out

    def matmul(self, name, a, b, nbytes, names=("a", "b")):
        """torch.matmul of (B, a, T, x)-shaped operands: it folds them to a batched bmm, copying an
        operand in "heads" layout (a transposed view) to a contiguous one, except for one
        sequence (b = 1, where the fold is a view); the bmm saves both operands it multiplies.
        names: what the operands are, for the saved terms."""
        z = self.sizes
        operands = dict(zip(names, (a, b)))
        copied = [k for k, t in operands.items() if t.layout == "heads" and z.b > 1]
        if copied:
            copies = self.alloc(name + ": copies", *((f"{name} {k} copy", operands[k].nbytes, operands[k].dtype)
                                                     for k in copied), region=a.region)
            operands.update(zip(copied, copies))
            del copies
        out = self.new(name, name + " output", nbytes, region=a.region, layout="head-major", dtype=a.dtype)
        saved = [(t, f"{name} {k} copy" if k in copied else f"{name} {k}") for k, t in operands.items()]
        self.record(name, [a, b], [out], _matmul_backward, saved=saved, sizes=(a.nbytes, b.nbytes))
        return out

    def sdpa(self, name, q, k, v):
        """F.scaled_dot_product_attention, causal. A fused kernel (flash, memory-efficient) keeps
        q, k, v (views of c_attn's output), its output and an FP32 logsumexp per (b, a, s) row,
        never the s x s softmax; CPU with dropout takes the math path (_sdpa_math)."""
        z = self.sizes
        if z.core == "math":
            return sdpa_math.forward(self, name, q, k, v)
        out, lse = self.alloc(name + " forward", (name + " output", z.bsh * z.e),
                              (name + " logsumexp (fp32)", z.b * z.a * z.lse_rows * 4, "float32"), region=True,
                              layout="sdpa", dtype=q.dtype)
        self.record(name, [q, k, v], [out], _sdpa_backward,
                    saved=[(q, "q"), (k, "k"), (v, "v"), (out, name + " output"),
                           (lse, name + " logsumexp (fp32)")])
        return out

    # ---------------------------------------------------------------- the model's ends

    def positions(self, name, nbytes):
        """torch.arange(T) in GPT.forward: int64 positions, saved by the position embedding."""
        return self.new(name, name, nbytes, dtype="int64")

    def embedding(self, name, rows, ids=None):
        """nn.Embedding(rows, h): a lookup that saves its indices: `ids`, or None for the batch's
        token ids (the step's input, not an activation)."""
        z = self.sizes
        self.declare("param", name + ".weight", rows * z.h, matrix=True, split=name == "wte")  # wte: vocab-parallel
        lookups = z.b * z.s if ids is None else ids.nbytes // 8
        out = self.new(name, name + " output", lookups * z.h * z.e)
        saved = [(ids, ids.storage.entry.label)] if ids is not None else []
        self.record(name, [], [out], _embedding_backward, saved=saved, rows=rows)
        return out

    def cross_entropy(self, name, logits):
        """F.cross_entropy on FP32 logits: log_softmax saves its output, nll_loss its total_weight
        (and the targets: the batch); the loss is one FP32 number."""
        logp = self.new(name + " log-softmax", "log-softmax output (fp32)", logits.nbytes, region=logits.region,
                        dtype=logits.dtype)
        self.record("log-softmax", [logits], [logp], _pointwise_backward, saved=[(logp, "log-softmax output (fp32)")],
                    nbytes=logp.nbytes)
        loss, weight = self.alloc(name + " nll", ("loss", 4), ("loss total_weight", 4), region=logp.region,
                                  dtype="float32")
        self.record("cross-entropy (nll)", [logp], [loss], _pointwise_backward, saved=[(weight, "loss total_weight")],
                    nbytes=logp.nbytes)
        return loss


# ---------------------------------------------------------------- the backward rules



def _norm_backward(g, node, grads):
    z = g.sizes
    dx = g.new(node.name + " backward", node.name + " dx", node.ctx["nbytes"], region=grads[0].region)
    g.param_grad(node.name + " backward", node.name + ".weight", z.h * z.e)
    if z.bias:
        g.param_grad(node.name + " backward", node.name + ".bias", z.h * z.e)
    return [dx]


def _linear_backward(g, node, grads):
    z = g.sizes
    M, n_in, n_out = z.b * z.s, node.ctx["n_in"], node.ctx["n_out"]
    dx = g.new(node.name + " backward: dx", node.name + " dx", M * n_in * z.e, region=grads[0].region)
    g.param_grad(node.name + " backward: dW", node.name + ".weight", n_out * n_in * z.e)
    if z.bias:
        if node.slots:  # in a recompute unit the unpacked x dies with AddmmBackward0, before the engine sums db
            node.release()
        g.param_grad(node.name + " backward: db", node.name + ".bias", n_out * z.e)
    return [dx]


def _tied_head_backward(g, node, grads):
    z = g.sizes
    g.param_grad(node.name + " backward: d " + node.ctx["weight"], node.ctx["weight"],
                 node.ctx["n_out"] * z.h * z.e)
    return [g.new(node.name + " backward: dx", node.name + " dx", node.ctx["nbytes"])]


def _embedding_backward(g, node, grads):
    """A dense gradient for the whole table: wpe's becomes its .grad; wte's is summed into the
    head's (the output head is wte: tied) as a new .grad."""
    z = g.sizes
    nbytes, param = node.ctx["rows"] * z.h * z.e, node.name + ".weight"
    if g.prefix + param not in g.grads:
        g.param_grad(node.name + " backward", param, nbytes)
        return []
    made = [g.new(node.name + " backward", "d" + node.name, nbytes)]
    grads[0] = None  # its output's gradient goes once the table's exists
    g.param_grad(node.name + " backward", param, nbytes, made)
    return []


def _split_heads_backward(g, node, grads):
    """dq, dk, dv back to (B, T, C) and concatenated into c_attn's output gradient. The fused
    kernels hand theirs back in that layout already; a head-major gradient (the bmm's dq and dk)
    takes a copy first, k's before q's, and the head-major dk goes at once, dq after the cat."""
    copies = []
    for i in (1, 0):
        if grads[i] is not None and grads[i].layout == "head-major":
            copies.append(g.new(f"d{'qk'[i]} to (B, T, C)", f"d{'qk'[i]} (B, T, C)", grads[i].nbytes, region=True))
            grads[i] = None if i == 1 else grads[i]
    dqkv = g.new("q, k, v gradients: cat", "dqkv", sum(node.ctx["sizes"]), region=True)
    grads[0] = None
    del copies
    return [dqkv]


def _repeat_heads_backward(g, node, grads):
    """The sum over the copies: x's size, a view of (B, T, d) where x had one head."""
    layout = "rows" if node.ctx["heads"] == 1 else "head-major"
    return [g.new(node.name + " backward: sum", node.name + " dx", node.ctx["nbytes"], region=True, layout=layout)]


def _merge_heads_backward(g, node, grads):
    return [grads[0].view(layout="heads")]  # views all the way: (B, T, C) -> (B, a, T, d)


def _matmul_backward(g, node, grads):
    """The output's reshape first: an incoming gradient in "heads" layout (the view c_proj's
    dx comes back as) is copied to (B*a, T, d), and the view goes; then the bmm's two
    gradients at once; then the operands it saved go."""
    z = g.sizes
    if grads[0].layout == "heads" and z.b > 1:
        grads[0] = g.new(node.name + " backward: dy contiguous", node.name + " dy", grads[0].nbytes, region=True)
    a_bytes, b_bytes = node.ctx["sizes"]
    da, db = g.alloc(node.name + " backward", (node.name + " da", a_bytes), (node.name + " db", b_bytes),
                     region=True, layout="head-major")
    return [da, db]


def _sdpa_backward(g, node, grads):
    bsh = g.sizes.bsh * g.sizes.e
    return g.alloc(node.name + " backward", ("dq", bsh), ("dk", bsh), ("dv", bsh), region=True, layout="sdpa")
