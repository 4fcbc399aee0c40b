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

Without running it (any size, on any machine): ``estimate_step`` builds the same Trainer on the meta
device, where tensors have shapes and dtypes but no storage, and traces its ``accumulate`` under
``LiveBytes`` (restricted to meta storages) and FlopCounterMode. The precision is replayed with CUDA's
autocast rules (``EmulatedAutocast``), attention runs the flash kernel as on a GPU, and activation
checkpointing recomputes as configured. Against the real CPU step (CPU autocast rules) it agrees to the byte
in fp32 and within 0.04 % in bf16 at 16³ (tests/test_memory.py); ``table_row`` turns it into a row of the
memory table (docs/performance.md, "Memory and FLOPs per size").
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from . import config as C
from .optimizer import split_parameters
from .precision import AUTOCAST_DTYPES
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

    With ``device`` (a device type, e.g. ``meta``) only storages on that device count: on the meta device
    nothing is allocated, but every storage still has its size, so a step traced there is measured as the
    device would hold it (the host-side noise and data the step also makes are not device memory).
    """

    def __init__(self, ignore: list[torch.Tensor] | tuple = (), device: str | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.device = device
        self._refs: dict[int, weakref.ref] = {}
        # a storage's identity is its StorageImpl (meta storages all have data_ptr 0)
        self._ignored = {t.untyped_storage()._cdata for t in ignore if t.untyped_storage().nbytes()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.device.type == self.device if self.device else not t.is_meta):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        if key in self._refs or nbytes == 0 or storage._cdata in self._ignored:
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


def synthetic_trainer(
    cfg: C.Config, batch: int, device: torch.device | str = "cpu", accum: int = PLAN_ACCUM
) -> Trainer:
    """The Trainer of ``cfg`` at micro-batch ``batch`` × ``accum``, fed synthetic data: its step is the one
    that trains (precision, activation checkpointing, scaler, EMA, optimizer), without compiling (compiling
    every trial size would take minutes), without data workers and with one process (no DDP buckets, so no
    effective_batch to keep: the trial's batch × accum need not give it)."""
    plan = cfg.override(
        batch_size=batch, gradient_accumulate_every=accum, effective_batch=None, compile=False, num_workers=0
    )
    return Trainer(plan, synthetic_cases(plan), device)


@dataclass
class StepMemory:
    """Bytes of one training step at a micro-batch: ``static`` (weights, EMA, optimizer state) and the
    measured peak of what the step's micro-batches allocate (batch, activations, gradients, temporaries)."""

    batch: int
    static_bytes: int
    step_peak_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.step_peak_bytes


def static_bytes(model: torch.nn.Module, optimizer: str = "adamw") -> int:
    """Weights + EMA copy + the optimizer's state, all fp32 like the parameters (gradients are measured):
    AdamW keeps two moments per parameter; ``muon`` keeps one momentum buffer for each hidden weight
    (``optimizer.split_parameters``) and AdamW's two moments for the rest."""
    param = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    hidden = sum(p.numel() * p.element_size() for p in split_parameters(model)[0]) if optimizer == "muon" else 0
    return 4 * param - hidden + 2 * buffers


def measure_step(trainer: Trainer) -> StepMemory:
    """The live-byte peak of one ``trainer.accumulate()`` (its micro-batches' forward and backward, data
    included), and the static bytes of its model. The gradients are dropped afterwards."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    tracker = LiveBytes(ignore=[*model.parameters(), *model.buffers()])
    with tracker:
        trainer.accumulate()
    model.zero_grad(set_to_none=True)
    return StepMemory(trainer.cfg.train.batch_size, static_bytes(model, trainer.cfg.train.optimizer), tracker.peak)


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
            log.info(
                "memory plan: batch %d %s (peak %.2f GiB)", batch, "fits" if ok else "over the limit", peak / 2**30
            )
            return ok
        except torch.cuda.OutOfMemoryError:
            log.info("memory plan: batch %d runs out of memory", batch)
            return False
        finally:
            trainer = None  # noqa: F841  (the trial's model, EMA, optimizer and activations go before the next)
            gc.collect()
            torch.cuda.empty_cache()

    return fits


def find_max_batch(
    cfg: C.Config, device: torch.device | str, limit_bytes: int | None = None, max_batch: int = 64
) -> int:
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
        method = (
            f"the trainer's measured step memory, {mm.per_sample_bytes / 2**20:.1f} MiB per sample, "
            f"limit {limit / 2**30:.2f} GiB"
        )
    if best < 1:
        raise MemoryPlanError(
            f"image_size {cfg.data.image_size}: not even batch 1 fits on {device} ({method}); try "
            "activation_checkpointing: true, precision bf16/fp16, or a smaller grid"
        )
    log.info("memory plan: largest micro-batch %d on %s (%s)", best, device, method)
    return best


# ---- estimating a step without running it: the trainer's own step traced on the meta device ----------
# FlopCounterMode has no formula for the CPU flash-attention kernel that scaled_dot_product_attention runs
# off CUDA (and that the meta trace below runs): without these, attention would count 0 FLOPs.
_ATEN = torch.ops.aten


def _sdpa_forward_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_backward_flops(grad, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad, q, k, v)


CPU_ATTENTION_FLOPS = {
    _ATEN._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward_flops,
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
}


def flop_counter() -> FlopCounterMode:
    """FlopCounterMode that also counts the CPU (and meta-traced) flash-attention kernel."""
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)


# Autocast's casting rules (torch's autocast_mode.cpp) for the functions MONAI's UNet calls: these run in
# the autocast dtype on CUDA and on the CPU; on CUDA these run in fp32 (norms, upsampling, softmax, exp),
# where the CPU runs them in their input's dtype; every other function runs in its inputs' dtypes.
_LOWER_PRECISION = {
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose3d,
    F.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.baddbmm,
    torch.addmm,
    torch.einsum,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
}
_FP32 = {
    "cuda": {F.group_norm, F.layer_norm, F.interpolate, F.softmax, F.log_softmax, torch.exp, torch.softmax},
    "cpu": set(),
}


class EmulatedAutocast(TorchFunctionMode):
    """Autocast's casts (``rules``: CUDA's or the CPU's), replayed on any device (the meta device has no
    autocast of its own).

    Active inside ``region()`` (what the trainer's autocast factory returns: the model's forward) and in
    the backward pass, where activation checkpointing recomputes blocks under the autocast state of their
    forward. Casts of weights are cached within a region, as autocast caches them, so each weight has one
    half-precision copy per forward. ``scaled_dot_product_attention`` runs the flash kernel (output and
    log-sum-exp saved, no L×L matrix), as SDPA does on CUDA and on the CPU; the meta device's own SDPA
    would take the math path and materialise the attention matrix.
    """

    def __init__(self, dtype: torch.dtype | None, rules: str = "cuda") -> None:
        super().__init__()
        self.dtype = dtype
        self.fp32 = _FP32[rules]
        self.depth = 0
        self.cache: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def region(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.cache.clear()

    def _active(self) -> bool:
        return self.dtype is not None and (self.depth > 0 or torch._C._current_graph_task_id() != -1)

    def _cast(self, value, dtype: torch.dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype):
            return value
        if value.is_leaf and value.requires_grad and self.depth > 0:  # a weight: cached, as autocast does
            key = id(value)
            if key not in self.cache:
                self.cache[key] = value.to(dtype)
            return self.cache[key]
        return value.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        active = self._active()
        if func is F.scaled_dot_product_attention:
            return self._flash_attention(*args, active=active, **kwargs)
        if func is torch.Tensor.backward:
            return self._backward(*args, **kwargs)
        if active and (func in _LOWER_PRECISION or func in self.fp32):
            dtype = self.dtype if func in _LOWER_PRECISION else torch.float32
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _backward(self, loss: torch.Tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """``loss.backward()`` with this mode on: a mode is off while its handler runs, and checkpointing
        recomputes blocks inside the backward. The engine is called directly, as torch.autograd.backward
        does: that function would dispatch back here."""
        if gradient is not None or inputs is not None or create_graph:
            raise NotImplementedError("EmulatedAutocast: only loss.backward() of a scalar loss is traced")
        with self:
            _engine_run_backward(
                (loss,),
                (torch.ones_like(loss),),
                bool(retain_graph),
                False,
                (),
                allow_unreachable=True,
                accumulate_grad=True,
            )

    def _flash_attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, active: bool = False, **_
    ):
        if attn_mask is not None:
            raise NotImplementedError("EmulatedAutocast: attention with a mask is not traced")
        if active:
            query, key, value = (self._cast(t, self.dtype) for t in (query, key, value))
        return _ATEN._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)[
            0
        ]


@dataclass
class StepEstimate(StepMemory):
    """One training step traced on the meta device at micro-batch ``batch``: ``static_bytes`` (weights, EMA,
    optimizer state), ``step_peak_bytes`` (the live-byte peak of the step's micro-batches: batch, activations,
    gradients, temporaries) and ``flops`` (forward + backward of one micro-batch, recomputation included)."""

    flops: int = 0


class _MetaCases(torch.utils.data.Dataset):
    """Training items of the configured shape on the meta device: shapes without memory."""

    def __init__(self, cfg, n: int = 2) -> None:
        size = tuple(cfg.data.image_size)
        self.item = {"image": torch.empty((cfg.image_channels, *size), device="meta")}
        if cfg.model.with_condition:
            self.item["mask"] = torch.zeros((1, *size), dtype=torch.uint8, device="meta")
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.item


def estimate_step(cfg, batch: int, accum: int = PLAN_ACCUM, rules: str = "cuda", flops: bool = True) -> StepEstimate:
    """The memory and FLOPs of the config's training step at micro-batch ``batch``, without running it:
    the Trainer of ``cfg`` is built on the meta device (tensors with shapes and dtypes, no storage, no
    arithmetic) and its ``accumulate`` (space encoding, noising, forward, loss, backward; ``accum``
    micro-batches, so one micro-batch's activations meet the gradients the step holds) runs under the
    live-byte counter, then one micro-batch under FlopCounterMode. The config's precision is replayed with
    CUDA's autocast rules (``EmulatedAutocast``; ``rules="cpu"``: the CPU's, to check against a CPU
    measurement) and its activation checkpointing as configured, so the figure is what a GPU's tensors would
    hold (without the allocator's caching and cuDNN workspaces: see CPU_SAFETY_FRACTION).
    Traces a 256³ step in seconds on a CPU. ``flops=False`` skips the FLOP trace (``flops`` is then 0)."""
    plan = C.from_dict(cfg.to_dict())
    precision = plan.train.precision
    plan.train.precision = "fp32"  # the trace's casts come from EmulatedAutocast
    plan.train.batch_size, plan.train.gradient_accumulate_every = batch, accum
    plan.train.compile, plan.data.num_workers, plan.data.pin_memory = False, 0, False
    with torch.device("meta"):
        trainer = Trainer(plan, _MetaCases(plan), "meta")
    emulation = EmulatedAutocast(AUTOCAST_DTYPES.get(precision), rules)
    trainer.autocast = emulation.region
    model = trainer.model
    tracker = LiveBytes(ignore=[*model.parameters(), *model.buffers()], device="meta")
    # backward on this thread: the autograd engine runs a non-CPU device's backward on a worker thread,
    # where the (thread-local) emulation would not see activation checkpointing's recomputation
    with emulation, tracker, torch.autograd.set_multithreading_enabled(False):
        trainer.accumulate()
    model.zero_grad(set_to_none=True)
    if not flops:
        return StepEstimate(batch, static_bytes(model, plan.train.optimizer), tracker.peak)
    # FLOPs in a trace of their own, of one micro-batch (each costs the same): FlopCounterMode's module hooks
    # keep recomputed activations alive
    plan.train.gradient_accumulate_every = 1  # the trainer's config: accumulate reads it on each call
    counter = flop_counter()
    with emulation, counter, torch.autograd.set_multithreading_enabled(False):
        trainer.accumulate()
    return StepEstimate(batch, static_bytes(model, plan.train.optimizer), tracker.peak, int(counter.get_total_flops()))


def estimate_memory_model(cfg) -> tuple[MemoryModel, int]:
    """The linear memory model (as ``fit_memory_model``) from meta traces at batch 1 and 2, and the FLOPs of
    one sample's forward and backward."""
    one, two = estimate_step(cfg, 1), estimate_step(cfg, 2, flops=False)
    slope = two.step_peak_bytes - one.step_peak_bytes
    return MemoryModel(one.static_bytes, one.step_peak_bytes - slope, slope), one.flops


# ---- the table: memory and FLOPs per size, space, precision and checkpointing ------------------------
GPU_HEADROOM = 0.9  # of a card's memory, left to tensors: the CUDA context, allocator caching, cuDNN workspaces


@dataclass
class TableRow:
    """One configuration of the table: its grid and channels as run, space, precision, checkpointing, the
    traced bytes of one micro-batch of 1 (static + step peak), the bytes each further sample adds, the
    FLOPs of one sample's forward and backward, and the largest micro-batch per card (GiB)."""

    image_size: list[int]
    image_channels: int
    space: str
    precision: str
    checkpointing: bool
    static_gb: float
    step_gb: float
    per_sample_gb: float
    tflops_per_sample: float
    largest_batch: dict[int, int]

    @property
    def total_gb(self) -> float:
        return self.static_gb + self.step_gb


def grid_multiple(cfg) -> int:
    """What every side of the image must be divisible by: the UNet's 2^(levels-1) × the space's 2^levels."""
    factor = 2 ** (len(cfg.model.channels) - 1)
    return factor * (2**cfg.data.wavelet_levels if cfg.data.space == "wavelet" else 1)


def table_row(
    base,
    image_size: list[int],
    image_channels: int,
    space: str,
    levels: int,
    precision: str,
    checkpointing: bool,
    cards_gb: list[int],
    max_batch: int = 64,
) -> TableRow:
    """Trace ``base``'s model at one table configuration (batch 1 and 2 on the meta device). A side that the
    space and UNet cannot divide is padded up to the next multiple, as ``resize_mode: pad_crop`` would."""
    cfg = C.from_dict(base.to_dict())
    cfg.data.space, cfg.data.wavelet_levels, cfg.data.image_channels = space, levels, image_channels
    cfg.data.image_dir = [f"channel_{c}" for c in range(image_channels)] if image_channels > 1 else "images"
    cfg.train.precision, cfg.model.activation_checkpointing = precision, checkpointing
    multiple = grid_multiple(cfg)
    cfg.data.image_size = [-(-s // multiple) * multiple for s in image_size]
    C.validate(cfg)
    model, flops = estimate_memory_model(cfg)
    gib = 2**30
    return TableRow(
        cfg.data.image_size,
        image_channels,
        space if space == "pixel" else f"wavelet-{levels}",
        precision,
        checkpointing,
        model.static_bytes / gib,
        (model.fixed_bytes + model.per_sample_bytes) / gib,
        model.per_sample_bytes / gib,
        flops / 1e12,
        {card: model.largest_batch(card * gib * GPU_HEADROOM, max_batch) for card in cards_gb},
    )
