"""The peak of a training step, derived: a walk over what is alive at each op of backward.

Chapter section 3 (what recomputation costs and saves) and 4 (the ledger's peak).
Read memory_ledger.py first (block_activation_terms: the tensors one block saves), then
memory_ops.py (each op's allocations and frees), then `walk_step` here: the state after
forward, the head's backward, each block's (or recompute unit's) backward last to first,
the embeddings', then the optimizer step. memory_ledger.peak_estimate calls it.

Under each policy (checkpoint.py):
  none       every block's saved tensors are alive when backward starts; each block frees
             its own as backward passes through it.
  selective  the attention core's saved tensors come back for the length of its own
             backward (checkpoint.Recompute re-runs it), with its recomputed output and the
             incoming gradient held by the Recompute node until it returns.
  full/sqrt  only the unit inputs are alive; backward re-runs a unit's forward (every
             block of the unit saves everything again) and walks back through it, while
             the unit's input, its recomputed output and incoming gradient stay held.
Only the backward re-runs are walked: a unit's first, no-grad forward frees as it goes and
never holds more than its re-run in backward does.
"""
from memory_ops import (FLIGHT, GRAD, SAVED, Walk, core_backward, core_forward, dropout_forward, flight,
                        layernorm_backward, linear_backward, linear_forward, qkv_grad)



def block_forward(w, p, z, T, x, out):
    """model.Block.forward with autograd recording, from its input x (alive) to `out` (SAVED:
    the next block's ln_1 input, or ln_f's). Saved tensors get T's names, prefixed by p."""
    h, bsh, e, fp8 = z.h, z.bsh, z.e, z.fp8
    ln1 = p + ("ln_1 output" if fp8 else "c_attn input")  # FP8Linear saves its own E4M3 copy instead
    w.step(p + "ln_1", new=[(p + "ln_1 mean+rstd", T["ln_1 mean+rstd"], SAVED), (ln1, bsh * e, FLIGHT if fp8 else SAVED)])
    # saved when the core keeps views of it (sdpa; one sequence, b = 1: memory_ops.core_forward)
    saved_qkv = z.core == "sdpa" or (z.b == 1 and (z.core == "manual" or z.e == 4))
    qkv, kind = (p + "q,k,v (c_attn output)", SAVED) if saved_qkv else (p + "qkv", FLIGHT)
    linear_forward(w, p, z, "attn.c_attn", ln1, qkv, h, 3 * h, p + "c_attn input", kind)
    y = core_forward(w, p, z, T, qkv)  # sdpa's output is laid out (B, T, a, d) already: no copy below
    if z.core != "sdpa":  # y.transpose(1, 2).contiguous(): the manual core's (B, a, T, d) output copied
        y2 = p + ("y2" if fp8 else "c_proj input")
        w.step(p + "y contiguous", new=[(y2, bsh * e, FLIGHT if fp8 else SAVED)], free=[y])
        y = y2
    linear_forward(w, p, z, "attn.c_proj", y, p + "attn out", h, h, p + "c_proj input")
    attn_out = residual_dropout(w, p, z, T, "residual dropout mask", p + "attn out")
    w.step(p + "attention done", free=[x for x in (qkv, ln1, y) if w.has(x) and w.alive[x][1] == FLIGHT])
    w.step(p + "x + attn", new=[(p + "ln_2 input", bsh * e, SAVED)], free=[attn_out])
    ln2 = p + ("ln_2 output" if fp8 else "c_fc input")
    w.step(p + "ln_2", new=[(p + "ln_2 mean+rstd", T["ln_2 mean+rstd"], SAVED), (ln2, bsh * e, FLIGHT if fp8 else SAVED)])
    linear_forward(w, p, z, "mlp.c_fc", ln2, p + "GELU input", h, 4 * h, p + "c_fc input", SAVED)
    gelu = p + ("GELU output" if fp8 else "MLP c_proj input (GELU output)")
    w.step(p + "GELU", new=[(gelu, 4 * bsh * e, FLIGHT if fp8 else SAVED)])
    linear_forward(w, p, z, "mlp.c_proj", gelu, p + "mlp out", 4 * h, h, p + "MLP c_proj input (GELU output)")
    mlp_out = residual_dropout(w, p, z, T, "MLP dropout mask", p + "mlp out")
    w.step(p + "MLP done", free=[x for x in (gelu, ln2) if fp8])
    w.step(p + "x + mlp", new=[(out, bsh * e, SAVED)], free=[mlp_out])


def residual_dropout(w, p, z, T, mask, x):
    if not z.drop:  # F.dropout with p = 0 returns its input
        return x
    dropout_forward(w, p + mask, z, p + mask, T[mask], x + " dropped", z.bsh * z.e, x=x)
    return x + " dropped"


