"""The peak of a training step, derived: a walk over what is alive at each op of backward.

Chapter section 3 (what recomputation costs and saves) and 4 (the ledger's peak).
Read memory_ledger.py first (block_activation_terms: the tensors one block saves), then
memory_ops.py and memory_linear.py (each op's allocations and frees), then `walk_step`
here: the state after forward, the head's backward, each block's (or recompute unit's)
backward last to first, the embeddings', then the optimizer step. The step is
accumulation_step with one micro-batch (K = 1), as memory_measure.measure runs it:
micro-step 1, where native FP8 quantizes each weight and keeps the E4M3 copy until just
before AdamW (memory_linear.py). memory_ledger.peak_estimate calls it.

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
never holds more than its re-run in backward does (it makes the kept FP8 copies, which the
re-run reuses). With K > 1 micro-steps this is micro-step 1 only: micro-steps 2..K start
with the earlier ones' .grad alive (unless FP32 sums took them) and the FP8 copies kept.
"""
from memory_linear import kept_copies, linear_backward, linear_forward
from memory_ops import (FLIGHT, GRAD, KEPT, SAVED, Walk, core_backward, core_forward, dropout_forward, flight,
                        layernorm_backward, qkv_grad)


def block_forward(walk, pre, sizes, terms, x, out):
    """model.Block.forward with autograd recording, from its input x (alive) to `out` (SAVED:
    the next block's ln_1 input, or ln_f's). Saved tensors get `terms`' names, prefixed by `pre`."""
    h, bsh, e, fp8 = sizes.h, sizes.bsh, sizes.e, sizes.fp8
    ln1 = pre + ("ln_1 output" if fp8 else "c_attn input")  # FP8Linear saves its own E4M3 copy instead
    walk.step(pre + "ln_1", new=[(pre + "ln_1 mean+rstd", terms["ln_1 mean+rstd"], SAVED),
                                 (ln1, bsh * e, FLIGHT if fp8 else SAVED)])
    # saved when the core keeps views of it (sdpa; one sequence, b = 1: memory_ops.core_forward)
    saved_qkv = sizes.core == "sdpa" or (sizes.b == 1 and (sizes.core == "manual" or sizes.e == 4))
    qkv, kind = (pre + "q,k,v (c_attn output)", SAVED) if saved_qkv else (pre + "qkv", FLIGHT)
    linear_forward(walk, pre, sizes, "attn.c_attn", ln1, qkv, h, 3 * h, pre + "c_attn input", kind)
    y = core_forward(walk, pre, sizes, terms, qkv)  # sdpa's output is laid out (B, T, a, d) already: no copy below
    if sizes.core != "sdpa":  # y.transpose(1, 2).contiguous(): the manual core's (B, a, T, d) output copied
        y2 = pre + ("y2" if fp8 else "c_proj input")
        walk.step(pre + "y contiguous", new=[(y2, bsh * e, FLIGHT if fp8 else SAVED)], free=[y])
        y = y2
    linear_forward(walk, pre, sizes, "attn.c_proj", y, pre + "attn out", h, h, pre + "c_proj input")
    attn_out = residual_dropout(walk, pre, sizes, terms, "residual dropout mask", pre + "attn out")
    walk.step(pre + "attention done", free=[t for t in (qkv, ln1, y) if walk.has(t) and walk.alive[t][1] == FLIGHT])
    walk.step(pre + "x + attn", new=[(pre + "ln_2 input", bsh * e, SAVED)], free=[attn_out])
    ln2 = pre + ("ln_2 output" if fp8 else "c_fc input")
    walk.step(pre + "ln_2", new=[(pre + "ln_2 mean+rstd", terms["ln_2 mean+rstd"], SAVED),
                                 (ln2, bsh * e, FLIGHT if fp8 else SAVED)])
    linear_forward(walk, pre, sizes, "mlp.c_fc", ln2, pre + "GELU input", h, 4 * h, pre + "c_fc input", SAVED)
    gelu = pre + ("GELU output" if fp8 else "MLP c_proj input (GELU output)")
    walk.step(pre + "GELU", new=[(gelu, 4 * bsh * e, FLIGHT if fp8 else SAVED)])
    linear_forward(walk, pre, sizes, "mlp.c_proj", gelu, pre + "mlp out", 4 * h, h,
                   pre + "MLP c_proj input (GELU output)")
    mlp_out = residual_dropout(walk, pre, sizes, terms, "MLP dropout mask", pre + "mlp out")
    walk.step(pre + "MLP done", free=[gelu, ln2] if fp8 else [])
    walk.step(pre + "x + mlp", new=[(out, bsh * e, SAVED)], free=[mlp_out])


