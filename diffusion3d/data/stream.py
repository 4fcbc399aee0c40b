"""The deterministic endless stream and its loader.

The k-th sample of a run (which case it is, which axes it is mirrored along with ``data.flip_axes``, and
its random rotation, scale and shift with ``data.affine_*``) depends only on ``(seed, k)``: one seeded
permutation of the training cases per epoch, one seeded draw per sample and augmentation. Micro-batches are
cut from that sequence, so batch_size × accum × world_size is a free split of the same samples, and the
stream position (``samples_seen``) is all a resume needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import Affine

from ..config import Config
from ..seeding import SALT_AFFINE, SALT_FLIP, SALT_PERMUTATION, derive_seed
from .transforms import plain


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


def flipped_axes(seed: int, k: int, axes: Sequence[int]) -> list[int]:
    """The spatial axes sample ``k`` is mirrored along: each of ``axes`` with probability 1/2, from (seed, k).
    One draw per axis 0, 1, 2 whatever ``axes`` holds, so adding an axis leaves the others' draws alone."""
    if not axes:
        return []
    draws = np.random.default_rng(derive_seed(seed, SALT_FLIP, k)).random(3)
    return [a for a in range(3) if a in axes and draws[a] < 0.5]


def flip_item(item: dict[str, Any], axes: Sequence[int]) -> dict[str, Any]:
    """Image and mask ([C, D, H, W]) mirrored together along the spatial ``axes``."""
    if not axes:
        return item
    dims = [a + 1 for a in axes]
    return {k: torch.flip(v, dims) if k in ("image", "mask") else v for k, v in item.items()}


@dataclass(frozen=True)
class AffineRanges:
    """``data.affine_rotate`` (degrees), ``affine_scale`` and ``affine_translate`` (fractions), all 0: off; and
    ``affine_prob``, the share of samples augmented (the rest are the training volumes as they are)."""

    rotate: float = 0.0
    scale: float = 0.0
    translate: float = 0.0
    prob: float = 1.0

    def __bool__(self) -> bool:
        return bool(self.rotate or self.scale or self.translate) and self.prob > 0


@dataclass(frozen=True)
class AffineDraw:
    """One sample's rotation (radians about each axis), isotropic scale and shift (fraction of each axis)."""

    angles: tuple[float, float, float]
    scale: float
    shift: tuple[float, float, float]


def affine_draw(seed: int, k: int, ranges: AffineRanges) -> AffineDraw | None:
    """Sample ``k``'s affine, uniform within ``ranges``, from (seed, k); None when augmentation is off or sample
    ``k`` is among the ``1 - prob`` left as it is. Eight draws whatever the ranges (the eighth decides ``prob``), so
    changing one range or the probability leaves the other parameters' draws alone."""
    if not ranges:
        return None
    u = np.random.default_rng(derive_seed(seed, SALT_AFFINE, k)).uniform(-1.0, 1.0, 8)
    if (u[7] + 1.0) / 2.0 >= ranges.prob:
        return None
    angles = np.deg2rad(ranges.rotate) * u[:3]
    shift = ranges.translate * u[4:7]
    return AffineDraw(
        (float(angles[0]), float(angles[1]), float(angles[2])),
        float(1.0 + ranges.scale * u[3]),
        (float(shift[0]), float(shift[1]), float(shift[2])),
    )


IMAGE_SPLINE_ORDER = 3  # cubic B-spline, as nnU-Net resamples images; trilinear would blur every augmented sample


def affine_item(item: dict[str, Any], draw: AffineDraw | None) -> dict[str, Any]:
    """Image and mask ([C, D, H, W]) resampled together through one affine about the grid's centre (MONAI's
    ``Affine``). The image by a cubic B-spline (scipy through MONAI), filled with -1 (the background, as the
    grid fit pads it) and clamped to its own range (the spline's overshoot); trilinear interpolation would
    soften each sample's texture (about -24 % of its mean gradient at a random sub-voxel offset, against -6 %:
    docs/design.md, "Affine augmentation"). The mask by nearest neighbour, filled with 0, so labels stay labels."""
    if draw is None:
        return item
    size = item["image"].shape[1:]
    transform = Affine(
        rotate_params=list(draw.angles),
        scale_params=[draw.scale] * 3,
        translate_params=[s * n for s, n in zip(draw.shift, size)],
        image_only=True,
    )

    def resample(volume: torch.Tensor, mode: str | int, padding: str) -> torch.Tensor:
        out = transform(volume, mode=mode, padding_mode=padding)
        return out.as_tensor() if isinstance(out, MetaTensor) else out

    image = item["image"]
    moved = resample(image.float() + 1.0, IMAGE_SPLINE_ORDER, "constant") - 1.0
    moved_image = moved.clamp(float(image.min()), float(image.max())).to(image.dtype)
    mask = item["mask"]
    moved_mask = resample(mask.float(), "nearest", "zeros").round().to(mask.dtype)
    return {**item, "image": moved_image, "mask": moved_mask}


class _StreamView(torch.utils.data.Dataset):
    def __init__(
        self, dataset, stream: SampleStream, flip_axes: Sequence[int] = (), affine: AffineRanges = AffineRanges()
    ) -> None:
        self.dataset, self.stream, self.flip_axes, self.affine = dataset, stream, list(flip_axes), affine

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, k: int) -> dict[str, Any]:
        item = plain(self.dataset[self.stream.index(k)])
        item = affine_item(item, affine_draw(self.stream.seed, k, self.affine))
        item = flip_item(item, flipped_axes(self.stream.seed, k, self.flip_axes))
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


def make_loader(
    dataset, stream: SampleStream, batch_size: int, cfg: Config, pin_memory: bool, rank: int = 0, world_size: int = 1
):
    """An endless loader of micro-batches starting at ``stream.samples_seen``; the caller advances the stream."""
    d = cfg.data
    affine = AffineRanges(d.affine_rotate, d.affine_scale, d.affine_translate, d.affine_prob)
    view = _StreamView(dataset, SampleStream(stream.num_cases, stream.seed), d.flip_axes, affine)
    workers = d.num_workers
    return torch.utils.data.DataLoader(
        view,
        batch_sampler=_MicroBatches(stream, batch_size, rank, world_size),
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
    )
