"""GaussianDiffusion and RectifiedFlow: schedule values, conversions, per-sample randomness, the loss contract,
every sampler against an exact oracle on Gaussian toy data (where the right answer is known in closed form),
condition dropout and classifier-free guidance."""

from __future__ import annotations

import hashlib
import math
import typing

import pytest
import torch
from torch import nn

from diffusion3d import config as C
from diffusion3d.diffusion import (
    FLOW_TIME_SCALE,
    SAMPLERS,
    GaussianDiffusion,
    RectifiedFlow,
    make_betas,
    resolution_shift,
    samplers_of,
    shift_time,
)
from diffusion3d.seeding import derive_seed

T = 250
MU, S = 0.1, 0.3  # toy data: x0 ~ N(MU, S²) i.i.d. per voxel
SHAPE = (8, 1, 16, 16, 16)  # 32768 voxels: the std of a sample is known to ~0.4 %


# ---- schedule ---------------------------------------------------------------------------------------
def _cosine_f(t: float, timesteps: int, s: float = 0.008) -> float:
    return math.cos((t / timesteps + s) / (1 + s) * math.pi / 2) ** 2


def test_cosine_schedule_known_values():
    d = GaussianDiffusion(T, "cosine")
    ac = d.alphas_cumprod
    assert ac.dtype == torch.float32 and d.betas.dtype == torch.float32
    assert ac[0] > 0.999
    assert (ac[1:] < ac[:-1]).all(), "alphas_cumprod must decrease strictly"
    assert ac[-1] < 1e-4
    assert (d.betas <= 0.999).all() and (d.betas > 0).all()
    # alphas_cumprod[t] is the product up to beta_t, i.e. f(t + 1) / f(0) (closed form, Nichol & Dhariwal eq. 17)
    for t in (0, 10, 100, 200, 240):
        expected = _cosine_f(t + 1, T) / _cosine_f(0, T)
        assert float(ac[t]) == pytest.approx(expected, rel=1e-5), t


def test_linear_schedule_endpoints():
    betas = make_betas("linear", 1000)
    assert float(betas[0]) == pytest.approx(1e-4) and float(betas[-1]) == pytest.approx(0.02)
    # fewer timesteps scale the betas so the chain still ends near pure noise
    d = GaussianDiffusion(250, "linear")
    assert float(d.betas[0]) == pytest.approx(4e-4) and float(d.betas[-1]) == pytest.approx(0.08)
    assert (d.alphas_cumprod[1:] < d.alphas_cumprod[:-1]).all() and d.alphas_cumprod[-1] < 1e-3


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="schedule"):
        make_betas("quadratic", 10)
    with pytest.raises(ValueError, match="prediction"):
        GaussianDiffusion(prediction="score")
    with pytest.raises(ValueError, match="loss"):
        GaussianDiffusion(loss="huber")
    with pytest.raises(ValueError, match="sampler"):
        GaussianDiffusion(10).sample(lambda x, t, c: x, (1, 1, 2, 2, 2), sampler="euler")


# ---- noising and conversions ------------------------------------------------------------------------
@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_q_sample_and_conversions_round_trip(prediction):
    d = GaussianDiffusion(T, "cosine", prediction, clip_x0=False)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand((6, 1, 4, 4, 4), generator=g) * 2 - 1
    noise = torch.randn(x0.shape, generator=g)
    t = torch.tensor([0, 1, 50, 125, 200, T - 2])
    x_t = d.q_sample(x0, t, noise)
    a = d.alphas_cumprod[t].view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(x_t, a.sqrt() * x0 + (1 - a).sqrt() * noise)
    x0_back, eps_back = d.to_x0_eps(x_t, t, d.target(x0, t, noise))
    torch.testing.assert_close(x0_back, x0, atol=1e-3, rtol=0)
    torch.testing.assert_close(eps_back, noise, atol=1e-3, rtol=0)


def test_noising_stays_fp32_for_low_precision_inputs():
    d = GaussianDiffusion(T)
    x0 = torch.zeros((2, 1, 2, 2, 2), dtype=torch.bfloat16)
    noise = torch.ones_like(x0)
    assert d.q_sample(x0, torch.tensor([0, 100]), noise).dtype == torch.float32


def test_clip_x0_clips_the_prediction():
    d = GaussianDiffusion(T, prediction="x0", clip_x0=True)
    x_t = torch.zeros((1, 1, 2, 2, 2))
    x0, _ = d.to_x0_eps(x_t, torch.tensor([10]), torch.full_like(x_t, 3.0))
    assert float(x0.max()) == 1.0


