"""What every evaluation reads: sample files and the files they belong to, and volumes on one intensity scale.

Naming: the sampling command writes ``<out>/<case>_sample<i>.nii.gz`` for mask ``<case>``; evaluations find a
sample's mask (and real image) by that case name in other folders (``<case>.nii.gz`` or ``<case>.nii``).

Intensity: every evaluation compares volumes mapped to [0, 1] and clipped — a real image by a fixed range or
its own percentiles, a sample by a fixed range (what the sampling command's output intensity was).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..data import NIFTI_SUFFIXES, DataError, read_volume

SAMPLE_NAME = re.compile(r"^(?P<case>.+)_sample(?P<index>\d+)\.nii(\.gz)?$")


def check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise DataError(f"{folder}: {'not a folder' if folder.exists() else 'folder not found'}")


def find_case_file(folder: Path, case: str) -> Path | None:
    """``<folder>/<case>.nii.gz`` (or ``.nii``) if it exists."""
    for ext in NIFTI_SUFFIXES:
        if (folder / f"{case}{ext}").is_file():
            return folder / f"{case}{ext}"
    return None


def group_samples(samples_dir: Path) -> dict[str, list[tuple[int, Path]]]:
    """``{case: [(i, <case>_sample<i> file), ...]}``, cases and indices sorted; DataError for a missing folder,
    a folder without sample files, or one index written twice (``.nii`` and ``.nii.gz``)."""
    check_folder(samples_dir)
    groups: dict[str, list[tuple[int, Path]]] = {}
    for p in sorted(samples_dir.iterdir()):
        m = SAMPLE_NAME.match(p.name)
        if not p.is_file() or m is None:
            continue
        case, index = m.group("case"), int(m.group("index"))
        samples = groups.setdefault(case, [])
        if any(i == index for i, _ in samples):
            raise DataError(f"{p}: sample {index} of case {case!r} appears twice (.nii and .nii.gz?)")
        samples.append((index, p))
    if not groups:
        raise DataError(f"{samples_dir}: no <case>_sample<i>.nii.gz files in this folder")
    return {case: sorted(groups[case]) for case in sorted(groups)}


def find_partner(sample: Path, folder: Path, case: str, what: str) -> Path:
    """The file of ``case`` in ``folder`` that ``sample`` belongs to; DataError naming the sample otherwise."""
    found = find_case_file(folder, case)
    if found is None:
        raise DataError(f"{sample}: no {what} {case}.nii.gz (or .nii) in {folder}")
    return found


# ---- intensity ----------------------------------------------------------------------------------------
def to_unit(volume: np.ndarray, lo: float, hi: float) -> torch.Tensor:
    """[D, H, W] → [1, 1, D, H, W] float32 in [0, 1]: (v - lo) / (hi - lo), clipped."""
    scale = hi - lo if hi > lo else 1.0
    return torch.from_numpy(np.clip((volume.astype(np.float64) - lo) / scale, 0.0, 1.0).astype(np.float32))[None, None]


def real_bounds(
    volume: np.ndarray, real_range: tuple[float, float] | None, percentiles: tuple[float, float]
) -> tuple[float, float]:
    if real_range is not None:
        return real_range
    lo, hi = np.percentile(volume, percentiles)
    return float(lo), float(hi)


@dataclass(frozen=True)
class Scaling:
    """How real images and samples are mapped to [0, 1] (see the module's doc)."""

    real_range: tuple[float, float] | None = None
    real_percentiles: tuple[float, float] = (0.0, 100.0)
    sample_range: tuple[float, float] = (0.0, 1.0)

    def read(self, path: Path, synthetic: bool) -> np.ndarray:
        """The volume in ``path`` as float32 [D, H, W] in [0, 1]; DataError for an unreadable or non-finite file."""
        _, volume = read_volume(path)
        if not np.isfinite(volume).all():
            raise DataError(f"{path}: contains NaN or infinite voxels")
        bounds = self.sample_range if synthetic else real_bounds(volume, self.real_range, self.real_percentiles)
        return to_unit(volume, *bounds)[0, 0].numpy()
