"""The one config: every key of a run, its choices, its meaning, and all validation.

Chapter: none by itself; every section's switch is a key here (PRECISION, ACCUM, CKPT).
Read first: `Config` (each key with its one-line meaning), then `validate`.

Every key is a command-line flag (`--n_layer=8`) and, in capitals, a make variable (`make train
N_LAYER=8`). The chapter files read a Config, never arguments (guards/cli.py parses). Bad input
raises `UsageError`: the programs print it as one line and exit with status 2.
"""
import math
import os
import re
from dataclasses import dataclass, field, fields

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
ATTENTIONS = ("manual", "sdpa")
LOSS_NORMS = ("mean", "tokens")
DEVICES = ("auto", "cpu", "cuda")
FP8_BACKENDS = ("native", "te")
FP8_RECIPES = ("delayed", "current")
FP8_GRADS = ("bf16", "e5m2")
SHARDS = ("none", "zero1", "zero2", "fsdp")  # zero.py, fsdp.py
CKPT_IMPLS = ("hooks", "naive")  # checkpoint.IMPLEMENTATIONS


FP32_MAX = 3.4028234663852886e38  # the optimizer and the master weights compute in FP32
INT64_MAX = 2 ** 63 - 1  # torch counts and indexes in int64: the largest any int key may be


class UsageError(Exception):
    """Bad input: the programs print it as one line 'error: ...' and exit with status 2."""


class RunError(Exception):
    """A run that cannot go on (parameters gone non-finite, a full disk): one line, exit status 1.
    The last good snapshot is never overwritten."""


def key(default, meaning, choices=None, at_least=None, at_most=None):
    """A config key: its default, a one-line meaning for --help, and what values it takes."""
    return field(default=default, metadata=dict(meaning=meaning, choices=choices, at_least=at_least,
                                                at_most=at_most))