# ---- per-sample randomness --------------------------------------------------------------------------
def test_draw_is_a_function_of_seed_and_sample_id():
    d = GaussianDiffusion(T, seed=7)
    t_all, n_all = d.draw([3, 4, 5, 6], (1, 4, 4, 4))
    t_a, n_a = d.draw([3, 4], (1, 4, 4, 4))
    t_b, n_b = d.draw([5, 6], (1, 4, 4, 4))
    assert torch.equal(t_all, torch.cat([t_a, t_b])) and torch.equal(n_all, torch.cat([n_a, n_b]))
    assert t_all.shape == (4,) and n_all.shape == (4, 1, 4, 4, 4)
    assert not torch.equal(n_all[0], n_all[1]), "different samples must get different noise"
    t_other, n_other = GaussianDiffusion(T, seed=8).draw([3, 4, 5, 6], (1, 4, 4, 4))
    assert not torch.equal(n_all, n_other)
    assert derive_seed(7, 1, 3) != derive_seed(8, 1, 3) and derive_seed(7, 1, 3) == derive_seed(7, 1, 3)


# ---- the loss contract ------------------------------------------------------------------------------
class ConvDenoiser(nn.Module):
    """A per-sample model (no batch coupling) that is cheap and has real parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x_t, t, cond):
        out = self.conv(torch.cat([x_t, cond.to(x_t.dtype)], 1))
        return out + (t.view(-1, 1, 1, 1, 1) / T).to(out.dtype)


def _batch(b: int = 4):
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand((b, 1, 6, 6, 6), generator=g) * 2 - 1
    cond = torch.randn((b, 2, 6, 6, 6), generator=g)
    return x0, cond


def test_loss_is_per_sample_and_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    model, (x0, cond) = ConvDenoiser(), _batch()
    d = GaussianDiffusion(T)
    loss = d.loss(model, x0, cond, [0, 1, 2, 3], autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert loss.shape == (4,) and loss.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x0, torch.zeros(4, dtype=torch.long), cond).dtype == torch.bfloat16  # autocast did act


@pytest.mark.parametrize("loss_type", ["l1", "l2"])
def test_batch_loss_equals_per_sample_losses_and_the_definition(loss_type):
    torch.manual_seed(0)
    model, (x0, cond) = ConvDenoiser(), _batch()
    d = GaussianDiffusion(T, loss=loss_type, seed=3)
    ids = [10, 11, 12, 13]
    batch = d.loss(model, x0, cond, ids)
    one_by_one = torch.cat([d.loss(model, x0[i : i + 1], cond[i : i + 1], [k]) for i, k in enumerate(ids)])
    torch.testing.assert_close(batch, one_by_one, rtol=1e-5, atol=1e-6)
    t, noise = d.draw(ids, x0.shape[1:])
    with torch.no_grad():
        diff = model(d.q_sample(x0, t, noise), t, cond) - noise  # eps prediction: the target is the noise
    expected = diff.abs() if loss_type == "l1" else diff.square()
    torch.testing.assert_close(batch.detach(), expected.flatten(1).mean(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
def test_min_snr_weighting_follows_the_formula(prediction):
    torch.manual_seed(0)
    model, (x0, cond) = ConvDenoiser(), _batch(16)
    gamma = 5.0
    ids = list(range(16))
    plain = GaussianDiffusion(T, prediction=prediction).loss(model, x0, cond, ids)
    weighted = GaussianDiffusion(T, prediction=prediction, min_snr_gamma=gamma).loss(model, x0, cond, ids)
    d = GaussianDiffusion(T)
    t, _ = d.draw(ids, x0.shape[1:])
    ac = d.alphas_cumprod.double()[t]
    snr = ac / (1 - ac)
    assert (snr > gamma).any() and (snr < gamma).any(), "the ids must cover both sides of gamma"
    clipped = snr.clamp(max=gamma)
    weight = {"eps": clipped / snr, "v": clipped / (snr + 1), "x0": clipped}[prediction]
    torch.testing.assert_close(weighted.double(), plain.double() * weight, rtol=1e-4, atol=1e-7)


# ---- samplers against an exact oracle ---------------------------------------------------------------
def oracle(d: GaussianDiffusion, mu: float = MU, s: float = S):
    """The exact denoiser for x0 ~ N(mu, s²): E[x0 | x_t] in closed form, returned as d's prediction type."""

    def model(x_t, t, cond):
        a = d.sqrt_ac.double()[t].view(-1, 1, 1, 1, 1)
        sig = d.sqrt_1m_ac.double()[t].view(-1, 1, 1, 1, 1)
        x = x_t.double()
        x0 = mu + a * s**2 / (a**2 * s**2 + sig**2) * (x - a * mu)
        eps = (x - a * x0) / sig
        return {"eps": eps, "x0": x0, "v": a * eps - sig * x0}[d.prediction].float()

    return model


def ddim_deterministic_std(d: GaussianDiffusion, steps: int) -> float:
    """Expected std of DDIM(eta=0) with the exact oracle on N(mu, S²), derived independently of the sampler.

    Write x_t - a·mu = r·(sin θ, cos θ)-mixture with tan θ = sigma_t / (a_t·S). A deterministic DDIM step with
    E[x0|x_t] keeps the radius direction fixed, so each step multiplies the std (relative to the exact
    marginal) by cos(θ_t - θ_next); the chain ends at θ = 0 (clean data).
    """

    def theta(t: int) -> float:
        return 0.0 if t < 0 else math.atan2(float(d.sqrt_1m_ac[t]), float(d.sqrt_ac[t]) * S)

    ts = d.sampling_timesteps(steps) + [-1]
    return S * math.prod(math.cos(theta(a) - theta(b)) for a, b in zip(ts[:-1], ts[1:]))


