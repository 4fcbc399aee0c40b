"""The objectives: Gaussian diffusion (eps / v / x0) and rectified flow, their losses and samplers.

``make_diffusion(cfg)`` picks one (``prediction: flow`` is rectified flow, the rest Gaussian diffusion).
Both share the training contract below, classifier-free guidance, condition dropout and the sampling loop.

Training draws each sample's timestep and noise from a generator seeded by ``(seed, k)``, where k is the
sample's position in the run's stream, so splitting an effective batch into micro-batches or processes
does not change them. The loss returns one value per sample; the trainer decides how to reduce it.

Sampling is one loop (``_Objective.sample``) around a sampler's ``step()``, as diffusers' and MONAI's
schedulers are: the loop owns the start noise, the model call under guidance and autocast, the conversion
of the model's output (where ``clip_x0`` applies: ``clamp``, from the space, brings a predicted x0 into
range; in wavelet space on the decoded image, as WDM-3D does), the progress bar and the callback; a step
only moves x.
``SAMPLERS`` is the one registry (name → step class, objective, default steps); everything else derives
from it. Samplers (all batched):
  ddim     DDIM on an evenly strided subset of the training steps, eta configurable (0: deterministic)
  ddpm     ancestral sampling with the true posterior variance; with fewer steps than training it is
           DDIM with eta=1 on the strided subset, whose variance is correct for that subset
  dpmpp2m  DPM-Solver++(2M), second-order multistep in log-SNR, deterministic, on steps evenly spaced
           in log-SNR
  euler    rectified flow, one evaluation per step
  heun     rectified flow, 2nd order, 2 evaluations per step but the last
  euler_a  rectified flow, ancestral: fresh noise each step (DDPM's posterior on the flow path), one evaluation

Rectified flow (Liu et al. 2022; Esser et al. 2024): x_t = (1 - t) x0 + t eps on t in [0, 1], the model
predicts the velocity v = eps - x0, training times are logit-normal and shifted toward noise for volumes
larger than 32³ (MONAI RFlowScheduler's timestep_transform); its samplers run on the same shifted grid.

Classifier-free guidance (Ho & Salimans 2022): with ``cond_drop_prob`` p, training replaces the condition of
sample k by the null condition (zeros: never a valid one-hot in {-1, 1}) when u(seed, k) < p; sampling
with ``guidance_scale`` w evaluates both and uses uncond + w · (cond - uncond). w = 1 is the plain
conditional model (one evaluation per step).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .seeding import SALT_COND_DROP, SALT_NOISE, SALT_SAMPLING, derive_seed
from .space import make_space

if TYPE_CHECKING:  # config imports this module (its sampler check reads SAMPLERS)
    from .config import Config

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
Clamp = Callable[[torch.Tensor], torch.Tensor]  # a predicted x0 -> the nearest valid one (clip_x0)
ErrorWeight = Callable[[torch.Tensor], torch.Tensor | None]  # a batch -> per-channel weights of its error
Noise = Callable[[Sequence[int]], torch.Tensor]  # size -> Gaussian noise on the sampling device

FLOW_TIME_SCALE = 1000.0  # flow time t in [0, 1] reaches the UNet's sinusoidal embedding as t * 1000
X0_MIN_T = 0.05  # flow_output x0: the velocity loss's 1 / t is taken with t at least this (JiT's clamp)


def unit_clamp(x0: torch.Tensor) -> torch.Tensor:
    """clip_x0 where the model works on the image itself: every value into [-1, 1]."""
    return x0.clamp(-1, 1)


def no_error_weight(x: torch.Tensor) -> None:
    """Every channel's error counts alike (the image's own voxels)."""
    return None


def make_betas(schedule: str, timesteps: int) -> torch.Tensor:
    """Betas in float64: cosine (Nichol & Dhariwal 2021, s=0.008) or linear (Ho et al. 2020, scaled)."""
    if schedule == "cosine":
        s = 0.008
        x = torch.linspace(0, timesteps, timesteps + 1, dtype=torch.float64)
        f = torch.cos(((x / timesteps) + s) / (1 + s) * math.pi / 2) ** 2
        alphas_cumprod = f / f[0]
        betas = 1 - (alphas_cumprod[1:] / alphas_cumprod[:-1])
        return betas.clamp(0, 0.999)
    if schedule == "linear":
        scale = 1000 / timesteps
        return torch.linspace(scale * 1e-4, scale * 0.02, timesteps, dtype=torch.float64)
    raise ValueError(f"unknown schedule {schedule!r}")


class _Objective:
    """What both objectives share: condition dropout for training; for sampling the seeded noise, guidance
    and the one loop around a sampler's steps."""

    objective: str  # "gaussian" or "flow": which samplers of the registry fit
    timesteps: int
    seed: int
    cond_drop_prob: float
    loss_type: str

    def drop_flags(self, sample_ids: Sequence[int]) -> torch.Tensor:
        """True where sample k's condition is dropped: u(seed, k) < cond_drop_prob, split-invariant."""
        flags = []
        for k in sample_ids:
            g = torch.Generator().manual_seed(derive_seed(self.seed, SALT_COND_DROP, int(k)))
            flags.append(bool(torch.rand(1, generator=g).item() < self.cond_drop_prob))
        return torch.tensor(flags, dtype=torch.bool)

    def training_cond(self, cond: torch.Tensor | None, sample_ids: Sequence[int]) -> torch.Tensor | None:
        if cond is None or self.cond_drop_prob <= 0:
            return cond
        keep = (~self.drop_flags(sample_ids)).to(cond.device, cond.dtype)
        return cond * keep.view(-1, *([1] * (cond.dim() - 1)))

    def loss(
        self,
        model: Denoiser,
        x0: torch.Tensor,
        cond: torch.Tensor | None,
        sample_ids: Sequence[int],
        autocast: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """Per-sample loss, shape [B], fp32: t and noise of sample k from (seed, k) on the CPU, the objective's
        network time, target and weight. ``autocast`` (a context factory) wraps only the model call."""
        t, noise = self.draw(sample_ids, x0.shape[1:])
        t = t.to(x0.device, non_blocking=True)
        noise = noise.to(x0.device, non_blocking=True)
        x_t = self.q_sample(x0, t, noise)
        cond = self.training_cond(cond, sample_ids)
        loss = self.regression_loss(model, x_t, self.net_time(t), cond, self.target(x0.float(), t, noise), autocast)
        weight = self.loss_weight(t, x0.device)
        return loss if weight is None else loss * weight

    def loss_weight(self, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        return None

    def regression_loss(
        self,
        model: Denoiser,
        x_t: torch.Tensor,
        net_t: torch.Tensor,
        cond: torch.Tensor | None,
        target: torch.Tensor,
        autocast: Callable[[], object] | None,
    ) -> torch.Tensor:
        """Per-sample mean L1 / L2 between the model output and ``target``; autocast wraps the model alone."""
        if autocast is None:
            out = model(x_t, net_t, cond)
        else:
            with autocast():
                out = model(x_t, net_t, cond)
        diff = out.float() - target
        per_voxel = diff.abs() if self.loss_type == "l1" else diff.square()
        weight = self.error_weight(per_voxel)  # the space's: wavelet counts each band's error in image units
        if weight is not None:
            per_voxel = per_voxel * (weight if self.loss_type == "l2" else weight.sqrt())
        return per_voxel.flatten(1).mean(1)

    @property
    def samplers(self) -> tuple[str, ...]:
        return samplers_of(self.objective)

    def check_sampler(self, sampler: str) -> None:
        if sampler not in self.samplers:
            raise ValueError(
                f"unknown sampler {sampler!r} for {type(self).__name__} (choose from {', '.join(self.samplers)})"
            )

    def default_steps(self, sampler: str, configured: int | None = None) -> int:
        """The step count of ``sampler`` when the caller names none: ddpm runs every training timestep, the
        others the configured number, else their default in ``SAMPLERS``."""
        self.check_sampler(sampler)
        default = SAMPLERS[sampler].default_steps
        if default is None:
            return self.timesteps
        return int(configured or default)

    def plan(self, sampler: str, steps: int | None = None, eta: float = 0.0, noise: Noise | None = None) -> SamplerStep:
        """A fresh step object of ``sampler`` for one run of ``steps`` (None: its default); it holds the
        run's evaluation times and any state kept between steps."""
        self.check_sampler(sampler)
        return SAMPLERS[sampler].step(self, steps or self.default_steps(sampler), eta, noise)

    def evaluations(self, sampler: str, steps: int | None) -> int:
        """Model evaluations of one sampling run (each one batched over cond and null under guidance)."""
        return len(self.plan(sampler, steps).times)

    def predict(self, model: Denoiser, x: torch.Tensor, t: Any, cond: torch.Tensor | None) -> Any:
        """What the objective's steps consume, from one call of ``model`` at time ``t`` of a step's times."""
        raise NotImplementedError

    @staticmethod
    def guided(
        model: Denoiser, guidance_scale: float, autocast: Callable[[], object] | None
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """The model output under classifier-free guidance; one batched evaluation of cond and null."""

        def call(x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
            if autocast is None:
                return model(x, t, cond)
            with autocast():
                return model(x, t, cond)

        def predict(x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
            if cond is None or guidance_scale == 1.0:
                return call(x, t, cond).float()
            both = call(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, torch.zeros_like(cond)])).float()
            c, u = both.chunk(2)
            return u + guidance_scale * (c - u)

        return predict

    @staticmethod
    def noise_source(seeds: Sequence[int] | None, seed: int, device: torch.device) -> Noise:
        """Gaussian noise drawn on the CPU (the same numbers on every device); with ``seeds`` one generator
        per volume, so a volume does not depend on its batch mates."""
        gens = [torch.Generator().manual_seed(derive_seed(s, SALT_SAMPLING)) for s in (seeds or [seed])]

        def noise(size: Sequence[int]) -> torch.Tensor:
            if seeds is None:
                return torch.randn(tuple(size), generator=gens[0]).to(device)
            return torch.stack([torch.randn(tuple(size[1:]), generator=g) for g in gens]).to(device)

        return noise

    @torch.no_grad()
    def sample(
        self,
        model: Denoiser,
        shape: Sequence[int],
        cond: torch.Tensor | None = None,
        sampler: str | None = None,
        steps: int | None = None,
        eta: float = 0.0,
        seed: int = 0,
        device: torch.device | str = "cpu",
        autocast: Callable[[], object] | None = None,
        progress: bool = False,
        seeds: Sequence[int] | None = None,
        on_step: Callable[[], None] | None = None,
        guidance_scale: float = 1.0,
    ) -> torch.Tensor:
        """Generate a batch of ``shape`` (B, C, *spatial: whatever the model works on) from pure noise with
        ``sampler`` (default: the objective's first in ``SAMPLERS``). A fixed seed reproduces the result.

        The one loop of every sampler: per entry of the sampler's ``times`` it calls the model once (under
        guidance and autocast), converts the output (``predict``: clip_x0 applies there, never in a step) and
        lets ``step`` move x. With ``seeds`` (one per volume) volume b draws its noise as a batch of one with
        seed=seeds[b] would, so a volume does not depend on its batch mates. Noise is drawn on the CPU: the
        same numbers on every device. ``eta``: DDIM's stochasticity (ddpm is eta 1; the other samplers are
        deterministic and ignore it). ``on_step`` is called once per model evaluation.
        """
        device = torch.device(device)
        sampler = sampler or self.samplers[0]
        noise = self.noise_source(seeds, seed, device)
        run = self.plan(sampler, steps, eta, noise)
        guided = self.guided(model, guidance_scale, autocast)
        x = noise(shape)
        bar = tqdm(total=len(run.times), desc=f"sampling ({sampler})", disable=not progress, leave=False)
        for i, t in enumerate(run.times):
            x = run.step(i, x, self.predict(guided, x, t, cond))
            bar.update(1)
            if on_step is not None:
                on_step()
        bar.close()
        return x


class GaussianDiffusion(_Objective):
    objective = "gaussian"

    def __init__(
        self,
        timesteps: int = 250,
        schedule: str = "cosine",
        prediction: str = "eps",
        loss: str = "l1",
        min_snr_gamma: float | None = None,
        clip_x0: bool = True,
        seed: int = 0,
        cond_drop_prob: float = 0.0,
        clamp: Clamp = unit_clamp,
        error_weight: ErrorWeight = no_error_weight,
    ) -> None:
        if prediction not in ("eps", "v", "x0"):
            raise ValueError(f"unknown prediction type {prediction!r}")
        if loss not in ("l1", "l2"):
            raise ValueError(f"unknown loss {loss!r}")
        self.timesteps = timesteps
        self.prediction = prediction
        self.loss_type = loss
        self.min_snr_gamma = min_snr_gamma
        self.clip_x0 = clip_x0
        self.clamp = clamp
        self.error_weight = error_weight
        self.seed = seed
        self.cond_drop_prob = cond_drop_prob
        betas = make_betas(schedule, timesteps)
        alphas_cumprod = torch.cumprod(1 - betas, dim=0)
        # float64 for derived quantities, fp32 tensors for use: noising never follows the input's dtype.
        self.betas = betas.float()
        self.alphas_cumprod = alphas_cumprod.float()
        self.sqrt_ac = alphas_cumprod.sqrt().float()
        self.sqrt_1m_ac = (1 - alphas_cumprod).sqrt().float()
        self.snr = (alphas_cumprod / (1 - alphas_cumprod)).float()

    @classmethod
    def from_config(cls, cfg: Config) -> GaussianDiffusion:
        d = cfg.diffusion
        space = make_space(cfg)
        return cls(
            d.timesteps,
            d.schedule,
            d.prediction,
            d.loss,
            d.min_snr_gamma,
            d.clip_x0,
            cfg.train.seed,
            d.cond_drop_prob,
            clamp=space.clamp,
            error_weight=space.error_weight,
        )

    # ---- noising and conversions (all fp32) -------------------------------------------------------
    def _coef(self, table: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return table.to(like.device)[t].view(-1, *([1] * (like.dim() - 1)))

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        x0, noise = x0.float(), noise.float()
        return self._coef(self.sqrt_ac, t, x0) * x0 + self._coef(self.sqrt_1m_ac, t, x0) * noise

    def target(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        if self.prediction == "eps":
            return noise
        if self.prediction == "x0":
            return x0
        return self._coef(self.sqrt_ac, t, x0) * noise - self._coef(self.sqrt_1m_ac, t, x0) * x0

    def to_x0_eps(self, x_t: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Model output (eps, x0 or v) -> (x0, eps) at timestep t."""
        a, s = self._coef(self.sqrt_ac, t, x_t), self._coef(self.sqrt_1m_ac, t, x_t)
        out = out.float()
        if self.prediction == "eps":
            x0 = (x_t - s * out) / a
        elif self.prediction == "x0":
            x0 = out
        else:
            x0 = a * x_t - s * out
        if self.clip_x0:
            x0 = self.clamp(x0)
        eps = (x_t - a * x0) / s
        return x0, eps

    # ---- training ---------------------------------------------------------------------------------
    def draw(self, sample_ids: Sequence[int], shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Timestep and noise of each sample, from a CPU generator seeded by (seed, k): device-independent."""
        ts, noises = [], []
        for k in sample_ids:
            g = torch.Generator().manual_seed(derive_seed(self.seed, SALT_NOISE, int(k)))
            ts.append(torch.randint(0, self.timesteps, (1,), generator=g))
            noises.append(torch.randn(tuple(shape), generator=g))
        return torch.cat(ts), torch.stack(noises)

    def net_time(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def loss_weight(self, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """min-SNR-gamma (Hang et al. 2023) per sample, or None."""
        if self.min_snr_gamma is None:
            return None
        snr = self.snr.to(device)[t]
        clipped = snr.clamp(max=self.min_snr_gamma)
        return {"eps": clipped / snr, "v": clipped / (snr + 1), "x0": clipped}[self.prediction]

    # ---- sampling ---------------------------------------------------------------------------------
    def sampling_timesteps(self, steps: int, spacing: str = "uniform") -> list[int]:
        """``steps`` distinct training timesteps, descending, from T-1 (pure noise) to 0.

        ``uniform`` strides evenly in t (DDIM's choice). ``logsnr`` strides evenly in the half log-SNR
        lambda, the variable DPM-Solver integrates in, so its second-order extrapolation sees equal steps.
        Evenly in t, the cosine schedule makes the first steps huge in lambda and the solver overshoots
        the data's spread (oracle test: std +24 % at 10 steps, within 2 % in lambda). T-1 is always the
        first step and lambda is spaced from T-2 on: the 0.999 beta clamp puts lambda(T-1) far below the
        rest, and spacing from there would spend several steps on pure noise.
        """
        steps = max(1, min(int(steps), self.timesteps))
        if spacing == "uniform":
            return np.linspace(self.timesteps - 1, 0, steps).round().astype(int).tolist()
        if spacing != "logsnr":
            raise ValueError(f"unknown timestep spacing {spacing!r}")
        if steps == 1:
            return [self.timesteps - 1]
        lam = 0.5 * np.log(self.snr.double().numpy())  # decreasing in t
        targets = np.linspace(lam[max(self.timesteps - 2, 0)], lam[0], steps - 1)
        nearest = np.abs(lam[None, :] - targets[:, None]).argmin(1)
        return _distinct_descending(np.append(nearest, self.timesteps - 1), self.timesteps)

    def visited_timesteps(self, sampler: str, steps: int | None) -> list[int]:
        """The timesteps a sampler evaluates the model at (ddpm: all training steps unless told fewer)."""
        return self.plan(sampler, steps).times

    def predict(
        self, model: Denoiser, x: torch.Tensor, t: int, cond: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x0, eps) at training timestep t from one model call; x0 clipped to [-1, 1] when clip_x0."""
        tt = torch.full((x.shape[0],), t, device=x.device, dtype=torch.long)
        return self.to_x0_eps(x, tt, model(x, tt, cond))


def shift_time(t: torch.Tensor | float, shift: float):
    """Resolution-dependent time shift (MONAI's timestep_transform, Esser et al. 2024): shift > 1 moves
    times toward noise, which larger volumes need since their images survive more noise."""
    return shift * t / (1 + (shift - 1) * t)


def resolution_shift(image_size: Sequence[int], base: int = 32**3) -> float:
    """MONAI's default: the cube root of the voxel count relative to 32³ (1 at 32³, 4 at 128³)."""
    return float((math.prod(int(s) for s in image_size) / base) ** (1 / 3))


class RectifiedFlow(_Objective):
    """Flow matching on the straight path x_t = (1 - t) x0 + t eps; the model predicts v = eps - x0, or, with
    ``output`` x0, x0 itself (x-prediction, Li & He 2025, "Back to Basics": a network narrower than the values
    it outputs per voxel, as in wavelet space, fits the data's low-dimensional x0 better than the noisy v)."""

    objective = "flow"
    timesteps = int(FLOW_TIME_SCALE)  # the range of times the network sees

    def __init__(
        self,
        shift: float = 1.0,
        loss: str = "l2",
        time_sampling: str = "logit_normal",
        clip_x0: bool = True,
        seed: int = 0,
        cond_drop_prob: float = 0.0,
        clamp: Clamp = unit_clamp,
        error_weight: ErrorWeight = no_error_weight,
        output: str = "velocity",
        x0_min_t: float = X0_MIN_T,
        sampling_shift: float | None = None,
    ) -> None:
        if loss not in ("l1", "l2"):
            raise ValueError(f"unknown loss {loss!r}")
        if output not in ("velocity", "x0"):
            raise ValueError(f"unknown flow output {output!r}")
        if time_sampling not in ("logit_normal", "uniform"):
            raise ValueError(f"unknown time sampling {time_sampling!r}")
        if shift <= 0 or (sampling_shift is not None and sampling_shift <= 0):
            raise ValueError(f"flow shift must be positive, got {shift} (sampling: {sampling_shift})")
        if not 0.0 < x0_min_t <= 1.0:
            raise ValueError(f"x0_min_t must be in (0, 1], got {x0_min_t}")
        self.shift = float(shift)
        self.sampling_shift = self.shift if sampling_shift is None else float(sampling_shift)
        self.x0_min_t = float(x0_min_t)
        self.loss_type = loss
        self.time_sampling = time_sampling
        self.clip_x0 = clip_x0
        self.clamp = clamp
        self.error_weight = error_weight
        self.seed = seed
        self.cond_drop_prob = cond_drop_prob
        self.output = output
        self.prediction = "flow"

    @classmethod
    def from_config(cls, cfg: Config) -> RectifiedFlow:
        d = cfg.diffusion
        shift = d.flow_shift if d.flow_shift is not None else resolution_shift(cfg.data.image_size)
        space = make_space(cfg)
        return cls(
            shift,
            d.loss,
            d.flow_time_sampling,
            d.clip_x0,
            cfg.train.seed,
            d.cond_drop_prob,
            clamp=space.clamp,
            error_weight=space.error_weight,
            output=d.flow_output,
            x0_min_t=d.flow_x0_min_t,
            sampling_shift=d.sampling_shift,
        )

    # ---- training ---------------------------------------------------------------------------------
    def draw(self, sample_ids: Sequence[int], shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Time in (0, 1) and noise of each sample, from a CPU generator seeded by (seed, k)."""
        ts, noises = [], []
        for k in sample_ids:
            g = torch.Generator().manual_seed(derive_seed(self.seed, SALT_NOISE, int(k)))
            if self.time_sampling == "logit_normal":
                u = torch.sigmoid(torch.randn(1, generator=g, dtype=torch.float64))
            else:
                u = torch.rand(1, generator=g, dtype=torch.float64)
            ts.append(shift_time(u, self.shift))
            noises.append(torch.randn(tuple(shape), generator=g))
        return torch.cat(ts).float(), torch.stack(noises)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        t = t.float().view(-1, *([1] * (x0.dim() - 1)))
        return (1 - t) * x0.float() + t * noise.float()

    def net_time(self, t: torch.Tensor) -> torch.Tensor:
        return t * FLOW_TIME_SCALE

    def target(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        if self.output == "x0":
            return x0.float()
        return noise.float() - x0.float()

    def loss_weight(self, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """x-prediction's loss is the velocity's: v - v_hat = (x0_hat - x0) / t, so the x0 error is weighted
        1 / t² (L2) or 1 / t (L1), with t at least ``x0_min_t`` (JiT, Li & He 2025: X0_MIN_T) so that t → 0 stays
        finite; a larger floor weights the near-clean times less."""
        if self.output != "x0":
            return None
        inv = 1.0 / t.float().clamp(min=self.x0_min_t).to(device)
        return inv.square() if self.loss_type == "l2" else inv

    # ---- sampling ---------------------------------------------------------------------------------
    def time_grid(self, steps: int) -> list[float]:
        """steps + 1 times from 1 (noise) to 0 (data), evenly spaced before the sampling shift (the training's
        unless ``sampling_shift`` was given)."""
        steps = max(1, int(steps))
        return [float(shift_time(1 - i / steps, self.sampling_shift)) for i in range(steps + 1)]

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: float) -> torch.Tensor:
        """The model's velocity, with its implied x0 clamped into range when clip_x0 (eps kept). An x0 output
        gives v = (x_t - x0) / t: the samplers never evaluate at t = 0."""
        if self.output == "x0":
            x0 = self.clamp(out.float()) if self.clip_x0 else out.float()
            return (x_t - x0) / t
        if not self.clip_x0:
            return out
        x0 = self.clamp(x_t - t * out)
        eps = x_t + (1 - t) * out
        return eps - x0

    def predict(self, model: Denoiser, x: torch.Tensor, t: float, cond: torch.Tensor | None) -> torch.Tensor:
        """The velocity at time t from one model call (which sees t * FLOW_TIME_SCALE)."""
        tt = torch.full((x.shape[0],), t * FLOW_TIME_SCALE, device=x.device, dtype=torch.float32)
        return self.velocity(model(x, tt, cond), x, t)


# ---- samplers: a step class each, one registry ----------------------------------------------------------
class SamplerStep:
    """One sampling run of a sampler, as a diffusers/MONAI scheduler: ``times`` lists the time of each model
    evaluation in order, ``step(i, x, prediction)`` returns x after evaluation i. A step never calls the
    model, draws the start or clips; what it keeps between evaluations (DPM-Solver++'s previous x0, Heun's
    predictor) lives on the instance, so each run builds a fresh one (``_Objective.plan``)."""

    times: list  # Gaussian: training timesteps (int); flow: times in [0, 1]

    def __init__(self, objective: Any, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        self.eta = eta
        self.noise = noise  # the run's seeded noise, for stochastic steps

    def step(self, i: int, x: torch.Tensor, prediction: Any) -> torch.Tensor:
        raise NotImplementedError


class _GaussianStep(SamplerStep):
    """Steps on ``steps`` training timesteps; ``prediction`` is (x0, eps) from ``GaussianDiffusion.predict``."""

    spacing = "uniform"

    def __init__(self, diffusion: GaussianDiffusion, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        super().__init__(diffusion, steps, eta, noise)
        self.times = diffusion.sampling_timesteps(steps, self.spacing)
        ac = diffusion.alphas_cumprod.double()
        # alpha_cumprod at each evaluation, then 1.0: the clean end after the last one
        self.alphas = [float(ac[t]) for t in self.times] + [1.0]


class DDIMStep(_GaussianStep):
    """DDIM (Song et al. 2021): eta 0 deterministic, eta 1 ancestral with the strided subset's variance."""

    def step(self, i: int, x: torch.Tensor, prediction: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x0, eps = prediction
        a_t, a_n = self.alphas[i], self.alphas[i + 1]
        last = i + 1 == len(self.times)
        sigma = 0.0 if last else self.eta * math.sqrt((1 - a_n) / (1 - a_t) * (1 - a_t / a_n))
        x = math.sqrt(a_n) * x0 + math.sqrt(max(1 - a_n - sigma**2, 0.0)) * eps
        if sigma > 0:
            x = x + sigma * self.noise(x.shape)
        return x


class DDPMStep(DDIMStep):
    """Ancestral sampling: DDIM with eta 1, whatever eta the caller gives."""

    def __init__(self, diffusion: GaussianDiffusion, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        super().__init__(diffusion, steps, 1.0, noise)


class DPMSolverStep(_GaussianStep):
    """DPM-Solver++(2M) (Lu et al. 2022): second-order multistep in the half log-SNR lambda, on steps evenly
    spaced in lambda; the first step and the one to the clean end are first order."""

    spacing = "logsnr"

    def __init__(self, diffusion: GaussianDiffusion, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        super().__init__(diffusion, steps, eta, noise)
        self.prev_x0: torch.Tensor | None = None
        self.prev_h: float | None = None

    def step(self, i: int, x: torch.Tensor, prediction: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x0, _ = prediction
        a_t, a_n = self.alphas[i], self.alphas[i + 1]
        if a_n >= 1.0:
            return x0
        alpha_t, sigma_t = math.sqrt(a_t), math.sqrt(1 - a_t)
        alpha_n, sigma_n = math.sqrt(a_n), math.sqrt(1 - a_n)
        h = math.log(alpha_n / sigma_n) - math.log(alpha_t / sigma_t)
        d = x0
        if self.prev_x0 is not None and self.prev_h is not None:
            r = self.prev_h / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * self.prev_x0
        self.prev_x0, self.prev_h = x0, h
        return (sigma_n / sigma_t) * x - alpha_n * math.expm1(-h) * d


class EulerStep(SamplerStep):
    """Euler on dx/dt = v from t = 1 to 0 on the flow's shifted grid; ``prediction`` is the velocity."""

    def __init__(self, flow: RectifiedFlow, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        super().__init__(flow, steps, eta, noise)
        grid = flow.time_grid(steps)
        self.times = grid[:-1]
        self.dt = [t_next - t for t, t_next in itertools.pairwise(grid)]

    def step(self, i: int, x: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        return x + self.dt[i] * prediction


class HeunStep(SamplerStep):
    """Heun (2nd order): an Euler predictor to the step's end, then the mean of the velocities at both ends.
    Predictor and corrector are separate evaluations (as diffusers' HeunDiscreteScheduler), so every step
    but the last, which stays Euler to t = 0, costs two: 2 * steps - 1."""

    def __init__(self, flow: RectifiedFlow, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        super().__init__(flow, steps, eta, noise)
        grid = flow.time_grid(steps)
        self.times: list[float] = []
        self.evals: list[tuple[float, bool]] = []  # per evaluation: its step's dt, and whether it corrects
        for i, (t, t_next) in enumerate(itertools.pairwise(grid)):
            self.times.append(t)
            self.evals.append((t_next - t, False))
            if i + 2 < len(grid):  # every step but the last is corrected at its end, at the Euler guess
                self.times.append(t_next)
                self.evals.append((t_next - t, True))
        self.start: tuple[torch.Tensor, torch.Tensor] | None = None  # x and v where the corrected step began

    def step(self, i: int, x: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        dt, corrects = self.evals[i]
        if corrects:
            x_start, v_start = self.start
            return x_start + dt * 0.5 * (v_start + prediction)
        self.start = (x, prediction)
        return x + dt * prediction


class EulerAncestralStep(SamplerStep):
    """Ancestral sampling on the flow's path x_t = (1 - t) x0 + t eps (DDPM's posterior for alpha = 1 - t,
    sigma = t): each step turns the velocity into (x0, eps) = (x - t v, x + (1 - t) v) and draws
    x' = (1 - t') x0 + sqrt(t'^2 - s^2) eps + s z, s = t' sqrt(1 - ((1 - t) t' / ((1 - t') t))^2).
    The fresh noise z keeps samples of one mask apart where a deterministic sampler regresses to their mean;
    with s = 0 the same step is exactly Euler. One evaluation per step; the step to t = 0 returns x0."""

    def __init__(self, flow: RectifiedFlow, steps: int, eta: float = 0.0, noise: Noise | None = None) -> None:
        super().__init__(flow, steps, 1.0, noise)
        grid = flow.time_grid(steps)
        self.times, self.ends = grid[:-1], grid[1:]

    def step(self, i: int, x: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        t, t_next = self.times[i], self.ends[i]
        x0, eps = x - t * prediction, x + (1 - t) * prediction
        if t_next <= 0:
            return x0
        kept = (1 - t) * t_next / ((1 - t_next) * t)  # 0 at t = 1: the first step keeps no eps
        s = self.eta * t_next * math.sqrt(max(1 - kept**2, 0.0))
        x = (1 - t_next) * x0 + math.sqrt(max(t_next**2 - s**2, 0.0)) * eps
        return x + s * self.noise(x.shape) if s > 0 else x


@dataclass(frozen=True)
class SamplerSpec:
    """A sampler: its step class, the objective it fits and its steps when no caller or config names them."""

    step: type[SamplerStep]
    objective: str  # "gaussian" or "flow" (an _Objective's ``objective``)
    default_steps: int | None  # None: every training timestep


# The one registry of samplers: the objectives' ``samplers``, the config's check of sampler against
# prediction, the commands' choices and the benchmark's default steps all derive from it (the config's
# ``sampler`` Literal is tested to list the same names).
SAMPLERS: dict[str, SamplerSpec] = {
    "ddim": SamplerSpec(DDIMStep, "gaussian", 50),
    "ddpm": SamplerSpec(DDPMStep, "gaussian", None),
    "dpmpp2m": SamplerSpec(DPMSolverStep, "gaussian", 20),
    "euler": SamplerSpec(EulerStep, "flow", 25),
    "heun": SamplerSpec(HeunStep, "flow", 25),
    "euler_a": SamplerSpec(EulerAncestralStep, "flow", 25),
}


def samplers_of(objective: str) -> tuple[str, ...]:
    """The names of the samplers that fit ``objective`` ("gaussian" or "flow"), in registry order."""
    return tuple(name for name, spec in SAMPLERS.items() if spec.objective == objective)


def make_diffusion(cfg: Config) -> GaussianDiffusion | RectifiedFlow:
    """The objective of a config: rectified flow for ``prediction: flow``, Gaussian diffusion otherwise."""
    if cfg.diffusion.prediction == "flow":
        return RectifiedFlow.from_config(cfg)
    return GaussianDiffusion.from_config(cfg)


def _distinct_descending(ts: np.ndarray, timesteps: int) -> list[int]:
    """Nearest-grid timesteps can collide where the grid is coarse in lambda: push collisions apart so
    that exactly len(ts) distinct steps remain, ending at 0 and starting at T-1."""
    ts = np.sort(ts.astype(int))
    ts[0], ts[-1] = 0, timesteps - 1
    for i in range(1, len(ts)):
        ts[i] = max(ts[i], ts[i - 1] + 1)
    ts[-1] = timesteps - 1
    for i in range(len(ts) - 2, -1, -1):
        ts[i] = min(ts[i], ts[i + 1] - 1)
    return ts[::-1].tolist()
