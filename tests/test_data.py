"""Data: pairing, validation (one-line errors naming the file), transforms, caching, the stream, geometry."""

from __future__ import annotations

import gzip
import logging
import math
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import LoadImaged

from diffusion3d import config as C
from diffusion3d import data as D
from diffusion3d.data.discovery import _image_columns
from tests.helpers import ROOT, SHARED_DATA, phantom, subprocess_env, tiny, write_nifti

SIZE = 16


@pytest.fixture
def pairs(tmp_path):
    """Three good 16³ phantom pairs and a config pointing at them."""
    run = tiny(tmp_path, n=3)
    return run.images, run.masks, run.cfg


def run_checks(cfg) -> list[dict]:
    return D.validate(D.discover(cfg), cfg)


def assert_error_names(cfg, path: Path, *fragments: str) -> str:
    with pytest.raises(D.DataError) as exc:
        run_checks(cfg)
    message = str(exc.value)
    assert message.startswith(f"{path}:"), message
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---- validation: every bad input is one line naming the file --------------------------------------
def test_good_data_passes_and_summarises(pairs):
    images, masks, cfg = pairs
    summaries = run_checks(cfg)
    assert [s["case"] for s in summaries] == ["case_000", "case_001", "case_002"]
    assert all(s["shape"] == (SIZE,) * 3 and s["orientation"] == "RAS" and not s["warnings"] for s in summaries)
    text = D.format_summary(summaries)
    assert "cases: 3" in text and "(16, 16, 16)" in text and "(1.5, 1.5, 1.5)" in text and "RAS" in text
    assert "1: " in text and "2: " in text and "in 3 cases" in text


def test_missing_folder(pairs, tmp_path):
    *_, cfg = pairs
    cfg.data.image_dir = str(tmp_path / "nowhere")
    assert_error_names(cfg, tmp_path / "nowhere", "not found")


def test_empty_folder(pairs):
    images, masks, cfg = pairs
    for p in masks.iterdir():
        p.unlink()
    assert_error_names(cfg, masks, "no NIfTI files")


def test_image_without_mask(pairs):
    images, masks, cfg = pairs
    (masks / "case_001.nii.gz").unlink()
    assert_error_names(cfg, images / "case_001.nii.gz", "image without mask")


def test_mask_without_image(pairs):
    images, masks, cfg = pairs
    (images / "case_001.nii.gz").unlink()
    assert_error_names(cfg, masks / "case_001.nii.gz", "mask without image")


def _good_bytes(tmp_path: Path, name: str) -> bytes:
    return write_nifti(tmp_path / "scratch" / name, phantom(SIZE, 0)[0]).read_bytes()


