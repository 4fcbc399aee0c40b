"""Gaussian diffusion: one schedule (fp32) shared by training and every sampler.

Training draws each sample's timestep and noise from a generator seeded by ``(seed, k)``, where k is the
sample's position in the run's stream, so splitting an effective batch into micro-batches or processes
does not change them. The loss returns one value per sample; the trainer decides how to reduce it.

Samplers (all batched, x0 optionally clipped to [-1, 1]):
  ddim     DDIM on an evenly strided subset of the training steps, eta configurable (0: deterministic)
  ddpm     ancestral sampling with the true posterior variance; with fewer steps than training it is
           DDIM with eta=1 on the strided subset, whose variance is correct for that subset
  dpmpp2m  DPM-Solver++(2M), second-order multistep in log-SNR, deterministic
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

# Salts that keep the independent random streams of one run apart.
SALT_NOISE = 1
SALT_PERMUTATION = 2
SALT_SAMPLING = 3


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (run seed, purpose, index, ...)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


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


class GaussianDiffusion:
    def __init__(
        self,
        timesteps: int = 250,
        schedule: str = "cosine",
        prediction: str = "eps",
        loss: str = "l1",
        min_snr_gamma: float | None = None,
        clip_x0: bool = True,
        seed: int = 0,
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
        return cls(d.timesteps, d.schedule, d.prediction, d.loss, d.min_snr_gamma, d.clip_x0, cfg.train.seed)

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
        if autocast is None:
            out = model(x_t, t, cond)
        else:
            with autocast():
                out = model(x_t, t, cond)
        diff = out.float() - self.target(x0.float(), t, noise)
        per_voxel = diff.abs() if self.loss_type == "l1" else diff.square()
        loss = per_voxel.flatten(1).mean(1)
        if self.min_snr_gamma is not None:
            snr = self.snr.to(x0.device)[t]
            clipped = snr.clamp(max=self.min_snr_gamma)
            weight = {"eps": clipped / snr, "v": clipped / (snr + 1), "x0": clipped}[self.prediction]
            loss = loss * weight
        return loss

    # ---- sampling ---------------------------------------------------------------------------------
    def sampling_timesteps(self, steps: int) -> list[int]:
        steps = max(1, min(steps, self.timesteps))
        ts = np.linspace(0, self.timesteps - 1, steps).round().astype(int)
        return sorted(set(ts.tolist()), reverse=True)

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
    ) -> torch.Tensor:
        """Generate a batch of shape ``shape`` (B, C, D, H, W). A fixed seed reproduces the result."""
        device = torch.device(device)
        g = torch.Generator().manual_seed(derive_seed(seed, SALT_SAMPLING))
        if sampler == "ddpm":
            steps, eta = steps or self.timesteps, 1.0
        elif sampler in ("ddim", "dpmpp2m"):
            steps = steps or 50
        else:
            raise ValueError(f"unknown sampler {sampler!r}")
        ts = self.sampling_timesteps(steps)
        x = torch.randn(tuple(shape), generator=g).to(device)

        def predict(x_t: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
            tt = torch.full((x_t.shape[0],), t, device=device, dtype=torch.long)
            if autocast is None:
                out = model(x_t, tt, cond)
            else:
                with autocast():
                    out = model(x_t, tt, cond)
            return self.to_x0_eps(x_t, tt, out)

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
                    x = x + sigma * torch.randn(x.shape, generator=g).to(device)
            bar.update(1)
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
