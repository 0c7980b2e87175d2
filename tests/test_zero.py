"""ZeRO-1 and ZeRO-2 by hand (zero.py) against DDP, through real torchrun/gloo processes on CPU.

The rank side is tests/zero_worker.py; each torchrun launch runs once per session. What must
hold: the same parameters as DDP, bit for bit (two ranks: x/2 is exact and a + b = b + a); the
micro-steps send nothing and the step one reduce-scatter and one all-gather; one overflow
decision and one clipping norm for all ranks; each rank holding 1/N of the master copy and
AdamW's states, padding included; snapshots in DDP's format that resume bit-exactly.
"""
from pathlib import Path

import pytest
import torch
from guards import cli

import zero
from ledger import comm
from conftest import torchrun
from zero_worker import CASES, K, SHAPE, key

WORKER = Path(__file__).resolve().parent / "zero_worker.py"
WORLD = 2
SHARDS = ("zero1", "zero2")


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    """One torchrun launch of the worker's cases, overflow and fp8 runs: {mode: [rank 0's, rank 1's]}."""
    out = tmp_path_factory.mktemp("zero")
    r = torchrun([WORKER, "all", out])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {mode: [torch.load(out / f"{mode}-rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
            for mode in ("cases", "overflow", "fp8")} | {"stderr": r.stderr}


def test_a_zero_run_is_told_of_no_deprecated_collective(launched):
    """zero.collective calls torch's current names: the older ones warn on every rank of every run (torch 2.13)."""
    told = [line for line in launched["stderr"].splitlines() if "deprecated" in line]
    assert not told, f"the ZeRO ranks' stderr says: {told[0]}"


@pytest.fixture(scope="session")
def cases(launched):
    return launched["cases"]


@pytest.fixture(scope="session")
def overflow(launched):
    return launched["overflow"]


def case_ids():
    return [f"{key(c, s)}" for c in CASES for s in SHARDS]


@pytest.mark.parametrize("case,shard", [(c, s) for c in CASES for s in SHARDS], ids=case_ids())
def test_zero_parameters_equal_ddps_bit_for_bit(cases, case, shard):
    for rank in range(WORLD):
        ddp, ours = cases[rank][key(case, "none")], cases[rank][key(case, shard)]
        assert all(s["stepped"] for s in ddp["steps"] + ours["steps"]), "a step was skipped: the case tests nothing"
        for step, (want, got) in enumerate(zip(ddp["params"], ours["params"])):
            differ = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
            worst = max(((a.float() - b.float()).abs().max().item() for a, b in zip(want, got)))
            assert not differ, (f"rank {rank}, {shard}: after step {step + 1} parameters {differ} differ from "
                                f"DDP's (largest difference {worst:g}); they must be equal bit for bit")
        norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(ddp["steps"], ours["steps"])]
        assert all(a == b for a, b in norms), f"rank {rank}, {shard}: gradient norms (DDP's, ours) {norms} " \
            f"differ: the clipping norm must be the whole gradient's, to the bit (precision.squared_sum)"
    if case["grad_clip"]:  # the clipping ran: the norm was above the limit on some step
        assert any(s["grad_norm"] > case["grad_clip"] for s in cases[0][key(case, shard)]["steps"])


def test_the_ranks_hold_one_model(cases):
    for k in cases[0]:
        for i, (a, b) in enumerate(zip(cases[0][k]["params"][-1], cases[1][k]["params"][-1])):
            assert torch.equal(a, b), f"{k}: parameter {i} differs between rank 0 and rank 1 after the all-gather"


@pytest.mark.parametrize("shard", SHARDS)
def test_micro_steps_send_nothing_and_a_step_one_reduce_scatter_and_one_all_gather(cases, shard):
    case = CASES[2]  # bf16, clipped
    for rank in range(WORLD):
        for step, phases in enumerate(cases[rank][key(case, shard)]["phases"]):
            sent = [(phase, kinds) for phase, kinds, _ in phases if kinds and phase != "step"]
            assert not sent, f"rank {rank}, step {step + 1}: {shard} sent {sent} during the micro-steps; " \
                             f"all its communication belongs to the optimizer step"
            at_step = [kinds for phase, kinds, _ in phases if phase == "step"][0]
            kinds = {next((k for k in ("reduce_scatter", "all_gather") if name.startswith(k)), name): n
                     for name, n in at_step.items()}
            assert kinds == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 1}, \
                f"rank {rank}, step {step + 1}: {shard}'s optimizer step issued {at_step}; expected one " \
                f"reduce-scatter of the gradients, one all-reduce of the squared norm, one all-gather of the weights"