@pytest.mark.parametrize(
    "which, name, corrupt, fragment",
    [
        ("image", "case_001.nii.gz", lambda good: b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4, "corrupt gzip"),
        ("image", "case_001.nii.gz", lambda good: good[: len(good) // 2], "truncated"),
        ("mask", "case_001.nii.gz", lambda good: good[:40], "truncated"),
        ("image", "case_001.nii.gz", lambda good: b"just some text\n" * 50, "not gzip-compressed"),
        ("image", "case_001.nii.gz", lambda good: gzip.compress(b"not an image at all\n" * 50), "not a NIfTI file"),
        ("image", "case_001.nii", lambda good: b"name,value\n" * 50, "not a NIfTI file"),
        ("mask", "case_001.nii.gz", lambda good: b"", "empty file"),
    ],
    ids=["bad-gzip", "truncated-data", "truncated-header", "plain-text-as-gz", "gzipped-text", "csv-as-nii", "empty"],
)
def test_unreadable_files(pairs, tmp_path, which, name, corrupt, fragment):
    images, masks, cfg = pairs
    folder = images if which == "image" else masks
    (folder / "case_001.nii.gz").unlink()
    target = folder / name
    good = _good_bytes(tmp_path, name)
    target.write_bytes(corrupt(good))
    assert_error_names(cfg, target, fragment)


def test_truncated_uncompressed_nii(pairs, tmp_path):
    images, masks, cfg = pairs
    (images / "case_002.nii.gz").unlink()
    target = images / "case_002.nii"
    target.write_bytes(_good_bytes(tmp_path, "x.nii")[:2000])
    assert_error_names(cfg, target, "truncated")


def _replace(path: Path, array: np.ndarray, affine: np.ndarray | None = None) -> Path:
    return write_nifti(path, array, affine)


def test_4d_where_3d_expected(pairs):
    images, masks, cfg = pairs
    image = phantom(SIZE, 1)[0]
    target = _replace(images / "case_001.nii.gz", np.stack([image, image], -1))
    assert_error_names(cfg, target, "expected a 3D volume", "(16, 16, 16, 2)")


def test_4d_with_one_volume_is_3d(pairs):
    images, masks, cfg = pairs
    _replace(images / "case_001.nii.gz", phantom(SIZE, 1)[0][..., None])
    assert len(run_checks(cfg)) == 3


def test_shape_mismatch(pairs):
    images, masks, cfg = pairs
    target = _replace(masks / "case_001.nii.gz", phantom(SIZE, 1)[1][:, :, :-1])
    assert_error_names(cfg, target, "shape (16, 16, 15) differs")


def test_affine_mismatch_beyond_tolerance(pairs):
    images, masks, cfg = pairs
    mask = phantom(SIZE, 1)[1]
    shifted = np.diag([1.5, 1.5, 1.5, 1.0])
    shifted[0, 3] = 1e-4  # within the 1e-3 mm tolerance
    _replace(masks / "case_001.nii.gz", mask, shifted)
    assert len(run_checks(cfg)) == 3
    shifted[0, 3] = 0.5
    target = _replace(masks / "case_001.nii.gz", mask, shifted)
    assert_error_names(cfg, target, "affine differs")


def test_mask_without_configured_labels(pairs):
    images, masks, cfg = pairs
    target = _replace(masks / "case_002.nii.gz", np.zeros((SIZE,) * 3, np.uint8))
    assert_error_names(cfg, target, "none of the configured labels")


def test_unknown_labels_error_or_warn(pairs, caplog):
    images, masks, cfg = pairs
    mask = phantom(SIZE, 2)[1]
    mask[0, 0, :3] = 4
    target = _replace(masks / "case_002.nii.gz", mask)
    assert_error_names(cfg, target, "labels [4] are not in the configured labels [1, 2]")
    cfg.data.unknown_labels = "warn"
    with caplog.at_level(logging.WARNING, logger="diffusion3d.data"):
        summaries = run_checks(cfg)
    assert summaries[2]["warnings"] and str(target) in summaries[2]["warnings"][0]
    assert any(str(target) in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert "warnings: 1" in D.format_summary(summaries)
    # warn means background: label 4 lights no condition channel
    cond = D.mask_to_cond(torch.from_numpy(mask.astype(np.uint8))[None, None], cfg.data.labels)
    assert (cond[0, :, 0, 0, :3] == -1).all()


def test_non_integer_mask(pairs):
    images, masks, cfg = pairs
    target = _replace(masks / "case_000.nii.gz", phantom(SIZE, 0)[0])
    assert_error_names(cfg, target, "non-integer")


def test_constant_image(pairs):
    images, masks, cfg = pairs
    target = _replace(images / "case_001.nii.gz", np.full((SIZE,) * 3, 0.25, np.float32))
    assert_error_names(cfg, target, "constant image")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_voxels(pairs, bad):
    images, masks, cfg = pairs
    image = phantom(SIZE, 1)[0]
    image[3, 4, 5] = bad
    target = _replace(images / "case_001.nii.gz", image)
    assert_error_names(cfg, target, "NaN or infinite")


def test_modalities_with_different_affines(tmp_path):
    image, mask = phantom(SIZE, 0)
    write_nifti(tmp_path / "t1" / "a.nii.gz", image)
    moved = np.diag([1.5, 1.5, 1.5, 1.0])
    moved[2, 3] = 3.0
    target = write_nifti(tmp_path / "t2" / "a.nii.gz", image, moved)
    write_nifti(tmp_path / "m" / "a.nii.gz", mask)
    cfg = tiny(
        tmp_path, data=False, image_dir=[str(tmp_path / "t1"), str(tmp_path / "t2")], mask_dir=str(tmp_path / "m")
    ).cfg
    assert_error_names(cfg, target, "affine differs")


@pytest.mark.slow
def test_check_data_command(tmp_path, capsys):
    """Bad data: exit 2, one line, no traceback, nothing created. Good data: the summary, exit 0."""
    run = tiny(tmp_path, n=2)
    argv = ["--check_data", *run.flags]
    bad = run.masks / "case_001.nii.gz"
    good_bytes = bad.read_bytes()
    bad.write_bytes(good_bytes[: len(good_bytes) // 2])
    proc = subprocess.run(
        [sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, env=subprocess_env()
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"error: {bad}: truncated"), proc.stderr
    assert lines[1] == "error: 1 of 2 cases are bad; nothing was written"
    assert "Traceback" not in proc.stderr
    assert not run.results.exists()

    bad.write_bytes(good_bytes)  # in-process from here: the same entry point, without a second interpreter start
    from diffusion3d.commands import train as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for expected in [
        "cases: 2",
        "shapes: (16, 16, 16)",
        "spacings: (1.5, 1.5, 1.5)",
        "orientations: RAS",
        "labels: 0: ",
    ]:
        assert expected in out, out
    assert not run.results.exists()


# ---- pairing ----------------------------------------------------------------------------------------
def test_suffixes_pair_brats_names(tmp_path):
    for i in (1, 2):
        image, mask = phantom(SIZE, i)
        write_nifti(tmp_path / "img" / f"BraTS2021_0000{i}_t1.nii.gz", image)
        write_nifti(tmp_path / "seg" / f"BraTS2021_0000{i}_seg.nii.gz", mask)
    cfg = tiny(tmp_path, data=False, image_dir=str(tmp_path / "img"), mask_dir=str(tmp_path / "seg")).cfg
    with pytest.raises(D.DataError, match="image without mask"):
        D.discover(cfg)
    cfg.data.image_suffix, cfg.data.mask_suffix = "_t1", "_seg"
    cases = D.discover(cfg)
    assert [c.name for c in cases] == ["BraTS2021_00001", "BraTS2021_00002"]
    assert cases[1].images == [tmp_path / "img" / "BraTS2021_00002_t1.nii.gz"]
    assert cases[1].mask == tmp_path / "seg" / "BraTS2021_00002_seg.nii.gz"


def _modalities(tmp_path: Path, names: list[str], offsets: list[float]) -> Path:
    """One folder per modality holding the phantom plus a distinct constant offset; returns the mask folder."""
    for i in range(2):
        image, mask = phantom(SIZE, i)
        for name, offset in zip(names, offsets):
            write_nifti(tmp_path / name / f"c{i}.nii.gz", image + offset)
        write_nifti(tmp_path / "seg" / f"c{i}.nii.gz", mask)
    return tmp_path / "seg"


def _channel_means(cfg) -> list[float]:
    dataset = D.build_dataset(D.discover(cfg), cfg)
    return [float(v) for v in dataset[0]["image"].mean(dim=(1, 2, 3))]


def test_modality_folders_stack_in_configured_order(tmp_path):
    seg = _modalities(tmp_path, ["t1", "t2", "flair"], [0.0, 10.0, 20.0])
    dirs = [str(tmp_path / n) for n in ("flair", "t1", "t2")]
    cfg = tiny(tmp_path, data=False, image_dir=dirs, mask_dir=str(seg), intensity="none").cfg
    assert len(run_checks(cfg)) == 2 and cfg.data.image_channels == 3
    base = float(phantom(SIZE, 0)[0].mean())
    assert _channel_means(cfg) == pytest.approx([base + 20, base, base + 10], abs=1e-4)
    cfg.data.image_dir = dirs[::-1]
    assert _channel_means(cfg) == pytest.approx([base + 10, base, base + 20], abs=1e-4)


def test_manifest_single_and_numbered_image_columns(tmp_path):
    seg = _modalities(tmp_path, ["t1", "t2"], [0.0, 10.0])
    single = tmp_path / "single.csv"
    single.write_text("case,image,mask\n" + "".join(f"c{i},t1/c{i}.nii.gz,seg/c{i}.nii.gz\n" for i in range(2)))
    cfg = tiny(tmp_path, data=False, manifest=str(single), intensity="none").cfg
    cases = D.discover(cfg)
    assert [(c.name, c.images, c.mask) for c in cases] == [
        (f"c{i}", [tmp_path / "t1" / f"c{i}.nii.gz"], seg / f"c{i}.nii.gz") for i in range(2)
    ]
    assert len(D.validate(cases, cfg)) == 2

    multi = tmp_path / "multi.csv"  # columns deliberately out of order: image_0 must still come first
    multi.write_text(
        "case,mask,image_1,image_0\n"
        + "".join(f"c{i},seg/c{i}.nii.gz,t2/c{i}.nii.gz,t1/c{i}.nii.gz\n" for i in range(2))
    )
    cfg = tiny(tmp_path, data=False, manifest=str(multi), intensity="none", image_dir=["t1", "t2"]).cfg
    base = float(phantom(SIZE, 0)[0].mean())
    assert _channel_means(cfg) == pytest.approx([base, base + 10], abs=1e-4)
    # with a manifest the model's image channels follow its image columns, whatever image_dir says;
    # discovery finds them (the config reads no file) and records them in the config
    cfg = tiny(tmp_path, data=False, manifest=str(multi), intensity="none").cfg
    assert cfg.image_channels == 1 and cfg.data.image_channels is None
    assert len(D.discover(cfg)[0].images) == 2
    assert cfg.image_channels == 2 and cfg.to_dict()["data"]["image_channels"] == 2
    # a count set by hand is checked against what discovery finds
    cfg = tiny(tmp_path, data=False, manifest=str(multi), intensity="none", image_channels=3).cfg
    with pytest.raises(
        D.DataError, match=r"^\S*multi.csv: 2 image channel\(s\) per case, but image_channels is set to 3$"
    ):
        D.discover(cfg)


def test_manifest_errors_name_the_file(tmp_path):
    seg = _modalities(tmp_path, ["t1"], [0.0])
    manifest = tmp_path / "m.csv"
    manifest.write_text("case,image,mask\nc0,t1/c0.nii.gz,seg/missing.nii.gz\n")
    cfg = tiny(tmp_path, data=False, manifest=str(manifest)).cfg
    with pytest.raises(D.DataError) as exc:
        D.discover(cfg)
    assert str(exc.value).startswith(f"{seg / 'missing.nii.gz'}: file not found")
    manifest.write_text("case,image,mask\nc0,t1/c0.nii.gz,seg/c0.nii.gz\nc0,t1/c1.nii.gz,seg/c1.nii.gz\n")
    with pytest.raises(D.DataError, match="listed twice"):
        D.discover(cfg)
    assert _image_columns(["case", "image_10", "image_2", "image_0", "mask"]) == ["image_0", "image_2", "image_10"]


def test_unconditional_needs_images_only(tmp_path):
    for i in range(2):
        write_nifti(tmp_path / "img" / f"c{i}.nii.gz", phantom(SIZE, i)[0])
    cfg = tiny(
        tmp_path, data=False, image_dir=str(tmp_path / "img"), mask_dir=str(tmp_path / "no_masks"), with_condition=False
    ).cfg
    cases = D.discover(cfg)
    assert all(c.mask is None for c in cases)
    summaries = D.validate(cases, cfg)
    assert "labels" not in summaries[0]
    item = D.build_dataset(cases, cfg)[1]
    assert set(item) == {"image"} and item["image"].shape == (1, SIZE, SIZE, SIZE)


# ---- transforms and caching -------------------------------------------------------------------------
def test_intensity_per_volume_and_per_channel(tmp_path):
    """Percentile scaling maps each channel's whole-volume range to [-1, 1]; slices keep their relative level."""
    x = np.arange(SIZE, dtype=np.float32)
    ramp = np.broadcast_to(x[None, None, :] * (1 + x[:, None, None]), (SIZE,) * 3).copy()  # each slice its own range
    write_nifti(tmp_path / "a" / "c.nii.gz", ramp)
    write_nifti(tmp_path / "b" / "c.nii.gz", ramp * 1000 + 500)
    write_nifti(tmp_path / "m" / "c.nii.gz", (ramp > 20).astype(np.uint8))
    cfg = tiny(
        tmp_path,
        data=False,
        image_dir=[str(tmp_path / "a"), str(tmp_path / "b")],
        mask_dir=str(tmp_path / "m"),
        intensity="percentile",
        lower_percentile=0.0,
        upper_percentile=100.0,
    ).cfg
    out = D.training_transforms(cfg)(
        {
            "image": [str(tmp_path / "a" / "c.nii.gz"), str(tmp_path / "b" / "c.nii.gz")],
            "mask": str(tmp_path / "m" / "c.nii.gz"),
        }
    )
    image = out["image"]
    assert image.shape == (2, SIZE, SIZE, SIZE) and not isinstance(image, MetaTensor)
    expected = torch.from_numpy(2 * (ramp - ramp.min()) / (ramp.max() - ramp.min()) - 1)
    for c in range(2):
        assert float(image[c].min()) == -1.0 and float(image[c].max()) == pytest.approx(1.0)
        torch.testing.assert_close(image[c], expected, atol=1e-5, rtol=0)
    assert out["mask"].dtype == torch.uint8


def test_padding_is_background(tmp_path):
    run = tiny(tmp_path, n=1, image_size=[20, 20, 20])
    images, masks, cfg = run.images, run.masks, run.cfg
    item = D.training_transforms(cfg)(
        {"image": str(images / "case_000.nii.gz"), "mask": str(masks / "case_000.nii.gz")}
    )
    assert item["image"].shape == (1, 20, 20, 20)
    assert (item["image"][:, :2] == -1).all() and (item["mask"][:, :2] == 0).all()
    assert float(item["image"].min()) >= -1 and float(item["image"].max()) <= 1


def test_disk_cache_equals_memory_cache_and_is_read_back(tmp_path, monkeypatch):
    cfg = tiny(tmp_path, n=3, intensity="percentile", spacing=[2.0, 2.0, 2.0]).cfg
    cases = D.discover(cfg)
    memory = D.build_dataset(cases, cfg)
    cfg.data.cache = "disk"
    disk = D.build_dataset(cases, cfg, tmp_path / "cache")
    for i in range(3):
        for key in ("image", "mask"):
            torch.testing.assert_close(D.plain(disk[i])[key], D.plain(memory[i])[key], atol=0, rtol=0)
        mask = disk[i]["mask"]
        assert mask.dtype == torch.uint8 and set(torch.unique(mask).tolist()) == {0, 1, 2}
        assert float(disk[i]["image"].min()) == -1.0 and float(disk[i]["image"].max()) <= 1.0
    assert len(list((tmp_path / "cache").rglob("*.pt"))) == 3

    def no_decoding(self, data, reader=None):
        raise AssertionError("decoded again instead of read from the disk cache")

    monkeypatch.setattr(LoadImaged, "__call__", no_decoding)
    again = D.build_dataset(cases, cfg, tmp_path / "cache")
    for i in range(3):
        torch.testing.assert_close(D.plain(again[i])["image"], D.plain(memory[i])["image"], atol=0, rtol=0)
    # the metadata survives the disk round trip (the file's own affine and shape)
    meta = again[1]["image"].meta
    np.testing.assert_allclose(np.asarray(meta["original_affine"]), np.diag([1.5, 1.5, 1.5, 1.0]))
    assert tuple(int(s) for s in meta["spatial_shape"]) == (SIZE,) * 3


def test_disk_cache_is_fresh_for_new_settings(tmp_path):
    run = tiny(tmp_path, n=1, cache="disk")
    images, cfg = run.images, run.cfg
    cases = D.discover(cfg)
    assert D.build_dataset(cases, cfg, tmp_path / "cache")[0]["image"].shape == (1, 16, 16, 16)
    cfg.data.image_size = [8, 8, 8]
    assert D.build_dataset(cases, cfg, tmp_path / "cache")[0]["image"].shape == (1, 8, 8, 8)
    # an edited source file is re-read, not served stale
    write_nifti(images / "case_000.nii.gz", phantom(SIZE, 0)[0] * 0 + np.linspace(0, 1, SIZE, dtype=np.float32))
    cfg.data.image_size = [16, 16, 16]
    fresh = D.build_dataset(cases, cfg, tmp_path / "cache")[0]["image"]
    torch.testing.assert_close(fresh[0, 0, 0], torch.linspace(-1, 1, SIZE), atol=1e-5, rtol=0)


# ---- the stream -------------------------------------------------------------------------------------
def _stream_dataset(tmp_path: Path, n: int = 5):
    cfg = tiny(tmp_path, n=n).cfg
    return D.build_dataset(D.discover(cfg), cfg), cfg


def _draw(dataset, cfg, stream, batch_size: int, count: int, rank: int = 0, world_size: int = 1):
    """The first ``count`` samples (id, image) the loader delivers in micro-batches of ``batch_size``."""
    loader = iter(D.make_loader(dataset, stream, batch_size, cfg, pin_memory=False, rank=rank, world_size=world_size))
    ids, images = [], []
    while len(ids) < count:
        batch = next(loader)
        assert batch["image"].shape[0] == batch_size and not isinstance(batch["image"], MetaTensor)
        ids += [int(k) for k in batch["sample_id"]]
        images += list(batch["image"])
    return ids, images


def test_stream_invariant_to_batch_split_and_restorable(tmp_path):
    dataset, cfg = _stream_dataset(tmp_path)
    reference = D.SampleStream(5, seed=3)
    ids2, images2 = _draw(dataset, cfg, D.SampleStream(5, seed=3), batch_size=2, count=12)  # batch 2 × accum 1
    ids1, images1 = _draw(dataset, cfg, D.SampleStream(5, seed=3), batch_size=1, count=12)  # batch 1 × accum 2
    assert ids2 == ids1 == list(range(12))
    for k, (a, b) in enumerate(zip(images2, images1)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(a, D.plain(dataset[reference.index(k)])["image"], atol=0, rtol=0)
    # two ranks with batch 1 cut the same sequence between them
    r0, _ = _draw(dataset, cfg, D.SampleStream(5, seed=3), batch_size=1, count=3, rank=0, world_size=2)
    r1, _ = _draw(dataset, cfg, D.SampleStream(5, seed=3), batch_size=1, count=3, rank=1, world_size=2)
    assert sorted(r0 + r1) == list(range(6)) and r0 == [0, 2, 4]
    # restored at a saved position: continues the same sequence
    ids7, images7 = _draw(dataset, cfg, D.SampleStream(5, seed=3, samples_seen=7), batch_size=2, count=4)
    assert ids7 == [7, 8, 9, 10]
    for a, b in zip(images7, images2[7:11]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_stream_epochs_are_permutations():
    stream = D.SampleStream(7, seed=11)
    epochs = [[stream.index(k) for k in range(e * 7, (e + 1) * 7)] for e in range(4)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # a new permutation each epoch
    # sample k depends only on (seed, k): any access order, any instance
    fresh = D.SampleStream(7, seed=11, samples_seen=20)
    assert [fresh.index(k) for k in reversed(range(28))] == [i for e in epochs for i in e][::-1]
    assert [D.SampleStream(7, seed=12).index(k) for k in range(7)] != epochs[0]
    assert [D.SampleStream(7, 0, s).epoch for s in (0, 6, 7, 20, 21)] == [0, 0, 1, 2, 3]
    assert stream.micro_batch_ids(1, 2) == [2, 3]
    assert D.SampleStream(7, 0, samples_seen=10).micro_batch_ids(1, 2, rank=1, world_size=2) == [16, 17]


def test_flips_are_drawn_per_sample_and_mirror_image_and_mask_together(tmp_path):
    """data.flip_axes: sample k is mirrored along a seeded choice of the listed axes, the same whatever the
    batch split or resume point, with its mask; axes not listed are never flipped."""
    from diffusion3d.data.stream import flipped_axes

    dataset, cfg = _stream_dataset(tmp_path)
    cfg.data.flip_axes = [0, 2]
    reference = D.SampleStream(5, seed=3)
    seen: dict[int, list[int]] = {}
    for batch_size, start in ((2, 0), (1, 0), (3, 6)):
        loader = iter(D.make_loader(dataset, D.SampleStream(5, seed=3, samples_seen=start), batch_size, cfg, False))
        for _ in range(12 // batch_size):
            batch = next(loader)
            for j, k in enumerate(int(i) for i in batch["sample_id"]):
                axes = flipped_axes(3, k, [0, 2])
                assert seen.setdefault(k, axes) == axes  # the same draw in every split
                item = D.plain(dataset[reference.index(k)])
                dims = [a + 1 for a in axes]
                torch.testing.assert_close(batch["image"][j], torch.flip(item["image"], dims), atol=0, rtol=0)
                torch.testing.assert_close(batch["mask"][j], torch.flip(item["mask"], dims), atol=0, rtol=0)
    drawn = [flipped_axes(3, k, [0, 2]) for k in range(400)]
    assert all(1 not in axes for axes in drawn)
    for axis in (0, 2):
        assert 0.4 < np.mean([axis in axes for axes in drawn]) < 0.6
    assert flipped_axes(3, 5, []) == []
    # adding an axis leaves the draws of the others unchanged
    assert [a for a in flipped_axes(3, 7, [0, 1, 2]) if a != 1] == flipped_axes(3, 7, [0, 2])


def test_affine_augmentation_is_drawn_per_sample_and_moves_image_and_mask_together(tmp_path):
    """data.affine_*: sample k is rotated, scaled and shifted by a draw from (seed, k), the same whatever the batch
    split or resume point; image and mask move together, the mask keeps its labels, the image's fill is the
    background (-1); all ranges 0 leaves every sample untouched."""
    from diffusion3d.data.stream import AffineDraw, AffineRanges, affine_draw, affine_item

    dataset, cfg = _stream_dataset(tmp_path)
    cfg.data.affine_rotate, cfg.data.affine_scale, cfg.data.affine_translate = 10.0, 0.1, 0.05
    ranges = AffineRanges(10.0, 0.1, 0.05)
    reference = D.SampleStream(5, seed=3)
    for batch_size, start in ((2, 0), (1, 0), (3, 6)):
        loader = iter(D.make_loader(dataset, D.SampleStream(5, seed=3, samples_seen=start), batch_size, cfg, False))
        for _ in range(6 // batch_size):
            batch = next(loader)
            for j, k in enumerate(int(i) for i in batch["sample_id"]):
                item = D.plain(dataset[reference.index(k)])
                moved = affine_item(item, affine_draw(3, k, ranges))
                torch.testing.assert_close(batch["image"][j], moved["image"], atol=0, rtol=0)
                torch.testing.assert_close(batch["mask"][j], moved["mask"], atol=0, rtol=0)
                assert not torch.equal(moved["image"], item["image"])
                assert set(moved["mask"].unique().tolist()) <= set(item["mask"].unique().tolist())
                assert moved["image"].dtype == item["image"].dtype and moved["mask"].dtype == item["mask"].dtype

    draws = [affine_draw(3, k, ranges) for k in range(400)]
    angles = np.array([d.angles for d in draws])
    assert np.abs(angles).max() <= np.deg2rad(10.0) and np.abs(angles).max() > np.deg2rad(9.0)
    assert all(0.9 <= d.scale <= 1.1 for d in draws) and all(max(map(abs, d.shift)) <= 0.05 for d in draws)
    assert len({d.angles for d in draws}) == 400
    # one range changed: the other parameters' draws stay
    assert affine_draw(3, 7, AffineRanges(10.0, 0.0, 0.05)).angles == draws[7].angles
    assert affine_draw(3, 7, AffineRanges(0.0, 0.1, 0.0)).scale == draws[7].scale
    assert affine_draw(3, 7, AffineRanges()) is None
    # affine_prob: about that share of the samples is moved, each by the draw it has at probability 1
    half = [affine_draw(3, k, AffineRanges(10.0, 0.1, 0.05, prob=0.3)) for k in range(400)]
    assert 0.22 < sum(d is not None for d in half) / 400 < 0.38
    assert all(d is None or d == draws[k] for k, d in enumerate(half))
    assert affine_draw(3, 7, AffineRanges(10.0, 0.1, 0.05, prob=0.0)) is None
    item = D.plain(dataset[0])
    assert affine_item(item, None) is item

    # a box whose image is bright where its mask is 2: rotated 20 degrees about one axis and shifted, the two still
    # overlap, the box really moved, and the corners, which come from outside the grid, are background (-1, not 0)
    image = -torch.ones(1, 24, 24, 24)
    mask = torch.zeros(1, 24, 24, 24, dtype=torch.uint8)
    image[:, 6:18, 4:16, 8:14], mask[:, 6:18, 4:16, 8:14] = 0.8, 2
    moved = affine_item({"image": image, "mask": mask}, AffineDraw((0.35, 0.0, 0.0), 1.0, (0.0, 0.1, 0.0)))
    bright, labelled = moved["image"] > -0.1, moved["mask"] == 2
    assert 2 * (bright & labelled).sum() / (bright.sum() + labelled.sum()) > 0.95
    assert (labelled != (mask == 2)).sum() > 200
    assert torch.all(moved["image"][0, :, 0, 0] == -1.0) and torch.all(moved["mask"][0, :, 0, 0] == 0)
    assert moved["image"].min() >= -1.0 and moved["image"].max() <= 0.8  # the spline's overshoot clamped

    # the image is resampled by a cubic spline, which keeps a white-noise texture's mean gradient at a sub-voxel
    # rotation and shift (0.72 of it; trilinear keeps 0.41)
    texture = torch.from_numpy(np.random.default_rng(0).uniform(-1, 1, (1, 32, 32, 32)).astype(np.float32))
    draw = AffineDraw((0.03, -0.02, 0.01), 1.0, (0.01, 0.01, -0.01))
    moved = affine_item({"image": texture, "mask": torch.zeros(1, 32, 32, 32, dtype=torch.uint8)}, draw)

    def gradient(v: torch.Tensor) -> float:
        inner = v[:, 4:-4, 4:-4, 4:-4]
        return float((inner[:, 1:] - inner[:, :-1]).abs().mean())

    assert gradient(moved["image"]) > 0.6 * gradient(texture)


@pytest.mark.parametrize(
    "name, value",
    [
        ("affine_rotate", -1.0),
        ("affine_rotate", 200.0),
        ("affine_scale", 1.0),
        ("affine_translate", 1.5),
        ("affine_prob", 1.5),
        ("affine_prob", -0.1),
    ],
)
def test_affine_ranges_are_checked(tmp_path, name, value):
    cfg = tiny(tmp_path).cfg
    with pytest.raises(C.ConfigError, match=name):
        cfg.override(**{name: value})


@pytest.mark.parametrize("axes", [[3], [0, 0], [-1]])
def test_flip_axes_must_be_distinct_spatial_axes(tmp_path, axes):
    cfg = tiny(tmp_path, data=False).cfg
    with pytest.raises(C.ConfigError, match="flip_axes"):
        cfg.override(flip_axes=axes)


# ---- geometry: a sample goes back onto the mask's own grid ------------------------------------------
ODD_SHAPE = (40, 36, 30)
ODD_SPACING = (1.2, 1.0, 2.0)


def _lps_oblique_affine() -> np.ndarray:
    angle = math.radians(10)
    rotation = np.array([[math.cos(angle), -math.sin(angle), 0], [math.sin(angle), math.cos(angle), 0], [0, 0, 1]])
    affine = np.eye(4)
    affine[:3, :3] = np.diag([-1.0, -1.0, 1.0]) @ rotation @ np.diag(ODD_SPACING)  # LPS, oblique, anisotropic
    affine[:3, 3] = [30.0, 20.0, -25.0]
    return affine


def _odd_mask(tmp_path: Path, smooth: bool) -> Path:
    rng = np.random.default_rng(0)
    if smooth:  # an off-centre ellipsoid (1) with a blob (2): survives resampling
        grid = np.stack(np.meshgrid(*[np.arange(s) for s in ODD_SHAPE], indexing="ij"), -1) * ODD_SPACING
        mask = np.zeros(ODD_SHAPE, np.uint8)
        mask[(((grid - [22, 16, 34]) / [16, 13, 20]) ** 2).sum(-1) <= 1] = 1
        mask[(((grid - [28, 20, 40]) / [6, 6, 10]) ** 2).sum(-1) <= 1] = 2
    else:  # random labels: any flip or shift shows
        mask = rng.integers(0, 3, ODD_SHAPE).astype(np.uint8)
    return write_nifti(tmp_path / "odd_mask.nii.gz", mask, _lps_oblique_affine())


def _roundtrip(tmp_path: Path, path: Path, **overrides) -> tuple[D.MaskGrid, np.ndarray, np.ndarray]:
    cfg = tiny(tmp_path, data=False, image_size=[32, 32, 32], **overrides).cfg
    grid = D.MaskGrid(path, cfg)
    assert grid.mask.shape == (1, 32, 32, 32) and grid.mask.dtype == torch.uint8
    assert grid.original_shape == ODD_SHAPE
    np.testing.assert_allclose(grid.original_affine, _lps_oblique_affine(), atol=1e-5)
    back = grid.invert(grid.mask.float(), fill=0.0)
    out = tmp_path / "back.nii.gz"
    D.save_nifti(back, grid.original_affine, out)
    written = nib.load(str(out))
    assert written.shape == ODD_SHAPE
    np.testing.assert_allclose(written.affine, _lps_oblique_affine(), atol=1e-5)
    np.testing.assert_allclose(written.header.get_zooms(), ODD_SPACING, atol=1e-5)
    assert "".join(nib.aff2axcodes(written.affine)) == "LPS"
    return grid, back[0], np.asarray(nib.load(str(path)).dataobj)


def test_roundtrip_pad_crop_is_exact(tmp_path):
    grid, back, original = _roundtrip(tmp_path, _odd_mask(tmp_path, smooth=False))
    # on the model grid: RAS (x and y flipped), centre-cropped 40→32 and 36→32, 30 padded by 1 on each side
    expected = np.zeros((32, 32, 32), np.uint8)
    expected[:, :, 1:31] = original[::-1, ::-1][4:36, 2:34]
    np.testing.assert_array_equal(grid.mask[0].numpy(), expected)
    covered = grid.invert(torch.ones(1, 32, 32, 32), fill=0.0)[0] == 1
    assert covered.sum() == 32 * 32 * 30
    np.testing.assert_array_equal(back[covered], original[covered])
    assert (back[~covered] == 0).all()
    # the fill value stands where the model grid does not reach
    assert (grid.invert(torch.zeros(1, 32, 32, 32), fill=-1.0)[0][~covered] == -1).all()
    cond = grid.cond([1, 2])
    assert cond.shape == (2, 32, 32, 32) and set(cond.unique().tolist()) == {-1.0, 1.0}


def _dice(a: np.ndarray, b: np.ndarray) -> float:
    return 2 * float((a & b).sum()) / float(a.sum() + b.sum())


@pytest.mark.parametrize(
    "overrides", [{"spacing": [1.5, 1.5, 1.5]}, {"resize_mode": "resize"}], ids=["spacing", "resize"]
)
def test_roundtrip_resampled_is_close(tmp_path, overrides):
    grid, back, original = _roundtrip(tmp_path, _odd_mask(tmp_path, smooth=True), **overrides)
    assert set(torch.unique(grid.mask).tolist()) == {0, 1, 2}  # nearest neighbour: labels stay labels
    labels = np.rint(back).astype(int)
    if (
        "spacing" in overrides
    ):  # 1.5 mm over 32 voxels = 48 mm does not cover all 48 × 36 × 60 mm: compare the covered part
        covered = grid.invert(torch.ones(1, 32, 32, 32), fill=0.0)[0] > 0.5
        assert 0.3 < covered.mean() < 1.0
    else:
        covered = np.ones(ODD_SHAPE, bool)
    assert _dice(labels[covered] >= 1, original[covered] >= 1) > 0.95
    assert _dice(labels[covered] == 2, original[covered] == 2) > 0.8


# ---- real data --------------------------------------------------------------------------------------
def test_real_whole_head_pair(tmp_path):
    root = SHARED_DATA / "whole_head"
    if not root.is_dir():
        pytest.skip(f"real data not present at {root}")
    image, mask = root / "image" / "sample_3.nii.gz", root / "mask" / "sample_3.nii.gz"
    cfg = tiny(
        tmp_path, data=False, labels=[1, 2], intensity="range", intensity_range=[-1.0, 1.0], image_size=[128] * 3
    ).cfg
    (summary,) = D.validate([D.Case("sample_3", [image], mask)], cfg)
    assert summary["shape"] == (128, 128, 128) and summary["orientation"] == "RAS"
    assert set(summary["labels"]) == {0, 1, 2}
    out = D.training_transforms(cfg)({"image": str(image), "mask": str(mask)})
    # already RAS, 128³ and in [-1, 1]: the transforms must leave it as it is
    np.testing.assert_allclose(out["image"][0].numpy(), np.asarray(nib.load(str(image)).dataobj), atol=1e-6)
    np.testing.assert_array_equal(out["mask"][0].numpy(), np.asarray(nib.load(str(mask)).dataobj))


def test_real_brats_case_checks_with_the_brats_config(capsys):
    """The brats_192 config on the one real BraTS 2021 case (4 modalities, 192×192×144, LPS, labels 0-4):
    --check_data finds one case of four image channels and every label, and writes nothing."""
    root = SHARED_DATA / "brats2021"
    if not root.is_dir():
        pytest.skip(f"real data not present at {root}")
    from diffusion3d.commands import train as cli

    folders = ",".join(str(root / m) for m in ("t1", "t1ce", "t2", "flair"))
    with pytest.raises(SystemExit) as exc:
        cli.main(
            ["--check_data", "--config", "brats_192", "--image_dir", f"[{folders}]", "--mask_dir", str(root / "seg")]
        )
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for expected in ["cases: 1", "shapes: (192, 192, 144)", "orientations: LPS", ", 1: ", ", 2: ", ", 3: ", ", 4: "]:
        assert expected in out, out
