"""report.html: PNG encoding, montages, histograms, the page the evaluate command writes, and (slow) what a real
browser shows of it."""

from __future__ import annotations

import base64
import re
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

from diffusion3d.commands import evaluate as E
from diffusion3d.evaluation import report as R
from tests.helpers import phantom, write_nifti

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def decode_png(data: bytes) -> tuple[int, int, int, np.ndarray]:
    """(width, height, colour type, pixels) of a PNG whose rows all use filter 0 (what encode_png writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, colour, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    channels = {0: 1, 2: 3}[colour]
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + width * channels)
    assert depth == 8 and (rows[:, 0] == 0).all()
    return width, height, colour, rows[:, 1:].reshape(height, width, channels).squeeze()


def test_png_round_trip_grey_and_rgb():
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (7, 5), dtype=np.uint8)
    rgb = rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    w, h, colour, pixels = decode_png(R.encode_png(grey))
    assert (w, h, colour) == (5, 7, 0) and np.array_equal(pixels, grey)
    w, h, colour, pixels = decode_png(R.encode_png(rgb))
    assert (w, h, colour) == (6, 4, 2) and np.array_equal(pixels, rgb)
    with pytest.raises(ValueError):
        R.encode_png(grey.astype(np.float32))


def test_montage_columns_and_label_colours():
    real, mask = phantom(16, 0)
    sample = np.clip(real, 0, 1)
    image = R.case_montage(np.clip(real, 0, 1), [sample, 1 - sample], mask, [0, 1, 2])
    assert image.shape == (48, 64, 3) and image.dtype == np.uint8  # 3 planes × (mask, real, 2 samples)
    mask_tile = image[:16, :16].reshape(-1, 3)
    colours = {tuple(c) for c in mask_tile}
    assert colours <= {tuple(R.label_colour(k)) for k in (0, 1, 2)} and len(colours) == 3
    real_tile, inverse_tile = image[:16, 16:32, 0].astype(int), image[:16, 48:64, 0].astype(int)
    assert np.abs(real_tile + inverse_tile - 255).max() <= 1  # the last column is 1 - sample


def test_histograms_count_every_voxel_of_each_label():
    real, mask = phantom(16, 1)
    real = np.clip(real, 0, 1)
    report = R.Report(max_cases=0)
    report.add_case("a", real, [real, np.full_like(real, 0.25)], mask)
    assert report.figures == [] and set(report.histograms) == {0, 1, 2}
    for label, h in report.histograms.items():
        n = int((mask == label).sum())
        assert h.real.sum() == n and h.synthetic.sum() == 2 * n
        assert h.real_sum == pytest.approx(float(real[mask == label].sum()), rel=1e-5)
    # The constant sample puts half the synthetic mass of every label into the bin of 0.25.
    bin_of = np.searchsorted(report.edges, 0.25, side="right") - 1
    assert report.histograms[1].synthetic[bin_of] >= (mask == 1).sum()


@pytest.fixture
def evaluated(tmp_path, capsys):
    """The evaluate command on three 32³ cases with two samples each (the real image, and it plus noise)."""
    rng = np.random.default_rng(0)
    for i in range(3):
        image, mask = phantom(32, i)
        write_nifti(tmp_path / "images" / f"case_{i}.nii.gz", image)
        write_nifti(tmp_path / "masks" / f"case_{i}.nii.gz", mask)
        write_nifti(tmp_path / "samples" / f"case_{i}_sample0.nii.gz", image)
        write_nifti(
            tmp_path / "samples" / f"case_{i}_sample1.nii.gz",
            image + rng.normal(0, 0.1, image.shape).astype(np.float32),
        )
    args = [
        "--samples",
        str(tmp_path / "samples"),
        "--images",
        str(tmp_path / "images"),
        "--masks",
        str(tmp_path / "masks"),
        "--out",
        str(tmp_path / "eval"),
        "--real_range",
        "-0.2",
        "1.2",
        "--sample_range",
        "-0.2",
        "1.2",
        "--report_cases",
        "2",
    ]
    with pytest.raises(SystemExit) as exc:
        E.main(args)
    assert exc.value.code == 0, capsys.readouterr().err
    return tmp_path / "eval" / "report.html"


def test_report_holds_montages_tables_and_histograms_and_nothing_external(evaluated):
    page = evaluated.read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 2  # --report_cases 2 of 3 cases
    for data in images:
        w, h, colour, _ = decode_png(base64.b64decode(data))
        assert (w, h, colour) == (4 * 32, 3 * 32, 2)  # mask, real, 2 samples; three planes
    assert "Mid-slices (2 of 3 cases)" in page and "case_0" in page and "sample 1" in page
    assert len(re.findall(r"<svg [^>]*class='histogram'", page)) == 3  # labels 0, 1, 2
    assert page.count("<polyline") == 6  # real and synthetic for each label
    for column in ("ssim", "psnr", "mae", "head_dice", "ms_ssim"):
        assert f"<th>{column}</th>" in page
    assert "case_2_sample1.nii.gz" in page  # every sample is in the table, also those without a montage
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page) and "<script" not in page and "@import" not in page


def test_report_cases_zero_writes_no_report(tmp_path, capsys):
    image, mask = phantom(16, 0)
    write_nifti(tmp_path / "images" / "c.nii.gz", image)
    write_nifti(tmp_path / "samples" / "c_sample0.nii.gz", image)
    with pytest.raises(SystemExit) as exc:
        E.main(
            [
                "--samples",
                str(tmp_path / "samples"),
                "--images",
                str(tmp_path / "images"),
                "--out",
                str(tmp_path / "eval"),
                "--report_cases",
                "0",
            ]
        )
    assert exc.value.code == 0, capsys.readouterr().err
    assert not (tmp_path / "eval" / "report.html").exists() and (tmp_path / "eval" / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")
def test_report_renders_in_headless_chromium(evaluated, tmp_path):
    """The page as a browser draws it: the montage's label colours and both histogram colours are on screen."""
    image = pytest.importorskip("PIL.Image")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1200,2400",
            evaluated.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = np.asarray(image.open(shot).convert("RGB"))
    assert pixels.shape == (2400, 1200, 3)
    colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    count = {tuple(int(v) for v in c): int(n) for c, n in zip(colours, counts)}
    for label in (1, 2):  # the montages' mask columns (thousands of pixels at 120 px a slice)
        assert count.get(tuple(int(v) for v in R.label_colour(label)), 0) > 500, label
    for colour in (R.REAL_COLOUR, R.SYNTHETIC_COLOUR):  # the histograms' step curves (a few hundred pixels)
        assert count.get(tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5)), 0) > 150, colour