def residual_dropout(walk, pre, sizes, terms, mask, x):
    if not sizes.drop:  # F.dropout with p = 0 returns its input
        return x
    dropout_forward(walk, pre + mask, sizes, pre + mask, terms[mask], x + " dropped", sizes.bsh * sizes.e, x=x)
    return x + " dropped"


def block_backward(walk, pre, sizes, terms, grad, x, out_g, x_held=False, g_held=False, selective=False):
    """Backward through one block from its output gradient `grad` to out_g, its input's gradient.
    x_held: the block's input stays alive (a recompute unit's kept input); g_held: `grad` does
    too (the Recompute node holds its incoming gradient until it returns)."""
    h, bsh, e = sizes.h, sizes.bsh, sizes.e
    gm = dropout_backward(walk, pre, sizes, "MLP dropout mask", grad)
    gc = linear_backward(walk, pre, sizes, "mlp.c_proj", gm, 4 * h, h, [pre + "MLP c_proj input (GELU output)"],
                         sizes.drop)
    walk.step(pre + "GELU backward", new=[flight(pre + "dGELU", 4 * bsh * e)], free=[pre + "GELU input", gc])
    gf = linear_backward(walk, pre, sizes, "mlp.c_fc", pre + "dGELU", h, 4 * h, [pre + "c_fc input"], True)
    gl = layernorm_backward(walk, pre, sizes, "ln_2", gf, pre + "ln_2 input", x_held=False)
    # the residual: ln_2's gradient and the one that skipped the MLP add into a new tensor
    walk.step(pre + "x1 gradients add", new=[flight(pre + "dx1", bsh * e)], free=[gl] + ([] if g_held else [grad]))
    ga = dropout_backward(walk, pre, sizes, "residual dropout mask", pre + "dx1")
    sdpa_out = sizes.core == "sdpa" and not sizes.fp8  # c_proj's saved input is sdpa's output: sdpa frees it
    gy = linear_backward(walk, pre, sizes, "attn.c_proj", ga, h, h, [None if sdpa_out else pre + "c_proj input"],
                         sizes.drop)
    if selective:  # checkpoint.Recompute re-runs the core, then differentiates it
        qkv = pre + "q,k,v (recompute inputs)"
        y = core_forward(walk, pre, sizes, terms, qkv)
        gq, gk, gv = core_backward(walk, pre, sizes, gy, free_gy=False, qkv=qkv, free_qkv=False)
        walk.step(pre + "core recompute done", free=[y, gy, qkv])
    else:
        gq, gk, gv = core_backward(walk, pre, sizes, gy, free_gy=True, qkv=pre + "q,k,v (c_attn output)")
    gqkv = qkv_grad(walk, pre, sizes, gq, gk, gv)
    ga = linear_backward(walk, pre, sizes, "attn.c_attn", gqkv, h, 3 * h, [pre + "c_attn input"], True)
    gl = layernorm_backward(walk, pre, sizes, "ln_1", ga, x, x_held=x_held)
    walk.step(pre + "input gradients add", new=[flight(out_g, bsh * e)], free=[gl, pre + "dx1"])
    return out_g


