"""The ``downstream`` and ``distribution`` subcommands of ``python -m diffusion3d evaluate``, and the intensity
flags every evaluation shares. Command-line layer: parses, prints, chooses exit codes; the work is in
``downstream`` and ``distribution``.

    python -m diffusion3d evaluate downstream --images I --masks M --samples S --out O
    python -m diffusion3d evaluate distribution --real I --samples S --feature_weights W --out O

Bad input → one line ``error: ...``, exit 2, nothing written; a storage fault → one line, exit 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .. import storage
from ..data import scan_folder
from ..evaluation import downstream as down
from ..evaluation import fid as dist
from ..evaluation.inputs import Scaling
from .common import (
    InputError,
    OneLineParser,
    comma_list,
    configure_logging,
    device_flag,
    int_list,
    run_command,
    write_csv,
    write_json,
)

log = logging.getLogger("diffusion3d.evaluate")


# ---- shared flags -------------------------------------------------------------------------------------------
def add_intensity_flags(p: argparse.ArgumentParser) -> None:
    # Two numbers rather than "LO,HI": argparse takes "-1,1" for a flag but "-1" for a number.
    p.add_argument(
        "--real_range",
        type=float,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="map the real image's [LO, HI] to [0, 1]",
    )
    p.add_argument(
        "--real_percentiles",
        type=float,
        nargs=2,
        default=[0.0, 100.0],
        metavar=("PLO", "PHI"),
        help="without --real_range: map these percentiles of each real image to [0, 1] (default 0 100)",
    )
    p.add_argument(
        "--sample_range",
        type=float,
        nargs=2,
        default=[0.0, 1.0],
        metavar=("LO", "HI"),
        help="map the samples' [LO, HI] to [0, 1] (default 0 1)",
    )


def check_pair(values: Sequence[float], flag: str) -> tuple[float, float]:
    lo, hi = values
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise InputError(f"{flag}: expected LO < HI, got {lo:g} {hi:g}")
    return lo, hi


def scaling_from(args: argparse.Namespace) -> Scaling:
    real_range = check_pair(args.real_range, "--real_range") if args.real_range else None
    percentiles = check_pair(args.real_percentiles, "--real_percentiles")
    if not 0 <= percentiles[0] < percentiles[1] <= 100:
        raise InputError(f"--real_percentiles: expected 0 <= low < high <= 100, got {percentiles}")
    return Scaling(real_range, percentiles, check_pair(args.sample_range, "--sample_range"))


def write_locked(out: Path, outputs: Sequence[str], overwrite: bool, what: str, write: Callable[[], None]) -> None:
    """Run ``write`` holding ``out``'s lock (taken once the inputs are known good, so bad input writes nothing)."""
    with storage.claim_folder(out, what, outputs, overwrite):  # re-checks: written meanwhile by a finished run?
        write()


def _num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# ---- downstream ---------------------------------------------------------------------------------------------
DOWNSTREAM_OUTPUTS = ("downstream.csv", "downstream.json", "splits.json")


