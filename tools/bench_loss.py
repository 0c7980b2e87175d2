"""`make bench`'s loss section: the loss whole (LOSS_CHUNKS=1) and in pieces, at GPT-2's vocabulary.

A tool, not a chapter file. Read model.ChunkedLoss first, then tools/bench_compile.py (the same
design: one process, the models' steps in turn on the same batches), then `measure_pieces`.
tools/bench.py starts this file once, in a process of its own (`--row JOB`), and prints its lines:

    python tools/bench.py --sections=loss          (make bench ARGS=--sections=loss)

The models are the base config's at vocabulary 50,304 (tokens are still bytes: the head and its
loss are as large as GPT-2's, the data need not be), one per k in PIECES, built alike (train.build
seeds them). Each round steps every model once, in a rotating order, so the machine's drift falls
on all; a model's time ratio against k = 1 is the median of its rounds' ratios. Per k: the step's
peak (every byte alive, the states too: ledger/measure.py's LiveTensors on CPU, the caching
allocator's high-water mark on CUDA) and the loss's temporaries at their most (ledger/loss.
loss_at_most, run on real tensors on the same device, their storages counted) as a share of it.
"""
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import torch  # noqa: E402

import accumulate  # noqa: E402
import train  # noqa: E402
from guards.clean_end import memory_available  # noqa: E402
from config import UsageError  # noqa: E402
from data import Batches, load_tokens, split_tokens  # noqa: E402
from guards import cli  # noqa: E402
from ledger import measure  # noqa: E402
from ledger.loss import loss_at_most  # noqa: E402
from tools import bench  # noqa: E402
from tools.bench_compile import job_of  # noqa: E402

VOCAB = 50304  # GPT-2's vocabulary, padded to a multiple of 64 as nanoGPT pads it
PIECES = (1, 4, 16)


def step_peak(model, parts, micro, cfg, device):
    """Every byte alive at the step's highest: the states, the batch and what the step adds."""
    before = measure.resident(model, parts) + (parts.grad_buffers or []) + [t for batch in micro for t in batch]
    tracker = measure.CudaAllocator(device) if device.type == "cuda" else measure.LiveTensors(device)
    with tracker:
        tracker.adopt(before)
        tracker.reset_peak()
        accumulate.accumulation_step(model, parts, micro, cfg.loss_norm, cfg.no_sync)
    return tracker.peak


def measure_pieces(flags, rounds, warmup):
    """The rows of PIECES for the base config at VOCAB, their steps in turn in one process."""
    cfg = replace(cli.parse_args(flags), vocab_size=VOCAB)
    if cfg.loss_chunks != 1:
        raise UsageError("the loss section sets LOSS_CHUNKS itself, to each of 1, 4 and 16: leave it out")
    device = train.pick_device(cfg)
    tokens, _ = split_tokens(load_tokens(cfg.data), cfg.block_size)
    runs = {k: train.build(replace(cfg, loss_chunks=k), device) for k in PIECES}
    batches = Batches(tokens, cfg.block_size, cfg.batch_size, cfg.seed, device)
    accum = accumulate.micro_steps(cfg, 1, memory_available())
    times = {k: [] for k in PIECES}
    for i in range(warmup + rounds):
        micro = [batches.next() for _ in range(accum)]
        for k in PIECES[i % len(PIECES):] + PIECES[:i % len(PIECES)]:
            times[k].append(bench.timed_step(*runs[k], micro, cfg, device))
    tokens_per_step = cfg.batch_size * accum * cfg.block_size
    rows = []
    for k, (model, parts) in runs.items():
        ratios = [whole / piece for whole, piece in zip(times[1][warmup:], times[k][warmup:])]
        peak = step_peak(model, parts, micro, cfg, device)
        loss = loss_at_most(replace(cfg, loss_chunks=k), fake=False, device=device)[0]
        rows.append(dict(section="loss", precision=parts.precision.name, loss_chunks=k, vocab_size=VOCAB,
                         rounds=rounds, tokens_per_s=tokens_per_step / statistics.median(times[k][warmup:]), peak_bytes=peak,
                         loss_bytes=loss, loss_share=loss / peak, speed_vs_whole=statistics.median(ratios),
                         speed_ratios=ratios, device=str(device),
                         config=dict(n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size,
                                     batch_size=cfg.batch_size, accum=accum)))
    whole = rows[0]["peak_bytes"]
    for row in rows:
        ratios = row["speed_ratios"]
        row["line"] = (f"loss      {row['precision']} V={VOCAB:,} in {row['loss_chunks']:2d} piece(s): peak "
                       f"{row['peak_bytes']:,} bytes (x{row['peak_bytes'] / whole:.2f} of whole), the loss at its most "
                       f"{row['loss_bytes']:,} ({row['loss_share']:.0%} of the peak); {row['tokens_per_s']:,.0f} "
                       f"tok/s, x{row['speed_vs_whole']:.3f} of whole (median of {rounds} rounds, "
                       f"{min(ratios):.3f}-{max(ratios):.3f})")
    return rows


def row_program(argv):
    """`--row JOB`, tools/bench.py's entry point into this file: its JSON job in, the JSON rows out."""
    print(json.dumps(measure_pieces(*job_of(argv, "loss"))))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--row"]:
        sys.exit(cli.run(lambda argv: print(__doc__.strip()) or 0, []))
    sys.exit(cli.run(row_program, sys.argv[2:]))
