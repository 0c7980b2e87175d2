"""The command line and how every program ends: --key=value flags into a Config, --help, and one line for each
way out, never a traceback: bad input (exit 2), a run that cannot go on (1), Ctrl-C and SIGTERM (130, 143).

Not read to learn the chapter. Read config.py first (the keys), then `parse_args`, then `run`, then
`Interrupted` (the first signal unwinds the program, so a file being written is finished or abandoned) and
`at_once` (where nothing needs unwinding, or the user will not wait for it), then `watch_launcher` (a
torchrun rank whose torchrun is gone ends in one line too). No torch at the top: train.py calls
`from_the_start` before it imports torch, which takes seconds (a Ctrl-C there was a traceback).
"""
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import fields
from types import SimpleNamespace

from config import NUMBER, Config, RunError, UsageError, validate



# ---------------------------------------------------------------- the command line

def _convert(f, text):
    if f.type is bool:
        if text.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return text.lower() in ("1", "true", "yes", "on")
        raise UsageError(f"--{f.name} expects true or false (1/0, yes/no, on/off), got {text!r}")
    if f.type is float and text.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        raise UsageError(f"--{f.name} must be a finite number, got {text!r}")
    if f.type in NUMBER and not NUMBER[f.type].fullmatch(text):
        raise UsageError(f"--{f.name} expects {'int (an integer)' if f.type is int else 'float (a number)'}, "
                         f"got {text!r}")
    if f.type is int and len(text) > 4000:  # int() refuses past 4,300 digits; config.validate bounds the rest
        raise UsageError(f"--{f.name} expects an int64, got an integer of {len(text.lstrip('+-'))} digits")
    return f.type(text)


def shown(text):
    """`text` on one line: a control character (a newline inside a value) is written as its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def parse_args(argv, *extra):
    """Config from ["--key=value", ...]; a bare --flag sets a bool to true. Every program parses here:
    PRECISION=auto decided for this machine (precision.native), config.validate, then what the recompute
    policy's class and the optimizer's spec hold. `extra`: more dataclasses of keys (a tool's own options,
    e.g. the ledger's --tp), parsed in the same pass; one instance of each is returned after the Config."""
    import precision  # torch: not before train.py has its signals
    owners = {f.name: (cls, f) for cls in (Config, *extra) for f in fields(cls)}
    values = {cls: {} for cls in (Config, *extra)}
    for arg in argv:
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}; use --key=value (see --help)")
        name, eq, text = arg[2:].partition("=")
        if name not in owners:
            raise UsageError(f"unknown flag --{name} (see --help)")
        cls, f = owners[name]
        if name in values[cls]:
            raise UsageError(f"--{name} is given twice")
        if not eq and f.type is not bool:
            raise UsageError(f"--{name} needs a value: --{name}=...")
        values[cls][name] = _convert(f, text if eq else "true")
    cfg = checked(precision.decided_here(Config(**values[Config])))
    if (folder := os.environ.get("TORCHINDUCTOR_CACHE_DIR")) and (why := cache_folder_error(folder)):
        raise UsageError(why)
    return (cfg, *(validate(cls(**values[cls])) for cls in extra)) if extra else cfg


def checked(cfg):
    """cfg by every rule a run's config keeps (a command line's, a snapshot's): config.validate, then what the
    recompute policy's class holds (checkpoint.policy). The optimizer's name is its spec's (build.py asks it)."""
    if validate(cfg).ckpt != "none":  # the policies are checkpoint.py's classes
        import checkpoint
        checkpoint.policy(cfg)
    return cfg


