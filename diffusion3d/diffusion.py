"""Gaussian diffusion: one schedule (fp32) shared by training and every sampler.

Training draws each sample's timestep and noise from a generator seeded by ``(seed, k)``, where k is the
sample's position in the run's stream, so splitting an effective batch into micro-batches or processes
does not change them. The loss returns one value per sample; the trainer decides how to reduce it.

Samplers (all batched, x0 optionally clipped to [-1, 1]):
  ddim     DDIM on an evenly strided subset of the training steps, eta configurable (0: deterministic)
  ddpm     ancestral sampling with the true posterior variance; with fewer steps than training it is
           DDIM with eta=1 on the strided subset, whose variance is correct for that subset
  dpmpp2m  DPM-Solver++(2M), second-order multistep in log-SNR, deterministic, on steps evenly spaced
           in log-SNR
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
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
        if sampler == "ddpm":
            return self.sampling_timesteps(steps or self.timesteps)
        if sampler == "ddim":
            return self.sampling_timesteps(steps or 50)
        if sampler == "dpmpp2m":
            return self.sampling_timesteps(steps or 50, "logsnr")
        raise ValueError(f"unknown sampler {sampler!r}")

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
    ) -> torch.Tensor:
        """Generate a batch of shape ``shape`` (B, C, D, H, W). A fixed seed reproduces the result.

        With ``seeds`` (one per volume) volume b draws its noise as a batch of one with seed=seeds[b]
        would, so a volume does not depend on its batch mates. Noise is drawn on the CPU: the same
        numbers on every device. ``on_step`` is called once per model evaluation.
        """
        device = torch.device(device)
        gens = [torch.Generator().manual_seed(derive_seed(s, SALT_SAMPLING)) for s in (seeds or [seed])]

        def noise(size: Sequence[int]) -> torch.Tensor:
            if seeds is None:
                return torch.randn(tuple(size), generator=gens[0]).to(device)
            return torch.stack([torch.randn(tuple(size[1:]), generator=g) for g in gens]).to(device)

        if sampler == "ddpm":
            eta = 1.0
        ts = self.visited_timesteps(sampler, steps)
        x = noise(shape)

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
