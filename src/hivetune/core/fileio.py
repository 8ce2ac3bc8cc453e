"""Writing files safely: atomic writes (temp file in the same folder, fsync, rename: a crash leaves old
or new), folders replaced whole the same way, clear errors for a full or read-only disk, names from
data kept inside their folder, the marker that makes a folder a run folder, and the lock that keeps
two trainers out of one run folder."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

try:
    import fcntl
except ImportError:  # not on Linux / macOS: run folders are not locked
    fcntl = None

from hivetune.core.errors import UserError


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so a rename or a new file in it survives a power loss."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, so the rename that publishes it comes after them."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb+") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


# Tests set this to a number of seconds to sleep at the stages of a checkpoint or adapter write,
# so that a SIGKILL sent at a chosen moment lands inside that stage.
SLOW_ENV = "HIVETUNE_TEST_SLOW_CHECKPOINT"


def sha256_file(path: Path) -> str:
    """The file's sha256, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pause_for_tests() -> None:
    seconds = float(os.environ.get(SLOW_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)


def atomic_write_with(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_path), fsync it, then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


# ---- folders replaced whole ----------------------------------------------------------------------
#
# A folder of several files (an adapter: weights + config) cannot be switched file by file: a
# crash between two renames leaves new weights beside an old config. write_folder_atomically
# writes a whole temp sibling, then swaps folders with two renames (old aside, new in); a crash
# between those leaves no folder but a complete old one aside, which recover_folder puts back.
#
#   killed while ...            on disk                                 recover_folder
#   writing .NAME.tmp-PID       NAME (old), part of .tmp                removes .tmp
#   between the renames         .NAME.old-PID, .NAME.tmp-PID (whole)    renames .old back to NAME
#   removing .NAME.old-PID      NAME (new), part of .old                removes .old


def write_folder_atomically(folder: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp) on an empty temp sibling of `folder`, fsync it, then put it in place of
    `folder` (replace_folder): a crash at any moment leaves the old folder or the new one, each
    complete (between the two renames the old one is aside: recover_folder puts it back). Only
    one process may write `folder` (a run folder's lock): an earlier one's leftovers go first."""
    folder = Path(folder)
    recover_folder(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        fsync_dir(tmp)
        pause_for_tests()
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cache_dir() -> Path:
    """hivetune's cache: $HIVETUNE_CACHE, else $XDG_CACHE_HOME/hivetune or ~/.cache/hivetune."""
    root = os.environ.get("HIVETUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hivetune")
    return Path(root)


def file_cache_folder(path: Path, kind: str, *more: Path) -> Path:
    """The cache folder of what hivetune derives from the file at `path` (and the files `more`;
    `kind`: tokenizers, models), keyed by their resolved paths, sizes and mtimes: a rewritten file
    gets a new folder."""
    stamps = []
    for p in (Path(path), *map(Path, more)):
        st = p.stat()
        stamps.append(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    key = hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:16]
    return cache_dir() / kind / key


def fill_cache_folder(folder: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) into a temp sibling, then rename it to `folder`, so a reader sees the folder
    complete or not at all. Another process that got there first keeps its folder; a cache that
    cannot be written (read-only, full) only costs time: nothing is raised, nothing is left."""
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_folder(tmp: Path, out: Path) -> None:
    """Rename tmp to out. An existing out is renamed aside (.NAME.old-PID) first and removed after;
    if tmp cannot be renamed in, the old one goes back."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        if old is not None:
            pause_for_tests()
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        _remove(old)


def recover_folder(folder: Path) -> None:
    """After a process was killed in write_folder_atomically(folder): put the old folder back if
    it was killed between the two renames; remove temp and old folders (see the table above).
    Only while no other process writes `folder`."""
    folder = Path(folder)
    if not folder.parent.is_dir():
        return
    prefix = f".{folder.name}."
    leftovers = sorted(p for p in folder.parent.iterdir()
                       if p.name.startswith((prefix + "tmp-", prefix + "old-")))
    for p in leftovers:
        if p.name.startswith(prefix + "old-") and not (folder.exists() or folder.is_symlink()):
            os.replace(p, folder)  # complete: it was renamed aside whole
            fsync_dir(folder.parent)
        else:
            _remove(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# ---- errors of a full or read-only disk ----------------------------------------------------------

# No space, no quota left, a read-only file system, no permission: the output cannot be written.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def is_disk_error(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_ERRNOS


def disk_error_message(e: OSError, what: str = "", folder: Path | None = None) -> str:
    """'checkpoint: cannot write runs/x/...: No space left on device (ENOSPC)'; `folder` names
    where, when the error has no file name (a write() that found the disk full)."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    filename = e.filename or folder
    where = f" {filename}" if filename else ""
    return f"{what + ': ' if what else ''}cannot write{where}: {e.strerror or e} ({name})"


def check_writable(folder: Path, key: str = "output_dir") -> None:
    """Refuse an output folder that cannot be created or written in (read-only file system, no
    permission), before anything is computed. Checks the folder, or its nearest existing parent."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UserError(f"{key}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only file system" if _read_only_fs(probe) else "no write permission"
        raise UserError(f"{key}: cannot write in {probe} ({why})")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


# ---- paths named by data -------------------------------------------------------------------------

def confined(folder: Path, name: str, what: str = "file name") -> Path:
    """folder / name, refused when `name` (read from a file: a manifest, a config) would leave the
    folder: an absolute path, '..', a path separator, or a NUL byte."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or os.path.isabs(name)):
        raise UserError(f"{folder}: {what} {name!r} is not a plain name inside the folder")
    return Path(folder) / name


# ---- the run folder's marker ---------------------------------------------------------------------
#
# A folder is a run folder only when hivetune made it one: .hivetune-run, written first, before
# config.yaml or anything else. A folder without it that holds files is someone else's.

RUN_MARKER = ".hivetune-run"
RUN_FORMAT = 1  # the run folder's layout; a newer hivetune that changes it raises this


def create_run_folder(folder: Path) -> None:
    """Create `folder` (new, or empty but for hivetune's own files) and write its marker first."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / RUN_MARKER).is_file():
        write_run_marker(folder)


def write_run_marker(folder: Path) -> None:
    atomic_write_bytes(Path(folder) / RUN_MARKER,
                       json.dumps({"tool": "hivetune", "format": RUN_FORMAT}).encode() + b"\n")


def run_marker_format(folder: Path) -> int | None:
    """The format in folder/.hivetune-run; None when there is no marker. A marker that is not
    hivetune's JSON is a UserError naming it."""
    path = Path(folder) / RUN_MARKER
    try:
        marker = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a hivetune run marker ({e})") from None
    if not isinstance(marker, dict) or marker.get("tool") != "hivetune" or not isinstance(marker.get("format"), int):
        raise UserError(f"{path}: not a hivetune run marker (expected {{\"tool\": \"hivetune\", \"format\": N}})")
    return marker["format"]


# ---- one trainer per run folder ------------------------------------------------------------------

LOCK_NAME = ".hivetune.lock"
_HELD: dict[str, tuple[int, int]] = {}  # resolved run folder -> (pid, fd of its lock file)


def hold_run_lock(folder: Path) -> int | None:
    """Make this process the only trainer of `folder`, or raise a UserError naming the pid of the
    one that is. Idempotent within a process. Returns the pid of a dead holder taken over, if any.

    The lock is a kernel lock (fcntl.lockf) on folder/.hivetune.lock, so it dies with its process:
    the lock of a crashed, killed or powered-off trainer is free without any clean-up, and a stale
    file (the pid of a process that is gone) is simply taken over. The pid in the file names the
    holder in the message. Where the file system has no locks (ENOLCK), the pid is checked instead.
    release_run_lock removes the file while it holds the lock; a process that locked the removed
    file meanwhile sees that the path names another file (or none) and tries again.
    """
    key = str(Path(folder).resolve())
    if _HELD.get(key, (0, 0))[0] == os.getpid():
        return None
    path = Path(folder) / LOCK_NAME
    for _ in range(100):
        fd, previous = _lock(folder, path)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise UserError(_busy_message(folder, None))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = (os.getpid(), fd)
    return previous if previous and previous != os.getpid() else None


def _lock(folder: Path, path: Path) -> tuple[int, int | None]:
    """(fd of path, locked; the pid the file held) or a UserError naming the live holder."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"output_dir: cannot create the run lock {path} ({e.strerror})") from None
    previous = _pid_in(fd)
    try:
        if fcntl is None:
            raise OSError(errno.ENOLCK, "no fcntl")
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise UserError(_busy_message(folder, previous)) from None
        if previous and previous != os.getpid() and pid_alive(previous):  # no locking here: trust the pid
            os.close(fd)
            raise UserError(_busy_message(folder, previous)) from None
    return fd, previous


def release_run_lock(folder: Path) -> None:
    """Remove the lock file (still locked, so no one else holds it), then unlock by closing it."""
    pid, fd = _HELD.pop(str(Path(folder).resolve()), (0, 0))
    if pid == os.getpid():
        try:
            if os.fstat(fd).st_ino == os.stat(Path(folder) / LOCK_NAME).st_ino:
                os.unlink(Path(folder) / LOCK_NAME)
        except OSError:
            pass  # gone already, or a read-only folder: a stale lock file is taken over later
        os.close(fd)


def release_run_locks() -> None:
    """Release every run lock this process holds: the end of `hivetune train`, on every exit path."""
    for key, (pid, _) in list(_HELD.items()):
        if pid == os.getpid():
            release_run_lock(Path(key))


def _busy_message(folder: Path, pid: int | None) -> str:
    holder = f"pid {pid}" if pid else "another process"
    return (f"output_dir: {folder} is in use by another hivetune train ({holder}); wait for it to finish or "
            f"stop it, or choose another output")


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def die_with_parent() -> None:
    """In a child process (a cycle's tool, torchrun, a torchrun worker): get SIGKILL when the
    process that started it dies (Linux), so a killed command leaves nothing writing into its
    folder or holding its run lock."""
    try:
        import ctypes  # Linux prctl; elsewhere a child outlives a killed parent

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
