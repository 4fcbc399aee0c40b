"""Quality metrics: each one catches the failure it is for (offset, blur, noise, a missing lesion), where
correlation would not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffusion3d.evaluation import metrics as M
from diffusion3d.synthetic import make_case


@pytest.fixture(scope="module")
def case():
    mask, image = make_case(np.random.default_rng([0, 2, 0]), 24)
    return image, mask


def blur(volume: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(volume)[None, None]
    return torch.nn.functional.avg_pool3d(t, 3, stride=1, padding=1, count_include_pad=False)[0, 0].numpy()


def test_otsu_and_dice():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(0.2, 0.03, 500), rng.normal(0.8, 0.03, 300)])
    t = M.otsu_threshold(values)
    assert (values[:500] < t).all() and (values[500:] > t).all()  # in the gap between the modes
    assert M.otsu_threshold(np.full(10, 0.4)) == 0.4
    ball = np.zeros((9, 9, 9), bool)
    ball[2:7, 2:7, 2:7] = True
    assert M.erode(ball, 1).sum() == 27 and M.erode(ball, 2).sum() == 1 and M.erode(ball, 0) is ball
    a = np.zeros((4, 4, 4), bool)
    a[:2] = True
    assert M.dice(a, a) == 1.0 and M.dice(a, ~a) == 0.0 and M.dice(~np.ones_like(a), ~np.ones_like(a)) == 1.0


def test_a_perfect_sample_scores_perfectly(case):
    image, mask = case
    r = M.score_sample(image, image, mask)
    assert r["abs_mean_error_max"] == 0.0 and r["ssim"] == pytest.approx(1.0) and math.isinf(r["psnr"])
    assert r["sharpness_ratio"] == pytest.approx(1.0) and r["contrast_ratio"] == pytest.approx(1.0)
    assert r["head_dice"] == r["truth_head_dice"] > 0.98
    assert r["lesion_dice"] == r["truth_lesion_dice"] > 0.9  # the bright skull rim is eroded away


def test_an_offset_keeps_correlation_but_not_the_mean_error(case):
    image, mask = case
    shifted = np.clip(image + 0.2, 0, 1)
    assert np.corrcoef(shifted.ravel(), image.ravel())[0, 1] > 0.95  # what correlation would report
    r = M.score_sample(shifted, image, mask)
    assert r["mean_error/0"] == pytest.approx(0.2, abs=0.01)
    assert r["abs_mean_error_max"] > 0.09 and r["psnr"] < 15


def test_grey_noise_background_is_caught(case):
    image, mask = case
    noisy = image.copy()
    bg = mask == 0
    noisy[bg] = np.random.default_rng(1).uniform(0.1, 0.4, bg.sum())
    assert np.corrcoef(noisy.ravel(), image.ravel())[0, 1] > 0.6
    r = M.score_sample(noisy, image, mask)
    # SSIM alone would not catch it here: MONAI computes it on the valid part of the 11-voxel window,
    # which at 24³ leaves out a 5-voxel border that is mostly background
    assert r["mean_error/0"] > 0.2 and r["abs_mean_error_max"] > 0.2


def test_sharpness_ratio_tells_blur_from_noise(case):
    image, mask = case
    assert M.realism(blur(image), image, mask)["sharpness_ratio"] < 0.8
    noisy = np.clip(image + np.random.default_rng(2).normal(0, 0.15, image.shape), 0, 1).astype(np.float32)
    assert M.realism(noisy, image, mask)["sharpness_ratio"] > 1.2


def test_a_missing_lesion_is_caught(case):
    image, mask = case
    no_lesion = image.copy()
    no_lesion[mask == 2] = np.random.default_rng(4).normal(0.5, 0.05, (mask == 2).sum())  # tissue-like
    r = M.mask_fidelity(no_lesion, image, mask)
    assert r["lesion_dice"] < 0.3 and r["contrast_ratio"] < 0.8
    assert r["mean_error/2"] < -0.2 and abs(r["mean_error/0"]) < 1e-6
    assert r["head_dice"] > 0.95  # the head is still right


def test_lesion_dice_is_not_fooled_by_the_skull_rim_but_catches_a_faint_lesion(case):
    image, mask = case
    faint = image.copy()
    faint[mask == 2] = 0.8  # still brighter than the tissue (0.5) and the rim (0.75): still a lesion
    assert M.mask_fidelity(faint, image, mask)["lesion_dice"] > 0.9
    gone = image.copy()
    gone[mask == 2] = np.random.default_rng(5).normal(0.55, 0.05, (mask == 2).sum())
    assert M.mask_fidelity(gone, image, mask)["lesion_dice"] < 0.5


def test_diversity(case):
    image, _ = case
    rng = np.random.default_rng(3)
    assert M.mean_pairwise_ssim([image, image]) == pytest.approx(1.0)
    assert M.mean_pairwise_ssim([rng.uniform(0, 1, image.shape), rng.uniform(0, 1, image.shape)]) < 0.1
    assert math.isnan(M.mean_pairwise_ssim([image]))


def test_diversity_against_the_datas_own(case):
    """Identical samples: model_div 0 whatever the data does; a twin (same mask, new texture and noise) is
    neither the truth nor uniform noise; samples that are the truth and its twin vary exactly as the data does."""
    image, mask = case
    twin_mask, twin = make_case(np.random.default_rng([0, 2, 0]), 24, texture_rng=np.random.default_rng([0, 3, 0]))
    assert np.array_equal(twin_mask, mask) and not np.array_equal(twin, image)
    data_div = M.data_diversity(image, twin)
    assert 0.005 < data_div < 0.5  # measured 0.016: the phantoms vary little given the mask (SSIM 0.98)
    same = M.reference_diversity([image, image], image, twin, mask)
    assert same["model_div"] == pytest.approx(0.0, abs=1e-6) and same["div_ratio"] == pytest.approx(0.0, abs=1e-4)
    assert same["data_div"] == pytest.approx(data_div) and same["ssim_twin"] == pytest.approx(1 - data_div)
    assert 0.7 < same["sharpness_twin"] < 1.3  # another real draw is about as sharp as the truth
    as_data = M.reference_diversity([image, twin], image, twin, mask)
    assert as_data["div_ratio"] == pytest.approx(1.0, rel=1e-5)
    no_twin = M.reference_diversity([image, twin], image, None, mask)
    assert math.isnan(no_twin["data_div"]) and math.isnan(no_twin["div_ratio"]) and no_twin["model_div"] > 0.005
    assert math.isnan(M.diversity_ratio(0.1, 0.0))


def test_bad_shapes_raise(case):
    image, mask = case
    with pytest.raises(ValueError, match="one shape"):
        M.score_sample(image[:10], image, mask)


def test_an_all_black_sample_or_a_flat_truth_scores_nan_not_an_exception(case):
    """A model early in training (or diverged, then clipped) can write an all-zero volume: no ZeroDivisionError."""
    image, mask = case
    r = M.score_sample(np.zeros_like(image), image, mask)
    assert math.isnan(r["contrast"]) and math.isnan(r["contrast_ratio"]) and r["sharpness_ratio"] == 0.0
    assert r["mean_error/1"] < -0.2 and r["head_dice"] == 0.0  # the rest is still scored
    flat = M.score_sample(image, np.zeros_like(image), mask)
    assert (
        math.isnan(flat["sharpness_ratio"])
        and math.isnan(flat["contrast_truth"])
        and math.isnan(flat["contrast_ratio"])
    )
