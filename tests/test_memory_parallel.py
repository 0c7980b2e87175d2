"""The parallel techniques' formulas (ZeRO, TP, SP, PP) and the published figures beside ours."""
from dataclasses import replace

import pytest

import torch

import memory_ledger as ml
from config import Config
from ledger import papers, plan
from ledger import parallel as mp
from model import GPT


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 12288, 96), (1024, 4, 1600, 25), (16, 3, 32, 2)])
def test_korthikanti_per_layer_formula(s, b, h, a):
    # Korthikanti et al. 2022, eq. (1): s*b*h*(34 + 5*a*s/h) bytes per layer; selective 34sbh.
    # Derived here from the term list: the a*s^2 terms are the ones that double with a.
    terms = dict(mp.korthikanti_layer_terms(s, b, h, a))
    core = {n for n, v in mp.korthikanti_layer_terms(s, b, h, 2 * a) if v != terms[n]}
    assert all(terms[n] % (a * s * s * b) == 0 for n in core)
    assert sum(terms.values()) == s * b * h * (34 + 5 * a * s / h)  # eq. (1)
    assert sum(terms[n] for n in core) == 5 * a * s * s * b
    selective = sum(v for n, v in terms.items() if n not in core)
    assert selective == 34 * s * b * h  # sec. 5: selective recompute keeps 34sbh
    assert ml.layer_activations_closed(s, b, h, a) == sum(terms.values())  # the chapter's closed forms
    assert ml.layer_activations_closed(s, b, h, a, sdpa=True) == selective
    # our block on CUDA, BF16, dropout, manual attention = the paper + what the norms keep beyond their
    # inputs (LayerNorm: its FP32 mean/rstd, 2 LNs x 2 x b*s x 4 bytes), which the paper ignores; no mask
    # term: model.py's future_mask is a buffer and masked_fill saves a view of it
    sh = Config(n_layer=1, n_embd=h, n_head=a, block_size=s, batch_size=b, dropout=0.1, precision="bf16",
                device="cuda")
    extras = papers.norm_extras(sh)
    ours, ours_selective = (sum(t.nbytes for t in ml.block_activation_terms(sh, paths))
                            for paths in ((), ("attn.core",)))
    assert ours == sum(terms.values()) + extras, f"ours {ours:,} bytes, the paper's {sum(terms.values()):,} " \
                                                 f"+ the norms' extras {extras:,}: the block is not the paper's"
    assert ours_selective == selective + extras