def ancestral_moments(d: GaussianDiffusion, steps: int) -> tuple[float, float]:
    """Expected (mean, std) of ancestral DDPM on the strided subset with the exact oracle.

    Scalar recursion in DDPM's own form (Ho et al. eq. 6-7) with the subset's betas beta = 1 - ab_t/ab_n:
    x_n = c0·x0_hat + c1·x_t + sqrt(beta_tilde)·z, written independently of the sampler's DDIM-style update.
    """
    ab = d.alphas_cumprod.double()
    ts = d.sampling_timesteps(steps)
    mean, var = 0.0, 1.0  # x_T ~ N(0, 1)
    for i, t in enumerate(ts):
        ab_t, ab_n = float(ab[t]), (float(ab[ts[i + 1]]) if i + 1 < len(ts) else 1.0)
        beta = 1 - ab_t / ab_n
        a, sig2 = math.sqrt(ab_t), 1 - ab_t
        k = a * S**2 / (a**2 * S**2 + sig2)  # x0_hat = MU + k·(x_t - a·MU)
        c0, c1 = math.sqrt(ab_n) * beta / (1 - ab_t), math.sqrt(1 - beta) * (1 - ab_n) / (1 - ab_t)
        slope = c0 * k + c1
        mean = c0 * (MU - k * a * MU) + slope * mean
        var = slope**2 * var + (1 - ab_n) / (1 - ab_t) * beta
    return mean, math.sqrt(var)


def _stats(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std())


@pytest.mark.parametrize("prediction", ["eps", "v", "x0"])
@pytest.mark.parametrize(
    "sampler,steps,eta",
    [("ddpm", None, 1.0), ("ddim", 50, 0.0), ("dpmpp2m", 10, 0.0), ("dpmpp2m", 20, 0.0), ("dpmpp2m", 50, 0.0)],
)
def test_samplers_reproduce_the_data_distribution(prediction, sampler, steps, eta):
    """The accurate settings: the default DDIM-50, full ancestral DDPM and the fast solver, against the data."""
    d = GaussianDiffusion(T, "cosine", prediction, clip_x0=False)
    mean, std = _stats(d.sample(oracle(d), SHAPE, sampler=sampler, steps=steps, eta=eta, seed=1))
    assert abs(mean - MU) < 0.01
    # 5 %: DDIM-50 is 4.5 % narrow by construction (see ddim_deterministic_std), the others within 3 %.
    assert abs(std / S - 1) < 0.05, f"std {std:.4f} vs data {S}"


@pytest.mark.parametrize("steps", [1, 5, 10, 25, 50, 250])
def test_ddim_matches_its_closed_form_at_every_step_count(steps):
    d = GaussianDiffusion(T, "cosine", "eps", clip_x0=False)
    mean, std = _stats(d.sample(oracle(d), SHAPE, sampler="ddim", steps=steps, eta=0.0, seed=2))
    expected = ddim_deterministic_std(d, steps)
    assert abs(mean - MU) < 0.01
    if steps == 1:  # one step from pure noise returns E[x0 | x_T]: the data mean, no spread
        assert std < 1e-3 and expected < 1e-3
        return
    assert abs(std / expected - 1) < 0.02, f"std {std:.4f} vs closed form {expected:.4f}"
    if steps >= 50:
        assert expected > 0.95 * S


@pytest.mark.parametrize(
    "sampler,steps,eta",
    [("ddpm", 10, 1.0), ("ddpm", 25, 1.0), ("ddpm", None, 1.0), ("ddim", 10, 1.0), ("ddim", 50, 1.0)],
)
def test_stochastic_samplers_have_the_right_variance_at_short_step_counts(sampler, steps, eta):
    """Ancestral sampling on a strided subset must use that subset's posterior variance. MONAI's
    DDPMScheduler does not (see the negative control below); the expected std here comes from DDPM's own
    posterior formulas, so a wrong variance term fails by far more than the 2 % allowed."""
    d = GaussianDiffusion(T, "cosine", "eps", clip_x0=False)
    mean, std = _stats(d.sample(oracle(d), SHAPE, sampler=sampler, steps=steps, eta=eta, seed=3))
    exp_mean, exp_std = ancestral_moments(d, steps or T)
    assert abs(std / exp_std - 1) < 0.02, f"std {std:.4f} vs expected {exp_std:.4f}"
    assert abs(mean - exp_mean) < 0.01 and abs(mean - MU) < 0.01
    # with a perfect denoiser a stochastic sampler can only lose spread, more so with fewer steps
    assert 0.6 * S < std < 1.02 * S


