"""The ops of one block, as the peak walk sees them: what each allocates and frees.

Chapter sections 3 and 4 (activation memory, the ledger's peak).
Read memory_ledger.py first (its `block_activation_terms` name every tensor a block saves),
then memory_timeline.py (the walk over a whole step). This file is their vocabulary:
`Walk`, and each op of model.py's Block forward and backward: Linear (nn.Linear or our
FP8Linear), LayerNorm, dropout, and the attention core (manual, sdpa, CPU sdpa's math path).
It is its own file because memory_timeline.py would pass the 340-line budget with it.

The rule of the walk: an op's outputs are allocated while its inputs are still alive
(`Walk.step`'s `new`: a candidate for the peak), and a node frees what it saved, and
the gradients it consumed, once it has run (`free`). The order is the autograd engine's,
read op by op off LiveTensors (memory_measure.py) while these were written; the tests
hold the resulting peak to the measured one. This file imports nothing of the project.
"""
from dataclasses import dataclass

SAVED, GRAD, FLIGHT = "activations", "parameter gradients", "in flight"
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
    fp8: bool  # native FP8 Linears (fp8.FP8Linear)
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


def flight(name, nbytes):
    return (name, nbytes, FLIGHT)


# ---------------------------------------------------------------- Linear layers

def linear_forward(w, p, z, name, x, out, n_in, n_out, saved, out_kind=FLIGHT):
    """x (M, n_in) -> out (M, n_out). nn.Linear saves x itself (`saved` is x's name); FP8Linear
    (fp8.py) saves an E4M3 copy of x under `saved` and makes FP32/E4M3 copies of x and W on
    the way, gone once its forward returns: FP8 transients, see fp8_linear_forward."""
    M = z.b * z.s
    if z.fp8:
        fp8_linear_forward(w, p + name, z, x, M, n_in, n_out, saved, p + FP8_SCALES[name])
    w.step(f"{p}{name} forward", new=[(out, M * n_out * z.e, out_kind)])
    if z.fp8:
        w.step(f"{p}{name} forward done", free=[p + name + " W e4m3"])


def fp8_linear_forward(w, q, z, x, M, n_in, n_out, saved, scales):
    """FP8Linear's forward before its matmul (fp8.FP8Linear.forward, _FP8LinearFunction.forward
    and quantize, today's code): |x| and |W| for the amaxes, the two scales (saved, one 8-byte
    storage), then x cast to an FP32 temporary, scaled and rounded to E4M3 (saved: 1 byte per
    element), then W the same way (fp8_weight_copies_in_forward)."""
    w.step(q + " |x| for amax", new=[flight(q + " |x|", M * n_in * z.e)], free=[q + " |x|"])
    w.step(q + " |W| for amax", new=[flight(q + " |W|", n_out * n_in * z.e)], free=[q + " |W|"])
    w.step(q + " scales", new=[(scales, 8, SAVED)])
    w.step(q + " x to fp32", new=[flight(q + " x fp32", 4 * M * n_in)])
    w.step(q + " x to e4m3", new=[(saved, M * n_in, SAVED)], free=[q + " x fp32"])
    fp8_weight_copies_in_forward(w, q, n_in, n_out)


def fp8_weight_copies_in_forward(w, q, n_in, n_out):
    """The FP8 weight copies of one FP8Linear forward, as today's fp8.py makes them: W cast to an
    FP32 temporary (scaled in place), then rounded to an E4M3 copy, which lives until the
    forward returns (linear_forward frees it as "W e4m3"). memory_ledger.fp8_weight_copies
    states the same per config; if FP8 weights get cached across micro-steps (issue 13), the
    E4M3 copy becomes persistent state there and leaves this walk."""
    w.step(q + " W to fp32", new=[flight(q + " W fp32", 4 * n_out * n_in)])
    w.step(q + " W to e4m3", new=[flight(q + " W e4m3", n_out * n_in)], free=[q + " W fp32"])


