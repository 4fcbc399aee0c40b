"""Downstream segmentation: the three arms learn an easy phantom task, the splits hold and repeat, bad input."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from diffusion3d.commands import evaluate as E
from diffusion3d.evaluation import downstream as D
from tests.helpers import write_nifti

SIZE = 16


def easy_case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A 16³ ellipsoid (label 1, intensity 0.5) holding a ball of radius 3.5 (label 2, 0.9), noise 0.03."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(SIZE)] * 3, indexing="ij"), -1).astype(np.float32)
    centre = SIZE / 2 - 0.5 + rng.uniform(-1, 1, 3)
    mask = np.zeros((SIZE,) * 3, np.uint8)
    mask[(((grid - centre) / (SIZE * rng.uniform(0.32, 0.42, 3))) ** 2).sum(-1) <= 1] = 1
    mask[((grid - centre - rng.uniform(-1, 1, 3)) ** 2).sum(-1) <= 3.5**2] = 2
    image = np.choose(mask, [0.05, 0.5, 0.9]).astype(np.float32) + rng.normal(0, 0.03, mask.shape).astype(np.float32)
    return image, mask


@pytest.fixture
def data(tmp_path):
    """8 real pairs; one synthetic sample per mask (the real image with other noise and a little contrast loss)."""
    rng = np.random.default_rng(99)
    for i in range(8):
        image, mask = easy_case(i)
        write_nifti(tmp_path / "images" / f"case_{i}.nii.gz", image)
        write_nifti(tmp_path / "masks" / f"case_{i}.nii.gz", mask)
        fake = 0.9 * image + 0.05 + rng.normal(0, 0.03, image.shape).astype(np.float32)
        write_nifti(tmp_path / "samples" / f"case_{i}_sample0.nii.gz", fake.astype(np.float32))
    return tmp_path


def argv(root, *extra) -> list[str]:
    return [
        "downstream",
        "--images",
        str(root / "images"),
        "--masks",
        str(root / "masks"),
        "--samples",
        str(root / "samples"),
        "--out",
        str(root / "out"),
        "--num_test",
        "2",
        "--steps",
        "120",
        "--channels",
        "8,16",
        "--real_range",
        "0",
        "1",
        *extra,
    ]


def call(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        E.main(args)
    captured = capsys.readouterr()
    return exc.value.code, captured.out, captured.err


def test_three_arms_learn_the_phantoms_and_repeat_exactly_from_their_splits(data, capsys):
    code, out, err = call(argv(data), capsys)
    assert code == 0, err
    result = json.loads((data / "out" / "downstream.json").read_text())
    splits = json.loads((data / "out" / "splits.json").read_text())
    assert result["splits"] == splits and result["labels"] == [1, 2]
    assert len(splits["real_test"]) == 2 and len(splits["real_train"]) == 6
    assert not set(splits["real_test"]) & set(splits["real_train"])
    # Samples of the two test masks are not trained on: their masks are the test labels.
    assert sorted(splits["synthetic_excluded"]) == sorted(f"{c}_sample0.nii.gz" for c in splits["real_test"])
    assert len(splits["synthetic_train"]) == 6
    arms = result["arms"]
    assert set(arms) == {"real", "synthetic", "mixed"}
    assert [arms[a]["train_volumes"] for a in ("real", "synthetic", "mixed")] == [6, 6, 12]
    for arm in arms.values():
        assert set(arm["per_case"]) == set(splits["real_test"])
    assert arms["real"]["dice"]["1"]["mean"] > 0.9 and arms["real"]["dice"]["2"]["mean"] > 0.9, arms["real"]["dice"]
    assert arms["mixed"]["mean_dice"] > 0.9
    with (data / "out" / "downstream.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["arm"], r["label"]) for r in rows][:3] == [("real", "1"), ("real", "2"), ("real", "mean")]
    assert float(rows[2]["dice_mean"]) == pytest.approx(arms["real"]["mean_dice"])
    assert "real+synth" in out and "label 2" in out
    assert "training (real)" in err  # the progress bar, on stderr

    # The same splits from the file, the same seed: the same numbers, to the last bit (CPU).
    (data / "splits.json").write_text((data / "out" / "splits.json").read_text())
    code, _, err = call(argv(data, "--splits", str(data / "splits.json"), "--overwrite", "--num_test", "3"), capsys)
    assert code == 0, err
    again = json.loads((data / "out" / "downstream.json").read_text())
    assert again["splits"]["real_test"] == splits["real_test"]  # --splits wins over --num_test
    for arm in arms:
        assert again["arms"][arm]["per_case"] == arms[arm]["per_case"]
        assert again["arms"][arm]["final_loss"] == arms[arm]["final_loss"]


def test_segresnet_and_a_single_arm_without_samples(data, capsys):
    args = [a for a in argv(data) if a != str(data / "samples")]
    args.remove("--samples")
    code, out, err = call(args + ["--network", "segresnet", "--arms", "real", "--steps", "5"], capsys)
    assert code == 0, err
    result = json.loads((data / "out" / "downstream.json").read_text())
    assert list(result["arms"]) == ["real"] and result["settings"]["network"] == "segresnet"
    assert result["splits"]["synthetic_train"] == [] and all(
        0 <= d["mean"] <= 1 for d in result["arms"]["real"]["dice"].values()
    )


def test_test_cases_by_name(data, capsys):
    code, _, err = call(argv(data, "--test_cases", "case_6,case_7", "--arms", "real", "--steps", "2"), capsys)
    assert code == 0, err
    splits = json.loads((data / "out" / "splits.json").read_text())
    assert splits["real_test"] == ["case_6", "case_7"] and splits["real_train"] == [f"case_{i}" for i in range(6)]
    assert splits["synthetic_excluded"] == ["case_6_sample0.nii.gz", "case_7_sample0.nii.gz"]


def test_splits_are_seeded_and_leave_test_masks_out():
    real = [D.Pair(f"c{i}", f"c{i}", None, None) for i in range(10)]  # type: ignore[arg-type]
    synthetic = [D.Pair(f"c{i}_sample{j}.nii.gz", f"c{i}", None, None) for i in range(10) for j in range(2)]  # type: ignore[arg-type]
    a, b = D.make_splits(real, synthetic, 3, seed=1), D.make_splits(real, synthetic, 3, seed=1)
    assert a == b and len(a["real_test"]) == 3
    assert D.make_splits(real, synthetic, 3, seed=2)["real_test"] != a["real_test"]
    assert len(a["synthetic_train"]) == 14 and all(n.split("_")[0] not in a["real_test"] for n in a["synthetic_train"])
    with pytest.raises(D.DataError, match="at least one to train"):
        D.make_splits(real, synthetic, 10, seed=0)


def test_crop_pads_small_volumes_and_centres_on_labels():
    import torch

    image = torch.zeros(1, 8, 8, 8)
    label = torch.zeros(1, 8, 8, 8, dtype=torch.int64)
    label[0, 6, 6, 6] = 1
    volume = D.Volume("v", image, label)
    rng = torch.Generator().manual_seed(0)
    crops = [D.crop(volume, (12, 4, 4), rng) for _ in range(40)]
    assert all(c[0].shape == (1, 12, 4, 4) for c in crops)
    assert sum(int(c[1].sum()) for c in crops) > 5  # about half of the patches hold the single labelled voxel


@pytest.mark.parametrize(
    "case, message",
    [
        ("unpaired", "image without mask"),
        ("no_samples", "--samples: needed"),
        ("arms", "--arms: expected"),
        ("patch", "--patch: every side must be a positive multiple of 2"),
        ("splits_unknown", "is not among the real pairs"),
        ("splits_leak", "was generated from a test mask"),
        ("no_sample_mask", "no mask case_9.nii.gz"),
        ("test_cases_unknown", "--test_cases: case 'case_42' is not among the real pairs"),
        ("exists", "already exists"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(data, capsys, case, message):
    args = argv(data)
    if case == "unpaired":
        write_nifti(data / "images" / "case_extra.nii.gz", np.zeros((SIZE,) * 3, np.float32))
    elif case == "no_samples":
        i = args.index("--samples")
        del args[i : i + 2]
    elif case == "arms":
        args += ["--arms", "real,bogus"]
    elif case == "patch":
        args += ["--patch", "16", "16", "15"]
    elif case in ("splits_unknown", "splits_leak"):
        splits = {"real_train": ["case_0", "case_1"], "real_test": ["case_2"]}
        splits["real_train" if case == "splits_unknown" else "synthetic_train"] = (
            ["case_0", "case_77"] if case == "splits_unknown" else ["case_2_sample0.nii.gz"]
        )
        (data / "s.json").write_text(json.dumps(splits))
        args += ["--splits", str(data / "s.json")]
    elif case == "test_cases_unknown":
        args += ["--test_cases", "case_1,case_42"]
    elif case == "no_sample_mask":
        write_nifti(data / "samples" / "case_9_sample0.nii.gz", np.zeros((SIZE,) * 3, np.float32))
    elif case == "exists":
        (data / "out").mkdir()
        (data / "out" / "splits.json").write_text("keep")
    code, _, err = call(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    if case == "exists":
        assert (data / "out" / "splits.json").read_text() == "keep" and len(list((data / "out").iterdir())) == 1
    else:
        assert not (data / "out").exists()
