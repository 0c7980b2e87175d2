"""Our FP8Linear (fp8.py) as one of the ledger's ops: what it allocates and keeps, forward and backward.

Chapter sections 1 (FP8) and 4 (the ledger's peak). Read fp8.py first, then docs/fp8.md ("What a
layer stores"), then ledger/ops.py (the ops and how they record); this file is the FP8 Linear the
trainer builds, for the code of fp8.py, backends/fp8_refined.py and backends/fp8_gemm.py as it is.
ops.Ops.linear calls it where a run is fp8.

What FP8 adds to a step (accumulate.accumulation_step):
  kept     micro-step 1's forward quantizes each weight once and keeps the E4M3 copy, with
           its scale and amax (two 8-byte storages), until accumulate.optimizer_step
           releases it before AdamW; HYBRID (fp8_grad=e5m2) adds a column-major twin at the
           layer's first backward. A recompute's re-run reuses the copy: it quantizes x only.
           (Transformer Engine's cached copy is state, not kept: memory_ledger counts it.)
  saved    x in E4M3 and the scales storage; in the forward that made the copy that storage
           is the copy's (its second half is the copy's scale): kept, so not an activation.
  in flight x * scale in FP32 (4 bytes per element) on its way to E4M3; on CPU every FP8
           GEMM operand looked up as BF16 through int32 codes (fp8_gemm._look_up).
"""


def linear(g, name, x, n_in, n_out, region):
    """FP8Linear.forward: the amaxes of x and W stacked (8 bytes; aminmax: no |x| temporary), the
    two scales (8 bytes, saved); where this layer has no kept copy yet, W times its scale in FP32
    and rounded to the kept E4M3 copy, the amax kept with it; then x the same way (saved); then
    the GEMM. A forward that reuses the copy lets its own amax go on return."""
    z = g.sizes
    M, w = z.b * z.s, n_in * n_out
    g.declare("fp8 weight", name, w)
    if z.fp8 == "native":  # FP32 buffers: amax_history (H, 3), scale, step_amax and fp8_max (3,) each
        for buffer, nbytes in (("amax_history", 12 * z.fp8_history), ("scale", 12), ("step_amax", 12), ("fp8_max", 12)):
            g.declare("buffer", f"{name}.{buffer}", nbytes)
    amax = g.new(name + " amax", name + " amax", 8, dtype="float32")
    scales = g.new(name + " scales", name + " FP8 scales", 8, dtype="float32")
    makes_copy = z.fp8 == "native" and g.prefix + name not in g.kept
    if makes_copy:
        w32 = g.new(name + " W * scale (fp32)", name + " W fp32", 4 * w)
        w8 = g.new(name + " W to e4m3 (kept)", name + " E4M3 weight (kept)", w, dtype="float8_e4m3fn")
        del w32
        g.keep(name, weight=w8, amax=amax, scales=scales)
        del w8
    x32 = g.new(name + " x * scale (fp32)", name + " x fp32", 4 * M * n_in, region=x.region)
    x8 = g.new(name + " x to e4m3", name + " input (E4M3)", M * n_in, region=x.region, dtype="float8_e4m3fn")
    del x32
    out = scaled_mm(g, name + " forward", M * n_in, w, lambda where: g.new(where, name + " output", M * n_out * z.e,
                                                                            region=region), z.bias)
    # the scales are saved too, but where this forward made the copy they are the copy's, kept for the
    # step: fp8_kept's bytes, not an activation (ledger/measure.py counts them once, there): term None
    saved = [(x8, name + " input"), (scales, None if makes_copy else name + " FP8 scales")]
    g.record(name, [x], [out], _backward, saved=saved, packs_after=True, n_in=n_in, n_out=n_out)
    return out


def scaled_mm(g, where, a, b, make_out, bias):
    """fp8_gemm.scaled_mm of an (a-element) and a (b-element) FP8 operand into make_out(where):
    the two reciprocal scales (4 bytes each) as arguments; on CUDA one torch._scaled_mm. On CPU
    the scales' product (4 bytes, read at once), a 0-d BF16 zero where there is no bias, then
    each operand looked up as BF16 values (lookup), then one addmm; all but the output go."""
    if g.sizes.cuda:
        inverse = g.alloc(where + ": 1/scales", ("1/scales", 8))
        out = make_out(where + ": _scaled_mm")
        del inverse
        return out
    inverse, alpha = g.alloc(where + ": 1/scales, alpha", ("1/scales", 8), ("alpha", 4))
    del alpha
    zero = None if bias else g.new(where + ": zero start", "zero", g.sizes.e)
    a_values, b_values = lookup(g, where, " a", a), lookup(g, where, " b", b)
    out = make_out(where + ": addmm")
    del inverse, zero, a_values, b_values
    return out