def block_backward(w, p, z, T, g, x, out_g, x_held=False, g_held=False, selective=False):
    """Backward through one block from its output gradient g to out_g, its input's gradient.
    x_held: the block's input stays alive (a recompute unit's kept input); g_held: g does too
    (the Recompute node holds its incoming gradient until it returns)."""
    h, bsh, e = z.h, z.bsh, z.e
    gm = dropout_backward(w, p, z, "MLP dropout mask", g)
    gc = linear_backward(w, p, z, "mlp.c_proj", gm, 4 * h, h, [p + "MLP c_proj input (GELU output)"], z.drop)
    w.step(p + "GELU backward", new=[flight(p + "dGELU", 4 * bsh * e)], free=[p + "GELU input", gc])
    gf = linear_backward(w, p, z, "mlp.c_fc", p + "dGELU", h, 4 * h, [p + "c_fc input"], True)
    gl = layernorm_backward(w, p, z, "ln_2", gf, p + "ln_2 input", x_held=False)
    # the residual: ln_2's gradient and the one that skipped the MLP add into a new tensor
    w.step(p + "x1 gradients add", new=[flight(p + "dx1", bsh * e)], free=[gl] + ([] if g_held else [g]))
    ga = dropout_backward(w, p, z, "residual dropout mask", p + "dx1")
    sdpa_out = z.core == "sdpa" and not z.fp8  # c_proj's saved input is sdpa's output: sdpa frees it
    gy = linear_backward(w, p, z, "attn.c_proj", ga, h, h, [None if sdpa_out else p + "c_proj input"], z.drop)
    if selective:  # checkpoint.Recompute re-runs the core, then differentiates it
        qkv = p + "q,k,v (recompute inputs)"
        y = core_forward(w, p, z, T, qkv)
        gq, gk, gv = core_backward(w, p, z, gy, free_gy=False, qkv=qkv, free_qkv=False)
        w.step(p + "core recompute done", free=[y, gy, qkv])
    else:
        gq, gk, gv = core_backward(w, p, z, gy, free_gy=True, qkv=p + "q,k,v (c_attn output)")
    gqkv = qkv_grad(w, p, z, gq, gk, gv)
    ga = linear_backward(w, p, z, "attn.c_attn", gqkv, h, 3 * h, [p + "c_attn input"], True)
    gl = layernorm_backward(w, p, z, "ln_1", ga, x, x_held=x_held)
    w.step(p + "input gradients add", new=[flight(out_g, bsh * e)], free=[gl, p + "dx1"])
    return out_g


def dropout_backward(w, p, z, mask, g, free_g=False):
    """The gradient times the saved mask (scaled): a new tensor. Without dropout, g itself.
    free_g: g has no other consumer (a residual branch would still hold it)."""
    if not z.drop:
        return g
    w.step(p + mask.replace("mask", "backward"), new=[flight(g + " dropped", z.bsh * z.e)],
           free=[p + mask] + ([g] if free_g else []))
    return g + " dropped"


def unit_backward(w, u, blocks, z, T, g):
    """checkpoint.Recompute.backward for one unit, from its output gradient g: re-run its
    blocks' forward from the kept input, differentiate, then release the input, the
    recomputed output and g. Returns the gradient of the unit's input."""
    x = f"unit {u} input"
    names = [x] + [f"{i}.ln_1 input" for i in blocks[1:]] + [f"unit {u} output"]
    for j, i in enumerate(blocks):
        block_forward(w, f"{i}.", z, T, names[j], names[j + 1])
    w.alive[names[-1]] = (w.alive[names[-1]][0], FLIGHT)  # held by Recompute.backward's `outputs`, saved by nothing
    g_in = g
    for j in reversed(range(len(blocks))):
        i = blocks[j]
        g = block_backward(w, f"{i}.", z, T, g, names[j], f"{i}.dx", x_held=j == 0, g_held=g == g_in)
    w.step(f"unit {u} backward done", free=[x, names[-1], g_in])
    return g


# ---------------------------------------------------------------- the whole step

