"""The denoiser: shapes, the conditioning contract, activation checkpointing (same outputs and gradients),
plain tensors in and out, and a tiny model that overfits one phantom pair on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from monai.data import MetaTensor

from diffusion3d.diffusion import GaussianDiffusion
from diffusion3d.model import Denoiser, build_model, count_parameters
from tests.helpers import phantom, tiny_config

SIZE = 16


def tiny_model(**kwargs) -> Denoiser:
    torch.manual_seed(0)
    args = dict(image_channels=1, cond_channels=2, channels=[8, 16], attention_levels=[False, True],
                num_head_channels=8, norm_num_groups=4)
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


def test_build_model_from_config(tmp_path):
    cfg = tiny_config(tmp_path, activation_checkpointing=True)
    model = build_model(cfg)
    assert model.activation_checkpointing and model.cond_channels == cfg.cond_channels
    assert count_parameters(model) == sum(p.numel() for p in model.parameters()) > 0
    assert not build_model(tiny_config(tmp_path / "b")).activation_checkpointing


def test_tiny_model_overfits_one_phantom_pair():
    """The whole training path (draw, q_sample, loss, backward) learns: loss on fixed held-out draws falls."""
    x0, cond = phantom_pair()
    model = tiny_model()
    diffusion = GaussianDiffusion(50, loss="l2", seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    eval_ids = list(range(1000, 1008))  # the same timesteps and noise before and after

    def eval_loss() -> float:
        with torch.no_grad():
            return diffusion.loss(model, x0.expand(8, -1, -1, -1, -1), cond.expand(8, -1, -1, -1, -1), eval_ids).mean().item()

    start = eval_loss()
    for step in range(30):
        loss = diffusion.loss(model, x0.expand(2, -1, -1, -1, -1), cond.expand(2, -1, -1, -1, -1), [2 * step, 2 * step + 1])
        optimizer.zero_grad(set_to_none=True)
        loss.mean().backward()
        optimizer.step()
    end = eval_loss()
    assert end < 0.5 * start, f"loss {start:.3f} -> {end:.3f}"