@pytest.mark.parametrize("case", CASES, ids=[key(c, "") for c in CASES])
def test_zero_moves_what_ddp_moves(cases, case):
    """The paper's volume: DDP's all-reduce is 2 x the gradient bytes; a ZeRO step's reduce-scatter
    and all-gather the same, plus the flat buffer's padding both ways and the 8-byte norm."""
    n_params = cases[0][key(case, "none")]["states"]["n_params"]
    padding = -n_params % WORLD
    grad_bytes = 4 if case.get("fp32_grad_accum") or case["precision"] == "fp32" else 2
    param_bytes = 4 if case["precision"] == "fp32" else 2
    ddp = sum(v for _, _, v in cases[0][key(case, "none")]["phases"][-1])
    assert ddp == 2 * grad_bytes * n_params, f"DDP moved {ddp:,} bytes in a step; 2 x the gradient is " \
                                             f"{2 * grad_bytes * n_params:,}"
    for shard in SHARDS:
        ours = sum(v for _, _, v in cases[0][key(case, shard)]["phases"][-1])
        want = (grad_bytes + param_bytes) * (n_params + padding) + 2 * 8
        assert ours == want, f"{shard} moved {ours:,} bytes in a step, expected a reduce-scatter of the " \
                             f"{grad_bytes}-byte gradients and an all-gather of the {param_bytes}-byte weights " \
                             f"({n_params:,} + {padding} padding each) and the norm: {want:,}"
        if grad_bytes == param_bytes:
            assert ours - ddp == 2 * grad_bytes * padding + 16


@pytest.mark.parametrize("shard", SHARDS)
def test_each_rank_holds_its_slice_of_the_master_and_adamws_states(cases, shard):
    """Measured storages against the slice arithmetic: rank r owns elements [r*S, (r+1)*S) of the
    padded flat buffer; its master is 4 bytes and its m and v 8 bytes per real element, plus
    AdamW's FP32 step count (torch keeps it on the CPU) per parameter piece in the slice."""
    case = CASES[2]
    n_params = cases[0][key(case, "none")]["states"]["n_params"]
    sizes = [p.numel() for p in cases[0][key(case, "none")]["params"][-1]]
    ddp = cases[0][key(case, "none")]["states"]
    total = dict(master=0, optimizer=0)
    for rank in range(WORLD):
        shards = zero.Shards(sizes, WORLD, rank)
        real = sum(n for *_, n in shards.pieces())
        got = cases[rank][key(case, shard)]["states"]
        want = dict(master=4 * real, optimizer=8 * real + 4 * len(shards.pieces()),
                    parameters=2 * (n_params + shards.padding))
        for component, value in want.items():
            assert got[component] == value, f"rank {rank}, {shard}: {component} measured {got[component]:,} bytes, " \
                                            f"the slice of {real:,} parameters (of {n_params:,}) predicts {value:,}"
        total["master"] += got["master"]
        total["optimizer"] += got["optimizer"] - 4 * len(shards.pieces())
    assert total["master"] == ddp["master"], "the ranks' master slices do not add up to DDP's whole master copy"
    assert total["optimizer"] == ddp["optimizer"] - 4 * len(sizes), "the ranks' m and v do not add up to DDP's"


@pytest.mark.parametrize("shard", SHARDS)
def test_an_overflow_in_one_ranks_slice_skips_the_step_on_every_rank(overflow, shard):
    runs = [overflow[rank][shard] for rank in range(WORLD)]
    last_start, _ = runs[-1]["slice"]
    assert runs[0]["n_params"] - 1 >= last_start, "the planted inf is not in the last rank's slice"
    for rank, run in enumerate(runs):
        steps = run["steps"]
        assert [s["stepped"] for s in steps] == [True, False, True], \
            f"rank {rank} ({shard}) stepped {[s['stepped'] for s in steps]}: the inf was in rank {WORLD - 1}'s " \
            f"slice only, and every rank must skip step 2"
        assert not steps[1]["changed"], f"rank {rank} ({shard}) changed its weights on the skipped step"
        assert [s["scale"] for s in steps] == [65536.0, 32768.0, 32768.0], \
            f"rank {rank} ({shard}): the loss scale went {[s['scale'] for s in steps]}; it must back off on every rank"


