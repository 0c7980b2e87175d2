"""torch's math path for scaled_dot_product_attention, as the ledger's walk sees it.

Chapter sections 3 and 4. Read ledger/ops.py first (the ops and how they record): this is
the one op whose insides are not ours but torch's composite, taken on CPU where attn=sdpa has
dropout (ops.Sizes.core == "math"): _scaled_dot_product_attention_math upcasts q, k and v to
FP32, scales q and k, adds a causal bias, softmax, dropout with FP32 noise, casts the weights
back (and returns them), @ v, casts the output back. It saves what the manual core saves, in
FP32; its steps were read op by op off LiveTensors, like the rest of the walk.
"""
from ledger.walk import Tensor


def forward(g, name, q, k, v):
    """torch's math path (_scaled_dot_product_attention_math), taken on CPU with dropout: q, k, v
    in FP32, q and k scaled, a causal bias of -inf above the diagonal, softmax, dropout (its
    noise in FP32 too), the attention weights cast back and returned, @ v, the output cast
    back. It saves what the manual core saves, in FP32. (For one sequence the scaled q and k
    are what QK^T saves, walked here as one allocation.) A k or v made contiguous already (head-major:
    grouped-query attention's repeated heads) is multiplied as it is, without the copy."""
    z = g.sizes
    one, bsh, A, e = z.b == 1, z.bsh, z.a * z.s * z.s * z.b, z.e
    whole = {name: one or t.layout == "head-major" for name, t in (("k", k), ("v", v))}  # no copy for the bmm
    temps, keep = [], {}
    if e != 4:
        q32, k32, v32 = g.alloc(name + " math: q, k, v to fp32", ("q32", bsh * 4), ("k32", bsh * 4),
                                (name + " math V copy (fp32)", bsh * 4), region=True, dtype="float32")
        temps += [q32, k32]
        if whole["v"]:
            keep["v"] = v32
        else:
            temps.append(v32)
        del q32, k32, v32
    elif whole["v"]:
        keep["v"] = v  # FP32 already: the view of c_attn's output itself (or the repeated heads)
    if one:  # the scaled q and k are what QK^T saves (walked here both at once)
        keep["q"], keep["k"] = g.alloc(name + " math: q * scale", (name + " math Q copy (fp32)", bsh * 4),
                                          (name + " math K copy (fp32)", bsh * 4), region=True, dtype="float32")
    else:
        temps.append(g.new(name + " math: q * scale", "qs", bsh * 4, region=True, dtype="float32"))
    tril = g.new(name + " math: causal tril", "tril", z.s * z.s, dtype="bool")
    bias = g.new(name + " math: causal bias", "bias", z.s * z.s * 4, dtype="float32")
    temps.append(bias)  # the mask lives to the end
    del bias
    del tril
    ks = None
    if not one:
        ks = g.new(name + " math: k * scale", "ks" if not whole["k"] else name + " math K (fp32)", bsh * 4,
                   region=True, dtype="float32")
        copies = [(name + " math Q copy (fp32)", bsh * 4)] + [(name + " math K copy (fp32)", bsh * 4)] * \
            (not whole["k"])
        keep["q"], keep["k"] = (g.alloc(name + " QK^T: copies of q, k", *copies, region=True, dtype="float32")
                                + [ks])[:2]
    att = g.new(name + " QK^T", "att", A * 4, region=True, dtype="float32")
    del ks  # a temporary of the QK^T expression: gone when it is done
    att = g.new(name + " + causal bias", "att2", A * 4, region=True, dtype="float32")
    keep["P"] = g.new(name + " softmax", name + " math softmax (fp32)", A * 4, region=True, dtype="float32")
    del att
    keep["mask"] = g.new(name + " attention dropout noise", name + " math dropout mask (fp32)", A * 4,
                            region=True, dtype="float32")
    keep["dropped"] = g.new(name + " attention dropout x * noise", name + " math dropout output (fp32)", A * 4,
                               region=True, dtype="float32")
    if e != 4:  # the math path returns the attention weights too, cast back
        temps.append(g.new(name + " math: weights to 16 bit", "weights16", A * e, region=True))
    if not whole["v"]:
        keep["v"], = g.alloc(name + " att@V: copy of v", (name + " math V copy (fp32)", bsh * 4), region=True,
                             dtype="float32")
    y = g.new(name + " att@V", "y32" if e != 4 else name + " output", bsh * 4, region=True, layout="head-major",
              dtype="float32")
    if e != 4:
        y = g.new(name + " math: output to 16 bit", name + " output", bsh * e, region=True, layout="head-major")
    del temps
    g.record(name, [q, k, v], [y], _backward, saved=[(t, t.storage.entry.label) for t in keep.values()],
             names=list(keep))
    return y


def _backward(g, node, grads):
    """The math path's backward: each op of its forward in reverse, its saved tensors let go as
    each op's backward runs (the node holds them all; this rule drops each in turn)."""
    z = g.sizes
    one, bsh, A, e, n = z.b == 1, z.bsh, z.a * z.s * z.s * z.b, z.e, node.name
    # node.saved is in the record's order (in a recompute unit, its filing order: the same here, since
    # all of them were made before y)
    keep = {key: Tensor(storage) for key, storage in zip(node.ctx["names"], node.saved)}
    node.release()  # from here `keep` holds them: each goes below as its own op's backward runs

    def drop(*names):
        for key in names:
            del keep[key]

    if e != 4:
        dy = g.new(n + " math backward: dy to fp32", "dy", bsh * 4, region=True)
        if not one:
            tmp = g.new(n + " math backward: dy to fp32", "dy tmp", bsh * e)
            del tmp
        grads[0] = None
    elif not one:
        dy = g.new(n + " att@V backward: dy contiguous", "dy", bsh * e, region=True)
        grads[0] = None
    else:
        dy = grads[0]
        grads[0] = None
    gv, dP = g.alloc(n + " att@V backward", ("dv", bsh * 4), ("dP", A * 4), region=True)
    drop("v", "dropped")
    del dy
    dP2 = g.new(n + " attention dropout backward", "dP2", A * 4, region=True)
    drop("mask")
    del dP
    dS = g.new(n + " softmax backward", "dS", A * 4, region=True)
    drop("P")
    del dP2
    gq, gk = g.alloc(n + " QK^T backward", ("dq", bsh * 4), ("dk", bsh * 4), region=True)
    drop("q", "k")
    del dS
    if e != 4:  # back through the scaling of q and k, and down to 16 bits
        gk = g.new(n + " math backward: k scale", "dk scaled", bsh * 4, region=True)
        gq = g.new(n + " math backward: q scale", "dq scaled", bsh * 4, region=True)
        gv = g.new(n + " math backward: to 16 bit", "dv16", bsh * e, region=True)
        gk = g.new(n + " math backward: to 16 bit", "dk16", bsh * e, region=True)
        gq = g.new(n + " math backward: to 16 bit", "dq16", bsh * e, region=True)
    for t in (gq, gk, gv):
        t.layout = "head-major"
    return [gq, gk, gv]