def dropout_backward(walk, pre, sizes, mask, grad, free_g=False):
    """The gradient times the saved mask (scaled): a new tensor. Without dropout, `grad` itself.
    free_g: `grad` has no other consumer (a residual branch would still hold it)."""
    if not sizes.drop:
        return grad
    walk.step(pre + mask.replace("mask", "backward"), new=[flight(grad + " dropped", sizes.bsh * sizes.e)],
              free=[pre + mask] + ([grad] if free_g else []))
    return grad + " dropped"


def unit_backward(walk, u, blocks, sizes, terms, grad):
    """checkpoint.Recompute.backward for unit u, from its output gradient `grad`: re-run its
    blocks' forward from the kept input, differentiate, then release the input, the
    recomputed output and that gradient. Returns the gradient of the unit's input."""
    kept = f"unit {u} input"
    names = [kept] + [f"{i}.ln_1 input" for i in blocks[1:]] + [f"unit {u} output"]
    for j, i in enumerate(blocks):
        block_forward(walk, f"{i}.", sizes, terms, names[j], names[j + 1])
    # the unit's output: held by Recompute.backward's `outputs`, saved by nothing
    walk.alive[names[-1]] = (walk.alive[names[-1]][0], FLIGHT)
    g_in = grad
    for j in reversed(range(len(blocks))):
        i = blocks[j]
        grad = block_backward(walk, f"{i}.", sizes, terms, grad, names[j], f"{i}.dx", x_held=j == 0,
                              g_held=grad == g_in)
    walk.step(f"unit {u} backward done", free=[kept, names[-1], g_in])
    return grad


# ---------------------------------------------------------------- the whole step

