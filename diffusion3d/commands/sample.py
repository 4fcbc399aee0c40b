"""``python -m diffusion3d sample``: sample volumes from a trained checkpoint, conditioned on masks.

The command parses, finds the masks, reads each mask once (checked and brought to the model grid), and
hands them to ``sampling.generate`` (the library the trainer's validation uses too); each volume is written
as ``<case>_sample<i>.nii.gz`` on its mask's grid. Volume i of mask <case> is seeded by (seed, case, i): see
``diffusion3d.sampling`` for what that guarantees.

Command line::

    python -m diffusion3d sample --checkpoint runs/default/checkpoints/step_00001000.pt \\
        --masks data/demo/masks --out samples/ --n 2

Bad input (checkpoint, masks, output folder) is found before anything is written: one line
``error: <file>: <problem>`` on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .. import checkpoint as ckpt
from .. import sampling, storage
from ..config import Config, ConfigError
from ..data import NIFTI_SUFFIXES, DataError, MaskGrid, case_name, scan_folder
from ..diffusion import SAMPLERS, samplers_of
from .common import InputError, OneLineParser, configure_logging, device_flag, run_command

log = logging.getLogger("diffusion3d.sample")  # not __name__: "__main__" under python -m


# ---- masks ------------------------------------------------------------------------------------------
def find_masks(path: Path) -> list[tuple[str, Path]]:
    """(case name, file) of a single mask file or of every NIfTI file in a folder, sorted by name."""
    path = Path(path)
    if path.is_file():
        if not path.name.endswith(NIFTI_SUFFIXES):
            raise DataError(f"{path}: not a NIfTI file (.nii or .nii.gz)")
        return [(case_name(path, ""), path)]
    return sorted(scan_folder(path, "").items())


# ---- the command line -------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _number_above(text: str, low: float, inclusive: bool, finite: bool) -> float:
    """A float >= low (inclusive) or > low, and not infinite where ``finite``; argparse's error otherwise."""
    expected = f"expected a number {'>=' if inclusive else '>'} {low:g}"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if not (value >= low if inclusive else value > low) or (finite and value == float("inf")):
        raise argparse.ArgumentTypeError(f"{expected}, got {value}")
    return value


def _non_negative(text: str) -> float:
    return _number_above(text, 0.0, inclusive=True, finite=False)


def _positive_float(text: str) -> float:
    return _number_above(text, 0.0, inclusive=False, finite=True)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m diffusion3d sample",
        description="Sample volumes from a trained checkpoint, conditioned on masks; each sample is written "
        "as <case>_sample<i>.nii.gz on the grid (shape, affine, spacing) of its mask.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        help="a step_*.pt file, or a run (or checkpoints) folder: its newest valid checkpoint",
    )
    p.add_argument("--masks", required=True, type=Path, help="a mask file or a folder of masks (.nii/.nii.gz)")
    p.add_argument("--out", required=True, type=Path, help="output folder (created)")
    p.add_argument("--n", type=_positive, default=1, help="samples per mask (default 1)")
    p.add_argument(
        "--sampler",
        choices=list(SAMPLERS),
        default=None,
        help=f"default: the checkpoint config's; {'|'.join(samplers_of('gaussian'))} for Gaussian "
        f"diffusion, {'|'.join(samplers_of('flow'))} for flow",
    )
    p.add_argument(
        "--steps",
        type=_positive,
        default=None,
        help="sampling steps (default: the config's sampling_steps; ddpm: all training steps)",
    )
    p.add_argument(
        "--guidance_scale",
        type=_non_negative,
        default=None,
        help="classifier-free guidance (default: the config's; 1 = conditional model only; "
        "needs a model trained with cond_drop_prob > 0)",
    )
    p.add_argument(
        "--sampling_shift",
        type=_positive_float,
        default=None,
        help="flow models: the time grid's shift (default: the config's sampling_shift, else its training "
        "flow_shift); lower puts the last steps nearer t = 0 (sharper samples from an x0-output model)",
    )
    p.add_argument("--seed", type=int, default=0, help="volume i of mask <case> is seeded by (seed, case, i)")
    p.add_argument(
        "--batch_size",
        type=_positive,
        default=4,
        help="volumes per forward pass (default 4: CPU conv3d takes a slow path at batch 1; "
        "results do not depend on it; lower it if memory runs out)",
    )
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
    storage.check_target(out)
    jobs = [Job(case, mask, i, out / f"{case}_sample{i}.nii.gz") for case, mask in masks for i in range(n)]
    existing = [j.path for j in jobs if j.path.exists()]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise InputError(f"{existing[0]}: already exists{more}; use --overwrite to replace")
    return jobs


def run(argv: list[str] | None = None) -> list[Path]:
    """Parse, check everything, then sample and write; returns the files written."""
    args = build_parser().parse_args(argv)
    if args.quiet:
        logging.getLogger("diffusion3d").setLevel(logging.WARNING)
    device = device_flag(args.device)
    try:
        model, cfg, state = sampling.load_for_sampling(*ckpt.find_checkpoint(args.checkpoint), args.weights, device)
    except ckpt.CheckpointError as e:
        raise InputError(str(e)) from None
    masks = find_masks(args.masks)
    grids = {case: sampling.load_mask(path, cfg) for case, path in masks}  # each file read once, all checked
    jobs = plan(masks, args.n, args.out, args.overwrite)
    if args.sampling_shift is not None:
        try:
            cfg = cfg.override(sampling_shift=args.sampling_shift)
        except ConfigError as e:
            raise InputError(f"--sampling_shift: this checkpoint's {e}") from None
    try:
        recipe = sampling.resolve(cfg, args.sampler, args.steps, args.guidance_scale)
    except sampling.SamplingError as e:
        raise InputError(f"--{e.key}: {e}") from None
    log.info(
        "%s (step %d, %s weights): %d masks × %d samples, %s %d steps (%d model evaluations), guidance %g, device %s",
        state["path"],
        state["step"],
        args.weights,
        len(masks),
        args.n,
        recipe.sampler,
        recipe.steps,
        recipe.evaluations,
        recipe.guidance,
        device,
    )
    lock = storage.claim_folder(args.out, "sampling run")  # held until run() returns (the kernel drops it if we die)
    try:
        return _sample(model, cfg, jobs, grids, recipe, args, device)
    finally:
        lock.release()


def _sample(
    model, cfg: Config, jobs: list[Job], grids: dict[str, MaskGrid], recipe: sampling.Recipe, args, device
) -> list[Path]:
    batches = -(-len(jobs) // args.batch_size)
    bar = tqdm(
        total=batches * recipe.evaluations,
        desc=f"sampling ({recipe.sampler})",
        unit="step",
        disable=args.quiet,
        dynamic_ncols=True,
    )
    written = []
    volumes = sampling.generate(
        model,
        cfg,
        [grids[j.case] for j in jobs],
        [sampling.volume_seed(args.seed, j.case, j.index) for j in jobs],
        sampler=recipe.sampler,
        steps=recipe.steps,
        guidance=recipe.guidance,
        batch_size=args.batch_size,
        device=device,
        on_step=lambda: bar.update(1),
    )
    for sampled in volumes:
        job = jobs[sampled.index]
        written.append(sampling.write_volume(sampled, grids[job.case], cfg, job.path))
    bar.close()
    return written


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
