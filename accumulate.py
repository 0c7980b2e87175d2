"""Gradient accumulation by hand: K micro-steps, one optimizer step, `no_sync` under DDP.

Chapter section 2. Read first: `accumulation_step`, then `optimizer_step`, then
`effective_batch`.

  effective batch = micro-batch x world_size x K   (sequences; x block_size for tokens)

Each micro-step runs forward and backward on one micro-batch; gradients add up in
`.grad` (or in FP32 buffers, `fp32_grad_buffers`); after K of them the optimizer steps
once. The loss is divided so that the summed gradient is the gradient of the mean loss
over the whole effective batch, exactly as if it had been one big batch.

Under DDP the first K-1 micro-steps run inside `no_sync()`, so gradients are all-reduced
once per optimizer step (one all-reduce per DDP bucket) instead of K times.
tests/test_accumulate.py checks both against a one-process big-batch run.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import fsdp as torch_fsdp

import fp8
import precision
from config import LOSS_NORMS

FSDP_MODULE = getattr(torch_fsdp, "FSDPModule", ())  # what fully_shard makes a module (torch >= 2.6; () matches none)
IGNORE_INDEX = -100  # targets equal to this carry no loss (padding); F.cross_entropy's default


@dataclass
class StepParts:
    """Everything an optimizer step uses besides the model, built once by train.build."""
    recipe: precision.Recipe  # the forward context (FP8: which weight copy, TE's autocast)
    scaler: precision.LossScaler
    optimizer: precision.MasterWeightOptimizer
    grad_buffers: list = None  # FP32 sums of the micro-steps' gradients, or None (sum in .grad)
    fp8_layers: list = ()  # fp8.layers(model): amax folded, FP8 weight copies released, once per step


def effective_batch(micro_batch, world_size, accum, block_size):
    """(sequences, tokens) that one optimizer step sees."""
    seqs = micro_batch * world_size * accum
    return seqs, seqs * block_size


def accum_from_total_tokens(total_batch_tokens, micro_batch, world_size, block_size):
    """K such that micro_batch x world_size x K x block_size == total_batch_tokens, or ValueError."""
    per_micro_step = micro_batch * world_size * block_size
    if total_batch_tokens < 1 or total_batch_tokens % per_micro_step:
        raise ValueError(f"total_batch_tokens={total_batch_tokens} is not a positive multiple of "
                         f"batch_size x world_size x block_size = {micro_batch} x {world_size} x {block_size} "
                         f"= {per_micro_step}")
    return total_batch_tokens // per_micro_step


def fp32_grad_buffers(params):
    """FP32 accumulation: the sum over micro-steps lives in FP32 buffers, so K 16-bit
    gradients are not rounded to 16 bits K times (4 bytes per parameter more)."""
    return [torch.zeros_like(p, dtype=torch.float32) for p in params if p.requires_grad]


def loss_weights(micro_batches, loss_norm, across_ranks):
    """(weights the micro-step losses are multiplied by, weights of this rank's logged mean loss).

    "mean" divides each micro-batch's mean loss by K, right when every micro-batch has the
    same number of target tokens. "tokens" weights each by its token count over the total:
    when counts differ (padding, variable lengths), dividing by K would give a token in a
    short micro-batch more weight than one in a long micro-batch."""
    K = len(micro_batches)
    if loss_norm == "mean":
        return [1.0 / K] * K, [1.0 / K] * K
    if loss_norm != "tokens":
        raise ValueError(f"loss_norm must be one of {'|'.join(LOSS_NORMS)}, got {loss_norm!r}")
    # each micro-batch's loss is a mean over its own valid tokens; times its count it
    # becomes a sum, and over the global count the step's gradient is the per-token mean
    counts = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches])
    total = counts.sum()  # int64 on the batch's device: NCCL reduces only device tensors
    world = 1
    if across_ranks:  # DDP (and ZeRO, FSDP) average over ranks (divide by world): scale by world / global count
        dist.all_reduce(total)
        world = dist.get_world_size()
    counts, total = counts.tolist(), total.item()  # one host sync for all of them
    if total == 0:
        raise ValueError("loss_norm=tokens: no target differs from IGNORE_INDEX in this optimizer step")
    return [c * world / total for c in counts], [c / max(1, sum(counts)) for c in counts]


def accumulation_step(model, parts, micro_batches, loss_norm="mean", use_no_sync=True, observe=None):
    """K forward+backward micro-steps and one optimizer step. Returns (mean loss, stepped, grad_norm).

    model: the module to call (a DistributedDataParallel wrapper under torchrun).
    parts: StepParts (recipe, loss scaler, optimizer, FP32 buffers, FP8 layers).
    micro_batches: list of K (x, y) pairs.
    observe: None, or called with "forward", "backward", "gradients" and "step" as each
      phase begins (ledger/measure.py reads memory there; training passes nothing).
    """
    observe = observe or (lambda phase: None)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    fsdp = isinstance(model, FSDP_MODULE)  # fsdp.py: sharded by fully_shard, no wrapper
    across_ranks = ddp or (dist.is_initialized() and dist.get_world_size() > 1)  # ZeRO and FSDP: no DDP wrapper
    weights, log_weights = loss_weights(micro_batches, loss_norm, across_ranks)
    buffers = parts.grad_buffers
    total_loss = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # with FP32 buffers under DDP every micro-step skips DDP's all-reduce and
        # optimizer_step all-reduces the FP32 sums (DDP can only reduce the 16-bit .grad)
        skip_sync = ddp and (buffers is not None or (use_no_sync and not last))
        if fsdp:  # FSDP2 has no no_sync(): its switch holds until set again, and sums unreduced grads in FP32
            model.set_requires_gradient_sync(not use_no_sync or last)
        # no_sync must cover the forward too: DDP decides at forward time whether this
        # backward will all-reduce, so a forward outside it would arm the all-reduce hooks
        with model.no_sync() if skip_sync else nullcontext():
            observe("forward")
            # the micro-step's index tells FP8 layers to quantize each weight once per optimizer
            # step (micro-step 0) and reuse that copy for the others (precision.Recipe.forward_context)
            with parts.recipe.forward_context(model, micro_step=i):
                loss = model(x, y)[1]  # the logits are not kept: nothing in backward needs them
            observe("backward")
            # a micro-batch with no valid tokens has a NaN mean loss but a zero gradient
            # (cross_entropy's backward writes 0 for ignored targets), and weight 0
            parts.scaler.backward(loss * weights[i])
        observe("gradients")
        if buffers is not None:  # add this micro-step's 16-bit gradients into the FP32 sums
            params = parts.optimizer.model_params
            torch._foreach_add_(buffers, [p.grad.float() for p in params])
            for p in params:
                p.grad = None
        if log_weights[i]:
            # a tensor, not .item(): on a GPU an .item() per micro-step would stall the queue
            total_loss = total_loss + loss.detach().float() * log_weights[i]
    observe("step")
    stepped, grad_norm = optimizer_step(parts, ddp, across_ranks)
    return float(total_loss), stepped, grad_norm


def optimizer_step(parts, ddp=False, across_ranks=None):
    """After the K micro-steps: the optimizer step, the loss scaler, the FP8 amax, zeroed gradients."""
    if parts.grad_buffers is not None and ddp:
        all_reduce_mean(parts.grad_buffers)
    fp8.release_weight_copies(parts.fp8_layers)  # the weights are about to change
    # the FP32 sums, or None: the parameters' .grad, which the optimizer reads (and zero.py's
    # ZeRO-2 releases as soon as it has reduce-scattered them: no list here may hold them)
    stepped, grad_norm = parts.optimizer.step(parts.grad_buffers, parts.scaler.loss_scale)
    parts.scaler.update(found_inf=not stepped)
    # the FP8 amax history moves once per optimizer step, whatever recompute re-ran
    fp8.fold_amax(parts.fp8_layers, across_ranks=ddp if across_ranks is None else across_ranks)
    parts.optimizer.zero_grad()
    if parts.grad_buffers is not None:
        torch._foreach_zero_(parts.grad_buffers)
    return stepped, grad_norm


def all_reduce_mean(tensors):
    """Average a list of tensors over ranks with one all-reduce of their flat concatenation.
    One call instead of one per tensor: per-call latency dominates for small tensors. The
    concatenation is a transient copy of all of them (DDP does the same per bucket)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch._foreach_copy_(tensors, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in tensors]), tensors)])