@dataclass
class Config:
    # data and output
    data: str = key("", "a text file or folder of text files; empty = this Python's standard library .py files")
    out_dir: str = key("out", "where snapshot.pt (and the tools' reports) go")
    seed: int = key(1337, "seed of the initial weights, the batches and dropout", at_least=0, at_most=2 ** 63 - 1)
    device: str = key("auto", "auto = cuda when there is one", DEVICES)
    # model (model.py)
    n_layer: int = key(4, "transformer blocks, L", at_least=1)
    n_head: int = key(4, "attention heads, a", at_least=1)
    n_embd: int = key(256, "width, h", at_least=1)
    block_size: int = key(256, "context length in tokens, s", at_least=1)
    vocab_size: int = key(256, "tokens are bytes: 256 (larger for make plan's and the ledger's shapes)", at_least=256)
    dropout: float = key(0.0, "dropout probability, in [0, 1)", at_least=0.0)
    bias: bool = key(True, "biases in Linears and LayerNorms")
    loss_chunks: int = key(1, "the loss over the rows in this many pieces, never all the FP32 logits at once "
                               "(model.ChunkedLoss); 1 = the plain loss", at_least=1)
    attn: str = key("manual", "attention core: manual (keeps the s x s softmax) or sdpa (fused)", ATTENTIONS)
    # batch and accumulation (accumulate.py)
    batch_size: int = key(8, "micro-batch: sequences per rank per micro-step", at_least=1)
    accum: int = key(1, "micro-steps per optimizer step, K", at_least=1)
    total_batch_tokens: int = key(0, "if > 0, derive accum from tokens per optimizer step", at_least=0)
    loss_norm: str = key("mean", "loss / K (mean) or weighted by each micro-batch's target tokens", LOSS_NORMS)
    no_sync: bool = key(True, "skip DDP's all-reduce on micro-steps 1..K-1")
    fp32_grad_accum: bool = key(False, "sum micro-step gradients in FP32 buffers (16-bit precisions)")
    shard: str = key("none", "under torchrun: DDP's whole copies (none), the optimizer states split over the ranks "
                             "(zero1), and the gradients (zero2), or everything by FSDP2 (fsdp)", SHARDS)
    # optimizer (precision.py's MasterWeightOptimizer)
    optimizer: str = key("adamw", "the optimizer's update rule: a spec of precision.OPTIMIZERS")
    max_iters: int = key(500, "optimizer steps to train for", at_least=1)
    learning_rate: float = key(1e-3, "peak learning rate", at_least=0.0)
    min_lr: float = key(1e-4, "learning rate at the end of the cosine decay", at_least=0.0)
    warmup_iters: int = key(20, "steps of linear warmup", at_least=0)
    lr_decay_iters: int = key(0, "step where the cosine decay ends; 0 = max_iters", at_least=0)
    weight_decay: float = key(0.1, "AdamW weight decay (matrices only)", at_least=0.0)
    beta1: float = key(0.9, "AdamW beta1, in [0, 1)", at_least=0.0)
    beta2: float = key(0.95, "AdamW beta2, in [0, 1)", at_least=0.0)
    grad_clip: float = key(1.0, "clip the gradient norm to this; 0 = off", at_least=0.0)
    # precision (precision.py, fp8.py, backends/fp8_te.py): read only by precision.decide()
    precision: str = key("bf16", "parameter/activation dtype; fp8 = bf16 with FP8 Linear matmuls", PRECISIONS)
    loss_scale: str = key("auto", "auto (dynamic for fp16, else none) | dynamic | none | a number")
    loss_scale_hysteresis: int = key(1, "the dynamic scale backs off at this many overflows (1: at the first)",
                                     at_least=1)
    loss_scale_growth: float = key(2.0, "a dynamic scale is multiplied by this after loss_scale_interval clean steps")
    loss_scale_backoff: float = key(0.5, "a dynamic scale is multiplied by this on an overflow")
    loss_scale_interval: int = key(2000, "clean steps in a row that grow a dynamic scale", at_least=1)
    fp8_backend: str = key("native", "native (ours, fp8.py) or te (Transformer Engine: backends/fp8_te.py)",
                           FP8_BACKENDS)
    fp8_recipe: str = key("delayed", "scale from an amax history (delayed) or this tensor's amax (current)",
                          FP8_RECIPES)
    fp8_amax_history: int = key(16, "amax history length of the delayed recipe", at_least=1)
    fp8_margin: int = key(0, "scale = fp8_max / amax / 2**margin (E4M3 spans about 18 binades: at most 16)",
                          at_least=0, at_most=16)
    fp8_grad: str = key("bf16", "backward in bf16 (the chapter) or gradients in FP8 E5M2 (TE's HYBRID)", FP8_GRADS)
    fp8_keep_weight: bool = key(False, "quantize each FP8 weight once per optimizer step and reuse it in micro-steps "
                                       "2..K and recompute re-runs (TE's is_first_microbatch); off: every forward")
    # activation checkpointing (checkpoint.py)
    ckpt: str = key("none", "what backward recomputes instead of keeping: a policy of checkpoint.POLICIES")
    ckpt_segment: int = key(0, "blocks per recompute unit for ckpt=sqrt; 0 = round(sqrt(n_layer))", at_least=0)
    ckpt_impl: str = key("hooks", "the recompute: hooks (saved-tensor hooks, as PyTorch's) or naive (the textbook "
                                  "autograd Function, checkpoint.NaiveRecompute)", CKPT_IMPLS)
    # compilation (train.py)
    compile: bool = key(False, "torch.compile each block on its own (build.compile_blocks); the mechanisms stay eager")
    # logging, evaluation, snapshots (train.py)
    log_interval: int = key(10, "steps between progress lines", at_least=1)
    eval_interval: int = key(100, "steps between validation losses", at_least=1)
    eval_iters: int = key(10, "batches per validation loss", at_least=1)
    snapshot_interval: int = key(0, "steps between snapshots; 0 = only at the end", at_least=0)
    resume: bool = key(False, "continue from out_dir/snapshot.pt")
    sample_tokens: int = key(200, "bytes to sample at the end; 0 = none", at_least=0)
    peak_flops: float = key(0.0, "FLOP/s for MFU; 0 = a table on CUDA, a quick measurement on CPU", at_least=0.0)
    ledger: bool = key(True, "after the first step, the memory ledger's prediction beside the allocator's figures")
    sample_only: bool = key(False, "load out_dir's snapshot, print a sample, train nothing")
    memory_snapshot: bool = key(False, "CUDA: record the allocator's history of the first steps into "
                                       "out_dir/memory_snapshot.pickle (open it at pytorch.org/memory_viz)")


