"""The memory ledger: formulas vs measured bytes, the published figures, the CLI."""
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import torch

import accumulate
import memory_ledger as ml
import train
from conftest import ROOT

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--seed=3"]


def ledger(argv, device="cpu"):
    cfg = train.parse_args(TINY + argv)
    meas = ml.run_config(cfg, torch.device(device))
    sh = ml.Shape.from_config(cfg, device)
    rows, ok = ml.compare(sh, meas)
    return sh, {r[0]: r for r in rows}, ok, meas


@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16", "fp8"])
def test_formulas_match_measurement(prec, ckpt):
    sh, rows, ok, meas = ledger([f"--precision={prec}", f"--ckpt={ckpt}", "--n_layer=3"])
    for k in ml.EXACT + ("buffers",):
        assert rows[k][2] == rows[k][1], (k, rows[k])
    assert rows["activations"][3] <= 0.02, rows["activations"]
    assert ok
    # the peak is an estimate of the whole timeline; it must still land near the measured one
    assert abs(meas["peak"] - ml.peak_estimate(sh)[0]) <= ml.PEAK_TOL * meas["peak"]


@pytest.mark.parametrize("argv", [["--dropout=0.1"], ["--attn=sdpa"], ["--attn=sdpa", "--dropout=0.1"],
                                  ["--dropout=0.1", "--ckpt=selective"], ["--bias=false", "--precision=fp32"],
                                  ["--fp32_grad_accum", "--precision=bf16"], ["--ckpt=sqrt", "--ckpt_segment=1"]])
def test_variants_match_measurement(argv):
    _, rows, ok, _ = ledger(argv)
    assert ok, rows


def test_activation_terms_are_what_autograd_saves():
    # the measured number comes from saved_tensors_hooks; removing one term must break the match
    sh, rows, _, meas = ledger(["--precision=bf16"])
    terms = ml.block_activation_terms(sh)
    softmax = dict(terms)["softmax output"]
    assert softmax == sh.a * sh.s * sh.s * sh.b * 2
    assert meas["activations"] - softmax * sh.L != ml.activation_bytes(sh)
    assert meas["activations"] == ml.activation_bytes(sh)
    # masked_fill saves a view of the future_mask buffer: state (buffers), not an activation
    assert not any("mask" in name and "dropout" not in name for name, _ in terms)
    assert meas["buffers"] == rows["buffers"][1] == sh.L * sh.s * sh.s


def test_saved_views_of_buffers_are_not_activations():
    # the same forward with the buffers' storages NOT excluded: the masks show up, once per block
    cfg = train.parse_args(TINY + ["--precision=fp32"])
    model, opt = train.build(cfg, torch.device("cpu"))
    x, y = ml.random_batch(cfg, "cpu")
    params = ml.storage_ids(list(model.parameters()))
    counts = []
    for exclude in (params, params | ml.storage_ids(list(model.buffers()))):
        with ml.saved_for_backward(exclude) as saved:
            model(x, y)
        counts.append(sum(saved.values()))
    assert counts[0] - counts[1] == cfg.n_layer * cfg.block_size ** 2


def test_recompute_keeps_only_unit_inputs():
    sh_none, _, _, m_none = ledger(["--precision=fp32", "--n_layer=4"])
    sh_full, _, _, m_full = ledger(["--precision=fp32", "--n_layer=4", "--ckpt=full"])
    head = sum(v for _, v in ml.head_activation_terms(sh_full))
    assert m_full["activations"] - head == 4 * sh_full.b * sh_full.s * sh_full.h * 4  # L inputs of bsh FP32
    assert m_full["activations"] < m_none["activations"]


def test_sixteen_bytes_per_param_for_mixed_precision_adam():
    # ZeRO (Rajbhandari et al. 2020), sec. 3.1: 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter
    assert ml.bytes_per_param("bf16") == (2, 2, 4, 8)
    assert sum(ml.bytes_per_param("fp16")) == 16
    assert ml.bytes_per_param("fp32") == (4, 4, 0, 8)
    assert ml.bytes_per_param("fp8")[:3] == (2, 2, 4)  # fp8 keeps BF16 parameters and an FP32 master


