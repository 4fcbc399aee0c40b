"""Sampling: masks → volumes on the masks' own grids (NIfTI), used by training and by the command line.

Seeds. Volume ``i`` of the mask named ``case`` draws all its noise (the start and, for ddpm, every step's)
from its own generator, seeded by ``volume_seed(seed, case, i)``. Its randomness therefore depends on
(seed, case name, i) only, not on ``--batch_size``, ``--n`` or the other masks in the folder; the same
command run twice writes bitwise identical files. Changing ``--batch_size`` changes no random number, but
CPU convolutions may round differently for another batch size: the files then agree to float rounding,
not bitwise (measured on the 2-step test checkpoint, batch 3 vs 1: at most 3.8e-6 on the [0, 1] scale
for ddim with 2 or 50 steps and dpmpp2m 50, 3.6e-7 for ddpm 50; a trained model may amplify it somewhat).
The training run's validation sample of a case is volume 0 with the run's seed and sampler, so this
command reproduces it (bitwise) from the checkpoint of the same step.

Command line::

    python -m diffusion3d.sample --checkpoint runs/default/checkpoints/step_00001000.pt \\
        --masks data/demo/masks --out samples/ --n 2

Bad input (checkpoint, masks, output folder) is found before anything is written: one line
``error: <file>: <problem>`` on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import checkpoint as ckpt
from . import config as C
from ._cli import InputError, OneLineParser, configure_logging, run_command
from .data import (
    NIFTI_SUFFIXES,
    Case,
    DataError,
    MaskGrid,
    case_name,
    check_mask_labels,
    data_items,
    read_volume,
    save_nifti,
    scan_folder,
    training_transforms,
)
from .diffusion import FLOW_SAMPLERS, GAUSSIAN_SAMPLERS, GaussianDiffusion, RectifiedFlow, derive_seed, make_diffusion
from .model import build_model
from .monitor import montage

log = logging.getLogger("diffusion3d.sample")  # not __name__: "__main__" under python -m
SAMPLERS = GAUSSIAN_SAMPLERS + FLOW_SAMPLERS
Objective = GaussianDiffusion | RectifiedFlow


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


def volume_seed(seed: int, case: str, index: int) -> int:
    """The seed of volume ``index`` of mask ``case`` (crc32: stable across processes, unlike hash())."""
    return derive_seed(seed, zlib.crc32(case.encode("utf-8")), index)


# ---- the batched, per-volume-seeded sampler ---------------------------------------------------------
def sample_volumes(
    model: Callable,
    diffusion: Objective,
    shape: Sequence[int],
    cond: torch.Tensor | None,
    seeds: Sequence[int],
    sampler: str = "ddim",
    steps: int | None = None,
    eta: float = 0.0,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    progress: Callable[[], None] | None = None,
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """``len(seeds)`` volumes of ``shape`` ([C, D, H, W]) in one batch, each from its own generator.

    Volume b draws its noise as ``diffusion.sample(seed=seeds[b])`` does for a batch of one, so it does
    not depend on its batch mates. ``progress`` is called once per step.
    """
    return diffusion.sample(model, (len(seeds), *shape), cond, sampler, steps, eta, device=device,
                            autocast=autocast, seeds=seeds, on_step=progress, guidance_scale=guidance_scale)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    diffusion: Objective,
    cfg,
    conds: torch.Tensor | None,
    count: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    seed: int = 0,
    sampler: str | None = None,
    steps: int | None = None,
    progress: bool = False,
    seeds: Sequence[int] | None = None,
    guidance_scale: float | None = None,
) -> torch.Tensor:
    """``count`` volumes [count, C, *image_size] on the model grid, in [-1, 1], on the CPU.

    ``seeds`` gives each volume its seed; without it volume b gets ``derive_seed(seed, b)``.
    """
    model.eval()
    sampler = sampler or cfg.diffusion.sampler
    steps = steps or diffusion.default_steps(sampler, cfg.diffusion.sampling_steps)
    seeds = list(seeds) if seeds is not None else [derive_seed(seed, b) for b in range(count)]
    bar = tqdm(total=diffusion.evaluations(sampler, steps), desc=f"sampling ({sampler})",
               disable=not progress, leave=False)
    x = sample_volumes(model, diffusion, (cfg.image_channels, *cfg.data.image_size), conds, seeds, sampler, steps,
                       cfg.diffusion.ddim_eta, device, autocast, progress=lambda: bar.update(1),
                       guidance_scale=cfg.diffusion.guidance_scale if guidance_scale is None else guidance_scale)
    bar.close()
    return x.clamp(-1, 1).float().cpu()


def write_samples(
    model: torch.nn.Module,
    diffusion: Objective,
    cfg,
    cases: Sequence[Case],
    out_dir: Path,
    device: torch.device,
    autocast: Callable | None = None,
    seed: int = 0,
) -> tuple[list[Path], dict[str, torch.Tensor]]:
    """One sample per case (volume 0, seeded as the command does), written as NIfTI on the case mask's grid.

    Returns the files and the montage panels (mask, real image, sample).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    conditional = cfg.model.with_condition
    grids = [MaskGrid(c.mask if conditional else c.images[0], cfg) for c in cases]
    conds = torch.stack([g.cond(cfg.data.labels) for g in grids]) if conditional else None
    seeds = [volume_seed(seed, c.name, 0) for c in cases]
    volumes = generate(model, diffusion, cfg, conds, len(cases), device, autocast, seeds=seeds)
    written, panels = [], {}
    real = training_transforms(cfg)
    for case, grid, volume in zip(cases, grids, volumes):
        path = out_dir / f"{case.name}_sample0.nii.gz"
        save_nifti(to_output_intensity(grid.invert(volume, fill=-1.0), cfg), grid.original_affine, path)
        written.append(path)
        ref = real(data_items([case], conditional)[0])
        columns = []
        if conditional:
            columns.append(ref["mask"][0].float() / max(cfg.data.labels))
        columns += [(ref["image"][0] + 1) / 2, (volume[0] + 1) / 2]
        panels[case.name] = montage(columns)
    return written, panels


