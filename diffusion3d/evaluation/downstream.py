"""Downstream segmentation: does a segmenter trained on synthetic volumes work on real ones?

Med-DDPM's protocol (Dorjsembe et al., JBHI 2024, Table: tumour Dice trained on real only / synthetic only /
real + synthetic): one MONAI segmentation network (UNet or SegResNet, Dice + cross-entropy loss) is trained
three times with the same seed, initial weights, step budget and batch order — on the real training pairs,
on the synthetic pairs (samples with the masks they were generated from), and on both — and each is scored
by Dice per label on a held-out split of real pairs that none of them saw.

Splits are drawn once from a seed and written down (``splits.json``); a run given that file repeats them.
Synthetic samples generated from a test case's mask are left out of training: their masks are the test
labels. Volumes are mapped to [0, 1] like every evaluation (``evaluation.inputs.Scaling``). Training takes random
patches (half of them centred on a labelled voxel, so small lesions are seen), testing slides a window of
the same size over the whole volume. No augmentation. On the CPU the numbers repeat exactly for the same
command (same thread count).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.inferers import sliding_window_inference
from monai.losses import DiceCELoss
from monai.metrics import compute_dice
from monai.networks.nets import SegResNet, UNet

from ..data import DataError, read_volume, scan_folder
from .inputs import Scaling, find_partner, group_samples

log = logging.getLogger(__name__)
ARMS = ("real", "synthetic", "mixed")  # mixed: real + synthetic
NETWORKS = ("unet", "segresnet")
MAX_PATCH = 96


# ---- inputs -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pair:
    name: str  # the real case, or the sample file's name
    case: str  # the mask's case
    image: Path
    mask: Path


def real_pairs(images_dir: Path, masks_dir: Path) -> list[Pair]:
    """Images and masks paired by case name; DataError listing every unpaired file."""
    images, masks = scan_folder(images_dir, ""), scan_folder(masks_dir, "")
    errors = [
        f"{images[c]}: image without mask (no case {c!r} in {masks_dir})" for c in sorted(set(images) - set(masks))
    ]
    errors += [
        f"{masks[c]}: mask without image (no case {c!r} in {images_dir})" for c in sorted(set(masks) - set(images))
    ]
    if errors:
        raise DataError(errors[0] + (f" (and {len(errors) - 1} more unpaired files)" if len(errors) > 1 else ""))
    return [Pair(c, c, images[c], masks[c]) for c in sorted(images)]


def synthetic_pairs(samples_dir: Path, masks_dir: Path) -> list[Pair]:
    """Every ``<case>_sample<i>`` file with the mask ``<case>`` it was generated from."""
    pairs = []
    for case, samples in group_samples(samples_dir).items():
        mask = find_partner(samples[0][1], masks_dir, case, "mask")
        pairs += [Pair(path.name, case, path, mask) for _, path in samples]
    return pairs


# ---- splits -----------------------------------------------------------------------------------------------
def make_splits(real: Sequence[Pair], synthetic: Sequence[Pair], num_test: int, seed: int) -> dict[str, Any]:
    """A seeded random test split of the real cases; synthetic samples of test masks are excluded."""
    cases = sorted(p.name for p in real)
    if not 1 <= num_test <= len(cases) - 1:
        raise DataError(f"{num_test} test cases of {len(cases)} real pairs: need at least one to train and one to test")
    test = sorted(random.Random(seed).sample(cases, num_test))
    return _with_synthetic(
        {"seed": seed, "real_train": [c for c in cases if c not in test], "real_test": test}, synthetic
    )


def _with_synthetic(splits: dict[str, Any], synthetic: Sequence[Pair]) -> dict[str, Any]:
    test = set(splits["real_test"])
    splits["synthetic_train"] = [p.name for p in synthetic if p.case not in test]
    splits["synthetic_excluded"] = [p.name for p in synthetic if p.case in test]
    return splits


def chosen_splits(
    real: Sequence[Pair],
    synthetic: Sequence[Pair],
    test: Sequence[str],
    seed: int | None = None,
    source: str = "--test_cases",
) -> dict[str, Any]:
    """``test`` (case names, e.g. those the diffusion model never trained on) for testing, the rest for training."""
    names = [p.name for p in real]
    return _checked(source, names, [c for c in names if c not in set(test)], list(test), seed, synthetic)


def read_splits(path: Path, real: Sequence[Pair], synthetic: Sequence[Pair]) -> dict[str, Any]:
    """Splits written by an earlier run (or by hand: ``real_train`` and ``real_test`` lists of case names,
    optionally ``synthetic_train``: sample file names); DataError when they do not fit the data given."""
    try:
        splits = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a JSON splits file ({e})") from None
    if not isinstance(splits, dict) or not all(isinstance(splits.get(k), list) for k in ("real_train", "real_test")):
        raise DataError(f"{path}: expected lists 'real_train' and 'real_test' of case names")
    out = _checked(
        str(path), [p.name for p in real], splits["real_train"], splits["real_test"], splits.get("seed"), synthetic
    )
    if "synthetic_train" in splits:
        by_name = {p.name: p for p in synthetic}
        missing = [n for n in splits["synthetic_train"] if n not in by_name]
        if missing:
            raise DataError(
                f"{path}: synthetic sample {missing[0]!r} is not in the samples folder ({len(missing)} missing)"
            )
        leaked = [n for n in splits["synthetic_train"] if by_name[n].case in set(out["real_test"])]
        if leaked:
            raise DataError(
                f"{path}: synthetic sample {leaked[0]!r} was generated from a test mask (its labels are test labels)"
            )
        out["synthetic_train"] = list(splits["synthetic_train"])
        out["synthetic_excluded"] = [p.name for p in synthetic if p.name not in set(out["synthetic_train"])]
    return out


def _checked(
    source: str,
    names: Sequence[str],
    train: Sequence[str],
    test: Sequence[str],
    seed: int | None,
    synthetic: Sequence[Pair],
) -> dict[str, Any]:
    unknown = [c for c in [*train, *test] if c not in set(names)]
    if unknown:
        raise DataError(f"{source}: case {unknown[0]!r} is not among the real pairs given ({len(unknown)} unknown)")
    both = sorted(set(train) & set(test))
    if both:
        raise DataError(f"{source}: case {both[0]!r} is in both real_train and real_test")
    if not train or not test:
        raise DataError(f"{source}: real_train and real_test must both name at least one case")
    return _with_synthetic({"seed": seed, "real_train": list(train), "real_test": list(test)}, synthetic)


# ---- volumes ----------------------------------------------------------------------------------------------
@dataclass
class Volume:
    name: str
    image: torch.Tensor  # [1, D, H, W] float32 in [0, 1]
    label: torch.Tensor  # [1, D, H, W] int64 class index (0 = background)


def label_classes(masks: Sequence[np.ndarray], labels: Sequence[int] | None) -> list[int]:
    """The foreground labels to segment: ``labels`` or every non-zero value in the masks."""
    if labels is not None:
        return sorted(int(v) for v in labels if v != 0)
    return sorted({int(v) for m in masks for v in np.unique(m) if v != 0})


def load_volume(pair: Pair, scaling: Scaling, synthetic: bool) -> tuple[np.ndarray, np.ndarray]:
    image = scaling.read(pair.image, synthetic)
    _, mask = read_volume(pair.mask)
    if mask.shape != image.shape:
        raise DataError(f"{pair.image}: shape {image.shape} differs from its mask's {mask.shape} ({pair.mask.name})")
    if mask.dtype.kind == "f" and not np.array_equal(mask, np.round(mask)):
        raise DataError(f"{pair.mask}: not a label map (non-integer values)")
    return image, mask.astype(np.int64)


def to_classes(mask: np.ndarray, labels: Sequence[int]) -> torch.Tensor:
    """Label values → class indices 1..K in ``labels`` order; every other value is background (0)."""
    out = np.zeros(mask.shape, np.int64)
    for k, label in enumerate(labels, start=1):
        out[mask == label] = k
    return torch.from_numpy(out)[None]


# ---- the segmenter ----------------------------------------------------------------------------------------
@dataclass
class Settings:
    network: str = "unet"
    channels: tuple[int, ...] = (8, 16, 32)  # sized for the 32³ demo: about 0.1 s a step on one CPU core
    steps: int = 300
    batch_size: int = 2
    lr: float = 1e-2
    patch: tuple[int, int, int] | None = None  # None: the largest volume, rounded up to a multiple of 16, <= 96
    overlap: float = 0.25
    seed: int = 0
    arms: tuple[str, ...] = ARMS
    labels: list[int] | None = None


def build_network(settings: Settings, classes: int) -> torch.nn.Module:
    """The segmenter; the same seed gives every arm the same initial weights (the caller's RNG is left alone)."""
    if settings.network not in NETWORKS:
        raise ValueError(f"network {settings.network!r}: expected one of {', '.join(NETWORKS)}")
    ch = tuple(settings.channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        if settings.network == "unet":
            return UNet(
                spatial_dims=3,
                in_channels=1,
                out_channels=classes,
                channels=ch,
                strides=(2,) * (len(ch) - 1),
                num_res_units=1,
            )
        # SegResNet: MONAI's default depth (1, 2, 2, 4) cut to the number of levels; widths double from ch[0]
        return SegResNet(
            spatial_dims=3,
            init_filters=ch[0],
            in_channels=1,
            out_channels=classes,
            blocks_down=(1, 2, 2, 4, 4, 4)[: len(ch)],
            blocks_up=(1,) * (len(ch) - 1),
        )


def default_patch(shapes: Sequence[tuple[int, ...]], multiple: int) -> tuple[int, int, int]:
    """The largest volume's shape rounded up to ``multiple`` (what the network's pooling needs), <= 96."""
    big = np.max(np.asarray(shapes), axis=0)
    return tuple(int(min(MAX_PATCH, math.ceil(s / multiple) * multiple)) for s in big)  # type: ignore[return-value]


def crop(volume: Volume, patch: Sequence[int], rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A patch of ``volume`` (padded with background where the volume is smaller); half the time centred on
    a labelled voxel, so that small structures are trained on."""
    image, label = volume.image, volume.label
    pad = [(0, max(0, p - s)) for p, s in zip(patch, image.shape[1:])]
    if any(after for _, after in pad):
        flat = [v for pair in reversed(pad) for v in pair]
        image = torch.nn.functional.pad(image, flat)
        label = torch.nn.functional.pad(label, flat)
    shape = image.shape[1:]
    foreground = torch.nonzero(label[0] > 0) if float(torch.rand(1, generator=rng)) < 0.5 else None
    starts = []
    for axis, (p, s) in enumerate(zip(patch, shape)):
        if foreground is not None and len(foreground):
            centre = int(foreground[int(torch.randint(len(foreground), (1,), generator=rng)), axis])
            start = min(max(centre - p // 2, 0), s - p)
        else:
            start = int(torch.randint(s - p + 1, (1,), generator=rng))
        starts.append(start)
    (a, b, c), (p0, p1, p2) = starts, patch
    return image[:, a : a + p0, b : b + p1, c : c + p2], label[:, a : a + p0, b : b + p1, c : c + p2]


def train(
    volumes: Sequence[Volume],
    settings: Settings,
    classes: int,
    patch: Sequence[int],
    device: torch.device,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[torch.nn.Module, float]:
    """``settings.steps`` Adam steps of Dice + CE on random patches; returns the network and the last loss."""
    net = build_network(settings, classes).to(device)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    optimizer = torch.optim.Adam(net.parameters(), lr=settings.lr)
    rng = torch.Generator().manual_seed(settings.seed)
    order: list[int] = []
    loss = float("nan")
    net.train()
    for step in range(settings.steps):
        batch = []
        for _ in range(settings.batch_size):  # epochs of seeded permutations: every volume once per epoch
            if not order:
                order = torch.randperm(len(volumes), generator=rng).tolist()
            batch.append(crop(volumes[order.pop()], patch, rng))
        x = torch.stack([b[0] for b in batch]).to(device)
        y = torch.stack([b[1] for b in batch]).to(device)
        optimizer.zero_grad(set_to_none=True)
        value = loss_fn(net(x), y)
        value.backward()
        optimizer.step()
        loss = float(value.detach())
        if on_step is not None:
            on_step(step, loss)
    return net.eval(), loss


@torch.inference_mode()
def dice_per_label(
    net: torch.nn.Module, volume: Volume, classes: int, patch: Sequence[int], overlap: float, device: torch.device
) -> list[float]:
    """Dice of each foreground class on one whole volume (sliding window); NaN where the truth is empty."""
    logits = sliding_window_inference(volume.image[None].to(device), tuple(patch), 1, net, overlap=overlap)
    pred = torch.nn.functional.one_hot(logits.argmax(1), classes).movedim(-1, 1)
    truth = torch.nn.functional.one_hot(volume.label.to(device), classes).movedim(-1, 1)
    return compute_dice(pred, truth, include_background=False, ignore_empty=True)[0].cpu().tolist()


def _summary(values: list[float]) -> dict[str, float | int | None]:
    finite = [v for v in values if math.isfinite(v)]
    return {
        "mean": float(np.mean(finite)) if finite else None,
        "std": float(np.std(finite)) if finite else None,
        "n": len(finite),
    }


def _mean_of_labels(dice: dict[str, dict[str, Any]]) -> float | None:
    means = [s["mean"] for s in dice.values() if s["mean"] is not None]
    return float(np.mean(means)) if means else None


def run(
    real: Sequence[Pair],
    synthetic: Sequence[Pair],
    splits: dict[str, Any],
    settings: Settings,
    scaling: Scaling,
    device: torch.device | str = "cpu",
    on_step: Callable[[str, int, float], None] | None = None,
) -> dict[str, Any]:
    """Train each arm and score it on the real test split; everything the outputs hold, in memory."""
    device = torch.device(device)
    by_name = {p.name: p for p in real} | {p.name: p for p in synthetic}
    is_synthetic = {"real_train": False, "real_test": False, "synthetic_train": True}
    arrays = {
        key: [(name, *load_volume(by_name[name], scaling, flag)) for name in splits[key]]
        for key, flag in is_synthetic.items()
    }
    labels = label_classes([m for key in ("real_train", "real_test") for _, _, m in arrays[key]], settings.labels)
    if not labels:
        raise DataError("the real masks hold no label other than 0: nothing to segment")
    sets = {
        key: [Volume(name, torch.from_numpy(img)[None], to_classes(mask, labels)) for name, img, mask in items]
        for key, items in arrays.items()
    }
    multiple = 2 ** (len(settings.channels) - 1)
    patch = settings.patch or default_patch([v.image.shape[1:] for vs in sets.values() for v in vs], multiple)
    if any(p % multiple for p in patch):
        raise ValueError(
            f"patch {tuple(patch)}: every side must be a multiple of {multiple} for {len(settings.channels)} levels"
        )
    training = {
        "real": sets["real_train"],
        "synthetic": sets["synthetic_train"],
        "mixed": sets["real_train"] + sets["synthetic_train"],
    }
    arms: dict[str, Any] = {}
    for arm in settings.arms:
        if not training[arm]:
            raise DataError(f"arm {arm!r}: no training volumes (check the samples folder and the splits)")
        start = time.perf_counter()
        net, last_loss = train(
            training[arm],
            settings,
            len(labels) + 1,
            patch,
            device,
            None if on_step is None else (lambda s, v, arm=arm: on_step(arm, s, v)),
        )
        per_case = {
            v.name: dice_per_label(net, v, len(labels) + 1, patch, settings.overlap, device) for v in sets["real_test"]
        }
        dice = {str(label): _summary([d[k] for d in per_case.values()]) for k, label in enumerate(labels)}
        arms[arm] = {
            "train_volumes": len(training[arm]),
            "final_loss": last_loss,
            "dice": dice,
            "mean_dice": _mean_of_labels(dice),
            "per_case": {name: dict(zip(map(str, labels), ds)) for name, ds in per_case.items()},
            "seconds": round(time.perf_counter() - start, 1),
        }
        log.info("%s: mean Dice %s on %d real test cases", arm, arms[arm]["mean_dice"], len(per_case))
    settings_out = asdict(settings) | {
        "patch": list(patch),
        "labels": labels,
        "device": str(device),
        "scaling": asdict(scaling),
    }
    return {"settings": settings_out, "splits": splits, "labels": labels, "arms": arms}


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (arm, label) and one per arm for the mean over labels: the CSV and the printed table."""
    rows = []
    for arm, r in result["arms"].items():
        for label, s in r["dice"].items():
            rows.append(
                {
                    "arm": arm,
                    "label": label,
                    "dice_mean": s["mean"],
                    "dice_std": s["std"],
                    "n_test": s["n"],
                    "train_volumes": r["train_volumes"],
                }
            )
        rows.append(
            {
                "arm": arm,
                "label": "mean",
                "dice_mean": r["mean_dice"],
                "dice_std": None,
                "n_test": len(r["per_case"]),
                "train_volumes": r["train_volumes"],
            }
        )
    return rows
