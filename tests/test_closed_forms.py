"""The chapter's closed forms (memory_ledger.py's first section) held to the papers' own figures and, with
each difference named, to the traced step (ledger/trace.py), which the ledger holds to the measured one."""
import itertools
import math

import pytest

import memory_ledger as ml
from config import Config
from ledger import papers, trace

GPT3 = dict(s=2048, b=1, h=12288, a=96)  # Korthikanti et al.'s shape (Table 3's 175B row)


def test_sixteen_bytes_per_parameter_for_every_precision():
    for name in ("fp32", "bf16", "fp16", "fp8"):
        per = ml.bytes_per_param_closed(name)
        assert sum(per) == 16, f"{name}: {per} bytes per parameter, 16 expected (ZeRO sec. 3.1: 2 + 2 + K, K = 12)"
        # and the traced states, per parameter, on CUDA (no CPU step scalars), say the same
        assert papers.bytes_per_param(Config(precision=name)) == per, f"{name}: the trace and the closed form differ"
    assert ml.bytes_per_param_closed("bf16")[2:] == (4, 8), "the K = 12 of mixed-precision Adam: master 4, m and v 8"


def test_one_layer_is_korthikantis_equation_1_and_table_2():
    s, b, h, a = GPT3.values()
    sbh = s * b * h
    # the paper's own breakdown (sec. 4.1): attention 11sbh + 5as^2b, MLP 19sbh, the two LayerNorms 4sbh
    paper_terms = 11 * sbh + 5 * a * s * s * b + 19 * sbh + 4 * sbh
    eq1 = round(sbh * (34 + 5 * a * s / h))
    assert ml.layer_activations_closed(s, b, h, a) == eq1 == paper_terms
    assert ml.layer_activations_closed(s, b, h, a, dropout=False) == round(sbh * (32 + 2 * a * s / h))
    # Table 2, t = 1: selective recompute keeps sbh(10 + 24/t) = 34sbh, which a fused kernel keeps too
    assert ml.layer_activations_closed(s, b, h, a, sdpa=True) == 34 * sbh
    assert ml.layer_activations_closed(s, b, h, a, dropout=False, sdpa=True) == 32 * sbh
    assert ml.full_recompute_layer_closed(s, b, h) == 2 * sbh  # Table 2, full recomputation
    # FP32 doubles every tensor but the 1-byte masks
    assert ml.layer_activations_closed(s, b, h, a, e=4) == 2 * eq1 - (2 * sbh + a * s * s * b)


@pytest.mark.parametrize("n_layer", [16, 25, 64, 100])
def test_sqrt_recompute_is_o_sqrt_l(n_layer):
    alive = {k: ml.sqrt_units_closed(n_layer, k) for k in range(1, n_layer + 1)}
    best = min(alive, key=alive.get)
    assert abs(best - math.sqrt(n_layer)) <= 1 and alive[best] <= 2 * math.sqrt(n_layer) + 1, \
        f"L={n_layer}: smallest at k={best} ({alive[best]} layers' worth), sqrt(L) = {math.sqrt(n_layer):.1f}"


def test_zero_bytes_per_rank_is_zeros_table_1():
    # ZeRO Table 1: a 7.5B model over N_d = 64 GPUs, in GB (1e9 bytes): 120, 31.4, 16.6, 1.9
    printed = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in printed.items():
        ours = ml.zero_bytes_per_rank(7.5e9, 64, stage) / 1e9
        assert round(ours, 1) == gb or (stage == 3 and round(ours, 2) == 1.88), \
            f"ZeRO stage {stage}: {ours:.2f} GB per rank, the paper prints {gb}"


# fp32, a 16-bit precision (fp16 saves what bf16 saves) and fp8 x attention x dropout x policy on CPU; on CUDA's
# rules (its kernels' own saved tensors) the policies that keep the attention core's tensors or drop them all
GRID = [c for c in itertools.product(["fp32", "bf16", "fp8"], ["manual", "sdpa"], [0.0, 0.1],
                                     ["none", "full", "sqrt", "selective"], ["cpu", "cuda"])
        if not (c[3] == "selective" and c[1] == "sdpa") and not (c[4] == "cuda" and c[3] == "sqrt")]


@pytest.mark.parametrize("prec,attn,dropout,ckpt,device", GRID)
def test_the_closed_forms_count_what_they_count_exactly_and_the_rest_is_named(prec, attn, dropout, ckpt, device):
    """The chapter's GPT traced: each term's tensors that the formula counts as they are add up to the closed
    form exactly (per layer, under every recompute policy); what differs is tensors the formula does not count
    as they are (LayerNorm's statistics, the loss's weight, ...), each named; every traced byte is in a term or
    named as in none."""
    cfg = Config(n_layer=4, n_embd=64, n_head=2, block_size=32, batch_size=2, precision=prec, attn=attn,
                 dropout=dropout, ckpt=ckpt, device=device)
    traced = trace.step(cfg)
    terms, unmatched = ml.account(traced["saved_tensors"], traced["kinds"])
    accounted = sum(s.nbytes for tensors in [*terms.values(), unmatched] for s in tensors)
    assert accounted == traced["activations"], f"terms and the unmatched hold {accounted:,} bytes, the trace " \
                                               f"{traced['activations']:,}"
    for term, closed, got, lines in ml.differences(cfg, terms, unmatched):
        # (0 bytes as counted: every tensor of the term kept otherwise, each named: CPU's dropout keeps its mask in
        # the activations' dtype, not 1 byte)
        miscounted = [line for line in lines if line.startswith("as the formula counts them")
                      and not line.startswith("as the formula counts them, 0 bytes")]
        if any(line.startswith("sdpa ran unfused here") for line in lines):  # named: torch chose the math path
            assert (prec, attn, dropout, device) == ("fp32", "sdpa", 0.1, "cpu"), f"sdpa unfused at {cfg}"
            continue
        assert not miscounted and lines, f"{term}: closed form {closed:,} bytes, traced {got:,}: " + \
            ("; ".join(miscounted) or "not named")
        if term != "not in the formulas":
            assert all(line.startswith(("not as the formula counts it", "as the formula counts them, 0 bytes"))
                       for line in lines), "\n".join(lines)
