"""MONAI transforms from file to the model's grid, the mask's one-hot condition, and the way back (MaskGrid)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor
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

from ..config import Config
from .nifti import read_volume
from .validation import max_volume_bytes


def _spatial(cfg: Config, keys: list[str], modes: list[str], pad_values: list[float]) -> list:
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
                ResizeWithPadOrCropd(
                    keys=key, spatial_size=d.image_size, mode="constant", value=value, allow_missing_keys=True
                )
            )
    return out


def _intensity(cfg: Config) -> list:
    d = cfg.data
    if d.intensity == "percentile":
        return [
            ScaleIntensityRangePercentilesd(
                keys="image",
                lower=d.lower_percentile,
                upper=d.upper_percentile,
                b_min=-1.0,
                b_max=1.0,
                clip=True,
                channel_wise=True,
            )
        ]
    if d.intensity == "range":
        lo, hi = d.intensity_range
        return [ScaleIntensityRanged(keys="image", a_min=lo, a_max=hi, b_min=-1.0, b_max=1.0, clip=True)]
    return []


def training_transforms(cfg: Config, keep_meta: bool = False) -> Compose:
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

    def __init__(
        self, path: str | Path, cfg: Config, voxels: np.ndarray | None = None, affine: np.ndarray | None = None
    ) -> None:
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
        loaded = MetaTensor(
            torch.as_tensor(np.asarray(voxels, dtype=np.float32))[None],
            affine=torch.as_tensor(self.original_affine),
            meta={"filename_or_obj": str(self.path)},
        )
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
