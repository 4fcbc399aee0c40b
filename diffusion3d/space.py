"""The space the diffusion runs in: the image's own voxels (``pixel``) or its Haar subbands (``wavelet``).

WDM-3D (Friedrich et al. 2024, github pfriedri/wdm-3d) trains the denoiser on the 3D discrete Haar
wavelet transform of the volume: one level turns each N³ image channel into 8 subbands of (N/2)³ stacked
as channels, the inverse is exact, and the UNet runs at half the resolution. Here ``levels`` 2 applies the
same level to every subband again (the full wavelet-packet tree): 64 subbands of (N/4)³ per channel. Both
are orthonormal, so the transform keeps every voxel's information and the noise stays white and unit-scale.

Scaling. A level's low-pass band (the block sum / √8) of an image in [-1, 1] lies in [-√8, √8] ≈ [-2.83,
2.83], while the high bands of a smooth image are near 0. WDM divides the low-pass band by
``LOWPASS_SCALE`` = 3 (their ``dwt`` output ``LLL / 3.``) so that it lies in [-0.94, 0.94], like the image
the diffusion was tuned for; the high bands keep the orthonormal scale. Each level here does the same, so
at 2 levels the all-low band is divided by 9 and a band that went through one low pass by 3.

The space is the one place that knows it: ``Trainer`` encodes each micro-batch's image and condition before
``Diffusion.loss``, and ``sampling.generate`` samples in ``latent_shape`` and decodes before the volume goes
back to its mask's grid; noise, loss, guidance and the samplers see plain tensors and are unchanged.

The mask condition on the subband grid (``cond``), two ways (``data.wavelet_cond``):

- ``haar`` (the default): the {-1, 1} one-hot's own Haar subbands, encoded like the image: 8^levels
  channels per label, which keep where inside each block a boundary runs (the mask is recoverable exactly).
- ``pool``: the one-hot average-pooled over each 2^levels block, i.e. every label's fraction of the block
  rescaled to [-1, 1]; one channel per label.
- ``labelmap``: the Haar subbands of one label-index map (background -1, the k-th of L labels
  -1 + 2k/L), encoded like the image: 8^levels channels whatever the number of labels. The mask is still
  recoverable exactly (decode, then the nearest index), at the input width of one label's subbands.

docs/design.md ("Spaces") has the measurement that chose ``haar`` and the reason for writing the
transform here instead of depending on ``ptwt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

LOWPASS_SCALE = 3.0  # WDM-3D's divisor of the low-pass band (its dwt returns LLL / 3.)
COND_KINDS = ("pool", "haar", "labelmap")
DEFAULT_COND = "haar"  # chosen by measurement (docs/design.md, "Spaces")


class Space(Protocol):
    """Where the diffusion runs: ``encode`` an image batch [B, C, *size] to it, ``decode`` back exactly."""

    name: str
    factor: int  # the grid shrinks by this much per axis

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, z: torch.Tensor) -> torch.Tensor: ...

    def cond(self, cond: torch.Tensor) -> torch.Tensor: ...

    def clamp(self, z: torch.Tensor) -> torch.Tensor: ...

    def error_weight(self, z: torch.Tensor) -> torch.Tensor | None: ...

    def cond_channels(self, label_channels: int) -> int: ...

    def latent_shape(self, image_channels: int, image_size: Sequence[int]) -> tuple[int, ...]: ...


class PixelSpace:
    """The image's own voxels: every method is the identity."""

    name = "pixel"
    factor = 1

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z

    def cond(self, cond: torch.Tensor) -> torch.Tensor:
        return cond

    def clamp(self, z: torch.Tensor) -> torch.Tensor:
        """clip_x0: the image's voxels into [-1, 1]."""
        return z.clamp(-1, 1)

    def error_weight(self, z: torch.Tensor) -> None:
        """Every voxel's squared error counts alike."""
        return None

    def cond_channels(self, label_channels: int) -> int:
        return label_channels

    def latent_shape(self, image_channels: int, image_size: Sequence[int]) -> tuple[int, ...]:
        return (image_channels, *(int(s) for s in image_size))


