"""The command line: --key=value flags into a Config, --help, and every program's one-line ending.

Not read to learn the chapter. Read config.py first (the keys), then `parse_args`, then `run`
(bad input is one line and exit status 2, a run that cannot go on one line and 1, Ctrl-C and
SIGTERM one line and 130 or 143, never a traceback).
"""
import sys
from dataclasses import fields

import checkpoint
import precision
from config import NUMBER, Config, RunError, UsageError, check_keys, validate
from guards import compiling, interrupts
from guards.preflight import launcher_error, torch_floor_error


def _convert(f, text):
    if f.type is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"--{f.name} expects true or false (1/0, yes/no, on/off), got {text!r}")
    if f.type is float and text.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        raise UsageError(f"--{f.name} must be a finite number, got {text!r}")
    if f.type in NUMBER and not NUMBER[f.type].fullmatch(text):
        kind = {int: "int (an integer)", float: "float (a number)"}[f.type]
        raise UsageError(f"--{f.name} expects {kind}, got {text!r}")
    if f.type is int and len(text) > 4000:  # int() refuses past 4,300 digits; config.check_keys bounds the rest
        raise UsageError(f"--{f.name} expects an int64, got an integer of {len(text.lstrip('+-'))} digits")
    return f.type(text)


def shown(text):
    """`text` on one line: a control character (a newline inside a value) is written as its escape,
    so an error message stays one line and no value can print a line of its own."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def parse_args(argv, *extra):
    """Config from ["--key=value", ...]; a bare --flag sets a bool to true. Every program parses here:
    config.validate, then the rules the recompute policy's class and the optimizer's spec hold.

    `extra`: more dataclasses of keys (a tool's own options, e.g. the ledger's --tp): their
    flags are parsed in the same pass and one instance of each is returned after the Config."""
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
        if not eq:
            if f.type is not bool:
                raise UsageError(f"--{name} needs a value: --{name}=...")
            text = "true"
        values[cls][name] = _convert(f, text)
    cfg = validate(Config(**values[Config]))
    if why := compiling.cache_folder_error():
        raise UsageError(why)
    checkpoint.policy(cfg)
    precision.optimizer_spec(cfg)
    if not extra:
        return cfg
    tools = [cls(**values[cls]) for cls in extra]
    for t in tools:
        check_keys(t)
    return (cfg, *tools)


def usage(program="train.py", *extra):
    """The --help text: every key with its default (or choices) and meaning; CKPT's choices are
    checkpoint.POLICIES' names."""
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
    """The keys named on a command line (to refuse a flag a program would silently ignore)."""
    return {arg[2:].partition("=")[0] for arg in argv if arg.startswith("--")}


def run(program, argv):
    """Every program's main: program(argv) -> exit status. Bad input is one line and status 2;
    a run that cannot go on, one line and status 1; Ctrl-C and SIGTERM, one line (the step
    reached, where the last snapshot is) and 130 or 143. Both signals unwind (interrupts.Interrupted),
    so a file being written atomically is finished or abandoned, never left half-written.
    A torch older than this code supports, and a malformed torchrun environment, are refused first,
    in the same one line."""
    if why := torch_floor_error() or launcher_error():
        return say(f"error: {why}", 2)
    interrupts.watch_launcher()  # under torchrun: its kill -9 must not leave this rank running or waiting
    try:
        with interrupts.signals_handled():
            return program(argv) or 0
    except UsageError as e:
        return say(f"error: {e}", 2)
    except RunError as e:
        return say(f"error: {e}", 1)
    except interrupts.Interrupted as e:
        return say(e.line(), 128 + e.signum)


def say(line, status):
    """The one line on stderr, in one write: torchrun's ranks share the terminal (python -u)."""
    sys.stderr.write(shown(line) + "\n")
    sys.stderr.flush()
    interrupts.line_written()
    return status
