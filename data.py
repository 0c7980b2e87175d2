"""The built-in data and the batches: bytes in, (x, y) windows out.

Chapter: none; it feeds every section. Read first: `load_tokens`, then `Batches`.
A token is a byte (vocabulary 256, no tokenizer). With no --data the corpus is this Python's own
standard library (*.py, about 31 MB), cached once under data_cache/: `make train` needs no
download. How --data is read safely (regular files only, read as needed): guards/data_files.py.
"""
import hashlib
from pathlib import Path

import numpy as np
import torch

from config import UsageError
from guards.data_files import file_tokens, host_memory_available, stdlib_files, text_files
from guards.files import remove_stale_temps, write_atomically

HERE = Path(__file__).resolve().parent


def load_tokens(data, cache_dir=HERE / "data_cache"):
    """All bytes of the data as a uint8 array (vocab 256: a token is a byte).

    One --data file is read from disk as needed (FileTokens), so it may be larger than memory;
    a folder is read into memory, so it must fit. The default data is cached once as a flat
    file under data_cache/ (git-ignored) and read the same way.
    """
    if data:
        files = text_files(data)
        if len(files) == 1:
            return file_tokens(files[0])
        size, free = sum(f.stat().st_size for f in files), host_memory_available()
        if size > free // 2:  # the files' bytes and their concatenation are both in memory for a moment
            raise UsageError(f"--data={data}: {size / 2**30:.1f} GiB of files do not fit in the "
                             f"{free / 2**30:.1f} GiB of memory available; concatenate them into one file, "
                             f"which is read from disk as needed")
        try:
            return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
        except OSError as e:
            raise UsageError(f"--data={data}: {e.strerror or e}") from None
    files = stdlib_files()
    digest = hashlib.sha1("\n".join(f"{f}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:12]
    cache = Path(cache_dir) / f"stdlib-{digest}.u8"
    if not cache.exists():
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(cache.parent, (cache.name,))
            write_atomically(cache, lambda fh: fh.writelines(f.read_bytes() for f in files))
        except OSError as e:
            raise UsageError(f"cannot write the data cache {cache}: {e.strerror or e}") from None
    return file_tokens(cache)


def split_tokens(tokens, block_size, val_fraction=0.1):
    """(train, val): the last 10% is validation. Both must hold at least one window."""
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if len(train) <= block_size or len(val) <= block_size:
        raise UsageError(f"data too short: {len(tokens)} bytes give {len(train)} train / {len(val)} val, "
                         f"each needs more than block_size={block_size}")
    return train, val


class Batches:
    """Random (x, y) windows from a token array, drawn from a seeded generator.
    Its state is part of a snapshot, so a resumed run sees the same batches."""

    def __init__(self, tokens, block_size, batch_size, seed, device):
        self.tokens, self.block_size, self.batch_size, self.device = tokens, block_size, batch_size, device
        self.gen = torch.Generator().manual_seed(seed)

    def micro_batches(self, k, all_at_once=False):
        """One optimizer step's k micro-batches. all_at_once: a list (loss_norm=tokens counts every
        micro-batch's targets before the first backward); else drawn one at a time as
        accumulation_step iterates them, so one is in memory, not k (the same draws, in order)."""
        if all_at_once:
            return [self.next() for _ in range(k)]
        return DrawnOnce(self, k)

    def next(self):
        ix = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.gen).tolist()
        chunk = np.stack([self.tokens[i:i + self.block_size + 1] for i in ix]).astype(np.int64)
        xy = torch.from_numpy(chunk)
        x, y = xy[:, :-1], xy[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()


class DrawnOnce:
    """k micro-batches from `batches`, each drawn when the iteration reaches it; iterable once."""

    def __init__(self, batches, k):
        self.batches, self.k, self.used = batches, k, False

    def __len__(self):
        return self.k

    def __iter__(self):
        if self.used:
            raise RuntimeError("micro-batches drawn as used can be iterated once")
        self.used = True
        return (self.batches.next() for _ in range(self.k))
