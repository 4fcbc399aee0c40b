"""Data: pairing, validation, MONAI transforms, caching, the deterministic endless stream, the loader.

The k-th sample of a run (which case it is) depends only on ``(seed, k)``: one seeded permutation of the
training cases per epoch. Micro-batches are cut from that sequence, so batch_size × accum × world_size is
a free split of the same samples, and the stream position (``samples_seen``) is all a resume needs.
"""

from __future__ import annotations

import copy
import csv
import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import monai
import nibabel as nib
import numpy as np
import torch
from monai.data import CacheDataset, Dataset, MetaTensor, PersistentDataset
from monai.transforms import (
    CastToTyped,
    Compose,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    Resized,
    ResizeWithPadOrCropd,
    ScaleIntensityRanged,
    ScaleIntensityRangePercentilesd,
    Spacingd,
    Transform,
)

from .checkpoint import storage_error
from .diffusion import SALT_PERMUTATION, derive_seed

log = logging.getLogger(__name__)
NIFTI_SUFFIXES = (".nii.gz", ".nii")


class DataError(ValueError):
    """Bad input data; the message starts with the offending file or folder."""


@dataclass
class Case:
    name: str
    images: list[Path] = field(default_factory=list)  # one per image channel, in configured order
    mask: Path | None = None


# ---- discovery ------------------------------------------------------------------------------------
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
    _raise_all(errors, "duplicate case names")
    return found


def discover(cfg) -> list[Case]:
    """Pair images and masks by case name (folders) or read them from a CSV manifest."""
    d = cfg.data
    need_mask = cfg.model.with_condition
    if d.manifest:
        cases = _read_manifest(Path(d.manifest), need_mask)
        return cases
    image_dirs = d.image_dir if isinstance(d.image_dir, list) else [d.image_dir]
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
    _raise_all(errors, "unpaired files")
    return [Case(n, [found[n] for found in per_channel], masks.get(n)) for n in sorted(names)]


def _raise_all(errors: list[str], what: str) -> None:
    if len(errors) == 1:
        raise DataError(errors[0])
    if errors:
        raise DataProblems(errors, f"{len(errors)} {what}")


def _image_columns(columns: Sequence[str]) -> list[str]:
    """``image`` alone, or ``image_0``, ``image_1``, ... in numeric order (so image_10 follows image_9)."""
    if "image" in columns:
        return ["image"]
    numbered = [c for c in columns if c.startswith("image_") and c[len("image_"):].isdigit()]
    return sorted(numbered, key=lambda c: int(c[len("image_"):]))


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
    _raise_all(errors, "bad manifest lines")
    return cases


# ---- validation -----------------------------------------------------------------------------------
@dataclass
class VolumeInfo:
    shape: tuple[int, ...]
    spacing: tuple[float, ...]
    orientation: str
    affine: np.ndarray


NIFTI_HEADER_SIZES = (348, 540)  # sizeof_hdr of NIfTI-1 and NIfTI-2


def _diagnose(path: Path) -> str:
    """Why nibabel could not open ``path``, in words a user can act on."""
    if path.stat().st_size == 0:
        return "empty file"
    try:
        if path.name.endswith(".gz"):
            with path.open("rb") as f:
                if f.read(2) != b"\x1f\x8b":
                    return "not gzip-compressed although named .gz"
            with gzip.open(path, "rb") as f:
                head = f.read(540)
        else:
            with path.open("rb") as f:
                head = f.read(540)
    except EOFError as e:
        return f"truncated file ({e})"
    except (gzip.BadGzipFile, zlib.error) as e:
        return f"corrupt gzip data ({e})"
    sizes = {int(np.frombuffer(head[:4], dtype=order + "i4")[0]) for order in "<>"} if len(head) >= 4 else set()
    if not sizes & set(NIFTI_HEADER_SIZES):
        return "not a NIfTI file (no NIfTI header)"
    if len(head) < 348:
        return f"truncated file (header of {len(head)} bytes)"
    return "not a readable NIfTI file"


