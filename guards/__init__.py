"""What keeps a run honest at its ends, not read to learn the chapter. Read train.py first.

  cli.py               the command line: --key=value into a Config, --help, and every program's
                       one-line ending (bad input exit 2, a run that cannot go on 1, signals)
  preflight.py         everything every rank checks before a run is built (the input, out_dir
                       and its lock, the snapshot, K, whether the step fits), so bad input costs nothing
  clean_end.py         how a run ends early and cleanly: divergence, a second run on one out_dir,
                       a rank or its launcher lost (Guard: the loop's part behind one name)
  interrupts.py        Ctrl-C and SIGTERM, one line from a program's first instant to its last
  files.py             atomic writes, the temporary files a killed run left, a folder probed
  data_files.py        --data read safely: regular files only, read as needed (pread, not a map)
  snapshot_fields.py   every field of a snapshot checked, by the command line's own rules,
                       before any of it is used
  sharded_snapshot.py  ZeRO's slices and FSDP's shards gathered into DDP's snapshot format and
                       cut back, so a snapshot resumes under DDP, ZeRO-1, ZeRO-2 or FSDP alike
  report.py            what a run says while it runs: the progress line (MFU, HFU), evaluation's, memory
                       (the traced step beside the CUDA allocator's, each rank's states, the history)
  compiling.py         what COMPILE=1 needs: a C++ compiler (CPU) or Triton (CUDA), and evaluation,
                       the probe and sampling kept eager
"""
