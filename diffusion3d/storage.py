"""Writing safely: storage errors, free-space checks, atomic writes and one writer per folder.

The bottom layer (it imports nothing of the package): checkpoints, the resolved config, JSON/CSV tables,
NIfTI samples and TensorBoard events all report an OS failure as one ``StorageError`` naming the file
(a fault: the command line exits 1), and every command claims its output folder with ``claim_folder``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: folders are not locked (warned once per lock)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """Writing failed in the OS (no space, I/O error, read-only or forbidden folder): a fault, not bad input.

    One line naming the path and the OS error; the command line exits 1 with it.
    """

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class FolderError(RuntimeError):
    """A folder that cannot be used for output (a file stands at its path, or it holds outputs that
    ``--overwrite`` was not given for): bad input, exit 2."""


class FolderLockedError(FolderError):
    """Another live process holds the folder's lock; the message names the folder and its pid."""


def storage_error(path: Path | str, exc: OSError, what: str) -> StorageError:
    """``path: cannot write <what>: <OS error> (ENOSPC)`` from an OSError, with a hint for the full disk."""
    code = exc.errno
    reason = exc.strerror or str(exc) or type(exc).__name__
    name = f" ({errno.errorcode[code]})" if code in errno.errorcode else ""
    hint = "; free some space and run the same command again" if code in (errno.ENOSPC, errno.EDQUOT) else ""
    return StorageError(f"{path}: cannot write {what}: {reason}{name}{hint}", code)


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """StorageError (ENOSPC) before a write of ``needed`` bytes that the folder's filesystem cannot take."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # cannot tell: let the write itself find out
    if free < needed:
        raise StorageError(
            f"{folder}: not enough free space for {what}: needs about {needed / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free; free some space and run the same command again",
            errno.ENOSPC,
        )


def atomic_write(
    path: Path | str, write: Callable[[Path], None], what: str, *, tmp_name: str | None = None, fsync: bool = True
) -> None:
    """``write(tmp)`` fills a temp file in the same folder, which is fsynced and then ``os.replace``d onto
    ``path`` (and the folder fsynced): readers see the old file or the new one, never a part. Any OS
    failure raises StorageError naming ``path`` and ``what``; the temp file is removed. ``tmp_name`` keeps
    a suffix a writer needs (nibabel's ``.nii.gz``)."""
    path = Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.tmp.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        if fsync:
            _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
        if fsync:
            _fsync(path.parent, os.O_RDONLY)
    except OSError as e:
        raise storage_error(path, e, what) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path | str, text: str, what: str) -> None:
    """A text file (config, JSON, CSV) written atomically; StorageError on an OS failure."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), what)


# ---- one writer per folder ------------------------------------------------------------------------------
LOCK_NAME = ".lock"


class FolderLock:
    """An exclusive ``flock`` on ``<folder>/.lock`` (which holds the owner's pid). The kernel drops it when
    the process ends, however it ends, so a SIGKILLed run never leaves a stale lock behind (at most a
    stale *file*, which the next process simply locks). A clean release removes the file, while still
    holding the lock; lock_folder re-checks that the file it locked is still the one at the path."""

    def __init__(self, folder: Path, fd: int | None) -> None:
        self.folder, self._fd, self._pid = Path(folder), fd, os.getpid()

    def release(self) -> None:
        if self._fd is not None and os.getpid() == self._pid:  # never from a forked child (loader workers)
            fd, self._fd = self._fd, None
            try:
                with contextlib.suppress(OSError):
                    (self.folder / LOCK_NAME).unlink()
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _holder_pid(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 32).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


def lock_folder(folder: Path, what: str = "run") -> FolderLock:
    """Take ``folder``'s lock (creating the folder) or raise FolderLockedError naming the holder's pid."""
    folder = Path(folder)
    lock_path = folder / LOCK_NAME
    for _ in range(100):  # retried only while other processes release (and remove) the file under us
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise storage_error(lock_path, e, "the folder's lock file") from None
        if fcntl is None:
            os.close(fd)
            log.warning("%s: no fcntl on this system; another process could write into this folder too", folder)
            return FolderLock(folder, None)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderLockedError(
                    f"{folder}: in use by another {what} (pid {holder}); wait for it to end or use another folder"
                ) from None
            raise storage_error(lock_path, e, "the folder's lock") from None
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # locked a file its holder removed on release: lock the current one instead
    else:
        raise FolderLockedError(f"{folder}: its lock file keeps changing; another process is taking it")
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass  # the lock holds without the pid; a second process then reports "pid unknown"
    return FolderLock(folder, fd)


def claim_folder(folder: Path | str, what: str, outputs: Sequence[str] = (), overwrite: bool = False) -> FolderLock:
    """The one way a command takes an output folder: refuse a path that is a file (FolderError), lock it
    (FolderLockedError names the holder), and refuse when one of ``outputs`` is already there unless
    ``overwrite`` (checked after locking, so a run that finished meanwhile is seen). Returns the held lock."""
    check_target(folder, outputs, overwrite)
    lock = lock_folder(folder, what)
    try:
        check_target(folder, outputs, overwrite)
    except FolderError:
        lock.release()
        raise
    return lock


def check_target(folder: Path | str, outputs: Sequence[str] = (), overwrite: bool = False) -> None:
    """FolderError when a file stands at ``folder``, or one of ``outputs`` already exists in it and
    ``overwrite`` is not set. Writes nothing: commands call it before their work, ``claim_folder`` again."""
    if Path(folder).exists() and not Path(folder).is_dir():
        raise FolderError(f"{folder}: exists and is not a folder")
    existing = [Path(folder) / n for n in outputs if (Path(folder) / n).exists()]
    if existing and not overwrite:
        raise FolderError(f"{existing[0]}: already exists; use --overwrite to replace")
