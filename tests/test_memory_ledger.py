"""The memory ledger: formulas vs measured bytes, the published figures, the CLI."""
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import torch

import memory_ledger as ml
import memory_measure
import memory_parallel as mp
import train
from config import Config, parse_args
from conftest import ROOT, merged
from tools import ledger as tool

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--seed=3"]
EXACT = ("parameters", "gradients", "master", "optimizer")


def ledger(argv, device="cpu"):
    cfg = replace(parse_args(merged(*TINY, *argv)), device=device)
    meas = tool.run_config(cfg, torch.device(device))
    rows, ok = tool.compare(cfg, meas)
    return cfg, {r[0]: r for r in rows}, ok, meas


@pytest.mark.parametrize("ckpt", ["none", "full", "sqrt", "selective"])
@pytest.mark.parametrize("prec", ["fp32", "bf16", "fp16", "fp8"])
def test_formulas_match_measurement(prec, ckpt):
    sh, rows, ok, meas = ledger([f"--precision={prec}", f"--ckpt={ckpt}", "--n_layer=3"])
    for k in EXACT + ("buffers",):
        assert rows[k][2] == rows[k][1], (k, rows[k])
    assert rows["activations"][3] <= 0.02, rows["activations"]
    assert ok
    # the peak is an estimate of the whole timeline; it must still land near the measured one
    assert abs(meas["peak"] - ml.peak_estimate(sh)[0]) <= 0.10 * meas["peak"]


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
    assert softmax == sh.n_head * sh.block_size * sh.block_size * sh.batch_size * 2
    assert meas["activations"] - softmax * sh.n_layer != ml.activation_bytes(sh)
    assert meas["activations"] == ml.activation_bytes(sh)
    # masked_fill saves a view of the future_mask buffer: state (buffers), not an activation
    assert not any("mask" in name and "dropout" not in name for name, _ in terms)
    assert meas["buffers"] == rows["buffers"][1] == sh.n_layer * sh.block_size * sh.block_size


def test_saved_views_of_buffers_are_not_activations():
    # the same forward with the buffers' storages NOT excluded: the masks show up, once per block
    cfg = parse_args(TINY + ["--precision=fp32"])
    model, _ = train.build(cfg, torch.device("cpu"))
    x, y = memory_measure.random_batch(cfg, "cpu")
    params = list(model.parameters())
    counts = []
    for static in (params, params + list(model.buffers())):
        with memory_measure.SavedBytes(static) as saved:
            model(x, y)
        counts.append(saved.total)
    assert counts[0] - counts[1] == cfg.n_layer * cfg.block_size ** 2


def test_recompute_keeps_only_unit_inputs():
    sh_none, _, _, m_none = ledger(["--precision=fp32", "--n_layer=4"])
    sh_full, _, _, m_full = ledger(["--precision=fp32", "--n_layer=4", "--ckpt=full"])
    head = sum(v for _, v in ml.head_activation_terms(sh_full))
    assert m_full["activations"] - head == 4 * sh_full.batch_size * sh_full.block_size * sh_full.n_embd * 4  # L inputs
    assert m_full["activations"] < m_none["activations"]


def test_sixteen_bytes_per_param_for_mixed_precision_adam():
    # ZeRO (Rajbhandari et al. 2020), sec. 3.1: 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter
    per_param = lambda prec: ml.bytes_per_param(Config(precision=prec))
    assert per_param("bf16") == (2, 2, 4, 8)
    assert sum(per_param("fp16")) == 16
    assert per_param("fp32") == (4, 4, 0, 8)
    assert per_param("fp8")[:3] == (2, 2, 4)  # fp8 keeps BF16 parameters and an FP32 master


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
    assert mp.korthikanti_layer_bytes(s, b, h, a) == sum(terms.values())
    assert mp.korthikanti_layer_bytes(s, b, h, a, "selective") == selective
    # our block on CUDA, BF16, dropout, manual attention = the paper + LayerNorm's FP32 mean/rstd
    # (2 LNs x 2 x b*s x 4 bytes), which the paper ignores; no mask term: model.py's future_mask
    # is a buffer and masked_fill saves a view of it
    sh = Config(n_layer=1, n_embd=h, n_head=a, block_size=s, batch_size=b, dropout=0.1, precision="bf16",
                device="cuda")
    ours = sum(v for _, v in ml.block_activation_terms(sh))
    assert ours == sum(terms.values()) + 16 * b * s
    sel = sum(v for _, v in ml.block_activation_terms(sh, "selective"))
    assert sel == selective + 16 * b * s


