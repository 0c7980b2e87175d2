"""Files written so that a crash never leaves half of one: atomic writes, the temporary files a killed
run left behind, and a folder probed for writing before anything is built.

Not read to learn the chapter. Read first: `write_atomically` (snapshot.py and every report write
through it), then `remove_stale_temps`.
"""
import os
import re
import stat
from pathlib import Path

from config import UsageError
from guards import interrupts

# write_atomically's temporary files: TARGET.partial-memtrain-<pid>
TEMP = re.compile(r"(.+)\.partial-memtrain-([0-9]{1,7})")
PROBE = ".probe"  # check_writable's probe file, PROBE.partial-memtrain-<pid>
PID_MAX = 2 ** 22  # Linux's largest pid (PID_MAX_LIMIT): a larger number in a name is no pid of ours


def write_atomically(path, write):
    """write(fh) into a temporary file beside `path`, fsync, then rename it over `path`:
    a crash mid-write leaves the previous file intact (or none), never a half-written one."""
    path = Path(path)
    tmp = path.with_name(path.name + f".partial-memtrain-{os.getpid()}")  # a name no user file has
    try:
        with interrupts.raised_through_c(), open(tmp, "wb") as fh:  # a Ctrl-C inside torch.save is no full disk
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temps(folder, targets):
    """Delete the temporary files of writes whose process is gone (a kill -9 mid-write): only
    regular files directly in `folder` named TARGET.partial-memtrain-<pid> for one of `targets`
    (the files this program writes there), so no file of the user's is taken for one."""
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
    if not 0 < pid <= PID_MAX:
        return True  # no pid: not ours to judge, leave the file
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
    """Raise UsageError unless `folder` can be created and written: a probe file is written
    and removed, and any folder made for it is removed again, so nothing is left behind."""
    folder = Path(folder)
    made, probe = [], None
    try:
        for parent in reversed([folder, *folder.parents]):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        probe = folder / f"{PROBE}.partial-memtrain-{os.getpid()}"
        probe.write_bytes(b"probe")  # on a full disk: created, then ENOSPC
    except OSError as e:
        raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
    finally:
        # whatever failed above, nothing of the probe stays (a cleanup error must not hide the first)
        for path in ([probe] if probe else []) + made[::-1]:
            try:
                path.unlink(missing_ok=True) if path is probe else path.rmdir()
            except OSError:
                pass


def check_reachable(folder, flag):
    """check_writable for a rank that writes nothing there, without creating anything (rank 0
    probes the same folder at the same moment): its nearest existing folder must be writable."""
    for parent in [Path(folder), *Path(folder).parents]:
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue  # not there (or rank 0's probe folder, just removed again): look one up
        except OSError as e:
            raise UsageError(f"{flag}={folder} cannot be written: {e.strerror or e}") from None
        if not stat.S_ISDIR(mode):
            raise UsageError(f"{flag}={folder} cannot be written: {parent} is not a folder")
        if not os.access(parent, os.W_OK | os.X_OK) and parent.exists():
            raise UsageError(f"{flag}={folder} cannot be written: Permission denied")
        return
