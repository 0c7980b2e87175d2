"""What keeps a run honest at its ends, not read to learn the chapter. Read train.py first: each guard is
one line there, marked `# guard:`.

  cli.py               the command line (--key=value into a Config, --help) and every program's one-line
                       ending: bad input exit 2, a run that cannot go on 1, Ctrl-C and SIGTERM 130 or 143
                       from the first instant, a torchrun rank whose torchrun is gone 1
  clean_end.py         one run per out_dir (its lock, also the probe that it takes a file), files never
                       half-written, a step too large for memory, divergence, a rank lost
  sharded_snapshot.py  ZeRO's slices and FSDP's shards gathered into DDP's snapshot format and cut back,
                       so a snapshot resumes under DDP, ZeRO-1, ZeRO-2 or FSDP alike
  compiling.py         what COMPILE=1 needs: a C++ compiler (CPU) or Triton (CUDA)
"""
