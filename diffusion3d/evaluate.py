"""Evaluation: samples against the real images of their masks, and the samples of one mask against each other.

Pairing: ``<samples>/<case>_sample<i>.nii.gz`` is compared with ``<images>/<case>.nii.gz`` and, for the
per-label statistics, ``<masks>/<case>.nii.gz`` (``.nii`` works too). The sample must have the real image's
shape (the sampling command writes on the mask's grid, which is the image's).

Intensity: every metric is computed on volumes mapped to [0, 1] (and clipped), so the data range of SSIM and
PSNR is 1.0 and MAE is in units of that range:

- the real image by ``--real_range LO HI`` if given, else by its own ``--real_percentiles`` (default 0 100:
  min to max; pass 0 99.5 to match training with ``intensity: percentile``);
- a sample by ``--sample_range LO HI`` (default 0 1: what the sampling command writes with the default
  ``output_intensity: unit``; use the run's ``intensity_range`` for ``source``, -1 1 for ``model``).

Metrics (MONAI's where they exist):

- per sample: SSIM (Gaussian window 11, or the largest odd size that fits the smallest side), PSNR
  (``inf`` for an identical volume; ``null`` in the JSON), MAE;
- per mask with ≥ 2 samples: diversity as the mean MS-SSIM over all pairs of its samples (lower = more
  diverse). Window 7 and as many of MONAI's five scale weights (renormalised) as the smallest side allows:
  32³ → 3 scales, 128³ → 5. Under 14 voxels on a side MS-SSIM is not defined here and is left empty, with
  a note;
- per mask label (``--labels``, default: every label in the mask, background 0 included): mean and standard
  deviation of intensity inside the label, in the real image and in the sample.
- with masks, mask fidelity and sharpness (``diffusion3d.metrics``, the same as the quality benchmark's):
  ``head_dice`` (Otsu threshold of the sample vs. all labels), ``lesion_dice`` (the extreme class of a
  three-class Otsu inside the head vs. the last label), ``truth_*_dice`` (the same on the real image: the
  ceiling), ``contrast_ratio`` (lesion / rest-of-head contrast, sample over real), ``abs_mean_error_max``
  (the largest per-label mean intensity error) and ``sharpness_ratio`` (mean gradient magnitude in the head,
  sample over real: blur < 1, noise > 1). Unlike correlation, none of these hides an offset or a scale.

Written to ``--out``: ``metrics.csv`` (one row per sample), ``cases.csv`` (one row per mask),
``metrics.json`` (settings, summary, everything per case), ``report.html`` (mid-slice montages, the tables,
per-label intensity histograms; ``report.Report``) and TensorBoard summaries in ``--out/tb`` at ``--step``.
Bad input → one line ``error: <file>: <problem>``, exit code 2, nothing written.

``python -m diffusion3d.evaluate downstream ...`` (segmentation Dice of networks trained on real, synthetic and
both) and ``... distribution ...`` (FID / MMD on MedicalNet features) are subcommands: ``evaluate_cli``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.metrics import MAEMetric, MultiScaleSSIMMetric, PSNRMetric, SSIMMetric

from . import checkpoint as ckpt
from . import evaluate_cli
from ._cli import InputError, OneLineParser, configure_logging, run_command, write_csv, write_json
from .data import DataError, read_volume
from .evalinputs import check_folder, find_partner, group_samples, real_bounds, to_unit
from .evaluate_cli import SUBCOMMANDS, add_intensity_flags, scaling_from
from .metrics import mask_fidelity, sharpness, ssim_window
from .report import Report

log = logging.getLogger("diffusion3d.evaluate")  # not __name__: "__main__" under python -m
MS_SSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)  # MONAI's (Wang et al. 2003)
MS_SSIM_KERNEL = 7
OUTPUTS = ("metrics.csv", "cases.csv", "metrics.json", "report.html")


# ---- inputs -----------------------------------------------------------------------------------------
@dataclass
class CaseFiles:
    case: str
    image: Path
    mask: Path | None
    samples: list[tuple[int, Path]] = field(default_factory=list)


def pair(samples_dir: Path, images_dir: Path, masks_dir: Path | None) -> list[CaseFiles]:
    """Group ``<case>_sample<i>`` files by case and find each case's image (and mask); DataError otherwise."""
    for folder in [samples_dir, images_dir, *([masks_dir] if masks_dir else [])]:
        check_folder(folder)
    cases = []
    for case, samples in group_samples(samples_dir).items():
        first = samples[0][1]
        image = find_partner(first, images_dir, case, "real image")
        mask = find_partner(first, masks_dir, case, "mask") if masks_dir is not None else None
        cases.append(CaseFiles(case, image, mask, samples))
    return cases


