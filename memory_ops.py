"""The ops of one block, as the peak walk sees them: what each allocates and frees.

Chapter sections 3 and 4 (activation memory, the ledger's peak).
Read memory_ledger.py first (its `block_activation_terms` name every tensor a block saves),
then memory_timeline.py (the walk over a whole step). This file is their vocabulary:
`Walk`, and each op of model.py's Block forward and backward: LayerNorm, dropout, and the
attention core (manual, sdpa, CPU sdpa's math path); the Linears (nn.Linear or our
FP8Linear) are memory_linear.py. It is its own file because memory_timeline.py would pass
the 340-line budget with it.

The rule of the walk: an op's outputs are allocated while its inputs are still alive
(`Walk.step`'s `new`: a candidate for the peak), and a node frees what it saved, and
the gradients it consumed, once it has run (`free`). The order is the autograd engine's,
read op by op off LiveTensors (memory_measure.py) while these were written; the tests
hold the resulting peak to the measured one. This file imports nothing of the project.
"""
from dataclasses import dataclass

SAVED, GRAD, FLIGHT = "activations", "parameter gradients", "in flight"
KEPT = "FP8 weights kept for the step"  # FP8Linear's E4M3 weight copies (memory_linear.py): micro-step 1 to AdamW
# FP8Linear saves its two FP32 scales (x_scale, w_scale: one 8-byte storage) per call: the term names
FP8_SCALES = {"attn.c_attn": "c_attn FP8 scales", "attn.c_proj": "c_proj FP8 scales", "mlp.c_fc": "c_fc FP8 scales",
              "mlp.c_proj": "MLP c_proj FP8 scales"}


@dataclass(frozen=True)
class Sizes:
    """Everything the walk needs about a config (memory_ledger.timeline_sizes builds it)."""
    L: int
    b: int
    s: int
    h: int
    a: int
    V: int
    e: int  # bytes per activation, parameter and gradient element
    fp8: bool  # FP8 Linears: ours (fp8.FP8Linear), or Transformer Engine's walked as ours
    fp8_te: bool  # Transformer Engine's: its weight cache is state (no copy kept for one step only)
    fp8_e5m2: bool  # their backward quantizes the output gradient to E5M2 (fp8_grad=e5m2)
    loss_scaled: bool  # the loss scaler multiplies the loss (one more scalar alive in backward)
    bias: bool
    drop: bool  # dropout > 0
    cuda: bool  # CUDA dtypes: fused dropout with a bool mask, FP32 LayerNorm statistics
    core: str  # "manual" | "sdpa" (a fused kernel) | "math" (CPU sdpa with dropout: manual ops in FP32)

    @property
    def bsh(self):
        return self.b * self.s * self.h


