"""Checkpoints: atomic save, newest-valid discovery, retention, and the resume compatibility check."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

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


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Temp file in the same folder, flushed and fsynced, then ``os.replace``: never a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
    return state


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
