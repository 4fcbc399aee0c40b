"""The sampling command: the mask's grid, reproducible seeds, batch invariance, bad input.

One tiny run (2 steps, 16³, a 2-level UNet) per module gives the checkpoint and the trainer's own
validation sample; every command runs in-process through ``sample.main`` except one real subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from diffusion3d.commands import evaluate as E
from diffusion3d.commands import sample as S
from diffusion3d.data import build_dataset, discover, split_cases
from diffusion3d.trainer import Trainer
from tests.helpers import ROOT, subprocess_env, tiny_config, write_nifti


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run that saves and samples at step 2; returns (cfg, run folder, checkpoint, val case)."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = tiny_config(tmp, train_num_steps=2, save_every=2, sample_every=2, sampling_steps=3, num_val_cases=1)
    train, val = split_cases(discover(cfg), cfg.data.num_val_cases)
    results = tmp / "run"
    Trainer(cfg, build_dataset(train, cfg), "cpu", results, val).train()
    return cfg, results, results / "checkpoints" / "step_00000002.pt", val[0]


def call(argv: list[str], capsys) -> tuple[int, str]:
    """Run the command in-process; (exit code, stderr)."""
    with pytest.raises(SystemExit) as exc:
        S.main([*argv, "--quiet"])
    return exc.value.code, capsys.readouterr().err


def volume(path):
    img = nib.load(str(path))
    return np.asarray(img.dataobj), img


def oblique_affine() -> np.ndarray:
    """1.2 × 1.0 × 2.0 mm voxels, rotated 20° about z and 10° about x, off the origin."""
    a, b = np.deg2rad(20), np.deg2rad(10)
    rz = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    rx = np.array([[1, 0, 0], [0, np.cos(b), -np.sin(b)], [0, np.sin(b), np.cos(b)]])
    affine = np.eye(4)
    affine[:3, :3] = rz @ rx @ np.diag([1.2, 1.0, 2.0])
    affine[:3, 3] = [-20.0, 13.5, 7.25]
    return affine


def test_sample_sits_on_the_masks_grid(run, tmp_path, capsys):
    """An oblique 40×36×30 mask (cropped to the 16³ model grid and back) → exactly its shape, affine, spacing."""
    _, _, checkpoint, _ = run
    mask = np.zeros((40, 36, 30), np.uint8)
    mask[12:28, 10:26, 8:22] = 1
    mask[17:23, 15:21, 12:18] = 2
    affine = oblique_affine()
    write_nifti(tmp_path / "masks" / "oblique.nii.gz", mask, affine)
    code, err = call(
        [
            "--checkpoint",
            str(checkpoint),
            "--masks",
            str(tmp_path / "masks" / "oblique.nii.gz"),
            "--out",
            str(tmp_path / "out"),
            "--steps",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    data, img = volume(tmp_path / "out" / "oblique_sample0.nii.gz")
    assert data.shape == (40, 36, 30)
    np.testing.assert_allclose(img.affine, affine, atol=1e-5)
    np.testing.assert_allclose(img.header.get_zooms()[:3], (1.2, 1.0, 2.0), atol=1e-5)
    assert img.get_data_dtype() == np.float32
    assert 0.0 <= data.min() and data.max() <= 1.0  # output_intensity: unit
    # The 16³ model grid covers the middle of the mask; the rest is background (model -1 → 0).
    assert data.std() > 0 and (data == 0).mean() > 0.5


def test_seeds_reproducible_and_independent_of_batch_size(run, tmp_path, capsys):
    """Same command twice: bitwise equal. Another batch_size: same noise, equal to float
    rounding. Another seed: different."""
    cfg, _, checkpoint, _ = run
    (tmp_path / "masks").mkdir()
    for name in ("case_000.nii.gz", "case_001.nii.gz"):
        shutil.copy(f"{cfg.data.mask_dir}/{name}", tmp_path / "masks" / name)
    outs = {}
    # 4 volumes in batches of 3 + 1 (one mixing two masks, one alone) vs 2 + 2.
    for name, seed, batch in [("a", 0, 3), ("again", 0, 3), ("b", 0, 2), ("c", 1, 3)]:
        code, err = call(
            [
                "--checkpoint",
                str(checkpoint),
                "--masks",
                str(tmp_path / "masks"),
                "--out",
                str(tmp_path / name),
                "--n",
                "2",
                "--steps",
                "2",
                "--seed",
                str(seed),
                "--batch_size",
                str(batch),
            ],
            capsys,
        )
        assert code == 0, err
        outs[name] = {p.name: volume(p)[0] for p in sorted((tmp_path / name).iterdir())}
    assert sorted(outs["a"]) == [
        "case_000_sample0.nii.gz",
        "case_000_sample1.nii.gz",
        "case_001_sample0.nii.gz",
        "case_001_sample1.nii.gz",
    ]
    for name in outs["a"]:
        np.testing.assert_array_equal(outs["a"][name], outs["again"][name])
        np.testing.assert_allclose(outs["a"][name], outs["b"][name], rtol=0, atol=1e-4)
        assert np.abs(outs["a"][name] - outs["c"][name]).max() > 0.1  # another seed
    assert np.abs(outs["a"]["case_000_sample0.nii.gz"] - outs["a"]["case_000_sample1.nii.gz"]).max() > 0.1


def test_reproduces_the_trainers_validation_sample(run, tmp_path, capsys):
    """Volume 0 with the run's seed and the config's sampler = the sample the trainer wrote at that step."""
    cfg, results, checkpoint, val = run
    code, err = call(
        [
            "--checkpoint",
            str(results),
            "--masks",
            str(val.mask),
            "--out",
            str(tmp_path / "out"),
            "--seed",
            str(cfg.train.seed),
        ],
        capsys,
    )
    assert code == 0, err
    ours, _ = volume(tmp_path / "out" / f"{val.name}_sample0.nii.gz")
    trainers, _ = volume(results / "samples" / "step_00000002" / f"{val.name}_sample0.nii.gz")
    np.testing.assert_array_equal(ours, trainers)
    code, err = call(
        [
            "--checkpoint",
            str(checkpoint),
            "--masks",
            str(val.mask),
            "--out",
            str(tmp_path / "raw"),
            "--seed",
            str(cfg.train.seed),
            "--weights",
            "model",
        ],
        capsys,
    )
    assert code == 0, err
    assert not np.array_equal(volume(tmp_path / "raw" / f"{val.name}_sample0.nii.gz")[0], ours)  # EMA ≠ raw


def test_each_mask_file_is_read_once(run, tmp_path, capsys, monkeypatch):
    """Checked, brought to the model grid and sampled twice: still one read per mask file."""
    cfg, _, checkpoint, _ = run
    (tmp_path / "masks").mkdir()
    for name in ("case_000.nii.gz", "case_001.nii.gz"):
        shutil.copy(f"{cfg.data.mask_dir}/{name}", tmp_path / "masks" / name)
    opened = []
    real_load = nib.load
    monkeypatch.setattr(nib, "load", lambda p, *a, **k: opened.append(str(p)) or real_load(p, *a, **k))
    code, err = call(
        [
            "--checkpoint",
            str(checkpoint),
            "--masks",
            str(tmp_path / "masks"),
            "--out",
            str(tmp_path / "out"),
            "--n",
            "2",
            "--steps",
            "1",
            "--batch_size",
            "3",
        ],
        capsys,
    )
    assert code == 0, err
    assert sorted(opened) == sorted(str(p) for p in (tmp_path / "masks").iterdir())


def bad_mask(tmp_path, kind: str):
    folder = tmp_path / "masks"
    good = np.zeros((16, 16, 16), np.uint8)
    good[4:12, 4:12, 4:12] = 1
    write_nifti(folder / "a_good.nii.gz", good)  # sorted first: proves nothing is written before checking all
    bad = {
        "label3": np.where(good > 0, 3, 0).astype(np.uint8),
        "empty": np.zeros((16, 16, 16), np.uint8),
        "4d": np.stack([good, good], -1),
        "float": np.linspace(0, 1, 16**3, dtype=np.float32).reshape(16, 16, 16),
    }[kind]
    return write_nifti(folder / "b_bad.nii.gz", bad)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_checkpoint", "checkpoint not found"),
        ("corrupt_checkpoint", "unreadable checkpoint"),
        ("label3", "labels [3] are not in the configured labels"),
        ("empty", "none of the configured labels"),
        ("4d", "expected a 3D volume"),
        ("float", "non-integer values"),
        ("no_masks", "no NIfTI files"),
        ("exists", "already exists"),
        ("n0", "--n: expected a positive integer"),
        ("sampler", "--sampler: invalid choice"),
        ("flow_sampler", "--sampler: euler does not fit this checkpoint's eps model"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(run, tmp_path, capsys, case, message):
    _, _, checkpoint, _ = run
    masks = tmp_path / "masks"
    good = np.zeros((16, 16, 16), np.uint8)
    good[4:12, 4:12, 4:12] = 2
    write_nifti(masks / "a_good.nii.gz", good)
    out = tmp_path / "out"
    extra: list[str] = []
    if case == "missing_checkpoint":
        checkpoint = tmp_path / "nope.pt"
    elif case == "corrupt_checkpoint":
        checkpoint = tmp_path / "step_00000001.pt"
        checkpoint.write_bytes(b"not a checkpoint" * 10)
    elif case in ("label3", "empty", "4d", "float"):
        bad_mask(tmp_path, case)
    elif case == "no_masks":
        shutil.rmtree(masks)
        masks.mkdir()
    elif case == "exists":
        out.mkdir()
        (out / "a_good_sample1.nii.gz").write_bytes(b"keep me")
        extra = ["--n", "2"]
    elif case == "n0":
        extra = ["--n", "0"]
    elif case == "sampler":
        extra = ["--sampler", "rk4"]
    elif case == "flow_sampler":
        extra = ["--sampler", "euler"]
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    code, err = call(["--checkpoint", str(checkpoint), "--masks", str(masks), "--out", str(out), *extra], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    if case in ("missing_checkpoint", "corrupt_checkpoint"):
        assert str(checkpoint) in lines[0]
    if case in ("label3", "empty", "4d", "float"):
        assert "b_bad.nii.gz" in lines[0]
    if before is None:
        assert not out.exists()
    else:
        assert sorted(p.name for p in out.iterdir()) == before
        assert (out / "a_good_sample1.nii.gz").read_bytes() == b"keep me"


@pytest.mark.slow
def test_module_entry_point_one_line_error(tmp_path):
    """``python -m diffusion3d sample`` itself: exit 2, a single stderr line, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffusion3d",
            "sample",
            "--checkpoint",
            str(tmp_path / "missing.pt"),
            "--masks",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.pt'}: checkpoint not found"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_flow_checkpoint_samples_with_guidance_and_reproduces_validation(tmp_path, capsys, precision):
    """A rectified-flow run trained with condition dropout: the command samples it with heun and guidance,
    its default reproduces the run's own validation sample bitwise — also for a bf16 CPU run, whose
    validation sampled under bf16 autocast (the command used to drop it off CUDA) — and a Gaussian sampler
    is refused."""
    cfg = tiny_config(
        tmp_path,
        precision=precision,
        prediction="flow",
        sampler="heun",
        sampling_steps=2,
        loss="l2",
        cond_drop_prob=0.3,
        guidance_scale=1.5,
        train_num_steps=2,
        save_every=2,
        sample_every=2,
        num_val_cases=1,
    )
    train, val = split_cases(discover(cfg), cfg.data.num_val_cases)
    results = tmp_path / "run"
    Trainer(cfg, build_dataset(train, cfg), "cpu", results, val).train()
    masks = tmp_path / "val_masks"
    masks.mkdir()
    (masks / val[0].mask.name).write_bytes(val[0].mask.read_bytes())
    code, err = call(["--checkpoint", str(results), "--masks", str(masks), "--out", str(tmp_path / "a")], capsys)
    assert code == 0, err
    name = f"{val[0].name}_sample0.nii.gz"
    ours, _ = volume(tmp_path / "a" / name)
    theirs, _ = volume(results / "samples" / "step_00000002" / name)
    assert np.array_equal(ours, theirs)  # guidance 1.5 and heun-2 from the config, as in validation
    code, err = call(
        ["--checkpoint", str(results), "--masks", str(masks), "--out", str(tmp_path / "b"), "--guidance_scale", "1"],
        capsys,
    )
    assert code == 0, err
    assert not np.array_equal(volume(tmp_path / "b" / name)[0], ours)
    code, err = call(
        ["--checkpoint", str(results), "--masks", str(masks), "--out", str(tmp_path / "c"), "--sampler", "ddim"], capsys
    )
    assert code == 2 and "does not fit this checkpoint's flow model" in err
    # --sampling_shift: the same checkpoint, seeds and sampler on another time grid gives another volume
    argv = ["--checkpoint", str(results), "--masks", str(masks), "--out", str(tmp_path / "d"), "--sampling_shift"]
    code, err = call([*argv, "3"], capsys)  # the run's own: resolution_shift at 16³, 0.5
    assert code == 0, err
    shifted = volume(tmp_path / "d" / name)[0]
    assert shifted.shape == ours.shape and not np.array_equal(shifted, ours)
    code, err = call([*argv[:-3], str(tmp_path / "e"), "--sampling_shift", "0"], capsys)
    assert code == 2 and "--sampling_shift: expected a number > 0, got 0.0" in err and not (tmp_path / "e").exists()


