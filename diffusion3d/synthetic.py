"""The one generator of synthetic data: the demo, the tests, the benchmarks and batch planning use it.

- ``make_case``: phantoms of the demo's kind, an ellipsoid head (label 1) holding an ellipsoid lesion
  (label 2). Intensity follows the mask (background ~0.02, tissue ~0.5 with a smooth texture, a bright
  ~1.5-voxel skull rim at 0.75, lesion 0.9) plus Gaussian noise, in [0, 1]. A case is a function of its numpy
  Generator only: ``data/make_demo.py`` writes the shipped demo from it and the quality benchmark its sets.
- ``nested_ellipsoids``: any labels and image channels, any size (label k nested inside label k-1), for
  tests and the throughput benchmark; ``write_cases`` writes them as NIfTI folders.
- ``SyntheticDataset``: items as the training cache holds them (image in [-1, 1], uint8 label map), no
  files: the data of batch planning and of the step benchmarks.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

SPACING = 1.5


def rotation(rng: np.random.Generator, max_deg: float = 15.0) -> np.ndarray:
    """Random small rotation matrix (product of rotations about x, y, z)."""
    r = np.eye(3)
    for axis, ang in enumerate(np.deg2rad(rng.uniform(-max_deg, max_deg, 3))):
        i, j = [k for k in range(3) if k != axis]
        m = np.eye(3)
        m[i, i] = m[j, j] = np.cos(ang)
        m[i, j], m[j, i] = -np.sin(ang), np.sin(ang)
        r = r @ m
    return r


def ellipsoid_radius(grid: np.ndarray, centre: np.ndarray, axes: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """Normalised ellipsoid radius: < 1 inside, 1 on the surface."""
    local = np.einsum("ij,j...->i...", rot.T, grid - centre[:, None, None, None])
    return np.sqrt(sum((local[k] / axes[k]) ** 2 for k in range(3)))


def smooth_noise(rng: np.random.Generator, size: int, sigma: float = 4.0) -> np.ndarray:
    """Gaussian-smoothed white noise (via FFT), rescaled to [-1, 1]."""
    f = np.fft.fftfreq(size)
    k2 = f[:, None, None] ** 2 + f[None, :, None] ** 2 + f[None, None, :] ** 2
    field = np.fft.ifftn(np.fft.fftn(rng.standard_normal((size,) * 3)) * np.exp(-2 * (np.pi * sigma) ** 2 * k2)).real
    return field / np.abs(field).max()


def make_case(
    rng: np.random.Generator, size: int, texture_rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Return (mask uint8, image float32) for one synthetic case.

    The geometry is drawn from ``rng`` first; the texture and noise from ``texture_rng`` (default: ``rng``,
    continuing). Another ``texture_rng`` gives a second real draw of the same mask (the data's own diversity).
    """
    grid = np.stack(np.meshgrid(*(np.arange(size, dtype=np.float64),) * 3, indexing="ij"))
    c = (size - 1) / 2
    scale = size / 32
    head_c = c + rng.uniform(-1.5, 1.5, 3) * scale
    head_ax = rng.uniform(10, 14, 3) * scale
    head_rot = rotation(rng)
    r_head = ellipsoid_radius(grid, head_c, head_ax, head_rot)

    # Lesion: radius 2.5-5 voxels, centre chosen so it lies fully inside the head
    # (distance to the head surface >= lesion max axis + 1 voxel margin).
    les_ax = rng.uniform(2.5, 5.0, 3) * scale
    margin = (les_ax.max() + 1.0) / head_ax.min()
    u = rng.standard_normal(3)
    u *= rng.uniform(0, 1 - margin) / np.linalg.norm(u)
    les_c = head_c + head_rot @ (u * head_ax)
    r_les = ellipsoid_radius(grid, les_c, les_ax, rotation(rng, 45.0))

    mask = np.zeros((size,) * 3, dtype=np.uint8)
    mask[r_head <= 1] = 1
    mask[(r_les <= 1) & (r_head <= 1)] = 2

    head = mask > 0
    rng = rng if texture_rng is None else texture_rng
    image = np.full(mask.shape, 0.02)
    image[head] = 0.5 + 0.08 * smooth_noise(rng, size)[head]
    rim = head & (r_head > 1 - 1.5 / head_ax.min())  # ~1.5-voxel thick skull
    image[rim] = 0.75
    image[mask == 2] = 0.9
    image += rng.normal(0, 0.02, image.shape)
    return mask, np.clip(image, 0, 1).astype(np.float32)


