"""Which cases there are: image/mask folders paired by case name, or a CSV manifest; the validation hold-out."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from .errors import DataError, raise_all
from .nifti import NIFTI_SUFFIXES


@dataclass
class Case:
    name: str
    images: list[Path] = field(default_factory=list)  # one per image channel, in configured order
    mask: Path | None = None


def case_name(path: Path, suffix: str) -> str:
    name = path.name
    for ext in NIFTI_SUFFIXES:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    if suffix and name.endswith(suffix):
        name = name[: -len(suffix)]
    return name


def scan_folder(folder: Path, suffix: str) -> dict[str, Path]:
    if not folder.exists():
        raise DataError(f"{folder}: folder not found")
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(NIFTI_SUFFIXES))
    if not files:
        raise DataError(f"{folder}: no NIfTI files (.nii or .nii.gz) in this folder")
    found: dict[str, Path] = {}
    errors = []
    for p in files:
        name = case_name(p, suffix)
        if name in found:
            errors.append(f"{p}: case name {name!r} also used by {found[name].name}")
        found[name] = found.get(name, p)
    raise_all(errors, "duplicate case names")
    return found


def discover(cfg: Config) -> list[Case]:
    """Pair images and masks by case name (folders) or read them from a CSV manifest.

    Also the one place that decides the model's image channels (one per image folder or manifest image
    column): it records them in ``cfg.data.image_channels``, so the resolved config, and every checkpoint,
    carries them. A value set by hand that differs is a DataError naming the folder or manifest.
    """
    d = cfg.data
    if d.manifest:
        cases = _read_manifest(Path(d.manifest), cfg.model.with_condition)
        _record_image_channels(cfg, len(cases[0].images), d.manifest)
    else:
        image_dirs = d.image_dir if isinstance(d.image_dir, list) else [d.image_dir]
        _record_image_channels(cfg, len(image_dirs), image_dirs[0])
        cases = _pair_folders(image_dirs, d, cfg.model.with_condition)
    return cases


def _record_image_channels(cfg: Config, found: int, source) -> None:
    if cfg.data.image_channels not in (None, found):
        raise DataError(
            f"{source}: {found} image channel(s) per case, but image_channels is set to {cfg.data.image_channels}"
        )
    cfg.data.image_channels = found


def _pair_folders(image_dirs: list[str], d, need_mask: bool) -> list[Case]:
    per_channel = [scan_folder(Path(p), d.image_suffix) for p in image_dirs]
    masks = scan_folder(Path(d.mask_dir), d.mask_suffix) if need_mask else {}
    names = set(per_channel[0])
    errors: list[str] = []  # every unpaired file, one line each
    for folder, found in zip(image_dirs[1:], per_channel[1:]):
        for name in sorted(names - set(found)):
            errors.append(f"{per_channel[0][name]}: no image of case {name!r} in {folder}")
        for name in sorted(set(found) - names):
            errors.append(f"{found[name]}: no image of case {name!r} in {image_dirs[0]}")
    if need_mask:
        for name in sorted(names - set(masks)):
            errors.append(f"{per_channel[0][name]}: image without mask (no case {name!r} in {d.mask_dir})")
        for name in sorted(set(masks) - names):
            errors.append(f"{masks[name]}: mask without image (no case {name!r} in {image_dirs[0]})")
    raise_all(errors, "unpaired files")
    return [Case(n, [found[n] for found in per_channel], masks.get(n)) for n in sorted(names)]


def _image_columns(columns: Sequence[str]) -> list[str]:
    """``image`` alone, or ``image_0``, ``image_1``, ... in numeric order (so image_10 follows image_9)."""
    if "image" in columns:
        return ["image"]
    numbered = [c for c in columns if c.startswith("image_") and c[len("image_") :].isdigit()]
    return sorted(numbered, key=lambda c: int(c[len("image_") :]))


def _read_manifest(path: Path, need_mask: bool) -> list[Case]:
    if not path.is_file():
        raise DataError(f"{path}: manifest not found")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise DataError(f"{path}: manifest has no rows")
    columns = list(rows[0].keys())
    image_cols = _image_columns(columns)
    if not image_cols or "case" not in columns or (need_mask and "mask" not in columns):
        raise DataError(f"{path}: manifest needs columns case, image (or image_0, image_1, ...) and mask")
    base = path.parent
    cases: list[Case] = []
    seen: set[str] = set()
    errors: list[str] = []
    for line, row in enumerate(rows, start=2):  # line 1 is the header
        wanted = [*image_cols, *(["mask"] if need_mask else [])]
        empty = [c for c in ["case", *wanted] if not (row.get(c) or "").strip()]
        if empty:
            errors.append(f"{path}: line {line} has no value for {', '.join(empty)}")
            continue
        name = row["case"].strip()
        if name in seen:
            errors.append(f"{path}: line {line}: case name {name!r} listed twice")
            continue
        seen.add(name)
        files = [(base / row[c].strip()).resolve() for c in wanted]
        missing = [p for p in files if not p.is_file()]
        errors += [f"{p}: file not found (listed in {path}, case {name!r})" for p in missing]
        if not missing:
            cases.append(Case(name, files[: len(image_cols)], files[len(image_cols)] if need_mask else None))
    raise_all(errors, "bad manifest lines")
    return cases


def split_cases(cases: Sequence[Case], num_val: int) -> tuple[list[Case], list[Case]]:
    """Hold out the last ``num_val`` cases when at least four remain for training; else share them."""
    cases = list(cases)
    if num_val > 0 and len(cases) - num_val >= 4:
        return cases[:-num_val], cases[-num_val:]
    return cases, cases[: max(num_val, 0)]