def test_one_process_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    import train
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert train.main(["--shard=zero2", "--device=cpu", f"--out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "torchrun" in err and "make ddp NPROC=2 SHARD=zero2" in err, err


def test_count_sees_every_collective_we_call():
    """ledger/comm.Count must wrap the names zero.py calls (or the step's volume reads 0)."""
    import inspect
    import re
    source = inspect.getsource(zero)
    called = set(re.findall(r"dist\.(\w+)\(", source))
    called |= {name for names in re.findall(r'collective\("(\w+)", "(\w+)"\)', source) for name in names}
    # gather: snapshots; all_gather_object: the states line said once, after the first step (not a step's)
    collectives = called - {"get_world_size", "get_rank", "gather", "all_gather_object"}
    assert collectives <= set(comm.FACTOR), f"zero.py calls {sorted(collectives - set(comm.FACTOR))}, " \
                                            f"which ledger/comm.Count does not count"


def param_count():
    from config import Config
    from model import GPT
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(Config(**SHAPE)).parameters())


def test_shape_is_padded():
    """The cases' model has an odd parameter count, so the flat buffer's padding is exercised."""
    n = param_count()
    assert n % WORLD, f"P = {n} divides by {WORLD}: pick a SHAPE with an odd parameter count"
    assert K > 1, "with one micro-step, 'the micro-steps send nothing' tests nothing"


# ---------------------------------------------------------------- make ledger's sharded rows

@pytest.fixture(scope="session")
def ledger_ranks():
    """tools/ledger.py's 2-process run at the odd shape, BF16: the flat buffer and FSDP's rows padded.
    (The FP32 sums' rows differ only in the gradients the step holds: tests/test_memory_cli.py's
    ledger runs are BF16 too; the sums' path is held bit for bit against DDP's above.)"""
    from config import Config
    from tools import ledger
    return {"bf16": ledger.measure_ranks(Config(**SHAPE, batch_size=2, precision="bf16"))}


@pytest.mark.parametrize("run", ["bf16"])
def test_the_ledgers_sharded_rows_are_exact(ledger_ranks, run):
    from config import Config
    from tools import ledger_ranks as ranks_tool
    figures = ledger_ranks[run]
    assert set(figures) == {"none", "zero1", "zero2", "fsdp"}
    cfg = Config(**SHAPE, batch_size=2, precision="bf16")
    for shard, ranks in figures.items():
        for r in ranks:
            missed, _ = ranks_tool.misses(cfg, shard, r)
            assert not missed, f"{run}, {shard}, rank {r['rank']}: measured vs its trace (fake process group): " + \
                "; ".join(missed)
    grads = {shard: ranks[0]["measured"]["step_gradients"] for shard, ranks in figures.items()}
    # what ZeRO-2 adds to ZeRO-1: the whole gradient gone before the step
    assert grads["zero2"] < grads["none"] < grads["zero1"], f"gradients held in the step: {grads}"
    master = figures["zero2"][0]["measured"]["master"]  # FP32: each rank's slice of the flat buffer
    assert master * WORLD // 4 == param_count() + 1, "the odd shape's flat buffer has one padding element"
    assert figures["fsdp"][0]["measured"]["parameters"] * WORLD // 2 > param_count(), \
        "the odd shape's FSDP shards are padded"


# ---------------------------------------------------------------- train.py: snapshots from sharded state

# FP16 (its loss scaler's state) with dropout (each rank's RNG): the state a resume must carry
RESUME_ARGS = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--accum=2",
               "--precision=fp16", "--dropout=0.1", "--warmup_iters=0", "--lr_decay_iters=4", "--learning_rate=1e-2",
               "--ledger=false", "--sample_tokens=0", "--eval_interval=1000", "--log_interval=1", "--device=cpu"]


