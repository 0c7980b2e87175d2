"""The memory ledger's machinery: what memory_ledger.py (the chapter's formulas, at the root)
stands on, and what puts its numbers to work. Read memory_ledger.py first.

  walk.py      the engine: runs a description of the model op by op, holding memory as
               PyTorch holds it, and walks one training step for its peak
  ops.py       the ops the description is written in: what each saves and allocates
  pointwise.py the elementwise ones among them (add, dropout, GELU, mul, nn.RMSNorm's)
  fp8_ops.py   our FP8Linear (fp8.py) as one of those ops
  sdpa_math.py torch's math path for sdpa (CPU with dropout), another
  step.py      accumulate.py's step around the model: the loss, backward, the optimizer
  measure.py   the same bytes measured on a real step: saved tensors, live storages
  compiled.py  the same under COMPILE=1: what compiled blocks save, the step's peak
  explain.py   measured against described: which saved tensor no term accounts for
  parallel.py  ZeRO, TP, SP, PP, CP and offload per GPU, and the big shapes (the what-if)
  shard.py     what one rank holds under zero.py's ZeRO and fsdp.py's FSDP, exactly, and its step
  plan.py      will it fit? every configuration's largest micro-batch on a GPU (make plan)
  comm.py      the collectives a step issues, counted, and the bytes they move
  papers.py    Korthikanti et al. and ZeRO's published figures beside ours
  run.py       what the trainer says about memory while it runs
"""
