"""Distance between a set of real volumes and a set of synthetic ones: FID and MMD on deep features.

Features: a 3D ResNet in the MedicalNet layout (MONAI's ``resnet50(spatial_dims=3, n_input_channels=1,
feed_forward=False, shortcut_type="B", bias_downsample=False)``, first convolution strided by 2 as
MedicalNet's, and by default layer3/layer4 dilated instead of strided, as MedicalNet computes),
global-average-pooled: 2048 numbers per volume for ResNet-50. The weights come from a local
file the user supplies (a MedicalNet checkpoint: ``{"state_dict": {"module.conv1.weight": ...}}``, or a plain
state dict); nothing is downloaded. Each volume is first mapped to [0, 1] like every evaluation
(``evaluation.inputs.Scaling``), then, by default, normalised as MedicalNet was trained: mean 0 and standard
deviation 1 over its non-zero voxels (MedicalNet also fills the background with noise; here it stays 0, so
the features are deterministic).

Distances:

- **FID** (Fréchet distance of Gaussians fitted to the two feature sets, Heusel et al. 2017). Computed
  exactly without a matrix square root: with A, B the centred features divided by sqrt(n − 1),
  tr sqrt(Σa Σb) is the nuclear norm of A Bᵀ (an n × m matrix), so
  FID = |μa − μb|² + |A|²_F + |B|²_F − 2 |A Bᵀ|_*. This is MONAI's ``FIDMetric`` formula; MONAI evaluates it
  with ``scipy.linalg.sqrtm`` of a 2048 × 2048 product that is singular whenever a set has fewer than 2049
  volumes. A set with itself gives 0 up to rounding.
- **MMD**: the unbiased estimate of MMD² with the linear kernel, i.e. of |E f(real) − E f(synthetic)|²:
  MONAI's ``MMDMetric`` formula, written out because MONAI's accepts only sets of equal size. Its expectation
  is 0 for two independent sets from one distribution,
  and it can be negative; a set against itself is not independent of itself and scores below 0.
- **Reference**: FID is biased upwards at small n, so a value means little alone. With k = n_real // 2, one
  random half of the real set is scored against the other half (what a perfect generator would get) and
  against k random synthetic volumes: these two are comparable.
"""

from __future__ import annotations

import functools
import logging
import pickle
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.networks import nets

from ..data import DataError

log = logging.getLogger(__name__)
FEATURE_NETWORKS = ("resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnet200")
FEATURE_INPUTS = ("zscore", "unit")
FEATURE_LAYOUTS = ("medicalnet", "monai")
IGNORED_PREFIXES = ("conv_seg.", "fc.")  # MedicalNet's segmentation head, a classifier: not the feature path


# ---- the feature network ---------------------------------------------------------------------------------
def build_feature_network(name: str = "resnet50", layout: str = "medicalnet") -> torch.nn.Module:
    """The MedicalNet weight layout of ``name`` (shortcut B and no downsample bias for 10/50/101/152/200,
    shortcut A for 18/34, as MONAI's MedicalNet loader requires), randomly initialised, in eval mode.

    ``layout="medicalnet"`` computes as MedicalNet's own network (and the HA-GAN / WDM evaluation scripts built
    on it): layer3 and layer4 keep the resolution and dilate their 3×3×3 convolutions by 2 and 4. MONAI's
    ResNet (``layout="monai"``) strides them instead: the same weights, a 64× coarser last feature map (1³ for
    a 32³ input, where MedicalNet's is 4³), so different features."""
    if name not in FEATURE_NETWORKS:
        raise ValueError(f"feature network {name!r}: expected one of {', '.join(FEATURE_NETWORKS)}")
    if layout not in FEATURE_LAYOUTS:
        raise ValueError(f"feature layout {layout!r}: expected one of {', '.join(FEATURE_LAYOUTS)}")
    depth = int(name.removeprefix("resnet"))
    bias_downsample, shortcut = nets.resnet.get_medicalnet_pretrained_resnet_args(depth)
    net = getattr(nets, name)(
        spatial_dims=3,
        n_input_channels=1,
        feed_forward=False,
        shortcut_type=shortcut,
        bias_downsample=bias_downsample,
        conv1_t_stride=2,
    )
    if layout == "medicalnet":
        dilate_like_medicalnet(net)
    return net.eval()


