"""The built-in data and the batches: bytes in, (x, y) windows out.

Chapter: none; it feeds every section. Read first: `load_tokens`, then `Batches`.

A token is a byte (vocabulary 256, no tokenizer). With no --data the corpus is this
Python's own standard library (*.py, site-packages excluded, about 31 MB), cached once
as a flat file under data_cache/, so `make train` needs no download.
"""
import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

from config import UsageError
from snapshot import write_atomically

HERE = Path(__file__).resolve().parent


def stdlib_files():
    """This Python's standard library .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())


def text_files(path):
    p = Path(path)
    if not p.exists():
        raise UsageError(f"--data={path}: no such file or folder")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    if not files:
        raise UsageError(f"--data={path}: the folder holds no files")
    return files


def load_tokens(data, cache_dir=HERE / "data_cache"):
    """All bytes of the data as a uint8 array (vocab 256: a token is a byte).

    The default data is cached once as a memmap under data_cache/ (git-ignored);
    a --data path is read directly.
    """
    if data:
        return np.frombuffer(b"".join(f.read_bytes() for f in text_files(data)), dtype=np.uint8)
    files = stdlib_files()
    digest = hashlib.sha1("\n".join(f"{f}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:12]
    cache = Path(cache_dir) / f"stdlib-{digest}.u8"
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache, lambda fh: fh.writelines(f.read_bytes() for f in files))
    return np.memmap(cache, dtype=np.uint8, mode="r")


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
