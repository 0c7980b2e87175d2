"""Traces kept on disk between runs, each in a file named by everything that makes it (make plan's second
question reads them instead of tracing).

Chapter section 4's machinery: ledger/trace.py asks `read` before it traces and `keep`s what it made.
Read `kept_on_disk` first. A folder for each version of the code (a hash of the text of every .py file
of the project but the tests' and the tools', and of torch's and Python's versions), in it a file for
each request (its hash, whether CUDA's rules stand in among it); the VERSIONS newest folders are kept.
"""
import contextlib
import hashlib
import marshal
import shutil
import sys
from pathlib import Path

import torch

import flops
from guards.clean_end import write_atomically
from ledger.cuda_rules import emulated

COUNTS = {"traced": 0, "read": 0}  # traces made in this process and its workers, and read from disk
_DISK = []  # kept_on_disk's folder, while it keeps traces
_MODEL_AS_IMPORTED = flops.model_code()  # model.py as its file says: a test's patch of it is kept nowhere
ROOT = Path(__file__).resolve().parent.parent
_CODE = []  # the project's code, hashed once a process


@contextlib.contextmanager
def kept_on_disk(folder):
    """Traces kept in `folder` too (None: not), so that a second question reads them: an edit of model.py
    (or of any code that runs a trace) is a new version's folder, never a stale trace."""
    _DISK.append(Path(folder) if folder else None)
    try:
        yield
    finally:
        _DISK.pop()


def _path(kind, cfg, *args):
    if not _DISK or _DISK[-1] is None or flops.model_code() != _MODEL_AS_IMPORTED:
        return None
    if not _CODE:  # a folder for each version of the code (and of torch and Python), a file for each request
        files = sorted(p for p in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py")] if p.parent.name not in ("tests", "tools"))
        code = b"".join(p.read_bytes() for p in files) + f"{torch.__version__} {sys.version}".encode()
        _CODE.append(hashlib.sha256(code).hexdigest()[:16])
    made_of = repr((kind, repr(cfg), args, emulated(cfg)))
    return _DISK[-1] / _CODE[0] / f"{hashlib.sha256(made_of.encode()).hexdigest()[:40]}.marshal"


def read(kind, cfg, *args):
    """The kept trace of this request, or None (none kept, or one that cannot be read: traced again)."""
    path = _path(kind, cfg, *args)
    try:  # marshal: Python's own types only, no code run as it loads, 40x faster than torch.load(weights_only)
        out = marshal.loads(path.read_bytes()) if path and path.exists() else None
    except Exception:  # noqa: BLE001  (a cache: whatever is wrong with the file, the trace is made again)
        return None
    COUNTS["read"] += out is not None
    return out


def keep(out, kind, cfg, *args):
    """Write the trace `out` of this request where kept_on_disk asks (one that cannot be: made again next time).
    The first of a new version of the code removes all but the VERSIONS newest versions' folders."""
    if path := _path(kind, cfg, *args):
        with contextlib.suppress(OSError, ValueError):  # (ValueError: not marshal's types)
            data = marshal.dumps(out)
            if not path.parent.exists():
                path.parent.mkdir(parents=True)
                for old in sorted(filter(_versions, path.parent.parent.iterdir()), key=lambda p: p.stat().st_mtime,
                                  reverse=True)[VERSIONS:]:
                    shutil.rmtree(old, ignore_errors=True)
            write_atomically(path, lambda fh: fh.write(data))


VERSIONS = 4  # the code's versions whose traces are kept (a learner's last few edits of model.py)


def _versions(folder):
    """Whether `folder` is one version's traces: 16 hex digits, nothing in it but traces (no folder of yours)."""
    return folder.is_dir() and len(folder.name) == 16 and all(c in "0123456789abcdef" for c in folder.name) and \
        all(p.suffix == ".marshal" or ".partial-memtrain-" in p.name for p in folder.iterdir())