def test_published_figures_are_reproduced_and_explained():
    """Defect 7: each Korthikanti row differs from ours by exactly the bytes its reason names
    (what our norms keep beyond their inputs: the LayerNorm statistics, computed from our
    terms), and ZeRO's Table 1 row is the same formula: equal unrounded, and within Table 1's
    rounding to 0.1 GB."""
    rows = papers.korthikanti_rows(t=8)
    assert len(rows) == 7
    for name, formula, paper, ours, explained, why in rows:
        assert ours - paper == explained, f"{name}: ours {ours:,}, the paper's {paper:,}, explained {explained:,}"
    extras = papers.norm_extras(mp.big_config("175B (GPT-3)", precision="bf16", attn="manual", dropout=0.1))
    assert [r[4] for r in rows] == [extras] * 3 + [extras // 8, extras, extras // 8, 0]
    zero = papers.zero_rows()
    assert zero[0][2:] == (16, 16)
    for name, _, paper, ours in zero[1:]:
        assert ours == paper and abs(round(paper, 1) - ours) < 0.05, name


def test_zero3_does_not_shard_buffers():
    """Defect 5: ZeRO-3/FSDP shards parameters, not buffers: the causal masks stay whole."""
    cfg = mp.big_config("7B", precision="bf16", attn="manual")
    c = ml.components(cfg)
    z3 = mp.zero_components(c, 8, 3)
    assert z3["buffers"] == c["buffers"] == cfg.n_layer * cfg.block_size ** 2
    assert z3["parameters"] == c["parameters"] // 8
    row = next(r for r in mp.what_if(ranks=8) if r["shape"] == "7B" and r["zero"] == "ZeRO-3/8")
    assert row["buffers"] == c["buffers"] and row["states"] == (c["parameters"] + c["gradients"] + c["optimizer"]) // 8
    small = Config(n_layer=4)
    whole = ml.components(small)["buffers"]
    for name, comp in mp.parallel_rows(small, ranks=4, pp=2):
        # every row keeps its own buffers line; only pipeline stages split them, with the layers
        assert comp["buffers"] == (whole // 2 if name.startswith("pipeline") else whole), name


def test_tp_without_sp_splits_only_the_logits_outside_the_blocks():
    """Defect 6 (TP): Megatron's TP without SP splits the vocab-parallel log-softmax; ln_f's
    input, output and statistics and the embedding dropout mask stay whole on every rank."""
    cfg = mp.big_config("175B (GPT-3)", dropout=0.1)
    outside = {t.name: t.nbytes for t in ml.outside_terms(cfg)}
    blocks = cfg.n_layer * mp.tp_block_bytes(cfg, 8, sp=False)
    split = outside.pop("log-softmax output (fp32)") + outside.pop("loss total_weight")
    assert mp.tp_components(cfg, 8, sp=False)["activations"] - blocks == split // 8 + sum(outside.values())
    sp_blocks = cfg.n_layer * mp.tp_block_bytes(cfg, 8, sp=True)
    assert mp.tp_components(cfg, 8, sp=True)["activations"] - sp_blocks == \
        sum(t.nbytes // 8 for t in ml.outside_terms(cfg))


def test_pp_stages_hold_their_own_terms():
    """Defect 6 (PP): the log-softmax lives on the last stage (one micro-batch in flight), the
    embeddings' terms on the first (p micro-batches); the tied wte sits on both ends."""
    cfg = Config(n_layer=8, n_embd=64, n_head=4, block_size=64, batch_size=2, dropout=0.1)
    L, h, s, V = cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size
    first, last = mp.pp_stages(cfg, 4)
    outside = {t.name: t.nbytes for t in ml.outside_terms(cfg)}
    block = sum(t.nbytes for t in ml.block_activation_terms(cfg))
    embed = outside["positions (wpe)"] + outside["drop mask"]
    assert first["activations"] == 4 * (L // 4 * block + embed)
    assert last["activations"] == L // 4 * block + sum(outside.values()) - embed
    with torch.device("meta"):  # the model's own parameters, not the description's
        gpt = GPT(cfg)
    block_params = sum(p.numel() for p in gpt.h[0].parameters())
    assert first["parameters"] == 2 * (V * h + s * h + L // 4 * block_params)
    assert last["parameters"] == 2 * (L // 4 * block_params + sum(p.numel() for p in gpt.ln_f.parameters()) + V * h)


@pytest.mark.parametrize("shape", [dict(), dict(attn="sdpa"), dict(attn="sdpa", dropout=0.1),
                                   dict(attn="sdpa", dropout=0.1, device="cuda"), dict(dropout=0.1),
                                   dict(precision="fp8"), dict(precision="fp8", attn="sdpa"),
                                   dict(precision="fp8", dropout=0.1, device="cuda")])
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_tp_splits_what_the_parallel_regions_make(shape, policy):
    """Megatron's rule, read off the description: a block term is split over t when it was made
    between a column-parallel Linear and the row-parallel Linear after it (the description's
    `split`), whole otherwise (the norms' inputs and statistics, the residual's dropout masks);
    SP splits the rest too; t = 1 is the one-GPU ledger."""
    if policy == "selective" and shape.get("attn") == "sdpa":
        return
    sh = replace(Config(n_layer=2, n_embd=64, n_head=4, block_size=32, batch_size=2, **shape), ckpt=policy)
    terms = ml.block_activation_terms(sh, ("attn.core",) if policy == "selective" else ())
    assert any(t.region for t in terms) and any(not t.region for t in terms)
    assert not any(t.region for t in terms if t.role == ml.NORM)
    one, t4, sp4 = (mp.tp_components(sh, t, sp) for t, sp in ((1, False), (4, False), (4, True)))
    assert sp4["activations"] < t4["activations"] < one["activations"] == ml.activation_bytes(sh)


def test_what_if_bigger_gpu_fits_bigger_batches():
    sh = mp.big_config("GPT-2 XL", precision="bf16", ckpt="full")
    b40, b80 = plan.largest_micro_batch(sh, 40 * 2 ** 30), plan.largest_micro_batch(sh, 80 * 2 ** 30)
    assert 0 < b40 < b80
    # 175B's states alone are 174.6B parameters x 16 bytes = 2.79 TB (2,602 GiB): no micro-batch fits
    big = mp.big_config("175B (GPT-3)")
    states = sum(v for k, v in ml.components(big).items() if k in ("parameters", "gradients", "optimizer"))
    assert states == 16 * ml.param_count(big)[0] > 80 * 2 ** 30
    assert plan.largest_micro_batch(big, 80 * 2 ** 30) == 0