GZIP_MAX_RATIO = 1032  # deflate cannot expand by more (RFC 1951 limits): bounds a .gz file's contents
DEFAULT_MAX_VOLUME_BYTES = 2 * 2**30


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def _datatype_problem(img) -> str | None:
    """None for a real integer or float datatype; else why the file's datatype cannot be an MRI volume."""
    header = img.header
    try:
        label = str(header.get_value_label("datatype"))
    except Exception:
        label = f"code {int(header['datatype'])}"
    try:
        dtype = header.get_data_dtype()
    except Exception:
        return f"datatype {label} is not supported (not a real integer or float type)"
    if dtype.kind in "iuf" and dtype.itemsize > 0:
        return None
    if dtype.fields is not None:  # RGB24 / RGBA32: structured R, G, B(, A) bytes
        return f"datatype {label} ({len(dtype.fields)} colour channels per voxel) is not supported; " \
               "save a greyscale volume (one channel per file)"
    if dtype.kind == "c":
        return f"datatype {label} (complex voxels) is not supported; save the magnitude or the real part as float32"
    return f"datatype {label} is not supported (not a real integer or float type)"


def _gzip_content_size(path: Path, needed: int) -> int | None:
    """At least how many bytes ``path`` decompresses to, as far as needed to tell whether it holds
    ``needed`` bytes; None when it does. Decides from the gzip trailer (ISIZE, the size mod 2^32) and the
    compressed size where it can; otherwise (several gzip members, a damaged trailer) streams through the
    data in 1 MiB pieces, which allocates nothing the header claims."""
    compressed = path.stat().st_size
    bound = compressed * GZIP_MAX_RATIO + 2**16
    if needed > bound:
        return bound  # no deflate stream this short holds that much
    if compressed >= 18:
        with path.open("rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
        smallest = needed + ((isize - needed) % 2**32)  # the smallest content size >= needed with this ISIZE
        if smallest <= bound:
            return None
    total = 0
    with gzip.open(path, "rb") as f:  # EOFError / BadGzipFile / zlib.error: the caller names them
        while piece := f.read(2**20):
            total += len(piece)
            if total >= needed:
                return None
    return total


def check_header(path: Path, img, max_bytes: int | None = DEFAULT_MAX_VOLUME_BYTES) -> tuple[int, ...]:
    """Datatype, dimensions and declared size of an opened (not yet read) NIfTI file; DataError naming
    the file. Nothing here reads voxels: a header cannot make anything allocate what it merely claims."""
    problem = _datatype_problem(img)
    if problem:
        raise DataError(f"{path}: {problem}")
    shape = tuple(int(n) for n in img.header.get_data_shape())
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if len(shape) != 3:
        raise DataError(f"{path}: expected a 3D volume, got shape {shape}")
    if min(shape) < 1:
        raise DataError(f"{path}: header declares an empty volume (shape {shape})")
    dtype = img.header.get_data_dtype()
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    declared = f"shape {shape} {dtype.name} ({_bytes(nbytes)})"
    offset = int(img.header.get_data_offset())
    needed = offset + nbytes
    if path.name.endswith(".gz"):
        try:
            holds = _gzip_content_size(path, needed)
        except EOFError as e:
            raise DataError(f"{path}: truncated file ({e})") from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise DataError(f"{path}: corrupt gzip data ({e})") from None
    else:
        size = path.stat().st_size
        holds = None if size >= needed else size
    if holds is not None:
        raise DataError(f"{path}: truncated file or wrong header: it declares {declared} of voxel data, "
                        f"the file holds at most {_bytes(max(holds - offset, 0))}")
    if max_bytes is not None and nbytes > max_bytes:
        raise DataError(f"{path}: header declares {declared}, over the ceiling of {_bytes(max_bytes)} per volume "
                        "(max_volume_gb; raise it if the volume is real)")
    return shape


def max_volume_bytes(cfg) -> int | None:
    gb = getattr(cfg.data, "max_volume_gb", 2.0)
    if gb is None:
        return None
    if not gb > 0:
        raise DataError(f"max_volume_gb: must be positive or null, got {gb}")
    return int(gb * 2**30)


def read_volume(path: Path, max_bytes: int | None = DEFAULT_MAX_VOLUME_BYTES) -> tuple[VolumeInfo, np.ndarray]:
    """Open, check the header (datatype, shape, declared size; see check_header), then read the voxels."""
    try:
        img = nib.load(str(path))
        check_header(path, img, max_bytes)
        data = np.asanyarray(img.dataobj)
    except DataError:
        raise
    except EOFError as e:
        raise DataError(f"{path}: truncated file ({e})") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data ({e})") from None
    except nib.filebasedimages.ImageFileError:
        raise DataError(f"{path}: {_diagnose(path)}") from None
    except nib.spatialimages.HeaderDataError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        code = re.fullmatch(r"data code (-?\d+) not supported", first)
        if code:  # a datatype nibabel cannot decode (DT_BINARY, or a code outside the standard)
            n = int(code.group(1))
            label = nib.nifti1.data_type_codes.label[n] if n in nib.nifti1.data_type_codes.value_set() else "unknown"
            raise DataError(f"{path}: datatype {label} (code {n}) is not supported (not a real integer or float type)") from None
        raise DataError(f"{path}: unsupported NIfTI header ({first})") from None
    except MemoryError:
        raise DataError(f"{path}: not enough memory to read it (lower max_volume_gb to refuse such files early)") from None
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = "truncated file" if "Expected" in first and "bytes" in first else "unreadable"
        raise DataError(f"{path}: {kind} ({first})") from None
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{path}: expected a 3D volume, got shape {tuple(data.shape)}")
    zooms = tuple(float(z) for z in img.header.get_zooms()[:3])
    codes = "".join(nib.aff2axcodes(img.affine))
    return VolumeInfo(tuple(data.shape), zooms, codes, img.affine), data


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


def check_case(case: Case, cfg) -> dict[str, Any]:
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


class DataProblems(DataError):
    """Several bad inputs at once: ``errors`` holds one line per bad file, ``summary`` the count.

    ``str()`` is the lines themselves (a single bad file: its one line, as a plain DataError)."""

    def __init__(self, errors: Sequence[str], summary: str) -> None:
        self.errors, self.summary = list(errors), summary
        super().__init__("\n".join(self.errors))


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


def validate(cases: Sequence[Case], cfg, workers: int | None = None) -> list[dict[str, Any]]:
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
        lines.append(
            "labels: " + ", ".join(f"{k}: {totals[k]} voxels in {present[k]} cases" for k in sorted(totals))
        )
    warnings = sum(len(s["warnings"]) for s in summaries)
    if warnings:
        lines.append(f"warnings: {warnings}")
    return "\n".join(lines)


# ---- transforms -----------------------------------------------------------------------------------
def _spatial(cfg, keys: list[str], modes: list[str], pad_values: list[float]) -> list:
    """Orientation, optional resampling and the model-grid fit, per key with its interpolation mode."""
    d = cfg.data
    out: list = []
    if d.orientation:
        out.append(Orientationd(keys=keys, axcodes=d.orientation, labels=None, allow_missing_keys=True))
    if d.spacing:
        spacing_modes = ["nearest" if m == "nearest" else "bilinear" for m in modes]
        out.append(Spacingd(keys=keys, pixdim=d.spacing, mode=spacing_modes, allow_missing_keys=True))
    for key, mode, value in zip(keys, modes, pad_values):
        if d.resize_mode == "resize":
            out.append(Resized(keys=key, spatial_size=d.image_size, mode=mode, allow_missing_keys=True))
        else:
            out.append(
                ResizeWithPadOrCropd(keys=key, spatial_size=d.image_size, mode="constant", value=value, allow_missing_keys=True)
            )
    return out


def _intensity(cfg) -> list:
    d = cfg.data
    if d.intensity == "percentile":
        return [
            ScaleIntensityRangePercentilesd(
                keys="image", lower=d.lower_percentile, upper=d.upper_percentile, b_min=-1.0, b_max=1.0, clip=True, channel_wise=True
            )
        ]
    if d.intensity == "range":
        lo, hi = d.intensity_range
        return [ScaleIntensityRanged(keys="image", a_min=lo, a_max=hi, b_min=-1.0, b_max=1.0, clip=True)]
    return []


def training_transforms(cfg, keep_meta: bool = False) -> Compose:
    """Deterministic, so everything is cached: load → channel-first → [-1, 1] → orient → (spacing) → grid.

    ``keep_meta`` leaves MetaTensors (the file's affine, spacing and shape, and every applied operation)
    for the cache; otherwise plain tensors come out, as the model wants them.
    """
    with_mask = cfg.model.with_condition
    keys = ["image", "mask"] if with_mask else ["image"]
    modes = ["trilinear", "nearest"] if with_mask else ["trilinear"]
    return Compose(
        [
            LoadImaged(keys=keys, ensure_channel_first=True, image_only=True),
            *_intensity(cfg),  # per volume, per channel, before padding so padding cannot shift percentiles
            *_spatial(cfg, keys, modes, [-1.0, 0.0][: len(keys)]),
            *([CastToTyped(keys="mask", dtype=np.uint8)] if with_mask else []),
            _LoadableMeta() if keep_meta else EnsureTyped(keys=keys, track_meta=False),
        ]
    )


def _torch_friendly(value: Any) -> Any:
    """numpy and enums inside metadata → tensors, numbers and str, which ``torch.load(weights_only=True)`` accepts."""
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Enum):  # MONAI's TraceKeys etc. are str enums; plain str keys look up the same
        return value.value
    if isinstance(value, dict):
        return type(value)((_torch_friendly(k), _torch_friendly(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_torch_friendly(v) for v in value)
    return value


class _LoadableMeta(Transform):
    """Without this, PersistentDataset cannot read its own files back (numpy in the metadata is refused by
    the safe loader) and silently decodes every volume again. A MONAI ``Transform`` (not a plain function),
    so PersistentDataset caches its output rather than stopping the cached part before it."""

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        for value in item.values():
            if isinstance(value, MetaTensor):
                value.meta = _torch_friendly(dict(value.meta))
                value.applied_operations = _torch_friendly(list(value.applied_operations))
        return item


def plain(item: dict[str, Any]) -> dict[str, Any]:
    """A cached item with its MetaTensors as plain tensors (a view, no copy): what the model is fed."""
    return {k: v.as_tensor() if isinstance(v, MetaTensor) else v for k, v in item.items()}


def mask_to_cond(mask: torch.Tensor, labels: Sequence[int]) -> torch.Tensor:
    """Label map [B, 1, ...] → one channel per configured label, in {-1, 1} (as Med-DDPM)."""
    onehot = torch.cat([(mask == label) for label in labels], dim=1)
    return onehot.float() * 2 - 1


# ---- the grid a sample is written back to ---------------------------------------------------------
class MaskGrid:
    """A mask brought to the model's grid, remembering how to map a volume back to the mask's own grid.

    The file is read once (``read_volume``: header checks, then the voxels), or not at all when the caller
    read it already and passes ``voxels`` and ``affine`` (what read_volume returned). Of the transformed
    float reference only its metadata is kept: the inverse needs the applied operations, not the voxels.
    """

    def __init__(self, path: str | Path, cfg, voxels: np.ndarray | None = None, affine: np.ndarray | None = None) -> None:
        self.path = Path(path)
        self.cfg = cfg
        if voxels is None:
            info, voxels = read_volume(self.path, max_volume_bytes(cfg))
            affine = info.affine
        self.original_shape = tuple(voxels.shape)
        self.original_affine = np.asarray(affine, dtype=np.float64)
        keys, modes = ["mask", "ref"], ["nearest", "trilinear"]
        self.spatial = Compose(_spatial(cfg, keys, modes, [0.0, 0.0]))
        # as LoadImaged(ensure_channel_first) builds it: float32, channel first, the file's affine
        loaded = MetaTensor(torch.as_tensor(np.asarray(voxels, dtype=np.float32))[None],
                            affine=torch.as_tensor(self.original_affine), meta={"filename_or_obj": str(self.path)})
        d = self.spatial({"mask": loaded, "ref": loaded.clone()})
        self.mask = d["mask"].as_tensor().round().to(torch.uint8)  # [1, *image_size]
        self._ref_meta = dict(d["ref"].meta)
        self._ref_ops = list(d["ref"].applied_operations)

    def cond(self, labels: Sequence[int]) -> torch.Tensor:
        return mask_to_cond(self.mask[None], labels)[0]

    def invert(self, volume: torch.Tensor, fill: float = 0.0) -> np.ndarray:
        """[C, *image_size] on the model grid → [C, *original_shape] on the mask's grid.

        Padding introduced by the inverse (a crop undone) is filled with ``fill``.
        """
        shifted = MetaTensor(volume.detach().cpu().float() - fill, meta=dict(self._ref_meta))
        shifted.applied_operations = copy.deepcopy(self._ref_ops)  # the inverse pops from them
        inverted = self.spatial.inverse({"ref": shifted})["ref"]
        out = np.asarray(inverted.detach().cpu().numpy()) + fill
        if tuple(out.shape[1:]) != self.original_shape:
            raise RuntimeError(f"{self.path}: inverse produced shape {out.shape[1:]}, expected {self.original_shape}")
        return out


def save_nifti(volume: np.ndarray, affine: np.ndarray, path: str | Path, dtype=np.float32) -> None:
    """Write [C, D, H, W] (C=1 → a 3D file) with the given affine, atomically."""
    array = volume[0] if volume.shape[0] == 1 else np.moveaxis(volume, 0, -1)
    img = nib.Nifti1Image(array.astype(dtype), affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    path = Path(path)
    tmp = path.with_name(f".tmp.{path.name}")  # keeps the .nii.gz ending nibabel needs
    try:
        nib.save(img, str(tmp))
        tmp.replace(path)
    except OSError as e:
        raise storage_error(path, e, "the NIfTI file") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


# ---- caching, stream, loader ----------------------------------------------------------------------
def data_items(cases: Sequence[Case], with_mask: bool) -> list[dict[str, Any]]:
    """The file dicts the MONAI transforms read: several image files of a case load as channels."""
    items = []
    for c in cases:
        item: dict[str, Any] = {"image": [str(p) for p in c.images] if len(c.images) > 1 else str(c.images[0])}
        if with_mask:
            item["mask"] = str(c.mask)
        items.append(item)
    return items


def transform_key(cfg) -> str:
    """A short hash of every setting the cached tensors depend on: a changed setting gets a fresh cache."""
    d = cfg.data
    relevant = {
        "with_condition": cfg.model.with_condition,
        "transforms": [d.orientation, d.spacing, d.intensity, d.lower_percentile, d.upper_percentile,
                       d.intensity_range, d.image_size, d.resize_mode],
        "monai": monai.__version__,
    }
    return hashlib.sha1(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]


def _item_hash(item: dict[str, Any]) -> bytes:
    """Cache file name of an item: its paths plus each file's size and mtime, so an edited file is re-read."""
    paths = [p for v in item.values() for p in (v if isinstance(v, list) else [v])]
    stats = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest().encode()


def build_dataset(cases: Sequence[Case], cfg, cache_dir: Path | None = None):
    """Decoded and transformed once: in memory, on disk, or (cache: none) every time.

    Items keep their metadata (MetaTensors); the loader hands plain tensors to the model.
    """
    items = data_items(cases, cfg.model.with_condition)
    transform = training_transforms(cfg, keep_meta=True)
    kind = cfg.data.cache
    if kind == "memory":
        return CacheDataset(items, transform, cache_rate=1.0, num_workers=max(cfg.data.num_workers, 1), progress=False, copy_cache=False)
    if kind == "disk":
        if cache_dir is None:
            raise ValueError("cache: disk needs a cache_dir")
        folder = Path(cache_dir) / transform_key(cfg)
        folder.mkdir(parents=True, exist_ok=True)
        # reset_ops_id would put a TraceKeys enum back into the metadata, which the safe loader refuses
        return PersistentDataset(items, transform, cache_dir=folder, hash_func=_item_hash, track_meta=True, reset_ops_id=False)
    return Dataset(items, transform)


def split_cases(cases: Sequence[Case], num_val: int) -> tuple[list[Case], list[Case]]:
    """Hold out the last ``num_val`` cases when at least four remain for training; else share them."""
    cases = list(cases)
    if num_val > 0 and len(cases) - num_val >= 4:
        return cases[:-num_val], cases[-num_val:]
    return cases, cases[: max(num_val, 0)]


class SampleStream:
    """Endless sequence of case indices: sample k is ``perm(seed, k // n)[k % n]``."""

    def __init__(self, num_cases: int, seed: int, samples_seen: int = 0) -> None:
        if num_cases < 1:
            raise ValueError("the stream needs at least one case")
        self.num_cases = num_cases
        self.seed = seed
        self.samples_seen = samples_seen
        self._perm_epoch = -1
        self._perm: list[int] = []

    def index(self, k: int) -> int:
        epoch, pos = divmod(k, self.num_cases)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(derive_seed(self.seed, SALT_PERMUTATION, epoch))
            self._perm = torch.randperm(self.num_cases, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm[pos]

    @property
    def epoch(self) -> int:
        return self.samples_seen // self.num_cases

    def micro_batch_ids(self, micro: int, batch_size: int, rank: int = 0, world_size: int = 1) -> list[int]:
        """Sample ids of micro-batch ``micro`` (counted from samples_seen) on ``rank``."""
        start = self.samples_seen + (micro * world_size + rank) * batch_size
        return list(range(start, start + batch_size))


class _StreamView(torch.utils.data.Dataset):
    def __init__(self, dataset, stream: SampleStream) -> None:
        self.dataset, self.stream = dataset, stream

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, k: int) -> dict[str, Any]:
        item = plain(self.dataset[self.stream.index(k)])
        item["sample_id"] = k
        return item


class _MicroBatches(torch.utils.data.Sampler):
    def __init__(self, stream: SampleStream, batch_size: int, rank: int, world_size: int) -> None:
        self.stream, self.batch_size, self.rank, self.world_size = stream, batch_size, rank, world_size
        self.start = stream.samples_seen

    def __iter__(self) -> Iterator[list[int]]:
        micro = 0
        probe = SampleStream(self.stream.num_cases, self.stream.seed, self.start)
        while True:
            yield probe.micro_batch_ids(micro, self.batch_size, self.rank, self.world_size)
            micro += 1


def make_loader(dataset, stream: SampleStream, batch_size: int, cfg, pin_memory: bool, rank: int = 0, world_size: int = 1):
    """An endless loader of micro-batches starting at ``stream.samples_seen``; the caller advances the stream."""
    view = _StreamView(dataset, SampleStream(stream.num_cases, stream.seed))
    workers = cfg.data.num_workers
    return torch.utils.data.DataLoader(
        view,
        batch_sampler=_MicroBatches(stream, batch_size, rank, world_size),
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
    )
