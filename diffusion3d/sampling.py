"""Sampling (library): a checkpoint and masks → volumes on the masks' own grids.

One entry point, ``generate``, used by the trainer's validation (``validator.py``), the sample command
(``commands/sample.py``) and the benchmarks (``commands/bench.py``, ``commands/quality.py``). The sampler, its steps
and the guidance come from ``resolve`` (the caller's choice, else the config's, else the objective's
default: its entry in ``diffusion.SAMPLERS``); the autocast from ``precision`` for the run's precision on the
sampling device, so validation and the command sample alike.

Seeds. Volume ``i`` of the mask named ``case`` draws all its noise (the start and, for ddpm, every step's)
from its own generator, seeded by ``volume_seed(seed, case, i)``. Its randomness therefore depends on
(seed, case name, i) only, not on the batch size, the number of volumes or the other masks; the same call
made twice gives bitwise identical volumes. Another batch size changes no random number, but CPU
convolutions may round differently for another batch size: the volumes then agree to float rounding, not
bitwise (measured on the 2-step test checkpoint, batch 3 vs 1: at most 3.8e-6 on the [0, 1] scale for
ddim with 2 or 50 steps and dpmpp2m 50, 3.6e-7 for ddpm 50; a trained model may amplify it somewhat).
The training run's validation sample of a case is volume 0 with the run's seed and sampler, so the sample
command reproduces it (bitwise) from the checkpoint of the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from . import checkpoint as ckpt
from . import config as C
from .data import DataError, MaskGrid, check_mask_labels, mask_to_cond, max_volume_bytes, read_volume, save_nifti
from .diffusion import make_diffusion
from .model import build_model
from .precision import autocast_factory, resolve_precision
from .seeding import volume_seed
from .space import make_space

log = logging.getLogger(__name__)
__all__ = [
    "Grid",
    "ModelGridMask",
    "Recipe",
    "Sampled",
    "SamplingError",
    "generate",
    "load_for_sampling",
    "load_mask",
    "resolve",
    "to_output_intensity",
    "volume_seed",
    "write_volume",
]


class SamplingError(ValueError):
    """A sampling setting that does not fit the model; ``key`` names the setting (sampler, guidance_scale)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


# ---- seeds and intensities --------------------------------------------------------------------------
def to_output_intensity(volume: np.ndarray, cfg: C.Config) -> np.ndarray:
    """Model range [-1, 1] → [0, 1] (unit), kept (model), or the fixed source range (source)."""
    kind = cfg.data.output_intensity
    if kind == "model":
        return volume
    unit = (volume + 1.0) / 2.0
    if kind == "source":
        lo, hi = cfg.data.intensity_range
        return unit * (hi - lo) + lo
    return unit


# ---- the model --------------------------------------------------------------------------------------
def load_for_sampling(
    path: Path, state: dict | None = None, weights: str = "ema", device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, C.Config, dict]:
    """(model in eval mode on ``device``, the run's config, the checkpoint) from checkpoint file ``path``.

    ``state``: the checkpoint when the caller has read it already (a folder's newest valid one), else
    ``path`` is read. ``weights``: ``ema`` (the AveragedModel's ``module.*`` entries) or ``model`` (the raw
    weights). Raises CheckpointError naming the file.
    """
    path = Path(path)
    state = ckpt.load(path) if state is None else state
    try:
        cfg = C.from_dict(state["config"], str(path))
        C.validate(cfg)
    except C.ConfigError as e:
        raise ckpt.CheckpointError(f"{path}: its config cannot be used ({e})") from None
    if weights == "ema":
        weights_dict = {k[len("module.") :]: v for k, v in state["ema"].items() if k.startswith("module.")}
    elif weights == "model":
        weights_dict = state["model"]
    else:
        raise ValueError(f"weights: {weights!r} is not one of ema, model")
    model = build_model(cfg)
    try:
        model.load_state_dict(weights_dict)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ckpt.CheckpointError(
            f"{path}: {weights} weights do not fit the model of its config ({first[:200]})"
        ) from None
    model.to(device).eval().requires_grad_(False)
    state["path"] = str(path)
    return model, cfg, state


# ---- masks ------------------------------------------------------------------------------------------
class Grid(Protocol):
    """What sampling needs of a mask: its condition on the model grid, and the way back to its own grid."""

    def cond(self, labels: Sequence[int]) -> torch.Tensor: ...

    def invert(self, volume: torch.Tensor, fill: float = 0.0) -> np.ndarray: ...


class ModelGridMask:
    """A label map already on the model grid (benchmarks, synthetic sets): its own grid is the model's."""

    def __init__(self, mask: torch.Tensor | np.ndarray) -> None:
        mask = torch.as_tensor(np.asarray(mask)).to(torch.uint8)
        self.mask = mask if mask.dim() == 4 else mask[None]  # [1, *image_size]

    def cond(self, labels: Sequence[int]) -> torch.Tensor:
        return mask_to_cond(self.mask[None], labels)[0]

    def invert(self, volume: torch.Tensor, fill: float = 0.0) -> np.ndarray:
        return volume.detach().cpu().float().numpy()


