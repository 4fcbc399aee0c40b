"""Memory planning: the largest micro-batch that fits, and the accumulation that keeps the effective batch.

Both ways of deciding whether a micro-batch fits run the trainer's own step: a ``Trainer`` of the config
(``synthetic_trainer``) fed seeded synthetic data of the configured shape, with ``PLAN_ACCUM`` micro-batches
per step, so the gradients of one micro-batch are held while the next one's activations are (as in any
run with accumulation; one without it needs less by at most the gradients' size).

* CUDA: try it. One ``Trainer.train_step`` (micro-batches, unscale, clip, optimizer step, EMA) at the
  configured grid, precision and activation checkpointing; ``torch.cuda.OutOfMemoryError`` (or a
  ``max_memory_allocated`` peak over ``limit_bytes``) means no. Batch sizes double until one fails, then a
  binary search finds the boundary.
* Elsewhere (CPU): estimate. ``measure_step`` runs ``Trainer.accumulate`` under a dispatch mode that
  follows every tensor storage the step allocates until it is freed, so its peak of live bytes is the
  step's real batch + activation + gradient + temporary memory (checkpointing's recomputation and early
  frees included), with no allocator or process RSS involved. It is measured at batch 1 and 2; activation
  memory is linear in the batch, so ``fixed + per_sample · b`` plus the weights, EMA and AdamW state gives
  the estimate at any b.

``plan_accumulation`` then splits the requested effective batch into batch_size × accum exactly; by the
trainer's accumulation invariance (each micro-batch backpropagates loss.sum() / batch_size / accum) every
split is the same optimization.
"""

from __future__ import annotations

import gc
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import config as C
from .synthetic import SyntheticDataset
from .trainer import Trainer

log = logging.getLogger(__name__)

# the caching allocator, cuDNN workspaces and fragmentation sit on top of what tensors hold
CPU_SAFETY_FRACTION = 0.9
PLAN_ACCUM = 2  # micro-batches per planning step: the second runs while the first one's gradients are held


class MemoryPlanError(ValueError):
    """No micro-batch fits, or a planning input is invalid; the message says which."""