def dilate_like_medicalnet(net: nets.ResNet) -> None:
    """Turn MONAI's strided layer3/layer4 into MedicalNet's: stride 1, 3×3×3 convolutions dilated (and padded)
    by 2 and 4. Only hyper-parameters change; the weights' names and shapes stay."""
    for layer, d in ((net.layer3, 2), (net.layer4, 4)):
        for block in layer:
            threes = (block.conv1, block.conv2) if isinstance(block, nets.resnet.ResNetBlock) else (block.conv2,)
            for conv in threes:
                conv.stride, conv.dilation, conv.padding = (1, 1, 1), (d, d, d), (d, d, d)
            shortcut = block.downsample
            if isinstance(shortcut, torch.nn.Sequential):  # type B: a strided 1×1×1 convolution
                shortcut[0].stride = (1, 1, 1)
            elif isinstance(shortcut, functools.partial):  # type A: strided pooling and zero channels
                block.downsample = functools.partial(
                    shortcut.func, *shortcut.args, **{**shortcut.keywords, "stride": 1}
                )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a local file: ``{"state_dict": {...}}`` (MedicalNet) or the dict itself, with
    DataParallel's ``module.`` prefix removed. Loaded with ``weights_only=True``: no code in the file runs."""
    if not path.is_file():
        raise DataError(f"{path}: {'not a file' if path.exists() else 'file not found'}")
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError) as e:
        text = str(e) or type(e).__name__
        # torch's weights-only refusal is a paragraph; its reason follows "WeightsUnpickler error:"
        text = text.split("WeightsUnpickler error:", 1)[-1].strip() or "refused"
        reason = text.splitlines()[0]
        raise DataError(
            f"{path}: not a PyTorch weights file torch loads with weights_only=True ({reason[:200]})"
        ) from None
    state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else loaded
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise DataError(f"{path}: not a state dict (expected a mapping of names to tensors, or one under 'state_dict')")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_feature_network(
    path: Path, name: str = "resnet50", device: torch.device | str = "cpu", layout: str = "medicalnet"
) -> torch.nn.Module:
    """``build_feature_network(name, layout)`` with the weights in ``path``; DataError when they do not fit."""
    net = build_feature_network(name, layout)
    state = {k: v for k, v in read_state_dict(path).items() if not k.startswith(IGNORED_PREFIXES)}
    expected = net.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        problems = []
        if missing:
            problems.append(f"{len(missing)} of {len(expected)} weights missing (first: {missing[0]})")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected (first: {unexpected[0]})")
        if wrong:
            k = wrong[0]
            problems.append(
                f"{len(wrong)} of the wrong shape (first: {k} {tuple(state[k].shape)}, "
                f"expected {tuple(expected[k].shape)})"
            )
        raise DataError(f"{path}: not the MedicalNet {name} layout: {'; '.join(problems)}")
    net.load_state_dict(state, strict=True)
    return net.to(device)


# ---- features ---------------------------------------------------------------------------------------------
def normalise(volume: np.ndarray, mode: str = "zscore") -> np.ndarray:
    """A [0, 1] volume as the network sees it: ``zscore`` (MedicalNet's: mean 0, std 1 over voxels > 0,
    background 0) or ``unit`` (unchanged)."""
    if mode == "unit":
        return volume.astype(np.float32)
    if mode != "zscore":
        raise ValueError(f"feature input {mode!r}: expected one of {', '.join(FEATURE_INPUTS)}")
    foreground = volume > 0
    if not foreground.any():
        return np.zeros_like(volume, np.float32)
    values = volume[foreground]
    out = np.zeros_like(volume, np.float32)
    out[foreground] = (values - values.mean()) / max(float(values.std()), 1e-6)
    return out