def test_ancestral_reference_catches_monais_short_schedule_variance():
    """Negative control: MONAI's DDPMScheduler asked for 25 of 250 steps, same oracle, same check."""
    schedulers = pytest.importorskip("monai.networks.schedulers")
    sch = schedulers.DDPMScheduler(num_train_timesteps=T, schedule="cosine", clip_sample=False)
    sch.set_timesteps(25)
    d = GaussianDiffusion(T, "cosine", "eps", clip_x0=False)
    d.alphas_cumprod = sch.alphas_cumprod.float()  # oracle and reference on MONAI's own schedule
    d.sqrt_ac, d.sqrt_1m_ac = d.alphas_cumprod.sqrt(), (1 - d.alphas_cumprod).sqrt()
    model, g = oracle(d), torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g)
    for t in sch.timesteps.tolist():
        x, _ = sch.step(model(x, torch.full((SHAPE[0],), t), None), t, x, generator=g)
    _, exp_std = ancestral_moments(d, 25)
    assert abs(float(x.std()) / exp_std - 1) > 0.2, "the check above would not catch MONAI's wrong variance"


def test_sampling_timesteps():
    d = GaussianDiffusion(T)
    for spacing in ("uniform", "logsnr"):
        for steps in (1, 10, 50, T):
            ts = d.sampling_timesteps(steps, spacing)
            assert len(ts) == steps, "the requested number of model calls"
            assert ts[0] == T - 1, "sampling must start from pure noise"
            assert all(a > b for a, b in zip(ts, ts[1:]))
            assert steps == 1 or ts[-1] == 0
    assert d.sampling_timesteps(T) == list(range(T - 1, -1, -1)) == d.sampling_timesteps(T, "logsnr")
    for small in (2, 3, 4):  # collisions on a coarse grid are pushed apart, never dropped
        for steps in range(1, small + 1):
            ts = GaussianDiffusion(small).sampling_timesteps(steps, "logsnr")
            assert len(set(ts)) == steps and ts[0] == small - 1 and ts == sorted(ts, reverse=True)
    with pytest.raises(ValueError, match="spacing"):
        d.sampling_timesteps(10, "karras")


@pytest.mark.parametrize("sampler,eta", [("ddim", 1.0), ("ddpm", 1.0), ("dpmpp2m", 0.0)])
def test_fixed_seed_reproduces_the_sample(sampler, eta):
    d = GaussianDiffusion(50, clip_x0=True)
    shape = (2, 1, 4, 4, 4)
    a = d.sample(oracle(d), shape, sampler=sampler, steps=8, eta=eta, seed=5)
    b = d.sample(oracle(d), shape, sampler=sampler, steps=8, eta=eta, seed=5)
    c = d.sample(oracle(d), shape, sampler=sampler, steps=8, eta=eta, seed=6)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert a.dtype == torch.float32 and a.abs().max() <= 1.0  # clip_x0 keeps the result in [-1, 1]


def test_sampling_under_bf16_autocast_returns_fp32():
    torch.manual_seed(0)
    d = GaussianDiffusion(50)
    model = ConvDenoiser()
    cond = torch.randn((1, 2, 4, 4, 4))
    x = d.sample(
        model,
        (1, 1, 4, 4, 4),
        cond,
        sampler="dpmpp2m",
        steps=4,
        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    )
    assert x.dtype == torch.float32 and torch.isfinite(x).all()


# ---- rectified flow ---------------------------------------------------------------------------------
def flow_oracle(mu: float = MU, s: float = S, cond_shift: float = 0.0, output: str = "velocity"):
    """The exact velocity E[eps - x0 | x_t] for x0 ~ N(mu (+ cond_shift where the condition is set), s²) on
    x_t = (1 - t) x0 + t eps. With ``cond_shift`` the data mean depends on the condition: zeros (the null
    condition) give the unconditional mean, so guidance has something to act on. ``output`` x0: E[x0 | x_t]."""

    def model(x_t, t_scaled, cond):
        t = (t_scaled.double() / FLOW_TIME_SCALE).view(-1, 1, 1, 1, 1)
        m = torch.full_like(x_t.double(), mu)
        if cond is not None:
            m = m + cond_shift * cond.double().mean(1, keepdim=True)
        x = x_t.double()
        var = (1 - t) ** 2 * s**2 + t**2
        x0 = m + (1 - t) * s**2 / var * (x - (1 - t) * m)
        eps = t / var * (x - (1 - t) * m)
        return x0.float() if output == "x0" else (eps - x0).float()

    return model


def test_flow_time_shift_and_draws():
    assert resolution_shift([32, 32, 32]) == pytest.approx(1.0)
    assert resolution_shift([128, 128, 128]) == pytest.approx(4.0)
    assert shift_time(0.5, 3.0) == pytest.approx(0.75) and shift_time(1.0, 3.0) == 1.0 and shift_time(0.0, 3.0) == 0.0
    f = RectifiedFlow(shift=1.0, seed=7)
    t_all, n_all = f.draw([3, 4, 5, 6], (1, 4, 4, 4))
    t_a, n_a = f.draw([3, 4], (1, 4, 4, 4))
    t_b, n_b = f.draw([5, 6], (1, 4, 4, 4))
    assert torch.equal(t_all, torch.cat([t_a, t_b])) and torch.equal(n_all, torch.cat([n_a, n_b]))  # (seed, k) only
    t, _ = f.draw(range(4000), (1, 1, 1, 1))
    assert 0 < t.min() and t.max() < 1
    assert t.mean() == pytest.approx(0.5, abs=0.02)  # logit-normal(0, 1) is symmetric about 1/2
    assert ((t > 0.3) & (t < 0.7)).float().mean() > 0.55  # and concentrated in the middle (uniform: 0.4)
    shifted, _ = RectifiedFlow(shift=4.0, seed=7).draw(range(4000), (1, 1, 1, 1))
    assert shifted.mean() > t.mean() + 0.2  # toward noise