# ---- loading a checkpoint for sampling --------------------------------------------------------------
def load_for_sampling(path: Path, weights: str = "ema", device: torch.device | str = "cpu") -> tuple[torch.nn.Module, C.Config, dict]:
    """(model in eval mode on ``device``, the run's config, the checkpoint) from a checkpoint.

    ``weights``: ``ema`` (the AveragedModel's ``module.*`` entries) or ``model`` (the raw weights).
    """
    path, state = ckpt.find_checkpoint(path)
    try:
        cfg = C.from_dict(state["config"], str(path))
        C.validate(cfg)
    except C.ConfigError as e:
        raise ckpt.CheckpointError(f"{path}: its config cannot be used ({e})") from None
    if weights == "ema":
        raw = state["ema"]
        weights_dict = {k[len("module."):]: v for k, v in raw.items() if k.startswith("module.")}
    elif weights == "model":
        weights_dict = state["model"]
    else:
        raise ValueError(f"weights: {weights!r} is not one of ema, model")
    model = build_model(cfg)
    try:
        model.load_state_dict(weights_dict)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ckpt.CheckpointError(f"{path}: {weights} weights do not fit the model of its config ({first[:200]})") from None
    model.to(device).eval().requires_grad_(False)
    state["path"] = str(path)
    return model, cfg, state


# ---- masks ------------------------------------------------------------------------------------------
def find_masks(path: Path) -> list[tuple[str, Path]]:
    """(case name, file) of a single mask file or of every NIfTI file in a folder, sorted by name."""
    path = Path(path)
    if path.is_file():
        if not path.name.endswith(NIFTI_SUFFIXES):
            raise DataError(f"{path}: not a NIfTI file (.nii or .nii.gz)")
        return [(case_name(path, ""), path)]
    return sorted(scan_folder(path, "").items())


def check_mask(path: Path, cfg) -> None:
    """Can the model be conditioned on this mask? Raises DataError naming the file."""
    _, data = read_volume(path)  # 3D (or 4D with one volume), readable, else DataError
    if not cfg.model.with_condition:
        return  # an unconditional model only takes the mask's grid
    _, warnings = check_mask_labels(path, data, cfg.data.labels, cfg.data.unknown_labels)
    for warning in warnings:
        log.warning(warning)


# ---- the command line -------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m diffusion3d.sample",
        description="Sample volumes from a trained checkpoint, conditioned on masks; each sample is written "
        "as <case>_sample<i>.nii.gz on the grid (shape, affine, spacing) of its mask.",
    )
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="a step_*.pt file, or a run (or checkpoints) folder: its newest valid checkpoint")
    p.add_argument("--masks", required=True, type=Path, help="a mask file or a folder of masks (.nii/.nii.gz)")
    p.add_argument("--out", required=True, type=Path, help="output folder (created)")
    p.add_argument("--n", type=_positive, default=1, help="samples per mask (default 1)")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="default: the checkpoint config's; ddim|ddpm|dpmpp2m for Gaussian diffusion, euler|heun for flow")
    p.add_argument("--steps", type=_positive, default=None,
                   help="sampling steps (default: the config's sampling_steps; ddpm: all training steps)")
    p.add_argument("--guidance_scale", type=_non_negative, default=None,
                   help="classifier-free guidance (default: the config's; 1 = conditional model only; "
                   "needs a model trained with cond_drop_prob > 0)")
    p.add_argument("--seed", type=int, default=0, help="volume i of mask <case> is seeded by (seed, case, i)")
    p.add_argument("--batch_size", type=_positive, default=4,
                   help="volumes per forward pass (default 4: CPU conv3d takes a slow path at batch 1; "
                   "results do not depend on it; lower it if memory runs out)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--weights", choices=("ema", "model"), default="ema", help="EMA weights (default) or the raw ones")
    p.add_argument("--overwrite", action="store_true", help="replace existing <case>_sample<i>.nii.gz files")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


@dataclass
class Job:
    case: str
    mask: Path
    index: int
    path: Path


