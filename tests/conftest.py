"""Shared fixtures: tiny configs and synthetic NIfTI phantoms (16³) so each test runs in seconds on CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Tiny models gain nothing from a second thread, and on a shared CPU oversubscription made tests up to
# 10x slower (measured); subprocesses inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import nibabel as nib
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from diffusion3d import config as C  # noqa: E402

torch.set_num_threads(1)


def write_nifti(path: Path, array: np.ndarray, affine: np.ndarray | None = None) -> Path:
    affine = np.diag([1.5, 1.5, 1.5, 1.0]) if affine is None else affine
    img = nib.Nifti1Image(array, affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(path))
    return path


def phantom(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """An ellipsoid (1) holding a sphere (2); intensity follows the labels plus noise."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), -1).astype(np.float32)
    centre = size / 2 + rng.uniform(-1, 1, 3)
    radii = size * rng.uniform(0.3, 0.42, 3)
    mask = np.zeros((size,) * 3, np.uint8)
    mask[(((grid - centre) / radii) ** 2).sum(-1) <= 1] = 1
    lesion = centre + rng.uniform(-1, 1, 3) * size * 0.1
    mask[((grid - lesion) ** 2).sum(-1) <= (size * 0.12) ** 2] = 2
    image = np.choose(mask, [0.02, 0.5, 0.9]).astype(np.float32) + rng.normal(0, 0.02, mask.shape).astype(np.float32)
    return image, mask


def make_dataset(root: Path, n: int = 6, size: int = 16) -> tuple[Path, Path]:
    images, masks = root / "images", root / "masks"
    for i in range(n):
        image, mask = phantom(size, i)
        write_nifti(images / f"case_{i:03d}.nii.gz", image)
        write_nifti(masks / f"case_{i:03d}.nii.gz", mask)
    return images, masks


def tiny_config(tmp_path: Path, n: int = 6, size: int = 16, **overrides) -> C.Config:
    """A 2-level 8/16-channel UNet at 16³ on phantoms in tmp_path; overrides by key name."""
    images, masks = make_dataset(tmp_path / "data", n, size)
    cfg = C.Config(name="tiny")
    values = dict(
        image_dir=str(images), mask_dir=str(masks), image_size=[size] * 3, intensity="range",
        channels=[8, 16], attention_levels=[False, True], num_head_channels=8, norm_num_groups=4,
        timesteps=50, sampling_steps=5, batch_size=2, gradient_accumulate_every=1, train_num_steps=4,
        lr=1e-3, save_every=2, sample_every=100, num_samples=1, num_val_cases=1, results_dir=str(tmp_path / "run"),
        quiet=True, device="cpu", warmup_steps=0,
    )
    values.update(overrides)
    return configure(cfg, **values)


def configure(cfg: C.Config, **values) -> C.Config:
    """Set keys by name (as the command line does) and validate."""
    for key, value in values.items():
        C.set_key(cfg, key, value)
    C.validate(cfg)
    return cfg