def test_flow_loss_is_zero_for_the_exact_velocity_of_a_point_mass():
    """Data x0 = c: the velocity (x_t - c) / t is exact, so the per-sample loss is 0; a wrong one is not."""
    c = 0.3
    x0 = torch.full((3, 1, 4, 4, 4), c)
    exact = lambda x_t, t, cond: (x_t - c) / (t / FLOW_TIME_SCALE).view(-1, 1, 1, 1, 1)  # noqa: E731
    f = RectifiedFlow(loss="l2", seed=1)
    loss = f.loss(exact, x0, None, [0, 1, 2])
    assert loss.shape == (3,) and loss.max() < 1e-8
    assert f.loss(lambda x_t, t, cond: torch.zeros_like(x_t), x0, None, [0, 1, 2]).min() > 0.1


@pytest.mark.parametrize("sampler", ["euler", "heun", "euler_a"])
def test_a_perfect_velocity_field_transports_a_point_mass_exactly(sampler):
    c = -0.4
    exact = lambda x_t, t, cond: (x_t - c) / (t / FLOW_TIME_SCALE).view(-1, 1, 1, 1, 1)  # noqa: E731
    for shift in (1.0, 3.0):
        x = RectifiedFlow(shift=shift, clip_x0=False).sample(exact, (2, 1, 4, 4, 4), sampler=sampler, steps=3, seed=0)
        torch.testing.assert_close(x, torch.full_like(x, c), rtol=0, atol=1e-5)


# euler_a at 200 steps: std 0.293 (-2.4 %): ancestral steps put the posterior mean of x0 in place of x0
# and so lose its posterior variance; the loss shrinks with the step size (10 steps: 0.219, Euler 0.246).
@pytest.mark.parametrize("sampler,steps,tol", [("euler", 200, 0.02), ("heun", 20, 0.02), ("euler_a", 200, 0.03)])
def test_flow_samplers_reach_the_data_distribution_with_the_exact_velocity(sampler, steps, tol):
    f = RectifiedFlow(shift=1.0, clip_x0=False)
    x = f.sample(flow_oracle(), SHAPE, sampler=sampler, steps=steps, seed=4)
    mean, std = _stats(x)
    assert mean == pytest.approx(MU, abs=0.01)
    assert std == pytest.approx(S, rel=tol)


@pytest.mark.parametrize("sampler,steps", [("euler", 200), ("heun", 20)])
def test_an_x0_output_samples_the_same_flow_as_the_velocity(sampler, steps):
    """flow_output x0: the exact posterior mean of x0 gives the exact velocity (x_t - x0) / t, so the samplers
    reach the data distribution as with the velocity output, and the same noise ends at the same volume."""
    by_v = RectifiedFlow(shift=1.0, clip_x0=False).sample(flow_oracle(), SHAPE, sampler=sampler, steps=steps, seed=4)
    flow = RectifiedFlow(shift=1.0, clip_x0=False, output="x0")
    by_x0 = flow.sample(flow_oracle(output="x0"), SHAPE, sampler=sampler, steps=steps, seed=4)
    mean, std = _stats(by_x0)
    assert mean == pytest.approx(MU, abs=0.01) and std == pytest.approx(S, rel=0.02)
    torch.testing.assert_close(by_x0, by_v, rtol=0, atol=2e-3)


@pytest.mark.parametrize("loss,floor", [("l2", None), ("l1", None), ("l2", 0.3)])
def test_an_x0_outputs_loss_is_the_velocitys_with_t_at_least_a_floor(loss, floor):
    """x-prediction's loss: the derived velocity (x_t - x0_hat) / t against the true one, i.e. the x0 error
    over t; below the floor (X0_MIN_T, or the config's flow_x0_min_t) the weight stops growing (a near-clean
    sample would otherwise dominate)."""
    from diffusion3d.diffusion import X0_MIN_T as DEFAULT_FLOOR

    X0_MIN_T = DEFAULT_FLOOR if floor is None else floor
    kwargs = {} if floor is None else {"x0_min_t": floor}
    flow = RectifiedFlow(shift=1.0, loss=loss, time_sampling="uniform", output="x0", **kwargs)
    x0 = torch.rand(200, 1, 4, 4, 4) * 2 - 1
    ids = list(range(200))
    t, noise = flow.draw(ids, x0.shape[1:])
    assert t.min() < X0_MIN_T < t.max()  # both sides of the floor are drawn
    guess = x0 + 0.1 * torch.randn_like(x0)
    got = flow.loss(lambda x_t, nt, cond: guess, x0, None, ids)
    x_t = flow.q_sample(x0, t, noise)
    tt = t.view(-1, 1, 1, 1, 1)
    v_err = ((x_t - guess) / tt) - (noise - x0)
    per = v_err.square() if loss == "l2" else v_err.abs()
    above = t >= X0_MIN_T
    torch.testing.assert_close(got[above], per.flatten(1).mean(1)[above], rtol=1e-4, atol=0)
    floor = (guess - x0).flatten(1) / X0_MIN_T
    floor = floor.square() if loss == "l2" else floor.abs()
    torch.testing.assert_close(got[~above], floor.mean(1)[~above], rtol=1e-4, atol=0)


