"""The Trainer: the step loop and nothing else. Checkpoint I/O, data and logging live in their modules.

One optimizer step = ``accum`` micro-batches of ``batch_size``, each backpropagating
``loss.sum() / batch_size / accum`` (so the accumulated gradient is that of one batch of
batch_size × accum), then once: unscale → clip → optimizer/scaler step → EMA → log → checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import monai
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from . import checkpoint as ckpt
from .config import Config
from .data import SampleStream, build_dataset, make_loader, mask_to_cond, split_cases
from .diffusion import make_diffusion
from .model import build_model
from .monitor import Monitor, peak_rss_gb
from .optimizer import build_optimizer
from .precision import autocast_factory, resolve_precision
from .space import make_space
from .validator import Validator

log = logging.getLogger(__name__)

FP16_BACKOFF_ALLOWANCE = 24  # fp16 may skip this many extra steps while the scaler backs off from 2^16


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps with non-finite loss or gradients."""


def lr_at(step: int, base_lr: float, warmup: int, total: int, kind: str, min_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if kind == "cosine":
        progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
        return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    return base_lr


def ema_decay_at(updates: int, decay: float, warmup: bool) -> float:
    """EMA decay of update number ``updates`` (0-based). With warmup the decay ramps as (1 + n) / (10 + n)
    (TensorFlow's num_updates rule) up to ``decay``: after 100 steps the EMA averages over about the last
    10 % of them instead of still holding the random initialisation, so early checkpoints sample well."""
    if updates == 0:
        return 0.0  # the first update copies the weights (as AveragedModel does)
    return min(decay, (1 + updates) / (10 + updates)) if warmup else decay


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    step_time: float
    data_time: float
    stop: bool = False  # some rank asked to stop; agreed by all ranks in the step's all-reduce


class Trainer:
    def __init__(
        self,
        cfg: Config,
        dataset,
        device: torch.device | str = "cpu",
        results_dir: Path | None = None,
        val_cases: list | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.precision = cfg.train.precision
        self.results_dir = Path(results_dir) if results_dir is not None else None
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        self.val_cases = val_cases or []
        self.autocast = autocast_factory(self.precision, self.device)  # the precision as given: resolved by the caller
        t = cfg.train
        torch.manual_seed(t.seed)  # weight init only; training randomness comes from (seed, k)
        model = build_model(cfg).to(self.device)
        if self.device.type == "cuda":
            model = model.to(memory_format=torch.channels_last_3d)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
        self.model = model
        self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(t.ema_decay), use_buffers=True)
        self.ema.requires_grad_(False).eval()
        self.train_model: torch.nn.Module = model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = DistributedDataParallel(model, device_ids=ids)
        self.forward: Callable = torch.compile(self.train_model) if t.compile else self.train_model
        self.optimizer = build_optimizer(model, t.optimizer, t.lr, t.adam_betas, t.weight_decay, t.muon_lr_ratio)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.diffusion = make_diffusion(cfg)
        self.space = make_space(cfg)  # the diffusion sees encoded images and conditions (pixel: unchanged)
        self.dataset = dataset
        self.stream = SampleStream(len(dataset), t.seed)
        self.step = 0
        self.skipped_steps = 0
        self.nonfinite_run = 0
        self.stop_requested = False
        self._batches: Iterator | None = None
        # validation cases are loaded once, here, and only where samples are written
        validating = self.is_main and self.val_cases and self.results_dir is not None
        self.validator = Validator(cfg, self.val_cases[: t.num_samples], self.device) if validating else None

    # ---- data -------------------------------------------------------------------------------------
    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        if self._batches is None:
            pin = self.cfg.data.pin_memory and self.device.type == "cuda"
            loader = make_loader(
                self.dataset, self.stream, self.cfg.train.batch_size, self.cfg, pin, self.rank, self.world_size
            )
            self._batches = iter(loader)
        batch = next(self._batches)
        x0 = self.space.encode(batch["image"].to(self.device, non_blocking=True))
        cond = None
        if self.cfg.model.with_condition:
            mask = batch["mask"].to(self.device, non_blocking=True)
            cond = self.space.cond(mask_to_cond(mask, self.cfg.data.labels))
        if self.device.type == "cuda":
            x0 = x0.contiguous(memory_format=torch.channels_last_3d)
        return x0, cond, [int(k) for k in batch["sample_id"]]

    # ---- one optimizer step -----------------------------------------------------------------------
    def accumulate(self) -> tuple[torch.Tensor, float]:
        """Forward/backward ``accum`` micro-batches; returns the per-sample losses and the data wait time.

        Each micro-batch backpropagates loss.sum() / batch_size / accum, so the summed gradient is that of
        the mean loss over batch_size × accum samples. No host-device sync happens here.
        """
        t = self.cfg.train
        bs, accum = t.batch_size, t.gradient_accumulate_every
        data_time = 0.0
        losses = []
        for micro in range(accum):
            t0 = time.perf_counter()
            x0, cond, ids = self._next_batch()
            data_time += time.perf_counter() - t0
            last = micro == accum - 1
            sync = contextlib.nullcontext() if last or self.world_size == 1 else self.train_model.no_sync()
            with sync:
                loss = self.diffusion.loss(self.forward, x0, cond, ids, self.autocast)  # [B], fp32
                self.scaler.scale(loss.sum() / (bs * accum)).backward()
            losses.append(loss.detach())
        self.stream.samples_seen += bs * accum * self.world_size
        return torch.cat(losses), data_time

    def train_step(self) -> StepResult:
        """One optimizer step: lr → accum micro-batches → clip and agree → step → EMA (or skip) → result."""
        lr = self._set_lr()
        start = time.perf_counter()
        losses, data_time = self.accumulate()
        loss, grad_norm, stop = self._clip_and_reduce(losses)  # the one host-device sync of the step
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self._optimizer_step(finite)
        self.step += 1
        if finite:
            self.nonfinite_run = 0
            self._update_ema()
        else:
            self._skip(loss, grad_norm)
        return StepResult(loss, grad_norm, lr, not finite, time.perf_counter() - start, data_time, stop)

    def _set_lr(self) -> float:
        t = self.cfg.train
        lr = lr_at(self.step, t.lr, t.warmup_steps, t.train_num_steps, t.lr_schedule, t.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)  # muon: its hidden-weight group runs at muon_lr_ratio
        return lr

    def _clip_and_reduce(self, losses: torch.Tensor) -> tuple[float, float, bool]:
        """Unscale and clip the gradients; (mean loss, grad norm) averaged over ranks, and whether any rank
        asked to stop. SIGTERM reaches the ranks at different moments; agreeing in this all-reduce makes all
        of them stop after the same step instead of one rank saving and leaving while the others wait."""
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
        mean_loss = losses.mean()
        stop = torch.tensor(float(self.stop_requested), device=mean_loss.device)
        stats = torch.stack([mean_loss, grad_norm.float(), stop])
        if self.world_size > 1:
            torch.distributed.all_reduce(stats)
            stats[:2] /= self.world_size
        loss, norm, stops = stats.tolist()
        return loss, norm, stops > 0

    def _optimizer_step(self, finite: bool) -> None:
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)  # skips by itself when it found inf/NaN
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _skip(self, loss: float, grad_norm: float) -> None:
        """A step with a non-finite loss or gradient: counted, logged, the EMA left alone; too many in a row stop."""
        self.skipped_steps += 1
        self.nonfinite_run += 1
        fp16 = self.scaler.is_enabled()
        limit = self.cfg.train.max_nonfinite_steps + (FP16_BACKOFF_ALLOWANCE if fp16 else 0)
        if fp16:  # the scaler backing off: expected now and then, not alarming
            log.info(
                "step %d: fp16 gradients overflowed; step skipped, loss scale now %g",
                self.step,
                self.scaler.get_scale(),
            )
        else:
            log.warning(
                "step %d: non-finite loss or gradient (loss %s, grad norm %s); step skipped", self.step, loss, grad_norm
            )
        if self.nonfinite_run >= limit:
            raise NonFiniteError(
                f"{self.nonfinite_run} consecutive steps with non-finite loss or gradients (last at step {self.step}); "
                "stopped, the last good checkpoint is kept. Try a lower lr, bf16 or fp32."
            )

    @torch.no_grad()
    def _update_ema(self) -> None:
        t = self.cfg.train
        if self.step <= t.ema_start_step:
            for e, p in zip(self.ema.module.state_dict().values(), self.model.state_dict().values()):
                e.copy_(p)
        elif self.step % t.ema_update_every == 0:
            updates = (self.step - t.ema_start_step) // t.ema_update_every - 1
            decay = ema_decay_at(updates, t.ema_decay, t.ema_warmup)
            pairs = list(zip(self.ema.module.state_dict().values(), self.model.state_dict().values()))
            floats = [(e, p) for e, p in pairs if e.is_floating_point()]
            torch._foreach_lerp_([e for e, _ in floats], [p for _, p in floats], 1.0 - decay)  # as AveragedModel's EMA
            for e, p in pairs:
                if not e.is_floating_point():
                    e.copy_(p)
            self.ema.n_averaged += 1

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        t = self.cfg.train
        return {
            "format_version": ckpt.FORMAT_VERSION,
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "lr_schedule": {
                "kind": t.lr_schedule,
                "warmup_steps": t.warmup_steps,
                "last_lr": self.optimizer.param_groups[0]["lr"],
            },
            "step": self.step,
            "samples_seen": self.stream.samples_seen,
            "skipped_steps": self.skipped_steps,
            "config": self.cfg.to_dict(),
            "versions": {
                "torch": str(torch.__version__),
                "monai": str(monai.__version__),
                "python": platform.python_version(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.stream.samples_seen = int(state["samples_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._batches = None  # restart the loader at the restored stream position

    def save_checkpoint(self) -> Path | None:
        if not self.is_main or self.results_dir is None:
            return None
        folder = self.results_dir / "checkpoints"
        path = folder / ckpt.checkpoint_name(self.step)
        ckpt.save_atomic(self.state_dict(), path)
        t = self.cfg.train
        ckpt.apply_retention(folder, t.keep_last, t.milestone_every, protect=path)
        return path

    # ---- sampling for monitoring ------------------------------------------------------------------
    def sample_validation(self, monitor: Monitor | None) -> list[Path]:
        if self.validator is None:
            return []
        out_dir = self.results_dir / "samples" / f"step_{self.step:08d}"
        return self.validator.run(self.ema.module, out_dir, self.step, monitor)

    # ---- the loop ---------------------------------------------------------------------------------
    def train(self) -> str:
        """Train to train_num_steps; returns 'finished' or 'interrupted' (a stop was requested)."""
        t = self.cfg.train
        log_dir = self.results_dir / "tb" if (self.results_dir is not None and self.is_main) else None
        monitor = Monitor(
            log_dir,
            t.train_num_steps,
            self.step,
            t.quiet or not self.is_main,
            purge_step=self.step + 1 if self.step > 0 else None,
        )
        if self.step == 0:
            monitor.text("config", "```\n" + self.cfg.to_yaml() + "\n```")
            monitor.hparams({**vars(t), **{f"model.{k}": v for k, v in vars(self.cfg.model).items()}})
        status = "finished"
        try:
            while self.step < t.train_num_steps:
                result = self.train_step()
                self._log(monitor, result)
                if self.step % t.save_every == 0 or self.step == t.train_num_steps:
                    monitor.flush()  # events up to a checkpoint's step are on disk before it exists
                    self.save_checkpoint()
                if self.step % t.sample_every == 0 or self.step == t.train_num_steps:
                    self.sample_validation(monitor)
                if result.stop:
                    if self.step % t.save_every != 0 and self.step != t.train_num_steps:
                        monitor.flush()
                        self.save_checkpoint()
                    status = "interrupted"
                    break
        finally:
            monitor.close()
        return status

    def _log(self, monitor: Monitor, r: StepResult) -> None:
        t = self.cfg.train
        volumes = t.batch_size * t.gradient_accumulate_every * self.world_size
        monitor.progress(
            self.step, {"loss": f"{r.loss:.4f}", "lr": f"{r.lr:.2e}", "vol/s": f"{volumes / r.step_time:.2f}"}
        )
        if self.step % t.log_every != 0:
            return
        values = {
            "train/loss": r.loss,
            "train/lr": r.lr,
            "train/grad_norm": r.grad_norm,
            "train/skipped_steps": float(self.skipped_steps),
            "perf/volumes_per_sec": volumes / r.step_time,
            "perf/step_time": r.step_time,
            "perf/data_wait_fraction": r.data_time / r.step_time,
            "data/epoch": float(self.stream.epoch),
            "data/samples_seen": float(self.stream.samples_seen),
        }
        if self.scaler.is_enabled():
            values["train/loss_scale"] = float(self.scaler.get_scale())
        if self.device.type == "cuda":
            values["mem/gpu_max_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 1024**3
        else:
            values["mem/rss_gb"] = peak_rss_gb()
        monitor.scalars(self.step, values)


def build_trainer(
    cfg: Config, cases: list, device, results: Path | None, rank: int = 0, world_size: int = 1
) -> Trainer:
    """Split the cases, cache the training set, and build the Trainer, in the precision ``device`` runs
    (``resolve_precision``: fp16 off CUDA and bf16 on a CPU that would emulate it train in fp32)."""
    cfg.train.precision = resolve_precision(cfg.train.precision, device)
    train_cases, val_cases = split_cases(cases, cfg.data.num_val_cases)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else (results or Path(".")) / "cache"
    dataset = build_dataset(train_cases, cfg, cache_dir)
    return Trainer(cfg, dataset, device, results, val_cases, rank, world_size)