# ---- the orthonormal 3D Haar transform, one level -----------------------------------------------------
def _haar_matrix(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 8×8 orthonormal 3D Haar matrix: row k = 4i + 2j + l is band (i, j, l) over the axes (D, H, W),
    0 low and 1 high; column = the voxel's offset (a, b, c) in its 2³ block, 4a + 2b + c. Symmetric and
    its own inverse."""
    h = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / 2**0.5
    return torch.kron(h, torch.kron(h, h)).to(dtype=dtype, device=device)


def _check_even(x: torch.Tensor) -> None:
    if x.dim() != 5 or any(s % 2 for s in x.shape[2:]):
        raise ValueError(f"Haar transform: expected [B, C, D, H, W] with even D, H, W, got {list(x.shape)}")


def haar3d(x: torch.Tensor) -> torch.Tensor:
    """[B, C, D, H, W] → [B, 8C, D/2, H/2, W/2]: channel c's 8 orthonormal subbands at 8c … 8c + 7 (LLL first)."""
    _check_even(x)
    b, c, d, h, w = x.shape
    blocks = x.reshape(b, c, d // 2, 2, h // 2, 2, w // 2, 2)
    m = _haar_matrix(x.dtype, x.device).view(8, 2, 2, 2)
    z = torch.einsum("kijl,bcdihjwl->bckdhw", m, blocks)
    return z.reshape(b, c * 8, d // 2, h // 2, w // 2)


def ihaar3d(z: torch.Tensor) -> torch.Tensor:
    """The exact inverse of ``haar3d``: [B, 8C, D, H, W] → [B, C, 2D, 2H, 2W]."""
    if z.dim() != 5 or z.shape[1] % 8:
        raise ValueError(f"inverse Haar transform: expected [B, 8C, D, H, W], got {list(z.shape)}")
    b, c8, d, h, w = z.shape
    bands = z.reshape(b, c8 // 8, 8, d, h, w)
    m = _haar_matrix(z.dtype, z.device).view(8, 2, 2, 2)  # symmetric and orthonormal: its own inverse
    x = torch.einsum("kijl,bckdhw->bcdihjwl", m, bands)
    return x.reshape(b, c8 // 8, d * 2, h * 2, w * 2)


def _lowpass_scale(channels: int, like: torch.Tensor) -> torch.Tensor:
    """Per-channel factor of one encoded level: 1 / LOWPASS_SCALE on each group's band 0 (LLL), else 1."""
    scale = torch.ones(channels, dtype=like.dtype, device=like.device)
    scale[0::8] = 1.0 / LOWPASS_SCALE
    return scale.view(1, channels, 1, 1, 1)


class WaveletSpace:
    """Haar subbands as channels, ``levels`` times (8^levels subbands per image channel at size / 2^levels)."""

    name = "wavelet"

    def __init__(self, levels: int = 1, cond: str = DEFAULT_COND) -> None:
        if levels not in (1, 2):
            raise ValueError(f"wavelet levels: must be 1 or 2, got {levels}")
        if cond not in COND_KINDS:
            raise ValueError(f"wavelet condition: {cond!r} is not one of {', '.join(COND_KINDS)}")
        self.levels = levels
        self.factor = 2**levels
        self.cond_kind = cond

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        z = x
        for _ in range(self.levels):
            z = haar3d(z)
            z = z * _lowpass_scale(z.shape[1], z)
        return z

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        x = z
        for _ in range(self.levels):
            x = ihaar3d(x / _lowpass_scale(x.shape[1], x))
        return x

    def clamp(self, z: torch.Tensor) -> torch.Tensor:
        """clip_x0 on subbands: decode, clamp the image to [-1, 1], encode (WDM-3D's ``clip_denoised``).
        Clamping the subbands themselves would be wrong: a sharp edge's high band lies outside [-1, 1]."""
        return self.encode(self.decode(z).clamp(-1, 1))

    def scale(self, channels: int, like: torch.Tensor) -> torch.Tensor:
        """The factor ``encode`` applies to each of its ``channels`` output channels, [1, channels, 1, 1, 1]:
        1 / 3 per low pass a band went through (WDM-3D's scale), 1 for the orthonormal high bands."""
        scale = torch.ones(1, dtype=like.dtype, device=like.device)
        for _ in range(self.levels):
            scale = (scale.view(-1, 1) * _lowpass_scale(8, like).view(1, 8)).flatten()
        return scale.repeat(channels // scale.numel()).view(1, channels, 1, 1, 1)

    def error_weight(self, z: torch.Tensor) -> torch.Tensor:
        """Per-channel weights that make the mean squared error over subbands the image's own MSE: an error e
        in a band scaled by s is an error e / s of the decoded image (the transform is orthonormal), so the
        low-pass band counts 9× (81× for the all-low band at 2 levels). Unweighted, the loss would count a
        mistake in a region's mean intensity 9× less than the same mistake in pixel space."""
        return self.scale(z.shape[1], z).square().reciprocal()

    def cond(self, cond: torch.Tensor) -> torch.Tensor:
        """The {-1, 1} one-hot [B, L, *size] on the subband grid: pooled label fractions or its subbands."""
        if self.cond_kind == "haar":
            return self.encode(cond)
        if self.cond_kind == "labelmap":
            return self.encode(label_index_map(cond))
        return F.avg_pool3d(cond, self.factor)

    def cond_channels(self, label_channels: int) -> int:
        if self.cond_kind == "labelmap":
            return 8**self.levels
        return label_channels * (8**self.levels if self.cond_kind == "haar" else 1)

    def latent_shape(self, image_channels: int, image_size: Sequence[int]) -> tuple[int, ...]:
        if any(int(s) % self.factor for s in image_size):
            raise ValueError(
                f"image_size {list(image_size)}: must be divisible by {self.factor} for {self.levels} wavelet level(s)"
            )
        return (image_channels * 8**self.levels, *(int(s) // self.factor for s in image_size))


def label_index_map(onehot: torch.Tensor) -> torch.Tensor:
    """One channel from the {-1, 1} one-hot [B, L, *size] of exclusive labels: -1 where no label is set
    (background), -1 + 2k/L where the k-th label (k = 1..L) is; [B, 1, *size]. Zeros (the null condition
    of classifier-free guidance) stay zeros."""
    labels = onehot.shape[1]
    k = torch.arange(1, labels + 1, dtype=onehot.dtype, device=onehot.device).view(1, labels, *[1] * (onehot.dim() - 2))
    index = ((onehot + 1) / 2 * k).sum(1, keepdim=True)  # 0 for background, k for label k
    out = index * (2 / labels) - 1
    return torch.where((onehot == 0).all(1, keepdim=True), torch.zeros_like(out), out)


def make_space(cfg) -> PixelSpace | WaveletSpace:
    """The space of a config (``data.space``, ``data.wavelet_levels``, ``data.wavelet_cond``)."""
    if cfg.data.space == "wavelet":
        return WaveletSpace(cfg.data.wavelet_levels, cfg.data.wavelet_cond)
    return PixelSpace()
