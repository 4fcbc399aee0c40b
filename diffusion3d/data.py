"""Data: pairing, validation, MONAI transforms, caching, the deterministic endless stream, the loader.

The k-th sample of a run (which case it is) depends only on ``(seed, k)``: one seeded permutation of the
training cases per epoch. Micro-batches are cut from that sequence, so batch_size × accum × world_size is
a free split of the same samples, and the stream position (``samples_seen``) is all a resume needs.
"""

from __future__ import annotations

import csv
import gzip
import logging
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from monai.data import CacheDataset, Dataset, MetaTensor, PersistentDataset
from monai.transforms import (
    CastToTyped,
    Compose,
    CopyItemsd,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    Orientationd,
    Resized,
    ResizeWithPadOrCropd,
    ScaleIntensityRanged,
    ScaleIntensityRangePercentilesd,
    Spacingd,
)

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
def _case_name(path: Path, suffix: str) -> str:
    name = path.name
    for ext in NIFTI_SUFFIXES:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    if suffix and name.endswith(suffix):
        name = name[: -len(suffix)]
    return name


def _scan(folder: Path, suffix: str) -> dict[str, Path]:
    if not folder.exists():
        raise DataError(f"{folder}: folder not found")
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(NIFTI_SUFFIXES))
    if not files:
        raise DataError(f"{folder}: no NIfTI files (.nii or .nii.gz) in this folder")
    found: dict[str, Path] = {}
    for p in files:
        name = _case_name(p, suffix)
        if name in found:
            raise DataError(f"{p}: case name {name!r} also used by {found[name].name}")
        found[name] = p
    return found


def discover(cfg) -> list[Case]:
    """Pair images and masks by case name (folders) or read them from a CSV manifest."""
    d = cfg.data
    need_mask = cfg.model.with_condition
    if d.manifest:
        return _read_manifest(Path(d.manifest), need_mask)
    image_dirs = d.image_dir if isinstance(d.image_dir, list) else [d.image_dir]
    per_channel = [_scan(Path(p), d.image_suffix) for p in image_dirs]
    masks = _scan(Path(d.mask_dir), d.mask_suffix) if need_mask else {}
    names = set(per_channel[0])
    for folder, found in zip(image_dirs[1:], per_channel[1:]):
        missing = sorted(names - set(found))
        if missing:
            raise DataError(f"{per_channel[0][missing[0]]}: no image of case {missing[0]!r} in {folder}")
        extra = sorted(set(found) - names)
        if extra:
            raise DataError(f"{found[extra[0]]}: no image of case {extra[0]!r} in {image_dirs[0]}")
    if need_mask:
        for name in sorted(names - set(masks)):
            raise DataError(f"{per_channel[0][name]}: image without mask (no case {name!r} in {d.mask_dir})")
        for name in sorted(set(masks) - names):
            raise DataError(f"{masks[name]}: mask without image (no case {name!r} in {image_dirs[0]})")
    return [Case(n, [found[n] for found in per_channel], masks.get(n)) for n in sorted(names)]


def _read_manifest(path: Path, need_mask: bool) -> list[Case]:
    if not path.is_file():
        raise DataError(f"{path}: manifest not found")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise DataError(f"{path}: manifest has no rows")
    columns = list(rows[0].keys())
    image_cols = ["image"] if "image" in columns else sorted(c for c in columns if c.startswith("image_"))
    if not image_cols or "case" not in columns or (need_mask and "mask" not in columns):
        raise DataError(f"{path}: manifest needs columns case, image (or image_0, image_1, ...) and mask")
    base = path.parent
    cases = []
    for row in rows:
        images = [(base / row[c]).resolve() for c in image_cols]
        mask = (base / row["mask"]).resolve() if need_mask else None
        for p in [*images, *([mask] if mask else [])]:
            if not p.is_file():
                raise DataError(f"{p}: file not found (listed in {path}, case {row['case']!r})")
        cases.append(Case(row["case"], images, mask))
    return cases