def test_a_sampling_shift_moves_the_sampling_grid_and_not_the_training_times():
    """sampling_shift: the samplers' time grid is shifted by it; the training draws keep flow_shift's."""
    from diffusion3d.diffusion import make_diffusion, shift_time

    cfg = C.Config().override(prediction="flow", sampler="heun", flow_shift=2.0)
    trained, resampled = make_diffusion(cfg), make_diffusion(cfg.override(sampling_shift=0.5))
    assert trained.time_grid(5) == pytest.approx([shift_time(1 - i / 5, 2.0) for i in range(6)])
    assert resampled.time_grid(5) == pytest.approx([shift_time(1 - i / 5, 0.5) for i in range(6)])
    assert resampled.time_grid(5)[-2] == pytest.approx(0.1 / 0.9)  # the last step from t 0.11 (0.33 at shift 2)
    ids = list(range(8))
    for a, b in zip(trained.draw(ids, (1, 2, 2, 2)), resampled.draw(ids, (1, 2, 2, 2)), strict=True):
        assert torch.equal(a, b)


def test_flow_output_applies_to_the_flow_only():
    from diffusion3d.diffusion import make_diffusion

    cfg = C.Config()
    for output in ("velocity", "x0"):
        assert make_diffusion(cfg.override(prediction="flow", sampler="heun", flow_output=output)).output == output
    with pytest.raises(C.ConfigError, match="flow_output"):
        cfg.override(prediction="x0", flow_output="x0")


def test_heun_beats_euler_at_equal_model_evaluations():
    f = RectifiedFlow(shift=1.0, clip_x0=False)
    assert f.evaluations("heun", 10) == 19 and f.evaluations("euler", 19) == 19
    err = {}
    for sampler, steps in (("euler", 19), ("heun", 10)):
        _, std = _stats(f.sample(flow_oracle(), SHAPE, sampler=sampler, steps=steps, seed=4))
        err[sampler] = abs(std - S)
    # measured: euler-19 std 0.269, heun-10 0.284 (S = 0.3; the sample's own std is 0.298 at 1000 steps).
    # At 9 evaluations they tie: S = 0.3 makes the field stiff near the data end for a uniform grid.
    assert err["heun"] < 0.6 * err["euler"], err


def test_ancestral_flow_step_without_its_noise_is_euler_and_with_it_is_seeded():
    """With s = 0 (eta 0) the ancestral step is Euler exactly; with its noise two seeds differ, one repeats."""
    f = RectifiedFlow(shift=2.0, clip_x0=False)
    start, v = torch.randn(2, 1, 4, 4, 4), torch.randn(2, 1, 4, 4, 4)
    euler, ancestral = f.plan("euler", 4), f.plan("euler_a", 4)
    ancestral.eta = 0.0
    assert euler.times == ancestral.times and f.evaluations("euler_a", 4) == 4
    for i in range(3):
        torch.testing.assert_close(ancestral.step(i, start, v), euler.step(i, start, v), rtol=0, atol=1e-6)
    a = f.sample(flow_oracle(), SHAPE, sampler="euler_a", steps=10, seed=1)
    b = f.sample(flow_oracle(), SHAPE, sampler="euler_a", steps=10, seed=2)
    assert not torch.equal(a, b) and torch.equal(a, f.sample(flow_oracle(), SHAPE, sampler="euler_a", steps=10, seed=1))


def test_flow_sampling_counts_evaluations_and_is_seeded():
    calls = []
    model = flow_oracle()
    counted = lambda x, t, c: (calls.append(1), model(x, t, c))[1]  # noqa: E731
    f = RectifiedFlow()
    a = f.sample(counted, (1, 1, 4, 4, 4), sampler="heun", steps=4, seed=3)
    assert len(calls) == f.evaluations("heun", 4) == 7
    b = f.sample(model, (1, 1, 4, 4, 4), sampler="heun", steps=4, seed=3)
    c = f.sample(model, (1, 1, 4, 4, 4), sampler="heun", steps=4, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="unknown sampler 'ddim'"):
        f.sample(model, (1, 1, 2, 2, 2), sampler="ddim")


