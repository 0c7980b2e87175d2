"""The built-in data and the batches: bytes in, (x, y) windows out.

Chapter: none; it feeds every section. Read first: `load_tokens`, then `Batches`.

A token is a byte (vocabulary 256, no tokenizer). With no --data the corpus is this
Python's own standard library (*.py, site-packages excluded, about 31 MB), cached once
as a flat file under data_cache/, so `make train` needs no download.
"""
import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from config import UsageError
from snapshot import remove_stale_temps, write_atomically

HERE = Path(__file__).resolve().parent


def stdlib_files():
    """This Python's standard library .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())


def host_memory_available():
    """Bytes of memory this machine can still give (MemAvailable; all of it where that is unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def text_files(path):
    """The regular files of --data (a file, or a folder read recursively), each readable."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--data={path}: no such file or folder")
    if not p.is_file() and not p.is_dir():
        raise UsageError(f"--data={path}: not a regular file or a folder (a pipe or a device cannot be read twice)")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    if not files:
        raise UsageError(f"--data={path}: the folder holds no files")
    for f in files:
        if not os.access(f, os.R_OK):
            raise UsageError(f"--data={path}: {f} cannot be read (permission denied)")
    return files


def load_tokens(data, cache_dir=HERE / "data_cache"):
    """All bytes of the data as a uint8 array (vocab 256: a token is a byte).

    One --data file is mapped from disk (np.memmap), so it may be larger than memory; a
    folder is read into memory, so it must fit. The default data is cached once as a flat
    file under data_cache/ (git-ignored) and mapped the same way.
    """
    if data:
        files = text_files(data)
        if len(files) == 1:
            return _mapped(files[0])
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
            remove_stale_temps(cache.parent)
            write_atomically(cache, lambda fh: fh.writelines(f.read_bytes() for f in files))
        except OSError as e:
            raise UsageError(f"cannot write the data cache {cache}: {e.strerror or e}") from None
    return _mapped(cache)


def _mapped(path):
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)  # mmap refuses an empty file
    try:
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise UsageError(f"--data={path}: {e.strerror or e}") from None


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

    def next(self):
        ix = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.gen).tolist()
        chunk = np.stack([self.tokens[i:i + self.block_size + 1] for i in ix]).astype(np.int64)
        xy = torch.from_numpy(chunk)
        x, y = xy[:, :-1], xy[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()
