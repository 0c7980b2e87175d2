"""How a run ends early, and cleanly: one run per out_dir, files never half-written, a step too large for
memory, divergence, a rank lost. Each is one line, and the last good snapshot is kept.

Not read to learn the chapter. Read train.py first: each of these is one line there. Then `out_dir_held`
(the lock, which also proves out_dir takes a file), `write_atomically`, `within_memory`, `Divergence`
(when skipped steps are no longer the loss scaler's doing: section 1), `lost_ranks_named`.
"""
import dataclasses
import errno
import fcntl
import math
import os
import re
import resource
import signal
import socket
import stat
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import torch.distributed as dist

import precision
from config import RunError, UsageError
from guards.cli import SIGNALS, Interrupted, ended, launcher_gone, raised_through_c
from model import GPT

TEMP = re.compile(r"(.+)\.partial-memtrain-([0-9]{1,7})")  # write_atomically's: TARGET.partial-memtrain-<pid>
MEMORY_HISTORY = "memory_snapshot.pickle"  # --memory_snapshot's file in out_dir (ledger/live.py writes it)


# ---------------------------------------------------------------- one run per out_dir

@contextmanager
def out_dir_held(folder, ours=()):
    """Hold out_dir for a run's whole life: an exclusive flock on the folder itself, which the OS releases when
    the process ends however it ends (kill -9 leaves no stale lock, and no file of the lock's). A second run on
    it is refused in one line. A probe file, written and removed, shows the folder takes a file: read-only, a
    full disk or a file in the way is refused before anything is built, and any folder made for it goes again.
    Once held, the temporaries a killed run left of `ours` (the files written there) go."""
    folder, fd, made = Path(folder), None, []
    probe = folder / f".probe.partial-memtrain-{os.getpid()}"
    try:
        made = [p for p in [folder, *folder.parents] if not p.exists()]  # a name too long fails here
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        probe.write_bytes(b"probe")  # on a full disk: made, then ENOSPC
        probe.unlink()
    except OSError as e:
        _remove([probe] + made)
        if fd is not None:
            os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise UsageError(f"--out_dir={folder} is in use by another run (pid {_holder(folder)}): one run per "
                             f"out_dir, so neither overwrites the other's snapshot; wait for it or choose another "
                             f"--out_dir") from None
        raise UsageError(f"--out_dir={folder} cannot be written: {e.strerror or e}") from None
    remove_stale_temps(folder, (*ours, ".probe"))  # the probe too: a run killed as it probed
    try:
        yield
    finally:
        os.close(fd)
        _remove(made)


def _holder(folder):
    """The pid holding `folder`'s flock, as /proc/locks lists it by device and inode; '?' where unknown."""
    st = os.stat(folder)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as fh:
            return next((m.group(1) for m in re.finditer(rf"FLOCK +\w+ +WRITE +(\d+) +{where} ", fh.read())), "?")
    except OSError:
        return "?"


def _remove(paths):
    for p in paths:  # files first, then the folders made, deepest first
        with suppress(OSError):  # a folder that holds something stays
            p.rmdir() if p.is_dir() else p.unlink()


# ---------------------------------------------------------------- files never half-written

def write_atomically(path, write):
    """write(fh) into a temporary file beside `path`, fsync, then rename it over `path`:
    a crash mid-write leaves the previous file intact (or none), never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + f".partial-memtrain-{os.getpid()}")  # a name no user file has
    try:
        with raised_through_c(), open(tmp, "wb") as fh:  # a Ctrl-C inside torch.save is no full disk
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temps(folder, targets):
    """Delete the temporary files of writes whose process is gone (a kill -9 mid-write): only regular files
    directly in `folder` named TARGET.partial-memtrain-<pid> for one of `targets` (the files this program
    writes there), so no file of the user's is taken for one."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return  # no folder (yet): nothing left over
    for entry in entries:
        match = TEMP.fullmatch(entry.name)
        if match and match.group(1) in targets and entry.is_file(follow_symlinks=False) \
                and not _alive(int(match.group(2))):
            Path(entry.path).unlink(missing_ok=True)


def _alive(pid):
    if not 0 < pid <= 2 ** 22:  # Linux's largest pid (PID_MAX_LIMIT): past it, no pid of ours
        return True  # not ours to judge, leave the file
    if pid == os.getpid():
        return False  # ours, from before an exec: nothing of this process writes it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def check_writable(folder, flag):
    """For the tools' reports: raise UsageError unless `folder` can be created and written. A probe file is
    written and removed, and any folder made for it is removed again, so nothing is left behind."""
    folder = Path(folder)
    made, probe = [], None
    try:
        for parent in reversed([folder, *folder.parents]):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        probe = folder / f".probe.partial-memtrain-{os.getpid()}"
        probe.write_bytes(b"probe")  # on a full disk: created, then ENOSPC
    except OSError as e:
        raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
    finally:  # whatever failed above, nothing of the probe stays (a cleanup error must not hide the first)
        _remove(([probe] if probe else []) + made[::-1])