# ---- condition dropout and classifier-free guidance --------------------------------------------------
def test_condition_dropout_draws_are_split_invariant_and_have_the_right_rate():
    for d in (GaussianDiffusion(T, seed=5, cond_drop_prob=0.2), RectifiedFlow(seed=5, cond_drop_prob=0.2)):
        all_ = d.drop_flags([3, 4, 5, 6, 7])
        assert torch.equal(all_, torch.cat([d.drop_flags([3, 4]), d.drop_flags([5, 6, 7])]))
        rate = d.drop_flags(range(5000)).float().mean().item()
        assert rate == pytest.approx(0.2, abs=0.02)
        cond = torch.ones(5, 2, 2, 2, 2)
        dropped = d.training_cond(cond, [3, 4, 5, 6, 7])
        assert torch.equal(dropped.flatten(1).abs().sum(1) == 0, all_)  # dropped: the null (zero) condition
    assert not GaussianDiffusion(T, cond_drop_prob=0.0).drop_flags(range(100)).any()


def test_the_model_sees_the_null_condition_for_dropped_samples():
    seen = []

    def model(x_t, t, cond):
        seen.append(cond.clone())
        return torch.zeros_like(x_t)

    d = RectifiedFlow(seed=5, cond_drop_prob=0.5)
    ids = list(range(8))
    d.loss(model, torch.zeros(8, 1, 2, 2, 2), torch.ones(8, 2, 2, 2, 2), ids)
    zero = seen[0].flatten(1).abs().sum(1) == 0
    assert torch.equal(zero, d.drop_flags(ids)) and 0 < zero.sum() < 8


@pytest.mark.parametrize("objective", ["gaussian", "flow"])
def test_guidance_scale_one_is_the_conditional_model_and_zero_the_unconditional(objective):
    if objective == "flow":
        d, sampler, model = RectifiedFlow(clip_x0=False), "euler", flow_oracle(cond_shift=0.3)
    else:
        d, sampler = GaussianDiffusion(50, clip_x0=False), "ddim"
        base, shifted = oracle(d), oracle(d, mu=MU + 0.3)

        def model(x, t, c):  # the exact denoiser of N(MU + 0.3, S²) where the condition is set, else N(MU, S²)
            on = (c.flatten(1).abs().sum(1) > 0).view(-1, 1, 1, 1, 1)
            return torch.where(on, shifted(x, t, None), base(x, t, None))

    shape = (2, 1, 4, 4, 4)
    cond = torch.ones(2, 2, 4, 4, 4)
    calls = []
    counted = lambda x, t, c: (calls.append(x.shape[0]), model(x, t, c))[1]  # noqa: E731
    plain = d.sample(model, shape, cond, sampler=sampler, steps=4, seed=1)
    one = d.sample(counted, shape, cond, sampler=sampler, steps=4, seed=1, guidance_scale=1.0)
    assert torch.equal(plain, one) and calls == [2] * 4  # one evaluation per step, no null batch
    calls.clear()
    zero = d.sample(counted, shape, cond, sampler=sampler, steps=4, seed=1, guidance_scale=0.0)
    uncond = d.sample(model, shape, torch.zeros_like(cond), sampler=sampler, steps=4, seed=1)
    torch.testing.assert_close(zero, uncond, rtol=0, atol=1e-5)
    assert calls == [4] * 4  # cond and null in one batched evaluation
    two = d.sample(model, shape, cond, sampler=sampler, steps=4, seed=1, guidance_scale=2.0)
    # guidance extrapolates away from the unconditional result, past the conditional one
    assert (two - uncond).mean() > (plain - uncond).mean() > 0.05


# ---- the one sampling loop reproduces the pre-refactor samplers bitwise ------------------------------
class PolyDenoiser(nn.Module):
    """A tiny deterministic model of elementwise arithmetic only (no convolution, no reduction), so its
    output does not depend on a CPU's kernel choices; it mixes x, t and both condition channels."""

    def forward(self, x_t, t, cond):
        tt = (t.float() / FLOW_TIME_SCALE).view(-1, 1, 1, 1, 1)
        c = 0.0 if cond is None else 0.2 * cond[:, :1] - 0.1 * cond[:, 1:2]
        return 0.8 * x_t - 0.3 * x_t * x_t * tt + c + 0.1 * tt


def _digest(x: torch.Tensor) -> tuple[float, str]:
    return float(x.double().sum()), hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()[:16]


