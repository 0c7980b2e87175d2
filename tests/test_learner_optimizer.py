"""A learner's edit: SGD with momentum in place of AdamW, as one class registered in
precision.OPTIMIZERS and nowhere else. It trains and resumes, and the ledger (its states, each ZeRO
rank's, the step's peak) is exact for it: the trace runs its step, and everything that splits, saves or
checks the optimizer's state reads the spec."""
from dataclasses import replace

import torch

import precision
import train
from config import Config
from guards import cli
from ledger import trace
from tools import ledger as tool


class SGD:
    """SGD with momentum (beta1 is its momentum): one FP32 buffer per parameter, no per-tensor count."""
    name = "sgd"
    per_element = ("momentum_buffer",)
    per_tensor = ()
    nonnegative = ()

    def __init__(self, cfg):
        self.hyperparameters = dict(momentum=cfg.beta1)

    def build(self, groups, lr):
        return torch.optim.SGD(groups, lr=lr, foreach=True, **self.hyperparameters)


TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2"]


def test_sgd_with_momentum_is_one_class(monkeypatch, tmp_path):
    monkeypatch.setitem(precision.OPTIMIZERS, "sgd", SGD)
    for prec in ("fp32", "bf16"):
        cfg = cli.parse_args(TINY + [f"--precision={prec}", "--optimizer=sgd", "--device=cpu"])
        meas, traced = tool.run_config(cfg, torch.device("cpu")), trace.step(cfg)
        rows, ok = tool.compare(cfg, traced, meas)
        assert ok, f"{prec}: " + tool.failure(cfg, rows)
        # one momentum buffer per parameter, FP32, no step counts: half of AdamW's moments
        P = traced["params"][0]
        assert meas["optimizer"] == 4 * P, f"{prec}: SGD's state measured {meas['optimizer']:,} bytes, 4P = {4 * P:,}"
        for stage in ("zero1", "zero2"):  # each rank's slice, traced under a fake process group of 2
            per_rank = [trace.step(replace(cfg, shard=stage), 2, r)["optimizer"] for r in range(2)]
            assert sum(per_rank) == 4 * (P + P % 2), f"{stage}: SGD's states over 2 ranks {per_rank}, 4P = {4 * P:,}"
    flags = TINY + ["--sample_tokens=0", "--ledger=false", "--optimizer=sgd", "--eval_interval=100",
                    "--lr_decay_iters=3", f"--out_dir={tmp_path}"]
    assert train.main(flags + ["--max_iters=2"]) == 0 and (tmp_path / "snapshot.pt").exists()
    resumed = train.train(cli.parse_args(flags + ["--max_iters=3", "--resume"]), log=lambda line: None)
    assert [h["step"] for h in resumed] == [3], "the SGD snapshot did not resume at step 3"
    saved = torch.load(tmp_path / "snapshot.pt", weights_only=True)["optimizer"]
    assert "sgd" in saved and "adamw" not in saved, f"the snapshot keeps {sorted(saved)}"


def test_the_ledger_counts_the_specs_state():
    # AdamW keeps two FP32 moments and a CPU step count per tensor; the spec says so, the ledger reads it
    cpu = trace.step(Config(n_layer=2, n_embd=32, n_head=2, block_size=16, device="cpu"))
    P, tensors = cpu["params"]
    assert cpu["optimizer"] == 8 * P + 4 * tensors, f"AdamW's states on CPU {cpu['optimizer']:,} bytes"
    gpu = trace.step(Config(n_layer=2, n_embd=32, n_head=2, block_size=16, device="cuda"))
    assert gpu["optimizer"] == 8 * P and gpu["host"] == 4 * tensors, \
        f"AdamW's states on a GPU {gpu['optimizer']:,} bytes, its step counts in host memory {gpu['host']:,}"