# ---------------------------------------------------------------- validation

def check_keys(obj):
    """Choices and lower bounds declared with `key`, for any dataclass of keys; floats must be finite."""
    for f in fields(obj):
        value, meta = getattr(obj, f.name), f.metadata
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FP32_MAX):
            raise UsageError(f"--{f.name} must be a finite number within FP32's range, got {value}")
        if meta.get("choices") and value not in meta["choices"]:
            raise UsageError(f"--{f.name}={value} is not one of {'|'.join(meta['choices'])}")
        most = INT64_MAX if meta.get("at_most") is None and type(value) is int else meta.get("at_most")
        if meta.get("at_least") is not None and value < meta["at_least"]:
            raise UsageError(f"--{f.name} must be >= {meta['at_least']}, got {value}")
        if most is not None and value > most:
            got = f"an integer of {len(str(value))} digits" if value > INT64_MAX else value
            raise UsageError(f"--{f.name} must be <= {most}, got {got}")


def validate(cfg):
    """Raise UsageError for a config that cannot run. Everything that needs no machine is here,
    but the recompute policy's own rules, which its class holds (checkpoint.policy;
    guards/cli.parse_args asks both)."""
    check_keys(cfg)
    if not cfg.out_dir.strip():
        raise UsageError("--out_dir must name a folder (empty would write into the current folder)")
    if cfg.n_embd % cfg.n_head:
        raise UsageError(f"n_head={cfg.n_head} does not divide n_embd={cfg.n_embd}")
    if cfg.dropout >= 1.0:
        raise UsageError(f"dropout must be in [0, 1), got {cfg.dropout}")
    for name in ("beta1", "beta2"):
        if getattr(cfg, name) >= 1.0:
            index = 0 if name == "beta1" else 1
            raise UsageError(f"--{name} must be in [0, 1) (AdamW's beta parameter at index {index}), "
                             f"got {getattr(cfg, name)}")
    # AdamW's first step moves by lr / (1 - beta1) (its bias correction): FP32 must hold that number
    name, lr = max(("learning_rate", cfg.learning_rate), ("min_lr", cfg.min_lr), key=lambda k: k[1])
    if lr / (1 - cfg.beta1) > FP32_MAX:
        raise UsageError(f"--{name}={lr:g} is too large: AdamW's first step moves by lr / (1 - beta1) = "
                         f"{lr / (1 - cfg.beta1):g}, past FP32's largest number ({FP32_MAX:.6g})")
    if cfg.loss_chunks > cfg.batch_size * cfg.block_size:  # a piece of no row would be a GEMM of nothing
        raise UsageError(f"--loss_chunks={cfg.loss_chunks} is more than the {cfg.batch_size * cfg.block_size} rows "
                         f"of a micro-batch (batch_size x block_size): at most one piece per row")
    if cfg.total_batch_tokens and cfg.accum != 1:
        raise UsageError("give --accum or --total_batch_tokens (which derives accum), not both")
    if cfg.loss_scale not in ("auto", "dynamic", "none"):
        if not NUMBER[float].fullmatch(cfg.loss_scale):  # float() would take 1_000, ' 5' and other scripts' digits
            raise UsageError(f"loss_scale must be auto|dynamic|none|<number>, got {cfg.loss_scale!r}")
        value = float(cfg.loss_scale)
        # the scaled loss and its gradients are FP32 numbers: a scale out of FP32's range is inf or 0
        if not (1 / FP32_MAX <= value <= FP32_MAX):
            raise UsageError(f"a static loss_scale must be a positive number within FP32's range, "
                             f"got {cfg.loss_scale!r}")
    # a scale that grows must grow, and one that backs off must shrink; within 2^24 either way, so that a few
    # changes cannot take the scale past FP32's range (inf) or to 0 (an unscale by 1/0)
    if not 1.0 < cfg.loss_scale_growth <= 2.0 ** 24:
        raise UsageError(f"--loss_scale_growth must be in (1, 2^24], got {cfg.loss_scale_growth}")
    if not 2.0 ** -24 <= cfg.loss_scale_backoff < 1.0:
        raise UsageError(f"--loss_scale_backoff must be in [2^-24, 1), got {cfg.loss_scale_backoff}")
    check_meaningful(cfg)
    if cfg.shard == "fsdp" and cfg.precision == "fp8":
        raise UsageError("--shard=fsdp does not run precision=fp8: FP8 Linears keep whole FP8 copies and an amax "
                         "per weight, and FSDP shards the weights (use shard=none|zero1|zero2)")
    if cfg.compile and cfg.precision == "fp8":  # measured: docs/compile.md
        raise UsageError("--compile does not run precision=fp8: every hand-written FP8 Linear breaks its block's "
                         "compiled graph (31 graphs for 2 blocks where bf16 has 1, each step slower than eager)")
    if cfg.precision == "fp8":
        validate_fp8(cfg)
    return cfg