def check_reachable(folder, flag):
    """For a rank that writes nothing there (rank 0 holds the folder at the same moment), without creating
    anything: its nearest existing folder must be writable."""
    for parent in [Path(folder), *Path(folder).parents]:
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue  # not there (or rank 0's folder, just removed again): look one up
        except OSError as e:
            raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
        if not stat.S_ISDIR(mode):
            raise UsageError(f"{flag}={folder} cannot be written: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK) and parent.exists():
            raise UsageError(f"{flag}={folder} cannot be written: Permission denied")
        return


# ---------------------------------------------------------------- a step too large for memory

def memory_available():
    """Bytes of memory this machine can still give (MemAvailable; all of it where that is unknown)."""
    try:
        return next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_free(device):
    """(bytes a rank may use, where): the GPU's free memory, or this node's ranks' share of the CPU's."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {torch.cuda.get_device_name(device)}"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return memory_available() // ranks, "of memory available" + (f" per rank ({ranks})" if ranks > 1 else "")


def check_fits(cfg, device):
    """Raise UsageError where what a step holds at the least, counted without building anything, is more than
    `device` has free: the parameters with their gradients, FP32 master copy and optimizer states (P from
    model.py on the meta device; a share of them per rank under SHARD), and the loss's FP32 logits. Refused in a
    second, where building and running it would fill the memory first; the rest is `within_memory`'s."""
    with torch.device("meta"):  # one block and two: blocks are alike (a deep model's modules take minutes to make)
        one, two = (sum(p.numel() for p in GPT(dataclasses.replace(cfg, n_layer=n)).parameters()) for n in (1, 2))
    prec, world = precision.decide(cfg), int(os.environ.get("WORLD_SIZE", 1)) if cfg.shard != "none" else 1
    spec = precision.optimizer_spec(cfg)  # a parameter and its gradient, its FP32 master, the optimizer's states
    per_parameter = 2 * prec.param_dtype.itemsize + 4 * prec.master_weights + 4 * len(spec.per_element)
    need = (one + (cfg.n_layer - 1) * (two - one)) * per_parameter // world + \
        4 * cfg.batch_size * cfg.block_size * cfg.vocab_size // cfg.loss_chunks
    free, where = memory_free(device)
    if need > free:
        raise UsageError(f"this shape needs at least {need / 2**30:,.1f} GiB for one step (its parameters and their "
                         f"states, its FP32 logits), {free / 2**30:,.1f} GiB {where}: make it smaller")


@contextmanager
def within_memory(device):
    """Around a run: a step that needs more memory than there is ends in one line, not in the kernel's OOM
    kill -9. On a CPU the process may map at most what it maps now plus its share of what is available
    (RLIMIT_AS, put back after), so torch's allocation fails there as it does on a GPU."""
    limit = resource.getrlimit(resource.RLIMIT_AS)
    if device.type == "cpu":
        mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")  # pages, now
        allowed = mapped + memory_free(device)[0]
        hard = limit[1]
        resource.setrlimit(resource.RLIMIT_AS, (allowed if hard == resource.RLIM_INFINITY else min(allowed, hard), hard))
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not (isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)):
            raise
        free, where = memory_free(device)
        tried = re.search(r"allocate ([0-9.]+ [GMK]iB|[0-9]+ bytes)", str(e))
        raise UsageError(f"this shape needs more than the {free / 2**30:,.1f} GiB {where} for one step (torch "
                         f"could not allocate {tried.group(1) if tried else 'more'}): make it smaller") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)


# ---------------------------------------------------------------- divergence