SMALL = dict(n_layer=2, n_embd=64, n_head=4, block_size=32, batch_size=2)


@pytest.mark.parametrize("shape", [dict(), dict(attn="sdpa"), dict(attn="sdpa", dropout=0.1),
                                   dict(attn="sdpa", dropout=0.1, device="cuda"), dict(dropout=0.1),
                                   dict(precision="fp8"), dict(precision="fp8", dropout=0.1, device="cuda")])
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_tp_places_every_term(shape, policy):
    # every block term is split over t or replicated, by exact name; an unknown name raises
    sh = Config(**SMALL, **shape)
    for name, _ in ml.block_activation_terms(sh, policy):
        assert (name in mp.TP_SPLIT) != (name in mp.TP_REPLICATED), name
    one, t4 = mp.tp_components(replace(sh, ckpt=policy), 1, sp=False), mp.tp_components(replace(sh, ckpt=policy), 4,
                                                                                       sp=False)
    assert t4["activations"] < one["activations"] == ml.activation_bytes(replace(sh, ckpt=policy))


def test_tp_unknown_term_raises(monkeypatch):
    real = ml.block_activation_terms
    monkeypatch.setattr(mp, "block_activation_terms", lambda sh, policy="none": real(sh, policy) + [("renamed", 1)])
    with pytest.raises(KeyError, match="renamed"):
        mp.tp_components(Config(n_layer=1, n_embd=32, n_head=2, block_size=16, batch_size=1), 2, sp=False)


def test_fp8_weight_copies():
    # native FP8Linear keeps no FP8 weight (a transient per forward); TE caches E4M3 W and W^T per Linear
    sh = Config(n_layer=3, n_embd=64, n_head=4, block_size=32, batch_size=2, precision="fp8")
    assert ml.fp8_weight_copies(sh) == (0, 5 * 4 * 64 * 64)
    te = replace(sh, fp8_backend="te")
    assert ml.fp8_weight_copies(te) == (2 * 12 * 64 * 64 * 3, 0)
    assert ml.components(te)["parameters"] - ml.state_bytes(te)["buffers"] == \
        ml.state_bytes(sh)["parameters"] + 2 * 12 * 64 * 64 * 3
    assert ml.fp8_weight_copies(replace(sh, precision="bf16")) == (0, 0)


def test_param_count_matches_meta_model():
    for L, h, a, s, V in [(2, 32, 2, 16, 256), (48, 1600, 25, 1024, 50257)]:
        for bias in (True, False):
            cfg = Config(n_layer=L, n_embd=h, n_head=a, block_size=s, vocab_size=V, bias=bias)
            n, _ = ml.param_count(cfg)
            assert n == mp.meta_param_count(cfg)


def test_what_if_bigger_gpu_fits_bigger_batches():
    sh = mp.big_config("GPT-2 XL", precision="bf16", ckpt="full")
    b40, b80 = mp.largest_micro_batch(sh, 40 * 2 ** 30), mp.largest_micro_batch(sh, 80 * 2 ** 30)
    assert 0 < b40 < b80
    assert ml.peak_estimate(replace(sh, batch_size=b80))[0] <= 80 * 2 ** 30 < \
        ml.peak_estimate(replace(sh, batch_size=b80 + 1))[0]
    big = mp.big_config("175B (GPT-3)")
    assert mp.largest_micro_batch(big, 80 * 2 ** 30) == 0  # 175B's states alone are 2.79 TB (2,602 GiB)


