"""`make ledger` (tools/ledger.py): the report, the published figures alone, the exit status, bad input."""
import xml.etree.ElementTree as ET

import pytest

import memory_ledger as ml
import model
import train
from config import RunError
from guards.cli import parse_args
from ledger import trace
from tools import ledger as tool
from tools import ledger_report

TINY = ["--n_layer=2", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=2", "--seed=3"]
READS_THE_PAPERS = ("test_cli_prints_table_and_writes_svg", "test_papers_only_builds_nothing",
                    "test_a_section_that_cannot_run_says_why_and_the_report_goes_on")


@pytest.fixture(autouse=True)
def papers_stubbed(request, monkeypatch):
    """The published figures trace the papers' shapes: the tests above read them (once), the others a stub."""
    if request.node.originalname not in READS_THE_PAPERS:
        monkeypatch.setattr(tool, "papers_text", lambda: ("the published figures: not run by this test", True))


def test_cli_prints_table_and_writes_svg(tmp_path, capsys):
    rc = tool.main(TINY + ["--precision=bf16", "--ckpt=full", f"--out_dir={tmp_path}", "--ranks=4", "--pp=2"])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("FP32 baseline", "BF16 mixed precision", "FSDP (ZeRO-3) over 4 (rank 0)", "tensor parallel", "CPU offload",
                 "selective checkpointing", "pipeline p=2, first stage", "pipeline p=2, last stage", "make plan N_LAYER=32",
                 "published figure vs ours", "Table 2: TP t=8 + SP + selective", "ZeRO Table 1: P_os+g+p"):
        assert name in out, name
    assert "buffers" in out.splitlines()[3] and "rng_states" in out and "UNEXPLAINED" not in out
    assert "measured" in out and "formula" in out
    root = ET.parse(tmp_path / "memory_ledger.svg").getroot()
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect")]
    table = out.split("four components x techniques", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    n_rows = sum(1 for line in table if line.endswith(("measured", "formula", "traced")))
    keys = len(ledger_report.KEYS)
    assert len(rects) == keys + keys * n_rows  # legend + six stacked components per technique (KEYS)
    assert not list(tmp_path.glob("*.partial-memtrain-*"))
    # make gpu-check's summary reads the comparison this run wrote (tools/gpu_check.py)
    from tools import gpu_check
    summary = gpu_check.ledger_figures(tmp_path / "memory_ledger.json")
    assert summary[0] == "| component | traced | measured | check |" and "| peak |" in "\n".join(summary), summary


def test_fp8_row_is_measured_here(tmp_path, capsys):
    assert tool.main(TINY + ["--precision=bf16", f"--out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("FP8 (native) ")).endswith("measured")


def test_papers_only_builds_nothing(monkeypatch, capsys):
    def refuse(*args, **kw):
        raise AssertionError("--papers_only must not build a model")
    monkeypatch.setattr(train, "build", refuse)
    assert tool.main(["--papers_only"]) == 0  # (the traces of the test above)
    assert tool.main(["--papers_only", "--ranks=4"]) == 2  # the papers' own sizes: none of the ledger's applies
    out = capsys.readouterr().out
    assert "published figure vs ours" in out and "component" not in out and "make plan" in out


def test_help_says_how_to_print_the_published_figures_alone(capsys):
    assert tool.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--papers_only" in out and "make ledger ARGS=--papers_only" in out


@pytest.mark.parametrize("component", ["activations", "peak"])
def test_cli_exits_1_when_a_check_misses(tmp_path, monkeypatch, capsys, component):
    """One byte off, in the activations or the peak, is a miss on CPU: exit status 1, the component named."""
    real = trace.step
    monkeypatch.setattr(trace, "step", lambda cfg, *args, **kwargs: {**real(cfg, *args, **kwargs),
                                                                     component: real(cfg, *args, **kwargs)[component] + 1})
    assert tool.main(TINY + ["--precision=fp32", f"--out_dir={tmp_path}", "--table=formula"]) == 1
    missed = [line for line in capsys.readouterr().out.splitlines() if "MISS" in line]
    assert [line.split()[0] for line in missed] == [component], f"the misses: {missed}"


@pytest.mark.parametrize("argv,needle", [(["--n_layer=-1"], "n_layer"), (["--n_embd=32", "--n_head=3"], "divide"),
                                         (["--batch_size=0"], "batch_size"), (["--ranks=0"], "ranks"),
                                         (["--tp=x"], "integer"), (["--precision=fp8", "--fp8_backend=te"], "native"),
                                         (["--papers_only=maybe"], "papers_only"),
                                         (["--precision=bf16", "--fp8_amax_history=0"], "fp8_amax_history")])
def test_bad_config_exits_2(argv, needle, capsys):
    assert tool.main(argv) == 2  # in-process: tools/ledger.py's main is what its command line runs
    out, err = capsys.readouterr()
    assert err.startswith("error:") and needle in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_table_has_both_fp8_rows_and_an_fp8_key_needs_fp8(tmp_path, capsys):
    # a bf16 run's table still has its FP8 rows (native measured, TE a formula) ...
    rc = tool.main(TINY + ["--precision=bf16", "--accum=2", f"--out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "FP8 (native)" in out and "FP8 (Transformer Engine)" in out and "K=2 (micro-b 1)" in out
    # ... and an fp8_* key given with another precision would be ignored: refused instead
    assert tool.main(TINY + ["--precision=bf16", "--fp8_backend=te", f"--out_dir={tmp_path / 'o'}"]) == 2
    assert "applies to precision=fp8 only" in capsys.readouterr().err


# ---------------------------------------------------------------- every precision's ledger passes (issue 27)

SDPA = ["--n_layer=1", "--n_embd=16", "--n_head=1", "--block_size=16", "--batch_size=1", "--attn=sdpa", "--seed=3"]
PRECISIONS = [(name, shape, precision) for name, shape in (("tiny", TINY), ("sdpa", SDPA))
              for precision in ("fp32", "bf16", "fp16", "fp8")] + [("pieces", TINY + ["--loss_chunks=3"], "fp16")]


@pytest.fixture(scope="module")
def ranks_measured():
    """The sharded rows of every config below measured in one start of the ranks (a start costs seconds):
    tools/ledger.py finds them measured."""
    tool.measure_ranks_many([parse_args(shape + [f"--precision={precision}"]) for _, shape, precision in PRECISIONS])


@pytest.mark.parametrize("name,shape,precision", PRECISIONS, ids=[f"{n}-{p}" for n, _, p in PRECISIONS])
def test_every_precisions_ledger_passes(ranks_measured, name, shape, precision, tmp_path, capsys, monkeypatch):
    """`make ledger` end to end, every section (the sharded rows' collectives included: FP8's amax
    all-reduce is in each rank's trace), exit status 0. The published figures are the same for every
    config (test_cli_prints_table_and_writes_svg prints them)."""
    rc = tool.main(shape + [f"--precision={precision}", f"--out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    missed = [line for line in out.splitlines() if any(word in line for word in ("MISS", "skipped", "DIFFERENT",
                                                                                 "UNEXPLAINED", "unexplained"))]
    assert rc == 0 and err == "" and not missed, f"{name}, {precision}: exit status {rc}; what missed:\n" + \
        "\n".join(missed) + f"\n{err}"
    assert "each rank (MiB), measured in" in out and "FP8 (native)" in out


# ---------------------------------------------------------------- the ledger always answers (issue 27)

def test_a_section_that_cannot_run_says_why_and_the_report_goes_on(monkeypatch, tmp_path, capsys):
    """A table row, the ranks' processes and the published figures each fail here: each says why in one line,
    every other section is printed, exit status 1, no traceback."""
    real = tool.run_config

    def failing_under_full(cfg, device):
        if cfg.ckpt == "full":
            raise AttributeError("'MLP' object has no attribute 'c_proj'")
        return real(cfg, device)
    monkeypatch.setattr(tool, "run_config", failing_under_full)

    def ranks_fail(cfg):
        raise RunError("the sharded rows' 2 processes failed: rank 1, ZeRO-1: TypeError: a learner's optimizer")
    monkeypatch.setattr(tool, "measure_ranks", ranks_fail)
    monkeypatch.setattr(tool, "papers_text", lambda: 1 / 0)
    rc = tool.main(TINY + ["--precision=bf16", f"--out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    said = ["  full checkpointing: skipped: AttributeError: 'MLP' object has no attribute 'c_proj' (tests/",
            f"  ZeRO-1, ZeRO-2 and FSDP over {tool.RANKS}: skipped: their processes failed (below)",
            "each rank's states under DDP, ZeRO and FSDP: skipped: the sharded rows' 2 processes failed: rank 1, "
            "ZeRO-1: TypeError: a learner's optimizer",
            "the published figures: skipped: ZeroDivisionError: division by zero (tests/"]
    unsaid = [line for line in said if not any(printed.startswith(line) for printed in lines)]
    assert rc == 1 and err == "ledger: some check missed\n" and not unsaid, \
        f"exit status {rc}, stderr {err!r}; not said:\n" + "\n".join(unsaid) + "\n" + out
    assert "Traceback" not in out and lines[11].startswith("peak ") and "sqrt checkpointing" in out


def test_a_model_the_trace_cannot_run_leaves_the_measurement(monkeypatch, tmp_path, capsys):
    """A learner's model.py that reads a tensor's value (.item(): fake tensors have none) runs for real but
    not on fake tensors: the measured components are printed with the trace's failure in one line and what
    it means, exit status 1, no traceback."""
    forward = model.MLP.forward

    def reading_a_value(self, x):
        out = forward(self, x)
        return out * 0.5 if out.abs().max().item() > 1e9 else out  # a value-dependent branch
    monkeypatch.setattr(model.MLP, "forward", reading_a_value)
    rc = tool.main(TINY + ["--precision=bf16", "--table=formula", f"--out_dir={tmp_path}"])
    out, err = capsys.readouterr()
    assert rc == 1 and err == "ledger: the trace failed (named above)\n" and "Traceback" not in out, out + err
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["component", "measured"] and lines[2].split()[0] == "parameters", out
    assert any(line.startswith("the trace (ledger/trace.py: model.py on fake tensors) failed:") and
               "test_memory_cli.py:" in line for line in lines), out


def test_ddps_buckets_are_compared_by_their_sum_the_others_call_by_call():
    # DDP's reducer splits the all-reduce the trace states as one call (1 MiB first, then 25 MiB buckets)
    from tools.ledger_ranks import _sent
    traced = [("all_reduce", 13_162_496, 3_290_624)]
    bucketed = [("all_reduce", 2_104_320, 526_080), ("all_reduce", 11_058_176, 2_764_544)]
    assert _sent(bucketed, "none") == _sent(traced, "none"), "DDP's two buckets against the trace's one all-reduce"
    assert _sent(bucketed[:1], "none") != _sent(traced, "none"), "a bucket missing must be a miss"
    assert _sent(bucketed, "zero1") != _sent(traced, "zero1"), "ZeRO's calls are its own: compared call by call"
    assert _sent(bucketed[::-1], "zero1") == _sent(bucketed, "zero1"), "in any order"


def test_the_ranks_say_their_own_failure_in_one_line():
    """A rank's failure travels in its own file, as its figures do (tools/ledger_ranks.py): the parent
    says which rank, under which SHARD, what and where, in one line; no launcher's words."""
    from tools import ledger_ranks
    flags, _ = ledger_ranks.job_of(parse_args(SDPA))
    said, = ledger_ranks.run_ranks([(flags, ("none", "bogus"))])
    assert said.startswith(f"the sharded rows' {ledger_ranks.RANKS} processes failed: rank ") and \
        ", bogus: UsageError: --shard=bogus is not one of none|zero1|zero2|fsdp (config.py:" in said and \
        "\n" not in said, said


def test_the_ranks_job_parses_for_every_recompute_implementation():
    """The ranks measure the states with ckpt=none, where ckpt_impl=naive is refused: it is left out."""
    from dataclasses import replace
    from tools import ledger_ranks
    for impl in ("hooks", "naive"):
        flags, _ = ledger_ranks.job_of(replace(parse_args(SDPA + ["--ckpt=full", f"--ckpt_impl={impl}"]), ckpt="none"))
        parse_args(list(flags))  # raises UsageError where the ranks would refuse it