def cache_folder_error(folder):
    """Why torch could not make its compile cache folder (TORCHINDUCTOR_CACHE_DIR), or None. Not only
    COMPILE needs it: torch.optim imports torch._dynamo, which makes the folder at import."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        why = "a file, not a folder" if os.path.exists(folder) and not os.path.isdir(folder) else e.strerror
        return f"TORCHINDUCTOR_CACHE_DIR={folder}: {why}; torch keeps its compile cache there " \
               f"(its optimizers import the compiler): set it to a folder it can make, or unset it"
    return None


def usage(program="train.py", *extra):
    """The --help text: every key with its default (or choices) and meaning."""
    import checkpoint
    import precision
    choices = dict(ckpt=tuple(checkpoint.POLICIES), optimizer=tuple(precision.OPTIMIZERS))
    lines = [f"usage: python {program} [--key=value ...]", ""]
    for cls in (*extra, Config):
        for f in fields(cls):
            options = choices.get(f.name) or f.metadata.get("choices")
            default = "|".join(options) if options else repr(f.default)
            lines.append(f"  --{f.name}={default}".ljust(40) + f" {f.metadata.get('meaning', '')}"
                         + (f" (default {f.default})" if options else ""))
    return "\n".join(lines)


def flags(cfg):
    """cfg as the command line that gives it: --key=value for every key off its default."""
    def text(value):
        return str(value).lower() if isinstance(value, bool) else str(value)
    return [f"--{f.name}={text(getattr(cfg, f.name))}" for f in fields(Config) if getattr(cfg, f.name) != f.default]


def given(argv):
    """The keys named on a command line (what a resume takes from it; a flag a program would ignore)."""
    return {arg[2:].partition("=")[0] for arg in argv if arg.startswith("--")}


# ---------------------------------------------------------------- every program's end

def run(program, argv):
    """Every program's main: program(argv) -> exit status. Bad input is one line and status 2; a run that
    cannot go on, one line and 1; Ctrl-C and SIGTERM, one line (the step reached, where the last snapshot
    is) and 130 or 143. A torch older than this code supports and a malformed torchrun environment first."""
    if why := torch_floor_error() or launcher_error():
        return say(f"error: {why}", 2)
    watch_launcher()  # under torchrun: its kill -9 must not leave this rank running or waiting
    try:
        with signals_handled():
            return program(argv) or 0
    except UsageError as e:
        return say(f"error: {e}", 2)
    except RunError as e:
        return say(f"error: {e}", 1)
    except Interrupted as e:
        return say(e.line(), 128 + e.signum)


def say(line, status):
    """The one line on stderr, in one write: torchrun's ranks share the terminal (python -u)."""
    sys.stderr.write(shown(line) + "\n")
    sys.stderr.flush()
    line_written()
    return status


def torch_floor_error(version=None, floor=(2, 4)):
    """Why this torch is older than the lowest this code runs on, or None. checkpoint.py asks
    torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type), both new in 2.4
    (torch/amp/autocast_mode.py); the rest it calls is older (float8 dtypes and torch._scaled_mm 2.1, whose tuple
    return before 2.5 backends/fp8_gemm.py unpacks; nn.LayerNorm's bias= 2.1). The suite runs on 2.11 to 2.14."""
    import torch
    if tuple(int(n) for n in re.findall(r"[0-9]+", version or torch.__version__)[:2]) >= floor:
        return None
    return (f"torch {version or torch.__version__} is older than this code supports: it needs torch >= "
            f"{'.'.join(map(str, floor))} (torch.get_autocast_dtype(device_type)); the tested range is in the README")


def launcher_error(env=os.environ, torchrun=("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")):
    """Why torchrun's variables in the environment cannot be a run's, or None (int() of 'abc' and a division
    by LOCAL_WORLD_SIZE=0 were tracebacks)."""
    if not any(name in env for name in torchrun):
        return None
    for name in (name for name in torchrun if name in env):
        if not re.fullmatch(r"[0-9]{1,9}", env[name]):
            return f"{name}={env[name]!r} is not a count: torchrun sets it (start the run with torchrun, or unset it)"
    for size, index in (("WORLD_SIZE", "RANK"), ("LOCAL_WORLD_SIZE", "LOCAL_RANK")):
        if env.get(size) == "0":
            return f"{size}=0: a run has at least one process (torchrun sets it: start the run with torchrun)"
        if index in env and size in env and int(env[index]) >= int(env[size]):
            return f"{index}={env[index]} is not below {size}={env[size]}: torchrun numbers its processes from 0 " \
                   f"(start the run with torchrun)"
    unset = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in env]
    if "RANK" in env and unset:  # init_process_group reads all four
        return f"RANK is set but {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not: torchrun sets them " \
               f"all (start the run with torchrun, or unset RANK)"
    if "WORLD_SIZE" in env and "RANK" not in env:
        return "WORLD_SIZE is set but RANK is not: torchrun sets both (start the run with torchrun, or unset " \
               "WORLD_SIZE)"
    return None


