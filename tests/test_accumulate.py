"""Gradient accumulation (accumulate.py): the effective batch, no_sync, loss normalisation,
FP32 gradient accumulation, and DDP through real torchrun/gloo processes on CPU.

The oracle everywhere is one process on one big batch: K micro-steps on each of 2 ranks
must give the gradient of the concatenated 2 x K micro-batches. The rank side of the
DDP tests is tests/ddp_worker.py; each torchrun launch runs once per module.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accumulate
import snapshot
import train
from guards.cli import parse_args
from conftest import merged, torchrun
from ddp_worker import CASES, K, STEPS, B, make_batches, rank_slice, record_grads, seed_of, tiny_config

# make test gives each file to one xdist worker (--dist loadfile), and the fixtures here are
# session-wide: a worker runs other files' tests in between, which would end a module's

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
WORLD = 2


def run_train_py(args, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="session")
def ddp_grads(tmp_path_factory):
    out = tmp_path_factory.mktemp("grads")
    r = torchrun([WORKER, "grads", out])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [torch.load(out / f"grads-rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def flat(tensors):
    return torch.cat([t.reshape(-1).float() for t in tensors])


def rel_err(a, b):
    return ((flat(a) - flat(b)).norm() / flat(b).norm()).item()


def big_batch_grads(params, batches, cfg=None):
    """The oracle: one FP32 process, one forward and backward on all micro-batches concatenated."""
    model, _ = train.build(cfg or tiny_config(), torch.device("cpu"))
    model.load_state_dict({k: v.float() for k, v in params.items()})
    x = torch.cat([x for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    model(x, y)[1].backward()
    return [p.grad for p in model.parameters()]


def assert_grads_equal(got, want, rtol=1e-5, atol=1e-7):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- the effective batch (pure functions)

def test_effective_batch_formula():
    assert accumulate.effective_batch(8, 2, 4, 256) == (64, 64 * 256)
    assert accumulate.effective_batch(1, 1, 1, 16) == (1, 16)
    # accum_from_total_tokens inverts it
    assert accumulate.accum_from_total_tokens(64 * 256, 8, 2, 256) == 4
    assert accumulate.accum_from_total_tokens(8 * 256, 8, 1, 256) == 1


@pytest.mark.parametrize("total", [0, 100, 8 * 2 * 256 + 1, 8 * 256])  # the last is a half micro-step on 2 ranks
def test_accum_from_total_tokens_rejects_uneven(total):
    with pytest.raises(ValueError, match="total_batch_tokens"):
        accumulate.accum_from_total_tokens(total, 8, 2, 256)


# ---------------------------------------------------------------- DDP: the gradient is the big-batch gradient

@pytest.mark.parametrize("case", ["no_sync", "sync_every_micro_step", "tokens"])
def test_ddp_accumulated_grads_match_big_batch(ddp_grads, case):
    """K micro-steps on each of 2 ranks == one process on the 2 x K micro-batches, in FP32."""
    for step in range(STEPS):
        params = ddp_grads[0][case]["params"][step]
        for k, v in ddp_grads[1][case]["params"][step].items():  # both ranks started from the same weights
            assert torch.equal(v, params[k]), k
        batches = make_batches(seed_of(case, step), WORLD * K, B, 16, CASES[case]["pad"])
        want = big_batch_grads(params, batches)
        for rank in range(WORLD):
            assert_grads_equal(ddp_grads[rank][case]["grads"][step], want)


def test_ddp_token_weighted_ranks_really_differ(ddp_grads):
    """The 'tokens' case is only a test if ranks hold different token counts (the
    global count has to be all-reduced), and if a plain mean would have been wrong."""
    batches = make_batches(seed_of("tokens", 0), WORLD * K, B, 16, CASES["tokens"]["pad"])
    counts = [sum(int((y != -100).sum()) for _, y in rank_slice(batches, r, WORLD, K)) for r in range(WORLD)]
    assert counts[0] > 2 * counts[1], counts
    # the mean over micro-batch means, which loss_norm=mean computes, is another gradient
    model, _ = train.build(tiny_config(), torch.device("cpu"))
    model.load_state_dict(ddp_grads[0]["tokens"]["params"][0])
    for x, y in batches:
        (model(x, y)[1] / len(batches)).backward()
    assert rel_err([p.grad for p in model.parameters()], ddp_grads[0]["tokens"]["grads"][0]) > 0.05


# ---------------------------------------------------------------- DDP: how many all-reduces

def test_no_sync_allreduces_once_per_bucket_per_step(ddp_grads):
    """With no_sync on micro-steps 1..K-1, only the last micro-step's backward communicates:
    one all-reduce per DDP bucket per optimizer step."""
    for rank in range(WORLD):
        rec = ddp_grads[rank]["no_sync"]
        assert rec["allreduces"] == rec["buckets"], rec
    # the small bucket cap gives several buckets once DDP has rebuilt them after step 1
    assert ddp_grads[0]["no_sync"]["buckets"][-1] > 1


def test_without_no_sync_allreduces_k_times(ddp_grads):
    rec = ddp_grads[0]["sync_every_micro_step"]
    # DDP rebuilds its buckets (in gradient-ready order) after the first backward, so
    # count from the second optimizer step, when the bucket count is settled
    for step in range(1, STEPS):
        assert rec["allreduces"][step] == K * rec["buckets"][step], rec
    assert rec["allreduces"][1] == K * ddp_grads[0]["no_sync"]["allreduces"][1]


def test_no_sync_must_cover_the_forward(ddp_grads):
    """The comment in accumulate.py: a forward outside no_sync arms the all-reduce, and a
    backward inside no_sync still runs it."""
    rec = ddp_grads[0]["forward_outside_no_sync"]
    assert rec["allreduces"] == rec["buckets"] >= 1


# ---------------------------------------------------------------- token-weighted loss, one process

def padded_micro_batches(n=4, seed=3):
    # valid targets per sequence: 16, 12, 4, 1: a token-count spread like real padding
    return make_batches(seed, n, B, 16, pad=lambda j: [0, 4, 12, 15][j % 4])


def accumulated_grads(cfg, batches, loss_norm):
    """(the gradients the optimizer steps with, the model) after one accumulation_step."""
    model, parts = train.build(cfg, torch.device("cpu"))
    sink = []
    record_grads(parts, sink)
    accumulate.accumulation_step(model, parts, batches, loss_norm)
    return sink[0], model


def test_token_weighted_loss_matches_big_batch_mean_does_not():
    batches = padded_micro_batches()
    model, _ = train.build(tiny_config(), torch.device("cpu"))
    want = big_batch_grads(model.state_dict(), batches)
    got_tokens, _ = accumulated_grads(tiny_config(), batches, "tokens")
    got_mean, _ = accumulated_grads(tiny_config(), batches, "mean")
    assert_grads_equal(got_tokens, want)
    # dividing by K weighs a token of the 1-token micro-batch 16x a token of the full one
    assert rel_err(got_mean, want) > 0.05


def test_token_weighted_loss_with_an_all_padding_micro_batch():
    """A micro-batch with no valid targets adds nothing (its mean loss is NaN, its weight 0)."""
    batches = padded_micro_batches(3)
    empty = (batches[0][0], torch.full_like(batches[0][1], -100))
    model, _ = train.build(tiny_config(), torch.device("cpu"))
    want = big_batch_grads(model.state_dict(), batches)
    got, _ = accumulated_grads(tiny_config(), batches[:1] + [empty] + batches[1:], "tokens")
    assert_grads_equal(got, want)
    model, parts = train.build(tiny_config(), torch.device("cpu"))
    loss, stepped, _ = accumulate.accumulation_step(model, parts, batches[:1] + [empty] + batches[1:], "tokens")
    assert stepped and loss == loss  # not NaN: the empty micro-batch is left out of the logged mean


def test_bad_loss_norm_is_rejected():
    model, parts = train.build(tiny_config(), torch.device("cpu"))
    with pytest.raises(ValueError, match="loss_norm"):
        accumulate.accumulation_step(model, parts, make_batches(0, 1, B, 16), "sum")


# ---------------------------------------------------------------- FP32 gradient accumulation

def test_fp32_grad_accum_is_closer_to_the_fp32_gradient():
    """BF16 parameters, K=64: summing 64 BF16 micro-gradients in .grad rounds the running
    sum to 8 significant bits 64 times; FP32 buffers round each micro-gradient once."""
    k = 64
    cfg = tiny_config(precision="bf16", fp32_grad_accum=True)
    batches = make_batches(11, k, B, 16)
    init, _ = train.build(cfg, torch.device("cpu"))
    got_fp32, _ = accumulated_grads(cfg, batches, "mean")
    got_bf16, _ = accumulated_grads(tiny_config(precision="bf16"), batches, "mean")
    # against the FP32 big-batch gradient on the same (BF16) weights: both carry the BF16
    # forward/backward error (~0.5% here), the BF16 sum about as much again on top
    want = big_batch_grads(init.state_dict(), batches)
    err_fp32, err_bf16 = rel_err(got_fp32, want), rel_err(got_bf16, want)
    assert err_fp32 < 0.6 * err_bf16, (err_fp32, err_bf16)
    # against the exact sum of the same BF16 micro-gradients: the buffers lose nothing
    exact = micro_gradients_summed_in_fp32(init.state_dict(), batches, k, 1)
    assert_grads_equal(got_fp32, exact)
    assert rel_err(got_bf16, exact) > 3e-3
    # without the flag the accumulation really happens in BF16 .grad (what the buffers avoid)
    _, parts = train.build(tiny_config(precision="bf16"), torch.device("cpu"))
    assert parts.grad_buffers is None and parts.optimizer.model_params[0].dtype == torch.bfloat16


def micro_gradients_summed_in_fp32(params, batches, k, world):
    """What FP32 accumulation over ranks must produce, by hand: each BF16 micro-gradient
    (of loss / K) cast to FP32, summed over all micro-batches, averaged over ranks."""
    model, _ = train.build(tiny_config(precision="bf16"), torch.device("cpu"))
    model.load_state_dict(params)
    acc = None
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        (model(x, y)[1] * (1.0 / k)).backward()
        g = [p.grad.float() for p in model.parameters()]
        acc = g if acc is None else [a + b for a, b in zip(acc, g)]
    return [a / world for a in acc]


def test_ddp_fp32_grad_accum_matches_big_batch(ddp_grads):
    rec0, rec1 = ddp_grads[0]["fp32_grad_accum"], ddp_grads[1]["fp32_grad_accum"]
    # DDP's own all-reduce never runs: one manual all-reduce of the FP32 buffers instead
    assert rec0["allreduces"] == [0] * STEPS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran on one thread: same BF16 matmul reduction order
    try:
        for step in range(STEPS):
            params = rec0["params"][step]
            assert params["wte.weight"].dtype == torch.bfloat16
            batches = make_batches(seed_of("fp32_grad_accum", step), WORLD * K, B, 16)
            assert_grads_equal(rec0["grads"][step], rec1["grads"][step], rtol=0, atol=0)
            assert_grads_equal(rec0["grads"][step], micro_gradients_summed_in_fp32(params, batches, K, WORLD))
            # and that is the big-batch gradient, up to BF16 arithmetic in forward and backward
            assert rel_err(rec0["grads"][step], big_batch_grads(params, batches)) < 0.03
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- train.py under torchrun

TRAIN_ARGS = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=4", "--max_iters=3",
              "--warmup_iters=0", "--learning_rate=1e-2", "--peak_flops=1", "--ledger=false", "--sample_tokens=0",
              "--eval_interval=1000", "--log_interval=1", "--device=cpu"]


@pytest.fixture(scope="session")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.txt"
    path.write_bytes(b"".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n".encode() for i in range(2000)))
    return path


@pytest.fixture(scope="session")
def ddp_train(tmp_path_factory, data_file):
    """train.py's loop on 2 ranks, bf16, K derived from --total_batch_tokens (4 x 2 x 4 x 16)."""
    out = tmp_path_factory.mktemp("train")
    args = TRAIN_ARGS + [f"--data={data_file}", f"--out_dir={out}", "--precision=bf16", "--total_batch_tokens=512"]
    r = torchrun([WORKER, "train", out, "--", *args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, [torch.load(out / f"train-rank{rank}.pt", weights_only=False) for rank in range(WORLD)], out


def test_torchrun_params_identical_on_all_ranks(ddp_train, data_file):
    _, ranks, out = ddp_train
    p0, p1 = ranks[0]["params"], ranks[1]["params"]
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k
    # it trained: the weights moved from the seeded initialisation
    init, _ = train.build(parse_args(TRAIN_ARGS + ["--precision=bf16"]), torch.device("cpu"))
    assert not torch.equal(init.state_dict()["wte.weight"], p0["wte.weight"])
    # every step stepped, and each rank saw its own data stream (different local losses)
    h0, h1 = ranks[0]["history"], ranks[1]["history"]
    assert len(h0) == len(h1) == 3 and all(r["stepped"] for r in h0 + h1)
    assert all(a["loss"] != b["loss"] for a, b in zip(h0, h1))
    assert (out / snapshot.FILE).exists()  # rank 0 wrote it


def test_torchrun_prints_the_effective_batch(ddp_train):
    r, _, _ = ddp_train
    lines = [l for l in r.stdout.splitlines() if "effective batch" in l]
    assert len(lines) == 1, r.stdout  # rank 0 only
    m = re.search(r"effective batch = micro-batch (\d+) x world_size (\d+) x accum (\d+) = (\d+) sequences "
                  r"= (\d+) tokens", lines[0])
    assert m, lines[0]
    b, w, k, seqs, tokens = map(int, m.groups())
    assert (b, w, k) == (4, WORLD, 512 // (4 * WORLD * 16))
    assert seqs == b * w * k and tokens == seqs * 16 == 512


def test_train_prints_the_effective_batch_single_process(data_file, tmp_path):
    r = run_train_py(merged(*TRAIN_ARGS, f"--data={data_file}", f"--out_dir={tmp_path}", "--precision=fp32",
                            "--accum=3", "--max_iters=1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "effective batch = micro-batch 4 x world_size 1 x accum 3 = 12 sequences = 192 tokens" in r.stdout


@pytest.mark.parametrize("bad, words", [
    ("--accum=0", "--accum must be >= 1"),
    ("--total_batch_tokens=100", "total_batch_tokens=100 is not a positive multiple"),
    ("--total_batch_tokens=32", "total_batch_tokens=32 is not a positive multiple"),
])
def test_train_bad_accumulation_exits_2(bad, words, data_file, tmp_path, capsys):
    status = train.main(TRAIN_ARGS + [f"--data={data_file}", f"--out_dir={tmp_path}", bad])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error:") and words in err[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_torchrun_bad_total_batch_tokens_names_the_world_size(data_file, tmp_path):
    """192 tokens is 3 micro-steps on one process but 1.5 on two: every rank refuses."""
    r = torchrun(["train.py", *TRAIN_ARGS, f"--data={data_file}", f"--out_dir={tmp_path}",
                  "--total_batch_tokens=192"], timeout=60)
    assert r.returncode != 0  # the ranks exit 2; torchrun itself reports 1
    assert "error: total_batch_tokens=192 is not a positive multiple of batch_size x world_size x block_size " \
           "= 4 x 2 x 16 = 128" in r.stderr + r.stdout


def test_torchrun_resume_keeps_one_data_stream_per_rank(ddp_train, data_file, tmp_path):
    _, _, out = ddp_train  # its snapshot: 3 steps on 2 ranks
    args = merged(*TRAIN_ARGS, f"--data={data_file}", f"--out_dir={out}", "--precision=bf16",
                  "--total_batch_tokens=512", "--max_iters=5", "--lr_decay_iters=3", "--resume")
    r = torchrun([WORKER, "train", tmp_path, "--", *args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    h0, h1 = (torch.load(tmp_path / f"train-rank{rank}.pt", weights_only=False)["history"] for rank in range(WORLD))
    assert [h["step"] for h in h0] == [4, 5]
    assert all(a["loss"] != b["loss"] for a, b in zip(h0, h1)), (h0, h1)


def test_torchrun_fp8_scales_are_the_same_on_every_rank(data_file, tmp_path):
    """Each rank sees other data, so other amaxes; the max over ranks keeps one set of FP8 scales."""
    args = TRAIN_ARGS + [f"--data={data_file}", f"--out_dir={tmp_path}", "--precision=fp8", "--accum=2"]
    r = torchrun([WORKER, "train", tmp_path, "--", *args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    p0, p1 = (torch.load(tmp_path / f"train-rank{rank}.pt", weights_only=False)["params"] for rank in range(WORLD))
    histories = [k for k in p0 if k.endswith("amax_history")]
    assert histories and all(p0[k][0, :2].gt(0).all() for k in histories)  # input and weight amax recorded
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k  # weights, amax histories and scales alike


def test_torchrun_divergence_stops_every_rank_and_keeps_the_snapshot(ddp_train, data_file, tmp_path):
    """A resume at a runaway learning rate on 2 ranks: the ranks agree (one all-reduce per check)
    and stop together, and the 2-rank snapshot they resumed from is not replaced."""
    out = tmp_path / "out"
    shutil.copytree(ddp_train[2], out)
    good = (out / snapshot.FILE).read_bytes()
    args = merged(*TRAIN_ARGS, f"--data={data_file}", f"--out_dir={out}", "--precision=bf16", "--resume",
                  "--total_batch_tokens=512", "--max_iters=8", "--lr_decay_iters=8", "--learning_rate=1e30",
                  "--snapshot_interval=1")
    r = torchrun(["train.py", *args])
    said = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(said) == WORLD, f"expected one error line per rank:\n{r.stderr[-3000:]}"
    assert all("the run diverged" in line and "resumed from, untouched)" in line for line in said), \
        f"not every rank's line says the run diverged and the resumed snapshot is kept: {said}"
    assert (out / snapshot.FILE).read_bytes() == good, "the 2-rank snapshot was replaced after the divergence"


def test_torchrun_a_refusal_on_one_rank_ends_the_others_at_once(data_file):
    """Only rank 0 can find that it cannot write here (/proc refuses a mkdir even to root); rank 1
    waits in the rendezvous, where torchrun's SIGTERM now ends it at once instead of after 30 s."""
    r = torchrun(["train.py", *TRAIN_ARGS, f"--data={data_file}", "--out_dir=/proc/no/such/out"])
    assert r.returncode != 0 and "error: --out_dir=/proc/no/such/out cannot be written" in r.stderr, r.stderr[-3000:]
    assert "exitcode  : -9" not in r.stderr, f"a rank ignored SIGTERM until torchrun's SIGKILL:\n{r.stderr[-3000:]}"
