"""Ctrl-C and SIGTERM: one line and exit 130 or 143, from a program's first instant to its last, never a traceback;
and a torchrun rank whose torchrun is gone ends in one line too.

Not read to learn the chapter. Read first: `Interrupted` (the first signal unwinds the program, so a
file being written is finished or abandoned), then `signals_handled` (cli.run holds it around every
program), then `at_once` (where nothing needs unwinding, or the user will not wait for it), then
`watch_launcher`.

No torch here: train.py calls `from_the_start` before it imports torch, which takes seconds (a Ctrl-C
there was a KeyboardInterrupt traceback; a kill -9 of torchrun there left its ranks waiting for ever).
"""
import os
import signal
import threading
import time
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_first = None  # the Interrupted the first signal raised inside signals_handled
_line_written = False  # the program wrote its one line (cli.say): a signal after it adds none
_launcher = None  # the pid of this rank's torchrun, once watch_launcher watches it
_ending = threading.Lock()  # held by the thread that ends the process (`ended`)


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM, raised where the program is. A BaseException, as KeyboardInterrupt is:
    no `except Exception` swallows it, and every `finally` on the way out runs (a snapshot being
    written is abandoned and its temporary file removed). cli.run prints it as one line and
    exits with 128 + the signal's number (130, 143)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum, self.where = signum, ""

    def line(self):
        return f"stopped by {name(self.signum)}" + (f" at {self.where}" if self.where else "")


def name(signum):
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


def _raise_interrupted(signum, frame):
    global _first
    if _first is None:
        _first = Interrupted(signum)
        raise _first
    if signum == _first.signum:  # the same signal again: the user will not wait for the unwinding
        at_once(signum, frame)
    # another one while the first unwinds is the same request (torchrun's SIGTERM after the terminal's Ctrl-C)


def at_once(signum, frame):
    """End the process now, in one line: torch still loading (nothing to unwind), a second Ctrl-C while
    the first unwinds, a signal after the program said its line (then no second line). A write in
    progress is left as a temporary file (the last snapshot stays whole), removed at the next start."""
    if not _line_written and os.environ.get("RANK", "0") == "0":  # torchrun's other ranks end silently, as ever
        line = f"{_first.line()}; {name(signum)} again: ended at once" if _first else f"stopped by {name(signum)}"
        os.write(2, (line + "\n").encode())
    os._exit(128 + signum)


def from_the_start():
    """A program's first line, before torch loads: Ctrl-C or SIGTERM is one line from here on, and a
    torchrun rank watches its torchrun."""
    for s in SIGNALS:
        signal.signal(s, at_once)
    watch_launcher()


def watch_launcher():
    """Under torchrun, a thread that ends this rank in one line (exit 1) once torchrun is gone: orphaned
    by a kill -9 of it, its ranks trained on, or waited for its store (in init_process_group) until
    killed. A process whose parent dies gets another (init, a subreaper): asked once a second."""
    global _launcher
    if _launcher is not None or "TORCHELASTIC_RUN_ID" not in os.environ or os.getppid() == 1:
        return
    _launcher = os.getppid()

    def watch():
        while not (line := launcher_gone()):
            time.sleep(1)
        ended(line)  # at once, from this thread: the main one may wait in C (a collective, torchrun's store)
    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def ended(line):
    """A torchrun rank that cannot go on: its one line (unless one was said) and exit 1, now, unwinding nothing:
    it may wait in C, and freeing the DDP wrapper once a peer is gone can deadlock (~ProcessGroupGloo joins
    gloo's thread, which waits for the GIL the freeing thread holds)."""
    with _ending:  # the main thread and the launcher's watcher may both come here: one line
        if not _line_written:
            os.write(2, f"error: {line}\n".encode())
            line_written()
        os._exit(1)


def launcher_gone():
    """The line of a rank whose torchrun is gone, or None while it lives (or none is watched)."""
    if _launcher is None or os.getppid() == _launcher:
        return None
    return (f"rank {os.environ.get('RANK', '?')}: its launcher (torchrun, pid {_launcher}) is gone (killed?): "
            f"this rank stops; the last snapshot written is kept")


def line_written():
    global _line_written
    _line_written = True


@contextmanager
def signals_handled(handler=_raise_interrupted):
    """Inside, SIGINT and SIGTERM call `handler` (by default: raise Interrupted); the previous
    handlers come back after. handler=signal.SIG_DFL: the signal ends the process at once, for
    a wait in C that no Python handler can interrupt (init_process_group's rendezvous: torchrun's
    SIGTERM would otherwise wait there until its 30 s kill) or a rank with nothing to unwind."""
    global _first
    if handler is _raise_interrupted:
        _first = None
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def raised_through_c():
    """Around a call into C that calls back into Python (torch.save's writer calls our file's write):
    an Interrupted raised in the callback comes out of C as the library's RuntimeError ("unexpected
    pos", then reported as a full disk): raise it as what it is."""
    before = _first
    try:
        yield
    except Exception:
        if _first is not before and _first is not None:
            raise _first from None
        raise