def save(arr: np.ndarray, path: Path) -> None:
    """Write a NIfTI (RAS, 1.5 mm, centred) as deterministic gzip (mtime=0)."""
    size = arr.shape[0]
    affine = np.diag([SPACING, SPACING, SPACING, 1.0])
    affine[:3, 3] = -(size - 1) * SPACING / 2
    img = nib.Nifti1Image(arr, affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    path.write_bytes(gzip.compress(img.to_bytes(), compresslevel=9, mtime=0))


# ---- any labels, any channels -------------------------------------------------------------------------
def nested_ellipsoids(
    rng: np.random.Generator,
    size: int | Sequence[int],
    labels: Sequence[int] = (1, 2),
    channels: int = 1,
    noise: float = 0.02,
) -> tuple[np.ndarray, np.ndarray]:
    """(mask uint8 [D, H, W], image float32 [channels, D, H, W] in [0, 1]): label ``labels[k]`` fills an
    ellipsoid 0.45^k times the size of the first, all around one jittered centre; intensity 0.02 outside,
    0.1 + 0.8 * label / max(labels) inside, plus independent Gaussian noise per channel."""
    shape = (size,) * 3 if isinstance(size, int) else tuple(size)
    grid = np.meshgrid(*[np.arange(n, dtype=np.float32) for n in shape], indexing="ij")
    centre = np.array(shape) / 2 + rng.uniform(-1, 1, 3)
    mask = np.zeros(shape, np.uint8)
    for level, label in enumerate(labels):
        radii = np.array(shape) * rng.uniform(0.3, 0.42, 3) * 0.45**level
        mask[sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) <= 1] = label
    top = max(max(labels, default=1), 1)
    clean = np.where(mask > 0, 0.1 + 0.8 * mask.astype(np.float32) / top, 0.02).astype(np.float32)
    image = np.stack([clean + rng.normal(0, noise, shape).astype(np.float32) for _ in range(channels)])
    return mask, np.clip(image, 0, 1).astype(np.float32)


def write_cases(
    root: Path,
    size: int | Sequence[int],
    n: int,
    labels: Sequence[int] = (1, 2),
    channels: int = 1,
    seed: int = 0,
    spacing: float = SPACING,
) -> tuple[list[Path], Path]:
    """``n`` pairs ``case_XXX.nii.gz`` of ``nested_ellipsoids``: (one image folder per channel, mask folder)."""
    image_dirs = [root / (f"images_{c}" if channels > 1 else "images") for c in range(channels)]
    mask_dir = root / "masks"
    for folder in [*image_dirs, mask_dir]:
        folder.mkdir(parents=True, exist_ok=True)
    affine = np.diag([spacing, spacing, spacing, 1.0])
    for i in range(n):
        mask, image = nested_ellipsoids(np.random.default_rng([seed, i]), size, labels, channels)
        nib.save(nib.Nifti1Image(mask, affine), str(mask_dir / f"case_{i:03d}.nii.gz"))
        for c, folder in enumerate(image_dirs):
            nib.save(nib.Nifti1Image(image[c], affine), str(folder / f"case_{i:03d}.nii.gz"))
    return image_dirs, mask_dir


class SyntheticDataset(torch.utils.data.Dataset):
    """``n`` seeded training items as the cache holds them: ``image`` [C, *size] in [-1, 1] and, with
    ``labels``, ``mask`` [1, *size] uint8 (``nested_ellipsoids``). Needs no files."""

    def __init__(
        self, size: Sequence[int], channels: int, labels: Sequence[int] | None, n: int = 2, seed: int = 0
    ) -> None:
        self.items = []
        for i in range(n):
            mask, image = nested_ellipsoids(np.random.default_rng([seed, i]), tuple(size), labels or (1,), channels)
            item = {"image": torch.from_numpy(image * 2 - 1)}
            if labels is not None:
                item["mask"] = torch.from_numpy(mask)[None]
            self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]
