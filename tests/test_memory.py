"""Batch-size planning (``--batch_size auto``): the split of the effective batch, the search, the step's
memory, measured by running the trainer's own step on synthetic data."""

from __future__ import annotations

import pytest
import torch

from diffusion3d import config as C
from diffusion3d import configs, memory
from diffusion3d.memory import (
    MemoryPlanError,
    find_max_batch,
    plan_accumulation,
    search_largest,
    step_memory,
    synthetic_trainer,
)
from diffusion3d.monitor import peak_rss_bytes
from diffusion3d.trainer import Trainer
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "effective, max_batch, expected",
    [
        (8, 8, (8, 1)),
        (8, 3, (2, 4)),
        (8, 100, (8, 1)),
        (7, 4, (1, 7)),
        (12, 5, (4, 3)),
        (1, 1, (1, 1)),
        (6, 1, (1, 6)),
    ],
)
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


# ---- the estimate: the trainer's step traced on the meta device ----------------------------------------
ESTIMATE_TOLERANCE = 0.01  # relative; measured: 0 bytes apart in fp32, at most 0.04 % in bf16 (CPU rules)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"activation_checkpointing": True},
        {"space": "wavelet"},
        {"space": "wavelet", "wavelet_levels": 2, "activation_checkpointing": True},
        {"precision": "bf16"},
        {"precision": "bf16", "activation_checkpointing": True},
    ],
    ids=["fp32", "fp32-ckpt", "wavelet1", "wavelet2-ckpt", "bf16", "bf16-ckpt"],
)
def test_meta_trace_agrees_with_the_measured_step(tmp_path, overrides):
    """The estimate traced on the meta device (no memory, no arithmetic) = the live bytes of the same step
    run for real on the CPU at 16³, within ESTIMATE_TOLERANCE. bf16 is replayed with the CPU's autocast
    rules here (the table uses CUDA's, which keep norms and upsampling in fp32)."""
    cfg = tiny_config(tmp_path, **overrides)
    estimate = memory.estimate_step(cfg, 2, rules="cpu", flops=False)
    real = step_memory(cfg, 2)
    assert estimate.static_bytes == real.static_bytes
    assert abs(estimate.step_peak_bytes - real.step_peak_bytes) <= ESTIMATE_TOLERANCE * real.step_peak_bytes


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_static_bytes_are_what_a_real_step_leaves(tmp_path, optimizer):
    """Weights, EMA and the optimizer's state after a real step: AdamW's two moments per parameter, Muon's one
    momentum buffer per hidden weight (and AdamW's moments for the rest) — counted tensor by tensor."""
    trainer = synthetic_trainer(tiny_config(tmp_path, optimizer=optimizer), 1, accum=1)
    trainer.train_step()
    held = [*trainer.model.parameters(), *trainer.model.buffers(), *trainer.ema.module.parameters()]
    held += [*trainer.ema.module.buffers()]
    held += [t for state in trainer.optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
    real = sum(t.numel() * t.element_size() for t in held)
    assert memory.static_bytes(trainer.model, optimizer) == real
    adamw = memory.static_bytes(trainer.model, "adamw")
    assert (optimizer == "muon") == (real < adamw)  # Muon's state is smaller by the hidden weights


def test_meta_trace_counts_the_flops_of_the_real_step(tmp_path):
    """FLOPs of the meta trace = FlopCounterMode on the real step, attention included (the CPU flash kernel
    has no formula of its own in torch: counted through memory.flop_counter)."""
    cfg = tiny_config(tmp_path)
    trainer = synthetic_trainer(cfg, 1, accum=1)
    with memory.flop_counter() as counter:
        trainer.accumulate()
    attention = counter.get_flop_counts()["Global"].get(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, 0)
    assert attention > 0
    assert memory.estimate_step(cfg, 1).flops == counter.get_total_flops()


def test_cuda_rules_keep_norms_and_upsampling_in_fp32():
    """EmulatedAutocast with CUDA's rules: convolutions and linears in half, group norm and interpolation in
    fp32, only inside a region; a weight is cast once per region."""
    emulation = memory.EmulatedAutocast(torch.float16)
    conv = torch.nn.Conv3d(2, 4, 3, padding=1, device="meta")
    x = torch.empty(1, 2, 4, 4, 4, device="meta")
    with emulation:
        assert conv(x).dtype == torch.float32  # outside a region: untouched
        with emulation.region():
            y = conv(x)
            assert y.dtype == torch.float16
            assert torch.nn.functional.group_norm(y, 2).dtype == torch.float32
            assert torch.nn.functional.interpolate(y, scale_factor=2.0).dtype == torch.float32
            conv(x)
            assert len(emulation.cache) == 2  # weight and bias, each cast once
        assert not emulation.cache
    with memory.EmulatedAutocast(torch.bfloat16, rules="cpu") as cpu, cpu.region():
        assert torch.nn.functional.group_norm(conv(x), 2).dtype == torch.bfloat16


def test_a_large_grid_is_traced_without_allocating_it(tmp_path):
    """256³ in wavelet space: the trace reports gigabytes of activations while the process does not grow
    by them (the meta device holds shapes only)."""
    cfg = tiny_config(tmp_path, size=256, data=False, space="wavelet", wavelet_levels=1)
    rss = peak_rss_bytes()
    estimate = memory.estimate_step(cfg, 1, flops=False)
    assert estimate.step_peak_bytes > 2 * 2**30
    assert peak_rss_bytes() - rss < 0.5 * estimate.step_peak_bytes


@pytest.mark.parametrize(
    "name, size, card_gib", [("whole_head_128", 128, 16), ("whole_head_128", 256, 40), ("brats_192", None, 24)]
)
def test_shipped_configs_fit_their_cards(name, size, card_gib):
    """The targets the configs are chosen by (docs/performance.md, "Memory and FLOPs per size"): one
    training sample of whole_head_128 in its wavelet space fits 16 GB at 128³ and 40 GB at 256³, and
    brats_192 (4 modalities, 192×192×160) fits 24 GB, with the planner's headroom for the allocator."""
    cfg = C.load(configs.find(name))
    if size is not None:
        cfg.data.image_size = [size] * 3
    estimate = memory.estimate_step(cfg, 1, flops=False)
    assert estimate.total_bytes <= memory.GPU_HEADROOM * card_gib * 2**30
