"""The trainer's validator: cases loaded once, samples on the masks' grids, montages; imports run one way."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
import torch

from diffusion3d.data import discover, split_cases
from diffusion3d.model import build_model
from diffusion3d.validator import Validator
from tests.helpers import tiny_config


class FakeMonitor:
    def __init__(self) -> None:
        self.images: dict[str, tuple[torch.Tensor, int]] = {}
        self.flushed = 0

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        self.images[tag] = (image, step)

    def flush(self) -> None:
        self.flushed += 1


@pytest.mark.parametrize("conditional, space", [(True, "pixel"), (False, "pixel"), (True, "wavelet")])
def test_cases_load_once_and_each_validation_reads_no_file(tmp_path, monkeypatch, conditional, space):
    """... and in wavelet space the montage and the files hold the decoded volume on the model / mask grid."""
    cfg = tiny_config(
        tmp_path, with_condition=conditional, num_val_cases=2, num_samples=2, sampling_steps=2, space=space
    )
    _, val = split_cases(discover(cfg), cfg.data.num_val_cases)
    validator = Validator(cfg, val, "cpu")

    def no_reads(*args, **kwargs):
        raise AssertionError("a validation read a file")

    monkeypatch.setattr(nib, "load", no_reads)
    torch.manual_seed(0)
    model = build_model(cfg)
    monitor = FakeMonitor()
    for step in (5, 10):
        written = validator.run(model, tmp_path / f"step_{step}", step, monitor)
        assert [p.name for p in written] == [f"{c.name}_sample0.nii.gz" for c in val]
    monkeypatch.undo()
    columns = 3 if conditional else 2  # (mask,) real image, sample
    assert sorted(monitor.images) == sorted(f"samples/{c.name}" for c in val) and monitor.flushed == 2
    for image, step in monitor.images.values():
        assert image.shape == (1, 3 * 16, columns * 16) and step == 10
    for path, case in zip(written, val):
        img = nib.load(str(path))
        source = nib.load(str(case.mask if conditional else case.images[0]))
        assert img.shape == source.shape
        np.testing.assert_allclose(img.affine, source.affine, atol=1e-6)
