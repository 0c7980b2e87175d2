"""The built-in data and the batches: bytes in, (x, y) windows out.

Chapter: none; it feeds every section. Read first: `load_tokens`, then `Batches`.
A token is a byte (vocabulary 256, no tokenizer). With no --data the corpus is this Python's own
standard library (*.py, about 31 MB), cached once under data_cache/: `make train` needs no
download. After them, how --data is read safely: `text_files` (regular files only, folders walked
without losing a file) and `FileTokens` (a file read as needed with pread: truncated mid-run, it is
one line, not SIGBUS).
"""
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from config import RunError, UsageError
from guards.clean_end import memory_available, remove_stale_temps, write_atomically


def load_tokens(data, cache_dir=Path(__file__).resolve().parent / "data_cache"):
    """All bytes of the data as a uint8 array (vocab 256: a token is a byte).

    The default data is this Python's standard library, cached once as a flat file under data_cache/
    (git-ignored, named by the Python that wrote it) and read whole into memory: about 31 MB, as nanoGPT
    maps its own. One --data file is read from disk as needed (FileTokens), so it may be larger than memory;
    a folder is read into memory, so it must fit.
    """
    if data:
        return user_tokens(data)
    cache = Path(cache_dir) / f"stdlib-{hashlib.sha1(sys.version.encode()).hexdigest()[:12]}.u8"
    if not cache.exists():
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(cache.parent, (cache.name,))
            write_atomically(cache, lambda fh: fh.writelines(f.read_bytes() for f in stdlib_files()))
        except OSError as e:
            raise UsageError(f"cannot write the data cache {cache}: {e.strerror or e}") from None
    return np.fromfile(cache, dtype=np.uint8)


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
        """One optimizer step's k micro-batches. all_at_once: k (x, y) pairs (loss_norm=tokens counts every
        micro-batch's targets before the first backward); else k draws, each made as accumulation_step reaches
        it, so one micro-batch is in memory, not k (the same draws, in order)."""
        return [self.next() for _ in range(k)] if all_at_once else [self.next] * k

    def next(self):
        ix = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=self.gen).tolist()
        xy = torch.from_numpy(np.stack([self.tokens[i:i + self.block_size + 1] for i in ix]).astype(np.int64))
        x, y = xy[:, :-1], xy[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.contiguous(), y.contiguous()


# ---------------------------------------------------------------- --data, read safely

def stdlib_files():
    """This Python's standard library .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())


def user_tokens(data):
    """--data's bytes: one file read as needed (FileTokens), a folder's files read into memory."""
    files = text_files(data)
    if len(files) == 1:
        return file_tokens(files[0])
    size, free = sum(f.stat().st_size for f in files), memory_available()
    if size > free // 2:  # the files' bytes and their concatenation are both in memory for a moment
        raise UsageError(f"--data={data}: {size / 2**30:.1f} GiB of files do not fit in the "
                         f"{free / 2**30:.1f} GiB of memory available; concatenate them into one file, "
                         f"which is read from disk as needed")
    try:
        return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    except OSError as e:
        raise UsageError(f"--data={data}: {e.strerror or e}") from None


def text_files(path):
    """The regular files of --data (a file, or a folder read recursively), each readable."""
    p = Path(path)
    try:
        p.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise UsageError(f"--data={path}: no such file or folder") from None
    except OSError as e:  # a name too long, a loop of links
        raise UsageError(f"--data={path}: {e.strerror or e}") from None
    if not p.is_file() and not p.is_dir():
        raise UsageError(f"--data={path}: not a regular file or a folder (a pipe or a device cannot be read twice)")
    files = [p] if p.is_file() else sorted(_files_below(p, path))
    if not files:
        raise UsageError(f"--data={path}: the folder holds no files")
    for f in files:
        if not os.access(f, os.R_OK):
            raise UsageError(f"--data={path}: {f} cannot be read (permission denied)")
    return files


def _files_below(folder, path):
    """The regular files below `folder`, each once (under the first name a sorted walk meets), each folder
    walked once: links are followed, so one back up (d/self -> d) is not walked again and again. A
    subfolder that cannot be listed is refused, as an unreadable file is (rglob would skip it silently)."""
    def refuse(e):
        raise UsageError(f"--data={path}: {e.filename} cannot be read ({e.strerror or e})")
    walked, found = set(), {}  # (device, inode) of each folder walked; of each file -> its first name
    for root, dirs, names in os.walk(folder, onerror=refuse, followlinks=True):
        here = os.stat(root)
        if (here.st_dev, here.st_ino) in walked:
            dirs.clear()  # reached again through a link: its files are listed, its subfolders walked
            continue
        walked.add((here.st_dev, here.st_ino))
        dirs.sort()  # walked in sorted order: the name a file is read under does not depend on the disk's order
        for f in sorted(Path(root) / n for n in names):
            if f.is_file():
                found.setdefault(_identity(f), f)
    return sorted(found.values())


def _identity(file):
    st = file.stat()
    return st.st_dev, st.st_ino


def file_tokens(path):
    """The file's bytes as FileTokens, read as needed (so it may be larger than memory)."""
    try:
        return FileTokens(open(path, "rb", buffering=0))  # noqa: SIM115 (open for the run's life)
    except OSError as e:
        raise UsageError(f"--data={path}: {e.strerror or e}") from None


class FileTokens:
    """The bytes of a file, as a uint8 array that reads only what is asked of it.

    A slice is another FileTokens (nothing read); numpy reads one (np.asarray, np.stack) with
    os.pread. A file that became shorter since it was opened (another program truncated it)
    raises RunError with one line: a memory map would have died of SIGBUS instead."""

    def __init__(self, fh, start=0, stop=None):
        self.fh, self.start = fh, start
        self.stop = os.fstat(fh.fileno()).st_size if stop is None else stop
        self.path = fh.name

    def __len__(self):
        return self.stop - self.start

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("FileTokens takes a slice with step 1")
        start, stop, _ = index.indices(len(self))
        return FileTokens(self.fh, self.start + start, self.start + max(start, stop))

    def __array__(self, dtype=None, copy=None):
        try:
            data = os.pread(self.fh.fileno(), len(self), self.start)
        except OSError as e:
            raise RunError(f"--data={self.path}: reading it failed mid-run: {e.strerror or e}") from None
        if len(data) != len(self):
            size = os.fstat(self.fh.fileno()).st_size
            raise RunError(f"--data={self.path} changed while the run read it: it is {size:,} bytes now, was "
                           f"{self.stop:,} or more (another program truncated it); stopping")
        return np.frombuffer(data, dtype=np.uint8).astype(dtype or np.uint8)