# ---------------------------------------------------------------- Ctrl-C, SIGTERM, a lost torchrun

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# how this process ends: `first`, the Interrupted the first signal raised inside signals_handled; `said`, the
# program wrote its one line (a signal after it adds none); `launcher`, the pid of this rank's torchrun once
# watch_launcher watches it; `ending`, held by the thread that ends the process (`ended`)
state = SimpleNamespace(first=None, said=False, launcher=None, ending=threading.Lock())


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM, raised where the program is. A BaseException, as KeyboardInterrupt is: no `except
    Exception` swallows it, and every `finally` on the way out runs (a snapshot being written is abandoned
    and its temporary file removed). `run` prints it as one line and exits with 128 + the signal's number."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum, self.where = signum, ""

    def line(self):
        return f"stopped by {name(self.signum)}" + (f" at {self.where}" if self.where else "")


def name(signum):
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


def _raise_interrupted(signum, frame):
    if state.first is None:
        state.first = Interrupted(signum)
        raise state.first
    if signum == state.first.signum:  # the same signal again: the user will not wait for the unwinding
        at_once(signum, frame)
    # another one while the first unwinds is the same request (torchrun's SIGTERM after the terminal's Ctrl-C)


def at_once(signum, frame):
    """End the process now, in one line: torch still loading (nothing to unwind), a second Ctrl-C while
    the first unwinds, a signal after the program said its line (then no second line). A write in
    progress is left as a temporary file (the last snapshot stays whole), removed at the next start."""
    if not state.said and os.environ.get("RANK", "0") == "0":  # torchrun's other ranks end silently, as ever
        first = state.first
        line = f"{first.line()}; {name(signum)} again: ended at once" if first else f"stopped by {name(signum)}"
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
    killed. A process whose parent dies gets another (init, a subreaper): asked every 0.2 s."""
    if state.launcher is not None or "TORCHELASTIC_RUN_ID" not in os.environ or os.getppid() == 1:
        return
    state.launcher = os.getppid()

    def watch():
        while not (line := launcher_gone()):
            time.sleep(0.2)
        ended(line)  # at once, from this thread: the main one may wait in C (a collective, torchrun's store)
    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def ended(line):
    """A torchrun rank that cannot go on: its one line (unless one was said) and exit 1, now, unwinding nothing:
    it may wait in C, and freeing the DDP wrapper once a peer is gone can deadlock (~ProcessGroupGloo joins
    gloo's thread, which waits for the GIL the freeing thread holds)."""
    with state.ending:  # the main thread and the launcher's watcher may both come here: one line
        if not state.said:
            os.write(2, f"error: {line}\n".encode())
            line_written()
        os._exit(1)


def launcher_gone():
    """The line of a rank whose torchrun is gone, or None while it lives (or none is watched)."""
    if state.launcher is None or os.getppid() == state.launcher:
        return None
    return (f"rank {os.environ.get('RANK', '?')}: its launcher (torchrun, pid {state.launcher}) is gone (killed?): "
            f"this rank stops; the last snapshot written is kept")


def line_written():
    state.said = True


@contextmanager
def signals_handled(handler=_raise_interrupted):
    """Inside, SIGINT and SIGTERM call `handler` (by default: raise Interrupted); the previous handlers
    come back after. handler=signal.SIG_DFL: the signal ends the process at once, for a wait in C that no
    Python handler can interrupt (init_process_group's rendezvous) or a rank with nothing to unwind."""
    state.first = None if handler is _raise_interrupted else state.first
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def raised_through_c():
    """Around a call into C that calls back into Python (torch.save's writer calls our file's write): an
    Interrupted raised in the callback comes out of C as the library's RuntimeError ("unexpected pos",
    then reported as a full disk): raise it as what it is."""
    before = state.first
    try:
        yield
    except Exception:
        if state.first is not before and state.first is not None:
            raise state.first from None
        raise
