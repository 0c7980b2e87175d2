"""The ledger's sharded rows, measured: each rank's states under DDP, ZeRO-1, ZeRO-2 and FSDP.

Both sides of it. tools/ledger.py (and tools/chapter.py) call `measure_ranks`, which starts this
file RANKS times (`run_ranks`), gloo on CPU, each process told its rank by RANK and WORLD_SIZE in
its environment, as torchrun would, the ranks meeting through a file in a temporary folder (no
port to find, no launcher's words between a failure and the learner):

    python tools/ledger_ranks.py --jobs=FOLDER/jobs.json --into=FOLDER

jobs.json is a list of {"flags": [train.py flags], "shards": [SHARD values]}. Each rank (`program`),
for each job and SHARD: builds the run, takes one step (AdamW makes its states), then one step of ACCUM
micro-steps measured (ledger/measure.measure: the storages, as the single-process ledger counts them) with its
collectives counted (ledger/comm.Count), beside the formulas' (ledger/shard.rank_states,
step_collectives); it writes its own FOLDER/rank<N>.json after every SHARD: its figures so far
and, where something failed, the error in one line. Figures and failures travel by that one file.
"""
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import accumulate  # noqa: E402
import train  # noqa: E402
from guards import cli  # noqa: E402
from config import Config, RunError, UsageError, key, validate  # noqa: E402
from ledger import comm, measure, trace  # noqa: E402
from guards.clean_end import write_atomically  # noqa: E402
from tools.ledger_report import in_words  # noqa: E402

