"""Sample-quality metrics that cannot hide offset or scale, for the quality benchmark and ``evaluate``.

Inputs are numpy arrays [D, H, W]: a sample and its truth already mapped to [0, 1], and the integer label
map that conditioned the sample (0 background). Correlation is deliberately absent: it ignores offset and
scale, so a sample with a grey-noise background can still correlate at 0.95.

- **mask fidelity**: per-label signed mean intensity error (sample − truth); Dice against the mask of an
  Otsu threshold of the sample (head: over the whole volume; lesion: inside the true head eroded by ``rim``
  voxels, default 2, so that a bright skull or scalp at the head's edge is not taken for lesion — a
  lesion voxel within 2 voxels of the head's surface is left out of both sides of that Dice); the
  lesion / rest-of-head contrast of the sample relative to the truth's. The same Dice of the truth itself is
  reported as the ceiling the data allows.
- **realism**: SSIM and PSNR against the truth (MONAI, data range 1), and the sharpness ratio: the mean
  gradient magnitude inside the head, sample over truth (blur < 1, noise > 1). MONAI's SSIM is computed on
  the valid part of its window (no padding): at 32³ with the 11-voxel window a 5-voxel border, mostly
  background, is left out, so SSIM must be read together with the background's mean error.
- **diversity**: the mean SSIM between the samples of one mask (lower = more diverse); against its
  reference (``reference_diversity``): ``model_div`` = 1 − that SSIM, ``data_div`` = 1 − SSIM between two
  real draws of the same mask, and ``div_ratio`` = model_div / data_div (1: as varied as the data; below 1:
  samples regress toward the conditional mean). The twin's SSIM and sharpness against the truth are the
  reference for the samples' own: with one truth and one twin, ``ssim_twin`` = 1 − ``data_div``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
from monai.metrics import PSNRMetric, SSIMMetric


def ssim_window(shape: tuple[int, ...]) -> int:
    """11 (the usual window), or the largest odd size that fits the smallest side."""
    side = min(shape)
    return min(11, side if side % 2 else side - 1)


def _check(*arrays: np.ndarray) -> None:
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1 or len(next(iter(shapes))) != 3:
        raise ValueError(f"expected 3-D arrays of one shape, got {[a.shape for a in arrays]}")


def _histogram(values: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    counts, edges = np.histogram(values, bins=bins)
    return counts.astype(np.float64), (edges[:-1] + edges[1:]) / 2


def otsu_threshold(values: np.ndarray, bins: int = 256) -> float:
    """Otsu (1979): the threshold maximising the between-class variance; constant input -> that value."""
    values = np.asarray(values, dtype=np.float64).ravel()
    if values.size == 0:
        raise ValueError("otsu_threshold of an empty array")
    if values.min() == values.max():
        return float(values.min())
    counts, centres = _histogram(values, bins)
    w0 = np.cumsum(counts)[:-1]
    w1 = counts.sum() - w0
    m = np.cumsum(counts * centres)[:-1]
    mu0 = m / np.maximum(w0, 1e-12)
    mu1 = (np.sum(counts * centres) - m) / np.maximum(w1, 1e-12)
    between = w0 * w1 * (mu0 - mu1) ** 2
    i = int(np.argmax(between))
    return float((centres[i] + centres[i + 1]) / 2)


def dice(pred: np.ndarray, target: np.ndarray) -> float:
    """Dice of two boolean arrays; 1.0 when both are empty."""
    pred, target = np.asarray(pred, bool), np.asarray(target, bool)
    total = pred.sum() + target.sum()
    return 1.0 if total == 0 else float(2 * np.logical_and(pred, target).sum() / total)


def sharpness(volume: np.ndarray, region: np.ndarray) -> float:
    """Mean 3-D gradient magnitude (central differences) over the voxels where ``region`` is True."""
    gradients = np.gradient(np.asarray(volume, dtype=np.float64))
    magnitude = np.sqrt(sum(g**2 for g in gradients))
    region = np.asarray(region, bool)
    return float(magnitude[region].mean()) if region.any() else float("nan")


def _ratio(num: float, den: float) -> float:
    """num / den, NaN where undefined (a zero or NaN denominator: an all-black sample, a flat truth)."""
    return float(num / den) if math.isfinite(num) and math.isfinite(den) and den != 0 else float("nan")


def _mean(volume: np.ndarray, where: np.ndarray) -> float:
    return float(volume[where].mean()) if where.any() else float("nan")


def _head_dice(volume: np.ndarray, head: np.ndarray) -> float:
    return dice(volume > otsu_threshold(volume), head)


def erode(region: np.ndarray, voxels: int) -> np.ndarray:
    """Binary erosion by a (2·voxels + 1)³ cube."""
    if voxels <= 0:
        return region
    outside = torch.from_numpy(~np.asarray(region, bool)).float()[None, None]
    grown = torch.nn.functional.max_pool3d(outside, 2 * voxels + 1, stride=1, padding=voxels)
    return grown[0, 0].numpy() == 0


def _lesion_dice(volume: np.ndarray, inner: np.ndarray, lesion: np.ndarray, brighter: bool) -> float:
    """Two-class Otsu of the voxels inside the eroded head; the lesion is the side the truth's lesion is on."""
    if not (lesion & inner).any():
        return float("nan")
    threshold = otsu_threshold(volume[inner])
    found = (volume > threshold) if brighter else (volume <= threshold)
    return dice(found & inner, lesion & inner)


