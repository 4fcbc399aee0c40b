"""Spaces: the Haar transform (exact inverse, orthonormal, WDM's low-pass scale), the condition on the subband
grid, shapes, the config keys; a sampler's oracle in wavelet space."""

from __future__ import annotations

import typing

import pytest
import torch
import torch.nn.functional as F

from diffusion3d import config as C
from diffusion3d import configs
from diffusion3d import space as S
from diffusion3d.diffusion import FLOW_TIME_SCALE, RectifiedFlow
from diffusion3d.model import build_model, unet_channels
from tests.helpers import configure, tiny_config


def volumes(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2 - 1


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("channels", [1, 3])
def test_decode_inverts_encode(levels, channels):
    x = volumes((2, channels, 16, 16, 32))
    space = S.WaveletSpace(levels)
    z = space.encode(x)
    assert z.shape == (2, channels * 8**levels, 16 // 2**levels, 16 // 2**levels, 32 // 2**levels)
    assert z.shape[1:] == space.latent_shape(channels, [16, 16, 32])
    torch.testing.assert_close(space.decode(z), x, rtol=0, atol=1e-6)
    x64 = x.double()
    assert (space.decode(space.encode(x64)) - x64).abs().max() < 1e-14  # exact up to float64 rounding


def test_haar_is_orthonormal_and_preserves_energy():
    x = volumes((2, 2, 8, 8, 8), seed=1, dtype=torch.float64)
    z = S.haar3d(x)
    assert z.square().sum() == pytest.approx(x.square().sum().item(), rel=1e-12)
    y = volumes((2, 2, 8, 8, 8), seed=2, dtype=torch.float64)
    assert (z * S.haar3d(y)).sum() == pytest.approx((x * y).sum().item(), rel=1e-12)  # inner products too
    # encode = haar3d with each level's low-pass band divided by 3: put the factor back, the energy is kept
    for levels in (1, 2):
        z = S.WaveletSpace(levels).encode(x)
        undone = z.clone()
        per_band = torch.ones(8**levels, dtype=torch.float64)
        for level in range(levels):  # band index in base 8, one digit per level; digit 0 = that level's LLL
            digit = (torch.arange(8**levels) // 8 ** (levels - 1 - level)) % 8
            per_band[digit == 0] *= S.LOWPASS_SCALE
        undone *= per_band.repeat(2).view(1, -1, 1, 1, 1)
        assert undone.square().sum() == pytest.approx(x.square().sum().item(), rel=1e-12)


def test_subbands_of_known_blocks():
    """A constant 2³ block is all low-pass (its sum / √8, then / 3); a step along W is the LLH band alone."""
    x = torch.full((1, 1, 2, 2, 2), 0.6)
    z = S.WaveletSpace(1).encode(x).flatten()
    assert z[0].item() == pytest.approx(8 * 0.6 / 8**0.5 / 3) and z[1:].abs().max() < 1e-7
    step = torch.tensor([-1.0, 1.0]).repeat(4).view(1, 1, 2, 2, 2)  # varies with the last axis (W) only
    bands = S.haar3d(step).flatten()
    assert bands[1].item() == pytest.approx(-8 / 8**0.5)  # LLH: band index 0b001
    assert torch.cat([bands[:1], bands[2:]]).abs().max() < 1e-6


def test_low_pass_band_of_an_image_in_range_stays_in_range():
    """WDM's divisor 3 keeps the low-pass band of a [-1, 1] image within [-1, 1] (|sum|/√8/3 ≤ 0.943)."""
    for levels in (1, 2):
        space = S.WaveletSpace(levels)
        for value in (-1.0, 1.0):
            z = space.encode(torch.full((1, 1, 8, 8, 8), value))
            assert z[:, 0].abs().max() <= 1.0 and z[:, 0].abs().max() > 0.85


def test_condition_on_the_subband_grid():
    mask = torch.zeros(1, 1, 8, 8, 8, dtype=torch.uint8)
    mask[..., :3, :, :] = 1  # label 1 fills 3 of every 4 rows along D: the 2³ blocks at D 2-3 hold it half
    onehot = torch.cat([mask == 1, mask == 2], 1).float() * 2 - 1
    pooled = S.WaveletSpace(1, cond="pool").cond(onehot)
    assert pooled.shape == (1, 2, 4, 4, 4)
    assert pooled[0, 0, 0].eq(1).all() and pooled[0, 0, 1].eq(0).all() and pooled[0, 0, 2:].eq(-1).all()
    assert pooled[0, 1].eq(-1).all()  # label 2 is nowhere
    torch.testing.assert_close(S.WaveletSpace(2, cond="pool").cond(onehot), F.avg_pool3d(onehot, 4))
    haar = S.WaveletSpace(1, cond="haar")
    assert haar.cond(onehot).shape == (1, 16, 4, 4, 4) and haar.cond_channels(2) == 16
    torch.testing.assert_close(haar.decode(haar.cond(onehot)), onehot)  # nothing of the mask is lost
    assert S.WaveletSpace(2, cond="pool").cond_channels(3) == 3 and S.PixelSpace().cond_channels(3) == 3
    assert S.WaveletSpace(2).cond_channels(3) == 3 * 64  # the default: the subbands (docs/design.md, "Spaces")


@pytest.mark.parametrize("levels", [1, 2])
def test_the_label_map_condition_is_one_set_of_subbands_and_keeps_the_mask(levels):
    """wavelet_cond labelmap: the subbands of one label-index map, 8^levels channels for any number of labels;
    decoding it gives the index map exactly, so every voxel's label comes back. Zeros (the null condition)
    stay zeros."""
    generator = torch.Generator().manual_seed(3)
    mask = torch.randint(0, 4, (2, 1, 8, 8, 8), generator=generator)  # background and labels 1-3
    onehot = torch.cat([mask == k for k in (1, 2, 3)], 1).float() * 2 - 1
    space = S.WaveletSpace(levels, cond="labelmap")
    cond = space.cond(onehot)
    assert cond.shape == (2, 8**levels, *[8 // 2**levels] * 3) and space.cond_channels(3) == 8**levels
    index = space.decode(cond)
    torch.testing.assert_close(index, mask.float() * 2 / 3 - 1)
    assert torch.equal(((index + 1) * 3 / 2).round().long(), mask)
    assert space.cond(torch.zeros_like(onehot)).eq(0).all()
    # two masks that differ in one voxel's label give different conditions
    other = mask.clone()
    other[0, 0, 1, 2, 3] = (other[0, 0, 1, 2, 3] + 1) % 4
    assert not torch.equal(space.cond(torch.cat([other == k for k in (1, 2, 3)], 1).float() * 2 - 1), cond)


def test_pixel_space_is_the_identity():
    x = volumes((1, 2, 4, 4, 4))
    p = S.PixelSpace()
    assert p.encode(x) is x and p.decode(x) is x and p.cond(x) is x
    assert p.latent_shape(2, [4, 6, 8]) == (2, 4, 6, 8)


def test_bad_shapes_and_settings_are_refused():
    with pytest.raises(ValueError, match="even"):
        S.haar3d(torch.zeros(1, 1, 4, 4, 5))
    with pytest.raises(ValueError, match="divisible by 4"):
        S.WaveletSpace(2).latent_shape(1, [16, 16, 18])
    with pytest.raises(ValueError, match="1 or 2"):
        S.WaveletSpace(3)
    with pytest.raises(ValueError, match="pool, haar"):
        S.WaveletSpace(1, cond="learned")


def test_config_keys_choose_the_space_and_check_divisibility():
    cfg = configure(
        C.Config(),
        channels=[8, 16, 16],
        attention_levels=[False, False, False],
        norm_num_groups=4,
        image_size=[32, 32, 16],
        space="wavelet",
        wavelet_levels=2,
    )
    space = S.make_space(cfg)
    assert isinstance(space, S.WaveletSpace) and space.levels == 2
    assert isinstance(S.make_space(C.Config()), S.PixelSpace)
    # 3 UNet levels need 4 | size; 2 wavelet levels make it 16 | size
    with pytest.raises(C.ConfigError, match=r"divisible by 16 \(2\^\(levels-1\) for 3 levels × 2\^2"):
        configure(cfg, image_size=[32, 32, 24])
    configure(cfg, image_size=[32, 32, 24], wavelet_levels=1)  # 8 | 24
    configure(cfg, image_size=[36, 36, 36], space="pixel")  # 4 | 36
    for bad in (0, 3):
        with pytest.raises(C.ConfigError, match="wavelet_levels"):
            configure(C.Config(), wavelet_levels=bad)


def test_wavelet_cond_key_chooses_the_condition_and_the_model_follows(tmp_path):
    """data.wavelet_cond reaches the space and the model: the pooled fractions are one channel per label,
    so the UNet's first level widens only to 8 subbands + 2 labels (10, rounded up to 4 groups: 12), where
    the subbands' 8 + 16 channels take it to 24."""
    cfg = tiny_config(tmp_path, space="wavelet", size=16)
    assert S.make_space(cfg).cond_kind == "haar" and cfg.data.wavelet_cond == "haar"
    pooled = configure(cfg, wavelet_cond="pool")
    space = S.make_space(pooled)
    assert space.cond_kind == "pool" and space.cond_channels(2) == 2
    model = build_model(pooled)
    assert model.cond_channels == 2 and model.unet.conv_in.conv.in_channels == 8 + 2
    m = pooled.model
    assert model.unet.conv_in.conv.out_channels == unet_channels(m.channels, 8 + 2, m.norm_num_groups)[0] == 12
    assert build_model(cfg).unet.conv_in.conv.out_channels == 24  # haar: 8 subbands + 2 labels × 8 in
    labelmap = configure(cfg, wavelet_cond="labelmap")  # one label-index map's 8 subbands: 8 + 8 in
    model = build_model(labelmap)
    assert model.cond_channels == 8 and model.unet.conv_in.conv.in_channels == 16
    assert model.unet.conv_in.conv.out_channels == 16  # the demo's own first level: not widened
    with pytest.raises(C.ConfigError, match="wavelet_cond"):
        configure(cfg, wavelet_cond="learned")
    hint = typing.get_type_hints(C.DataConfig)["wavelet_cond"]
    assert set(typing.get_args(hint)) == set(S.COND_KINDS) and C.DataConfig().wavelet_cond == S.DEFAULT_COND


def test_the_demo_recipe_in_wavelet_space_conditions_on_the_label_map():
    """The user's `train.py --space wavelet --image_size [64,64,64]` on the demo config: the label map's 8
    subbands beside the image's 8, so the demo's 16-channel first level is not widened (the step cost
    measured in docs/design.md, "Spaces")."""
    cfg = C.load(configs.find("default")).override(space="wavelet", image_size=[64, 64, 64])
    assert cfg.data.wavelet_cond == "labelmap" and S.make_space(cfg).cond_channels(len(cfg.data.labels)) == 8
    conv_in = build_model(cfg).unet.conv_in.conv
    assert (conv_in.in_channels, conv_in.out_channels) == (16, cfg.model.channels[0]) == (16, 16)
    assert C.Config().data.wavelet_cond == "haar"  # the built-in default, as the bundled 128³/BraTS models use


# ---- a sampler's oracle in subband space --------------------------------------------------------------
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_a_perfect_velocity_field_in_subband_space_decodes_to_the_image(levels, sampler):
    """Data = one image x* (a point mass): in subband space the exact velocity is (z_t - z*) / t, the flow
    samplers transport the noise onto z* = encode(x*) exactly, and the decoded sample is x* voxel for voxel."""
    space = S.WaveletSpace(levels)
    image = volumes((1, 2, 8, 8, 8), seed=5)
    target = space.encode(image)

    def exact(z_t, t_scaled, cond):
        return (z_t - target) / (t_scaled / FLOW_TIME_SCALE).view(-1, 1, 1, 1, 1)

    flow = RectifiedFlow(shift=2.0, clip_x0=False)
    z = flow.sample(exact, (3, *space.latent_shape(2, [8, 8, 8])), sampler=sampler, steps=3, seeds=[1, 2, 3])
    torch.testing.assert_close(space.decode(z), image.expand(3, -1, -1, -1, -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("levels", [1, 2])
def test_clip_x0_in_wavelet_space_clamps_the_decoded_image_not_the_subbands(levels):
    """A checkerboard of ±1 is a valid image whose high bands lie far outside [-1, 1] (its HHH band is ±√8).
    With clip_x0 the space's clamp keeps the exact oracle exact; clamping every subband to [-1, 1] (the pixel
    rule) would flatten it."""
    space = S.WaveletSpace(levels)
    idx = torch.arange(8)
    board = ((idx.view(8, 1, 1) + idx.view(1, 8, 1) + idx.view(1, 1, 8)) % 2 * 2 - 1).float()
    image = board.view(1, 1, 8, 8, 8)
    target = space.encode(image)
    assert target.abs().max() > 2  # the subbands of a valid image leave [-1, 1]

    def exact(z_t, t_scaled, cond):
        return (z_t - target) / (t_scaled / FLOW_TIME_SCALE).view(-1, 1, 1, 1, 1)

    shape = (2, *space.latent_shape(1, [8, 8, 8]))
    flow = RectifiedFlow(shift=2.0, clip_x0=True, clamp=space.clamp)
    good = flow.sample(exact, shape, sampler="heun", steps=3, seeds=[1, 2])
    torch.testing.assert_close(space.decode(good), image.expand(2, -1, -1, -1, -1), rtol=0, atol=1e-5)
    bad = RectifiedFlow(shift=2.0, clip_x0=True).sample(exact, shape, sampler="heun", steps=3, seeds=[1, 2])
    assert (space.decode(bad) - image).abs().max() > 0.25  # the checkerboard shrunk by a third
    # and the clamp is the image's: a decoded volume out of range comes back in [-1, 1], one in range unchanged
    z = space.encode(image * 3)
    assert space.decode(space.clamp(z)).abs().max() <= 1 + 1e-6
    torch.testing.assert_close(space.clamp(target), target, rtol=0, atol=1e-6)


def test_the_objective_of_a_wavelet_config_clamps_in_image_space():
    from diffusion3d.diffusion import make_diffusion

    for prediction, sampler in (("flow", "heun"), ("eps", "ddim")):
        cfg = configure(C.Config(), space="wavelet", prediction=prediction, sampler=sampler, image_size=[8, 8, 8])
        z = S.WaveletSpace(1).encode(volumes((1, 1, 8, 8, 8)).sign())  # high bands beyond [-1, 1]
        torch.testing.assert_close(make_diffusion(cfg).clamp(z), z, rtol=0, atol=1e-6)
        pixel = configure(C.Config(), prediction=prediction, sampler=sampler, image_size=[8, 8, 8])
        assert make_diffusion(pixel).clamp(z).abs().max() <= 1


@pytest.mark.parametrize("levels", [1, 2])
def test_the_weighted_subband_error_is_the_decoded_images_error(levels):
    """An error e in the subbands weighted by ``error_weight`` has the mean square of decode's error: the
    loss in wavelet space counts a mistake in a region's mean as pixel space does (unweighted: 9× less)."""
    space = S.WaveletSpace(levels)
    x, e = volumes((2, 3, 8, 8, 8), seed=1), volumes((2, 3, 8, 8, 8), seed=2) * 0.1
    z, z_err = space.encode(x), space.encode(x + e) - space.encode(x)
    weighted = (z_err.square() * space.error_weight(z)).mean()
    torch.testing.assert_close(weighted, e.square().mean(), rtol=1e-5, atol=0)
    # a wrong mean intensity (a constant error) lies in the all-low band alone: unweighted it counts 9^levels× less
    bias = torch.full_like(x, 0.1)
    z_bias = space.encode(x + bias) - z
    torch.testing.assert_close((z_bias.square() * space.error_weight(z)).mean(), torch.tensor(0.01), rtol=1e-4, atol=0)
    torch.testing.assert_close(z_bias.square().mean(), torch.tensor(0.01 / 9**levels), rtol=1e-4, atol=0)
    assert S.PixelSpace().error_weight(x) is None


@pytest.mark.parametrize("loss", ["l2", "l1"])
def test_the_wavelet_objectives_loss_weighs_the_low_pass_band(loss):
    from diffusion3d.diffusion import make_diffusion

    cfg = configure(C.Config(), space="wavelet", prediction="flow", sampler="heun", loss=loss, image_size=[8, 8, 8])
    flow = make_diffusion(cfg)
    x0 = S.WaveletSpace(1).encode(volumes((2, 1, 8, 8, 8)))
    for band, factor in ((0, 9.0), (3, 1.0)):  # the low-pass band (scaled by 1/3) and a high band
        offset = torch.zeros_like(x0)
        offset[:, band] = 0.2

        t, noise = flow.draw([0, 1], x0.shape[1:])  # what loss() draws for samples 0 and 1
        velocity = flow.target(x0, t, noise)

        def off_by(x_t, t, cond, wrong=velocity + offset):  # the exact velocity of each sample, plus an offset
            return wrong

        per_sample = flow.loss(off_by, x0, None, [0, 1])
        expected = (0.2**2 * factor if loss == "l2" else 0.2 * factor**0.5) / 8  # one band of 8
        torch.testing.assert_close(per_sample, torch.full((2,), expected), rtol=1e-5, atol=0)