def walk_step(z, static, T, T_kept, H, policy, units, groups, master_grads, fp32_sums, shard=1):
    """Walk one steady-state micro-step and its optimizer step; returns the Walk (peak, where, parts).

    static: bytes alive throughout (states, buffers, the batch). T: one block's saved terms
    under policy none, {name: bytes}; T_kept: under this policy (selective: the core's inputs
    instead of its internals). H: the saved terms outside the blocks. units: recompute units
    (full/sqrt) or []. groups: AdamW's parameter-group sizes (foreach AdamW makes one FP32
    sqrt(v) temporary per group). master_grads: bytes of the FP32 copies of the 16-bit
    gradients the optimizer step makes (4 per parameter; 0 for fp32). fp32_sums: with
    FP32 accumulation buffers those copies are made right after backward instead, added
    into the buffers and freed with the 16-bit .grad (accumulate.accumulation_step).
    """
    w, e = Walk(static, shard), z.e
    if units:
        kept = [(f"unit {u} input", z.bsh * e, SAVED) for u in range(len(units))]
    else:
        kept = [(f"{i}.{n}", v, SAVED) for i in range(z.L) for n, v in T_kept.items()]
    w.step("end of forward", new=kept + [("head." + n, v, SAVED) for n, v in H.items()]
           + [flight("loss", 4), flight("loss x weight", 4)] + ([flight("loss x scale", 4)] if z.loss_scaled else []))
    g = head_backward(w, z)
    if units:
        for u in reversed(range(len(units))):
            g = unit_backward(w, u, units[u], z, T, g)
    else:
        for i in reversed(range(z.L)):
            g = block_backward(w, f"{i}.", z, T, g, f"{i}.ln_1 input", f"{i}.dx", selective=policy == "selective")
    embedding_backward(w, z, g)
    w.step("backward done", free=["loss x weight", "seed"] + (["loss x scale"] if z.loss_scaled else []))
    w.step("the step's running mean loss", new=[flight("running loss", 4)])  # accumulate.py's total_loss
    optimizer_step(w, groups, master_grads, fp32_sums, shard)
    return w


def head_backward(w, z):
    """Cross-entropy on FP32 logits, the tied head (x @ wte^T) and ln_f, backward."""
    bsV, e = z.b * z.s * z.V, z.e
    # backward() seeds with ones_like(loss), which its Python frame holds until the engine returns
    w.step("backward: the loss gradient", new=[flight("seed", 4), flight("seed x weight", 4)])
    w.step("cross-entropy backward (nll)", new=[flight("dlogp", 4 * bsV)], free=["seed x weight", "head.loss total_weight"])
    w.step("log-softmax backward (start of backward)", new=[flight("dlogits32", 4 * bsV)],
           free=["dlogp", "head.log-softmax output (fp32)"])
    g = "dlogits32"
    if e != 4:  # logits.float()'s backward: the gradient back to the logits' dtype
        w.step("logits gradient to 16 bits", new=[flight("dlogits", e * bsV)], free=[g])
        g = "dlogits"
    w.step("head backward: d wte", new=[("wte.weight grad", z.V * z.h * e, GRAD)])
    w.step("head backward: dx", new=[flight("dhead", z.bsh * e)])
    w.step("head backward done", free=[g, "head.head input (ln_f output)"])
    return layernorm_backward(w, "head.", z, "ln_f", "dhead", "head.ln_f input", x_held=False)


def embedding_backward(w, z, g):
    """drop(wte(idx) + wpe(pos)) backward: wpe's gradient sums over the batch; wte's adds onto
    the head's (a new tensor, then the old one and the embedding's own are freed)."""
    e, sh = z.e, z.s * z.h
    g = dropout_backward(w, "head.", z, "embedding dropout mask", g, free_g=True)
    w.step("wpe gradient: sum over the batch", new=[flight("dpos", sh * e)])
    w.step("wpe backward", new=[("wpe.weight grad", sh * e, GRAD)], free=["dpos", "head.positions (wpe)"])
    w.step("wte backward", new=[flight("dwte", z.V * z.h * e)], free=[g])
    w.step("wte gradient accumulated", new=[("wte.weight grad (sum)", z.V * z.h * e, GRAD)],
           free=["wte.weight grad", "dwte"])


def optimizer_step(w, groups, master_grads, fp32_sums, shard):
    """precision.MasterWeightOptimizer.step: FP32 copies of the gradients (16-bit precisions),
    then torch's foreach AdamW, whose sqrt(v) is an FP32 temporary the size of each group."""
    if fp32_sums:  # the FP32 buffers are the optimizer's gradients: no copy at the step
        grads = [name for name, (_, kind) in w.alive.items() if kind == GRAD]
        w.step("FP32 sums: every .grad as FP32", new=[flight("grads as fp32", master_grads // shard)],
               free=["grads as fp32"] + grads)
    elif master_grads:
        w.step("optimizer step: FP32 master gradients", new=[flight("master grads", master_grads // shard)])
    for k, n in enumerate(groups):
        w.step(f"optimizer step: AdamW sqrt(v), group {k}", new=[flight("sqrt v", 4 * n // shard)], free=["sqrt v"])
    # zero_grad frees every gradient; the step's last reference to the loss goes with it
    w.step("optimizer step done", free=[name for name, (_, kind) in w.alive.items() if kind == GRAD]
           + [x for x in ("master grads", "loss", "running loss") if x in w.alive])
