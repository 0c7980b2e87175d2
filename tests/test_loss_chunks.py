"""The loss in pieces (model.ChunkedLoss, LOSS_CHUNKS): the same loss and gradients as the plain loss.

The oracle is the plain loss (LOSS_CHUNKS=1: F.cross_entropy of the whole FP32 logits) on the same
model and batch, at this file's shape, on CPU. FP32: the loss and every gradient to the bit, but wte's, which
sums the head's weight gradient over the pieces in another order than one GEMM does; BF16: every gradient
within one BF16 ulp. (Other shapes and BLAS builds may sum a piece's rows in another order too: a piece of
a few rows can take a matrix-vector path.)
"""
import re
from dataclasses import replace

import pytest
import torch

import accumulate
import memory_ledger as ml
import train
from config import Config, UsageError, validate
from ledger.loss import loss_at_most
from model import GPT, IGNORE_INDEX

ROWS = 3 * 32  # batch x block: 7 and 5 do not divide it, 96 pieces are a row each


def tiny(**overrides):
    return Config(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=1000, batch_size=3, **overrides)


def loss_and_grads(cfg, dtype, weight=0.37, seed=0):
    torch.manual_seed(seed)
    model = GPT(cfg).to(dtype)
    x, y = torch.randint(0, cfg.vocab_size, (2, cfg.batch_size, cfg.block_size))
    y[0, :5] = IGNORE_INDEX  # padding: not in the mean
    _, loss = model(x, y)
    (loss * weight).backward()  # a micro-step's weight that is no power of two
    return loss, {name: p.grad for name, p in model.named_parameters()}


def ulps_apart(got, want):
    """|got - want| in units of the last place of want's BF16 value (its exponent's)."""
    exponent = torch.frexp(want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny))[1]
    return ((got.float() - want.float()).abs() / torch.ldexp(torch.ones_like(want.float()), exponent - 8)).max()


def differing(got, want, close):
    return [f"{name}: {close(got[name], want[name])}" for name in want if close(got[name], want[name])]


@pytest.mark.parametrize("chunks", [2, 7, 5])  # (1 is the plain loss itself: model.GPT.head_and_loss)
def test_fp32_loss_and_gradients_to_the_bit_but_wtes_sum(chunks):
    want_loss, want = loss_and_grads(tiny(), torch.float32)
    loss, got = loss_and_grads(tiny(loss_chunks=chunks), torch.float32)
    assert torch.equal(loss, want_loss), f"loss in {chunks} pieces {loss.item()!r}, plain {want_loss.item()!r}"
    head = got.pop("wte.weight") - want.pop("wte.weight")
    unequal = [name for name in want if not torch.equal(got[name], want[name])]
    assert not unequal, f"in {chunks} pieces these gradients differ from the plain loss's: {unequal}"
    # wte's: the pieces' products summed in another order than one GEMM sums them, nothing more
    scale = max(g.abs().max() for g in got.values())
    assert head.abs().max() <= 2 ** -20 * scale, f"wte's gradient is {head.abs().max():.3g} away in {chunks} pieces"


@pytest.mark.parametrize("chunks", [2, 7, 5, ROWS])
def test_bf16_gradients_within_one_ulp(chunks):
    want_loss, want = loss_and_grads(tiny(), torch.bfloat16)
    loss, got = loss_and_grads(tiny(loss_chunks=chunks), torch.bfloat16)
    assert torch.equal(loss, want_loss), f"loss in {chunks} pieces {loss.item()!r}, plain {want_loss.item()!r}"
    far = [f"{name} ({ulps_apart(got[name], want[name]):.0f} ulps)" for name in want
           if ulps_apart(got[name], want[name]) > 1]
    assert not far, f"in {chunks} pieces these BF16 gradients are more than one ulp from the plain loss's: {far}"


def accumulated(cfg, micro_batches):
    """The gradients of one optimizer step's micro-steps, weighted by their target tokens (LOSS_NORM=tokens)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    weights, _ = accumulate.token_weights(micro_batches, "tokens", across_ranks=False)
    for (x, y), weight in zip(micro_batches, weights):
        (model(x, y)[1] * weight).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_token_weighted_micro_steps_match_the_plain_loss():
    torch.manual_seed(1)
    micro_batches = [tuple(torch.randint(0, 1000, (2, 3, 32))) for _ in range(3)]
    micro_batches[1][1][:, 20:] = IGNORE_INDEX
    want, got = accumulated(tiny(), micro_batches), accumulated(tiny(loss_chunks=7), micro_batches)
    unequal = [name for name in want if name != "wte.weight" and not torch.equal(got[name], want[name])]
    assert not unequal, f"token-weighted, in 7 pieces, these gradients differ from the plain loss's: {unequal}"


def test_more_pieces_than_rows_is_refused():
    with pytest.raises(UsageError, match="--loss_chunks=97 is more than the 96 rows"):
        validate(tiny(loss_chunks=ROWS + 1))


def test_training_in_pieces_follows_the_plain_loss(tmp_path):
    """FP16 with its dynamic loss scale and K=3 (weights of 1/3): the losses of 4 steps as the plain loss's."""
    runs = {}
    for chunks in (1, 7):
        cfg = replace(tiny(loss_chunks=chunks), out_dir=str(tmp_path / str(chunks)), max_iters=4,
                                  accum=3, precision="fp16", eval_interval=100, sample_tokens=0, log_interval=1)
        runs[chunks] = [record["loss"] for record in train.train(cfg, log=lambda *_: None)]
    assert runs[7] == pytest.approx(runs[1], rel=1e-3), f"losses in 7 pieces {runs[7]}, plain {runs[1]}"


@pytest.mark.parametrize("vocab_size,chunks", [(256, 16), (1000, 1), (1000, 4)])
def test_the_ledger_names_what_the_loss_holds_beyond_its_formula(vocab_size, chunks):
    """The loss at its most, traced alone, is the closed form's three FP32 tensors plus what the ledger names,
    byte for byte (at V = h = 256 too, where a (rows, V) tensor and a (rows, h) one have one shape)."""
    cfg = replace(tiny(loss_chunks=chunks), vocab_size=vocab_size, n_embd=256 if vocab_size == 256 else 64)
    traced, alive = loss_at_most(cfg)
    closed = ml.loss_temporaries_closed(cfg.block_size, cfg.batch_size, cfg.vocab_size, chunks)
    named = ml.loss_differences(cfg, alive)
    named_bytes = sum(int(n.replace(",", "")) * int(times or 1) * (-1 if line.startswith("not alive") else 1)
                      for line in named
                      for n, times in [re.search(r"([\d,]+) bytes(?: \(x(\d+)\))?$", line).groups()])
    measured = loss_at_most(cfg, fake=False)[0]
    assert traced == measured, f"the loss at its most: traced {traced:,} bytes, measured {measured:,}"
    assert traced - closed == named_bytes, f"{chunks} piece(s), V={vocab_size}: {traced - closed:,} bytes beyond " \
                                           f"the formula, {named_bytes:,} named: {named}"
