"""The memory ledger's machinery: what memory_ledger.py (the chapter's formulas, at the root) stands on,
and what puts its numbers to work. Read memory_ledger.py first, then trace.py.

  trace.py      the exact column: build.py's run of model.py, stepped on fake tensors (no memory), counted
  cuda_rules.py what a GPU's kernels keep that a CPU's do not, for a GPU's step traced on CPU tensors
  kept.py       traces kept on disk between runs, named by the code and the request (make plan)
  loss.py       the loss alone at its most (head_and_loss by itself), fake or real
  measure.py    the census that counts it, and a real step the same way: saved tensors, live storages
  compiled.py   the same under COMPILE=1: what compiled blocks save, the step's peak
  comm.py       the collectives a step issues, counted, and the bytes they move
  plan.py       will it fit? every configuration's largest micro-batch on a GPU, from small traces (make plan)
  gpus.py       the GPUs the plan fits into, and their peak FLOP/s: each figure with its source
  parallel.py   ZeRO and FSDP traced over N ranks; TP, SP, PP, CP and offload per GPU
  papers.py     Korthikanti et al. and ZeRO's published figures beside the trace
  live.py       on a GPU, the ledger's prediction beside the CUDA allocator after each step (train.py's Report)
  fits.py       the tools' check that a shape fits before they run it, by the closed forms or a trace
"""
