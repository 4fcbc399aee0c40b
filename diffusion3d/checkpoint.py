"""Checkpoints: atomic save (``storage.atomic_write``, free space checked first), finding the newest valid one
(in a run or its checkpoints folder), choosing what to resume, retention and the resume compatibility check.
The folder lock and the storage errors live in ``storage``."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from .config import WAVELET, Config, keys_where
from .storage import atomic_write, check_free_space, storage_error

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
NAME = re.compile(r"^step_(\d{8,})\.pt$")
REQUIRED_KEYS = ("format_version", "model", "ema", "optimizer", "scaler", "step", "samples_seen", "config")

# Config keys whose change breaks a run's continuation (model shape, data, randomness, schedule): section ->
# key names, as each key's metadata in config.py says (``key(..., breaks_resume=True)``).
BREAKING_KEYS = keys_where("breaks_resume")
WAVELET_ONLY_KEYS = keys_where("wavelet_only")  # inert in pixel space


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run; the message names the file."""


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
    """``storage.atomic_write`` of ``torch.save(state)``: never a partial file.

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
    atomic_write(path, lambda tmp: _torch_save(state, tmp), "checkpoint")


def _torch_save(state: dict[str, Any], tmp: Path) -> None:
    with open(tmp, "wb") as f:
        tracked = _TrackedFile(f)
        try:
            torch.save(state, tracked)
        except RuntimeError:
            if tracked.error is not None:  # torch.save's "file write failed": the OSError underneath
                raise tracked.error from None
            raise


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
        raise CheckpointError(
            f"{path}: the checkpoint's config section is unusable ({type(e).__name__}: {e})"
        ) from None


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
    keep = {p for _, p in found[-max(keep_last, 1) :]}
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
    """(breaking, harmless) differences between two config dicts, each as 'section.key: old -> new'. A key
    the saved config lacks (a checkpoint written before the key existed) counts as its built-in default: a
    new key's default is the behaviour before it, so such a checkpoint still resumes. A key that acts only in
    wavelet space (``wavelet_only``) is harmless where both configs train in pixel space."""
    breaking, harmless = [], []
    defaults = Config().to_dict()
    for section in sorted(set(saved) | set(current)):
        if section == WAVELET:
            continue  # values for a space the run may not train in; a wavelet run's are in its sections
        old, new = saved.get(section), current.get(section)
        if isinstance(old, dict) and isinstance(defaults.get(section), dict):
            old = {**defaults[section], **old}
        if not isinstance(old, dict) or not isinstance(new, dict):
            if old != new and section != "name":
                harmless.append(f"{section}: {old!r} -> {new!r}")
            continue
        inert = WAVELET_ONLY_KEYS.get(section, ()) if old.get("space") == new.get("space") == "pixel" else ()
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                line = f"{section}.{key}: {old.get(key)!r} -> {new.get(key)!r}"
                breaks = key in BREAKING_KEYS.get(section, ()) and key not in inert
                (breaking if breaks else harmless).append(line)
    return breaking, harmless


def select_checkpoint(
    resume: str, overwrite: bool, folder: Path, config: dict[str, Any]
) -> tuple[Path, dict[str, Any]] | None:
    """Apply ``--resume auto|none|PATH`` to a run's ``checkpoints/`` folder: None to start afresh, else the
    (path, state) to continue from (PATH: a file, or a run or checkpoints folder: its newest valid one).
    CheckpointError for what cannot be resumed: checkpoints that ``none`` would silently replace, a folder of
    only corrupt files, a config that differs in keys that break the run."""
    folder = Path(folder)
    existing = list_checkpoints(folder)
    if resume == "none":
        if existing and not overwrite:
            raise CheckpointError(
                f"{folder}: holds {len(existing)} checkpoint(s); use --resume auto to continue "
                "or --overwrite to start afresh"
            )
        return None
    if resume == "auto":
        found = load_latest_valid(folder)
        if found is None and existing:
            raise CheckpointError(f"{folder}: no valid checkpoint among {len(existing)} file(s)")
    else:
        found = find_checkpoint(Path(resume))
    if found is None:
        return None
    path, state = found
    breaking, harmless = config_differences(state["config"], config)
    if breaking:
        raise CheckpointError(
            f"{path}: the config differs from the checkpoint's in ways that break the run: "
            + "; ".join(breaking)
            + " (give the checkpoint's values as flags to continue it, use another --results_dir, "
            "or --resume none --overwrite)"
        )
    for line in harmless:
        log.info("config change since the checkpoint (allowed): %s", line)
    return path, state
