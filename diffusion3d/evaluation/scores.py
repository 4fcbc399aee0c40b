"""Per-image scores: each sample against the real image of its mask (SSIM, PSNR, MAE, mask fidelity,
sharpness, per-label intensity), the samples of one mask against each other (MS-SSIM), and the summary.
Where a second real image of a mask is given (a test-retest scan), the samples' diversity is read against
the data's own (``metrics.reference_diversity``: model_div, data_div, div_ratio); where none is, the summary
says so (``diversity_note``).

Library code: pairs files, reads volumes and raises ``DataError`` naming the file; the ``evaluate`` command
parses the flags and writes the tables (``diffusion3d.commands.evaluate``, whose docstring gives the metrics).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.metrics import MAEMetric, MultiScaleSSIMMetric, PSNRMetric, SSIMMetric

from ..data import DataError, read_volume
from .inputs import check_folder, find_case_file, find_partner, group_samples, real_bounds, to_unit
from .metrics import diversity_ratio, mask_fidelity, reference_diversity, sharpness, ssim_window
from .report import Report

log = logging.getLogger("diffusion3d.evaluate")
MS_SSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)  # MONAI's (Wang et al. 2003)
MS_SSIM_KERNEL = 7


# ---- inputs -----------------------------------------------------------------------------------------
@dataclass
class CaseFiles:
    case: str
    image: Path
    mask: Path | None
    samples: list[tuple[int, Path]] = field(default_factory=list)
    second: Path | None = None  # a second real image of the same mask (test-retest), if the user has one


def pair(
    samples_dir: Path, images_dir: Path, masks_dir: Path | None, second_dir: Path | None = None
) -> list[CaseFiles]:
    """Group ``<case>_sample<i>`` files by case and find each case's image (and mask); DataError otherwise.
    A case may lack its second image (``second_dir/<case>.nii.gz``): it is then left out of the data's diversity."""
    for folder in [samples_dir, images_dir, *([masks_dir] if masks_dir else []), *([second_dir] if second_dir else [])]:
        check_folder(folder)
    cases = []
    for case, samples in group_samples(samples_dir).items():
        first = samples[0][1]
        image = find_partner(first, images_dir, case, "real image")
        mask = find_partner(first, masks_dir, case, "mask") if masks_dir is not None else None
        second = find_case_file(second_dir, case) if second_dir is not None else None
        cases.append(CaseFiles(case, image, mask, samples, second))
    return cases


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


def ms_ssim_among(samples: list[torch.Tensor]) -> tuple[float | None, int, str]:
    """(mean pairwise MS-SSIM, number of pairs, note). None when there are < 2 samples or they are too small."""
    if len(samples) < 2:
        return None, 0, "needs at least 2 samples"
    levels = ms_ssim_scales(tuple(samples[0].shape[2:]))
    if levels == 0:
        return (
            None,
            0,
            f"volume {tuple(samples[0].shape[2:])} too small for MS-SSIM (smallest side < {2 * MS_SSIM_KERNEL})",
        )
    weights = np.asarray(MS_SSIM_WEIGHTS[:levels]) / sum(MS_SSIM_WEIGHTS[:levels])
    metric = MultiScaleSSIMMetric(
        spatial_dims=3, data_range=1.0, kernel_size=MS_SSIM_KERNEL, weights=tuple(weights.tolist())
    )
    pairs = list(itertools.combinations(range(len(samples)), 2))
    a = torch.cat([samples[i] for i, _ in pairs])
    b = torch.cat([samples[j] for _, j in pairs])
    values = metric(a, b).flatten()
    return float(values.mean().item()), len(pairs), f"{levels} scales, window {MS_SSIM_KERNEL}"


