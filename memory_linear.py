"""The Linear layers as the peak walk sees them: nn.Linear and our FP8Linear, op by op.

Chapter sections 1 (FP8) and 4 (the ledger's peak). Read fp8.py first (FP8Linear's
docstring, "What it stores"), then memory_ops.py (the walk's vocabulary: `Walk`, the
kinds of bytes, the rule of the walk); this file is the walk's Linear, forward and
backward, for the code of fp8.py and fp8_gemm.py as it is. It is its own file because
memory_ops.py would pass the 340-line budget with it.

What FP8 adds to a step, in the walk's terms (accumulate.accumulation_step, K = 1):
  kept     micro-step 1's forward quantizes each weight once and keeps the E4M3 copy, with
           its scale and amax (two 8-byte storages), until accumulate.optimizer_step
           releases it before AdamW; HYBRID (fp8_grad=e5m2) adds a column-major twin at the
           layer's first backward. A recompute's re-run reuses the copy: it quantizes x only.
  saved    x in E4M3 and the scales storage (whose second half is the kept copy's scale, in
           the forward that made the copy: when backward lets go of it, it stays as kept).
  in flight x * scale in FP32 (4 bytes per element) on its way to E4M3; on CPU every FP8
           GEMM operand looked up as BF16 through int32 codes (fp8_gemm._look_up).
"""
from memory_ops import FLIGHT, FP8_SCALES, GRAD, KEPT, SAVED, flight

LINEARS = (("attn.c_attn", 1, 3), ("attn.c_proj", 1, 1), ("mlp.c_fc", 1, 4), ("mlp.c_proj", 4, 1))  # in, out (x h)


def kept_names(op):
    """The names of one FP8Linear's kept copy in the walk (op: "3.mlp.c_fc")."""
    return dict(weight=op + " E4M3 weight (kept)", amax=op + " amax (kept)", scales=op + " scales (kept)",
                twin=op + " E4M3 weight, column-major (kept)")


def kept_copies(sizes, with_scales):
    """Every FP8Linear's kept copy when the forward is done: the E4M3 weight and its amax, and
    its scales where no saved tensor shares their storage (`with_scales`: a recompute unit's
    first forward, under no_grad, saves nothing)."""
    out = []
    for i in range(sizes.L):
        for name, n_in, n_out in LINEARS:
            kept = kept_names(f"{i}.{name}")
            out += [(kept["weight"], n_in * n_out * sizes.h * sizes.h, KEPT), (kept["amax"], 8, KEPT)]
            out += [(kept["scales"], 8, KEPT)] if with_scales else []
    return out


# ---------------------------------------------------------------- forward

def linear_forward(walk, pre, sizes, name, x, out, n_in, n_out, saved, out_kind=FLIGHT):
    """x (M, n_in) -> out (M, n_out). nn.Linear saves x itself (`saved` is x's name): one op.
    FP8Linear (fp8.FP8Linear.forward, _FP8LinearFunction.forward) saves an E4M3 copy of x
    under `saved` and the scales: fp8_linear_forward."""
    M = sizes.b * sizes.s
    if sizes.fp8:
        fp8_linear_forward(walk, pre, sizes, name, (out, M * n_out * sizes.e, out_kind), n_in, n_out, saved)
    else:
        walk.step(f"{pre}{name} forward", new=[(out, M * n_out * sizes.e, out_kind)])