def linear_backward(w, p, z, name, g, n_in, n_out, saved, free_g):
    """dx = g W and dW = g^T x (+ db = sum g): returns dx's name. Frees `saved` (names) and,
    when `free_g`, the incoming gradient g (not when a residual branch still holds it)."""
    M, q = z.b * z.s, p + name
    gx = q + " dx"
    if z.fp8 and z.fp8_e5m2:
        fp8_e5m2_backward(w, q, z, M, n_in, n_out, saved)
    else:
        w.step(q + " backward: dx", new=[flight(gx, M * n_in * z.e)])
    if z.fp8 and not z.fp8_e5m2:  # dW from x dequantized: its E4M3 bytes to FP32, divided by the scale, to BF16
        dequantize(w, q, " xf", M * n_in, z.e)
        w.step(q + " backward: dW", new=[(q + ".weight grad", n_out * n_in * z.e, GRAD)], free=[q + " xf16"])
    elif not z.fp8:
        w.step(q + " backward: dW", new=[(q + ".weight grad", n_out * n_in * z.e, GRAD)])
    if z.bias and z.fp8:  # g.float().sum(0).to(bf16)
        w.step(q + " backward: g.float()", new=[flight(q + " gf", 4 * M * n_out)])
        w.step(q + " backward: db", new=[flight(q + " db32", 4 * n_out)])
        w.step(q + " backward: db to bf16", new=[(q + ".bias grad", n_out * z.e, GRAD)], free=[q + " gf", q + " db32"])
    elif z.bias:
        w.step(q + " backward: db", new=[(q + ".bias grad", n_out * z.e, GRAD)])
    fp8_held = ([p + FP8_SCALES[name]] if z.fp8 else []) + ([q + " g8", q + " W e4m3"] if z.fp8 and z.fp8_e5m2 else [])
    w.step(q + " backward done", free=[x for x in saved if x] + fp8_held + ([g] if free_g else []))
    return gx


def dequantize(w, q, name, n, e):
    """fp8.dequantize: FP8 bytes to an FP32 copy, divided by the scale (another), down to 16 bits."""
    w.step(q + " dequantize: .float()", new=[flight(q + name + "32", 4 * n)])
    w.step(q + " dequantize: / scale", new=[flight(q + name + "d", 4 * n)], free=[q + name + "32"])
    w.step(q + " dequantize: to 16 bits", new=[flight(q + name + "16", n * e)], free=[q + name + "d"])


def fp8_e5m2_backward(w, q, z, M, n_in, n_out, saved):
    """_FP8LinearFunction.backward with grad="e5m2" (TE's HYBRID), today's fp8.py: the output
    gradient's amax and E5M2 copy; dx = g8 @ W8 with W quantized again (and laid out column-
    major); dW = g8^T @ x8 in FP8 when the token count M is a multiple of 16, else both
    dequantized. g8 and W8 live until the backward returns."""
    gx, e = q + " dx", z.e
    w.step(q + " backward: |g| for amax", new=[flight(q + " |g|", M * n_out * e)], free=[q + " |g|"])
    w.step(q + " backward: g to fp32", new=[flight(q + " g32", 4 * M * n_out)])
    w.step(q + " backward: g to e5m2", new=[flight(q + " g8", M * n_out)], free=[q + " g32"])
    fp8_weight_copies_in_forward(w, q, n_in, n_out)  # the forward's E4M3 weight, made again
    w.step(q + " backward: W8 column-major", new=[flight(q + " W8c", n_out * n_in)])
    w.step(q + " backward: dx", new=[flight(gx, M * n_in * e)], free=[q + " W8c"])
    if M % 16 == 0:
        w.step(q + " backward: g8^T contiguous", new=[flight(q + " g8t", M * n_out)])
        w.step(q + " backward: x8 column-major", new=[flight(q + " x8c", M * n_in)])
        w.step(q + " backward: dW", new=[(q + ".weight grad", n_out * n_in * e, GRAD)], free=[q + " g8t", q + " x8c"])
    else:
        dequantize(w, q, " gq", M * n_out, e)
        dequantize(w, q, " xq", M * n_in, e)
        w.step(q + " backward: dW", new=[(q + ".weight grad", n_out * n_in * e, GRAD)],
               free=[q + " gq16", q + " xq16"])


def layernorm_backward(w, p, z, name, g, x, x_held):
    gx = p + name + " dx"
    new = [flight(gx, z.bsh * z.e), (p + name + ".weight grad", z.h * z.e, GRAD)]
    if z.bias:
        new.append((p + name + ".bias grad", z.h * z.e, GRAD))
    w.step(p + name + " backward", new=new)
    w.step(p + name + " backward done", free=([] if x_held else [x]) + [p + name + " mean+rstd", g])
    return gx


# ---------------------------------------------------------------- the attention core

def core_names(z):
    """The saved tensors of the manual core (and of CPU sdpa's FP32 math path), by role."""
    if z.core == "math":
        return dict(qk="sdpa-math Q, K copies (fp32)", P="sdpa-math softmax (fp32)", mask="sdpa-math dropout mask (fp32)",
                    dropped="sdpa-math dropout output (fp32)", v="sdpa-math V copy (fp32)")
    return dict(qk="Q, K copies for QK^T", P="softmax output", mask="attention dropout mask",
                dropped="attention dropout output", v="V copy for att@V")