RANKS = 2  # the sharded rows' processes: gloo on CPU
SHARD_NAMES = {"none": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP (ZeRO-3)"}
MEASURED = ("parameters", "buffers", "master", "optimizer", "step_gradients", "fp8_kept", "activations", "peak")
WAIT = timedelta(minutes=5)  # the longest a collective waits for the other ranks: a step here takes seconds
GRACE = 5  # seconds the other ranks get to say their own words once one has failed
_DONE = {}  # the flags of a job -> its figures, or the line that says why it has none (once per process)


# ---------------------------------------------------------------- the parent: start the ranks, read them

def shards_for(cfg):
    """The SHARD values cfg can run with (FSDP refuses FP8 and FP32 sums: config.validate)."""
    runnable = []
    for shard in SHARD_NAMES:
        try:
            validate(replace(cfg, shard=shard))
            runnable.append(shard)
        except UsageError:
            pass
    return runnable


def job_config(cfg):
    """The config the ranks measure for cfg's shape: one micro-batch, no output, the keys that change
    neither left at their defaults (one run for them all)."""
    cpu = replace(cfg, device="cpu", shard="none", accum=1, total_batch_tokens=0, out_dir=Config.out_dir,
                  compile=False)
    if cpu.ckpt == "none":  # ckpt_impl names how a policy recomputes: with none it is refused
        cpu = replace(cpu, ckpt_impl=Config.ckpt_impl)
    return cpu


def job_of(cfg):
    """The job that measures cfg's shape: its flags and the SHARD values it runs with."""
    cpu = job_config(cfg)
    return tuple(cli.flags(cpu)), tuple(shards_for(cpu))


def measure_ranks(cfg):
    """{shard: [each rank's measured and formula figures]} for cfg's shape, RANKS gloo processes on CPU;
    RunError, in one line, where they could not say."""
    return measure_ranks_many([cfg])[0]


def measure_ranks_many(cfgs):
    """measure_ranks for several configs, those not measured yet in this process in one start of the
    ranks (again for the jobs after one that failed). Returns each one's figures, or raises the first
    one's failure."""
    jobs = [job_of(cfg) for cfg in cfgs]
    while todo := list(dict.fromkeys(job for job in jobs if job not in _DONE)):
        _DONE.update((job, said) for job, said in zip(todo, run_ranks(todo)) if said is not None)
    for job in jobs:
        if isinstance(_DONE[job], str):
            raise RunError(_DONE[job])
    return [_DONE[job] for job in jobs]


def run_ranks(jobs):
    """Start RANKS processes of this file on `jobs` [(flags, shards)]; returns, per job, {shard: [figures
    of each rank]}, the one line that says why not, or None for a job after the one that failed. The
    first rank that fails ends the others (they would wait for it in a collective) GRACE seconds on."""
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "jobs.json").write_text(json.dumps([dict(flags=flags, shards=shards) for flags, shards in jobs]))
        procs, ended = [], set()
        for rank in range(RANKS):
            # one thread per rank: RANKS processes share the cores. torchrun's whole set of variables, as
            # guards/preflight.launcher_error asks of a rank; MASTER_* go unused: the ranks meet through a file
            env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS),
                       LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
            with open(folder / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen([sys.executable, __file__, f"--jobs={folder / 'jobs.json'}",
                                               f"--into={folder}"], stdout=log, stderr=subprocess.STDOUT, env=env))
        failed_at = None
        try:
            while any(p.poll() is None for p in procs):
                if failed_at is None and any(p.poll() for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > GRACE:
                    for rank, p in enumerate(procs):
                        if p.poll() is None:
                            p.kill()
                            ended.add(rank)
                time.sleep(0.05)
        finally:  # Ctrl-C here, or anything else: no rank outlives the parent that started it
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return _collect(folder, jobs, [p.returncode for p in procs], ended)


def _collect(folder, jobs, codes, ended):
    """Per job: its figures from every rank's file, the line that says why there are none, or None (a
    job after the failed one: not run). ended: the ranks run_ranks killed once another had failed."""
    said, errors = {}, []
    for rank, code in enumerate(codes):
        path = folder / f"rank{rank}.json"
        said[rank] = json.loads(path.read_text()) if path.exists() else dict(done=[], error=None)
        error = said[rank]["error"]
        if code and error is None:  # it ended without its own word: its log's last line says what it could
            last = ((folder / f"rank{rank}.log").read_text().strip().splitlines() or ["nothing"])[-1][:300]
            how = f"signal {-code}" if code < 0 else f"exit status {code}"
            error = dict(job=len(said[rank]["done"]) - 1, shard=None,
                         line=f"ended by {how}" + (" once another rank had failed" if rank in ended else
                                                   f", its last line: {last}"))
        if error:
            errors.append((rank in ended, error["job"], rank, error))
    out = []
    for i, (_, shards) in enumerate(jobs):
        failed = sorted(e for e in errors if max(e[1], 0) <= i)  # a rank's own words before an ended one's
        if failed and max(failed[0][1], 0) < i:
            out.append(None)
        elif failed:
            _, _, rank, error = failed[0]
            where = f", {SHARD_NAMES.get(error['shard'], error['shard'])}" if error["shard"] else ""
            out.append(f"the sharded rows' {RANKS} processes failed: rank {rank}{where}: {error['line']}")
        else:
            out.append({shard: [said[r]["done"][i][shard] for r in range(RANKS)] for shard in shards})
    return out


CHECKED = ("parameters", "buffers", "master", "optimizer", "step_gradients", "fp8_kept", "activations")


def misses(cfg, shard, r):
    """(what of rank r's measured figures differs from its trace, in words; the trace) for cfg's job."""
    t = trace.step(replace(job_config(cfg), shard=shard), world=RANKS, rank=r["rank"])
    m = r["measured"]
    found = [f"{k} {m[k]:,} vs {t[k]:,}" for k in CHECKED if m[k] != t[k]]
    if _sent(r["calls"], shard) != _sent(t["calls"], shard):
        found.append("collectives " + ", ".join(f"{n} {k:,}" for n, _, k in r["calls"]) + " vs the trace's "
                     + ", ".join(f"{n} {k:,}" for n, _, k in t["calls"]))
    return found, t


def _sent(calls, shard):
    """The collectives as compared: each call, but DDP's, whose reducer splits its all-reduce into buckets it
    sizes itself (1 MiB first, then 25, rebuilt in backward's order): the trace states their sum (trace.DDP)."""
    if shard != "none":
        return sorted((name, numel) for name, _, numel in calls)
    totals = {}
    for name, _, numel in calls:
        totals[name] = totals.get(name, 0) + numel
    return sorted(totals.items())


def format_ranks(cfg, figures):
    """(lines, ok): each rank's states measured against that rank's trace (ledger/trace.py, a fake process
    group of RANKS), to the byte, and the collectives its step issued against the trace's."""
    mib = lambda n: f"{n / 2 ** 20:9.3f}"  # noqa: E731
    lines = [f"each rank (MiB), measured in {RANKS} gloo processes on CPU (tools/ledger_ranks.py) against its trace "
             f"under a fake process group of {RANKS} (ledger/trace.py); what a step sends (ledger/comm.py: the "
             f"paper's volume):",
             f"{'technique':14} {'rank':>4} {'parameters':>10} {'master':>9} {'AdamW':>9} {'grads@step':>10} "
             f"{'peak':>9} {'traced':>9}  {'check':6} collectives per step (volume)"]
    ok = True
    for shard, ranks in figures.items():
        for r in ranks:
            m = r["measured"]
            missed, t = misses(cfg, shard, r)
            ok = ok and not missed
            calls = ", ".join(f"{k} x{v}" for k, v in sorted(comm.kinds(r["calls"]).items()))
            lines.append(f"{SHARD_NAMES[shard]:14} {r['rank']:4d} {mib(m['parameters'])} {mib(m['master'])} "
                         f"{mib(m['optimizer'])} {mib(m['step_gradients'])} {mib(m['peak'])} {mib(t['peak'])}  "
                         f"{'MISS: ' + '; '.join(missed) if missed else 'exact':6} {calls} ({comm.volume(r['calls']):,} B, "
                         f"{comm.elements(r['calls']):,} elements)")
    lines.append("  the peaks are printed, not checked: gloo's collectives run asynchronously and hold their buffers "
                 "till they are done, which a fake process group's do not; DDP's reducer fills its buckets "
                 "(ledger/trace.DDP)")
    return lines, ok


def sharded_rows(figures):
    """The table's rows for ZeRO-1, ZeRO-2 and FSDP over RANKS, rank 0's measured figures."""
    rows = []
    for shard, ranks in figures.items():
        if shard != "none":
            m = ranks[0]["measured"]
            rows.append((f"{SHARD_NAMES[shard]} over {RANKS} (rank 0)",
                         dict(parameters=m["parameters"], buffers=m["buffers"], gradients=m["step_gradients"],
                              optimizer=m["master"] + m["optimizer"], fp8_kept=m["fp8_kept"],
                              activations=m["activations"]), "measured"))
    return rows


# ---------------------------------------------------------------- a rank

@dataclass
class RankOptions:
    jobs: str = key("", "the JSON file of jobs: [{flags: [train.py flags], shards: [SHARD values]}]")
    into: str = key("", "the folder each rank writes its rank<N>.json into (and meets the others through)")


def measure_shard(cfg, shard, rank, world):
    cfg = validate(replace(cfg, shard=shard))
    device = torch.device("cpu")
    model, parts = train.build(cfg, device)
    run_model = train.wrap_ddp(model, device) if shard == "none" else model
    if shard == "none":
        comm.Count.ddp_hook(run_model)
    batch = measure.random_batch(cfg, device)
    accumulate.accumulation_step(run_model, parts, [batch])  # AdamW's states exist from here: the steady state
    with comm.Count() as count:
        meas = measure.measure(run_model, parts, batch, device, micro_steps=cfg.accum)
    return dict(rank=rank, measured={k: meas.get(k) for k in MEASURED}, calls=count.calls)


def program(argv):
    _, opts = cli.parse_args(argv, RankOptions)
    if not (opts.jobs and opts.into and "RANK" in os.environ):
        raise UsageError("tools/ledger_ranks.py is one of the processes tools/ledger.py starts (--jobs, --into, "
                         "RANK and WORLD_SIZE); run make ledger")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jobs, out = json.loads(Path(opts.jobs).read_text()), Path(opts.into) / f"rank{rank}.json"
    done, failed = [], None

    def write():
        text = json.dumps(dict(rank=rank, done=done, error=failed))
        write_atomically(out, lambda fh: fh.write(text.encode()))
    dist.init_process_group("gloo", init_method=f"file://{Path(opts.into).resolve() / 'rendezvous'}", rank=rank,
                            world_size=world, timeout=WAIT)
    for job in jobs:
        cfg = replace(cli.parse_args(job["flags"]), device="cpu")
        done.append({})
        for shard in job["shards"]:
            try:
                done[-1][shard] = measure_shard(cfg, shard, rank, world)
            except Exception as e:  # noqa: BLE001  (a finding, in one line: the parent ends the ranks)
                failed = dict(job=len(done) - 1, shard=shard, line=in_words(e))
                write()
                return 1  # no destroy_process_group: another rank may wait for this one in a collective
            write()
    gc.collect()  # the DDP wrappers (reference cycles) freed while the process group lives, as train.py does
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(program, sys.argv[1:]))