# Each case: (objective, sampling kwargs). Every sampler, stochastic and deterministic, clipped and not,
# guided and not, one seed and per-volume seeds.
BITWISE_CASES = {
    "ddim": ("eps", {"sampler": "ddim", "steps": 5, "seed": 1}),
    "ddim_eta_seeds": ("v", {"sampler": "ddim", "steps": 6, "eta": 0.5, "seeds": [3, 7]}),
    "ddpm_strided_guided": ("eps", {"sampler": "ddpm", "steps": 6, "seed": 2, "guidance_scale": 2.0}),
    "ddpm_all": ("x0", {"sampler": "ddpm", "steps": None, "seed": 3}),
    "dpmpp2m_guided": ("v", {"sampler": "dpmpp2m", "steps": 6, "seed": 4, "guidance_scale": 1.5}),
    "dpmpp2m_noclip": ("x0-noclip", {"sampler": "dpmpp2m", "steps": 7, "seeds": [5, 6]}),
    "dpmpp2m_one": ("v-noclip", {"sampler": "dpmpp2m", "steps": 1, "seed": 1}),
    "euler_guided": ("flow", {"sampler": "euler", "steps": 4, "seed": 1, "guidance_scale": 1.5}),
    "euler_noclip": ("flow-noclip", {"sampler": "euler", "steps": 5, "seeds": [8, 9]}),
    "heun": ("flow", {"sampler": "heun", "steps": 4, "seed": 2}),
    "heun_noclip_guided": ("flow-noclip", {"sampler": "heun", "steps": 3, "seeds": [1, 2], "guidance_scale": 2.0}),
    "heun_one": ("flow", {"sampler": "heun", "steps": 1, "seed": 3}),
}
# (sum, sha256 prefix) of each case's output, recorded by running the two sample() methods as they were before
# the samplers became step classes around one loop (commit b48f963), torch 2.13.0+cpu on x86-64. A torch
# build that draws other random numbers would change these without any change of ours.
BITWISE_REFERENCE = {
    "ddim": (7.159333199262619, "ab2980859d8c7d38"),
    "ddim_eta_seeds": (1.746548481285572, "b752a1d2803cb452"),
    "ddpm_all": (-2.1457483135163784, "8cb358545d557db2"),
    "ddpm_strided_guided": (-1.0123363509774208, "1de09751c43f06a1"),
    "dpmpp2m_guided": (-0.5013993354514241, "8abf8cd89f74573e"),
    "dpmpp2m_noclip": (0.656028226017952, "77086ba1dfd7ac84"),
    "dpmpp2m_one": (-7.465299927163869, "cbe41b78a1831064"),
    "euler_guided": (4.571371056139469, "d919e86f83b4c1c6"),
    "euler_noclip": (2.610705718398094, "f2d71574ea2843fc"),
    "heun": (1.055906917899847, "03a02eef35d5c5be"),
    "heun_noclip_guided": (0.197037935256958, "18f0e4387dbfc939"),
    "heun_one": (3.171353865414858, "55280e65a07e7aa4"),
}


def _objective(kind: str) -> GaussianDiffusion | RectifiedFlow:
    clip = not kind.endswith("-noclip")
    kind = kind.removesuffix("-noclip")
    if kind == "flow":
        return RectifiedFlow(shift=2.0, clip_x0=clip)
    return GaussianDiffusion(20, "cosine", kind, clip_x0=clip)


@pytest.mark.parametrize("case", sorted(BITWISE_CASES))
def test_sampling_reproduces_the_pre_refactor_loops_bitwise(case):
    kind, kwargs = BITWISE_CASES[case]
    d, calls = _objective(kind), []
    cond = torch.stack([torch.full((2, 2, 3, 2), v) for v in (1.0, -1.0)])  # two volumes, two label channels
    x = d.sample(PolyDenoiser(), (2, 1, 2, 3, 2), cond, on_step=lambda: calls.append(1), **kwargs)
    assert x.shape == (2, 1, 2, 3, 2) and x.dtype == torch.float32
    assert len(calls) == d.evaluations(kwargs["sampler"], kwargs["steps"])
    total, digest = _digest(x)
    ref_total, ref_digest = BITWISE_REFERENCE[case]
    assert digest == ref_digest, f"{case}: sum {total!r}, reference {ref_total!r}"


# ---- the sampler registry ---------------------------------------------------------------------------
def test_the_registry_is_the_one_list_of_samplers():
    """The config's ``sampler`` choices, each objective's samplers and the config's fit check all come from
    ``SAMPLERS``; every sampler runs with its default steps."""
    choices = typing.get_args(typing.get_type_hints(C.DiffusionConfig)["sampler"])
    assert set(choices) == set(SAMPLERS) and len(choices) == len(SAMPLERS)
    gauss, flow = GaussianDiffusion(20), RectifiedFlow()
    assert gauss.samplers == samplers_of("gaussian") == ("ddim", "ddpm", "dpmpp2m")
    assert flow.samplers == samplers_of("flow") == ("euler", "heun", "euler_a")
    assert set(gauss.samplers) | set(flow.samplers) == set(SAMPLERS)
    for name, spec in SAMPLERS.items():
        d = gauss if spec.objective == "gaussian" else flow
        assert d.default_steps(name) == (spec.default_steps or d.timesteps)
        prediction = "flow" if d is flow else "eps"
        C.DiffusionConfig(prediction=prediction, sampler=name).validate()  # fits its own objective
        with pytest.raises(C.ConfigError, match=f"sampler: {name!r} does not fit"):
            C.DiffusionConfig(prediction="eps" if d is flow else "flow", sampler=name).validate()
    assert gauss.evaluations("ddpm", None) == 20 and flow.evaluations("heun", None) == 2 * 25 - 1