def check_meaningful(cfg):
    """Keys that would be silently ignored by this config are refused instead."""
    defaults = Config()
    if cfg.precision != "fp8":
        changed = [k for k in ("fp8_backend", "fp8_recipe", "fp8_amax_history", "fp8_margin", "fp8_grad",
                                "fp8_keep_weight")
                   if getattr(cfg, k) != getattr(defaults, k)]
        if changed:
            raise UsageError(f"--{changed[0]} applies to precision=fp8 only, this run has precision={cfg.precision}")
    dynamic = cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto" and cfg.precision == "fp16")
    for name in ("loss_scale_hysteresis", "loss_scale_growth", "loss_scale_backoff", "loss_scale_interval"):
        if getattr(cfg, name) != getattr(defaults, name) and not dynamic:
            raise UsageError(f"--{name} applies to dynamic loss scaling (fp16, or loss_scale=dynamic)")
    if cfg.fp32_grad_accum and cfg.precision == "fp32":
        raise UsageError("--fp32_grad_accum sums 16-bit gradients in FP32; with precision=fp32 they already are")
    if cfg.ckpt_impl != "hooks" and cfg.ckpt == "none":
        raise UsageError(f"--ckpt_impl={cfg.ckpt_impl} applies to a recompute policy, this run has ckpt=none")
    if cfg.ckpt_impl == "naive" and cfg.shard == "fsdp":
        raise UsageError("--ckpt_impl=naive does not run under shard=fsdp: its backward inside backward sends the "
                         "blocks' gradients around FSDP's per-block hooks (use ckpt_impl=hooks)")
    if cfg.fp32_grad_accum and cfg.shard == "fsdp":
        raise UsageError("--fp32_grad_accum does not apply to shard=fsdp: FSDP already reduces and sums the "
                         "micro-steps' gradients in FP32 (its reduce_dtype)")


def validate_fp8(cfg):
    """The FP8 GEMMs' shape rules, and the Transformer Engine settings that cannot work."""
    if cfg.n_embd % 16:
        raise UsageError(f"fp8 needs Linear dimensions divisible by 16 (an FP8 GEMM requirement), got "
                         f"n_embd={cfg.n_embd}: use an n_embd that is a multiple of 16")
    if cfg.fp8_backend != "te":
        return
    # TE's shape rule for every FP8 GEMM input: a Linear's tokens divisible by 8 (NOTES.md says where)
    tokens = cfg.batch_size * cfg.block_size
    if tokens % 8:
        raise UsageError(f"fp8_backend=te needs batch_size x block_size divisible by 8 (Transformer Engine's FP8 "
                         f"GEMM shape rule), got {cfg.batch_size} x {cfg.block_size} = {tokens}")
    if cfg.fp8_recipe == "current" and cfg.fp8_margin:
        raise UsageError("fp8_margin applies to the delayed recipe only: Transformer Engine's current "
                         "scaling has no margin; use fp8_margin=0 or fp8_recipe=delayed")


# what a value may look like: ASCII digits, no spaces, no 1_000 (Python's int() and float() accept
# all three, and digits of any script, '٥' too: [0-9] is ASCII only, \d would not be)
NUMBER = {int: re.compile(r"[+-]?[0-9]+"), float: re.compile(r"[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][+-]?[0-9]+)?")}


def world_size():
    """Processes in this run: torchrun sets WORLD_SIZE; 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", 1))
