"""Building a run: precision, model, recompute policy, sharding and optimizer, each decided once.

Chapter: where sections 1-4 meet before the first step. Read first: `build` (every mechanism put
together, in the order that matters: cast, recompute, compile, shard, optimizer), then `make_optimizer`
(SHARD's choice of optimizer). train.py runs what this builds; the memory ledger builds the same run on
fake tensors (ledger/trace.py) to count its bytes without memory. Each mechanism's file is imported where
its flag asks for it: a plain run runs nothing of FP8, recompute or sharding.
"""
import inspect

import torch

import accumulate
import precision
from config import UsageError
from model import GPT


def pick_device(cfg, local_rank=0):
    """The device cfg asks for: CUDA's LOCAL_RANK-th GPU (one per rank), or the CPU."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device=cuda but no CUDA device is available")
        if local_rank >= (gpus := torch.cuda.device_count()):  # one rank per GPU: cuda:1 of one GPU is a traceback
            raise UsageError(f"LOCAL_RANK={local_rank}, but this machine has {gpus} CUDA device(s): start at most "
                             f"{gpus} process(es) per node (make ddp NPROC={gpus}, torchrun --nproc_per_node={gpus})")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build(cfg, device=None):
    """(model, accumulate.StepParts) for cfg: the model in its precision, with its recompute
    policy, and everything an optimizer step needs. Used by the loop, the tools and the tests."""
    device = device or pick_device(cfg)
    prec = precision.decide(cfg)
    try:
        torch.manual_seed(cfg.seed)
        model = GPT(cfg, linear_factory=prec.linear_factory())
        if prec.fp8:  # its GEMM must run on this device, on Linears of its shapes
            import fp8
            prec.check_device(device)
            fp8.check_shapes(model)
        # FSDP2 keeps FP32 shards (the master weights) and casts them per block
        model.to(device=device, dtype=torch.float32 if cfg.shard == "fsdp" else prec.param_dtype)
        if cfg.ckpt != "none":
            import checkpoint
            checkpoint.apply_policy(model, checkpoint.policy(cfg), prec.recompute_contexts,
                                    recompute_fn=checkpoint.IMPLEMENTATIONS[cfg.ckpt_impl],
                                    stop_early=checkpoint.rerun_stops_early(cfg, prec))
        if cfg.compile:
            compile_blocks(model)  # before FSDP and DDP wrap the model, as PyTorch documents
        if cfg.shard == "fsdp":
            import fsdp
            fsdp.apply_fsdp(model, prec)
        optimizer = make_optimizer(cfg, model, prec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # FP32_GRAD_ACCUM: the micro-steps' 16-bit gradients summed in FP32 buffers (config.py refuses it in fp32)
    return model, accumulate.StepParts(prec, prec.loss_scaler(), optimizer, accumulate.fp32_grad_buffers(
        model.parameters()) if cfg.fp32_grad_accum else None, fp8.layers(model) if prec.fp8 else ())


def compile_blocks(model):
    """COMPILE: each block compiled on its own, in place; the policy's units run compiled blocks (torchtitan's
    order). A submodule unit stays eager: traced, our hooks give its backward wrong tensors (docs/compile.md)."""
    for block in model.h:
        for module in block.modules():
            if "forward" in module.__dict__:  # checkpoint.apply_policy's recompute of a submodule unit
                module.forward = torch.compiler.disable(module.forward)
        block.compile()


def make_optimizer(cfg, model, prec):
    """The optimizer SHARD asks for, with the update rule OPTIMIZER names (precision.OPTIMIZERS): on an
    FP32 master copy of the whole model (none: DDP keeps it on every rank), or of this rank's slice
    only (zero1, zero2: zero.py), or on this rank's FP32 shards, which are the master weights (fsdp)."""
    spec = precision.optimizer_spec(cfg)
    settings = dict(lr=cfg.learning_rate, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    if cfg.shard in ("zero1", "zero2"):
        import zero
        return zero.ShardedOptimizer(model.parameters(), prec.master_weights, spec, zero.STAGES[cfg.shard],
                                     **settings)
    if cfg.shard == "fsdp":
        import fsdp
        return fsdp.ShardOptimizer(model.parameters(), prec.master_weights, spec, **settings)
    return precision.MasterWeightOptimizer(model.parameters(), prec.master_weights, spec, **settings)


def wrap_ddp(model, device):
    """DDP's wrapper (SHARD=none over several ranks): every gradient all-reduced in its backward."""
    from torch.nn.parallel import DistributedDataParallel
    # no buffer sync per forward: FP8's per-step amax stays each rank's own until fp8.fold_amax takes the
    # max over ranks (torch 2.13 renames broadcast_buffers forward_sync_buffers)
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   **no_buffer_sync)
