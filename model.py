"""The GPT: a small nanoGPT-style decoder that the memory techniques act on.

Chapter: none of the techniques by itself; this is the model every section measures.
Read first: `GPT.forward`, then `Block`, `CausalSelfAttention` and `AttentionCore`. It is built
from config.Config (n_layer, n_head, n_embd, block_size, vocab_size, dropout, bias, attn).

Two seams let the other files change the model without forking it: every Linear is built by
`linear_factory` (precision.py's Precision swaps in an FP8 Linear), and `GPT.forward` runs the blocks
through `self.block_runner` (checkpoint.py swaps in one that recomputes runs of blocks). Any
submodule of a block can be a recompute unit too, with no seam (checkpoint.apply_policy).
"""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

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
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t()
        if targets is None:
            return logits, None
        # cross entropy in fp32: a 16-bit log-softmax over the vocabulary loses the small terms
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
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
