"""Reading --data safely: regular files only, folders walked without losing a file, and a file read
as needed with pread, so a file truncated mid-run is one line, not SIGBUS.

Not read to learn the chapter. Read data.py first (load_tokens), then `text_files`, then `FileTokens`.
"""
import functools
import os
import sysconfig
from pathlib import Path

import numpy as np

from config import RunError, UsageError


@functools.cache  # listed once per process: the walk takes a second or two
def stdlib_files():
    """This Python's standard library .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(p for p in root.rglob("*.py")
                        if "site-packages" not in p.relative_to(root).parts and p.is_file()))


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
