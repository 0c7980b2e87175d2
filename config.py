"""The one config: every key of a run, its meaning, and the rule it must keep, declared beside it.

Chapter: none by itself; every section's switch is a key here (PRECISION, ACCUM, CKPT).
Read first: `Config` (each key with its one-line meaning and its rule), then `validate`, which asks every rule.

Every key is a command-line flag (`--n_layer=8`) and, in capitals, a make variable (`make train
N_LAYER=8`). The chapter files read a Config, never arguments (guards/cli.py parses). Bad input
raises `UsageError`: the programs print it as one line and exit with status 2.
"""
import math
import re
from dataclasses import dataclass, field, fields

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # PRECISION=auto picks one of them for the device (precision.py)
FP32_MAX = 3.4028234663852886e38  # the optimizer and the master weights compute in FP32
INT64_MAX = 2 ** 63 - 1  # torch counts and indexes in int64: the largest any int key may be
# what a number may look like: ASCII digits, no spaces, no 1_000 (Python's int() and float() take all three)
NUMBER = {int: re.compile(r"[+-]?[0-9]+"), float: re.compile(r"[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?")}


class UsageError(Exception):
    """Bad input: the programs print it as one line 'error: ...' and exit with status 2."""


class RunError(Exception):
    """A run that cannot go on (parameters gone non-finite, a full disk): one line, exit status 1.
    The last good snapshot is never overwritten."""


def key(default, meaning, choices=None, at_least=None, at_most=None, only=None, rule=None):
    """A config key: its default, a one-line meaning for --help, and its rules. only(cfg): where the key
    applies ("" where it does), for a value off its default; rule(cfg): what is wrong ("" if nothing)."""
    at_most = INT64_MAX if at_most is None and type(default) is int else at_most  # torch's ints are int64
    return field(default=default, metadata=dict(meaning=meaning, choices=choices, at_least=at_least, at_most=at_most,
                                                only=only, rule=rule))


def fp8_only(cfg):
    return cfg.precision != "fp8" and f"precision=fp8 only, this run has precision={cfg.precision}"


def dynamic_only(cfg):
    dynamic = cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto" and cfg.precision == "fp16")
    return not dynamic and "dynamic loss scaling (fp16, or loss_scale=dynamic)"


def first_step_too_large(cfg):
    # AdamW's first step moves by lr / (1 - beta1) (its bias correction): FP32 must hold that number
    name, lr = max(("learning_rate", cfg.learning_rate), ("min_lr", cfg.min_lr), key=lambda k: k[1])
    return lr / (1 - cfg.beta1) > FP32_MAX and (f"--{name}={lr:g} is too large: AdamW's first step moves by lr / "
                                               f"(1 - beta1) = {lr / (1 - cfg.beta1):g}, past FP32's largest number "
                                               f"({FP32_MAX:.6g})")


def scale_rule(cfg):
    """loss_scale: auto|dynamic|none, or a static scale within FP32's range (the scaled loss is an FP32 number)."""
    if (text := cfg.loss_scale) in ("auto", "dynamic", "none"):
        return ""
    if not NUMBER[float].fullmatch(text):  # float() would take 1_000, ' 5' and other scripts' digits
        return f"loss_scale must be auto|dynamic|none|<number>, got {text!r}"
    return not 1 / FP32_MAX <= float(text) <= FP32_MAX and \
        f"a static loss_scale must be a positive number within FP32's range, got {text!r}"


def segment_only(cfg):  # a policy's own rules are its class's (checkpoint.policy): with none, these
    return cfg.ckpt == "none" and "ckpt=sqrt only, this run has ckpt=none"


def naive_only(cfg):
    return cfg.ckpt == "none" and "a recompute policy, this run has ckpt=none"


def fp32_grad_accum_rule(cfg):
    return cfg.fp32_grad_accum and (
        cfg.precision == "fp32" and "--fp32_grad_accum sums 16-bit gradients in FP32; with precision=fp32 they already are"
        or cfg.shard == "fsdp" and "--fp32_grad_accum does not apply to shard=fsdp: FSDP already reduces and sums the "
                                   "micro-steps' gradients in FP32 (its reduce_dtype)")