def core_forward(w, p, z, T, qkv):
    """softmax(QK^T/sqrt(d)) V with autograd recording (model.CausalSelfAttention.core): returns
    the output's name. sdpa: one fused op saving q, k, v (views of `qkv`), its output and logsumexp.
    For one sequence (b = 1) reshaping (1, a, T, d) to (a, T, d) is a view: the matmuls save
    their inputs themselves, no copies (memory_ledger.block_activation_terms says the same)."""
    if z.core == "sdpa":
        w.step(p + "sdpa forward", new=[(p + "sdpa output", T["sdpa output"], SAVED),
                                        (p + "sdpa logsumexp (fp32)", T["sdpa logsumexp (fp32)"], SAVED)])
        return p + "sdpa output"
    A, bsh, n, one = z.a * z.s * z.s * z.b, z.bsh, core_names(z), z.b == 1
    ec = 4 if z.core == "math" else z.e  # the math path upcasts 16-bit q, k, v to FP32
    if z.core == "math":  # q, k, v in FP32, q and k scaled, a causal bias of -inf above the diagonal
        v32 = (p + n["v"], bsh * 4, SAVED) if one else flight(p + "v32", bsh * 4)  # b = 1: saved as it is
        w.step(p + "math: q, k, v to fp32", new=[flight(p + "q32", bsh * 4), flight(p + "k32", bsh * 4), v32]
               if z.e != 4 else [])
        # b = 1: the scaled q and k are what QK^T saves (the walk makes both at once, here)
        w.step(p + "math: q * scale", new=[(p + n["qk"], T[n["qk"]], SAVED) if one else flight(p + "qs", bsh * 4)])
        w.step(p + "math: causal tril", new=[flight(p + "tril", z.s * z.s)])
        w.step(p + "math: causal bias", new=[flight(p + "bias", z.s * z.s * 4)], free=[p + "tril"])
        if not one:
            w.step(p + "math: k * scale", new=[flight(p + "ks", bsh * 4)])
    if not one:
        w.step(p + "QK^T: copies of q, k", new=[(p + n["qk"], T[n["qk"]], SAVED)])
    w.step(p + "QK^T", new=[flight(p + "att", A * ec)])
    if z.core == "math":
        w.step(p + "+ causal bias", new=[flight(p + "att2", A * ec)], free=[p + "att", p + "bias"])
    else:
        w.step(p + "* 1/sqrt(d)", new=[flight(p + "att1", A * ec)], free=[p + "att"])
        w.step(p + "masked_fill", new=[flight(p + "att2", A * ec)], free=[p + "att1"])
    w.step(p + "softmax", new=[(p + n["P"], T[n["P"]], SAVED)], free=[p + "att2"])
    if z.drop:
        dropout_forward(w, p + "attention dropout", z, p + n["mask"], T[n["mask"]], p + n["dropped"], T[n["dropped"]])
    if z.core == "math" and z.e != 4:  # the math path returns the attention weights too, cast back
        w.step(p + "math: weights to 16 bit", new=[flight(p + "weights16", A * z.e)])
    if not one:
        w.step(p + "att@V: copy of v", new=[(p + n["v"], T[n["v"]], SAVED)])
    down = z.core == "math" and z.e != 4  # the math path casts its FP32 output back to 16 bits
    w.step(p + "att@V", new=[flight(p + ("y32" if down else "y"), bsh * ec)])
    if z.core == "math":
        if down:
            w.step(p + "math: output to 16 bit", new=[flight(p + "y", bsh * z.e)], free=[p + "y32"])
        w.step(p + "math: done", free=[x for x in [p + "q32", p + "k32", p + "v32", p + "qs", p + "ks", p + "weights16",
                                                    p + "y32"] if w.has(x) and w.alive[x][1] == FLIGHT])
    return p + "y"


def dropout_forward(w, where, z, mask, mask_bytes, out, out_bytes, x=None):
    """CPU: noise = bernoulli(1-p)/(1-p), then x * noise (mul saves the noise); CUDA: one fused
    native_dropout saving a bool mask. Frees x, the dropout's input, when given."""
    if z.cuda:
        w.step(where, new=[(mask, mask_bytes, SAVED), (out, out_bytes, SAVED if x is None else FLIGHT)],
               free=[x] if x else [])
        return
    w.step(where + " noise", new=[(mask, mask_bytes, SAVED)])
    w.step(where + " x * noise", new=[(out, out_bytes, SAVED if x is None else FLIGHT)], free=[x] if x else [])