def label_stats(
    sample: np.ndarray, real: np.ndarray, mask: np.ndarray, labels: list[int]
) -> dict[int, dict[str, float | int | None]]:
    """Per label: voxel count and the mean/std of intensity inside it in the real image and the sample."""
    out: dict[int, dict[str, float | int | None]] = {}
    for label in labels:
        inside = mask == label
        n = int(inside.sum())
        if n == 0:
            out[label] = {"voxels": 0, "real_mean": None, "real_std": None, "sample_mean": None, "sample_std": None}
            continue
        r, s = real[inside], sample[inside]
        out[label] = {
            "voxels": n,
            "real_mean": float(r.mean()),
            "real_std": float(r.std()),
            "sample_mean": float(s.mean()),
            "sample_std": float(s.std()),
        }
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
        case_labels = (
            labels
            if labels is not None
            else (sorted(int(v) for v in np.unique(mask_np)) if mask_np is not None else [])
        )
        units = []
        for index, path in sorted(c.samples):
            info, sample_np = read_volume(path)
            if sample_np.shape != real_np.shape:
                raise DataError(
                    f"{path}: sample shape {sample_np.shape} differs from the real image's {real_np.shape} "
                    f"({c.image.name})"
                )
            if not np.allclose(info.affine, real_info.affine, atol=1e-3):
                log.warning("%s: affine differs from %s's; voxels are compared as they are", path, c.image.name)
            if not np.isfinite(sample_np).all():
                raise DataError(f"{path}: contains NaN or infinite voxels")
            sample = to_unit(sample_np, *sample_range)
            units.append(sample)
            row: dict[str, Any] = {
                "case": c.case,
                "sample": index,
                "file": path.name,
                **per_sample_metrics(sample, real),
            }
            if mask_np is not None:
                stats = label_stats(sample[0, 0].numpy(), real[0, 0].numpy(), mask_np, case_labels)
                row["labels"] = stats
                row.update(fidelity(sample[0, 0].numpy(), real[0, 0].numpy(), mask_np, case_labels))
            rows.append(row)
        ms, n_pairs, note = ms_ssim_among(units)
        if report is not None:
            report.add_case(c.case, real[0, 0].numpy(), [u[0, 0].numpy() for u in units], mask_np)
        per_case.append(
            {
                "case": c.case,
                "image": str(c.image),
                "mask": str(c.mask) if c.mask else None,
                "n_samples": len(units),
                "ms_ssim": ms,
                "ms_ssim_pairs": n_pairs,
                "ms_ssim_note": note,
                **against_second(c, real, real_np.shape, mask_np, units, real_range, real_percentiles),
            }
        )
    return {
        "settings": {
            "real_range": real_range,
            "real_percentiles": list(real_percentiles),
            "sample_range": list(sample_range),
            "labels": labels,
            "data_range": 1.0,
            "ms_ssim_kernel": MS_SSIM_KERNEL,
        },
        "summary": summarize(rows, per_case),
        "cases": per_case,
        "samples": rows,
    }


def against_second(
    c: CaseFiles,
    real: torch.Tensor,
    shape: tuple[int, ...],
    mask: np.ndarray | None,
    units: list[torch.Tensor],
    real_range: tuple[float, float] | None,
    real_percentiles: tuple[float, float],
) -> dict[str, Any]:
    """model_div (1 − mean pairwise SSIM of the samples), and with a second real image data_div (1 − its SSIM
    against the first, scaled to [0, 1] the same way), div_ratio, ssim_twin and sharpness_twin."""
    second = None
    if c.second is not None:
        _, second_np = read_volume(c.second)
        if second_np.shape != shape:
            raise DataError(f"{c.second}: second image shape {second_np.shape} differs from the image's {shape}")
        second = to_unit(second_np, *real_bounds(second_np, real_range, real_percentiles))[0, 0].numpy()
    head = mask if mask is not None else np.ones(shape, np.uint8)  # sharpness over the head, or everywhere
    samples = [u[0, 0].numpy() for u in units]
    ref = reference_diversity(samples, real[0, 0].numpy(), second, head)
    finite = {k: (v if math.isfinite(v) else None) for k, v in ref.items()}  # JSON has no NaN: null
    return {"second_image": str(c.second) if c.second else None, **finite}


REFERENCE_KEYS = ("model_div", "data_div", "div_ratio", "ssim_twin", "sharpness_twin")


def diversity_summary(per_case: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the cases; div_ratio over the cases that have both ≥ 2 samples and a second image, and a
    note saying what the ratio rests on (or why there is none)."""
    both = [c for c in per_case if _finite(c.get("model_div")) and _finite(c.get("data_div"))]
    out: dict[str, Any] = {
        "model_div": _mean([c.get("model_div") for c in per_case]),
        "data_div": _mean([c.get("data_div") for c in per_case]),
        "ssim_twin": _mean([c.get("ssim_twin") for c in per_case]),
        "sharpness_twin": _mean([c.get("sharpness_twin") for c in per_case]),
        "div_ratio": None,
        "div_ratio_cases": len(both),
    }
    with_second = sum(1 for c in per_case if c.get("second_image"))
    if both:
        ratio = diversity_ratio(_mean([c["model_div"] for c in both]), _mean([c["data_div"] for c in both]))
        out["div_ratio"] = ratio if math.isfinite(ratio) else None
        out["diversity_note"] = (
            f"div_ratio = model_div / data_div over the {len(both)} of {len(per_case)} masks "
            "with >= 2 samples and a second real image"
        )
    elif with_second:
        out["diversity_note"] = "second real images given, but no mask has >= 2 samples: no diversity ratio"
    else:
        out["diversity_note"] = (
            "no second real image of any mask (--second_images DIR of <case>.nii.gz, e.g. "
            "test-retest scans): the data's own diversity is unknown, so the samples' "
            "diversity (model_div, ms_ssim) has no reference"
        )
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


FIDELITY_KEYS = (
    "head_dice",
    "lesion_dice",
    "truth_head_dice",
    "truth_lesion_dice",
    "contrast_ratio",
    "abs_mean_error_max",
    "sharpness_ratio",
)


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
        **diversity_summary(per_case),
    }
    for key in FIDELITY_KEYS:
        if any(key in r for r in rows):
            summary[key] = _mean([r.get(key) for r in rows])
    labels = sorted({k for r in rows for k in r.get("labels", {})})
    for label in labels:
        diffs = [
            abs(s["sample_mean"] - s["real_mean"])
            for r in rows
            if (s := r.get("labels", {}).get(label)) and s["voxels"]
        ]
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
