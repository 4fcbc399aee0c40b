"""The time-to-quality benchmark: its sets (seeded, test masks unseen), its scoring and its command line."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from diffusion3d.commands import quality as Q
from diffusion3d.commands.bench import main as bench_main
from tests.helpers import SHARED_DATA, tiny

REAL = SHARED_DATA / "whole_head"


def tiny_yaml(tmp_path):
    """The tiny run (2 sampling steps, a fast EMA) as the --config the command trains."""
    return tiny(tmp_path, sampling_steps=2, ema_decay=0.9).yaml()


def test_phantom_sets_are_seeded_and_the_test_masks_are_not_trained_on(tmp_path):
    a = Q.write_set("phantom", tmp_path / "a", 4, 3, seed=0, size=16, labels=[1, 2])
    b = Q.write_set("phantom", tmp_path / "b", 4, 3, seed=0, size=16, labels=[1, 2])
    for x, y in zip(a, b):
        assert np.array_equal(x.mask, y.mask) and np.array_equal(x.truth, y.truth)  # reproducible
    train = [np.asarray(nib.load(str(p)).dataobj) for p in sorted((tmp_path / "a" / "train" / "masks").iterdir())]
    for case in a:
        assert not any(np.array_equal(case.mask, m) for m in train)
    assert len({c.mask.tobytes() for c in a}) == 3
    other = Q.write_set("phantom", tmp_path / "c", 1, 1, seed=1, size=16, labels=[1, 2])
    assert not np.array_equal(other[0].mask, a[0].mask)


def test_phantom_test_masks_have_an_independent_twin_and_the_ratio_reads_against_it(tmp_path):
    cases = Q.write_set("phantom", tmp_path, 2, 2, seed=0, size=16, labels=[1, 2])
    assert not (tmp_path / "train" / "twins").exists() and (tmp_path / "test" / "twins" / "case_001.nii.gz").is_file()
    for c in cases:
        assert c.twin is not None and c.twin.shape == c.truth.shape and not np.array_equal(c.twin, c.truth)
        # same mask, so the same mean intensity per label up to texture and noise
        assert abs(c.twin[c.mask == 2].mean() - c.truth[c.mask == 2].mean()) < 0.03
    again = Q.write_set("phantom", tmp_path / "again", 2, 2, seed=0, size=16, labels=[1, 2])
    assert all(np.array_equal(a.twin, b.twin) for a, b in zip(cases, again))  # seeded
    identical = np.stack([c.truth for c in cases for _ in range(2)])
    scores = Q.score_samples(identical, cases, [1, 2])
    assert scores["model_div"] == pytest.approx(0.0, abs=1e-6) and scores["data_div"] > 0.005
    assert scores["div_ratio"] == pytest.approx(0.0, abs=1e-3) and scores["ssim"] == pytest.approx(1.0)
    assert scores["ssim_twin"] == pytest.approx(1 - scores["data_div"])
    like_data = np.stack([v for c in cases for v in (c.truth, c.twin)])
    assert Q.score_samples(like_data, cases, [1, 2])["div_ratio"] == pytest.approx(1.0, rel=1e-5)
    row = {
        "run": "r",
        "set": "realistic",
        "step": 1,
        "train_s": 1.0,
        "sampling": "heun-5",
        "evaluations": 9,
        **Q.score_samples(identical, [Q.TestCase(c.name, c.mask, c.truth) for c in cases], [1, 2]),
    }
    cells = Q.format_row(row).split(" | ")
    header = ["run", "set", "step", "train s", "sampling", "NFE", *[h for h, _, _ in Q.TABLE_KEYS]]
    assert [cells[header.index(h)] for h in ("data_div", "div_ratio", "SSIM twin")] == ["n/a"] * 3
    assert cells[header.index("model_div")] == "0.000"


def test_deform_pair_keeps_labels_and_range():
    rng = np.random.default_rng(0)
    size = 32
    grid = np.stack(np.meshgrid(*[np.arange(size)] * 3, indexing="ij"), -1)
    mask = np.zeros((size,) * 3, np.uint8)
    mask[((grid - 16) ** 2).sum(-1) < 100] = 1
    mask[((grid - 16) ** 2).sum(-1) < 16] = 2
    image = np.choose(mask, [0.02, 0.5, 0.9]).astype(np.float32)
    small_image, small_mask = Q.deform_pair(image, mask, rng, [1, 2], factor=2)
    assert small_image.shape == small_mask.shape == (16, 16, 16)
    assert set(np.unique(small_mask)) == {0, 1, 2}
    assert 0 <= small_image.min() and small_image.max() <= 1
    # intensity still follows the label after warping both the same way (bias field: ±~12 %)
    assert (
        small_image[small_mask == 2].mean() > small_image[small_mask == 1].mean() > small_image[small_mask == 0].mean()
    )
    again, _ = Q.deform_pair(image, mask, np.random.default_rng(0), [1, 2], factor=2)
    assert np.array_equal(small_image, again)


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data/whole_head is absent")
def test_realistic_set_from_the_real_pair(tmp_path):
    cases = Q.write_set("realistic", tmp_path, 1, 2, seed=0, size=32, labels=[1, 2])
    assert len(cases) == 2 and cases[0].truth.shape == (32, 32, 32)
    assert not np.array_equal(cases[0].truth, cases[1].truth)
    for c in cases:  # the head (label 1) is brighter than the background, as in the real image
        assert c.truth[c.mask == 1].mean() > c.truth[c.mask == 0].mean() + 0.1
    assert (tmp_path / "train" / "images" / "case_000.nii.gz").is_file()


def test_parse_sampling():
    cfg = Q.C.Config()
    assert [s.label for s in Q.parse_sampling(None, cfg)] == ["ddim-50"]
    specs = Q.parse_sampling("euler:10,heun:5:2", cfg)
    assert [(s.sampler, s.steps, s.guidance) for s in specs] == [("euler", 10, None), ("heun", 5, 2.0)]
    with pytest.raises(Q.QualityError, match="sampler:steps"):
        Q.parse_sampling("euler", cfg)
    with pytest.raises(Q.QualityError, match="prediction: flow"):  # a Gaussian model has no time grid to shift
        Q.parse_sampling("ddim:10:shift=1", cfg)


def test_sampling_spec_shift_reaches_the_sampler():
    cfg = Q.C.Config().override(prediction="flow", sampler="euler", flow_shift=3.0)
    specs = Q.parse_sampling("euler:10:shift=0.5,heun:5:1.5:shift=2,euler:10", cfg)
    assert [(s.sampler, s.steps, s.guidance, s.shift) for s in specs] == [
        ("euler", 10, None, 0.5),
        ("heun", 5, 1.5, 2.0),
        ("euler", 10, None, None),
    ]
    assert [s.label for s in specs] == ["euler-10-s0.5", "heun-5-w1.5-s2", "euler-10"]
    grids = [Q.make_diffusion(s.config(cfg)).time_grid(10) for s in specs]
    # shift 0.5 puts the grid's steps nearer t = 0 than the training's 3; no shift keeps the training's
    assert grids[0][5] < grids[2][5] and grids[2] == Q.make_diffusion(cfg).time_grid(10)
    assert cfg.diffusion.sampling_shift is None  # the spec's config is a copy
    for bad in ("euler:10:shift=0", "euler:10:shift=x", "euler:10:1:2:3"):
        with pytest.raises(Q.QualityError, match="--sampling"):
            Q.parse_sampling(bad, cfg)


def test_command_trains_scores_and_writes_json(tmp_path, capsys):
    out = tmp_path / "q.json"
    code = bench_main(
        [
            "--parts",
            "quality",
            "--config",
            str(tiny_yaml(tmp_path)),
            "--sets",
            "phantom",
            "--size",
            "16",
            "--steps",
            "3",
            "--eval_every",
            "2",
            "--n_train",
            "4",
            "--n_test",
            "2",
            "--sampling",
            "ddim:2,ddpm:3",
            "--real_pair",
            str(tmp_path / "absent"),
            "--out",
            str(out),
            "--save_samples",
            str(tmp_path / "s"),
        ]
    )
    assert code == 0
    saved = tmp_path / "s" / "phantom" / "step_000003" / "ddpm-3"
    assert sorted(p.name for p in saved.iterdir())[:3] == [
        "case_000_sample0.nii.gz",
        "case_000_sample1.nii.gz",
        "case_000_truth.nii.gz",
    ]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["step"], r["sampling"]) for r in rows] == [(2, "ddim-2"), (2, "ddpm-3"), (3, "ddim-2"), (3, "ddpm-3")]
    for r in rows:
        assert r["set"] == "phantom" and r["evaluations"] in (2, 3)
        for key in (
            "head_dice",
            "lesion_dice",
            "mean_error/0",
            "mean_error/1",
            "mean_error/2",
            "ssim",
            "psnr",
            "sharpness_ratio",
            "diversity",
            "contrast_ratio",
            "train_s",
            "train_cpu_s",
            "model_div",
            "data_div",
            "div_ratio",
            "ssim_twin",
            "sharpness_twin",
        ):
            assert key in r, key
        assert 0 <= r["head_dice"] <= 1 and -1 <= r["ssim"] <= 1
        assert r["data_div"] > 0.005 and r["div_ratio"] == pytest.approx(r["model_div"] / r["data_div"])
    assert rows[2]["train_s"] > rows[0]["train_s"] > 0
    printed = capsys.readouterr().out
    assert "| run | set | step |" in printed and "ddpm-3" in printed
    assert bench_main(["--parts", "quality", "--table", str(out)]) == 0
    assert capsys.readouterr().out.count("ddim-2") == 2


def test_trained_weights_are_scored_beside_the_ema_from_one_run(tmp_path):
    """--weights ema,model: each scoring samples the EMA and the trained weights; they differ, and training
    after the trained model sampled is the same as training with the EMA alone."""
    reports = []
    for i, weights in enumerate(("ema", "ema,model")):
        out = tmp_path / f"q{i}.json"
        argv = ["--config", str(tiny_yaml(tmp_path)), "--sets", "phantom", "--size", "16", "--steps", "4"]
        argv += ["--eval_every", "2", "--n_train", "4", "--n_test", "2", "--sampling", "ddim:2"]
        argv += ["--weights", weights, "--real_pair", str(tmp_path / "absent"), "--out", str(out)]
        assert Q.main(argv) == 0
        reports.append(json.loads(out.read_text())["rows"])
    ema_only, both = reports
    assert [(r["step"], r["sampling"], r["weights"]) for r in both] == [
        (2, "ddim-2", "ema"),
        (2, "ddim-2 no-EMA", "model"),
        (4, "ddim-2", "ema"),
        (4, "ddim-2 no-EMA", "model"),
    ]
    assert both[2]["ssim"] != both[3]["ssim"]
    for a, b in zip(ema_only, [r for r in both if r["weights"] == "ema"]):
        assert a["ssim"] == b["ssim"] and a["loss"] == b["loss"]


def test_realistic_set_is_skipped_with_a_message_without_the_real_pair(tmp_path, capsys):
    code = Q.main(
        [
            "--config",
            str(tiny_yaml(tmp_path)),
            "--sets",
            "realistic",
            "--size",
            "16",
            "--steps",
            "1",
            "--real_pair",
            str(tmp_path / "absent"),
        ]
    )
    assert code == 0
    assert "realistic set skipped" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--sets", "mri"], "--sets: unknown set 'mri'"),
        (["--set", "lr"], "--set: expected key=value"),
        (["--set", "colour=red"], "unknown config key 'colour'"),
        (["--sampling", "euler:10"], "--sampling: euler does not fit prediction eps"),
        (["--weights", "best"], "--weights: expected ema, model or ema,model"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    code = Q.main(
        [
            "--config",
            str(tiny_yaml(tmp_path)),
            "--sets",
            "phantom",
            "--size",
            "16",
            "--steps",
            "1",
            "--n_train",
            "4",
            "--n_test",
            "1",
            *argv,
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and message in err[-1], err


def test_wavelet_space_trains_and_scores_decoded_samples_on_the_mask_grid(tmp_path):
    """--set space=wavelet: the run trains on the subbands (its loss is not the pixel run's) and the scored
    samples are decoded back onto the test masks' 16³ grid."""
    losses = {}
    for space in ("pixel", "wavelet"):
        out = tmp_path / f"{space}.json"
        argv = ["--config", str(tiny_yaml(tmp_path)), "--sets", "phantom", "--size", "16", "--steps", "2"]
        argv += ["--n_train", "4", "--n_test", "1", "--sampling", "ddim:2", "--set", f"space={space}"]
        argv += ["--real_pair", str(tmp_path / "absent"), "--out", str(out), "--save_samples", str(tmp_path / space)]
        assert Q.main(argv) == 0
        (row,) = json.loads(out.read_text())["rows"]
        assert f"space={space}" in row["run"] and -1 <= row["ssim"] <= 1 and 0 <= row["head_dice"] <= 1
        losses[space] = row["loss"]
        saved = tmp_path / space / "phantom" / "step_000002" / "ddim-2"
        sample = np.asarray(nib.load(str(saved / "case_000_sample0.nii.gz")).dataobj)
        truth = np.asarray(nib.load(str(saved / "case_000_truth.nii.gz")).dataobj)
        assert sample.shape == truth.shape == (16, 16, 16) and np.isfinite(sample).all()
    assert losses["pixel"] != losses["wavelet"]