def parse_labels(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        labels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"--labels: expected integers separated by commas, got {text!r}") from None
    if not labels or len(set(labels)) != len(labels):
        raise InputError(f"--labels: expected distinct integers, got {text!r}")
    return labels


# ---- scaling and metrics ------------------------------------------------------------------------------
def ms_ssim_scales(shape: tuple[int, ...], kernel: int = MS_SSIM_KERNEL) -> int:
    """How many scales fit: every scale's side must hold the window, and MONAI's own size check must pass."""
    side = min(shape)
    best = 0
    for levels in range(2, len(MS_SSIM_WEIGHTS) + 1):
        fits = side // 2 ** (levels - 1) >= kernel
        monai_check = side // max(1, levels - 1) ** 2 > kernel - 1
        if fits and monai_check:
            best = levels
    return best


def per_sample_metrics(sample: torch.Tensor, real: torch.Tensor) -> dict[str, float]:
    win = ssim_window(tuple(real.shape[2:]))
    return {
        "ssim": float(SSIMMetric(spatial_dims=3, data_range=1.0, win_size=win)(sample, real).item()),
        "psnr": float(PSNRMetric(max_val=1.0)(sample, real).item()),
        "mae": float(MAEMetric()(sample, real).item()),
    }


def diversity(samples: list[torch.Tensor]) -> tuple[float | None, int, str]:
    """(mean pairwise MS-SSIM, number of pairs, note). None when there are < 2 samples or they are too small."""
    if len(samples) < 2:
        return None, 0, "needs at least 2 samples"
    levels = ms_ssim_scales(tuple(samples[0].shape[2:]))
    if levels == 0:
        return None, 0, f"volume {tuple(samples[0].shape[2:])} too small for MS-SSIM (smallest side < {2 * MS_SSIM_KERNEL})"
    weights = np.asarray(MS_SSIM_WEIGHTS[:levels]) / sum(MS_SSIM_WEIGHTS[:levels])
    metric = MultiScaleSSIMMetric(spatial_dims=3, data_range=1.0, kernel_size=MS_SSIM_KERNEL, weights=tuple(weights.tolist()))
    pairs = list(itertools.combinations(range(len(samples)), 2))
    a = torch.cat([samples[i] for i, _ in pairs])
    b = torch.cat([samples[j] for _, j in pairs])
    values = metric(a, b).flatten()
    return float(values.mean().item()), len(pairs), f"{levels} scales, window {MS_SSIM_KERNEL}"


def label_stats(sample: np.ndarray, real: np.ndarray, mask: np.ndarray, labels: list[int]) -> dict[int, dict[str, float | int | None]]:
    """Per label: voxel count and the mean/std of intensity inside it in the real image and the sample."""
    out: dict[int, dict[str, float | int | None]] = {}
    for label in labels:
        inside = mask == label
        n = int(inside.sum())
        if n == 0:
            out[label] = {"voxels": 0, "real_mean": None, "real_std": None, "sample_mean": None, "sample_std": None}
            continue
        r, s = real[inside], sample[inside]
        out[label] = {"voxels": n, "real_mean": float(r.mean()), "real_std": float(r.std()),
                      "sample_mean": float(s.mean()), "sample_std": float(s.std())}
    return out


