"""Synthetic phantoms of the demo's kind: an ellipsoid head (label 1) holding an ellipsoid lesion (label 2).

Intensity follows the mask (background ~0.02, tissue ~0.5 with a smooth texture, a bright ~1.5-voxel skull
rim at 0.75, lesion 0.9) plus Gaussian noise, in [0, 1]. A case is a function of its numpy Generator only:
``data/make_demo.py`` writes the shipped demo from it and the quality benchmark its train and test sets.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np

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


def ellipsoid_radius(grid: np.ndarray, centre: np.ndarray, axes: np.ndarray,
                     rot: np.ndarray) -> np.ndarray:
    """Normalised ellipsoid radius: < 1 inside, 1 on the surface."""
    local = np.einsum("ij,j...->i...", rot.T, grid - centre[:, None, None, None])
    return np.sqrt(sum((local[k] / axes[k]) ** 2 for k in range(3)))


def smooth_noise(rng: np.random.Generator, size: int, sigma: float = 4.0) -> np.ndarray:
    """Gaussian-smoothed white noise (via FFT), rescaled to [-1, 1]."""
    f = np.fft.fftfreq(size)
    k2 = f[:, None, None] ** 2 + f[None, :, None] ** 2 + f[None, None, :] ** 2
    field = np.fft.ifftn(np.fft.fftn(rng.standard_normal((size,) * 3))
                         * np.exp(-2 * (np.pi * sigma) ** 2 * k2)).real
    return field / np.abs(field).max()


def make_case(rng: np.random.Generator, size: int,
              texture_rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
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