def test_train_time_ledger_line_runs_nothing(tmp_path):
    """The line train.py prints after step 1 reads counters (CUDA) or points to `make ledger`
    (CPU): no copy of the model, no extra forward, the run identical with it or without it."""
    flags = TINY + ["--precision=bf16", "--dropout=0.1", "--max_iters=3", "--sample_tokens=0", "--log_interval=100",
                    "--eval_interval=100"]
    forwards, lines, histories, params = [], [], [], []
    real_forward = train.GPT.forward
    for ledger in ("true", "false"):
        cfg = parse_args(flags + [f"--ledger={ledger}", f"--out_dir={tmp_path / ledger}"])
        forwards.append(0)

        def counting(self, *a, **kw):
            forwards[-1] += 1
            return real_forward(self, *a, **kw)
        train.GPT.forward = counting
        try:
            histories.append(train.train(cfg, log=lines.append))
        finally:
            train.GPT.forward = real_forward
        params.append(torch.load(tmp_path / ledger / "snapshot.pt", weights_only=True)["model"])
    assert forwards[0] == forwards[1] == 3
    assert [h["loss"] for h in histories[0]] == [h["loss"] for h in histories[1]]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert sum("make ledger" in line for line in lines) == 1  # CPU: the pointer, once, only with --ledger=true


def test_cli_prints_table_and_writes_svg(tmp_path, capsys):
    rc = tool.main(TINY + ["--precision=bf16", "--ckpt=full", f"--out_dir={tmp_path}", "--ranks=4"])
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
    assert tool.main(TINY + ["--precision=fp32", f"--out_dir={tmp_path}", "--table=formula"]) == 1
    assert "MISS" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [(["--n_layer=-1"], "n_layer"), (["--n_embd=32", "--n_head=3"], "divide"),
                                         (["--batch_size=0"], "batch_size"), (["--ranks=0"], "ranks"),
                                         (["--tp=x"], "integer"), (["--precision=fp8", "--fp8_backend=te"], "native"),
                                         (["--precision=bf16", "--fp8_amax_history=0"], "fp8_amax_history")])
def test_bad_config_exits_2(argv, needle):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ledger.py"), *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error:") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""


def test_fp8_row_ignores_te_backend(tmp_path, capsys):
    # --fp8_backend=te with bf16: the table's FP8 row is measured with the native backend
    rc = tool.main(TINY + ["--precision=bf16", "--fp8_backend=te", "--accum=2", f"--out_dir={tmp_path}"])
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
    cfg = parse_args(["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=8",
                      f"--precision={prec}", f"--ckpt={ckpt}", "--device=cuda"])
    meas = tool.run_config(cfg, torch.device("cuda"))
    sh = cfg
    rows, ok = tool.compare(sh, meas)
    pred = ml.predicted(sh)
    for k in EXACT + ("buffers",):  # storage sizes, gradients included: exact on CUDA too
        assert meas[k] == pred[k], (k, meas[k], pred[k])
    assert abs(meas["activations"] - pred["activations"]) <= 0.05 * pred["activations"], meas["activations"]
    assert ok, rows


@pytest.mark.cuda
def test_cuda_fp32_grad_accum_gradients_are_exact():
    # the allocator barely grows in backward here (the FP32 buffers exist already): storage sizes count
    cfg = parse_args(["--n_layer=2", "--n_embd=128", "--n_head=4", "--block_size=128", "--batch_size=4",
                      "--precision=bf16", "--fp32_grad_accum", "--device=cuda"])
    meas = tool.run_config(cfg, torch.device("cuda"))
    sh = cfg
    assert meas["gradients"] == ml.predicted(sh)["gradients"] == 6 * ml.param_count(sh)[0]
    rows, _ = tool.compare(sh, meas)
    assert all(ok for k, _, _, _, ok in rows if k in EXACT), rows


@pytest.mark.cuda
def test_cuda_train_time_ledger_line_keeps_peak_stats(tmp_path):
    cfg = parse_args(TINY + ["--precision=bf16", "--device=cuda", "--max_iters=2", "--sample_tokens=0",
                             f"--out_dir={tmp_path}"])
    lines = []
    train.train(cfg, log=lines.append)
    line = next(line for line in lines if line.startswith("memory after step 1"))
    assert "vs allocated" in line and "vs max allocated" in line