# ---- validation -----------------------------------------------------------------------------------
@dataclass
class VolumeInfo:
    shape: tuple[int, ...]
    spacing: tuple[float, ...]
    orientation: str
    affine: np.ndarray


def _read(path: Path) -> tuple[VolumeInfo, np.ndarray]:
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
    except (gzip.BadGzipFile, zlib.error, EOFError) as e:
        raise DataError(f"{path}: corrupt or truncated file ({type(e).__name__}: {e})") from None
    except nib.filebasedimages.ImageFileError:
        raise DataError(f"{path}: not a NIfTI file") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{path}: expected a 3D volume, got shape {tuple(data.shape)}")
    zooms = tuple(float(z) for z in img.header.get_zooms()[:3])
    codes = "".join(nib.aff2axcodes(img.affine))
    return VolumeInfo(tuple(data.shape), zooms, codes, img.affine), data


def check_case(case: Case, cfg) -> dict[str, Any]:
    """Validate one case; raises DataError naming the file. Returns its summary (and warnings)."""
    d = cfg.data
    infos = []
    for path in case.images:
        info, data = _read(path)
        if not np.isfinite(data).all():
            raise DataError(f"{path}: contains NaN or infinite voxels")
        if data.size == 0 or float(data.max()) == float(data.min()):
            raise DataError(f"{path}: constant image (every voxel is {float(data.flat[0]) if data.size else 'empty'})")
        if infos and info.shape != infos[0].shape:
            raise DataError(f"{path}: shape {info.shape} differs from {case.images[0].name} {infos[0].shape}")
        infos.append(info)
    summary: dict[str, Any] = {
        "case": case.name,
        "shape": infos[0].shape,
        "spacing": tuple(round(s, 4) for s in infos[0].spacing),
        "orientation": infos[0].orientation,
        "warnings": [],
    }
    if case.mask is None:
        return summary
    minfo, mask = _read(case.mask)
    if minfo.shape != infos[0].shape:
        raise DataError(f"{case.mask}: mask shape {minfo.shape} differs from image shape {infos[0].shape}")
    if not np.allclose(minfo.affine, infos[0].affine, atol=d.shape_tolerance_mm):
        raise DataError(f"{case.mask}: mask affine differs from the image's ({case.images[0].name}) beyond tolerance")
    if not np.isfinite(mask).all():
        raise DataError(f"{case.mask}: contains NaN or infinite voxels")
    values, counts = np.unique(mask, return_counts=True)
    if np.any(values != np.round(values)):
        raise DataError(f"{case.mask}: mask has non-integer values (is this an image?)")
    label_counts = {int(v): int(c) for v, c in zip(values, counts)}
    unknown = sorted(set(label_counts) - {0, *d.labels})
    if unknown:
        msg = f"{case.mask}: labels {unknown} are not in the configured labels {d.labels}"
        if d.unknown_labels == "error":
            raise DataError(msg)
        summary["warnings"].append(msg + " (treated as background)")
    if not any(label_counts.get(label, 0) for label in d.labels):
        raise DataError(f"{case.mask}: none of the configured labels {d.labels} present")
    summary["labels"] = label_counts
    return summary


def validate(cases: Sequence[Case], cfg) -> list[dict[str, Any]]:
    """Validate every case (stops at the first error). Warnings are logged and returned in the summaries."""
    if not cases:
        raise DataError(f"{cfg.data.image_dir}: no cases found")
    summaries = []
    for case in cases:
        s = check_case(case, cfg)
        for w in s["warnings"]:
            log.warning(w)
        summaries.append(s)
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