def downstream_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m diffusion3d evaluate downstream",
        description="Train one segmentation network three ways (real only, synthetic only, real + synthetic) with "
        "the same seed and budget, and report Dice per label on held-out real pairs (Med-DDPM's protocol).",
    )
    p.add_argument("--images", required=True, type=Path, help="real images <case>.nii.gz")
    p.add_argument("--masks", required=True, type=Path, help="real masks <case>.nii.gz")
    p.add_argument("--samples", type=Path, default=None, help="synthetic volumes <case>_sample<i>.nii.gz")
    p.add_argument(
        "--sample_masks",
        type=Path,
        default=None,
        help="the masks the samples were generated from, <case>.nii.gz (default: --masks)",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="output folder: downstream.csv, downstream.json, splits.json"
    )
    p.add_argument("--splits", type=Path, default=None, help="reuse the splits of an earlier run (its splits.json)")
    p.add_argument(
        "--test_cases",
        default=None,
        help="real test cases by name, e.g. case_018,case_019 (the cases the diffusion model never trained on)",
    )
    p.add_argument(
        "--num_test", type=int, default=None, help="else: this many random real test cases (default: a quarter)"
    )
    p.add_argument(
        "--arms", default="real,synthetic,mixed", help="which trainings: real, synthetic, mixed (default all)"
    )
    p.add_argument("--labels", default=None, help="labels to segment, e.g. 1,2 (default: every non-zero mask label)")
    p.add_argument("--network", choices=down.NETWORKS, default="unet", help="MONAI UNet or SegResNet (default unet)")
    p.add_argument(
        "--channels",
        default="8,16,32",
        help="UNet widths per level (SegResNet: the first is its init_filters); default 8,16,32",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per arm (default 300)")
    p.add_argument("--batch_size", type=int, default=2, help="patches per step (default 2)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 0.01)")
    p.add_argument(
        "--patch",
        type=int,
        nargs=3,
        default=None,
        metavar=("D", "H", "W"),
        help="training patch and sliding window (default: the largest volume, up to 96 a side)",
    )
    p.add_argument("--seed", type=int, default=0, help="splits, initial weights and batch order (default 0)")
    p.add_argument("--device", default="cpu", help="cpu (default: repeatable), cuda, cuda:N or auto")
    add_intensity_flags(p)
    p.add_argument("--overwrite", action="store_true", help="replace existing results in --out")
    return p


def downstream_settings(args: argparse.Namespace) -> down.Settings:
    arms = tuple(comma_list(args.arms))
    unknown = [a for a in arms if a not in down.ARMS]
    if unknown or not arms or len(set(arms)) != len(arms):
        raise InputError(f"--arms: expected distinct names among {', '.join(down.ARMS)}, got {args.arms!r}")
    channels = tuple(int_list(args.channels, "--channels", distinct=True))
    if len(channels) < 2 or min(channels) < 1:
        raise InputError(f"--channels: expected at least two positive widths, got {args.channels!r}")
    for flag, value in (("--steps", args.steps), ("--batch_size", args.batch_size)):
        if value < 1:
            raise InputError(f"{flag}: expected a positive integer, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise InputError(f"--lr: expected a positive number, got {args.lr}")
    multiple = 2 ** (len(channels) - 1)
    if args.patch is not None and any(p < multiple or p % multiple for p in args.patch):
        raise InputError(
            f"--patch: every side must be a positive multiple of {multiple} with {len(channels)} levels, "
            f"got {' '.join(map(str, args.patch))}"
        )
    labels = int_list(args.labels, "--labels", distinct=True) if args.labels else None
    if labels is not None and not [v for v in labels if v != 0]:
        raise InputError("--labels: name at least one label other than 0 (the background)")
    return down.Settings(
        network=args.network,
        channels=channels,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        patch=tuple(args.patch) if args.patch else None,
        seed=args.seed,
        arms=arms,
        labels=labels,
    )


def run_downstream(argv: Sequence[str]) -> dict[str, Any]:
    args = downstream_parser().parse_args(list(argv))
    settings = downstream_settings(args)
    scaling = scaling_from(args)
    device = device_flag(args.device)
    storage.check_target(args.out, DOWNSTREAM_OUTPUTS, args.overwrite)
    if args.samples is None and set(settings.arms) - {"real"}:
        raise InputError("--samples: needed for the synthetic and mixed arms (or use --arms real)")
    real = down.real_pairs(args.images, args.masks)
    synthetic = down.synthetic_pairs(args.samples, args.sample_masks or args.masks) if args.samples else []
    if args.splits is not None and args.test_cases is not None:
        raise InputError("--splits and --test_cases: give one of them")
    if args.splits is not None:
        splits = down.read_splits(args.splits, real, synthetic)
    elif args.test_cases is not None:
        splits = down.chosen_splits(real, synthetic, comma_list(args.test_cases), args.seed)
    else:
        num_test = args.num_test if args.num_test is not None else max(1, round(len(real) / 4))
        splits = down.make_splits(real, synthetic, num_test, args.seed)
    log.info(
        "%d real training, %d real test cases; %d synthetic training volumes (%d left out: test masks)",
        len(splits["real_train"]),
        len(splits["real_test"]),
        len(splits["synthetic_train"]),
        len(splits["synthetic_excluded"]),
    )
    bars: dict[str, tqdm] = {}

    def on_step(arm: str, step: int, loss: float) -> None:
        if arm not in bars:
            bars[arm] = tqdm(
                total=settings.steps, desc=f"training ({arm})", unit="step", dynamic_ncols=True, leave=False
            )
        bars[arm].update(1)
        bars[arm].set_postfix(loss=f"{loss:.4f}", refresh=False)
        if step + 1 == settings.steps:
            bars[arm].close()

    result = down.run(real, synthetic, splits, settings, scaling, device, on_step)
    result["inputs"] = {
        k: str(getattr(args, k)) if getattr(args, k) else None
        for k in ("images", "masks", "samples", "sample_masks", "splits")
    }

    def write() -> None:
        write_csv(args.out / "downstream.csv", down.table_rows(result))
        write_json(args.out / "downstream.json", result)
        write_json(args.out / "splits.json", result["splits"])

    write_locked(args.out, DOWNSTREAM_OUTPUTS, args.overwrite, "evaluation", write)
    return result


def downstream_table(result: dict[str, Any]) -> str:
    labels = [str(v) for v in result["labels"]]
    lines = [
        f"{'trained on':<12}" + "".join(f"{'label ' + v:>10}" for v in labels) + f"{'mean':>10}  (Dice on "
        f"{len(result['splits']['real_test'])} real test cases)"
    ]
    for arm, r in result["arms"].items():
        name = {"mixed": "real+synth"}.get(arm, arm)
        lines.append(
            f"{name:<12}"
            + "".join(f"{_num(r['dice'][v]['mean']):>10}" for v in labels)
            + f"{_num(r['mean_dice']):>10}  ({r['train_volumes']} training volumes)"
        )
    return "\n".join(lines)


# ---- distribution -------------------------------------------------------------------------------------------
DISTRIBUTION_OUTPUTS = ("distribution.json", "distribution.csv")
NO_WEIGHTS = (
    "--feature_weights PATH is required: a local MedicalNet ResNet checkpoint (e.g. resnet_50_23dataset.pth "
    "from huggingface.co/TencentMedicalNet); nothing is downloaded"
)


def distribution_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m diffusion3d evaluate distribution",
        description="FID and MMD between real and synthetic volumes on global-average-pooled features of a 3D "
        "MedicalNet ResNet whose weights you supply (nothing is downloaded).",
    )
    p.add_argument("--real", required=True, type=Path, help="folder of real volumes (every .nii / .nii.gz)")
    p.add_argument("--samples", required=True, type=Path, help="folder of synthetic volumes (every .nii / .nii.gz)")
    p.add_argument("--feature_weights", type=Path, default=None, help="local MedicalNet checkpoint or state dict")
    p.add_argument(
        "--feature_network",
        choices=dist.FEATURE_NETWORKS,
        default="resnet50",
        help="the layout of the weights (default resnet50: 2048 features)",
    )
    p.add_argument(
        "--feature_layout",
        choices=dist.FEATURE_LAYOUTS,
        default="medicalnet",
        help="medicalnet: layer3/4 dilated as MedicalNet computes (default); monai: strided, as MONAI's ResNet",
    )
    p.add_argument(
        "--feature_input",
        choices=dist.FEATURE_INPUTS,
        default="zscore",
        help="zscore: MedicalNet's normalisation of each volume (default); unit: the [0, 1] volume as is",
    )
    p.add_argument("--out", required=True, type=Path, help="output folder: distribution.json, distribution.csv")
    p.add_argument("--seed", type=int, default=0, help="the random halves of the real set (reference FID)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    add_intensity_flags(p)
    p.add_argument("--overwrite", action="store_true", help="replace existing results in --out")
    return p


def run_distribution(argv: Sequence[str]) -> dict[str, Any]:
    args = distribution_parser().parse_args(list(argv))
    if args.feature_weights is None:
        raise InputError(NO_WEIGHTS)
    scaling = scaling_from(args)
    device = device_flag(args.device)
    storage.check_target(args.out, DISTRIBUTION_OUTPUTS, args.overwrite)
    files = {
        "real": sorted(scan_folder(args.real, "").values()),
        "synthetic": sorted(scan_folder(args.samples, "").values()),
    }
    for kind, paths in files.items():
        if len(paths) < 2:
            raise InputError(
                f"{args.real if kind == 'real' else args.samples}: FID and MMD need at least 2 volumes, "
                f"found {len(paths)}"
            )
    net = dist.load_feature_network(args.feature_weights, args.feature_network, device, args.feature_layout)
    bar = tqdm(total=sum(map(len, files.values())), desc="features", unit="volume", dynamic_ncols=True, leave=False)
    feats = {
        kind: dist.features(
            net,
            (scaling.read(p, kind == "synthetic") for p in paths),
            device,
            args.feature_input,
            lambda: bar.update(1),
        )
        for kind, paths in files.items()
    }
    bar.close()
    result = dist.compare(feats["real"], feats["synthetic"], args.seed)
    result["settings"] = {
        "feature_weights": str(args.feature_weights),
        "feature_network": args.feature_network,
        "feature_layout": args.feature_layout,
        "feature_input": args.feature_input,
        "seed": args.seed,
        "device": str(device),
        "real": str(args.real),
        "samples": str(args.samples),
        "scaling": vars(scaling),
    }

    def write() -> None:
        write_json(args.out / "distribution.json", result)
        keys = ("fid", "mmd", "n_real", "n_synthetic", "feature_dim")
        ref = result["reference"] or {}
        write_csv(
            args.out / "distribution.csv", [{k: result[k] for k in keys} | {f"half_{k}": v for k, v in ref.items()}]
        )

    write_locked(args.out, DISTRIBUTION_OUTPUTS, args.overwrite, "evaluation", write)
    return result


# ---- dispatch -----------------------------------------------------------------------------------------------
def _report(name: str, result: dict[str, Any]) -> str:
    if name == "downstream":
        return downstream_table(result)
    ref = result["reference"]
    lines = [
        f"FID {result['fid']:.4g}, MMD {result['mmd']:.4g}: {result['n_real']} real vs {result['n_synthetic']} "
        "synthetic volumes"
    ]
    if ref:
        lines.append(
            f"at {ref['n']} vs {ref['n']}: real half vs real half FID {ref['fid_real_vs_real']:.4g}, MMD "
            f"{ref['mmd_real_vs_real']:.4g}; real half vs synthetic FID {ref['fid_real_vs_synthetic']:.4g}, "
            f"MMD {ref['mmd_real_vs_synthetic']:.4g}"
        )
    return "\n".join(lines + [f"note: {n}" for n in result["notes"]])


SUBCOMMANDS: dict[str, Callable[[Sequence[str]], dict[str, Any]]] = {
    "downstream": run_downstream,
    "distribution": run_distribution,
}


def main(name: str, argv: Sequence[str]) -> None:
    """Run subcommand ``name``: exit 0 with its table, 2 with one line for bad input, 1 for a storage fault."""
    configure_logging()

    def body() -> int:
        print(_report(name, SUBCOMMANDS[name](argv)))
        return 0

    sys.exit(run_command(body))