def walk_step(sizes, static, terms, kept_terms, head_terms, policy, units, groups, master_grads, fp32_sums, shard=1):
    """Walk one steady-state micro-step and its optimizer step; returns the Walk (peak, where, parts).

    static: bytes alive throughout (states, buffers, the batch). terms: one block's saved terms
    under policy none, {name: bytes}; kept_terms: under this policy (selective: the core's inputs
    instead of its internals). head_terms: the saved terms outside the blocks. units: recompute units
    (full/sqrt) or []. groups: AdamW's parameter-group sizes (foreach AdamW makes one FP32
    sqrt(v) temporary per group). master_grads: bytes of the FP32 copies of the 16-bit
    gradients the optimizer step makes (4 per parameter; 0 for fp32). fp32_sums: with
    FP32 accumulation buffers those copies are made right after backward instead, added
    into the buffers and freed with the 16-bit .grad (accumulate.accumulation_step).
    Native FP8's kept weight copies are alive from the forward (memory_linear.kept_copies; a
    forward that saves, under none/selective, shares their scales with its saved tensors).
    """
    walk, e = Walk(static, shard), sizes.e
    if units:
        kept = [(f"unit {u} input", sizes.bsh * e, SAVED) for u in range(len(units))]
    else:
        kept = [(f"{i}.{name}", v, SAVED) for i in range(sizes.L) for name, v in kept_terms.items()]
    # native FP8: every Linear's E4M3 weight, quantized in this micro-step's forward, kept till AdamW
    kept += kept_copies(sizes, with_scales=bool(units)) if sizes.fp8 and not sizes.fp8_te else []
    walk.step("end of forward", new=kept + [("head." + name, v, SAVED) for name, v in head_terms.items()]
              + [flight("loss", 4), flight("loss x weight", 4)]
              + ([flight("loss x scale", 4)] if sizes.loss_scaled else []))
    grad = head_backward(walk, sizes)
    if units:
        for u in reversed(range(len(units))):
            grad = unit_backward(walk, u, units[u], sizes, terms, grad)
    else:
        for i in reversed(range(sizes.L)):
            grad = block_backward(walk, f"{i}.", sizes, terms, grad, f"{i}.ln_1 input", f"{i}.dx",
                                  selective=policy == "selective")
    embedding_backward(walk, sizes, grad)
    walk.step("backward done", free=["loss x weight", "seed"] + (["loss x scale"] if sizes.loss_scaled else []))
    if fp32_sums:  # accumulate.accumulation_step adds the 16-bit gradients into the FP32 buffers first
        grads = [name for name, (_, kind) in walk.alive.items() if kind == GRAD]
        walk.step("FP32 sums: every .grad as FP32", new=[flight("grads as fp32", master_grads // shard)],
                  free=["grads as fp32"] + grads)
    walk.step("the step's running mean loss", new=[flight("running loss", 4)])  # accumulate.py's total_loss
    optimizer_step(walk, groups, master_grads, fp32_sums, shard)
    return walk


def head_backward(walk, sizes):
    """Cross-entropy on FP32 logits, the tied head (x @ wte^T) and ln_f, backward."""
    bsV, e = sizes.b * sizes.s * sizes.V, sizes.e
    # backward() seeds with ones_like(loss), which its Python frame holds until the engine returns
    walk.step("backward: the loss gradient", new=[flight("seed", 4), flight("seed x weight", 4)])
    walk.step("cross-entropy backward (nll)", new=[flight("dlogp", 4 * bsV)],
              free=["seed x weight", "head.loss total_weight"])
    walk.step("log-softmax backward (start of backward)", new=[flight("dlogits32", 4 * bsV)],
              free=["dlogp", "head.log-softmax output (fp32)"])
    grad = "dlogits32"
    if e != 4:  # logits.float()'s backward: the gradient back to the logits' dtype
        walk.step("logits gradient to 16 bits", new=[flight("dlogits", e * bsV)], free=[grad])
        grad = "dlogits"
    walk.step("head backward: d wte", new=[("wte.weight grad", sizes.V * sizes.h * e, GRAD)])
    walk.step("head backward: dx", new=[flight("dhead", sizes.bsh * e)])
    walk.step("head backward done", free=[grad, "head.head input (ln_f output)"])
    return layernorm_backward(walk, "head.", sizes, "ln_f", "dhead", "head.ln_f input", x_held=False)


def embedding_backward(walk, sizes, grad):
    """drop(wte(idx) + wpe(pos)) backward: wpe's gradient sums over the batch; wte's adds onto
    the head's (a new tensor, then the old one and the embedding's own are freed)."""
    e, sh = sizes.e, sizes.s * sizes.h
    grad = dropout_backward(walk, "head.", sizes, "embedding dropout mask", grad, free_g=True)
    walk.step("wpe gradient: sum over the batch", new=[flight("dpos", sh * e)])
    walk.step("wpe backward", new=[("wpe.weight grad", sh * e, GRAD)], free=["dpos", "head.positions (wpe)"])
    walk.step("wte backward", new=[flight("dwte", sizes.V * sizes.h * e)], free=[grad])
    walk.step("wte gradient accumulated", new=[("wte.weight grad (sum)", sizes.V * sizes.h * e, GRAD)],
              free=["wte.weight grad", "dwte"])


def optimizer_step(walk, groups, master_grads, fp32_sums, shard):
    """accumulate.optimizer_step: the kept FP8 weights released (the weights are about to change),
    then precision.MasterWeightOptimizer.step: FP32 copies of the gradients (16-bit precisions),
    then torch's foreach AdamW, whose sqrt(v) is an FP32 temporary the size of each group."""
    kept = [name for name, (_, kind) in walk.alive.items() if kind == KEPT]
    if kept:
        walk.step("FP8 weight copies released", free=kept)
    if master_grads and not fp32_sums:  # the FP32 buffers are the optimizer's gradients: no copy at the step
        walk.step("optimizer step: FP32 master gradients", new=[flight("master grads", master_grads // shard)])
    for group, count in enumerate(groups):
        walk.step(f"optimizer step: AdamW sqrt(v), group {group}", new=[flight("sqrt v", 4 * count // shard)],
                  free=["sqrt v"])
    # zero_grad frees every gradient; the step's last reference to the loss goes with it
    walk.step("optimizer step done", free=[name for name, (_, kind) in walk.alive.items() if kind == GRAD]
              + [x for x in ("master grads", "loss", "running loss") if x in walk.alive])
