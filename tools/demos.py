"""Three small demonstrations of the chapter's claims, each one command.

    python tools/demos.py dtypes              (make dtypes)    the dtype table, from torch.finfo
    python tools/demos.py underflow           (make underflow) FP16 gradients lost without loss scaling
    python tools/demos.py flops [flags]       (make flops)     each recompute policy's step FLOPs

A tool, not a chapter file: it prints what precision.py and checkpoint.py implement.
"""
import copy
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's files sit one folder up

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import checkpoint  # noqa: E402
import precision  # noqa: E402
import train  # noqa: E402
from guards import cli  # noqa: E402
from config import Config, UsageError, validate  # noqa: E402
from guards.cli import given  # noqa: E402
from ledger.fits import check_fits  # noqa: E402
from data import Batches, load_tokens  # noqa: E402
from model import GPT  # noqa: E402


def format_dtype_table():
    lines = [f"{'type':9} {'bits':>4} {'exp':>3} {'mant':>4} {'max':>11} {'smallest normal':>15} {'epsilon':>10}"]
    for r in precision.dtype_table():
        lines.append(f"{r['name']:9} {r['bits']:4d} {r['exponent']:3d} {r['mantissa']:4d} {r['max']:11.4g} "
                     f"{r['smallest_normal']:15.4g} {r['eps']:10.4g}")
    return "\n".join(lines)


# ---------------------------------------------------------------- FP16 underflow

def gradient_underflow(model, x, y, dtype, loss_scale=1.0, reference=None):
    """Backward of loss * loss_scale through `model` cast to `dtype`; measure its parameter gradients.

    The metric, per gradient element whose FP32 reference gradient is non-zero: the
    16-bit gradient as stored (still scaled: that is the number that must fit in 16
    bits) is zero ("zero", it underflowed entirely) or below the dtype's smallest normal
    ("subnormal", it kept only a few significant bits). `lost` = zero + subnormal, as a
    share of those elements. Returns a dict with the shares and `overflow` (any inf/NaN).
    """
    m = copy.deepcopy(model).to(dtype)
    _, loss = m(x, y)
    (loss * loss_scale).backward()
    grads = [p.grad for p in m.parameters()]
    tiny = torch.finfo(dtype).smallest_normal
    ref = reference or [g.float() for g in grads]
    counted = zero = subnormal = 0
    for g, r in zip(grads, ref):
        live = r != 0  # exact zeros in FP32 too (e.g. embedding rows of unseen bytes) are not underflow
        counted += int(live.sum())
        zero += int((live & (g == 0)).sum())
        subnormal += int((live & (g != 0) & (g.abs() < tiny)).sum())
    overflow = not all(bool(torch.isfinite(g).all()) for g in grads)
    return dict(dtype=str(dtype).replace("torch.", ""), loss_scale=loss_scale, zero=zero / counted,
                subnormal=subnormal / counted, lost=(zero + subnormal) / counted, overflow=overflow, grads=grads)


def underflow_demo(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, seed=1337, tokens=None):
    """The same model and batch, backward in FP16 without scaling, FP16 with the dynamic
    scaler's scale, BF16 without scaling; rows for `format_underflow`.

    FP16 with dynamic scaling: the scale the scaler settles on for this batch, i.e. 2^16
    halved once per overflowing (skipped) step until the gradients are finite.
    """
    torch.manual_seed(seed)
    model = GPT(Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size))
    tokens = load_tokens("") if tokens is None else tokens
    x, y = Batches(tokens, block_size, batch_size, seed, torch.device("cpu")).next()
    ref = gradient_underflow(model, x, y, torch.float32)["grads"]
    rows = [dict(name="fp16, no scaling", **gradient_underflow(model, x, y, torch.float16, 1.0, ref))]
    scaler = precision.LossScaler("dynamic")
    while True:
        row = gradient_underflow(model, x, y, torch.float16, scaler.loss_scale, ref)
        if not row["overflow"]:
            break
        scaler.update(found_inf=True)
    rows.append(dict(name=f"fp16, dynamic scaling ({scaler.skipped_steps} skipped)", **row))
    rows.append(dict(name="bf16, no scaling", **gradient_underflow(model, x, y, torch.bfloat16, 1.0, ref)))
    for r in rows:
        del r["grads"]
    return rows


def format_underflow(rows):
    lines = ["share of gradient elements (non-zero in FP32) that are zero or subnormal in 16 bits",
             f"{'':36} {'scale':>7} {'zero':>8} {'subnormal':>10} {'lost':>8}"]
    for r in rows:
        lines.append(f"{r['name']:36} {r['loss_scale']:7g} {100 * r['zero']:7.2f}% {100 * r['subnormal']:9.2f}% "
                     f"{100 * r['lost']:7.2f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------- recompute FLOPs

COUNTED_AS = dict(precision="fp32", attn="manual", device="cpu")  # what the FLOP count sets itself
# what it reads: the model's shape, the micro-batch and the seed of the initial weights
COUNTED_KEYS = {"n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "dropout", "batch_size", "seed"}


def counted_step_flops(flags):
    """{policy: FLOPs of one forward + backward}, counted by FlopCounterMode, for train.py flags.
    FP32 and manual attention: the counter sees the attention core's matmuls as plain ops."""
    base = cli.parse_args(flags)
    fixed = given(flags) & {*COUNTED_AS, "ckpt", "ckpt_segment"}
    if fixed:
        raise UsageError(f"--{', --'.join(sorted(fixed))}: the FLOP count sets these itself (fp32, manual "
                         f"attention, CPU, every ckpt policy)")
    ignored = given(flags) - COUNTED_KEYS
    if ignored:
        raise UsageError(f"--{', --'.join(sorted(ignored))}: the FLOP count runs one forward and backward of a fresh "
                         f"model, nothing else applies (only --{', --'.join(sorted(COUNTED_KEYS))})")
    counted = {}
    for policy in checkpoint.POLICIES:  # every policy there is: a new one is counted too
        cfg = validate(replace(base, ckpt=policy, **COUNTED_AS))
        check_fits(cfg, torch.device("cpu"))  # a shape this machine cannot hold, refused in one line
        model, _ = train.build(cfg)
        x = torch.randint(0, model.cfg.vocab_size, (cfg.batch_size, cfg.block_size))
        with FlopCounterMode(display=False) as counter:
            model(x, x)[1].backward()
        counted[policy] = counter.get_total_flops()
    return counted


def format_flops(counted):
    lines = ["FLOPs of one forward + backward, counted by torch.utils.flop_counter.FlopCounterMode:"]
    for policy, n in counted.items():
        lines.append(f"  {policy:9} {n / 1e9:9.2f} GFLOP  {100 * (n / counted['none'] - 1):+6.1f}% vs none")
    return "\n".join(lines)


def program(argv):
    what, rest = (argv[0], argv[1:]) if argv else ("", [])
    if what == "dtypes" and not rest:
        print(format_dtype_table())
    elif what == "underflow" and not rest:
        print(format_underflow(underflow_demo()))
    elif what == "flops":
        print(format_flops(counted_step_flops(rest)))
    elif what in ("dtypes", "underflow"):
        raise UsageError(f"the {what} demo takes no flags, got {rest[0]}")
    else:
        raise UsageError(f"unknown demo {' '.join(argv)!r}; usage: python tools/demos.py dtypes|underflow|"
                         f"flops [--key=value ...]")


def main(argv):
    return cli.run(program, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