def fp8_linear_forward(walk, pre, sizes, name, out, n_in, n_out, saved):
    """The amaxes of x and W stacked (8 bytes; aminmax: no |x| temporary), the two scales
    (8 bytes, saved); where this layer has no kept copy yet (micro-step 1's forward), W times
    its scale in FP32 and rounded to the kept E4M3 copy, the amax kept with it; then x the
    same way (saved); then the GEMM. A re-run (the copy kept already) frees its amax on return."""
    op, M, w = pre + name, sizes.b * sizes.s, n_in * n_out
    kept = kept_names(op)
    reuse = walk.has(kept["weight"])
    walk.step(op + " amax", new=[flight(op + " amax", 8)])
    walk.step(op + " scales", new=[(pre + FP8_SCALES[name], 8, SAVED)])
    if not reuse:
        walk.step(op + " W * scale (fp32)", new=[flight(op + " W fp32", 4 * w)])
        walk.step(op + " W to e4m3 (kept)", new=[(kept["weight"], w, KEPT)], free=[op + " W fp32"])
        walk.rename(op + " amax", kept["amax"], KEPT)
    walk.step(op + " x * scale (fp32)", new=[flight(op + " x fp32", 4 * M * n_in)])
    walk.step(op + " x to e4m3", new=[(saved, M * n_in, SAVED)], free=[op + " x fp32"])
    scaled_mm(walk, op + " forward", sizes, M * n_in, w, out, sizes.bias)
    walk.step(op + " forward done", free=[op + " amax"] if reuse else [])


def scaled_mm(walk, op, sizes, a, b, out, bias):
    """fp8_gemm.scaled_mm of an (a-element) and a (b-element) FP8 operand into `out`: the two
    reciprocal scales (4 bytes each) as arguments; on CUDA one torch._scaled_mm. On CPU the
    scales' product (4 bytes, read at once), a 0-d BF16 zero where there is no bias, then
    each operand looked up as BF16 values (lookup), then one addmm; all but `out` freed on return."""
    tmp = [op + " 1/scales"]
    if sizes.cuda:
        walk.step(op + ": 1/scales", new=[flight(tmp[0], 8)])
        walk.step(op + ": _scaled_mm", new=[out], free=tmp)
        return
    walk.step(op + ": 1/scales, alpha", new=[flight(tmp[0], 8), flight(op + " alpha", 4)], free=[op + " alpha"])
    if not bias:
        walk.step(op + ": zero start", new=[flight(op + " zero", sizes.e)])
        tmp.append(op + " zero")
    tmp += [lookup(walk, op, sizes, " a", a), lookup(walk, op, sizes, " b", b)]
    walk.step(op + ": addmm", new=[out], free=tmp)


def lookup(walk, op, sizes, name, count, table=None):
    """fp8_gemm._look_up (CPU): the 256-entry table in the compute dtype, the FP8 bytes as int32
    codes (4 bytes each), index_select into 16-bit values; codes and table freed. `table`: the
    FP32 table of scaled values dequantize makes first (freed once cast). Returns the values' name."""
    if table:
        walk.step(op + name + ": table / scale", new=[flight(op + name + " table32", 4 * 256)])
    walk.step(op + name + ": table", new=[flight(op + name + " table", 256 * sizes.e)],
              free=[op + name + " table32"] if table else [])
    walk.step(op + name + ": int32 codes", new=[flight(op + name + " codes", 4 * count)])
    walk.step(op + name + ": index_select", new=[flight(op + name + " values", count * sizes.e)],
              free=[op + name + " codes", op + name + " table"])
    return op + name + " values"


def dequantize(walk, op, sizes, name, count):
    """fp8_gemm.dequantize to 16 bits: CUDA q.float() / scale, cast down; CPU a lookup in the
    table of scaled values. Returns the 16-bit copy's name."""
    if not sizes.cuda:
        return lookup(walk, op, sizes, name, count, table=True)
    walk.step(op + name + ": .float()", new=[flight(op + name + "32", 4 * count)])
    walk.step(op + name + ": / scale", new=[flight(op + name + "d", 4 * count)], free=[op + name + "32"])
    walk.step(op + name + ": to 16 bits", new=[flight(op + name + "16", count * sizes.e)], free=[op + name + "d"])
    return op + name + "16"


# ---------------------------------------------------------------- backward