def mask_fidelity(
    sample: np.ndarray,
    truth: np.ndarray,
    mask: np.ndarray,
    labels: Sequence[int] = (1, 2),
    head_labels: Sequence[int] | None = None,
    lesion_label: int | None = None,
    rim: int = 2,
) -> dict[str, float]:
    """Does the sample follow its mask? See the module docstring for each key."""
    _check(sample, truth, mask)
    labels = list(labels)
    out: dict[str, float] = {}
    for label in [0, *labels]:
        inside = mask == label
        out[f"mean_error/{label}"] = _mean(sample, inside) - _mean(truth, inside)
    present = [abs(v) for v in out.values() if not math.isnan(v)]
    out["abs_mean_error_max"] = max(present) if present else float("nan")
    head = np.isin(mask, list(head_labels)) if head_labels is not None else mask > 0
    lesion_label = labels[-1] if lesion_label is None else lesion_label
    lesion = mask == lesion_label
    rest = head & ~lesion
    brighter = _mean(truth, lesion) > _mean(truth, rest) if lesion.any() else True
    out["head_dice"] = _head_dice(sample, head)
    out["truth_head_dice"] = _head_dice(truth, head)
    inner = erode(head, rim)
    out["lesion_dice"] = _lesion_dice(sample, inner, lesion, brighter)
    out["truth_lesion_dice"] = _lesion_dice(truth, inner, lesion, brighter)
    out["contrast"] = _ratio(_mean(sample, lesion), _mean(sample, rest))
    out["contrast_truth"] = _ratio(_mean(truth, lesion), _mean(truth, rest))
    out["contrast_ratio"] = _ratio(out["contrast"], out["contrast_truth"])
    return out


def _tensor(volume: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(volume, dtype=np.float32))[None, None]


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    win = ssim_window(a.shape)
    return float(SSIMMetric(spatial_dims=3, data_range=1.0, win_size=win)(_tensor(a), _tensor(b)).item())


def realism(sample: np.ndarray, truth: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """SSIM and PSNR against the truth, and the sharpness ratio inside the head (mask > 0)."""
    _check(sample, truth, mask)
    head = mask > 0
    return {
        "ssim": ssim(sample, truth),
        "psnr": float(PSNRMetric(max_val=1.0)(_tensor(sample), _tensor(truth)).item()),
        "sharpness_ratio": _ratio(sharpness(sample, head), sharpness(truth, head)),
    }


def mean_pairwise_ssim(samples: Sequence[np.ndarray]) -> float:
    """Mean SSIM over all pairs of samples of one mask (lower = more diverse); NaN for fewer than 2."""
    if len(samples) < 2:
        return float("nan")
    return float(np.mean([ssim(a, b) for a, b in itertools.combinations(samples, 2)]))


def score_sample(
    sample: np.ndarray, truth: np.ndarray, mask: np.ndarray, labels: Sequence[int] = (1, 2)
) -> dict[str, float]:
    """mask_fidelity and realism in one flat dict of floats."""
    return {**mask_fidelity(sample, truth, mask, labels), **realism(sample, truth, mask)}


def model_diversity(samples: Sequence[np.ndarray]) -> float:
    """1 − mean pairwise SSIM of the samples of one mask (0: identical); NaN for fewer than 2."""
    return 1.0 - mean_pairwise_ssim(samples)


def data_diversity(truth: np.ndarray, twin: np.ndarray) -> float:
    """1 − SSIM between two real draws of one mask: how much the data itself varies given the mask."""
    _check(truth, twin)
    return 1.0 - ssim(truth, twin)


def diversity_ratio(model_div: float, data_div: float) -> float:
    """model_div / data_div; NaN where undefined (no twin, or two identical real draws)."""
    return _ratio(model_div, data_div)


def reference_diversity(
    samples: Sequence[np.ndarray], truth: np.ndarray, twin: np.ndarray | None, mask: np.ndarray
) -> dict[str, float]:
    """The samples' diversity beside the data's, for one mask: model_div, data_div, div_ratio, and the
    twin's SSIM and sharpness ratio against the truth (NaN for the twin's keys where there is no twin)."""
    out = {
        "model_div": model_diversity(samples),
        "data_div": float("nan"),
        "ssim_twin": float("nan"),
        "sharpness_twin": float("nan"),
    }
    if twin is not None:
        _check(truth, twin, mask)
        out["data_div"] = data_diversity(truth, twin)
        out["ssim_twin"] = 1.0 - out["data_div"]
        head = mask > 0
        out["sharpness_twin"] = _ratio(sharpness(twin, head), sharpness(truth, head))
    out["div_ratio"] = diversity_ratio(out["model_div"], out["data_div"])
    return out
