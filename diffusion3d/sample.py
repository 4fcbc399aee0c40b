"""Sampling: masks → volumes on the masks' own grids (NIfTI), used by training and by the command line."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from .data import Case, MaskGrid, save_nifti, training_transforms
from .diffusion import GaussianDiffusion
from .monitor import montage


def to_output_intensity(volume: np.ndarray, cfg) -> np.ndarray:
    """Model range [-1, 1] → [0, 1] (unit), kept (model), or the fixed source range (source)."""
    kind = cfg.data.output_intensity
    if kind == "model":
        return volume
    unit = (volume + 1.0) / 2.0
    if kind == "source":
        lo, hi = cfg.data.intensity_range
        return unit * (hi - lo) + lo
    return unit


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    diffusion: GaussianDiffusion,
    cfg,
    conds: torch.Tensor | None,
    count: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    seed: int = 0,
    sampler: str | None = None,
    steps: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """``count`` volumes [count, C, *image_size] on the model grid, in [-1, 1]."""
    model.eval()
    shape = (count, cfg.image_channels, *cfg.data.image_size)
    cond = conds.to(device) if conds is not None else None
    sampler = sampler or cfg.diffusion.sampler
    steps = steps or (diffusion.timesteps if sampler == "ddpm" else cfg.diffusion.sampling_steps)
    x = diffusion.sample(model, shape, cond, sampler=sampler, steps=steps, eta=cfg.diffusion.ddim_eta,
                         seed=seed, device=device, autocast=autocast, progress=progress)
    return x.clamp(-1, 1).float().cpu()


def write_samples(
    model: torch.nn.Module,
    diffusion: GaussianDiffusion,
    cfg,
    cases: Sequence[Case],
    out_dir: Path,
    device: torch.device,
    autocast: Callable | None = None,
    seed: int = 0,
) -> tuple[list[Path], dict[str, torch.Tensor]]:
    """One sample per case, written as NIfTI on the case mask's grid; returns files and montage panels."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditional = cfg.model.with_condition
    grids = [MaskGrid(c.mask if conditional else c.images[0], cfg) for c in cases]
    conds = torch.stack([g.cond(cfg.data.labels) for g in grids]) if conditional else None
    volumes = generate(model, diffusion, cfg, conds, len(cases), device, autocast, seed=seed)
    written, panels = [], {}
    real = training_transforms(cfg)
    for case, grid, volume in zip(cases, grids, volumes):
        on_grid = grid.invert(volume, fill=-1.0)
        path = out_dir / f"{case.name}_sample0.nii.gz"
        save_nifti(to_output_intensity(on_grid, cfg), grid.original_affine, path)
        written.append(path)
        item = {"image": [str(p) for p in case.images] if len(case.images) > 1 else str(case.images[0])}
        if conditional:
            item["mask"] = str(case.mask)
        ref = real(item)
        columns = []
        if conditional:
            columns.append(ref["mask"][0].float() / max(cfg.data.labels))
        columns += [(ref["image"][0] + 1) / 2, (volume[0] + 1) / 2]
        panels[case.name] = montage(columns)
    return written, panels