# ---- pure planning --------------------------------------------------------------------------------
def plan_accumulation(effective_batch: int, max_batch: int) -> tuple[int, int]:
    """(batch_size, accum) with batch_size × accum == effective_batch and batch_size the largest divisor of
    effective_batch that is ≤ max_batch (so the fewest micro-batches that each fit)."""
    if isinstance(effective_batch, bool) or not isinstance(effective_batch, int) or effective_batch < 1:
        raise MemoryPlanError(f"effective_batch: must be a positive integer, got {effective_batch!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise MemoryPlanError(f"max_batch: must be a positive integer, got {max_batch!r}")
    for batch in range(min(effective_batch, max_batch), 0, -1):
        if effective_batch % batch == 0:
            return batch, effective_batch // batch
    raise AssertionError("unreachable: 1 divides every integer")


def search_largest(fits: Callable[[int], bool], max_batch: int) -> int:
    """Largest b in [1, max_batch] with fits(b), assuming fits is monotone (true up to a point, then false).

    Doubles from 1 until a failure or max_batch, then bisects between the last success and the first
    failure: O(log max_batch) trials. Returns 0 when even batch 1 does not fit.
    """
    if max_batch < 1:
        raise MemoryPlanError(f"max_batch: must be at least 1, got {max_batch}")
    good, bad = 0, None
    b = 1
    while True:
        if fits(b):
            good = b
            if b == max_batch:
                return b
            b = min(2 * b, max_batch)
        else:
            bad = b
            break
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


# ---- measuring one step's memory without an allocator -----------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Follows every storage an op returns until it is freed: ``peak`` is the most bytes alive at once.

    Storages that existed before (``ignore``: weights, inputs) are not counted when an op returns a view of
    them. Python keeps one object per storage alive as long as the storage lives, so a weak reference's
    callback marks the moment it is freed, also for tensors only autograd's graph still holds.
    """

    def __init__(self, ignore: list[torch.Tensor] | tuple = ()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self._ignored = {t.untyped_storage().data_ptr() for t in ignore if t.untyped_storage().nbytes()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        if key in self._refs or nbytes == 0 or storage.data_ptr() in self._ignored:
            return

        def freed(_ref, key=key, nbytes=nbytes) -> None:
            self._refs.pop(key, None)
            self.live -= nbytes

        self._refs[key] = weakref.ref(storage, freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def synthetic_cases(cfg: C.Config, n: int = 2, seed: int = 0) -> SyntheticDataset:
    """Training items of ``cfg``'s shape, channels and labels (``synthetic.SyntheticDataset``)."""
    labels = cfg.data.labels if cfg.model.with_condition else None
    return SyntheticDataset(cfg.data.image_size, cfg.image_channels, labels, n, seed)


def synthetic_trainer(cfg: C.Config, batch: int, device: torch.device | str = "cpu",
                      accum: int = PLAN_ACCUM) -> Trainer:
    """The Trainer of ``cfg`` at micro-batch ``batch`` × ``accum``, fed synthetic data: its step is the one
    that trains (precision, activation checkpointing, scaler, EMA, optimizer), without compiling (compiling
    every trial size would take minutes), without data workers and with one process (no DDP buckets, so no
    effective_batch to keep: the trial's batch × accum need not give it)."""
    plan = cfg.override(batch_size=batch, gradient_accumulate_every=accum, effective_batch=None, compile=False,
                        num_workers=0)
    return Trainer(plan, synthetic_cases(plan), device)


@dataclass
class StepMemory:
    """Bytes of one training step at a micro-batch: ``static`` (weights, EMA, AdamW moments) and the
    measured peak of what the step's micro-batches allocate (batch, activations, gradients, temporaries)."""

    batch: int
    static_bytes: int
    step_peak_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.step_peak_bytes


def static_bytes(model: torch.nn.Module) -> int:
    """Weights + EMA copy + AdamW's two moments, all fp32 like the parameters (gradients are measured)."""
    param = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 4 * param + 2 * buffers


def measure_step(trainer: Trainer) -> StepMemory:
    """The live-byte peak of one ``trainer.accumulate()`` (its micro-batches' forward and backward, data
    included), and the static bytes of its model. The gradients are dropped afterwards."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    tracker = LiveBytes(ignore=[*model.parameters(), *model.buffers()])
    with tracker:
        trainer.accumulate()
    model.zero_grad(set_to_none=True)
    return StepMemory(trainer.cfg.train.batch_size, static_bytes(model), tracker.peak)


def step_memory(cfg: C.Config, batch: int, device: torch.device | str = "cpu") -> StepMemory:
    """Measure the trainer's step at ``batch`` with the config's precision and activation checkpointing."""
    return measure_step(synthetic_trainer(cfg, batch, device))


@dataclass
class MemoryModel:
    """total(b) = static + fixed + per_sample · b, fitted from two measured batch sizes."""

    static_bytes: int
    fixed_bytes: float
    per_sample_bytes: float

    def total(self, batch: int) -> float:
        return self.static_bytes + self.fixed_bytes + self.per_sample_bytes * batch

    def largest_batch(self, limit_bytes: float, max_batch: int) -> int:
        if self.per_sample_bytes <= 0:
            return max_batch if self.total(1) <= limit_bytes else 0
        b = math.floor((limit_bytes - self.static_bytes - self.fixed_bytes) / self.per_sample_bytes)
        return max(0, min(b, max_batch))


def fit_memory_model(cfg: C.Config, device: torch.device | str = "cpu") -> MemoryModel:
    one, two = step_memory(cfg, 1, device), step_memory(cfg, 2, device)
    slope = two.step_peak_bytes - one.step_peak_bytes
    return MemoryModel(one.static_bytes, one.step_peak_bytes - slope, slope)


def available_cpu_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere a limit must be given."""
    meminfo = Path("/proc/meminfo")
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise MemoryPlanError(f"{meminfo}: cannot read MemAvailable; pass limit_bytes explicitly")


# ---- CUDA: try it ------------------------------------------------------------------------------------
def _prime_optimizer(trainer: Trainer) -> None:
    """Allocate AdamW's moments now, as every step after the first holds them: a trial step the fp16 scaler
    skips would otherwise never create them. (A zero-gradient step; the trial weights do not matter.)"""
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def _cuda_trial(cfg: C.Config, device: torch.device, limit_bytes: int | None) -> Callable[[int], bool]:
    def fits(batch: int) -> bool:
        trainer = None
        try:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            trainer = synthetic_trainer(cfg, batch, device)
            _prime_optimizer(trainer)
            trainer.train_step()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            ok = limit_bytes is None or peak <= limit_bytes
            log.info("memory plan: batch %d %s (peak %.2f GiB)", batch, "fits" if ok else "over the limit", peak / 2**30)
            return ok
        except torch.cuda.OutOfMemoryError:
            log.info("memory plan: batch %d runs out of memory", batch)
            return False
        finally:
            trainer = None  # noqa: F841  (the trial's model, EMA, optimizer and activations go before the next)
            gc.collect()
            torch.cuda.empty_cache()

    return fits


def find_max_batch(cfg: C.Config, device: torch.device | str, limit_bytes: int | None = None,
                   max_batch: int = 64) -> int:
    """The largest micro-batch (≤ max_batch) whose training step fits, at the config's grid, precision and
    activation checkpointing. Raises MemoryPlanError when batch 1 does not fit."""
    device = torch.device(device)
    if limit_bytes is not None and limit_bytes <= 0:
        raise MemoryPlanError(f"limit_bytes: must be positive, got {limit_bytes}")
    if device.type == "cuda":
        best = search_largest(_cuda_trial(cfg, device, limit_bytes), max_batch)
        method = "trial steps of the trainer on the GPU"
    else:
        limit = limit_bytes if limit_bytes is not None else int(available_cpu_bytes() * CPU_SAFETY_FRACTION)
        mm = fit_memory_model(cfg, device)
        best = mm.largest_batch(limit, max_batch)
        method = f"the trainer's measured step memory, {mm.per_sample_bytes / 2**20:.1f} MiB per sample, limit {limit / 2**30:.2f} GiB"
    if best < 1:
        raise MemoryPlanError(
            f"image_size {cfg.data.image_size}: not even batch 1 fits on {device} ({method}); try "
            "activation_checkpointing: true, precision bf16/fp16, or a smaller grid"
        )
    log.info("memory plan: largest micro-batch %d on %s (%s)", best, device, method)
    return best