@pytest.mark.parametrize("s,b,h,a", [(2048, 1, 12288, 96), (1024, 4, 1600, 25), (16, 3, 32, 2)])
def test_korthikanti_per_layer_formula(s, b, h, a):
    # Korthikanti et al. 2022, eq. (1): s*b*h*(34 + 5*a*s/h) bytes per layer; selective 34sbh.
    # Derived here from the term list: the a*s^2 terms are the ones that double with a.
    terms = dict(ml.korthikanti_layer_terms(s, b, h, a))
    core = {n for n, v in ml.korthikanti_layer_terms(s, b, h, 2 * a) if v != terms[n]}
    assert all(terms[n] % (a * s * s * b) == 0 for n in core)
    assert sum(terms.values()) == s * b * h * (34 + 5 * a * s / h)  # eq. (1)
    assert sum(terms[n] for n in core) == 5 * a * s * s * b
    selective = sum(v for n, v in terms.items() if n not in core)
    assert selective == 34 * s * b * h  # sec. 5: selective recompute keeps 34sbh
    assert ml.korthikanti_layer_bytes(s, b, h, a) == sum(terms.values())
    assert ml.korthikanti_layer_bytes(s, b, h, a, "selective") == selective
    # our block on CUDA, BF16, dropout, manual attention = the paper + LayerNorm's FP32 mean/rstd
    # (2 LNs x 2 x b*s x 4 bytes), which the paper ignores; no mask term: model.py's future_mask
    # is a buffer and masked_fill saves a view of it
    sh = ml.Shape(L=1, h=h, a=a, s=s, b=b, dropout=0.1, precision="bf16", device="cuda")
    ours = sum(v for _, v in ml.block_activation_terms(sh))
    assert ours == sum(terms.values()) + 16 * b * s
    sel = sum(v for _, v in ml.block_activation_terms(sh, "selective"))
    assert sel == selective + 16 * b * s


@pytest.mark.parametrize("shape", [dict(), dict(attn="sdpa"), dict(attn="sdpa", dropout=0.1),
                                   dict(attn="sdpa", dropout=0.1, device="cuda"), dict(dropout=0.1),
                                   dict(precision="fp8"), dict(precision="fp8", dropout=0.1, device="cuda")])
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_tp_places_every_term(shape, policy):
    # every block term is split over t or replicated, by exact name; an unknown name raises
    sh = ml.Shape(L=2, h=64, a=4, s=32, b=2, **shape)
    for name, _ in ml.block_activation_terms(sh, policy):
        assert (name in ml.TP_SPLIT) != (name in ml.TP_REPLICATED), name
    one, t4 = ml.tp_components(replace(sh, ckpt=policy), 1, sp=False), ml.tp_components(replace(sh, ckpt=policy), 4,
                                                                                       sp=False)
    assert t4["activations"] < one["activations"] == ml.activation_bytes(replace(sh, ckpt=policy))


def test_tp_unknown_term_raises(monkeypatch):
    real = ml.block_activation_terms
    monkeypatch.setattr(ml, "block_activation_terms", lambda sh, policy="none": real(sh, policy) + [("renamed", 1)])
    with pytest.raises(KeyError, match="renamed"):
        ml.tp_components(ml.Shape(L=1, h=32, a=2, s=16, b=1), 2, sp=False)


def test_fp8_weight_copies():
    # native FP8Linear keeps no FP8 weight (a transient per forward); TE caches E4M3 W and W^T per Linear
    sh = ml.Shape(L=3, h=64, a=4, s=32, b=2, precision="fp8")
    assert ml.fp8_weight_copies(sh) == (0, 5 * 4 * 64 * 64)
    te = replace(sh, fp8_backend="te")
    assert ml.fp8_weight_copies(te) == (2 * 12 * 64 * 64 * 3, 0)
    assert ml.components(te)["parameters"] - ml.state_bytes(te)["buffers"] == \
        ml.state_bytes(sh)["parameters"] + 2 * 12 * 64 * 64 * 3
    assert ml.fp8_weight_copies(replace(sh, precision="bf16")) == (0, 0)


def test_param_count_matches_meta_model():
    for L, h, a, s, V in [(2, 32, 2, 16, 256), (48, 1600, 25, 1024, 50257)]:
        for bias in (True, False):
            n, _ = ml.param_count(ml.Shape(L=L, h=h, a=a, s=s, b=1, V=V, bias=bias))
            assert n == ml.meta_param_count(L, h, a, s, V, bias)


def test_what_if_bigger_gpu_fits_bigger_batches():
    sh = ml.Shape(L=48, h=1600, a=25, s=1024, b=1, V=50257, precision="bf16", ckpt="full", device="cuda")
    b40, b80 = ml.largest_micro_batch(sh, 40 * 2 ** 30), ml.largest_micro_batch(sh, 80 * 2 ** 30)
    assert 0 < b40 < b80
    assert ml.peak_estimate(replace(sh, b=b80))[0] <= 80 * 2 ** 30 < ml.peak_estimate(replace(sh, b=b80 + 1))[0]
    big = ml.Shape(L=96, h=12288, a=96, s=2048, b=1, V=50257, device="cuda")
    assert ml.largest_micro_batch(big, 80 * 2 ** 30) == 0  # 175B's states alone are 2.6 TB


def test_summary_after_first_step_leaves_training_alone():
    cfg = train.parse_args(TINY + ["--precision=bf16", "--dropout=0.1"])
    model, opt = train.build(cfg, torch.device("cpu"))
    batch = ml.random_batch(cfg, "cpu")
    accumulate.accumulation_step(model, opt, [batch])
    rng = torch.get_rng_state()
    params = [p.detach().clone() for p in model.parameters()]
    state = [t.clone() for t in ml.optimizer_tensors(opt)]
    text = ml.summary_after_first_step(cfg, model, opt, batch, torch.device("cpu"))
    assert "activations" in text and "MISS" not in text
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state, ml.optimizer_tensors(opt)))
    assert all(p.grad is None for p in model.parameters())