def lookup(g, where, name, count, table=False):
    """fp8_gemm._look_up (CPU): the 256-entry table in the compute dtype, the FP8 bytes as int32
    codes (4 bytes each), index_select into 16-bit values; codes and table go. `table`: the
    FP32 table of scaled values dequantize makes first (gone once cast). Returns the values."""
    table32 = g.new(where + name + ": table / scale", "table32", 4 * 256) if table else None
    values_table = g.new(where + name + ": table", "table", 256 * g.sizes.e)
    del table32
    codes = g.new(where + name + ": int32 codes", "codes", 4 * count)
    values = g.new(where + name + ": index_select", "values", count * g.sizes.e)
    del codes, values_table
    return values


def dequantize(g, where, name, count):
    """fp8_gemm.dequantize to 16 bits: CUDA q.float() / scale, cast down; CPU a lookup in the
    table of scaled values. Returns the 16-bit copy."""
    if not g.sizes.cuda:
        return lookup(g, where, name, count, table=True)
    wide = g.new(where + name + ": .float()", "wide", 4 * count)
    divided = g.new(where + name + ": / scale", "divided", 4 * count)
    del wide
    narrow = g.new(where + name + ": to 16 bits", "16 bit", count * g.sizes.e)
    del divided
    return narrow


def _backward(g, node, grads):
    """dx = g W and dW = g^T x (+ db = sum g), g the incoming gradient. The chapter's (fp8_grad=bf16):
    dx with the BF16 weight, dW with x dequantized. Then the node lets go of x8 and the scales:
    where they are the kept copy's scale (the forward that made the copy), they stay, kept."""
    z = g.sizes
    M, n_in, n_out, op = z.b * z.s, node.ctx["n_in"], node.ctx["n_out"], node.name
    if not z.fp8_e5m2:
        dx = g.new(op + " backward: dx", op + " dx", M * n_in * z.e, region=grads[0].region)
        x16 = dequantize(g, op + " backward:", " x", M * n_in)
        g.param_grad(op + " backward: dW", op + ".weight", n_out * n_in * z.e)
        del x16
    else:
        dx, held = _e5m2_backward(g, op, M, n_in, n_out, grads[0].region)
    if z.bias:  # g.sum(0, dtype=float32).to(bf16)
        db32 = g.new(op + " backward: db (fp32)", op + " db32", 4 * n_out)
        g.param_grad(op + " backward: db", op + ".bias", n_out * z.e)
        del db32
    return [dx]


def _e5m2_backward(g, op, M, n_in, n_out, region):
    """fp8_refined._FP8LinearFunction.backward with grad="e5m2" (TE's HYBRID): the output gradient's scale
    (4 bytes) and E5M2 copy (through FP32); the kept copy's column-major twin, made at the
    layer's first backward and kept; dx = g8 @ W8; dW = g8^T @ x8 in FP8 (two column-major
    copies) when the token count M is a multiple of 16, else in FP32 values. Returns dx and
    what the backward holds until it returns (g8 and its scale)."""
    z, w = g.sizes, n_in * n_out
    g_scale = g.new(op + " backward: g scale", op + " g scale", 4)
    g32 = g.new(op + " backward: g * scale (fp32)", op + " g fp32", 4 * M * n_out)
    g8 = g.new(op + " backward: g to e5m2", op + " g8", M * n_out)
    del g32
    if "twin" not in g.kept.get(g.prefix + op, {}):
        g.keep(op, twin=g.new(op + " backward: W8 column-major (kept)", op + " E4M3 weight, column-major (kept)", w))
    dx = scaled_mm(g, op + " backward dx", M * n_out, w, lambda where: g.new(where, op + " dx", M * n_in * z.e,
                                                                             region=region), False)
    if M % 16 == 0:
        g8t = g.new(op + " backward: g8^T contiguous", op + " g8t", M * n_out)
        x8c = g.new(op + " backward: x8 column-major", op + " x8c", M * n_in)
        scaled_mm(g, op + " backward dW", M * n_out, M * n_in,
                  lambda where: g.param_grad(where, op + ".weight", n_out * n_in * z.e), False)
        del g8t, x8c
    else:  # fp8_gemm.scaled_mm_any_shape: both operands' values in FP32, one FP32 mm, alpha, one rounding
        inverse = g.alloc(op + " backward dW: 1/scales", ("1/scales", 8))
        g32 = values32(g, op + " backward dW:", " g", M * n_out)
        x32 = values32(g, op + " backward dW:", " x", M * n_in)
        dw32 = g.new(op + " backward dW: mm (fp32)", op + " dW fp32", 4 * w)
        del g32, x32
        alpha = g.new(op + " backward dW: alpha", "alpha", 4)
        del alpha  # mul_ scales the FP32 sum in place
        g.param_grad(op + " backward: dW", op + ".weight", n_out * n_in * z.e)
        del dw32, inverse
    return dx, (g8, g_scale)


def values32(g, where, name, count):
    """fp8_gemm.fp8_values(q, float32): CUDA q.float(); CPU the cached FP32 table (no copy: .to()
    of an FP32 tensor is itself) indexed by int32 codes, which go once looked up."""
    if g.sizes.cuda:
        return g.new(where + name + ": .float()", "values", 4 * count)
    codes = g.new(where + name + ": int32 codes", "codes", 4 * count)
    values = g.new(where + name + ": index_select", "values", 4 * count)
    del codes
    return values