@dataclass
class Config:
    # data and output
    data: str = key("", "a text file or folder of text files; empty = this Python's standard library .py files")
    out_dir: str = key("out", "where snapshot.pt (and the tools' reports) go", rule=lambda c: not c.out_dir.strip()
                       and "--out_dir must name a folder (empty would write into the current folder)")
    seed: int = key(1337, "seed of the initial weights, the batches and dropout", at_least=0)
    device: str = key("auto", "auto = cuda when there is one", ("auto", "cpu", "cuda"))
    # model (model.py)
    n_layer: int = key(4, "transformer blocks, L", at_least=1)
    n_head: int = key(4, "attention heads, a", at_least=1, rule=lambda c: c.n_embd % c.n_head
                      and f"n_head={c.n_head} does not divide n_embd={c.n_embd}")
    n_embd: int = key(256, "width, h", at_least=1)
    block_size: int = key(256, "context length in tokens, s", at_least=1)
    vocab_size: int = key(256, "tokens are bytes: 256 (larger for make plan's and the ledger's shapes)", at_least=256)
    dropout: float = key(0.0, "dropout probability, in [0, 1)", at_least=0.0, rule=lambda c: c.dropout >= 1
                         and f"dropout must be in [0, 1), got {c.dropout}")
    bias: bool = key(True, "biases in Linears and LayerNorms")
    # the loss in pieces (model.ChunkedLoss): a piece of no row would be a GEMM of nothing
    loss_chunks: int = key(1, "the loss in this many pieces of rows; 1 = the plain loss", at_least=1, rule=lambda c:
                           c.loss_chunks > c.batch_size * c.block_size and f"--loss_chunks={c.loss_chunks} is more "
                           f"than the {c.batch_size * c.block_size} rows of a micro-batch (batch_size x block_size): "
                           f"at most one piece per row")
    attn: str = key("manual", "attention core: manual (keeps the s x s softmax) or sdpa (fused)", ("manual", "sdpa"))
    # batch and accumulation (accumulate.py); past 2^24 micro-steps, each 1/K of the sum adds nothing in FP32
    batch_size: int = key(8, "micro-batch: sequences per rank per micro-step", at_least=1)
    accum: int = key(1, "micro-steps per optimizer step, K", at_least=1, at_most=2 ** 24)
    total_batch_tokens: int = key(0, "if > 0, accum from the tokens per step", at_least=0, rule=lambda c:
                                  c.total_batch_tokens and c.accum != 1 and "give --accum or --total_batch_tokens "
                                                                            "(which derives accum), not both")
    loss_norm: str = key("mean", "loss / K (mean), or each micro-batch's by its target tokens", ("mean", "tokens"))
    no_sync: bool = key(True, "skip DDP's all-reduce on micro-steps 1..K-1")
    fp32_grad_accum: bool = key(False, "sum micro-step gradients in FP32 buffers (16-bit)", rule=fp32_grad_accum_rule)
    # under torchrun: DDP's whole copies (none), the optimizer states split over the ranks (zero1), and the
    # gradients (zero2), or everything by FSDP2 (fsdp)
    shard: str = key("none", "what the ranks split", ("none", "zero1", "zero2", "fsdp"), rule=lambda c: c.shard == "fsdp"
                     and c.precision == "fp8"
                     and "--shard=fsdp does not run precision=fp8: FP8 Linears keep whole FP8 copies and an amax per "
                         "weight, and FSDP shards the weights (use shard=none|zero1|zero2)")
    # optimizer (precision.py's MasterWeightOptimizer)
    optimizer: str = key("adamw", "the optimizer's update rule: a spec of precision.OPTIMIZERS")
    beta1: float = key(0.9, "AdamW beta1, in [0, 1)", at_least=0.0, rule=lambda c: c.beta1 >= 1
                       and f"--beta1 must be in [0, 1) (AdamW's beta parameter at index 0), got {c.beta1}")
    beta2: float = key(0.95, "AdamW beta2, in [0, 1)", at_least=0.0, rule=lambda c: c.beta2 >= 1
                       and f"--beta2 must be in [0, 1) (AdamW's beta parameter at index 1), got {c.beta2}")
    max_iters: int = key(500, "optimizer steps to train for", at_least=1)
    learning_rate: float = key(1e-3, "peak learning rate", at_least=0.0)
    min_lr: float = key(1e-4, "learning rate at the end of the cosine decay", at_least=0.0, rule=first_step_too_large)
    warmup_iters: int = key(20, "steps of linear warmup", at_least=0)
    lr_decay_iters: int = key(0, "step where the cosine decay ends; 0 = max_iters", at_least=0)
    weight_decay: float = key(0.1, "AdamW weight decay (matrices only)", at_least=0.0)
    grad_clip: float = key(1.0, "clip the gradient norm to this; 0 = off", at_least=0.0)
    # precision (precision.py, fp8.py, backends/fp8_te.py): read only by precision.decide(); auto is what the
    # device computes natively: bf16, else fp32 on a CPU and fp16 (with the dynamic loss scaler) on a GPU
    precision: str = key("auto", "parameter/activation dtype; fp8 = bf16 with FP8 Linear matmuls", ("auto", *PRECISIONS))
    loss_scale: str = key("auto", "auto (dynamic for fp16, else none)|dynamic|none|a number", rule=scale_rule)
    # a dynamic scale within 2^24 either way: a few changes cannot take it past FP32's range (inf) or to 0
    loss_scale_hysteresis: int = key(1, "the dynamic scale backs off at this many overflows", at_least=1, only=dynamic_only)
    loss_scale_growth: float = key(2.0, "its factor after loss_scale_interval clean steps", only=dynamic_only,
                                   rule=lambda c: not 1.0 < c.loss_scale_growth <= 2.0 ** 24
                                   and f"--loss_scale_growth must be in (1, 2^24], got {c.loss_scale_growth}")
    loss_scale_backoff: float = key(0.5, "its factor on an overflow", only=dynamic_only, rule=lambda c: not
                                    2.0 ** -24 <= c.loss_scale_backoff < 1.0
                                    and f"--loss_scale_backoff must be in [2^-24, 1), got {c.loss_scale_backoff}")
    loss_scale_interval: int = key(2000, "clean steps in a row that grow a dynamic scale", at_least=1, only=dynamic_only)
    # FP8 (Transformer Engine's shape rule: NOTES.md)
    fp8_backend: str = key("native", "native (fp8.py) or te (Transformer Engine)", ("native", "te"), only=fp8_only, rule=(
        lambda c: c.fp8_backend == "te" and c.batch_size * c.block_size % 8 and f"fp8_backend=te needs batch_size x "
        f"block_size divisible by 8 (Transformer Engine's FP8 GEMM shape rule), got {c.batch_size} x {c.block_size} = "
        f"{c.batch_size * c.block_size}"))
    fp8_recipe: str = key("delayed", "scale by an amax history, or this tensor's", ("delayed", "current"), only=fp8_only)
    fp8_amax_history: int = key(16, "amax history length of the delayed recipe", at_least=1, only=fp8_only)
    # E4M3 spans about 18 binades: a margin of at most 16
    fp8_margin: int = key(0, "scale = fp8_max / amax / 2**margin", at_least=0, at_most=16, only=fp8_only, rule=(
        lambda c: c.fp8_backend == "te" and c.fp8_recipe == "current" and c.fp8_margin and "fp8_margin applies to the "
        "delayed recipe only: Transformer Engine's current scaling has no margin; use fp8_margin=0 or "
        "fp8_recipe=delayed"))
    fp8_grad: str = key("bf16", "backward in bf16 (the chapter), or E5M2 (TE's HYBRID)", ("bf16", "e5m2"), only=fp8_only)
    # TE's is_first_microbatch: W quantized once per optimizer step, reused by micro-steps 2..K and re-runs
    fp8_keep_weight: bool = key(False, "quantize each FP8 weight once per optimizer step", only=fp8_only)
    # activation checkpointing (checkpoint.py: the policies' own rules, checked by its `policy`)
    ckpt: str = key("none", "what backward recomputes instead of keeping: a policy of checkpoint.POLICIES")
    ckpt_segment: int = key(0, "blocks a unit for ckpt=sqrt; 0 = round(sqrt(n_layer))", at_least=0, only=segment_only)
    # hooks: saved-tensor hooks, as PyTorch's; naive: the textbook autograd Function, checkpoint.NaiveRecompute
    ckpt_impl: str = key("hooks", "the recompute: hooks or naive", ("hooks", "naive"), only=naive_only, rule=(
        lambda c: c.ckpt_impl == "naive" and c.shard == "fsdp" and "--ckpt_impl=naive does not run under shard=fsdp: "
        "its backward inside backward sends the blocks' gradients around FSDP's per-block hooks (use ckpt_impl=hooks)"))
    # compilation (build.py); with FP8: measured, docs/compile.md
    compile: bool = key(False, "torch.compile each block; the mechanisms stay eager", rule=lambda c: c.compile
                        and c.precision == "fp8" and "--compile does not run precision=fp8: "
                        "every hand-written FP8 Linear breaks its block's compiled graph (31 graphs for 2 blocks "
                        "where bf16 has 1, each step slower than eager)")
    # logging, evaluation, snapshots (train.py)
    log_interval: int = key(10, "steps between progress lines", at_least=1)
    eval_interval: int = key(100, "steps between validation losses", at_least=1)
    eval_iters: int = key(10, "batches per validation loss", at_least=1)
    snapshot_interval: int = key(0, "steps between snapshots; 0 = only at the end", at_least=0)
    resume: bool = key(False, "continue from out_dir/snapshot.pt, with its config and the flags given now")
    sample_tokens: int = key(0, "bytes to sample at the end; 0 = none (`make sample` prints one later)", at_least=0)
    peak_flops: float = key(0.0, "FLOP/s for MFU; 0 = a table on CUDA, measured on CPU", at_least=0.0)
    ledger: bool = key(True, "CUDA: after the first step, the memory ledger's prediction beside the allocator's")
    sample_only: bool = key(False, "load out_dir's snapshot, print a sample, train nothing")
    # open it at pytorch.org/memory_viz
    memory_snapshot: bool = key(False, "CUDA: the allocator's history of the first steps, in out_dir")