class Walk:
    """The bytes alive over a step, by tensor name. `step(where, new, free)`: the op's outputs
    `new` appear while everything alive is still there (a candidate for the peak), then the
    tensors in `free` are released. Every name is unique while it is alive."""

    def __init__(self, static, shard=1):
        self.static, self.alive, self.shard = static, {}, shard  # shard: ZeRO-3 keeps 1/N of each gradient
        self.total, self.totals, self.steps = static, [], []  # bytes alive now; at every step, and where
        self.peak, self.where, self.parts = static, "start", {}

    def step(self, where, new=(), free=()):
        for name, nbytes, kind in new:
            if name in self.alive:
                raise KeyError(f"{name!r} is already alive at {where}")
            self.alive[name] = (nbytes // self.shard if kind == GRAD else nbytes, kind)
            self.total += self.alive[name][0]
        self.totals.append(self.total)
        self.steps.append(where)
        if self.total > self.peak:
            self.peak, self.where, self.parts = self.total, where, {}
            for nbytes, kind in self.alive.values():
                self.parts[kind] = self.parts.get(kind, 0) + nbytes
        for name in free:
            self.total -= self.alive.pop(name)[0]

    def has(self, name):
        return name in self.alive

    def rename(self, name, new_name, kind):
        """The same bytes, now held as something else (a saved tensor that outlives its node)."""
        self.alive[new_name] = (self.alive.pop(name)[0], kind)


def flight(name, nbytes):
    return (name, nbytes, FLIGHT)


# ---------------------------------------------------------------- LayerNorm (the Linears: memory_linear.py)

def layernorm_backward(walk, pre, sizes, name, grad, x, x_held):
    gx = pre + name + " dx"
    new = [flight(gx, sizes.bsh * sizes.e), (pre + name + ".weight grad", sizes.h * sizes.e, GRAD)]
    if sizes.bias:
        new.append((pre + name + ".bias grad", sizes.h * sizes.e, GRAD))
    walk.step(pre + name + " backward", new=new)
    walk.step(pre + name + " backward done", free=([] if x_held else [x]) + [pre + name + " mean+rstd", grad])
    return gx


# ---------------------------------------------------------------- the attention core

def core_names(sizes):
    """The saved tensors of the manual core (and of CPU sdpa's FP32 math path), by role."""
    if sizes.core == "math":
        return dict(qk="sdpa-math Q, K copies (fp32)", P="sdpa-math softmax (fp32)",
                    mask="sdpa-math dropout mask (fp32)",
                    dropped="sdpa-math dropout output (fp32)", v="sdpa-math V copy (fp32)")
    return dict(qk="Q, K copies for QK^T", P="softmax output", mask="attention dropout mask",
                dropped="attention dropout output", v="V copy for att@V")


def core_forward(walk, pre, sizes, terms, qkv):
    """softmax(QK^T/sqrt(d)) V with autograd recording (model.CausalSelfAttention.core): returns
    the output's name. sdpa: one fused op saving q, k, v (views of `qkv`), its output and logsumexp.
    For one sequence (b = 1) reshaping (1, a, T, d) to (a, T, d) is a view: the matmuls save
    their inputs themselves, no copies (memory_ledger.block_activation_terms says the same)."""
    if sizes.core == "sdpa":
        walk.step(pre + "sdpa forward", new=[(pre + "sdpa output", terms["sdpa output"], SAVED),
                                             (pre + "sdpa logsumexp (fp32)", terms["sdpa logsumexp (fp32)"], SAVED)])
        return pre + "sdpa output"
    A, bsh, names, one = sizes.a * sizes.s * sizes.s * sizes.b, sizes.bsh, core_names(sizes), sizes.b == 1
    ec = 4 if sizes.core == "math" else sizes.e  # the math path upcasts 16-bit q, k, v to FP32
    if sizes.core == "math":  # q, k, v in FP32, q and k scaled, a causal bias of -inf above the diagonal
        v32 = (pre + names["v"], bsh * 4, SAVED) if one else flight(pre + "v32", bsh * 4)  # b = 1: saved as it is
        walk.step(pre + "math: q, k, v to fp32", new=[flight(pre + "q32", bsh * 4), flight(pre + "k32", bsh * 4), v32]
                  if sizes.e != 4 else [])
        # b = 1: the scaled q and k are what QK^T saves (the walk makes both at once, here)
        qs = (pre + names["qk"], terms[names["qk"]], SAVED) if one else flight(pre + "qs", bsh * 4)
        walk.step(pre + "math: q * scale", new=[qs])
        walk.step(pre + "math: causal tril", new=[flight(pre + "tril", sizes.s * sizes.s)])
        walk.step(pre + "math: causal bias", new=[flight(pre + "bias", sizes.s * sizes.s * 4)], free=[pre + "tril"])
        if not one:
            walk.step(pre + "math: k * scale", new=[flight(pre + "ks", bsh * 4)])
    if not one:
        walk.step(pre + "QK^T: copies of q, k", new=[(pre + names["qk"], terms[names["qk"]], SAVED)])
    walk.step(pre + "QK^T", new=[flight(pre + "att", A * ec)])
    if sizes.core == "math":
        walk.step(pre + "+ causal bias", new=[flight(pre + "att2", A * ec)], free=[pre + "att", pre + "bias"])
    else:
        walk.step(pre + "* 1/sqrt(d)", new=[flight(pre + "att1", A * ec)], free=[pre + "att"])
        walk.step(pre + "masked_fill", new=[flight(pre + "att2", A * ec)], free=[pre + "att1"])
    walk.step(pre + "softmax", new=[(pre + names["P"], terms[names["P"]], SAVED)], free=[pre + "att2"])
    if sizes.drop:
        dropout_forward(walk, pre + "attention dropout", sizes, pre + names["mask"], terms[names["mask"]],
                        pre + names["dropped"], terms[names["dropped"]])
    if sizes.core == "math" and sizes.e != 4:  # the math path returns the attention weights too, cast back
        walk.step(pre + "math: weights to 16 bit", new=[flight(pre + "weights16", A * sizes.e)])
    if not one:
        walk.step(pre + "att@V: copy of v", new=[(pre + names["v"], terms[names["v"]], SAVED)])
    down = sizes.core == "math" and sizes.e != 4  # the math path casts its FP32 output back to 16 bits
    walk.step(pre + "att@V", new=[flight(pre + ("y32" if down else "y"), bsh * ec)])
    if sizes.core == "math":
        if down:
            walk.step(pre + "math: output to 16 bit", new=[flight(pre + "y", bsh * sizes.e)], free=[pre + "y32"])
        temporaries = [pre + t for t in ("q32", "k32", "v32", "qs", "ks", "weights16", "y32")]
        walk.step(pre + "math: done", free=[t for t in temporaries if walk.has(t) and walk.alive[t][1] == FLIGHT])
    return pre + "y"


def dropout_forward(walk, where, sizes, mask, mask_bytes, out, out_bytes, x=None):
    """CPU: noise = bernoulli(1-p)/(1-p), then x * noise (mul saves the noise); CUDA: one fused
    native_dropout saving a bool mask. Frees x, the dropout's input, when given."""
    if sizes.cuda:
        walk.step(where, new=[(mask, mask_bytes, SAVED), (out, out_bytes, SAVED if x is None else FLIGHT)],
                  free=[x] if x else [])
        return
    walk.step(where + " noise", new=[(mask, mask_bytes, SAVED)])
    walk.step(where + " x * noise", new=[(out, out_bytes, SAVED if x is None else FLIGHT)], free=[x] if x else [])


def core_backward(walk, pre, sizes, gy, free_gy, qkv, free_qkv=True):
    """Backward through the core from the output gradient gy: returns the names of dq, dk, dv.
    qkv: c_attn's output, freed here when the core's views of it were its last holders."""
    A, bsh, e, names, one = sizes.a * sizes.s * sizes.s * sizes.b, sizes.bsh, sizes.e, core_names(sizes), sizes.b == 1
    gq, gk, gv = pre + "dq", pre + "dk", pre + "dv"
    if sizes.core == "sdpa":
        walk.step(pre + "sdpa backward", new=[flight(x, bsh * e) for x in (gq, gk, gv)],
                  free=[pre + "sdpa output", pre + "sdpa logsumexp (fp32)"] + ([qkv] if free_qkv else [])
                  + ([gy] if free_gy else []))
        return gq, gk, gv
    ec, dy = (4 if sizes.core == "math" else e), pre + "dy"
    if sizes.core == "math" and e != 4:
        tmp = [] if one else [flight(pre + "dy tmp", bsh * e)]
        walk.step(pre + "math backward: dy to fp32", new=[flight(dy, bsh * 4)] + tmp,
                  free=[pre + "dy tmp"] * (not one) + ([gy] if free_gy else []))
    elif not one:  # the bmm wants (B*a, T, d): a contiguous copy of the transposed gradient
        walk.step(pre + "att@V backward: dy contiguous", new=[flight(dy, bsh * e)], free=[gy] if free_gy else [])
    else:  # b = 1: a view will do
        dy = gy if free_gy else None
    v_view = one and (sizes.core == "manual" or e == 4)  # b = 1: att@V saved v itself, a view of qkv
    v_free = ([qkv] if (sizes.core == "math" and free_qkv) else []) if v_view else [pre + names["v"]]
    walk.step(pre + "att@V backward", new=[flight(gv, bsh * ec), flight(pre + "dP", A * ec)],
              free=v_free + ([dy] if dy else []) + ([pre + names["dropped"]] if sizes.drop else []))
    grad = pre + "dP"
    if sizes.drop:
        walk.step(pre + "attention dropout backward", new=[flight(pre + "dP2", A * ec)],
                  free=[pre + names["mask"], grad])
        grad = pre + "dP2"
    walk.step(pre + "softmax backward", new=[flight(pre + "dS", A * ec)], free=[pre + names["P"], grad])
    grad = pre + "dS"
    if sizes.core == "manual":
        walk.step(pre + "masked_fill backward", new=[flight(pre + "dM", A * ec)], free=[grad])
        walk.step(pre + "scale backward", new=[flight(pre + "dA", A * ec)], free=[pre + "dM"])
        grad = pre + "dA"
    qk = ([qkv] if free_qkv else []) if (one and sizes.core == "manual") else [pre + names["qk"]]
    walk.step(pre + "QK^T backward", new=[flight(gq, bsh * ec), flight(gk, bsh * ec)], free=qk + [grad])
    if sizes.core == "math" and e != 4:  # back through the scaling of q and k, and down to 16 bits
        walk.step(pre + "math backward: k scale", new=[flight(gk + "s", bsh * 4)], free=[gk])
        walk.step(pre + "math backward: q scale", new=[flight(gq + "s", bsh * 4)], free=[gq])
        for x, src in ((gv, gv), (gk, gk + "s"), (gq, gq + "s")):
            walk.step(pre + "math backward: to 16 bit", new=[flight(x + "16", bsh * e)], free=[src])
        gq, gk, gv = gq + "16", gk + "16", gv + "16"
    return gq, gk, gv


def qkv_grad(walk, pre, sizes, gq, gk, gv):
    """The gradient of c_attn's output, 3bsh: dq, dk (and dv) back to (B, T, C) and concatenated.
    The manual core's dq and dk come out as (B*a, T, d): back to (B, T, C) takes a copy each."""
    bsh, e = sizes.bsh, sizes.e
    if sizes.core == "sdpa":
        walk.step(pre + "q, k, v gradients: cat", new=[flight(pre + "dqkv", 3 * bsh * e)], free=[gq, gk, gv])
        return pre + "dqkv"
    walk.step(pre + "dk to (B, T, C)", new=[flight(gk + "c", bsh * e)], free=[gk])
    walk.step(pre + "dq to (B, T, C)", new=[flight(gq + "c", bsh * e)])
    walk.step(pre + "q, k, v gradients: cat", new=[flight(pre + "dqkv", 3 * bsh * e)], free=[gq])
    walk.step(pre + "cat done", free=[gk + "c", gq + "c", gv])
    return pre + "dqkv"