# ---- one evaluation -------------------------------------------------------------------------------------
def evaluate(
    cases: list[CaseFiles],
    labels: list[int] | None = None,
    real_range: tuple[float, float] | None = None,
    real_percentiles: tuple[float, float] = (0.0, 100.0),
    sample_range: tuple[float, float] = (0.0, 1.0),
    report: Report | None = None,
) -> dict[str, Any]:
    """Every metric, in memory (nothing is written here); raises DataError naming a file that does not fit.
    With ``report``, each case's volumes (as scored, in [0, 1]) are also handed to it."""
    rows: list[dict[str, Any]] = []
    per_case: list[dict[str, Any]] = []
    for c in cases:
        real_info, real_np = read_volume(c.image)
        lo, hi = real_bounds(real_np, real_range, real_percentiles)
        real = to_unit(real_np, lo, hi)
        mask_np = None
        if c.mask is not None:
            _, mask_np = read_volume(c.mask)
            if mask_np.shape != real_np.shape:
                raise DataError(f"{c.mask}: mask shape {mask_np.shape} differs from image shape {real_np.shape}")
        case_labels = labels if labels is not None else (sorted(int(v) for v in np.unique(mask_np)) if mask_np is not None else [])
        units = []
        for index, path in sorted(c.samples):
            info, sample_np = read_volume(path)
            if sample_np.shape != real_np.shape:
                raise DataError(f"{path}: sample shape {sample_np.shape} differs from the real image's {real_np.shape} ({c.image.name})")
            if not np.allclose(info.affine, real_info.affine, atol=1e-3):
                log.warning("%s: affine differs from %s's; voxels are compared as they are", path, c.image.name)
            if not np.isfinite(sample_np).all():
                raise DataError(f"{path}: contains NaN or infinite voxels")
            sample = to_unit(sample_np, *sample_range)
            units.append(sample)
            row: dict[str, Any] = {"case": c.case, "sample": index, "file": path.name, **per_sample_metrics(sample, real)}
            if mask_np is not None:
                stats = label_stats(sample[0, 0].numpy(), real[0, 0].numpy(), mask_np, case_labels)
                row["labels"] = stats
                row.update(fidelity(sample[0, 0].numpy(), real[0, 0].numpy(), mask_np, case_labels))
            rows.append(row)
        ms, n_pairs, note = diversity(units)
        if report is not None:
            report.add_case(c.case, real[0, 0].numpy(), [u[0, 0].numpy() for u in units], mask_np)
        per_case.append({"case": c.case, "image": str(c.image), "mask": str(c.mask) if c.mask else None,
                         "n_samples": len(units), "ms_ssim": ms, "ms_ssim_pairs": n_pairs, "ms_ssim_note": note})
    return {"settings": {"real_range": real_range, "real_percentiles": list(real_percentiles),
                         "sample_range": list(sample_range), "labels": labels, "data_range": 1.0,
                         "ms_ssim_kernel": MS_SSIM_KERNEL},
            "summary": summarize(rows, per_case), "cases": per_case, "samples": rows}


FIDELITY_KEYS = ("head_dice", "lesion_dice", "truth_head_dice", "truth_lesion_dice", "contrast_ratio",
                 "abs_mean_error_max", "sharpness_ratio")


def fidelity(sample: np.ndarray, real: np.ndarray, mask: np.ndarray, labels: list[int]) -> dict[str, float]:
    """Mask fidelity (``metrics.mask_fidelity``: Otsu Dice of head = all labels and lesion = the last label,
    contrast ratio, largest per-label mean error) and the sharpness ratio inside the head."""
    foreground = [label for label in labels if label != 0]
    if not foreground or not (mask > 0).any():
        return {}
    full = mask_fidelity(sample, real, mask, foreground)
    out = {k: full[k] for k in FIDELITY_KEYS if k in full}
    head = mask > 0
    out["sharpness_ratio"] = sharpness(sample, head) / sharpness(real, head)
    return out


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def summarize(rows: list[dict[str, Any]], per_case: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "n_cases": len(per_case),
        "n_samples": len(rows),
        "ssim": _mean([r["ssim"] for r in rows]),
        "psnr": _mean([r["psnr"] for r in rows]),  # finite values only: identical volumes (inf) are left out
        "psnr_infinite": sum(1 for r in rows if math.isinf(r["psnr"])),
        "mae": _mean([r["mae"] for r in rows]),
        "ms_ssim": _mean([c["ms_ssim"] for c in per_case]),
    }
    for key in FIDELITY_KEYS:
        if any(key in r for r in rows):
            summary[key] = _mean([r.get(key) for r in rows])
    labels = sorted({k for r in rows for k in r.get("labels", {})})
    for label in labels:
        diffs = [abs(s["sample_mean"] - s["real_mean"]) for r in rows if (s := r.get("labels", {}).get(label)) and s["voxels"]]
        summary[f"label{label}_mean_abs_diff"] = _mean(diffs)
    return summary