def choices(name):
    """A key's choices (the tools go through them: the plan tries every attention and sharding)."""
    return next(f.metadata["choices"] for f in fields(Config) if f.name == name)


def validate(cfg):
    """cfg, or UsageError for the first key that breaks its rules: any dataclass of keys (a tool's options too).
    First every key alone (floats finite and within FP32's range, ints within int64, choices, bounds), then
    each key's rule over the others. The recompute policy's own rules are its class's (checkpoint.policy), the
    optimizer's name precision.OPTIMIZERS' (guards/cli.parse_args asks both)."""
    for f in fields(cfg):
        value, meta = getattr(cfg, f.name), f.metadata
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FP32_MAX):
            raise UsageError(f"--{f.name} must be a finite number within FP32's range, got {value}")
        if meta.get("choices") and value not in meta["choices"]:
            raise UsageError(f"--{f.name}={value} is not one of {'|'.join(meta['choices'])}")
        if meta.get("at_least") is not None and value < meta["at_least"]:
            raise UsageError(f"--{f.name} must be >= {meta['at_least']}, got {value}")
        if meta.get("at_most") is not None and value > meta["at_most"]:
            got = f"an integer of {len(str(value))} digits" if value > INT64_MAX else value
            raise UsageError(f"--{f.name} must be <= {meta['at_most']}, got {got}")
    for f in fields(cfg):
        only, rule = f.metadata.get("only"), f.metadata.get("rule")
        if only and getattr(cfg, f.name) != f.default and (where := only(cfg)):
            raise UsageError(f"--{f.name} applies to {where}")
        if rule and (why := rule(cfg)):
            raise UsageError(why)
    return cfg

