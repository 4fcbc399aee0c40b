"""Batch-size planning (``--batch_size auto``): the split of the effective batch, the search, the step's
memory, measured by running the trainer's own step on synthetic data."""

from __future__ import annotations

import pytest
import torch

from diffusion3d import memory
from diffusion3d.memory import (MemoryPlanError, find_max_batch, plan_accumulation, search_largest, step_memory,
                                synthetic_trainer)
from diffusion3d.trainer import Trainer
from tests.helpers import tiny_config


@pytest.mark.parametrize("effective, max_batch, expected", [
    (8, 8, (8, 1)), (8, 3, (2, 4)), (8, 100, (8, 1)), (7, 4, (1, 7)), (12, 5, (4, 3)), (1, 1, (1, 1)), (6, 1, (1, 6)),
])
def test_plan_accumulation(effective, max_batch, expected):
    batch, accum = plan_accumulation(effective, max_batch)
    assert (batch, accum) == expected and batch * accum == effective and batch <= max_batch


@pytest.mark.parametrize("effective, max_batch", [(0, 4), (4, 0), (-2, 2), (2.0, 2), (True, 2)])
def test_plan_accumulation_rejects_bad_input(effective, max_batch):
    with pytest.raises(MemoryPlanError):
        plan_accumulation(effective, max_batch)


@pytest.mark.parametrize("limit, max_batch", [(0, 8), (1, 8), (5, 8), (8, 8), (20, 8), (13, 64), (1000, 64)])
def test_search_largest_finds_the_boundary_with_few_trials(limit, max_batch):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= limit

    assert search_largest(fits, max_batch) == min(limit, max_batch)
    assert len(tried) <= 2 * max_batch.bit_length() + 1 and max(tried) <= max_batch


def test_step_memory_is_linear_in_batch_and_lower_with_checkpointing(tmp_path):
    plain = tiny_config(tmp_path / "a")
    ckpt = tiny_config(tmp_path / "b", activation_checkpointing=True)
    one, two, four = (step_memory(plain, b).step_peak_bytes for b in (1, 2, 4))
    assert 0 < one < two < four
    predicted = one + 3 * (two - one)  # the linear fit from batch 1 and 2 predicts batch 4
    assert abs(four - predicted) / four < 0.1
    with_ckpt = step_memory(ckpt, 2).step_peak_bytes
    assert with_ckpt < 0.8 * two  # recomputation frees the blocks' activations


def test_find_max_batch_respects_the_limit(tmp_path):
    cfg = tiny_config(tmp_path)
    mm = memory.fit_memory_model(cfg)
    limit = int(mm.total(3) + 0.5 * mm.per_sample_bytes)  # room for 3, not for 4
    assert find_max_batch(cfg, "cpu", limit_bytes=limit) == 3
    assert find_max_batch(cfg, "cpu", limit_bytes=10 * 2**30, max_batch=5) == 5
    with pytest.raises(MemoryPlanError, match="not even batch 1"):
        find_max_batch(cfg, "cpu", limit_bytes=mm.static_bytes + 1)
    # the live-bytes measurement it rests on agrees with the fitted line
    assert abs(step_memory(cfg, 3).total_bytes - mm.total(3)) / mm.total(3) < 0.1


def test_planning_runs_the_trainers_own_step(tmp_path, monkeypatch):
    """The planner measures Trainer.accumulate itself: memory the trainer's step holds shows in the plan.
    (A copy of the step inside the planner would not see this.)"""
    cfg = tiny_config(tmp_path)
    trainer = synthetic_trainer(cfg, 2)
    assert isinstance(trainer, Trainer) and trainer.cfg.train.batch_size == 2 and not trainer.cfg.train.compile
    before = step_memory(cfg, 2).step_peak_bytes
    real = Trainer.accumulate
    extra = 64 * 2**20

    def heavier(self):
        held = torch.empty(extra, dtype=torch.uint8)  # noqa: F841  (alive while the step runs)
        return real(self)

    monkeypatch.setattr(Trainer, "accumulate", heavier)
    after = step_memory(cfg, 2).step_peak_bytes
    assert after - before >= extra


def test_planning_does_not_touch_the_callers_config(tmp_path):
    cfg = tiny_config(tmp_path, batch_size=3, gradient_accumulate_every=1, compile=False)
    before = cfg.to_dict()
    step_memory(cfg, 1)
    assert cfg.to_dict() == before