# ---- writing ------------------------------------------------------------------------------------------
def flat_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The per-sample rows with one column per (label, statistic); blank where a label is absent."""
    labels = sorted({k for r in rows for k in r.get("labels", {})})
    stats = ("voxels", "real_mean", "real_std", "sample_mean", "sample_std")
    fid = [k for k in FIDELITY_KEYS if any(k in r for r in rows)]
    header = ["case", "sample", "file", "ssim", "psnr", "mae", *fid, *[f"label{k}_{s}" for k in labels for s in stats]]
    flat = []
    for r in rows:
        out = {k: r[k] for k in header[:6]}
        out.update({k: r.get(k) for k in fid})
        for k in labels:
            for s in stats:
                v = r.get("labels", {}).get(k, {}).get(s)
                out[f"label{k}_{s}"] = "" if v is None else v
        flat.append(out)
    return header, flat


def write_outputs(result: dict[str, Any], out: Path, step: int, report: Report | None = None) -> list[Path]:
    from torch.utils.tensorboard import SummaryWriter

    out.mkdir(parents=True, exist_ok=True)
    header, flat = flat_rows(result["samples"])
    write_csv(out / "metrics.csv", flat, header)
    case_header = ["case", "n_samples", "ms_ssim", "ms_ssim_pairs", "ms_ssim_note", "image", "mask"]
    write_csv(out / "cases.csv", result["cases"], case_header)
    write_json(out / "metrics.json", result)
    if report is not None:
        (out / "report.html").write_text(report.evaluation_page(result, header, flat), encoding="utf-8")
    with SummaryWriter(str(out / "tb")) as writer:
        for key, value in result["summary"].items():
            if isinstance(value, float) and math.isfinite(value):
                writer.add_scalar(f"eval/{key}", value, step)
        table = "| " + " | ".join(header[:6]) + " |\n|" + "---|" * 6 + "\n"
        table += "\n".join("| " + " | ".join(str(r[k]) for k in header[:6]) + " |" for r in flat)
        writer.add_text("eval/samples", table, step)
    return [out / name for name in OUTPUTS if (out / name).exists()]


# ---- the command line -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m diffusion3d.evaluate",
        description="SSIM / PSNR / MAE of each <case>_sample<i>.nii.gz against <images>/<case>.nii.gz, MS-SSIM "
        "among the samples of one mask, and per-label intensity statistics; written as CSV, JSON, report.html and "
        "TensorBoard. Subcommands (see their --help): 'downstream' (segmentation Dice of networks trained on real, "
        "synthetic and both), 'distribution' (FID and MMD on MedicalNet features).",
    )
    p.add_argument("--samples", required=True, type=Path, help="folder of <case>_sample<i>.nii.gz")
    p.add_argument("--images", required=True, type=Path, help="folder of real images <case>.nii.gz")
    p.add_argument("--masks", type=Path, default=None, help="folder of masks <case>.nii.gz (per-label statistics)")
    p.add_argument("--out", required=True, type=Path, help="output folder: metrics.csv, cases.csv, metrics.json, tb/")
    p.add_argument("--labels", default=None, help="e.g. 0,1,2 (default: every label in each mask)")
    add_intensity_flags(p)
    p.add_argument("--step", type=int, default=0, help="TensorBoard step of these results (e.g. the checkpoint's)")
    p.add_argument("--report_cases", type=int, default=6, metavar="N",
                   help="report.html shows the mid-slices of the first N cases (0: no report; default 6)")
    p.add_argument("--overwrite", action="store_true", help="replace existing metrics files in --out")
    return p


def run(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    scaling = scaling_from(args)
    labels = parse_labels(args.labels)
    if args.report_cases < 0:
        raise InputError(f"--report_cases: expected a number >= 0, got {args.report_cases}")
    if args.out.exists() and not args.out.is_dir():
        raise InputError(f"{args.out}: exists and is not a folder")
    existing = [args.out / n for n in OUTPUTS if (args.out / n).exists()]
    if existing and not args.overwrite:
        raise InputError(f"{existing[0]}: already exists; use --overwrite to replace")
    cases = pair(args.samples, args.images, args.masks)
    report = Report(max_cases=args.report_cases) if args.report_cases else None
    result = evaluate(cases, labels, scaling.real_range, scaling.real_percentiles, scaling.sample_range, report)
    result["settings"]["step"] = args.step
    try:  # one writer per output folder; taken once the inputs are known good, so bad input writes nothing
        lock = ckpt.lock_folder(args.out, "evaluation")
    except ckpt.FolderLockedError as e:
        raise InputError(str(e)) from None
    with lock:
        existing = [args.out / n for n in OUTPUTS if (args.out / n).exists()]
        if existing and not args.overwrite:  # written meanwhile by a run that has finished
            raise InputError(f"{existing[0]}: already exists; use --overwrite to replace")
        write_outputs(result, args.out, args.step, report)
    return result


def evaluate_and_report(argv: list[str] | None = None) -> int:
    s = run(argv)["summary"]

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    print(f"{s['n_samples']} samples of {s['n_cases']} masks: SSIM {fmt(s['ssim'])}, PSNR {fmt(s['psnr'])} dB"
          f"{' (+%d identical)' % s['psnr_infinite'] if s['psnr_infinite'] else ''}, MAE {fmt(s['mae'])}, "
          f"MS-SSIM among samples {fmt(s['ms_ssim'])}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``diffusion3d-evaluate``): exit 0; 2 with one line for bad input; 1 for a storage fault.
    ``downstream ...`` and ``distribution ...`` run those subcommands (``evaluate_cli``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        evaluate_cli.main(argv[0], argv[1:])
    configure_logging()
    sys.exit(run_command(lambda: evaluate_and_report(argv)))


if __name__ == "__main__":
    main()