def core_backward(w, p, z, gy, free_gy, qkv, free_qkv=True):
    """Backward through the core from the output gradient gy: returns the names of dq, dk, dv.
    qkv: c_attn's output, freed here when the core's views of it were its last holders."""
    A, bsh, e, n, one = z.a * z.s * z.s * z.b, z.bsh, z.e, core_names(z), z.b == 1
    gq, gk, gv = p + "dq", p + "dk", p + "dv"
    if z.core == "sdpa":
        w.step(p + "sdpa backward", new=[flight(x, bsh * e) for x in (gq, gk, gv)],
               free=[p + "sdpa output", p + "sdpa logsumexp (fp32)"] + ([qkv] if free_qkv else [])
               + ([gy] if free_gy else []))
        return gq, gk, gv
    ec, dy = (4 if z.core == "math" else e), p + "dy"
    if z.core == "math" and e != 4:
        tmp = [] if one else [flight(p + "dy tmp", bsh * e)]
        w.step(p + "math backward: dy to fp32", new=[flight(dy, bsh * 4)] + tmp,
               free=[p + "dy tmp"] * (not one) + ([gy] if free_gy else []))
    elif not one:  # the bmm wants (B*a, T, d): a contiguous copy of the transposed gradient
        w.step(p + "att@V backward: dy contiguous", new=[flight(dy, bsh * e)], free=[gy] if free_gy else [])
    else:  # b = 1: a view will do
        dy = gy if free_gy else None
    v_view = one and (z.core == "manual" or e == 4)  # b = 1: att@V saved v itself, a view of qkv
    v = ([qkv] if (z.core == "math" and free_qkv) else []) if v_view else [p + n["v"]]
    w.step(p + "att@V backward", new=[flight(gv, bsh * ec), flight(p + "dP", A * ec)],
           free=v + ([dy] if dy else []) + ([p + n["dropped"]] if z.drop else []))
    g = p + "dP"
    if z.drop:
        w.step(p + "attention dropout backward", new=[flight(p + "dP2", A * ec)], free=[p + n["mask"], g])
        g = p + "dP2"
    w.step(p + "softmax backward", new=[flight(p + "dS", A * ec)], free=[p + n["P"], g])
    g = p + "dS"
    if z.core == "manual":
        w.step(p + "masked_fill backward", new=[flight(p + "dM", A * ec)], free=[g])
        w.step(p + "scale backward", new=[flight(p + "dA", A * ec)], free=[p + "dM"])
        g = p + "dA"
    qk = ([qkv] if free_qkv else []) if (one and z.core == "manual") else [p + n["qk"]]
    w.step(p + "QK^T backward", new=[flight(gq, bsh * ec), flight(gk, bsh * ec)], free=qk + [g])
    if z.core == "math" and e != 4:  # back through the scaling of q and k, and down to 16 bits
        w.step(p + "math backward: k scale", new=[flight(gk + "s", bsh * 4)], free=[gk])
        w.step(p + "math backward: q scale", new=[flight(gq + "s", bsh * 4)], free=[gq])
        for x, src in ((gv, gv), (gk, gk + "s"), (gq, gq + "s")):
            w.step(p + "math backward: to 16 bit", new=[flight(x + "16", bsh * e)], free=[src])
        gq, gk, gv = gq + "16", gk + "16", gv + "16"
    return gq, gk, gv


def qkv_grad(w, p, z, gq, gk, gv):
    """The gradient of c_attn's output, 3bsh: dq, dk (and dv) back to (B, T, C) and concatenated.
    The manual core's dq and dk come out as (B*a, T, d): back to (B, T, C) takes a copy each."""
    bsh, e = z.bsh, z.e
    if z.core == "sdpa":
        w.step(p + "q, k, v gradients: cat", new=[flight(p + "dqkv", 3 * bsh * e)], free=[gq, gk, gv])
        return p + "dqkv"
    w.step(p + "dk to (B, T, C)", new=[flight(gk + "c", bsh * e)], free=[gk])
    w.step(p + "dq to (B, T, C)", new=[flight(gq + "c", bsh * e)])
    w.step(p + "q, k, v gradients: cat", new=[flight(p + "dqkv", 3 * bsh * e)], free=[gq])
    w.step(p + "cat done", free=[gk + "c", gq + "c", gv])
    return p + "dqkv"
