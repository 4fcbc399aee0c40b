"""train.optimizer: Muon on the hidden weights with AdamW on the rest, against torch's own optimizers."""

from __future__ import annotations

import typing

import pytest
import torch

from diffusion3d import checkpoint
from diffusion3d import config as C
from diffusion3d.data import discover
from diffusion3d.model import build_model
from diffusion3d.optimizer import OPTIMIZERS, MuonWithAdamW, build_optimizer, orthogonalize, split_parameters
from diffusion3d.trainer import build_trainer
from tests.helpers import tiny_config


def test_steps_equal_torch_muon_and_adamw(monkeypatch):
    """A conv weight's Muon step is torch.optim.Muon's on its out × (in·k³) view ("match_rms_adamw", Nesterov
    0.95, decoupled weight decay), with torch's Newton–Schulz run in fp32 as here; a bias's step is
    torch.optim.AdamW's. Five steps, bit for bit."""
    fp32 = lambda g, coefficients, steps, eps: orthogonalize(g, steps, eps)  # noqa: E731
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", fp32)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3, 3))
    b = torch.nn.Parameter(torch.randn(8))
    w_ref, b_ref = w.detach().clone(), b.detach().clone().requires_grad_()
    view = w_ref.view(8, -1)  # shares w_ref's storage: torch's Muon updates w_ref through it
    ours = MuonWithAdamW([{"params": [w], "muon": True}, {"params": [b], "muon": False}], 1e-3, (0.9, 0.999), 0.01)
    muon = torch.optim.Muon([view], lr=1e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([b_ref], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    start = w.detach().clone()
    for _ in range(5):
        g, gb = torch.randn(8, 4, 3, 3, 3), torch.randn(8)
        w.grad, view.grad, b.grad, b_ref.grad = g.clone(), g.view(8, -1).clone(), gb.clone(), gb.clone()
        for opt in (ours, muon, adamw):
            opt.step()
    assert not torch.equal(w.detach(), start)
    assert torch.equal(w.detach(), w_ref)
    assert torch.equal(b.detach(), b_ref.detach())


@pytest.mark.parametrize("shape", [(16, 108), (108, 16)])
def test_orthogonalize_brings_every_singular_value_near_one(shape):
    """Singular values spread over two decades come out within Newton–Schulz's band around 1, in the
    input's singular directions (the product with the input is symmetric positive semi-definite)."""
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(shape[0], min(shape)))
    v, _ = torch.linalg.qr(torch.randn(shape[1], min(shape)))
    s = torch.logspace(-1, 1, min(shape))
    g = u @ torch.diag(s) @ v.T
    out = orthogonalize(g)
    assert out.shape == g.shape and out.dtype == torch.float32
    sv = torch.linalg.svdvals(out)
    assert sv.min() > 0.6 and sv.max() < 1.25
    assert torch.linalg.svdvals(g).min() < 0.2  # the input's were not
    gram = out.T @ g if shape[0] > shape[1] else g @ out.T
    assert torch.allclose(gram, gram.T, atol=1e-4) and torch.linalg.eigvalsh(gram).min() > -1e-4


def test_split_puts_hidden_weights_on_muon_and_the_rest_on_adamw(tmp_path):
    """Every parameter is in exactly one group; the first and last convs, biases and norms are AdamW's."""
    cfg = tiny_config(tmp_path, space="wavelet")
    model = build_model(cfg)
    muon, adamw = split_parameters(model)
    ids = [id(p) for p in muon + adamw]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert all(p.dim() >= 2 for p in muon) and len(muon) > 10
    on_adamw = {id(p) for p in adamw}
    assert id(model.unet.conv_in.conv.weight) in on_adamw and id(model.unet.out[2].conv.weight) in on_adamw
    assert all(id(p) in on_adamw for p in model.parameters() if p.dim() < 2)
    assert id(model.unet.down_blocks[0].resnets[0].conv1.conv.weight) not in on_adamw


def test_build_optimizer_names_and_errors(tmp_path):
    model = build_model(tiny_config(tmp_path))
    assert isinstance(build_optimizer(model, "adamw", 1e-3, [0.9, 0.999], 0.0), torch.optim.AdamW)
    muon = build_optimizer(model, "muon", 1e-3, [0.9, 0.999], 0.0, muon_lr_ratio=3.0)
    assert [(g["muon"], g["lr"], g["lr_ratio"]) for g in muon.param_groups] == [(False, 1e-3, 1.0), (True, 3e-3, 3.0)]
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer(model, "sgd", 1e-3, [0.9, 0.999], 0.0)
    with pytest.raises(ValueError, match="rank 2"):
        MuonWithAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "muon": True}], 1e-3, (0.9, 0.999), 0.0)
    literal = typing.get_type_hints(C.TrainConfig)["optimizer"]
    assert typing.get_args(literal) == OPTIMIZERS


@pytest.mark.parametrize("space", [{}, {"space": "wavelet"}], ids=["pixel", "wavelet"])
def test_muon_run_keeps_the_split_invariance_and_differs_from_adamw(tmp_path, space):
    """3 Muon steps as 2 × 1 and 1 × 2 give the same weights (the orthogonalisation sees the same accumulated
    gradient), in both spaces; AdamW from the same start ends elsewhere, so the Muon groups did step."""
    weights = {}
    for name, bs, accum, optimizer in (("2x1", 2, 1, "muon"), ("1x2", 1, 2, "muon"), ("adamw", 2, 1, "adamw")):
        cfg = tiny_config(
            tmp_path / name,
            batch_size=bs,
            gradient_accumulate_every=accum,
            max_grad_norm=1e9,
            optimizer=optimizer,
            **space,
        )
        trainer = build_trainer(cfg, discover(cfg), "cpu", None)
        assert isinstance(trainer.optimizer, MuonWithAdamW) == (optimizer == "muon")
        for _ in range(3):
            trainer.train_step()
        weights[name] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    scale = weights["2x1"].abs().max()
    assert (weights["2x1"] - weights["1x2"]).abs().max() <= 1e-5 * scale
    assert (weights["2x1"] - weights["adamw"]).abs().max() > 1e-4 * scale


def test_trainer_schedules_each_group_at_its_ratio(tmp_path):
    """The warmup's lr reaches AdamW's group as it is and Muon's times muon_lr_ratio."""
    cfg = tiny_config(tmp_path, optimizer="muon", muon_lr_ratio=3.0, lr=1e-3, warmup_steps=4)
    trainer = build_trainer(cfg, discover(cfg), "cpu", None)
    trainer.train_step()
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([2.5e-4, 7.5e-4])


def test_switching_the_optimizer_breaks_resume_and_its_ratio_does_not():
    """AdamW's moments and Muon's buffers do not carry over: a checkpoint refuses the other optimizer.
    The ratio is an lr: it may change on resume, as lr may."""
    adamw = C.Config().to_dict()
    muon = C.Config().override(optimizer="muon").to_dict()
    assert checkpoint.config_differences(adamw, muon) == (["train.optimizer: 'adamw' -> 'muon'"], [])
    ratio = C.Config().override(optimizer="muon", muon_lr_ratio=3.0).to_dict()
    assert checkpoint.config_differences(muon, ratio) == ([], ["train.muon_lr_ratio: 1.0 -> 3.0"])
    with pytest.raises(C.ConfigError, match="^muon_lr_ratio: must be positive, got 0.0$"):
        C.Config().override(muon_lr_ratio=0.0)
