"""Every case checked before training: each bad file reported on one line naming it, warnings logged."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config import Config
from .discovery import Case
from .errors import DataError, DataProblems
from .nifti import VolumeInfo, read_volume

log = logging.getLogger(__name__)


def max_volume_bytes(cfg: Config) -> int | None:
    gb = getattr(cfg.data, "max_volume_gb", 2.0)
    if gb is None:
        return None
    if not gb > 0:
        raise DataError(f"max_volume_gb: must be positive or null, got {gb}")
    return int(gb * 2**30)


def _value_counts(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(mask, return_counts=True), by counting (bincount, 10x faster) for integer label maps."""
    if mask.size and mask.dtype.kind in "iu":
        lo, hi = int(mask.min()), int(mask.max())
        if hi - lo <= 65535:
            flat = mask.ravel()
            counts = np.bincount(flat if lo == 0 else flat.astype(np.int64) - lo, minlength=hi - lo + 1)
            present = np.flatnonzero(counts)
            return present + lo, counts[present]
    return np.unique(mask, return_counts=True)


def check_mask_labels(
    path: Path, mask: np.ndarray, labels: Sequence[int], unknown_labels: str = "error"
) -> tuple[dict[int, int], list[str]]:
    """Voxel count per label of a mask, and warnings; DataError for what no model can be conditioned on."""
    if not np.isfinite(mask).all():
        raise DataError(f"{path}: contains NaN or infinite voxels")
    values, counts = _value_counts(mask)
    if np.any(values != np.round(values)):
        raise DataError(f"{path}: mask has non-integer values (is this an image?)")
    label_counts = {int(v): int(c) for v, c in zip(values, counts)}
    warnings = []
    unknown = sorted(set(label_counts) - {0, *labels})
    if unknown:
        msg = f"{path}: labels {unknown} are not in the configured labels {list(labels)}"
        if unknown_labels == "error":
            raise DataError(msg)
        warnings.append(msg + " (treated as background)")
    if not any(label_counts.get(label, 0) for label in labels):
        raise DataError(f"{path}: none of the configured labels {list(labels)} present")
    return label_counts, warnings


def _check_image(path: Path, max_bytes: int | None) -> VolumeInfo:
    info, data = read_volume(path, max_bytes)
    if not np.isfinite(data).all():
        raise DataError(f"{path}: contains NaN or infinite voxels")
    if data.size == 0 or float(data.max()) == float(data.min()):
        raise DataError(f"{path}: constant image (every voxel is {float(data.flat[0]) if data.size else 'empty'})")
    return info


def check_case(case: Case, cfg: Config) -> dict[str, Any]:
    """Validate one case: every file of it, each file read once. Raises DataError naming the file (one bad
    file) or DataProblems (several). Returns its summary (and warnings)."""
    d = cfg.data
    max_bytes = max_volume_bytes(cfg)
    errors: list[str] = []
    infos: dict[Path, VolumeInfo] = {}
    for path in case.images:
        try:
            infos[path] = _check_image(path, max_bytes)
        except DataError as e:
            errors.append(str(e))
    first = case.images[0]
    if not errors:
        for path in case.images[1:]:
            info, ref = infos[path], infos[first]
            if info.shape != ref.shape:
                errors.append(f"{path}: shape {info.shape} differs from {first.name} {ref.shape}")
            elif not np.allclose(info.affine, ref.affine, atol=d.shape_tolerance_mm):
                errors.append(f"{path}: affine differs from {first.name}'s beyond tolerance")
    summary: dict[str, Any] = {"case": case.name, "warnings": []}
    if case.mask is not None:
        try:
            minfo, mask = read_volume(case.mask, max_bytes)
            if first in infos and minfo.shape != infos[first].shape:
                raise DataError(f"{case.mask}: mask shape {minfo.shape} differs from image shape {infos[first].shape}")
            if first in infos and not np.allclose(minfo.affine, infos[first].affine, atol=d.shape_tolerance_mm):
                raise DataError(f"{case.mask}: mask affine differs from the image's ({first.name}) beyond tolerance")
            label_counts, warnings = check_mask_labels(case.mask, mask, d.labels, d.unknown_labels)
            summary["warnings"] += warnings
            summary["labels"] = label_counts
        except DataError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise DataError(errors[0])
    if errors:
        raise DataProblems(errors, f"case {case.name!r} has {len(errors)} bad files")
    ref = infos[first]
    summary.update(shape=ref.shape, spacing=tuple(round(s, 4) for s in ref.spacing), orientation=ref.orientation)
    return summary


def _check_case_safely(args: tuple[Case, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    case, cfg = args
    try:
        return check_case(case, cfg), []
    except DataProblems as e:
        return None, e.errors
    except DataError as e:
        return None, [str(e)]
    except MemoryError:
        return None, [f"{case.images[0]}: not enough memory to validate case {case.name!r}"]


def _pool(workers: int):
    """A process pool for validation; fork where the OS has it (cheap: the parent's imports are shared)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def validate(cases: Sequence[Case], cfg: Config, workers: int | None = None) -> list[dict[str, Any]]:
    """Validate every case and report every bad one: DataProblems lists one line per bad file, then
    "k of n cases are bad". Warnings are logged and returned in the summaries.

    ``workers`` (default: data.num_workers) processes check cases in parallel; 0 or 1 checks them here.
    """
    if not cases:
        raise DataError(f"{cfg.data.image_dir}: no cases found")
    max_volume_bytes(cfg)  # a bad ceiling is one error, not one per case
    workers = cfg.data.num_workers if workers is None else workers
    workers = max(0, min(workers, len(cases), os.cpu_count() or 1))
    jobs = [(case, cfg) for case in cases]
    if workers > 1:
        with _pool(workers) as pool:
            results = list(pool.map(_check_case_safely, jobs, chunksize=max(1, len(jobs) // (workers * 8))))
    else:
        results = [_check_case_safely(job) for job in jobs]
    summaries, errors, bad = [], [], 0
    for summary, case_errors in results:
        if case_errors:
            errors += case_errors
            bad += 1
            continue
        for w in summary["warnings"]:
            log.warning(w)
        summaries.append(summary)
    if errors:
        raise DataProblems(errors, f"{bad} of {len(cases)} cases are bad")
    return summaries


def format_summary(summaries: Sequence[dict[str, Any]]) -> str:
    def distinct(key: str) -> str:
        return ", ".join(sorted({str(s[key]) for s in summaries}))

    lines = [
        f"cases: {len(summaries)}",
        f"shapes: {distinct('shape')}",
        f"spacings: {distinct('spacing')}",
        f"orientations: {distinct('orientation')}",
    ]
    if summaries and "labels" in summaries[0]:
        totals: dict[int, int] = {}
        present: dict[int, int] = {}
        for s in summaries:
            for label, count in s["labels"].items():
                totals[label] = totals.get(label, 0) + count
                present[label] = present.get(label, 0) + 1
        lines.append("labels: " + ", ".join(f"{k}: {totals[k]} voxels in {present[k]} cases" for k in sorted(totals)))
    warnings = sum(len(s["warnings"]) for s in summaries)
    if warnings:
        lines.append(f"warnings: {warnings}")
    return "\n".join(lines)
