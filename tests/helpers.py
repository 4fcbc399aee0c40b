"""What the tests share: synthetic NIfTI phantoms (16³, so each test runs in seconds on CPU) and ONE tiny run,
as a config for in-process tests and as the same settings in train.py flags for the command line.

Imported as ``from tests.helpers import ...`` (``tests`` is a package; pytest puts the repository root on
``sys.path`` for it, and ``subprocess_env`` does the same for the interpreters the tests start).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from diffusion3d import config as C
from diffusion3d import configs
from diffusion3d.synthetic import nested_ellipsoids

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# A 2-level 8/16-channel UNet at 16³ with the plain Gaussian recipe (eps, l1, ddim) in fp32 on the CPU.
TINY = dict(
    intensity="range",
    channels=[8, 16],
    attention_levels=[False, True],
    num_head_channels=8,
    norm_num_groups=4,
    timesteps=50,
    sampling_steps=5,
    batch_size=2,
    gradient_accumulate_every=1,
    train_num_steps=4,
    lr=1e-3,
    save_every=2,
    sample_every=100,
    num_samples=1,
    num_val_cases=1,
    quiet=True,
    device="cpu",
    warmup_steps=0,
)


def write_nifti(path: Path, array: np.ndarray, affine: np.ndarray | None = None) -> Path:
    affine = np.diag([1.5, 1.5, 1.5, 1.0]) if affine is None else affine
    img = nib.Nifti1Image(array, affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(path))
    return path


def phantom(size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(image [D, H, W] in [0, 1], mask): an ellipsoid (1) holding a smaller one (2),
    ``synthetic.nested_ellipsoids``."""
    mask, image = nested_ellipsoids(np.random.default_rng(seed), size)
    return image[0], mask


def make_dataset(root: Path, n: int = 6, size: int = 16) -> tuple[Path, Path]:
    """n phantom pairs case_000 … in root/images and root/masks."""
    images, masks = root / "images", root / "masks"
    for i in range(n):
        image, mask = phantom(size, i)
        write_nifti(images / f"case_{i:03d}.nii.gz", image)
        write_nifti(masks / f"case_{i:03d}.nii.gz", mask)
    return images, masks


def configure(cfg: C.Config, **values) -> C.Config:
    """``cfg.override(**values)``: a copy with keys set by name (as the command line does), validated."""
    return cfg.override(**values)


def sections(cfg: C.Config) -> dict:
    """cfg's sections as a dict: what a run trains with, without the ``wavelet`` section's values (inert in pixel
    space, already in the sections in wavelet space)."""
    return {key: value for key, value in cfg.to_dict().items() if key != C.WAVELET}


def as_flags(cfg: C.Config) -> list[str]:
    """cfg as train.py flags: every key (and the name) where it differs from the default config, which is
    where the command line starts (in cfg's space: in wavelet space with its ``wavelet`` section's values), so
    that ``cli.parse(as_flags(cfg))`` builds cfg's sections again."""
    default = C.load(configs.DEFAULT)
    flags = [] if cfg.name == default.name else ["--name", cfg.name]
    if cfg.data.space != default.data.space:
        flags += ["--space", cfg.data.space]
        default = default.override(space=cfg.data.space)
    for key, (section, _) in C.key_index().items():
        value = getattr(getattr(cfg, section), key)
        if value != getattr(getattr(default, section), key):
            flags += [f"--{key}", C.show(value)]
    return flags


@dataclass
class Tiny:
    """One tiny run: ``cfg`` for in-process tests, ``flags`` (the same settings) for train.py / cli.main."""

    cfg: C.Config
    flags: list[str]

    @property
    def images(self) -> Path:
        return Path(self.cfg.data.image_dir)

    @property
    def masks(self) -> Path:
        return Path(self.cfg.data.mask_dir)

    @property
    def results(self) -> Path:
        return Path(self.cfg.train.results_dir)

    def yaml(self, path: Path | None = None) -> Path:
        """The config as a YAML file (for --config); default: tiny.yaml beside the results folder."""
        path = path or self.results.parent / "tiny.yaml"
        path.write_text(self.cfg.to_yaml())
        return path


def tiny(
    tmp_path: Path, n: int = 6, size: int = 16, data: Path | bool = True, base: C.Config | None = None, **overrides
) -> Tiny:
    """The tiny run (``TINY`` on a size³ grid, results in tmp_path/run), with overrides by key name.

    data: True writes n phantom pairs to tmp_path/data; a folder uses the images/ and masks/ already in it;
    False writes none (the overrides say where the data is, if anywhere). base: the config the settings go
    on (default: the dataclass defaults; ``C.load(configs.DEFAULT)`` keeps the default config's recipe).
    """
    values = dict(TINY, image_size=[size] * 3, results_dir=str(tmp_path / "run"))
    if data is True:
        data = tmp_path / "data"
        make_dataset(data, n, size)
    if data:
        values.update(image_dir=str(Path(data) / "images"), mask_dir=str(Path(data) / "masks"))
    values.update(overrides)
    cfg = configure(base if base is not None else C.Config(name="tiny"), **values)
    return Tiny(cfg, as_flags(cfg))


def tiny_config(tmp_path: Path, n: int = 6, size: int = 16, **overrides) -> C.Config:
    """``tiny(...).cfg``: the tiny run's config alone."""
    return tiny(tmp_path, n, size, **overrides).cfg


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for an interpreter a test starts: one thread (oversubscribing the shared CPU made
    tests up to 10x slower), the repository first on PYTHONPATH (this checkout's diffusion3d and tests
    package, installed or not) and no torchrun variables left over."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", **extra)
    return env