def test_cli_prints_table_and_writes_svg(tmp_path, capsys):
    rc = ml.main(TINY + ["--precision=bf16", "--ckpt=full", f"--out_dir={tmp_path}", "--ranks=4"])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("FP32 baseline", "BF16 mixed precision", "ZeRO-3 over 4", "tensor parallel", "CPU offload",
                 "selective checkpointing", "GPT-2 XL", "175B"):
        assert name in out
    assert "measured" in out and "formula" in out
    root = ET.parse(tmp_path / "memory_ledger.svg").getroot()
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")]
    n_rows = sum(1 for line in out.splitlines() if line.endswith(("measured", "formula")))
    assert len(rects) == 4 + 4 * n_rows  # legend + four stacked components per technique
    assert not list(tmp_path.glob("*.tmp*"))


def test_cli_exits_1_when_a_component_misses(tmp_path, monkeypatch, capsys):
    real = ml.activation_terms
    # a formula 10% too high must fail the 2% check
    monkeypatch.setattr(ml, "activation_terms", lambda sh: real(sh) + [("wrong", sum(v for _, v in real(sh)) // 10)])
    assert ml.main(TINY + ["--precision=fp32", f"--out_dir={tmp_path}", "--table=formula"]) == 1
    assert "MISS" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [(["--n_layer=-1"], "n_layer"), (["--n_embd=32", "--n_head=3"], "divide"),
                                         (["--batch_size=0"], "batch_size"), (["--ranks=0"], "ranks"),
                                         (["--tp=x"], "integer"), (["--precision=fp8", "--fp8_backend=te"], "native"),
                                         (["--precision=bf16", "--fp8_amax_history=0"], "fp8_amax_history")])
def test_bad_config_exits_2(argv, needle):
    r = subprocess.run([sys.executable, str(ROOT / "memory_ledger.py"), *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error:") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""


def test_fp8_row_ignores_te_backend(tmp_path, capsys):
    # --fp8_backend=te with bf16: the table's FP8 row is measured with the native backend
    rc = ml.main(TINY + ["--precision=bf16", "--fp8_backend=te", "--accum=2", f"--out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "FP8 (native)" in out and "FP8 (Transformer Engine)" in out and "K=2 (micro-b 1)" in out


@pytest.mark.cuda
@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16", "fp8"])
def test_cuda_allocator_matches_formulas(prec, ckpt):
    if prec == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"native FP8 (torch._scaled_mm) needs sm89+, this GPU is sm"
                    f"{''.join(map(str, torch.cuda.get_device_capability()))}")
    # allocator readings round each block up to 512 bytes: a config big enough for 5%
    cfg = train.parse_args(["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=8",
                            f"--precision={prec}", f"--ckpt={ckpt}", "--device=cuda"])
    meas = ml.run_config(cfg, torch.device("cuda"))
    sh = ml.Shape.from_config(cfg, "cuda")
    rows, ok = ml.compare(sh, meas)
    pred = ml.predicted(sh)
    for k in ml.EXACT + ("buffers",):  # storage sizes, gradients included: exact on CUDA too
        assert meas[k] == pred[k], (k, meas[k], pred[k])
    assert abs(meas["activations"] - pred["activations"]) <= 0.05 * pred["activations"], meas["activations"]
    assert ok, rows


@pytest.mark.cuda
def test_cuda_fp32_grad_accum_gradients_are_exact():
    # the allocator barely grows in backward here (the FP32 buffers exist already): storage sizes count
    cfg = train.parse_args(["--n_layer=2", "--n_embd=128", "--n_head=4", "--block_size=128", "--batch_size=4",
                            "--precision=bf16", "--fp32_grad_accum", "--device=cuda"])
    meas = ml.run_config(cfg, torch.device("cuda"))
    sh = ml.Shape.from_config(cfg, "cuda")
    assert meas["gradients"] == ml.predicted(sh)["gradients"] == 6 * ml.param_count(sh)[0]
    rows, _ = ml.compare(sh, meas)
    assert all(ok for k, _, _, _, ok in rows if k in ml.EXACT), rows


@pytest.mark.cuda
def test_cuda_summary_keeps_peak_stats():
    cfg = train.parse_args(TINY + ["--precision=bf16", "--device=cuda"])
    device = torch.device("cuda")
    model, opt = train.build(cfg, device)
    batch = ml.random_batch(cfg, device)
    accumulate.accumulation_step(model, opt, [batch])
    torch.cuda.synchronize()
    before = torch.cuda.max_memory_allocated(device)
    text = ml.summary_after_first_step(cfg, model, opt, batch, device)
    assert torch.cuda.max_memory_allocated(device) >= before  # never reset below the run's own peak
    assert "MISS" not in text and "peak stats not reset" in text
