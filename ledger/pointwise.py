"""The elementwise ops of a description of the model, and the norms built of them: what each
allocates and saves, forward and backward.

Chapter sections 3 and 4 (activation memory; the ledger's peak). Read ledger/ops.py first (the
ops as a whole, and the Linears and attention there); ops.Ops is this class with those added.
Each output takes its input's dtype unless the op says otherwise (to_fp32, cast): a term's
dtype is what ledger/explain.py matches a measured saved tensor by, with its module, before
its bytes.
"""
from ledger.walk import Graph

NORM = "normalization"  # the role of what a norm layer saves (ledger/papers.py sets it beside the paper's)


class Pointwise(Graph):
    """The Graph with PyTorch's elementwise ops (and nn.RMSNorm, made of them)."""

    def rms_norm(self, name, x):
        """nn.RMSNorm, as torch's composite runs it on CPU (rms_norm in aten's layer_norm.cpp;
        torch/_decomp/decompositions.py writes the same): x in FP32, pow(2), mean, + eps in
        place, rsqrt, x * rstd, * weight, back to x's dtype. It keeps x in FP32, rstd and the
        normalized x, all FP32. (On CUDA torch may fuse it, keeping x and rstd: not measured here.)"""
        z = self.sizes
        self.declare("param", name + ".weight", z.h)
        with self.kept_by(NORM):
            x32 = self.to_fp32(name + " x.float()", x)
            rstd = self.rsqrt(name + " rsqrt", self.mean(name + " mean", self.power(name + " pow", x32, 2),
                                                          4 * z.b * z.s))
            return self.cast(name + " type_as", self.by_weight(name + " * weight",
                                                               self.mul(name + " x * rstd", x32, rstd),
                                                               name + ".weight"), z.e)

    def power(self, name, x, exponent):
        """x ** exponent: saves x; backward x ** (exponent - 1), * exponent, * the gradient."""
        out = self.new(name, name + " output", x.nbytes, region=x.region, layout=x.layout, dtype=x.dtype)
        self.record(name, [x], [out], _chain_backward, saved=[(x, name + " input")], steps=3, nbytes=x.nbytes)
        return out

    def rsqrt(self, name, x):
        """1 / sqrt(x): saves its output; backward output ** 3, * -0.5, * the gradient."""
        out = self.new(name, name + " output", x.nbytes, region=x.region, dtype=x.dtype)
        self.record(name, [x], [out], _chain_backward, saved=[(out, name + " output")], steps=3, nbytes=x.nbytes)
        return out

    def mean(self, name, x, nbytes):
        """x.mean(-1, keepdim=True) (nbytes: the result's): saves nothing; backward expands the
        gradient (a view) and divides it: one tensor of x's size."""
        out = self.new(name, name + " output", nbytes, region=x.region, dtype=x.dtype)
        self.record(name, [x], [out], _chain_backward, steps=1, nbytes=x.nbytes)
        return out

    def cast(self, name, x, itemsize):
        """An FP32 x .to() the activations' dtype (`itemsize` bytes): a copy (nothing for FP32);
        backward casts back."""
        if itemsize == 4:
            return x
        out = self.new(name, name + " output", x.nbytes // 4 * itemsize, region=x.region)
        self.record(name, [x], [out], _chain_backward, steps=1, nbytes=x.nbytes)
        return out

    def mul(self, name, a, b):
        """a * b, b the same size as a or broadcast along its last dimension: saves both; backward
        grad * b for a, then grad * a, summed down to b's size where b is smaller."""
        out = self.new(name, name + " output", max(a.nbytes, b.nbytes), region=a.region or b.region, layout=a.layout,
                       dtype=a.dtype)
        self.record(name, [a, b], [out], _mul_backward, saved=[(a, name + " a"), (b, name + " b")],
                    sizes=(a.nbytes, b.nbytes))
        return out

    def by_weight(self, name, x, param):
        """x * a parameter vector (a norm's scale): saves x; backward grad * weight for x, then
        grad * x summed over the tokens (FP32), cast to the parameter's dtype: its .grad."""
        out = self.new(name, name + " output", x.nbytes, region=x.region, dtype=x.dtype)
        self.record(name, [x], [out], _by_weight_backward, saved=[(x, name + " input")], param=param, nbytes=x.nbytes)
        return out

    def pointwise(self, name, x, saves="input", nbytes=None):
        """An elementwise op (GELU, ReLU, SiLU, x * a Python number, ...): one output; it saves
        its input ("input": GELU, SiLU), its output ("output": ReLU, softmax) or nothing (None)."""
        out = self.new(name, name + " output", x.nbytes if nbytes is None else nbytes, region=x.region,
                       layout=x.layout, dtype=x.dtype)
        saved = [(x, name + " input")] if saves == "input" else [(out, name + " output")] if saves else []
        self.record(name, [x], [out], _pointwise_backward, saved=saved, nbytes=x.nbytes)
        return out

    def gelu(self, name, x):
        return self.pointwise(name, x, saves="input")

    def silu(self, name, x):
        return self.pointwise(name, x, saves="input")

    def softmax(self, name, x):
        return self.pointwise(name, x, saves="output")

    def masked_fill(self, name, x, buffer, nbytes):
        """x.masked_fill(mask, value): saves the mask, here a view of a buffer of the module's
        (`buffer`, nbytes: declared here), so nothing new; a new output."""
        self.declare("buffer", buffer, nbytes)
        return self.pointwise(name, x, saves=None)

    def add(self, name, a, b):
        """a + b (a residual): saves nothing; backward hands the same gradient to both, and sums
        it over the batch for an operand broadcast along it (b smaller than a)."""
        out = self.new(name, name + " output", a.nbytes, region=a.region or b.region, dtype=a.dtype)
        self.record(name, [a, b], [out], _add_backward, small=b.nbytes if b.nbytes < a.nbytes else None)
        return out

    def dropout(self, name, x):
        """F.dropout: nothing at p = 0 (it returns its input). CPU: noise = bernoulli(1-p)/(1-p),
        then x * noise, whose mul saves the noise (x's dtype); CUDA: one fused native_dropout saving a
        bool mask."""
        z = self.sizes
        if not z.drop:
            return x
        mask_bytes = x.nbytes // z.e * z.mask_bytes
        if z.cuda:
            mask, out = self.alloc(name, (name + " mask", mask_bytes, "bool"), (name + " output", x.nbytes),
                                   region=x.region, layout=x.layout, dtype=x.dtype)
        else:
            mask = self.new(name + " noise", name + " mask", mask_bytes, region=x.region, dtype=x.dtype)
            out = self.new(name + " x * noise", name + " output", x.nbytes, region=x.region, layout=x.layout,
                           dtype=x.dtype)
        self.record(name, [x], [out], _pointwise_backward, saved=[(mask, name + " mask")], nbytes=x.nbytes)
        return out

    def to_fp32(self, name, x):
        """x.float(): a copy in FP32 (nothing, for an FP32 x)."""
        if self.sizes.e == 4:
            return x
        out = self.new(name, name + " output", x.nbytes // self.sizes.e * 4, region=x.region, dtype="float32")
        self.record(name, [x], [out], _to_16_backward, nbytes=x.nbytes)
        return out

    def scalar(self, name, x):
        """x * a Python number: a new 4-byte loss; backward multiplies its gradient the same way."""
        out = self.new(name, name, 4, dtype="float32")
        self.record(name, [x], [out], _pointwise_backward, nbytes=4)
        return out


# ---------------------------------------------------------------- the backward rules

def _pointwise_backward(g, node, grads):
    return [g.new(node.name + " backward", node.name + " dx", node.ctx["nbytes"], region=grads[0].region)]


def _add_backward(g, node, grads):
    if node.ctx["small"] is None:
        return [grads[0], grads[0]]
    summed = g.new(node.name + " backward: sum over the batch", node.name + " dsmall", node.ctx["small"])
    return [grads[0], summed]


def _to_16_backward(g, node, grads):
    return [g.new(node.name + " backward", node.name + " dx", node.ctx["nbytes"], region=grads[0].region)]


def _chain_backward(g, node, grads):
    """A gradient made in `steps` elementwise ops of one C++ expression (pow_backward's
    `grad * (exp * self.pow(exp - 1))`, rsqrt's `-0.5 * grad * result.pow(3)`): each result a
    temporary that lives to the expression's end, so all are alive when the last is made."""
    made = [g.new(node.name + " backward", node.name + f" d{i}", node.ctx["nbytes"], region=grads[0].region)
            for i in range(node.ctx["steps"])]
    return made[-1:]


def _mul_backward(g, node, grads):
    a_bytes, b_bytes = node.ctx["sizes"]
    da = g.new(node.name + " backward: d a", node.name + " da", a_bytes, region=grads[0].region)
    db = g.new(node.name + " backward: d b", node.name + " db", max(a_bytes, b_bytes), region=grads[0].region)
    if b_bytes < a_bytes:  # summed down to b's size
        db = g.new(node.name + " backward: sum", node.name + " db summed", b_bytes, region=grads[0].region)
    return [da, db]


def _by_weight_backward(g, node, grads):
    z = g.sizes
    dx = g.new(node.name + " backward: dx", node.name + " dx", node.ctx["nbytes"], region=grads[0].region)
    product = g.new(node.name + " backward: g * x", node.name + " g x", node.ctx["nbytes"])
    summed = [g.new(node.name + " backward: sum", node.name + " dw32", 4 * z.h)]
    del product
    if z.e == 4:  # the FP32 sum is .grad itself
        g.param_grad(node.name + " backward: dW", node.ctx["param"], 4 * z.h, made=summed)
    else:  # cast to the parameter's dtype first
        g.param_grad(node.name + " backward: dW", node.ctx["param"], z.h * z.e)
    del summed
    return [dx]
