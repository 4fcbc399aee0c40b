"""TensorBoard, read back with tensorboard's own EventAccumulator; the montage; process memory."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from diffusion3d.data import build_dataset, discover, split_cases
from diffusion3d.monitor import Monitor, mid_slices, montage, peak_rss_gb
from diffusion3d.trainer import Trainer
from tests.helpers import tiny_config

SCALARS_CPU = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/skipped_steps",
    "perf/volumes_per_sec",
    "perf/step_time",
    "perf/data_wait_fraction",
    "data/epoch",
    "data/samples_seen",
    "mem/rss_gb",
}  # train/loss_scale exists only in fp16 (CUDA), mem/gpu_max_allocated_gb only on CUDA


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    """A 2-step CPU run (batch 2) that samples at step 2, as cli.run builds it; its event files, loaded."""
    tmp = tmp_path_factory.mktemp("tb")
    cfg = tiny_config(tmp, train_num_steps=2, save_every=2, sample_every=2, sampling_steps=2, num_val_cases=1)
    train, val = split_cases(discover(cfg), cfg.data.num_val_cases)
    Trainer(cfg, build_dataset(train, cfg), "cpu", tmp / "run", val).train()
    acc = EventAccumulator(str(tmp / "run" / "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc, val[0].name


def test_scalar_tags_every_step(events):
    acc, _ = events
    tags = set(acc.Tags()["scalars"])
    assert SCALARS_CPU <= tags, sorted(SCALARS_CPU - tags)
    assert "train/loss_scale" not in tags and "mem/gpu_max_allocated_gb" not in tags
    for tag in SCALARS_CPU:
        assert [e.step for e in acc.Scalars(tag)] == [1, 2], tag
    assert [e.value for e in acc.Scalars("data/samples_seen")] == [2.0, 4.0]
    assert all(e.value > 0 for e in acc.Scalars("train/loss") + acc.Scalars("mem/rss_gb"))
    assert all(0 <= e.value <= 1 for e in acc.Scalars("perf/data_wait_fraction"))


def test_sample_image_after_the_sampling_step(events):
    acc, case = events
    assert f"samples/{case}" in acc.Tags()["images"]
    (image,) = acc.Images(f"samples/{case}")
    assert image.step == 2
    # mask | real | sample, three planes of 16 × 16 each
    assert (image.height, image.width) == (3 * 16, 3 * 16)


def test_config_text_at_start(events):
    acc, _ = events
    assert "config/text_summary" in acc.Tags()["tensors"]


def test_montage_shape_range_and_layout():
    d, h, w = 16, 12, 8
    zeros, ones = torch.zeros(d, h, w), torch.ones(d, h, w)
    loud = torch.full((d, h, w), 5.0)
    loud[0] = -3.0
    image = montage([zeros, ones, loud])
    assert image.shape == (1, 3 * 16, 3 * 16)  # rows: planes, columns: volumes; each slice resized to 16²
    assert image.min() >= 0 and image.max() <= 1  # clamped
    assert image[:, :, :16].max() == 0 and image[:, :, 16:32].min() == 1
    assert set(image[:, :, 32:].unique().tolist()) == {0.0, 1.0}  # 5 → 1 and the -3 plane d=0 → 0


def test_mid_slices_are_the_middle_planes():
    volume = torch.zeros(8, 8, 8)
    volume[4], volume[:, 4], volume[:, :, 4] = 0.25, 0.5, 0.75  # the three mid-planes
    volume[4, 4], volume[4, :, 4], volume[:, 4, 4] = 0.1, 0.2, 0.3
    planes = mid_slices(volume)
    assert planes.shape == (3, 8, 8)
    # Each plane holds its own mid-plane value away from the two lines where it crosses the others.
    for plane, value in zip(planes, (0.25, 0.5, 0.75)):
        assert (plane == value).float().mean() > 0.5


def test_monitor_without_a_log_dir_and_peak_memory():
    monitor = Monitor(None, total_steps=3, start_step=0, quiet=True)
    monitor.scalars(1, {"train/loss": 1.0})  # no writer: nothing happens, nothing fails
    monitor.image("x", torch.zeros(1, 4, 4), 1)
    monitor.progress(1, {"loss": "1.0"})
    monitor.close()
    assert 0.01 < peak_rss_gb() < 64  # this process holds torch, so more than 10 MB
