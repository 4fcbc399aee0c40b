"""The run's optimizer (``train.optimizer``): AdamW, or Muon on the hidden weights with AdamW on the rest.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks") steps each hidden weight
along its orthogonalised momentum: the momentum matrix with its singular values brought to about 1 by five
quintic Newton–Schulz iterations, so that every direction of the weight moves, not only the few that dominate
the gradient. A conv weight (out, in, k, k, k) is the out × (in·k³) matrix. The update is scaled to AdamW's
RMS, 0.2·√max(rows, columns) (Liu et al. 2025, "Muon is scalable for LLM training"; torch's
``adjust_lr_fn="match_rms_adamw"``), so ``lr``, its warmup and schedule and ``weight_decay`` (decoupled, as
AdamW's) carry over unchanged. The first conv (it reads the image and the mask), the last (it writes the
output) and every parameter of rank < 2 (biases, norms) stay on AdamW, as in Keller Jordan's
``MuonWithAuxAdam``. One optimizer holds both kinds of group, so the GradScaler, the clip, the lr schedule and
the checkpoint see one optimizer whatever the choice.

Written here rather than taken from a package: ``torch.optim.Muon`` accepts 2-D parameters only (a conv
weight raises) and runs Newton–Schulz in bf16, which CPUs without AVX512-BF16 emulate (one 64 × 1728 matrix:
0.088 s in bf16 against 0.016 s in fp32, measured on the project's CI machine); PyPI's ``muon-optimizer``
(Keller Jordan's reference) flattens 4-D conv weights only and its distributed class needs a process group.
The iteration and its coefficients below are theirs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic, as in torch.optim.Muon
NS_STEPS = 5
MUON_MOMENTUM = 0.95  # Nesterov, torch.optim.Muon's default
ADAMW_EPS = 1e-8  # torch.optim.AdamW's default
# Parameters that stay on AdamW whatever their rank: the network's first and last layer (module name prefixes).
ADAMW_ONLY = ("unet.conv_in.", "unet.out.")


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """About U Vᵀ of the matrix g = U S Vᵀ (singular values brought into roughly [0.7, 1.2]) by quintic
    Newton–Schulz in fp32: x ← a x + (b A + c A²) x with A = x xᵀ, after scaling x to spectral norm ≤ 1."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class MuonWithAdamW(torch.optim.Optimizer):
    """Groups with ``muon`` True take Muon steps (weights of rank ≥ 2), the others AdamW's. Every group has
    ``lr``, ``lr_ratio`` (the trainer sets ``lr`` to the scheduled lr times it) and ``weight_decay``."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        for group in groups:
            if group["muon"] and any(p.dim() < 2 for p in group["params"]):
                raise ValueError("Muon groups take weights of rank 2 or more")
        defaults = dict(
            lr=lr,
            lr_ratio=1.0,
            weight_decay=weight_decay,
            betas=tuple(betas),
            eps=ADAMW_EPS,
            momentum=MUON_MOMENTUM,
            muon=False,
        )
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch.optim.Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if wd:
                    p.mul_(1 - lr * wd)
                if group["muon"]:
                    self._muon(p, group["momentum"], lr)
                else:
                    self._adamw(p, group["betas"], group["eps"], lr)
        return loss

    def _muon(self, p: torch.Tensor, momentum: float, lr: float) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buf, momentum)  # Nesterov, as torch.optim.Muon
        matrix = update.reshape(p.shape[0], -1)
        scale = 0.2 * math.sqrt(max(matrix.shape))  # AdamW's update RMS
        p.add_(orthogonalize(matrix).view_as(p).to(p.dtype), alpha=-lr * scale)

    def _adamw(self, p: torch.Tensor, betas: tuple[float, float], eps: float, lr: float) -> None:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = float(state["step"])
        b1, b2 = betas
        state["exp_avg"].lerp_(p.grad, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**step)).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**step))


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's): the hidden weights of rank ≥ 2, and the first and last layers with every
    parameter of rank < 2."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        hidden = p.dim() >= 2 and not name.startswith(ADAMW_ONLY)
        (muon if hidden else adamw).append(p)
    return muon, adamw


def build_optimizer(
    model: nn.Module,
    kind: str,
    lr: float,
    betas: Iterable[float],
    weight_decay: float,
    muon_lr_ratio: float = 1.0,
) -> torch.optim.Optimizer:
    """``adamw``: torch's AdamW on every parameter. ``muon``: AdamW on the first and last layers, biases and
    norms (the first group, at ``lr``), Muon on ``split_parameters``' hidden weights at ``lr × muon_lr_ratio``,
    in one optimizer. Each group's ``lr_ratio`` is what the trainer multiplies its scheduled lr by."""
    betas = tuple(betas)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "muon":
        if muon_lr_ratio <= 0:
            raise ValueError(f"muon_lr_ratio must be positive, got {muon_lr_ratio}")
        muon, adamw = split_parameters(model)
        groups = [
            {"params": adamw, "muon": False, "lr": lr, "lr_ratio": 1.0},
            {"params": muon, "muon": True, "lr": lr * muon_lr_ratio, "lr_ratio": float(muon_lr_ratio)},
        ]
        return MuonWithAdamW([g for g in groups if g["params"]], lr, betas, weight_decay)
    raise ValueError(f"unknown optimizer {kind!r} (choose from {', '.join(OPTIMIZERS)})")
