"""The denoiser: shapes, the conditioning contract, activation checkpointing (same outputs and gradients),
plain tensors in and out, and a tiny model that overfits one phantom pair on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from monai.data import MetaTensor

from diffusion3d.diffusion import GaussianDiffusion
from diffusion3d.model import Denoiser, build_model, count_parameters, unet_channels
from tests.helpers import phantom, tiny_config

SIZE = 16


def tiny_model(**kwargs) -> Denoiser:
    torch.manual_seed(0)
    args = dict(
        image_channels=1,
        cond_channels=2,
        channels=[8, 16],
        attention_levels=[False, True],
        num_head_channels=8,
        norm_num_groups=4,
    )
    args.update(kwargs)
    return Denoiser(**args)


def inputs(batch: int = 2, cond_channels: int = 2, size: int = SIZE):
    g = torch.Generator().manual_seed(1)
    x_t = torch.randn((batch, 1, size, size, size), generator=g)
    cond = torch.randn((batch, cond_channels, size, size, size), generator=g).sign()
    t = torch.randint(0, 50, (batch,), generator=g)
    return x_t, t, cond


def phantom_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """One phantom as the trainer sees it: image in [-1, 1], labels 1 and 2 as channels in {-1, 1}."""
    image, mask = phantom(SIZE, 0)
    x0 = torch.from_numpy(image)[None, None] * 2 - 1
    labels = torch.from_numpy(mask)[None].long()
    cond = torch.stack([labels == 1, labels == 2], 1).float() * 2 - 1
    return x0, cond


def test_output_shape_and_plain_tensor():
    model = tiny_model()
    x_t, t, cond = inputs()
    out = model(x_t, t, cond)
    assert out.shape == x_t.shape and type(out) is torch.Tensor
    assert tiny_model(cond_channels=0)(x_t, t, None).shape == x_t.shape


def test_metatensors_are_fed_as_plain_tensors():
    model = tiny_model()
    x_t, t, cond = inputs()
    with torch.no_grad():
        expected = model(x_t, t, cond)
        out = model(MetaTensor(x_t), t, MetaTensor(cond))
    assert type(out) is torch.Tensor, "a MetaTensor reached the network"
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("cond_channels", [None, 1, 3])
def test_condition_channels_are_enforced(cond_channels):
    model = tiny_model()
    x_t, t, _ = inputs()
    cond = None if cond_channels is None else inputs(cond_channels=cond_channels)[2]
    with pytest.raises(ValueError, match="condition channels"):
        model(x_t, t, cond)


def test_activation_checkpointing_changes_no_output_or_gradient():
    plain = tiny_model(attention_levels=[True, True])
    ckpt = copy.deepcopy(plain)
    ckpt.enable_activation_checkpointing()
    ckpt.enable_activation_checkpointing()  # idempotent: no double wrapping
    # count the block's real forward calls: with checkpointing the backward pass recomputes it
    block = ckpt.unet.down_blocks[0]
    calls = []
    inner = block.forward.forward
    block.forward.forward = lambda *a, **k: (calls.append(1), inner(*a, **k))[1]
    x_t, t, cond = inputs(size=8)  # 8³ keeps full-resolution attention cheap
    out_plain, out_ckpt = plain(x_t, t, cond), ckpt(x_t, t, cond)
    torch.testing.assert_close(out_ckpt, out_plain, rtol=0, atol=1e-6)
    out_plain.square().mean().backward()
    out_ckpt.square().mean().backward()
    assert len(calls) == 2, "checkpointing did not recompute the block in backward"
    grads_plain = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads_plain[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():
        ckpt(x_t, t, cond)
    assert len(calls) == 3, "without gradients a block runs once"


def tiny_unet_parameters_by_hand(image_channels: int, cond_channels: int, a: int = 8) -> int:
    """Parameters of MONAI's DiffusionModelUNet in the tiny layout (channels a/16 with a = 8, attention at level 2
    only, one res block per level, time embedding 4 × a), counted layer by layer from its architecture."""

    def conv(i: int, o: int, k: int = 3) -> int:
        return i * o * k**3 + o

    def linear(i: int, o: int) -> int:
        return i * o + o

    def norm(c: int) -> int:
        return 2 * c

    te = 4 * a  # the time embedding's width: 4 × the first level's channels

    def res(i: int, o: int) -> int:  # norm, conv, time projection, norm, conv, 1³ skip conv if the width changes
        return norm(i) + conv(i, o) + linear(te, o) + norm(o) + conv(o, o) + (conv(i, o, 1) if i != o else 0)

    def attention(c: int) -> int:  # norm, q, k, v, out
        return norm(c) + 4 * linear(c, c)

    stem = conv(image_channels + cond_channels, a) + linear(a, te) + linear(te, te)
    down = res(a, a) + conv(a, a) + res(a, 16) + attention(16)  # level 1 downsamples; level 2 is the last
    middle = res(16, 16) + attention(16) + res(16, 16)
    # up: each res block takes the skip of one down output (16, then a at level 2; a, a at level 1)
    up = res(16 + 16, 16) + res(16 + a, 16) + 2 * attention(16) + conv(16, 16) + res(16 + a, a) + res(a + a, a)
    head = norm(a) + conv(a, image_channels)
    return stem + down + middle + up + head


def test_the_first_level_is_raised_to_the_input_channels_only_where_narrower():
    assert unet_channels([16, 32, 64], 3, 8) == [16, 32, 64]  # pixel space: 1 image + 2 label channels
    assert unet_channels([16, 32, 64], 8 + 16, 8) == [24, 32, 64]  # wavelet-1: 8 subbands + 2 labels × 8
    assert unet_channels([16, 32, 64], 25, 8) == [32, 32, 64]  # rounded up to the GroupNorm groups
    assert unet_channels([64, 64, 128], 64, 32) == [64, 64, 128]  # brats_192 in wavelet-1: already as wide


def test_count_parameters_counts_each_tensor_once():
    conv = torch.nn.Conv3d(3, 8, 3)
    assert count_parameters(conv) == 3 * 8 * 27 + 8
    assert count_parameters(torch.nn.Sequential(conv, conv)) == 3 * 8 * 27 + 8  # a shared layer counts once


def test_build_model_from_config(tmp_path):
    """build_model passes the config's layout to the UNet: the parameter count of the tiny layout, with and
    without the two mask channels, and activation checkpointing as configured."""
    cfg = tiny_config(tmp_path, activation_checkpointing=True)
    model = build_model(cfg)
    assert model.activation_checkpointing and (cfg.image_channels, cfg.cond_channels) == (1, 2)
    assert model.cond_channels == 2 and count_parameters(model) == tiny_unet_parameters_by_hand(1, 2) == 112_505
    plain = build_model(tiny_config(tmp_path / "b", with_condition=False))
    assert not plain.activation_checkpointing and plain.cond_channels == 0
    assert count_parameters(plain) == tiny_unet_parameters_by_hand(1, 0)


@pytest.mark.parametrize("levels", [1, 2])
def test_wavelet_space_model_takes_the_subbands_as_channels(tmp_path, levels):
    """In wavelet space the UNet reads and predicts 8^levels subbands per image channel (2 channels here),
    takes the condition's subbands (8^levels per label), and runs on the grid shrunk by 2^levels. Its first
    level (8 channels in the tiny layout) is widened to the 4 × 8^levels channels each voxel brings in."""
    cfg = tiny_config(tmp_path, space="wavelet", wavelet_levels=levels, image_channels=2, size=32)
    model = build_model(cfg)
    bands = 8**levels
    assert (model.image_channels, model.cond_channels) == (2 * bands, 2 * bands)
    assert model.unet.conv_in.conv.out_channels == 4 * bands
    assert count_parameters(model) == tiny_unet_parameters_by_hand(2 * bands, 2 * bands, a=4 * bands)
    side = 32 // 2**levels
    x_t = torch.randn(1, 2 * bands, side, side, side)
    assert model(x_t, torch.tensor([3]), torch.ones(1, 2 * bands, side, side, side)).shape == x_t.shape


def test_tiny_model_overfits_one_phantom_pair():
    """The whole training path (draw, q_sample, loss, backward) learns: loss on fixed held-out draws falls."""
    x0, cond = phantom_pair()
    model = tiny_model()
    diffusion = GaussianDiffusion(50, loss="l2", seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    eval_ids = list(range(1000, 1008))  # the same timesteps and noise before and after

    def eval_loss() -> float:
        with torch.no_grad():
            return (
                diffusion.loss(model, x0.expand(8, -1, -1, -1, -1), cond.expand(8, -1, -1, -1, -1), eval_ids)
                .mean()
                .item()
            )

    start = eval_loss()
    for step in range(30):
        loss = diffusion.loss(
            model, x0.expand(2, -1, -1, -1, -1), cond.expand(2, -1, -1, -1, -1), [2 * step, 2 * step + 1]
        )
        optimizer.zero_grad(set_to_none=True)
        loss.mean().backward()
        optimizer.step()
    end = eval_loss()
    assert end < 0.5 * start, f"loss {start:.3f} -> {end:.3f}"