@pytest.fixture(scope="session")
def resumed(tmp_path_factory):
    """train.py under torchrun: zero2 4 steps; zero2 2 steps (its snapshot kept), then resumed to 4."""
    import shutil
    base = tmp_path_factory.mktemp("resume")
    data = base / "data.txt"
    data.write_bytes(b"".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n".encode() for i in range(2000)))
    def train(out, *extra):
        r = torchrun(["train.py", *RESUME_ARGS, f"--data={data}", f"--out_dir={base / out}", *extra])
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return r
    train("straight", "--shard=zero2", "--max_iters=4")
    train("half", "--shard=zero2", "--max_iters=2")
    shutil.copy(base / "half" / "snapshot.pt", base / "half.pt")
    logs = dict(zero2=train("half", "--shard=zero2", "--max_iters=4", "--resume"))
    snap = {name: torch.load(path, weights_only=True) for name, path in (
        ("straight", base / "straight" / "snapshot.pt"), ("half", base / "half" / "snapshot.pt"),
        ("at 2", base / "half.pt"))}
    return snap, logs, None


def same_state(a, b):
    """[what differs] between two snapshots' model, master weights and AdamW moments."""
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    differ += [f"master {i}" for i, (x, y) in enumerate(zip(a["optimizer"]["master_params"],
                                                            b["optimizer"]["master_params"])) if not torch.equal(x, y)]
    sa, sb = a["optimizer"]["adamw"]["state"], b["optimizer"]["adamw"]["state"]
    differ += [f"AdamW {k} {name}" for k in sa for name in ("exp_avg", "exp_avg_sq", "step")
               if not torch.equal(sa[k][name], sb[k][name])]
    return differ


def test_a_zero_snapshot_resumes_bit_exactly(resumed):
    snap, _, _ = resumed
    assert snap["half"]["step"] == snap["straight"]["step"] == 4
    assert not (d := same_state(snap["straight"], snap["half"])), \
        f"zero2: 2 steps + snapshot + resume + 2 steps differ from 4 straight steps in {d[:5]}"


def test_zero_and_ddp_snapshots_are_one_format(resumed):
    """A ZeRO snapshot is DDP's: a DDP rank's optimizer (one process here, rank 0 of 2) restores it
    and gives back the same state, every master weight and AdamW moment."""
    import snapshot
    import train
    from guards.cli import parse_args
    from data import Batches
    snap, _, _ = resumed
    saved = snap["at 2"]
    cfg = parse_args(RESUME_ARGS + ["--shard=none"])
    model, parts = train.build(cfg, torch.device("cpu"))
    batches = Batches(torch.zeros(4096, dtype=torch.uint8), cfg.block_size, cfg.batch_size, 0, torch.device("cpu"))
    assert snapshot.restore(saved, model, parts, batches, 0, WORLD, torch.device("cpu")) == 2
    again = dict(model=model.state_dict(), optimizer=parts.optimizer.state_dict())
    assert not (d := same_state(saved, again)), f"DDP's optimizer restored zero2's snapshot as something else: {d[:5]}"


def test_sharded_runs_say_each_ranks_states(resumed):
    _, logs, _ = resumed
    lines = [line for line in logs["zero2"].stdout.splitlines() if line.startswith("states per rank")]
    assert len(lines) == 1 and "rank 0:" in lines[0] and "rank 1:" in lines[0] and "every DDP rank" in lines[0], \
        logs["zero2"].stdout[-2000:]


def test_fp8_scales_are_the_same_on_every_rank_under_zero(launched):
    """FP8's amax is max-reduced over the ranks once per step under ZeRO too (no DDP wrapper there:
    accumulate.py's across_ranks): every rank keeps one set of scales, DDP's, and one model."""
    runs = [launched["fp8"][rank] for rank in range(WORLD)]
    for shard in ("none", "zero2"):
        b0, b1 = runs[0][shard], runs[1][shard]
        histories = [k for k in b0 if k.endswith("amax_history")]
        assert histories and all(b0[k][0, :2].gt(0).all() for k in histories), f"{shard}: no amax was recorded"
        differ = [k for k in b0 if not torch.equal(b0[k], b1[k])]
        assert not differ, f"{shard}: rank 0 and rank 1 differ in {differ[:5]} (weights, amax histories, scales)"
    differ = [k for k in runs[0]["none"] if not torch.equal(runs[0]["none"][k], runs[0]["zero2"][k])]
    assert not differ, f"FP8 under zero2 differs from DDP in {differ[:5]}"
