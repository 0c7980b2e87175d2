"""How a run ends early, and cleanly: divergence, Ctrl-C and SIGTERM, a second run on one out_dir.

Chapter: none; section 1's loss scaler (precision.py) skips a step whose gradients overflow,
and this file says when skipping is no longer the scaler's doing. Read first: `Divergence`
(the rule), then `out_dir_lock`; Ctrl-C and SIGTERM are guards/interrupts.py's.

Every stop keeps the last good snapshot: a diverged run is stopped before its next snapshot
would be written, a signal unwinds a write in progress (snapshot.write_atomically removes
its temporary file), and the lock keeps two runs from writing one snapshot in turns.
"""
import errno
import fcntl
import math
import os
import re
import signal
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

import precision
from config import RunError, UsageError
from guards.interrupts import SIGNALS, Interrupted, ended, launcher_gone
from guards.compiling import eagerly

LOCK = ".memtrain.lock"  # in out_dir while a run uses it; its pid inside, for the refusal
LOCK_TEXT = re.compile(rb"[0-9]{0,7}\n?")  # what a lock of ours holds (nothing yet, just made): any other is the user's


# ---------------------------------------------------------------- divergence

class Divergence:
    """Watches each step's loss and whether it stepped (host values the loop has anyway: no sync).

    The rule. A non-finite loss (on any rank) is divergence: no loss scale makes a forward finite.
    A skipped step (inf/NaN gradients) is the scaler's business while the scaler can explain it
    (precision.overflows_explained): a dynamic scaler tolerates hysteresis-1 overflows,
    then backs off per overflow, so from scale S it is down to 1 after hysteresis-1 + ceil(log2 S)
    skips in a row at the default back-off (it halves). One skip more
    overflowed at a scale <= 1: the gradients are not finite even unscaled, and lowering the
    scale further cannot help. A static scale (or none, scale 1) never moves; its run of skips
    gets the same allowance, counted from that scale (none: 0, the first skip stops: a bf16 or
    fp32 gradient that is inf or NaN is no overflow a scale could avoid). FP16's early overflows
    at 2^16 take at most 16 + hysteresis-1 halvings, so they never trigger it.
    """

    def __init__(self, prec):
        self.precision = prec
        self.nonfinite = None  # (step, loss) of this rank's first non-finite loss
        self.skips, self.scale_at_first_skip = 0, None  # the current run of skipped steps
        self.too_many = None  # (step, skips, scale) where a run of skips passed the allowance

    def allowance(self, scale):
        return precision.overflows_explained(self.precision.loss_scaler(), scale)

    def after_step(self, step, loss, stepped, scale):
        """step: the step just done (1-based); scale: the loss scale it ran with."""
        if not math.isfinite(loss) and self.nonfinite is None:
            self.nonfinite = (step, loss)
        if stepped:
            self.skips = 0
            return
        if self.skips == 0:
            self.scale_at_first_skip = scale
        self.skips += 1
        if self.skips > self.allowance(self.scale_at_first_skip) and self.too_many is None:
            self.too_many = (step, self.skips, self.scale_at_first_skip)

    def check(self, step, weights, cfg, note, probe_loss=None, world_size=1, device=None):
        """Raise RunError (every rank alike) if the run diverged; called once per log interval and
        before each snapshot. probe_loss: before a snapshot that would replace one, the loss its
        weights give on a fixed batch (an update can run away with the step's loss still finite:
        only the next forward shows it, and the good snapshot must not go for it)."""
        finite_weights = all(bool(torch.isfinite(w).all()) for w in weights)
        probe_bad = probe_loss is not None and not math.isfinite(probe_loss)
        flags = [self.nonfinite is not None, self.too_many is not None, probe_bad, not finite_weights]
        if world_size > 1:  # ranks see other losses: they decide together, so all stop or none
            agreed = torch.tensor(flags, dtype=torch.float32, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            flags = [bool(f) for f in agreed.tolist()]
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
            if self.precision.loss_scaling == "static":
                cause = f"lower --loss_scale={scale:g} (or use --loss_scale=dynamic), or {cause.replace('lower ', '')}"
            why = (f"step {step}: the run diverged: {skips} steps in a row (to step {at}) were skipped for inf/NaN "
                   f"gradients, more than the loss scale ({self.precision.loss_scaling}, {scale:g}) can explain "
                   f"({self.allowance(scale)}); {cause}")
        elif flags[2]:
            why = f"step {step}: the run diverged: the weights of this step give a loss of {probe_loss}; {cause}"
        else:
            return
        raise RunError(f"{why}; stopping without writing a snapshot, {note}")


@eagerly
@torch.no_grad()
def probe_loss(model, batch):
    """The loss of the current weights on a fixed batch, in eval mode (no dropout, no FP8 amax
    recorded, no random stream drawn: a run with a probe trains exactly as one without)."""
    model.eval()
    loss = model(*batch)[1].item()
    model.train()
    return loss


def snapshot_note(path, saved_step, resumed_step):
    """Where the last good snapshot is, in words, for the line a stopped run ends with."""
    if saved_step is not None:
        return f"the last snapshot is {path} (step {saved_step})"
    if resumed_step is not None:
        return f"the last snapshot is {path} (step {resumed_step}, resumed from, untouched)"
    return f"this run wrote no snapshot ({path} is as it was)" if Path(path).exists() else "no snapshot was written"


class Guard:
    """What stops a run cleanly, behind one name for train.train_loop: divergence (Divergence, checked
    once per log interval and before each snapshot), the probe loss before a snapshot replaces the last
    good one, where that snapshot is, and the step an interruption reached."""

    def __init__(self, cfg, model, parts, probe_batch, device, world_size, path, resumed_step):
        self.cfg, self.model, self.probe_batch, self.device, self.world_size = cfg, model, probe_batch, device, \
            world_size
        self.path, self.resumed_step, self.saved_step, self.done = path, resumed_step, None, resumed_step or 0
        self.watch = Divergence(parts.precision)
        opt = parts.optimizer
        self.weights = opt.model_params + (opt.master_params if opt.master_weights else [])

    def after_step(self, step, loss, stepped, scale, snapshot_due):
        """step: the step just done (1-based); scale: the loss scale it ran with. Raises RunError."""
        self.watch.after_step(step, loss, stepped, scale)
        self.done = step
        if snapshot_due or step % self.cfg.log_interval == 0:  # one host sync per log interval
            replaces = snapshot_due and Path(self.path).exists()  # a good snapshot goes only for finite weights
            probe = probe_loss(self.model, self.probe_batch) if replaces else None
            self.watch.check(step, self.weights, self.cfg, self.note(), probe, self.world_size, self.device)

    def saved(self, step):
        self.saved_step = step

    def note(self):
        return snapshot_note(self.path, self.saved_step, self.resumed_step)

    @contextmanager
    def interruptible(self):
        """Ctrl-C and SIGTERM say the step reached and where the last snapshot is."""
        try:
            yield
        except Interrupted as e:
            e.where = f"step {self.done} of {self.cfg.max_iters}; {self.note()}"
            raise


# ---------------------------------------------------------------- one run per out_dir

@contextmanager
def out_dir_lock(folder):
    """Hold out_dir for a run's whole life: an exclusive flock on out_dir/.memtrain.lock, which
    the OS releases when the process ends however it ends (kill -9 leaves no stale lock). A second
    run on the same out_dir is refused in one line. On the way out the lock file is removed, and
    any folder made for it, if still empty, so a refused or failed start leaves nothing behind. A file
    of that name that is no lock of ours (LOCK_TEXT) is the user's: refused, never written or removed."""
    folder = Path(folder)
    made = [p for p in [folder, *folder.parents] if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _acquire(folder / LOCK, folder)
    except BaseException:
        _remove_folders(made)
        raise
    try:
        yield
    finally:
        try:  # removed while still held: a run that opened it meanwhile sees the name is gone (_acquire)
            (folder / LOCK).unlink()
        except OSError:
            pass
        os.close(fd)
        _remove_folders(made)


def _acquire(path, folder):
    while True:
        try:  # O_NOFOLLOW: a link of that name is the user's, never written through
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                raise _not_ours(path, folder) from None
            raise UsageError(f"--out_dir={folder} cannot be written: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not LOCK_TEXT.fullmatch(os.pread(fd, 64, 0)):
            os.close(fd)
            raise _not_ours(path, folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(f"--out_dir={folder}: cannot lock {path}: {e.strerror or e}") from None
            raise UsageError(f"--out_dir={folder} is in use by another run (pid {holder or '?'}): one run per "
                             f"out_dir, so neither overwrites the other's snapshot; wait for it or choose another "
                             f"--out_dir") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # its holder removed it as we opened it: lock the file now under that name


def _not_ours(path, folder):
    return UsageError(f"--out_dir={folder}: {path} is not a lock of this program's (one holds a pid, or nothing): "
                      f"it is left as it is; move it, or choose another --out_dir")


def _remove_folders(made):
    for p in made:  # deepest first
        try:
            p.rmdir()
        except OSError:
            pass


# ---------------------------------------------------------------- a rank, or its launcher, lost

@contextmanager
def lost_ranks_named():
    """Around a torchrun rank's life once its process group forms: a collective that fails because
    another rank is gone (kill -9, SIGTERM, a crash) ends this one in a line naming it, not in gloo's
    traceback. Every rank's host and pid are gathered first (a collective: every rank enters)."""
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    try:
        yield
    except RuntimeError as e:  # gloo's and NCCL's errors (torch.distributed.DistError is one)
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}  # torchrun's SIGTERM comes next: say it first
        if line := launcher_gone():  # torchrun itself is gone, and with it every rank: that is the news
            ended(line)
        gone = _gone(table, e)
        if gone is None:
            for s, h in previous.items():
                signal.signal(s, h)
            raise
        # at once (interrupts.ended): no snapshot is being written while a collective fails, so nothing
        # needs unwinding, and freeing the DDP wrapper now can deadlock in gloo
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
