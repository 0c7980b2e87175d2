"""The GPT: a small nanoGPT-style decoder that the memory techniques act on.

Chapter: none of the techniques by itself; this is the model every section measures.
Read first: `GPT.forward`, then `Block`, `CausalSelfAttention` and `AttentionCore`. It is built
from config.Config (n_layer, n_head, n_embd, block_size, vocab_size, dropout, bias, attn, loss_chunks).
The loss (`GPT.head_and_loss`) is the plain cross-entropy of the FP32 logits; with LOSS_CHUNKS > 1 it
runs in pieces (`ChunkedLoss`: chapter section 3 applied to the head, docs/loss.md).

Two seams let the other files change the model without forking it: every Linear is built by
`linear_factory` (precision.py's Precision swaps in an FP8 Linear), and `GPT.forward` runs the blocks
through `self.block_runner` (checkpoint.py swaps in one that recomputes runs of blocks). Any
submodule of a block can be a recompute unit too, with no seam (checkpoint.apply_policy).
"""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100  # targets equal to this carry no loss (padding); F.cross_entropy's default


def default_linear(in_features, out_features, bias):
    return nn.Linear(in_features, out_features, bias=bias)


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(d)) V for (B, heads, T, d) tensors, causal: the part whose saved tensors grow
    with s^2 and whose FLOPs are small (checkpoint.py's selective policy recomputes just this)."""

    def __init__(self, cfg):
        super().__init__()
        self.attn, self.dropout = cfg.attn, cfg.dropout
        if cfg.attn == "manual":
            # True above the diagonal: the future positions a token must not attend to. Stored
            # inverted once, so masked_fill's saved mask is a view of this buffer, not a new s^2 tensor
            future = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1)
            self.register_buffer("future_mask", future.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, q, k, v):
        p = self.dropout if self.training else 0.0
        if self.attn == "sdpa":
            # flash/memory-efficient kernels never store the (T, T) softmax: they
            # recompute it in backward, i.e. selective recompute done inside a kernel.
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.future_mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)  # the (B, heads, T, T) tensor the chapter talks about
        att = F.dropout(att, p, training=self.training)
        return att @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg, linear_factory):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = linear_factory(cfg.n_embd, 3 * cfg.n_embd, cfg.bias)
        self.core = AttentionCore(cfg)
        self.c_proj = linear_factory(cfg.n_embd, cfg.n_embd, cfg.bias)
        self.c_proj.residual_projection = True  # it writes into the residual stream: GPT.__init__ scales its init
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg, linear_factory):
        super().__init__()
        self.c_fc = linear_factory(cfg.n_embd, 4 * cfg.n_embd, cfg.bias)
        self.c_proj = linear_factory(4 * cfg.n_embd, cfg.n_embd, cfg.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg, linear_factory):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, linear_factory)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg, linear_factory)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ChunkedLoss(torch.autograd.Function):
    """The loss in pieces (LOSS_CHUNKS): F.cross_entropy(x @ W^T in FP32), `chunks` pieces of the rows at a
    time. At its most the plain loss holds three FP32 tensors of the logits' size (the log-softmax, its
    gradient from the NLL, the logits' gradient: 4bsV bytes each); in pieces, one piece's, beside the FP32
    sum of W's gradient (4Vh: a win where bs is large against h). Chapter section 3 applied to the head: do
    not keep what is large and can be had again. Forward keeps the head's input and the targets; backward
    re-runs each piece's logits to form their gradient: one head GEMM more. Not the gradients formed in
    forward (no GEMM more): the loss's output gradient (the loss scale, the micro-step's weight) is not
    known there, and without it they underflow in FP16. Measured: docs/loss.md."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunks):
        rows, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        ctx.save_for_backward(rows, weight, targets)
        ctx.chunks, ctx.x_shape = chunks, x.shape
        row_losses = [F.cross_entropy((piece @ weight.t()).float(), piece_targets, ignore_index=IGNORE_INDEX,
                                      reduction="none")
                      for piece, piece_targets in zip(rows.tensor_split(chunks), targets.tensor_split(chunks))]
        # their mean as F.cross_entropy takes it (nll_loss's own sum over the targets not ignored): to the bit
        ctx.counted = (targets != IGNORE_INDEX).sum()
        counted_rows = torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, 0)
        return F.nll_loss(-torch.cat(row_losses).unsqueeze(1), counted_rows)

    @staticmethod
    def backward(ctx, grad_loss):
        rows, weight, targets = ctx.saved_tensors
        grad_rows = torch.empty_like(rows)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # the pieces' sum
        pieces = (t.tensor_split(ctx.chunks) for t in (rows, targets, grad_rows))
        for piece, piece_targets, grad_piece in zip(*pieces):
            grad_logits = logits_gradient(piece, weight, piece_targets, grad_loss / ctx.counted)
            torch.mm(grad_logits, weight, out=grad_piece)
            sum_in_fp32(grad_weight, grad_logits.t(), piece)
            del grad_logits  # before the next piece's logits exist
        return grad_rows.view(ctx.x_shape), grad_weight.to(weight.dtype), None, None


def logits_gradient(piece, weight, targets, grad):
    """The gradient of a piece's logits, its loss re-run: autograd's own log-softmax gradient and cast back
    to 16 bits, as the plain loss forms them (its locals die here, before the next piece)."""
    with torch.enable_grad():
        logits = (piece @ weight.t()).requires_grad_()
        loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return torch.autograd.grad(loss, logits, grad)[0]


def on_gpu(t):  # ledger/trace.py says yes for a GPU's step traced on CPU
    return t.is_cuda


def sum_in_fp32(total, a, b):
    """total += a @ b in FP32: the pieces' weight gradients add up there and round to 16 bits once (in FP32
    they add in another order than one GEMM's: wte's gradient differs from the plain loss's in its last bits). A CPU
    has no GEMM of 16-bit inputs into FP32, so the same values are multiplied in FP32 there (a product of
    two 16-bit values is exact in FP32); cuBLAS has one (out_dtype)."""
    if on_gpu(a) and a.dtype != torch.float32:
        total += torch.mm(a, b, out_dtype=torch.float32)
    else:
        torch.addmm(total, a.float(), b.float(), out=total)


def run_blocks_in_order(blocks, x):
    for block in blocks:
        x = block(x)
    return x


class GPT(nn.Module):
    def __init__(self, cfg, linear_factory=default_linear):
        super().__init__()
        self.cfg = cfg  # config.Config, validated by config.validate
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, linear_factory) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.block_runner = run_blocks_in_order  # checkpoint.py replaces this
        # GPT-2's init: N(0, 0.02) for embeddings and Linear weights (whatever class the factory made),
        # 0.02 / sqrt(2L) for the projections into the residual stream, zero biases. The head is wte (tied)
        for module in self.modules():
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if getattr(module, "residual_projection", False) else 0.02
            for name, p in module.named_parameters(recurse=False):
                if p.dim() == 2:
                    nn.init.normal_(p, mean=0.0, std=std)
                elif name == "bias":
                    nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = self.block_runner(self.h, x)
        return self.head_and_loss(self.ln_f(x), targets)

    def head_and_loss(self, x, targets=None):
        """(logits, loss) from the final norm's output: the head (wte, tied) and the cross-entropy (None
        without targets). In pieces (LOSS_CHUNKS > 1): (None, loss), no logits kept whole."""
        head = self.wte.weight
        if targets is not None and self.cfg.loss_chunks > 1:
            return None, ChunkedLoss.apply(x, head, targets, self.cfg.loss_chunks)
        logits = x @ head.t()
        if targets is None:
            return logits, None
        # cross entropy in fp32: a 16-bit log-softmax over the vocabulary loses the small terms
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE_INDEX)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), 1)), dim=1)
        return idx


# ---------------------------------------------------------------- the random streams dropout draws from

def rng_state(device):
    """This process's random streams: the CPU generator, and the CUDA one on a GPU. A recompute's re-run draws
    the forward's dropout masks again from them (checkpoint.py); a snapshot keeps them (snapshot.py)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
