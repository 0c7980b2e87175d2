"""Gradient accumulation by hand: K micro-steps, one optimizer step, `no_sync` under DDP.

Chapter section 2. Read first: `accumulation_step`, then `effective_batch`.

  effective batch = micro-batch x world_size x K   (sequences; x block_size for tokens)

Each micro-step runs forward and backward on one micro-batch; gradients add up in
`.grad` (or in FP32 buffers, see precision.py); after K of them the optimizer steps
once. The loss is divided so that the summed gradient is the gradient of the mean loss
over the whole effective batch, exactly as if it had been one big batch.

Under DDP the first K-1 micro-steps run inside `no_sync()`, so gradients are all-reduced
once per optimizer step (one all-reduce per DDP bucket) instead of K times.
tests/test_accumulate.py checks both against a one-process big-batch run.
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist

LOSS_NORMS = ("mean", "tokens")
IGNORE_INDEX = -100  # targets equal to this carry no loss (padding); F.cross_entropy's default


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


def accumulation_step(model, optimizer, micro_batches, loss_norm="mean", use_no_sync=True):
    """K forward+backward micro-steps and one optimizer step. Returns (mean loss, stepped, grad_norm).

    model: the module to call (a DistributedDataParallel wrapper under torchrun).
    optimizer: precision.MasterWeightOptimizer (master weights, loss scaler).
    micro_batches: list of K (x, y) pairs.
    loss_norm: "mean" divides each micro-batch's mean loss by K, right when every micro-batch
      has the same number of target tokens. "tokens" weights each by its token count over
      the total: when counts differ (padding, variable lengths), dividing by K would give a
      token in a short micro-batch more weight than one in a long micro-batch.
    """
    K = len(micro_batches)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if loss_norm == "tokens":
        # each micro-batch's loss is a mean over its own valid tokens; times its count it
        # becomes a sum, and over the global count the step's gradient is the per-token mean
        counts = torch.stack([(y != IGNORE_INDEX).sum() for _, y in micro_batches])
        total = counts.sum()  # int64 on the batch's device: NCCL reduces only device tensors
        world = 1
        if ddp:  # DDP averages over ranks (divides by world), so scale by world / global count
            dist.all_reduce(total)
            world = dist.get_world_size()
        counts, total = counts.tolist(), total.item()  # one host sync for all of them
        if total == 0:
            raise ValueError("loss_norm=tokens: no target differs from IGNORE_INDEX in this optimizer step")
        weights = [c * world / total for c in counts]
        log_weights = [c / max(1, sum(counts)) for c in counts]  # this rank's token mean, for the log
    elif loss_norm == "mean":
        weights = log_weights = [1.0 / K] * K
    else:
        raise ValueError(f"loss_norm must be one of {'|'.join(LOSS_NORMS)}, got {loss_norm!r}")
    # with FP32 accumulation under DDP every micro-step skips DDP's all-reduce and we
    # all-reduce the FP32 sums ourselves at the end (DDP can only reduce the 16-bit .grad)
    fp32_buffers = optimizer.fp32_grad_accum
    total_loss = 0.0
    for i, (x, y) in enumerate(micro_batches):
        last = i == K - 1
        skip_sync = ddp and (fp32_buffers or (use_no_sync and not last))
        # no_sync must cover the forward too: DDP decides at forward time whether this
        # backward will all-reduce, so a forward outside it would arm the all-reduce hooks
        with model.no_sync() if skip_sync else nullcontext():
            with optimizer.forward_context():
                _, loss = model(x, y)
            # a micro-batch with no valid tokens has a NaN mean loss but a zero gradient
            # (cross_entropy's backward writes 0 for ignored targets), and weight 0
            optimizer.backward(loss * weights[i])
        if fp32_buffers:
            optimizer.move_grads_to_fp32_buffers()
        if log_weights[i]:
            # a tensor, not .item(): on a GPU an .item() per micro-step would stall the queue
            total_loss = total_loss + loss.detach().float() * log_weights[i]
    if ddp and fp32_buffers:
        all_reduce_mean(optimizer.grad_buffers)
    if ddp and optimizer.fp8_modules:
        # every rank must quantize with the same FP8 scales: fold the max amax over ranks
        # (one all-reduce for all layers), as Transformer Engine does
        amax = torch.stack([m.step_amax for m in optimizer.fp8_modules])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        for m, a in zip(optimizer.fp8_modules, amax):
            m.step_amax.copy_(a)
    stepped, grad_norm = optimizer.step()
    return float(total_loss), stepped, grad_norm


def all_reduce_mean(tensors):
    """Average a list of tensors over ranks with one all-reduce of their flat concatenation.
    One call instead of one per tensor: per-call latency dominates for small tensors. The
    concatenation is a transient copy of all of them (DDP does the same per bucket)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    torch._foreach_copy_(tensors, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in tensors]), tensors)])
