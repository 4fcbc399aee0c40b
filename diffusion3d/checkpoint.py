"""Checkpoints: atomic save, finding the newest valid one (in a run or its checkpoints folder), retention,
the resume compatibility check, the folder lock (one writer per results folder) and storage errors
(ENOSPC, EIO, read-only) as one-line faults."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not POSIX: no folder lock (a warning says so)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
NAME = re.compile(r"^step_(\d{8,})\.pt$")
REQUIRED_KEYS = ("format_version", "model", "ema", "optimizer", "scaler", "step", "samples_seen", "config")

# Config keys whose change breaks a run's continuation (model shape, data, randomness, schedule).
BREAKING_KEYS = {
    "model": ("with_condition", "channels", "num_res_blocks", "attention_levels", "num_head_channels", "norm_num_groups"),
    "diffusion": ("timesteps", "schedule", "prediction"),
    "data": (
        "image_dir", "mask_dir", "manifest", "image_suffix", "mask_suffix", "labels", "orientation", "spacing",
        "intensity", "lower_percentile", "upper_percentile", "intensity_range", "image_size", "resize_mode",
        "num_val_cases",
    ),
    "train": ("seed",),
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run; the message names the file."""


class StorageError(RuntimeError):
    """Writing failed in the OS (no space, I/O error, read-only or forbidden folder): a fault, not bad input.

    One line naming the path and the OS error; the command line exits 1 with it.
    """

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class FolderLockedError(RuntimeError):
    """Another live process holds the folder's lock; the message names the folder and its pid."""


def storage_error(path: Path | str, exc: OSError, what: str) -> StorageError:
    """``path: cannot write <what>: <OS error> (ENOSPC)`` from an OSError, with a hint for the full disk."""
    code = exc.errno
    reason = exc.strerror or str(exc) or type(exc).__name__
    name = f" ({errno.errorcode[code]})" if code in errno.errorcode else ""
    hint = "; free some space and run the same command again" if code in (errno.ENOSPC, errno.EDQUOT) else ""
    return StorageError(f"{path}: cannot write {what}: {reason}{name}{hint}", code)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


TEMP_NAME = re.compile(r"^\..+\.tmp\.\d+$")  # .step_00000004.pt.tmp.<pid>, as save_atomic names them


def state_nbytes(state: Any) -> int:
    """Bytes of the tensor storages in ``state`` (each storage counted once): what a save writes, roughly."""
    seen: set[int] = set()
    total = 0
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return total


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """StorageError (ENOSPC) before a write of ``needed`` bytes that the folder's filesystem cannot take."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return  # cannot tell: let the write itself find out
    if free < needed:
        raise StorageError(
            f"{folder}: not enough free space for {what}: needs about {needed / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB free; free some space and run the same command again", errno.ENOSPC
        )


class _TrackedFile:
    """A file wrapper that remembers the OSError of a failed write: torch.save reports it as a bare
    RuntimeError ("file write failed"), which would hide ENOSPC / EIO from the user."""

    def __init__(self, f) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self._f.flush()


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Temp file in the same folder, flushed and fsynced, then ``os.replace``: never a partial file.

    Refuses to start when the filesystem has less free space than the state's tensors need. Any OS
    failure (ENOSPC, EIO, read-only) raises StorageError naming the path; the temp file is removed and
    the checkpoints already there are untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(path.parent, e, "the checkpoint folder") from None
    needed = int(state_nbytes(state) * 1.05) + 2**20  # pickled structure and zip headers on top of the tensors
    check_free_space(path.parent, needed, f"checkpoint {path.name}")
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tracked = None
    try:
        with open(tmp, "wb") as f:
            tracked = _TrackedFile(f)
            torch.save(state, tracked)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise storage_error(path, e, "checkpoint") from None
    except RuntimeError:
        if tracked is not None and tracked.error is not None:
            raise storage_error(path, tracked.error, "checkpoint") from None
        raise
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete temp files a killed writer left in ``folder`` (call only while holding the folder's lock)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in folder.iterdir():
        if TEMP_NAME.match(p.name) and p.is_file():
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    if removed:
        log.info("removed %d temp file(s) left by an interrupted write in %s", len(removed), folder)
    return removed


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


def load(path: Path) -> dict[str, Any]:
    """Read and sanity-check a checkpoint; CheckpointError names the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated or foreign files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: unreadable checkpoint ({first[:200]})") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED_KEYS):
        raise CheckpointError(f"{path}: not a diffusion3d checkpoint (missing keys)")
    if state["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {state['format_version']} is newer than this diffusion3d")
    _check_config_section(path, state["config"])
    return state


def _check_config_section(path: Path, raw: Any) -> None:
    """The saved config must be a usable config: resume and sampling rebuild the model from it."""
    from . import config as C

    try:
        C.validate(C.from_dict(raw, "config"))
    except C.ConfigError as e:
        raise CheckpointError(f"{path}: the checkpoint's config section is unusable ({e})") from None
    except Exception as e:  # garbage of any shape
        raise CheckpointError(f"{path}: the checkpoint's config section is unusable ({type(e).__name__}: {e})") from None


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint file in ``folder``, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := NAME.match(p.name))]
    return sorted(found)


def load_latest_valid(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; corrupt ones are reported (logged) and skipped."""
    for _, path in reversed(list_checkpoints(folder)):
        try:
            return path, load(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
    return None


def find_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint file, or a run folder or its ``checkpoints/`` folder: its newest valid checkpoint.

    The one lookup behind ``sample --checkpoint`` and ``train --resume PATH``; CheckpointError names the
    file or folder."""
    path = Path(path)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = load_latest_valid(folder)
        if found is None:
            raise CheckpointError(f"{folder}: no valid checkpoint (step_*.pt) in this folder")
        return found
    return path, load(path)


def apply_retention(folder: Path, keep_last: int, milestone_every: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` and every ``milestone_every``-th step; returns what went."""
    found = list_checkpoints(folder)
    keep = {p for _, p in found[-max(keep_last, 1):]}
    if milestone_every > 0:
        keep |= {p for step, p in found if step % milestone_every == 0}
    if protect is not None:
        keep.add(Path(protect))
    removed = []
    for _, path in found:
        if path not in keep:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between two config dicts, each as 'section.key: old -> new'."""
    breaking, harmless = [], []
    for section in sorted(set(saved) | set(current)):
        old, new = saved.get(section), current.get(section)
        if not isinstance(old, dict) or not isinstance(new, dict):
            if old != new and section != "name":
                harmless.append(f"{section}: {old!r} -> {new!r}")
            continue
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                line = f"{section}.{key}: {old.get(key)!r} -> {new.get(key)!r}"
                (breaking if key in BREAKING_KEYS.get(section, ()) else harmless).append(line)
    return breaking, harmless