def test_sampling_shift_is_refused_for_a_gaussian_checkpoint(run, tmp_path, capsys):
    cfg, results, _, val = run
    out = tmp_path / "out"
    code, err = call(
        ["--checkpoint", str(results), "--masks", str(val.mask), "--out", str(out), "--sampling_shift", "0.5"], capsys
    )
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: --sampling_shift: this checkpoint's sampling_shift: applies to prediction: flow, "
        f"not {cfg.diffusion.prediction}"
    ]
    assert not out.exists()


@pytest.mark.parametrize("levels", [1, 2])
def test_wavelet_checkpoint_samples_without_flags(tmp_path, capsys, levels):
    """A run trained in wavelet space records it in its config: the command, given no space flag, samples
    its subbands, decodes them, writes them on an oblique mask's own grid and reproduces the run's own
    validation sample bitwise."""
    cfg = tiny_config(
        tmp_path,
        space="wavelet",
        wavelet_levels=levels,
        prediction="flow",
        sampler="heun",
        sampling_steps=2,
        loss="l2",
        train_num_steps=2,
        save_every=2,
        sample_every=2,
        num_val_cases=1,
    )
    train, val = split_cases(discover(cfg), cfg.data.num_val_cases)
    results = tmp_path / "run"
    Trainer(cfg, build_dataset(train, cfg), "cpu", results, val).train()
    masks = tmp_path / "masks"
    masks.mkdir()
    (masks / val[0].mask.name).write_bytes(val[0].mask.read_bytes())
    code, err = call(["--checkpoint", str(results), "--masks", str(masks), "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    name = f"{val[0].name}_sample0.nii.gz"
    ours, img = volume(tmp_path / "out" / name)
    theirs, _ = volume(results / "samples" / "step_00000002" / name)
    assert ours.shape == (16, 16, 16) and np.array_equal(ours, theirs)
    # `evaluate` scores the decoded samples against the real image like any other samples
    images = tmp_path / "images"
    images.mkdir()
    (images / f"{val[0].name}.nii.gz").write_bytes(val[0].images[0].read_bytes())
    argv = ["--samples", str(tmp_path / "out"), "--images", str(images), "--masks", str(masks)]
    with pytest.raises(SystemExit) as exc:
        E.main([*argv, "--out", str(tmp_path / "eval"), "--report_cases", "0"])
    assert exc.value.code == 0, capsys.readouterr().err
    (scored,) = json.loads((tmp_path / "eval" / "metrics.json").read_text())["samples"]
    assert scored["file"] == name and -1 <= scored["ssim"] < 1 and scored["mae"] > 0
    assert {"0", "1", "2"} <= set(scored["labels"])
    oblique = np.zeros((40, 36, 30), np.uint8)
    oblique[12:28, 10:26, 8:22] = 1
    oblique[17:23, 15:21, 12:18] = 2
    write_nifti(tmp_path / "oblique.nii.gz", oblique, oblique_affine())
    code, err = call(
        ["--checkpoint", str(results), "--masks", str(tmp_path / "oblique.nii.gz"), "--out", str(tmp_path / "out")],
        capsys,
    )
    assert code == 0, err
    data, img = volume(tmp_path / "out" / "oblique_sample0.nii.gz")
    assert data.shape == (40, 36, 30)
    np.testing.assert_allclose(img.affine, oblique_affine(), atol=1e-5)
    assert 0.0 <= data.min() and data.max() <= 1.0 and data.std() > 0