def training_transforms(cfg) -> Compose:
    """Deterministic, so everything is cached: load → channel-first → orient → (spacing) → [-1, 1] → grid."""
    with_mask = cfg.model.with_condition
    keys = ["image", "mask"] if with_mask else ["image"]
    modes = ["trilinear", "nearest"] if with_mask else ["trilinear"]
    return Compose(
        [
            LoadImaged(keys=keys, ensure_channel_first=True, image_only=True),
            *_intensity(cfg),  # per volume, per channel, before padding so padding cannot shift percentiles
            *_spatial(cfg, keys, modes, [-1.0, 0.0][: len(keys)]),
            *([CastToTyped(keys="mask", dtype=np.uint8)] if with_mask else []),
            EnsureTyped(keys=keys, track_meta=False),  # plain tensors to the model
        ]
    )


def mask_to_cond(mask: torch.Tensor, labels: Sequence[int]) -> torch.Tensor:
    """Label map [B, 1, ...] → one channel per configured label, in {-1, 1} (as Med-DDPM)."""
    onehot = torch.cat([(mask == label) for label in labels], dim=1)
    return onehot.float() * 2 - 1


# ---- the grid a sample is written back to ---------------------------------------------------------
class MaskGrid:
    """A mask brought to the model's grid, remembering how to map a volume back to the mask's own grid."""

    def __init__(self, path: str | Path, cfg) -> None:
        self.path = Path(path)
        self.cfg = cfg
        keys, modes = ["mask", "ref"], ["nearest", "trilinear"]
        self.spatial = Compose(_spatial(cfg, keys, modes, [0.0, 0.0]))
        loaded = LoadImaged(keys="mask", ensure_channel_first=True, image_only=True)({"mask": str(self.path)})
        if loaded["mask"].ndim == 5 and loaded["mask"].shape[-1] == 1:
            loaded["mask"] = loaded["mask"][..., 0]
        if loaded["mask"].ndim != 4 or loaded["mask"].shape[0] != 1:
            raise DataError(f"{self.path}: expected a 3D mask, got shape {tuple(loaded['mask'].shape[1:])}")
        self.original_shape = tuple(loaded["mask"].shape[1:])
        self.original_affine = np.asarray(nib.load(str(self.path)).affine)
        d = CopyItemsd(keys="mask", names="ref")(loaded)
        d = self.spatial(d)
        self.mask = d["mask"].as_tensor().round().to(torch.uint8)  # [1, *image_size]
        self._ref: MetaTensor = d["ref"]

    def cond(self, labels: Sequence[int]) -> torch.Tensor:
        return mask_to_cond(self.mask[None], labels)[0]

    def invert(self, volume: torch.Tensor, fill: float = 0.0) -> np.ndarray:
        """[C, *image_size] on the model grid → [C, *original_shape] on the mask's grid.

        Padding introduced by the inverse (a crop undone) is filled with ``fill``.
        """
        shifted = MetaTensor(volume.detach().cpu().float() - fill, meta=dict(self._ref.meta))
        shifted.applied_operations = list(self._ref.applied_operations)
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
    nib.save(img, str(tmp))
    tmp.replace(path)


# ---- caching, stream, loader ----------------------------------------------------------------------
def build_dataset(cases: Sequence[Case], cfg, cache_dir: Path | None = None):
    """Decoded and transformed once: in memory, on disk, or (cache: none) every time."""
    items = [{"image": [str(p) for p in c.images] if len(c.images) > 1 else str(c.images[0])} for c in cases]
    if cfg.model.with_condition:
        for item, c in zip(items, cases):
            item["mask"] = str(c.mask)
    transform = training_transforms(cfg)
    kind = cfg.data.cache
    if kind == "memory":
        return CacheDataset(items, transform, cache_rate=1.0, num_workers=max(cfg.data.num_workers, 1), progress=False, copy_cache=False)
    if kind == "disk":
        if cache_dir is None:
            raise ValueError("cache: disk needs a cache_dir")
        cache_dir.mkdir(parents=True, exist_ok=True)
        return PersistentDataset(items, transform, cache_dir=cache_dir)
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
        item = dict(self.dataset[self.stream.index(k)])
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
