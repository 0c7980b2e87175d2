"""Gradient accumulation by hand: K micro-steps, one optimizer step, `no_sync` under DDP.

Chapter section 2. Read first: `accumulation_step` (nanoGPT's micro-step loop, written out),
then `optimizer_step`, then `effective_batch`. Two refinements follow them: the loss weighted
by token counts (`token_weights`), and the micro-steps' gradients summed in FP32 (`fp32_grad_buffers`).

  effective batch = micro-batch x world_size x K   (sequences; x block_size for tokens)

Each micro-step's loss is divided by K, so the K gradients summed in .grad are the gradient of
the mean loss over the effective batch, as one big batch gives (tests/test_accumulate.py).
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

import precision
from config import UsageError
from model import IGNORE_INDEX



@dataclass
class StepParts:
    """Everything an optimizer step uses besides the model, built once by train.build."""
    precision: precision.Precision  # the forward context (FP8: which weight copy, TE's autocast)
    scaler: precision.LossScaler  # FP16's, or None: BF16 and FP32 need no loss scaling
    optimizer: precision.MasterWeightOptimizer
    grad_buffers: list = None  # fp32_grad_buffers, or None: the sum lives in .grad
    fp8_layers: list = ()  # fp8.layers(model): amax folded, weight copies released, once per step


def accumulation_step(model, parts, micro_batches, loss_norm="mean", use_no_sync=True):
    """K forward+backward micro-steps, then one optimizer step. Returns (mean loss, stepped, grad_norm).
    model: what to call (DDP's wrapper under torchrun); micro_batches: K (x, y) pairs, or K draws (functions
    that make one when called: Batches.micro_batches)."""
    K = len(micro_batches)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    across_ranks = dist.is_initialized() and dist.get_world_size() > 1
    if loss_norm == "mean":
        weights = log_weights = [1 / K] * K  # the loss / K
    else:
        weights, log_weights = token_weights(micro_batches, loss_norm, across_ranks)
    total_loss = 0.0
    for i, micro_batch in enumerate(micro_batches):
        x, y = micro_batch() if callable(micro_batch) else micro_batch
        # the sync rule: reduce once, in the last micro-step's backward (FP32 sums: in optimizer_step). DDP's
        # no_sync covers the forward too (DDP arms its all-reduce there); FSDP2's is a flag; ZeRO reduces in its step
        sync = (i == K - 1 or not use_no_sync) and parts.grad_buffers is None
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2's model
            model.set_requires_gradient_sync(sync)
        with model.no_sync() if ddp and not sync else nullcontext():
            with parts.precision.forward_context(model, micro_step=i):  # FP8_KEEP_WEIGHT: W quantized at micro-step 0 only
                loss = model(x, y)[1]
            # the gradients add up in .grad; FP16 scales the loss up first, so small gradients stay in range
            parts.scaler.backward(loss * weights[i]) if parts.scaler else (loss * weights[i]).backward()
        if parts.grad_buffers is not None:
            add_to_fp32_sums(parts)
        if log_weights[i]:  # a tensor, not .item(): on a GPU that would stall the queue each micro-step
            total_loss = total_loss + loss.detach().float() * log_weights[i]
    stepped, grad_norm = optimizer_step(parts, ddp, across_ranks)
    return precision.host_value(total_loss, assumed=float("nan")), stepped, grad_norm


def optimizer_step(parts, ddp=False, across_ranks=False):
    """After the K micro-steps: the optimizer step, the loss scaler, the FP8 amax, zeroed gradients."""
    if parts.grad_buffers is not None and ddp:
        all_reduce_mean(parts.grad_buffers)  # DDP reduces only .grad: the FP32 sums go here
    if parts.fp8_layers:
        import fp8
        fp8.release_weight_copies(parts.fp8_layers)  # the weights are about to change
    if parts.scaler:  # FP16: the gradients unscaled, then the scale backs off or grows
        stepped, grad_norm = parts.scaler.step(parts.optimizer, parts.grad_buffers)
    else:
        stepped, grad_norm = parts.optimizer.step(parts.grad_buffers)  # skipped on inf/NaN
    if parts.fp8_layers:
        fp8.fold_amax(parts.fp8_layers, across_ranks)  # the amax history moves once per optimizer step
    parts.optimizer.zero_grad()
    if parts.grad_buffers is not None:
        torch._foreach_zero_(parts.grad_buffers)
    return stepped, grad_norm


def effective_batch(micro_batch, world_size, accum, block_size):
    """(sequences, tokens) that one optimizer step sees."""
    seqs = micro_batch * world_size * accum
    return seqs, seqs * block_size


def micro_steps(cfg, world_size, memory_available):
    """K, from --accum (at most 2^24: config.py) or --total_batch_tokens; refused where a step cannot finish."""
    if not cfg.total_batch_tokens and cfg.loss_norm == "mean":
        return cfg.accum
    accum, source = cfg.accum, f"accum={cfg.accum}"
    if cfg.total_batch_tokens:
        try:
            accum = accum_from_total_tokens(cfg.total_batch_tokens, cfg.batch_size, world_size, cfg.block_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        source = f"total_batch_tokens={cfg.total_batch_tokens} is accum={accum}"
    # K micro-step gradients, each 1/K of the step's, add up in FP32 at best (a 24-bit significand):
    # past 2^24 micro-steps each one is below half an FP32 ulp of the sum and adds nothing
    if accum > 2 ** 24:
        raise UsageError(f"{source} micro-steps per optimizer step: past 2^24 = {2 ** 24:,} a micro-step's "
                         f"gradient (1/K of the sum) is below half an FP32 ulp of the sum and adds nothing; "
                         f"use a larger --batch_size or fewer tokens per step")
    # loss_norm=tokens holds every micro-batch (x and y, int64) of a step at once (mean: drawn as used)
    held = accum * (16 * cfg.batch_size * cfg.block_size + 616)
    if cfg.loss_norm == "tokens" and held > memory_available // 2:
        raise UsageError(f"{source} micro-steps per optimizer step hold {held / 2**30:.1f} GiB at once, more than "
                         f"half the {memory_available / 2**30:.1f} GiB of memory available; loss_norm=mean draws "
                         f"micro-batches as used")
    return accum


# ---------------------------------------------------------------- refinements

def token_weights(micro_batches, loss_norm, across_ranks):
    """(loss weights, weights of this rank's logged mean) by target tokens (LOSS_NORM=tokens): when
    micro-batches hold different numbers of tokens (padding), / K would weigh a token of a short one
    more than a token of a long one."""
    if loss_norm != "tokens":
        raise ValueError(f"loss_norm must be one of mean|tokens, got {loss_norm!r}")
    counts = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches])
    total, world = counts.sum(), 1  # int64 on the batch's device: NCCL reduces device tensors only
    if across_ranks:  # DDP, ZeRO and FSDP average over the ranks: scale by world / the global count
        dist.all_reduce(total)
        world = dist.get_world_size()
    counts, total = counts.tolist(), total.item()  # one host sync for all of them
    if total == 0:
        raise ValueError("loss_norm=tokens: no target differs from IGNORE_INDEX in this optimizer step")
    return [c * world / total for c in counts], [c / max(1, sum(counts)) for c in counts]


def fp32_grad_buffers(params):
    """FP32_GRAD_ACCUM: the micro-steps' gradients summed in FP32 buffers (4 bytes per parameter more),
    so K 16-bit gradients are not rounded to 16 bits K times."""
    return [torch.zeros_like(p, dtype=torch.float32) for p in params if p.requires_grad]


def add_to_fp32_sums(parts):
    """This micro-step's 16-bit .grad into the FP32 sums, then freed."""
    params = parts.optimizer.model_params
    torch._foreach_add_(parts.grad_buffers, [p.grad.float() for p in params])
    for p in params:
        p.grad = None


def accum_from_total_tokens(total_batch_tokens, micro_batch, world_size, block_size):
    """K such that micro_batch x world_size x K x block_size == total_batch_tokens, or ValueError."""
    per_micro_step = micro_batch * world_size * block_size
    if total_batch_tokens < 1 or total_batch_tokens % per_micro_step:
        raise ValueError(f"total_batch_tokens={total_batch_tokens} is not a positive multiple of "
                         f"batch_size x world_size x block_size = {micro_batch} x {world_size} x {block_size} "
                         f"= {per_micro_step}")
    return total_batch_tokens // per_micro_step


def all_reduce_mean(tensors):
    """Average tensors over the ranks in one all-reduce of their flat concatenation (a transient copy,
    as DDP's buckets are): per-call latency dominates for small tensors."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch._foreach_copy_(tensors, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in tensors]), tensors)])
