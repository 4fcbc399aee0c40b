"""GaussianDiffusion: schedule values, conversions, per-sample randomness, the loss contract, and every sampler
against an exact oracle denoiser on Gaussian toy data (where the right answer is known in closed form)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from diffusion3d.diffusion import GaussianDiffusion, derive_seed, make_betas

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


@pytest.mark.parametrize("sampler,steps,eta", [("ddpm", 10, 1.0), ("ddpm", 25, 1.0), ("ddpm", None, 1.0),
                                                ("ddim", 10, 1.0), ("ddim", 50, 1.0)])
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
    x = d.sample(model, (1, 1, 4, 4, 4), cond, sampler="dpmpp2m", steps=4,
                 autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