def plan(masks: list[tuple[str, Path]], n: int, out: Path, overwrite: bool) -> list[Job]:
    """Every file to write; refuses an output that is a file or files that exist (without overwrite)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    jobs = [Job(case, mask, i, out / f"{case}_sample{i}.nii.gz") for case, mask in masks for i in range(n)]
    existing = [j.path for j in jobs if j.path.exists()]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise InputError(f"{existing[0]}: already exists{more}; use --overwrite to replace")
    return jobs


def _autocast(cfg, device: torch.device) -> Callable[[], contextlib.AbstractContextManager] | None:
    """The run's mixed precision, as its training and validation sampling used it: fp16 on CUDA only,
    bf16 on any device (fp32 where the run trained in fp32, or in fp16 and the device is not CUDA)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.train.precision)
    if dtype is None or (dtype is torch.float16 and device.type != "cuda"):
        return None
    return lambda: torch.autocast(device.type, dtype=dtype)


def run(argv: list[str] | None = None) -> list[Path]:
    """Parse, check everything, then sample and write; returns the files written."""
    from .distributed import resolve_device

    args = build_parser().parse_args(argv)
    if args.quiet:
        logging.getLogger("diffusion3d").setLevel(logging.WARNING)
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as e:
        raise InputError(f"--device: {e}") from None
    try:
        model, cfg, state = load_for_sampling(args.checkpoint, args.weights, device)
    except ckpt.CheckpointError as e:
        raise InputError(str(e)) from None
    masks = find_masks(args.masks)
    for _, path in masks:
        check_mask(path, cfg)
        try:
            MaskGrid(path, cfg)  # the grid transform must work too, before anything is written
        except DataError:
            raise
        except Exception as e:  # MONAI raises many types for files nibabel could read
            raise DataError(f"{path}: cannot be brought to the model grid ({type(e).__name__}: {e})") from None
    jobs = plan(masks, args.n, args.out, args.overwrite)

    diffusion = make_diffusion(cfg)
    sampler = args.sampler or cfg.diffusion.sampler
    if sampler not in diffusion.samplers:
        raise InputError(f"--sampler: {sampler} does not fit this checkpoint's {cfg.diffusion.prediction} model "
                         f"(use {' or '.join(diffusion.samplers)})")
    steps = args.steps or diffusion.default_steps(sampler, cfg.diffusion.sampling_steps)
    guidance = cfg.diffusion.guidance_scale if args.guidance_scale is None else args.guidance_scale
    if guidance != 1.0 and not cfg.model.with_condition:
        raise InputError("--guidance_scale: this checkpoint's model is unconditional")
    autocast = _autocast(cfg, device)
    log.info("%s (step %d, %s weights): %d masks × %d samples, %s %d steps (%d model evaluations), guidance %g, device %s",
             state["path"], state["step"], args.weights, len(masks), args.n, sampler, steps,
             diffusion.evaluations(sampler, steps), guidance, device)
    try:  # one writer per output folder, held until run() returns (the kernel drops it if we die)
        lock = ckpt.lock_folder(args.out, "sampling run")
    except ckpt.FolderLockedError as e:
        raise InputError(str(e)) from None
    try:
        batches = [jobs[i:i + args.batch_size] for i in range(0, len(jobs), args.batch_size)]
        bar = tqdm(total=len(batches) * diffusion.evaluations(sampler, steps), desc=f"sampling ({sampler})",
                   unit="step", disable=args.quiet, dynamic_ncols=True)
        grids: dict[str, MaskGrid] = {}
        written = []
        for batch in batches:
            for job in batch:
                if job.case not in grids:
                    grids[job.case] = MaskGrid(job.mask, cfg)
            conds = torch.stack([grids[j.case].cond(cfg.data.labels) for j in batch]) if cfg.model.with_condition else None
            seeds = [volume_seed(args.seed, j.case, j.index) for j in batch]
            volumes = sample_volumes(model, diffusion, (cfg.image_channels, *cfg.data.image_size), conds, seeds, sampler,
                                     steps, cfg.diffusion.ddim_eta, device, autocast, progress=lambda: bar.update(1),
                                     guidance_scale=guidance)
            for job, volume in zip(batch, volumes.clamp(-1, 1).float().cpu()):
                grid = grids[job.case]
                save_nifti(to_output_intensity(grid.invert(volume, fill=-1.0), cfg), grid.original_affine, job.path)
                written.append(job.path)
            done = {j.case for j in batch} - {j.case for j in jobs[len(written):]}
            for case in done:  # masks are sampled in order: free each grid once its last volume is written
                grids.pop(case, None)
        bar.close()
        return written
    finally:
        lock.release()


def sample_and_report(argv: list[str] | None = None) -> int:
    written = run(argv)
    if written:
        print(f"wrote {len(written)} sample(s) to {written[0].parent}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``diffusion3d-sample``): exit 0; 2 with one line for bad input; 1 for a storage fault."""
    configure_logging()
    sys.exit(run_command(lambda: sample_and_report(argv)))


if __name__ == "__main__":
    main()