class Divergence:
    """Watches each step's loss and whether it stepped (host values the loop has anyway: no sync), and stops a
    diverged run before its next snapshot, the last good one kept.

    The rule. A non-finite loss (on any rank) is divergence: no loss scale makes a forward finite. A skipped
    step (inf/NaN gradients) is the loss scaler's business while it can explain it
    (precision.overflows_explained): a dynamic scaler tolerates hysteresis-1 overflows, then backs off per
    overflow, so from scale S it is down to 1 after hysteresis-1 + ceil(log2 S) skips in a row at the default
    back-off (it halves). One skip more overflowed at a scale <= 1: the gradients are not finite even
    unscaled. A static scale never moves; its run of skips gets the same allowance, counted from that scale.
    No scaler (BF16, FP32): the first skip stops the run, an inf or NaN gradient no scale could avoid."""

    def __init__(self, prec, optimizer=None, path=None, resumed_step=None):
        self.scaler, self.path, self.resumed_step, self.saved_step = prec.loss_scaler(), path, resumed_step, None
        self.nonfinite, self.skipped, self.too_many, self.done = None, [], None, resumed_step or 0  # skipped: scales
        self.weights = optimizer.model_params + (optimizer.master_params if prec.master_weights else []) \
            if optimizer else []

    def after_step(self, step, loss, stepped, scale):
        """step: the step just done (1-based); scale: the loss scale it ran with."""
        self.done = step
        if not math.isfinite(loss) and self.nonfinite is None:
            self.nonfinite = (step, loss)
        self.skipped = [] if stepped else self.skipped + [scale]
        if self.skipped and len(self.skipped) > self.allowance(self.skipped[0]) and self.too_many is None:
            self.too_many = (step, len(self.skipped), self.skipped[0])

    def allowance(self, scale):
        return precision.overflows_explained(self.scaler, scale)

    def check(self, step, cfg, probe_loss=None):
        """Raise RunError (every rank alike) if the run diverged; called once per log interval and before each
        snapshot. probe_loss: before a snapshot that would replace one, the loss its weights give on a fixed
        batch (an update can run away with the step's loss still finite: only the next forward shows it)."""
        flags = [self.nonfinite is not None, self.too_many is not None,
                 isinstance(probe_loss, float) and not math.isfinite(probe_loss),
                 not all(bool(torch.isfinite(w).all()) for w in self.weights)]
        if dist.is_initialized():  # ranks see other losses: they decide together, so all stop or none
            agreed = torch.tensor(flags, dtype=torch.float32, device=self.weights[0].device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            flags = [bool(f) for f in agreed.tolist()]
        if not any(flags):
            return
        cause = f"lower --learning_rate (its peak is {cfg.learning_rate:g})"
        if cfg.weight_decay >= 1 and cfg.learning_rate * cfg.weight_decay >= 1:  # AdamW: weights x (1 - lr x wd)
            cause += f" or --weight_decay ({cfg.weight_decay:g}: lr x weight_decay >= 1 flips the weights each step)"
        if flags[3]:
            why = f"step {step}: the weights hold inf or NaN; {cause}"
        elif flags[0]:
            when = f"step {self.nonfinite[0]}, loss {self.nonfinite[1]}" if self.nonfinite else "on another rank"
            why = f"step {step}: the run diverged: the loss is not finite ({when}); {cause}"
        elif flags[1]:
            at, skips, scale = self.too_many
            mode = self.scaler.mode if self.scaler else "none"
            if mode == "static":
                cause = f"lower --loss_scale={scale:g} (or use --loss_scale=dynamic), or {cause.replace('lower ', '')}"
            why = (f"step {step}: the run diverged: {skips} steps in a row (to step {at}) were skipped for inf/NaN "
                   f"gradients, more than the loss scale ({mode}, {scale:g}) can explain "
                   f"({self.allowance(scale)}); {cause}")
        else:
            why = f"step {step}: the run diverged: the weights of this step give a loss of {probe_loss}; {cause}"
        raise RunError(f"{why}; stopping without writing a snapshot, {self.note()}")

    def note(self):
        """Where the last good snapshot is, in words, for the line a stopped run ends with."""
        if self.saved_step is not None:
            return f"the last snapshot is {self.path} (step {self.saved_step})"
        if self.resumed_step is not None:
            return f"the last snapshot is {self.path} (step {self.resumed_step}, resumed from, untouched)"
        return f"this run wrote no snapshot ({self.path} is as it was)" if Path(self.path).exists() \
            else "no snapshot was written"

    @contextmanager
    def interruptible(self, max_iters):
        """Ctrl-C and SIGTERM say the step reached and where the last snapshot is."""
        try:
            yield
        except Interrupted as e:
            e.where = f"step {self.done} of {max_iters}; {self.note()}"
            raise


# ---------------------------------------------------------------- a rank, or its launcher, lost

@contextmanager
def lost_ranks_named():
    """Around a torchrun rank's life once its process group forms: a collective that fails because another
    rank is gone (kill -9, SIGTERM, a crash) ends this one in a line naming it, not in gloo's traceback.
    Every rank's host and pid are gathered first (a collective: every rank enters)."""
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    try:
        yield
    except RuntimeError as e:  # gloo's and NCCL's errors (torch.distributed.DistError is one)
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}  # torchrun's SIGTERM comes next
        if line := launcher_gone():  # torchrun itself is gone, and with it every rank: that is the news
            ended(line)
        gone = _gone(table, e)
        if gone is None:
            for s, h in previous.items():
                signal.signal(s, h)
            raise
        # at once (cli.ended): no snapshot is being written while a collective fails, so nothing needs
        # unwinding, and freeing the DDP wrapper now can deadlock in gloo
        ended(f"rank {dist.get_rank()}: {gone} (killed, or it failed: its own line says why); this rank cannot go "
              f"on without it and stops; the last snapshot written is kept")


def _gone(table, error, wait=1.0):
    """Who is gone, in words, or None: ranks on this host whose process ended (a killed rank closes its
    sockets a moment before it is seen ended: looked for up to `wait` s), else a lost connection to
    ranks on other hosts, which this rank cannot look at."""
    host, me = socket.gethostname(), os.getpid()
    for _ in range(int(wait / 0.05) + 1):
        gone = [(r, pid) for r, (h, pid) in enumerate(table) if h == host and pid != me and _ended(pid)]
        if gone:
            return ", ".join(f"rank {r} (pid {pid})" for r, pid in gone) + (" is" if len(gone) == 1 else " are") \
                + " gone"
        time.sleep(0.05)
    others = sorted({h for h, _ in table if h != host})
    return f"lost contact with the ranks on {', '.join(others)}" if others and "onnection" in str(error) else None


def _ended(pid):
    try:  # a zombie (Z) has ended; its parent (torchrun) has not collected it yet
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