def linear_backward(walk, pre, sizes, name, grad, n_in, n_out, saved, free_g):
    """dx = g W and dW = g^T x (+ db = sum g), g the incoming gradient `grad`: returns dx's name.
    Frees `saved` (names) and, when `free_g`, `grad` (not when a residual branch still holds it).
    FP8: the scales too, but where they are the kept copy's (the forward that made it), they stay."""
    M, op, e = sizes.b * sizes.s, pre + name, sizes.e
    gx, gw = op + " dx", (op + ".weight grad", n_out * n_in * e, GRAD)
    held = []
    if not sizes.fp8:
        walk.step(op + " backward: dx", new=[flight(gx, M * n_in * e)])
        walk.step(op + " backward: dW", new=[gw])
    elif not sizes.fp8_e5m2:  # the chapter's: dx with the BF16 weight, dW with x dequantized
        walk.step(op + " backward: dx", new=[flight(gx, M * n_in * e)])
        x16 = dequantize(walk, op + " backward:", sizes, " x", M * n_in)
        walk.step(op + " backward: dW", new=[gw], free=[x16])
    else:
        held = e5m2_backward(walk, op, sizes, M, n_in, n_out, gx, gw)
    if sizes.bias and sizes.fp8:  # g.sum(0, dtype=float32).to(bf16)
        walk.step(op + " backward: db (fp32)", new=[flight(op + " db32", 4 * n_out)])
        walk.step(op + " backward: db", new=[(op + ".bias grad", n_out * e, GRAD)], free=[op + " db32"])
    elif sizes.bias:
        walk.step(op + " backward: db", new=[(op + ".bias grad", n_out * e, GRAD)])
    if sizes.fp8:
        scales, kept = pre + FP8_SCALES[name], kept_names(op)["scales"]
        if walk.has(kept):
            held.append(scales)
        else:  # the forward that made the kept copy: its scales storage is the copy's scale
            walk.rename(scales, kept, KEPT)
    walk.step(op + " backward done", free=[x for x in saved if x] + held + ([grad] if free_g else []))
    return gx


def e5m2_backward(walk, op, sizes, M, n_in, n_out, gx, gw):
    """_FP8LinearFunction.backward with grad="e5m2" (TE's HYBRID): the output gradient's scale
    (4 bytes) and E5M2 copy (through FP32); the kept copy's column-major twin, made at the
    layer's first backward and kept; dx = g8 @ W8; dW = g8^T @ x8 in FP8 (two column-major
    copies) when the token count M is a multiple of 16, else both dequantized. Returns what
    the backward holds until it returns (g8 and its scale)."""
    twin, w = kept_names(op)["twin"], n_in * n_out
    walk.step(op + " backward: g scale", new=[flight(op + " g scale", 4)])
    walk.step(op + " backward: g * scale (fp32)", new=[flight(op + " g fp32", 4 * M * n_out)])
    walk.step(op + " backward: g to e5m2", new=[flight(op + " g8", M * n_out)], free=[op + " g fp32"])
    if not walk.has(twin):
        walk.step(op + " backward: W8 column-major (kept)", new=[(twin, w, KEPT)])
    scaled_mm(walk, op + " backward dx", sizes, M * n_out, w, flight(gx, M * n_in * sizes.e), False)
    if M % 16 == 0:
        walk.step(op + " backward: g8^T contiguous", new=[flight(op + " g8t", M * n_out)])
        walk.step(op + " backward: x8 column-major", new=[flight(op + " x8c", M * n_in)])
        scaled_mm(walk, op + " backward dW", sizes, M * n_out, M * n_in, gw, False)
        walk.step(op + " backward: dW done", free=[op + " g8t", op + " x8c"])
    else:
        g16 = dequantize(walk, op + " backward:", sizes, " g", M * n_out)
        x16 = dequantize(walk, op + " backward:", sizes, " x", M * n_in)
        walk.step(op + " backward: dW", new=[gw], free=[g16, x16])
    return [op + " g8", op + " g scale"]