@torch.inference_mode()
def features(
    net: torch.nn.Module,
    volumes: Iterable[np.ndarray],
    device: torch.device | str = "cpu",
    mode: str = "zscore",
    progress: Callable[[], None] | None = None,
) -> torch.Tensor:
    """[N, F] float64 pooled features of volumes [D, H, W] in [0, 1], one at a time (shapes may differ)."""
    rows = []
    for volume in volumes:
        x = torch.from_numpy(normalise(volume, mode))[None, None].to(device)
        rows.append(net(x).double().cpu())
        if progress is not None:
            progress()
    if not rows:
        raise ValueError("no volumes")
    return torch.cat(rows)


# ---- distances --------------------------------------------------------------------------------------------
def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """FID between feature sets a [n, F] and b [m, F] (n, m >= 2), exactly, in float64 (see the module doc)."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(
            f"expected two [n >= 2, F] feature sets of one width, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a, b = a.double(), b.double()
    mean_term = float(((a.mean(0) - b.mean(0)) ** 2).sum())
    ca = (a - a.mean(0)) / (len(a) - 1) ** 0.5
    cb = (b - b.mean(0)) / (len(b) - 1) ** 0.5
    cross = float(torch.linalg.svdvals(ca @ cb.T).sum())  # = tr sqrt(Σa Σb)
    return mean_term + float((ca**2).sum()) + float((cb**2).sum()) - 2.0 * cross


def mmd(a: torch.Tensor, b: torch.Tensor) -> float:
    """Unbiased MMD² with the linear kernel between feature sets a [n, F] and b [m, F], n, m >= 2: MONAI's
    ``MMDMetric`` formula (Gretton et al. 2012, eq. 3), which MONAI computes only for n = m."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or min(len(a), len(b)) < 2:
        raise ValueError(
            f"expected two [n >= 2, F] feature sets of one width, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a, b = a.double(), b.double()

    def within(x: torch.Tensor) -> float:  # mean kernel value over pairs i != j
        total = x.sum(0)
        return float(total @ total - (x * x).sum()) / (len(x) * (len(x) - 1))

    return within(a) + within(b) - 2.0 * float(a.mean(0) @ b.mean(0))


def compare(real: torch.Tensor, synthetic: torch.Tensor, seed: int = 0) -> dict[str, Any]:
    """FID and MMD of the two sets, and the reference at matched size (see ``reference``)."""
    return {
        "n_real": len(real),
        "n_synthetic": len(synthetic),
        "feature_dim": int(real.shape[1]),
        "fid": frechet_distance(real, synthetic),
        "mmd": mmd(real, synthetic),
        "reference": reference(real, synthetic, seed),
        "notes": notes(len(real), len(synthetic), int(real.shape[1])),
    }


def reference(real: torch.Tensor, synthetic: torch.Tensor, seed: int = 0) -> dict[str, Any] | None:
    """Distances at one size k = n_real // 2: real half 1 against real half 2 (what a perfect generator would
    score) and against k random synthetic volumes. FID depends on the set size, so only these two compare;
    None when a half would hold fewer than 2 volumes."""
    k = len(real) // 2
    if k < 2 or len(synthetic) < k:
        return None
    rng = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(real), generator=rng)
    first, second = real[order[:k]], real[order[k : 2 * k]]
    picked = synthetic[torch.randperm(len(synthetic), generator=rng)[:k]]
    return {
        "n": k,
        "fid_real_vs_real": frechet_distance(first, second),
        "fid_real_vs_synthetic": frechet_distance(first, picked),
        "mmd_real_vs_real": mmd(first, second),
        "mmd_real_vs_synthetic": mmd(first, picked),
    }


def notes(n_real: int, n_synthetic: int, dim: int) -> list[str]:
    said = []
    if min(n_real, n_synthetic) <= dim:
        said.append(
            f"fewer volumes than feature dimensions ({min(n_real, n_synthetic)} <= {dim}): the covariances "
            "are singular and FID is biased upwards; compare FIDs only at equal set sizes"
        )
    if min(n_real, n_synthetic) < 50:
        said.append(
            "under 50 volumes per set: FID and MMD vary strongly with the sample; report the reference "
            "(real half against real half, and against as many synthetic volumes) beside them"
        )
    return said
