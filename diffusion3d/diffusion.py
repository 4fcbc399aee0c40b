"""The objectives: Gaussian diffusion (eps / v / x0) and rectified flow, their losses and samplers.

``make_diffusion(cfg)`` picks one (``prediction: flow`` is rectified flow, the rest Gaussian diffusion).
Both share the training contract below, classifier-free guidance and condition dropout.

Training draws each sample's timestep and noise from a generator seeded by ``(seed, k)``, where k is the
sample's position in the run's stream, so splitting an effective batch into micro-batches or processes
does not change them. The loss returns one value per sample; the trainer decides how to reduce it.

Samplers (all batched, x0 optionally clipped to [-1, 1]):
  ddim     DDIM on an evenly strided subset of the training steps, eta configurable (0: deterministic)
  ddpm     ancestral sampling with the true posterior variance; with fewer steps than training it is
           DDIM with eta=1 on the strided subset, whose variance is correct for that subset
  dpmpp2m  DPM-Solver++(2M), second-order multistep in log-SNR, deterministic, on steps evenly spaced
           in log-SNR

Rectified flow (Liu et al. 2022; Esser et al. 2024): x_t = (1 - t) x0 + t eps on t in [0, 1], the model
predicts the velocity v = eps - x0, training times are logit-normal and shifted toward noise for volumes
larger than 32³ (MONAI RFlowScheduler's timestep_transform); samplers ``euler`` and ``heun`` (2nd order,
2 evaluations per step but the last) on the same shifted grid.

Classifier-free guidance (Ho & Salimans 2022): with ``cond_drop_prob`` p, training replaces the condition of
sample k by the null condition (zeros: never a valid one-hot in {-1, 1}) when u(seed, k) < p; sampling
with ``guidance_scale`` w evaluates both and uses uncond + w · (cond - uncond). w = 1 is the plain
conditional model (one evaluation per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .seeding import SALT_COND_DROP, SALT_NOISE, SALT_SAMPLING, derive_seed

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

GAUSSIAN_SAMPLERS = ("ddim", "ddpm", "dpmpp2m")
FLOW_SAMPLERS = ("euler", "heun")
SAMPLERS = GAUSSIAN_SAMPLERS + FLOW_SAMPLERS
# The one table of default step counts: a sampler's steps when neither the caller nor a config names them
# (the benchmark's defaults too). None: every training timestep (ddpm always defaults to all of them).
SAMPLER_STEPS: dict[str, int | None] = {"ddim": 50, "ddpm": None, "dpmpp2m": 20, "euler": 25, "heun": 25}
FLOW_TIME_SCALE = 1000.0  # flow time t in [0, 1] reaches the UNet's sinusoidal embedding as t * 1000


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
    """What both objectives share: condition dropout for training, guidance and seeded noise for sampling."""

    seed: int
    cond_drop_prob: float
    loss_type: str
    samplers: tuple[str, ...]

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

    def regression_loss(self, model: Denoiser, x_t: torch.Tensor, net_t: torch.Tensor, cond: torch.Tensor | None,
                        target: torch.Tensor, autocast: Callable[[], object] | None) -> torch.Tensor:
        """Per-sample mean L1 / L2 between the model output and ``target``; autocast wraps the model alone."""
        if autocast is None:
            out = model(x_t, net_t, cond)
        else:
            with autocast():
                out = model(x_t, net_t, cond)
        diff = out.float() - target
        per_voxel = diff.abs() if self.loss_type == "l1" else diff.square()
        return per_voxel.flatten(1).mean(1)

    def check_sampler(self, sampler: str) -> None:
        if sampler not in self.samplers:
            raise ValueError(f"unknown sampler {sampler!r} for {type(self).__name__} (choose from {', '.join(self.samplers)})")

    def default_steps(self, sampler: str, configured: int | None = None) -> int:
        """The step count of ``sampler`` when the caller names none: ddpm runs every training timestep, the
        others the configured number, else their entry in ``SAMPLER_STEPS``."""
        self.check_sampler(sampler)
        default = SAMPLER_STEPS[sampler]
        if default is None:
            return self.timesteps
        return int(configured or default)

    @staticmethod
    def guided(model: Denoiser, guidance_scale: float,
               autocast: Callable[[], object] | None) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
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
    def noise_source(seeds: Sequence[int] | None, seed: int, device: torch.device) -> Callable[[Sequence[int]], torch.Tensor]:
        """Gaussian noise drawn on the CPU (the same numbers on every device); with ``seeds`` one generator
        per volume, so a volume does not depend on its batch mates."""
        gens = [torch.Generator().manual_seed(derive_seed(s, SALT_SAMPLING)) for s in (seeds or [seed])]

        def noise(size: Sequence[int]) -> torch.Tensor:
            if seeds is None:
                return torch.randn(tuple(size), generator=gens[0]).to(device)
            return torch.stack([torch.randn(tuple(size[1:]), generator=g) for g in gens]).to(device)
        return noise


class GaussianDiffusion(_Objective):
    samplers = GAUSSIAN_SAMPLERS

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
    def from_config(cls, cfg) -> "GaussianDiffusion":
        d = cfg.diffusion
        return cls(d.timesteps, d.schedule, d.prediction, d.loss, d.min_snr_gamma, d.clip_x0, cfg.train.seed,
                   d.cond_drop_prob)

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
            x0 = x0.clamp(-1, 1)
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

    def loss(
        self,
        model: Denoiser,
        x0: torch.Tensor,
        cond: torch.Tensor | None,
        sample_ids: Sequence[int],
        autocast: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """Per-sample loss, shape [B], fp32. ``autocast`` (a context factory) wraps only the model call."""
        t, noise = self.draw(sample_ids, x0.shape[1:])
        t = t.to(x0.device, non_blocking=True)
        noise = noise.to(x0.device, non_blocking=True)
        x_t = self.q_sample(x0, t, noise)
        loss = self.regression_loss(model, x_t, t, self.training_cond(cond, sample_ids), self.target(x0.float(), t, noise), autocast)
        if self.min_snr_gamma is not None:
            snr = self.snr.to(x0.device)[t]
            clipped = snr.clamp(max=self.min_snr_gamma)
            weight = {"eps": clipped / snr, "v": clipped / (snr + 1), "x0": clipped}[self.prediction]
            loss = loss * weight
        return loss

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
        self.check_sampler(sampler)
        steps = steps or self.default_steps(sampler)
        return self.sampling_timesteps(steps, "logsnr" if sampler == "dpmpp2m" else "uniform")

    def evaluations(self, sampler: str, steps: int | None) -> int:
        """Model evaluations of one sampling run (each one batched over cond and null under guidance)."""
        return len(self.visited_timesteps(sampler, steps))

    @torch.no_grad()
    def sample(
        self,
        model: Denoiser,
        shape: Sequence[int],
        cond: torch.Tensor | None = None,
        sampler: str = "ddim",
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
        """Generate a batch of shape ``shape`` (B, C, D, H, W). A fixed seed reproduces the result.

        With ``seeds`` (one per volume) volume b draws its noise as a batch of one with seed=seeds[b]
        would, so a volume does not depend on its batch mates. Noise is drawn on the CPU: the same
        numbers on every device. ``on_step`` is called once per model evaluation.
        """
        device = torch.device(device)
        self.check_sampler(sampler)
        noise = self.noise_source(seeds, seed, device)
        guided = self.guided(model, guidance_scale, autocast)

        if sampler == "ddpm":
            eta = 1.0
        ts = self.visited_timesteps(sampler, steps)
        x = noise(shape)

        def predict(x_t: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
            tt = torch.full((x_t.shape[0],), t, device=device, dtype=torch.long)
            return self.to_x0_eps(x_t, tt, guided(x_t, tt, cond))

        ac = self.alphas_cumprod.double()
        bar = tqdm(total=len(ts), desc=f"sampling ({sampler})", disable=not progress, leave=False)
        prev_x0: torch.Tensor | None = None
        prev_h: float | None = None
        for i, t in enumerate(ts):
            t_next = ts[i + 1] if i + 1 < len(ts) else -1
            a_t = float(ac[t])
            a_n = float(ac[t_next]) if t_next >= 0 else 1.0
            x0, eps = predict(x, t)
            if sampler == "dpmpp2m":
                x, prev_x0, prev_h = self._dpmpp2m_step(x, x0, a_t, a_n, prev_x0, prev_h)
            else:
                sigma = eta * math.sqrt((1 - a_n) / (1 - a_t) * (1 - a_t / a_n)) if t_next >= 0 else 0.0
                x = math.sqrt(a_n) * x0 + math.sqrt(max(1 - a_n - sigma**2, 0.0)) * eps
                if sigma > 0:
                    x = x + sigma * noise(x.shape)
            bar.update(1)
            if on_step is not None:
                on_step()
        bar.close()
        return x

    @staticmethod
    def _dpmpp2m_step(
        x: torch.Tensor,
        x0: torch.Tensor,
        a_t: float,
        a_n: float,
        prev_x0: torch.Tensor | None,
        prev_h: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """One DPM-Solver++(2M) step from alpha_cumprod a_t to a_n (a_n = 1: the clean end, first order)."""
        if a_n >= 1.0:
            return x0, x0, None
        alpha_t, sigma_t = math.sqrt(a_t), math.sqrt(1 - a_t)
        alpha_n, sigma_n = math.sqrt(a_n), math.sqrt(1 - a_n)
        h = math.log(alpha_n / sigma_n) - math.log(alpha_t / sigma_t)
        d = x0
        if prev_x0 is not None and prev_h is not None:
            r = prev_h / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * prev_x0
        x = (sigma_n / sigma_t) * x - alpha_n * math.expm1(-h) * d
        return x, x0, h


def shift_time(t: torch.Tensor | float, shift: float):
    """Resolution-dependent time shift (MONAI's timestep_transform, Esser et al. 2024): shift > 1 moves
    times toward noise, which larger volumes need since their images survive more noise."""
    return shift * t / (1 + (shift - 1) * t)


def resolution_shift(image_size: Sequence[int], base: int = 32 ** 3) -> float:
    """MONAI's default: the cube root of the voxel count relative to 32³ (1 at 32³, 4 at 128³)."""
    return float((math.prod(int(s) for s in image_size) / base) ** (1 / 3))


class RectifiedFlow(_Objective):
    """Flow matching on the straight path x_t = (1 - t) x0 + t eps; the model predicts v = eps - x0."""

    samplers = FLOW_SAMPLERS
    timesteps = int(FLOW_TIME_SCALE)  # the range of times the network sees

    def __init__(
        self,
        shift: float = 1.0,
        loss: str = "l2",
        time_sampling: str = "logit_normal",
        clip_x0: bool = True,
        seed: int = 0,
        cond_drop_prob: float = 0.0,
    ) -> None:
        if loss not in ("l1", "l2"):
            raise ValueError(f"unknown loss {loss!r}")
        if time_sampling not in ("logit_normal", "uniform"):
            raise ValueError(f"unknown time sampling {time_sampling!r}")
        if shift <= 0:
            raise ValueError(f"flow shift must be positive, got {shift}")
        self.shift = float(shift)
        self.loss_type = loss
        self.time_sampling = time_sampling
        self.clip_x0 = clip_x0
        self.seed = seed
        self.cond_drop_prob = cond_drop_prob
        self.prediction = "flow"

    @classmethod
    def from_config(cls, cfg) -> "RectifiedFlow":
        d = cfg.diffusion
        shift = d.flow_shift if d.flow_shift is not None else resolution_shift(cfg.data.image_size)
        return cls(shift, d.loss, d.flow_time_sampling, d.clip_x0, cfg.train.seed, d.cond_drop_prob)

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

    def loss(
        self,
        model: Denoiser,
        x0: torch.Tensor,
        cond: torch.Tensor | None,
        sample_ids: Sequence[int],
        autocast: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """Per-sample loss, shape [B], fp32. ``autocast`` (a context factory) wraps only the model call."""
        t, noise = self.draw(sample_ids, x0.shape[1:])
        t = t.to(x0.device, non_blocking=True)
        noise = noise.to(x0.device, non_blocking=True)
        x_t = self.q_sample(x0, t, noise)
        target = noise.float() - x0.float()
        return self.regression_loss(model, x_t, t * FLOW_TIME_SCALE, self.training_cond(cond, sample_ids), target, autocast)

    # ---- sampling ---------------------------------------------------------------------------------
    def time_grid(self, steps: int) -> list[float]:
        """steps + 1 times from 1 (noise) to 0 (data), evenly spaced before the shift."""
        steps = max(1, int(steps))
        return [float(shift_time(1 - i / steps, self.shift)) for i in range(steps + 1)]

    def evaluations(self, sampler: str, steps: int | None) -> int:
        """Euler: one per step; Heun: two per step except the last (Euler to t = 0)."""
        self.check_sampler(sampler)
        steps = max(1, int(steps or self.default_steps(sampler)))
        return steps if sampler == "euler" else 2 * steps - 1

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: float) -> torch.Tensor:
        """The model's velocity, with its implied x0 clipped to [-1, 1] when clip_x0 (eps kept)."""
        if not self.clip_x0:
            return out
        x0 = (x_t - t * out).clamp(-1, 1)
        eps = x_t + (1 - t) * out
        return eps - x0

    @torch.no_grad()
    def sample(
        self,
        model: Denoiser,
        shape: Sequence[int],
        cond: torch.Tensor | None = None,
        sampler: str = "euler",
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
        """Integrate dx/dt = v from t = 1 (noise) to 0; same seeding contract as GaussianDiffusion.sample.
        ``eta`` is accepted for a uniform interface and ignored (the flow ODE is deterministic)."""
        device = torch.device(device)
        self.check_sampler(sampler)
        guided = self.guided(model, guidance_scale, autocast)
        x = self.noise_source(seeds, seed, device)(shape).float()
        grid = self.time_grid(steps or self.default_steps(sampler))
        bar = tqdm(total=self.evaluations(sampler, len(grid) - 1), desc=f"sampling ({sampler})", disable=not progress, leave=False)

        def v_at(x_t: torch.Tensor, t: float) -> torch.Tensor:
            tt = torch.full((x_t.shape[0],), t * FLOW_TIME_SCALE, device=device, dtype=torch.float32)
            v = self.velocity(guided(x_t, tt, cond), x_t, t)
            bar.update(1)
            if on_step is not None:
                on_step()
            return v

        for i in range(len(grid) - 1):
            t, t_next = grid[i], grid[i + 1]
            v = v_at(x, t)
            x_euler = x + (t_next - t) * v
            if sampler == "heun" and i + 1 < len(grid) - 1:
                x = x + (t_next - t) * 0.5 * (v + v_at(x_euler, t_next))
            else:
                x = x_euler
        bar.close()
        return x


def make_diffusion(cfg) -> GaussianDiffusion | RectifiedFlow:
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