def load_mask(path: Path, cfg: C.Config) -> MaskGrid:
    """Read a mask once: check it can condition the model (labels; any readable 3D volume for an
    unconditional model, which takes only its grid) and bring it to the model grid. DataError names the file."""
    info, voxels = read_volume(path, max_volume_bytes(cfg))
    if cfg.model.with_condition:
        _, warnings = check_mask_labels(path, voxels, cfg.data.labels, cfg.data.unknown_labels)
        for warning in warnings:
            log.warning(warning)
    try:
        return MaskGrid(path, cfg, voxels, info.affine)
    except DataError:
        raise
    except Exception as e:  # MONAI raises many types for files nibabel could read
        raise DataError(f"{path}: cannot be brought to the model grid ({type(e).__name__}: {e})") from None


# ---- what to run ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """A sampling run's settings, resolved: ``evaluations`` counts model calls per batch."""

    sampler: str
    steps: int
    guidance: float
    eta: float
    evaluations: int


def resolve(
    cfg: C.Config, sampler: str | None = None, steps: int | None = None, guidance: float | None = None
) -> Recipe:
    """The caller's settings, else the config's; steps else the objective's default (the one place:
    ``diffusion.default_steps``). SamplingError for a sampler or guidance the model cannot use."""
    diffusion = make_diffusion(cfg)
    sampler = sampler or cfg.diffusion.sampler
    if sampler not in diffusion.samplers:
        raise SamplingError(
            "sampler",
            f"{sampler} does not fit this checkpoint's {cfg.diffusion.prediction} model "
            f"(use {' or '.join(diffusion.samplers)})",
        )
    steps = steps or diffusion.default_steps(sampler, cfg.diffusion.sampling_steps)
    guidance = cfg.diffusion.guidance_scale if guidance is None else float(guidance)
    if guidance != 1.0 and not cfg.model.with_condition:
        raise SamplingError("guidance_scale", "this checkpoint's model is unconditional")
    if guidance != 1.0 and cfg.diffusion.cond_drop_prob <= 0:
        # measured: guidance 1.5 on such a model lowered phantom lesion Dice 0.92 -> 0.86 (docs/performance.md)
        log.warning(
            "guidance_scale %g: this model was trained without condition dropout (cond_drop_prob 0), "
            "so its unconditional prediction is untrained; guidance will likely hurt",
            guidance,
        )
    return Recipe(sampler, steps, guidance, cfg.diffusion.ddim_eta, diffusion.evaluations(sampler, steps))


# ---- the one entry point ----------------------------------------------------------------------------
@dataclass
class Sampled:
    """Volume ``index`` of a ``generate`` call: on the model grid [C, *image_size] and on its mask's own
    grid [C, *mask shape], both in the model range [-1, 1]."""

    index: int
    model_grid: torch.Tensor
    mask_grid: np.ndarray


@torch.no_grad()
def generate(
    model: Callable,
    cfg: C.Config,
    grids: Sequence[Grid],
    seeds: Sequence[int],
    *,
    sampler: str | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    batch_size: int = 4,
    device: torch.device | str = "cpu",
    on_step: Callable[[], None] | None = None,
) -> Iterator[Sampled]:
    """One volume per (grid, seed), ``batch_size`` per forward pass, yielded in order as each batch ends.

    Volume b draws its noise from its own generator seeded by ``seeds[b]`` (see the module docstring), so it
    does not depend on its batch mates. The run's precision (``cfg.train.precision``, resolved for
    ``device``) wraps each model call. ``on_step`` is called once per model evaluation of each batch.
    """
    if len(grids) != len(seeds):
        raise ValueError(f"generate: {len(grids)} grids but {len(seeds)} seeds")
    device = torch.device(device)
    recipe = resolve(cfg, sampler, steps, guidance)
    diffusion = make_diffusion(cfg)
    autocast = autocast_factory(resolve_precision(cfg.train.precision, device), device)
    space = make_space(cfg)  # the model samples in the space it was trained in; decoded before the grid inverse
    shape = space.latent_shape(cfg.image_channels, cfg.data.image_size)
    if isinstance(model, torch.nn.Module):
        model.eval()
    for start in range(0, len(seeds), batch_size):
        part = list(grids[start : start + batch_size])
        conds = None
        if cfg.model.with_condition:
            conds = space.cond(torch.stack([g.cond(cfg.data.labels) for g in part]).to(device))
        z = diffusion.sample(
            model,
            (len(part), *shape),
            conds,
            recipe.sampler,
            recipe.steps,
            recipe.eta,
            device=device,
            autocast=autocast,
            seeds=seeds[start : start + batch_size],
            on_step=on_step,
            guidance_scale=recipe.guidance,
        )
        x = space.decode(z.float())
        for offset, (grid, volume) in enumerate(zip(part, x.clamp(-1, 1).cpu())):
            yield Sampled(start + offset, volume, grid.invert(volume, fill=-1.0))


def write_volume(sampled: Sampled, grid: MaskGrid, cfg: C.Config, path: Path) -> Path:
    """A sampled volume as NIfTI on its mask's grid (shape and affine), in the config's output intensity."""
    save_nifti(to_output_intensity(sampled.mask_grid, cfg), grid.original_affine, path)
    return path
