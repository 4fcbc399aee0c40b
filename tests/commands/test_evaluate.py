"""The evaluation command: perfect against itself, worse against a perturbed copy, diversity, outputs, bad input."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffusion3d.commands import evaluate as E
from diffusion3d.evaluation import inputs, metrics, scores
from tests.helpers import phantom, write_nifti

SIZE = 32  # MS-SSIM gets 3 scales at 32³


@pytest.fixture
def folders(tmp_path):
    """Two cases (32³ phantoms, values about 0.02 / 0.5 / 0.9 per label) and their masks, no samples yet."""
    for i in range(2):
        image, mask = phantom(SIZE, i)
        write_nifti(tmp_path / "images" / f"case_{i}.nii.gz", image)
        write_nifti(tmp_path / "masks" / f"case_{i}.nii.gz", mask)
    (tmp_path / "samples").mkdir()
    return tmp_path


def load_image(root, case: str) -> np.ndarray:
    import nibabel as nib

    return np.asarray(nib.load(str(root / "images" / f"{case}.nii.gz")).dataobj)


def argv(root, *extra) -> list[str]:
    return [
        "--samples",
        str(root / "samples"),
        "--images",
        str(root / "images"),
        "--masks",
        str(root / "masks"),
        "--out",
        str(root / "eval"),
        "--real_range",
        "-0.2",
        "1.2",
        "--sample_range",
        "-0.2",
        "1.2",
        *extra,
    ]


def call(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        E.main(args)
    return exc.value.code, capsys.readouterr().err


def test_perfect_against_itself_worse_against_a_perturbed_copy(folders, capsys):
    image = load_image(folders, "case_0")
    rng = np.random.default_rng(0)
    write_nifti(folders / "samples" / "case_0_sample0.nii.gz", image)
    write_nifti(
        folders / "samples" / "case_0_sample1.nii.gz", image + rng.normal(0, 0.1, image.shape).astype(np.float32)
    )
    code, err = call(argv(folders, "--step", "7"), capsys)
    assert code == 0, err
    result = json.loads((folders / "eval" / "metrics.json").read_text())
    same, noisy = result["samples"]
    assert (same["file"], noisy["file"]) == ("case_0_sample0.nii.gz", "case_0_sample1.nii.gz")
    assert same["ssim"] == pytest.approx(1.0, abs=1e-6)
    assert same["mae"] == 0.0
    assert same["psnr"] is None  # infinite: identical volumes (strict JSON has no inf)
    assert noisy["ssim"] < 0.9 and noisy["mae"] > 0.05 and 10 < noisy["psnr"] < 40
    # The identical sample has the real image's label statistics; the phantom's label means are ordered.
    for stats in same["labels"].values():
        assert stats["sample_mean"] == pytest.approx(stats["real_mean"]) and stats["voxels"] > 0
    means = [same["labels"][k]["real_mean"] for k in ("0", "1", "2")]
    assert means == sorted(means) and means[2] - means[0] > 0.5
    case = result["cases"][0]
    assert case["n_samples"] == 2 and case["ms_ssim_pairs"] == 1 and case["ms_ssim_note"].startswith("3 scales")
    assert 0 <= case["ms_ssim"] < 0.99  # the noisy copy differs from the original (identical: 1, tested below)
    assert result["summary"]["psnr_infinite"] == 1
    with (folders / "eval" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["psnr"] for r in rows][0] == "inf" and float(rows[1]["ssim"]) == pytest.approx(noisy["ssim"])
    assert {"label0_real_mean", "label2_sample_std", "label1_voxels"} <= set(rows[0])
    events = EventAccumulator(str(folders / "eval" / "tb"))
    events.Reload()
    assert {"eval/ssim", "eval/mae", "eval/ms_ssim", "eval/label2_mean_abs_diff"} <= set(events.Tags()["scalars"])
    (point,) = events.Scalars("eval/ssim")
    assert point.step == 7 and point.value == pytest.approx(result["summary"]["ssim"])


def test_diversity_identical_samples_score_one(folders, capsys):
    image = load_image(folders, "case_1")
    for i in range(3):
        write_nifti(folders / "samples" / f"case_1_sample{i}.nii.gz", image)
    code, err = call(argv(folders, "--labels", "1,2"), capsys)
    assert code == 0, err
    result = json.loads((folders / "eval" / "metrics.json").read_text())
    assert result["cases"][0]["ms_ssim"] == pytest.approx(1.0, abs=1e-5)
    assert result["cases"][0]["ms_ssim_pairs"] == 3
    assert set(result["samples"][0]["labels"]) == {"1", "2"}  # --labels restricts the statistics


def test_diversity_against_second_real_images_or_a_note_without_them(folders, capsys):
    """Samples identical to the image: model_div 0, ratio 0. Samples that are the image and its retest: the ratio is
    1 (they vary as the data does). Without --second_images the summary says there is no reference."""
    rng = np.random.default_rng(5)
    for i in range(2):
        image = load_image(folders, f"case_{i}")
        retest = np.clip(image + rng.normal(0, 0.05, image.shape), 0, 1).astype(np.float32)
        write_nifti(folders / "second" / f"case_{i}.nii.gz", retest)
        write_nifti(folders / "samples" / f"case_{i}_sample0.nii.gz", image)
        write_nifti(folders / "samples" / f"case_{i}_sample1.nii.gz", image if i == 0 else retest)
    code, err = call(
        argv(folders, "--second_images", str(folders / "second"), "--real_range", "0", "1", "--sample_range", "0", "1"),
        capsys,
    )
    assert code == 0, err
    result = json.loads((folders / "eval" / "metrics.json").read_text())
    same, like_data = result["cases"]
    assert same["model_div"] == pytest.approx(0.0, abs=1e-6) and same["div_ratio"] == pytest.approx(0.0, abs=1e-4)
    assert same["data_div"] > 0.05 and same["ssim_twin"] == pytest.approx(1 - same["data_div"])
    assert like_data["div_ratio"] == pytest.approx(1.0, rel=1e-5)
    s = result["summary"]
    assert (
        s["div_ratio_cases"] == 2
        and s["div_ratio"] == pytest.approx(s["model_div"] / s["data_div"])
        and "2 of 2 masks" in s["diversity_note"]
    )
    assert "model_div" in (folders / "eval" / "cases.csv").read_text().splitlines()[0]
    code, err = call(argv(folders, "--overwrite"), capsys)
    assert code == 0, err
    s = json.loads((folders / "eval" / "metrics.json").read_text())["summary"]
    assert s["div_ratio"] is None and s["data_div"] is None and "no second real image" in s["diversity_note"]
    assert s["model_div"] > 0  # still measured, just without a reference
    (folders / "second" / "case_1.nii.gz").unlink()  # a case without its retest is left out of the ratio
    write_nifti(folders / "second" / "case_0.nii.gz", np.zeros((SIZE, SIZE, 8), np.float32))
    code, err = call(argv(folders, "--overwrite", "--second_images", str(folders / "second")), capsys)
    assert code == 2 and "case_0.nii.gz: second image shape" in err


def test_sample_that_ignores_the_mask_shows_in_label_stats(folders, capsys):
    """A sample with the intensities of label 1 and 2 swapped: the per-label means say so."""
    image = load_image(folders, "case_0")
    import nibabel as nib

    mask = np.asarray(nib.load(str(folders / "masks" / "case_0.nii.gz")).dataobj)
    swapped = image.copy()
    swapped[mask == 1], swapped[mask == 2] = 0.9, 0.5
    write_nifti(folders / "samples" / "case_0_sample0.nii.gz", swapped)
    code, err = call(argv(folders), capsys)
    assert code == 0, err
    stats = json.loads((folders / "eval" / "metrics.json").read_text())["samples"][0]["labels"]
    assert stats["1"]["sample_mean"] - stats["1"]["real_mean"] > 0.2
    assert stats["2"]["real_mean"] - stats["2"]["sample_mean"] > 0.2
    assert stats["0"]["sample_mean"] == pytest.approx(stats["0"]["real_mean"])


def test_scale_helpers():
    assert [scores.ms_ssim_scales((s,) * 3) for s in (13, 16, 32, 40, 64, 128)] == [0, 2, 3, 3, 4, 5]
    assert metrics.ssim_window((40, 36, 30)) == 11 and metrics.ssim_window((8, 9, 9)) == 7
    small = [torch.rand(1, 1, 12, 12, 12) for _ in range(2)]
    value, pairs, note = scores.ms_ssim_among(small)
    assert value is None and pairs == 0 and "too small" in note
    unit = inputs.to_unit(np.array([[[-1.0, 0.0, 0.5, 2.0]]]), 0.0, 1.0)
    assert unit.shape == (1, 1, 1, 1, 4) and unit.flatten().tolist() == [0.0, 0.0, 0.5, 1.0]
    # Without --real_range the real image's own percentiles set the scale.
    lo, hi = inputs.real_bounds(np.arange(101.0), None, (0.0, 100.0))
    assert (lo, hi) == (0.0, 100.0)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_samples_folder", "folder not found"),
        ("no_sample_files", "no <case>_sample<i>.nii.gz files"),
        ("no_image", "no real image"),
        ("no_mask", "no mask"),
        ("shape", "differs from the real image's"),
        ("not_nifti", "case_0_sample0.nii.gz: "),  # the reason is data._read's
        ("exists", "already exists"),
        ("range", "--real_range: expected LO < HI"),
        ("labels", "--labels: expected integers"),
        ("flag", "unrecognized arguments"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(folders, capsys, case, message):
    image = load_image(folders, "case_0")
    sample = folders / "samples" / "case_0_sample0.nii.gz"
    write_nifti(sample, image)
    args = argv(folders)
    out = folders / "eval"
    if case == "no_samples_folder":
        args[1] = str(folders / "nowhere")
    elif case == "no_sample_files":
        sample.unlink()
        (folders / "samples" / "notes.txt").write_text("x")
    elif case == "no_image":
        write_nifti(folders / "samples" / "case_9_sample0.nii.gz", image)
    elif case == "no_mask":
        (folders / "masks" / "case_0.nii.gz").unlink()
    elif case == "shape":
        write_nifti(sample, image[:, :, :-2])
    elif case == "not_nifti":
        sample.write_bytes(b"garbage")
    elif case == "exists":
        out.mkdir()
        (out / "metrics.json").write_text("keep")
    elif case == "range":
        args[args.index("--real_range") + 1] = "2"  # LO 2 > HI 1.2
    elif case == "labels":
        args += ["--labels", "one"]
    elif case == "flag":
        args += ["--bogus"]
    code, err = call(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    if case in ("no_image", "shape", "not_nifti"):
        assert "_sample0.nii.gz" in lines[0]
    if case == "exists":
        assert (
            sorted(p.name for p in out.iterdir()) == ["metrics.json"] and (out / "metrics.json").read_text() == "keep"
        )
    else:
        assert not out.exists()


def test_overwrite_replaces_results(folders, capsys):
    write_nifti(folders / "samples" / "case_0_sample0.nii.gz", load_image(folders, "case_0"))
    assert call(argv(folders), capsys)[0] == 0
    assert call(argv(folders), capsys)[0] == 2
    assert call(argv(folders, "--overwrite"), capsys)[0] == 0
    assert math.isclose(
        json.loads((folders / "eval" / "metrics.json").read_text())["summary"]["ssim"], 1.0, abs_tol=1e-6
    )


def test_mask_fidelity_and_sharpness_columns(folders, capsys):
    """With masks, each sample gets Otsu Dice, contrast, the largest per-label mean error and sharpness:
    perfect for the image itself, caught for an offset copy (which SSIM-free correlation would pass)."""
    image = load_image(folders, "case_0")
    write_nifti(folders / "samples" / "case_0_sample0.nii.gz", image)
    write_nifti(folders / "samples" / "case_0_sample1.nii.gz", (image + 0.14).astype(np.float32))  # 0.1 in [0, 1]
    code, err = call(argv(folders), capsys)
    assert code == 0, err
    same, shifted = json.loads((folders / "eval" / "metrics.json").read_text())["samples"]
    assert same["head_dice"] == same["truth_head_dice"] > 0.95
    assert same["lesion_dice"] == same["truth_lesion_dice"] > 0.9
    assert same["abs_mean_error_max"] == 0.0 and same["sharpness_ratio"] == pytest.approx(1.0)
    assert shifted["abs_mean_error_max"] == pytest.approx(0.1, abs=0.01)
    with (folders / "eval" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {"head_dice", "lesion_dice", "contrast_ratio", "sharpness_ratio", "abs_mean_error_max"} <= set(rows[0])
    summary = json.loads((folders / "eval" / "metrics.json").read_text())["summary"]
    assert summary["abs_mean_error_max"] == pytest.approx(0.05, abs=0.01)
