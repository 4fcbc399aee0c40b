"""Time to quality: train a config on a seeded synthetic set, and score samples of unseen masks along the way.

Two sets, each written afresh with its own seeds (the test masks are never trained on):

- ``phantom``: the demo's kind (``diffusion3d.synthetic.make_case``), train seeds (seed, 1, i), test seeds (seed, 2, i);
- ``realistic``: smooth random deformations (a small rotation/scale plus a smooth displacement field) and a
  smooth multiplicative bias field of the real whole-head pair in ``../shared/data/whole_head`` (Med-DDPM's
  sample_3), deformed at 128³ and brought to the model grid by 4× area averaging (masks by majority vote).
  Skipped with a message where that data is absent.

At every ``eval_every`` optimizer steps (and at the end) the EMA model (``--weights``: and/or the trained weights
themselves, ``model`` as in ``sample --weights``; one training run for both) samples every test mask
``samples_per_mask`` times with each requested sampler (``sampler:steps[:guidance][:shift=S]``) and the samples are
scored against the truth by ``diffusion3d.evaluation.metrics`` (per-label mean error, Otsu Dice of head and lesion,
contrast ratio, SSIM, PSNR, sharpness ratio, diversity). The phantom set also draws each test mask a second
time (same mask, independent texture and noise): the samples' diversity is reported beside the data's own
(``model_div``, ``data_div``, ``div_ratio``) and their SSIM and sharpness beside the twin's (``metrics.
reference_diversity``); the realistic set has no such twin (n/a). NFE counts network evaluations per sample: a guided
call evaluates the condition and the null condition, so it counts twice. Seconds are those of the training steps alone
(wall clock and process CPU time), so a row reads "after this much training, samples are this good".

Command line (``python -m diffusion3d quality --help``; also ``python -m diffusion3d bench --parts quality``)::

    python -m diffusion3d quality --config default --sets phantom,realistic --steps 1000 \\
        --eval_every 250 --sampling euler:10,heun:5 --set prediction=flow --set sampler=euler --out q.json
    python -m diffusion3d quality --table q_eps.json q_flow.json        # one table from several runs
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F

from .. import config as C
from .. import configs
from ..data import build_dataset, discover, save_nifti
from ..diffusion import make_diffusion
from ..evaluation import metrics
from ..precision import resolve_precision
from ..sampling import ModelGridMask, generate, resolve
from ..synthetic import SPACING, make_case
from ..synthetic import save as save_phantom
from ..trainer import Trainer
from .common import InputError, OneLineParser, configure_logging, run_command, write_json

log = logging.getLogger("diffusion3d.quality")
REAL_PAIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "whole_head"  # beside a checkout
SETS = ("phantom", "realistic")
TABLE_KEYS = (  # column header, result key, format
    ("head", "head_dice", ".3f"),
    ("lesion", "lesion_dice", ".3f"),
    ("|Δμ|max", "abs_mean_error_max", ".3f"),
    ("Δμ bg", "mean_error/0", "+.3f"),
    ("Δμ head", "mean_error/1", "+.3f"),
    ("Δμ les", "mean_error/2", "+.3f"),
    ("contr", "contrast_ratio", ".2f"),
    ("SSIM", "ssim", ".3f"),
    ("PSNR", "psnr", ".1f"),
    ("sharp", "sharpness_ratio", ".2f"),
    ("model_div", "model_div", ".3f"),
    ("data_div", "data_div", ".3f"),
    ("div_ratio", "div_ratio", ".2f"),
    ("SSIM twin", "ssim_twin", ".3f"),
    ("sharp twin", "sharpness_twin", ".2f"),
)
NO_TWIN = {"data_div", "div_ratio", "ssim_twin", "sharpness_twin"}  # "n/a" where a set has no second real draw


QualityError = InputError  # bad benchmark input (a flag, a config key, a missing file): one line, exit 2


# ---- the data sets ---------------------------------------------------------------------------------
@dataclass
class TestCase:
    name: str
    mask: np.ndarray  # [D, H, W] labels on the model grid
    truth: np.ndarray  # [D, H, W] in [0, 1]
    twin: np.ndarray | None = None  # a second, independent real draw of the same mask (the data's own diversity)


def _affine(size: int, spacing: float) -> np.ndarray:
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = -(size - 1) * spacing / 2
    return affine


TWIN_SPLIT = 3  # texture and noise of the twins: seeds (seed, 3, i), independent of both splits


def write_phantom_set(root: Path, n: int, seed: int, split: int, size: int, twins: bool = False) -> list[TestCase]:
    """``n`` phantoms seeded (seed, split, i); with ``twins`` also a second draw of each mask (same geometry,
    texture and noise from (seed, TWIN_SPLIT, i)) in ``root/twins``: what another real volume of it looks like."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    cases = []
    for i in range(n):
        mask, image = make_case(np.random.default_rng([seed, split, i]), size)
        name = f"case_{i:03d}"
        save_phantom(mask, root / "masks" / f"{name}.nii.gz")
        save_phantom(image, root / "images" / f"{name}.nii.gz")
        twin = None
        if twins:
            twin_mask, twin = make_case(
                np.random.default_rng([seed, split, i]), size, texture_rng=np.random.default_rng([seed, TWIN_SPLIT, i])
            )
            assert np.array_equal(twin_mask, mask)  # the geometry is drawn before the texture
            (root / "twins").mkdir(exist_ok=True)
            save_phantom(twin, root / "twins" / f"{name}.nii.gz")
        cases.append(TestCase(name, mask, image, twin))
    return cases


def _smooth_field(rng: np.random.Generator, channels: int, coarse: int, size: int) -> torch.Tensor:
    """Random values on a coarse grid, cubic-like (trilinear of a 4³ grid, then again) upsampled: [1, C, s, s, s]."""
    field = torch.from_numpy(rng.standard_normal((1, channels, coarse, coarse, coarse)).astype(np.float32))
    return F.interpolate(field, size=(size,) * 3, mode="trilinear", align_corners=True)


def deform_pair(
    image: np.ndarray,
    mask: np.ndarray,
    rng: np.random.Generator,
    labels: Sequence[int],
    factor: int,
    displacement: float = 0.04,
    bias: float = 0.12,
) -> tuple[np.ndarray, np.ndarray]:
    """One smooth random deformation + bias field of an (image in [0, 1], mask) pair, then ``factor``× down.

    ``displacement`` is the displacement's std as a fraction of the half-width (0.04 ≈ 2.6 voxels at 128³),
    ``bias`` the std of the log bias field. The mask is warped by its one-hot channels (trilinear) and
    down-sampled by majority vote, so label boundaries stay smooth and labels stay labels.
    """
    size = image.shape[0]
    angles = np.deg2rad(rng.uniform(-6, 6, 3))
    rot = np.eye(3)
    for axis, ang in enumerate(angles):
        i, j = [k for k in range(3) if k != axis]
        m = np.eye(3)
        m[i, i] = m[j, j] = np.cos(ang)
        m[i, j], m[j, i] = -np.sin(ang), np.sin(ang)
        rot = rot @ m
    theta = torch.zeros(1, 3, 4)
    theta[0, :, :3] = torch.from_numpy(rot * rng.uniform(0.95, 1.05)).float()
    theta[0, :, 3] = torch.from_numpy(rng.uniform(-0.03, 0.03, 3)).float()
    grid = F.affine_grid(theta, (1, 1, size, size, size), align_corners=True)
    grid = grid + displacement * _smooth_field(rng, 3, 5, size).permute(0, 2, 3, 4, 1)
    src = torch.from_numpy(image.astype(np.float32))[None, None]
    warped = F.grid_sample(src, grid, mode="bilinear", padding_mode="border", align_corners=True)
    warped = warped * torch.exp(bias * _smooth_field(rng, 1, 4, size))
    onehot = torch.stack([torch.from_numpy(mask == v) for v in (0, *labels)]).float()[None]
    warped_mask = F.grid_sample(onehot, grid, mode="bilinear", padding_mode="border", align_corners=True)
    small_image = F.avg_pool3d(warped, factor)[0, 0].clamp(0, 1).numpy()
    votes = F.avg_pool3d(warped_mask, factor)[0]
    values = torch.tensor([0, *labels], dtype=torch.uint8)
    small_mask = values[votes.argmax(0)].numpy()
    return small_image.astype(np.float32), small_mask


def write_realistic_set(
    root: Path, n: int, seed: int, split: int, size: int, source: Path, labels: Sequence[int]
) -> list[TestCase]:
    image_file, mask_file = source / "image" / "sample_3.nii.gz", source / "mask" / "sample_3.nii.gz"
    for f in (image_file, mask_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: the real pair for the realistic set is not there")
    real = np.asarray(nib.load(str(image_file)).dataobj, dtype=np.float32)
    real = (real + 1) / 2  # stored in [-1, 1] (see shared/data/README.md)
    real_mask = np.asarray(nib.load(str(mask_file)).dataobj).astype(np.uint8)
    factor = real.shape[0] // size
    if factor < 1 or real.shape[0] % size or len(set(real.shape)) != 1:
        raise QualityError(f"{image_file}: shape {real.shape} cannot be brought to {size}³ by an integer factor")
    spacing = float(nib.load(str(image_file)).header.get_zooms()[0]) * factor
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    cases = []
    for i in range(n):
        image, mask = deform_pair(real, real_mask, np.random.default_rng([seed, split, i]), labels, factor)
        name = f"case_{i:03d}"
        save_nifti(image[None], _affine(size, spacing), root / "images" / f"{name}.nii.gz")
        save_nifti(mask[None], _affine(size, spacing), root / "masks" / f"{name}.nii.gz", dtype=np.uint8)
        cases.append(TestCase(name, mask, image))
    return cases


def write_set(
    kind: str,
    root: Path,
    n_train: int,
    n_test: int,
    seed: int,
    size: int,
    labels: Sequence[int],
    source: Path = REAL_PAIR,
) -> list[TestCase]:
    """Write ``root/train`` (files the trainer reads) and ``root/test``; returns the test cases."""
    if kind == "phantom":
        write_phantom_set(root / "train", n_train, seed, 1, size)
        return write_phantom_set(root / "test", n_test, seed, 2, size, twins=True)
    if kind == "realistic":
        # no twins: every case is one real head deformed, so a second draw of the same mask would be the same
        # texture again (or, deformed again, another mask); the data's diversity is not defined here (n/a)
        write_realistic_set(root / "train", n_train, seed, 1, size, source, labels)
        return write_realistic_set(root / "test", n_test, seed, 2, size, source, labels)
    raise QualityError(f"--sets: unknown set {kind!r} (choose from {', '.join(SETS)})")


# ---- training with evaluations along the way ------------------------------------------------------------
@dataclass
class SamplingSpec:
    sampler: str
    steps: int
    guidance: float | None = None  # None: the config's
    shift: float | None = None  # flow models' sampling_shift; None: the config's

    @property
    def label(self) -> str:
        return (
            f"{self.sampler}-{self.steps}"
            + (f"-w{self.guidance:g}" if self.guidance is not None else "")
            + (f"-s{self.shift:g}" if self.shift is not None else "")
        )

    def config(self, cfg: C.Config) -> C.Config:
        """``cfg`` as this spec samples it: with its sampling shift where it sets one."""
        return cfg if self.shift is None else cfg.override([("sampling_shift", self.shift)])


SAMPLING_FORM = "sampler:steps[:guidance][:shift=S]"


def parse_sampling(text: str | None, cfg: C.Config) -> list[SamplingSpec]:
    """``sampler:steps[:guidance][:shift=S]`` items separated by commas; empty: the config's sampler and steps.
    ``shift=S`` samples a flow model on a time grid of shift S (as ``sample --sampling_shift``), so one training
    run scores several shifts."""
    if not text:
        return [SamplingSpec(cfg.diffusion.sampler, cfg.diffusion.sampling_steps)]
    specs = []
    for item in text.split(","):
        parts = item.strip().split(":")
        shift = parts.pop()[len("shift=") :] if len(parts) > 2 and parts[-1].startswith("shift=") else None
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            spec = SamplingSpec(
                parts[0],
                int(parts[1]),
                float(parts[2]) if len(parts) > 2 else None,
                float(shift) if shift is not None else None,
            )
        except ValueError:
            raise QualityError(f"--sampling: expected {SAMPLING_FORM}, got {item!r}") from None
        if spec.steps < 1:
            raise QualityError(f"--sampling: {item!r}: steps must be at least 1")
        try:
            spec.config(cfg)  # the config's own check of the shift (positive, a flow model's)
        except C.ConfigError as e:
            raise QualityError(f"--sampling: {item!r}: {e}") from None
        specs.append(spec)
    return specs


def bench_config(base: C.Config, train_root: Path, overrides: Sequence[str]) -> C.Config:
    """The base config with the ``key=value`` overrides, then on the benchmark's training data."""
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise QualityError(f"--set: expected key=value, got {item!r}")
        pairs.append((key.strip(), C.parse_value(value)))
    try:
        return base.override(
            pairs,
            image_dir=str(train_root / "images"),
            mask_dir=str(train_root / "masks"),
            manifest=None,
            image_suffix="",
            mask_suffix="",
            intensity="range",
            intensity_range=[0.0, 1.0],
            num_val_cases=0,
            cache="memory",
            quiet=True,
            orientation="RAS",
            spacing=None,
        )
    except C.ConfigError as e:  # names the key, whether --set gave it or the combination is invalid
        raise QualityError(f"config: {e}") from None


def score_samples(samples: np.ndarray, cases: Sequence[TestCase], labels: Sequence[int]) -> dict[str, float]:
    """Mean over test masks (and their samples) of every metric; diversity per mask, then averaged.

    ``div_ratio`` is the ratio of the means (mean model_div / mean data_div over the masks), which a mask
    with a nearly identical pair of real draws cannot blow up."""
    per_sample, diversities, references = [], [], []
    per_mask = samples.shape[0] // len(cases)
    for c, case in enumerate(cases):
        group = [samples[c * per_mask + j] for j in range(per_mask)]
        for s in group:
            per_sample.append(metrics.score_sample(s, case.truth, case.mask, labels))
        if per_mask > 1:
            diversities.append(metrics.mean_pairwise_ssim(group))
            references.append(metrics.reference_diversity(group, case.truth, case.twin, case.mask))
    keys = per_sample[0].keys()
    summary = {k: _nanmean([r[k] for r in per_sample]) for k in keys}
    summary["diversity"] = _nanmean(diversities) if diversities else float("nan")
    for key in ("model_div", "data_div", "ssim_twin", "sharpness_twin"):
        summary[key] = _nanmean([r[key] for r in references]) if references else float("nan")
    summary["div_ratio"] = metrics.diversity_ratio(summary["model_div"], summary["data_div"])
    return summary


def _nanmean(values: Sequence[float]) -> float:
    finite = [float(v) for v in values if v is not None and not math.isnan(float(v)) and not math.isinf(float(v))]
    return float(np.mean(finite)) if finite else float("nan")


def evaluate_model(
    model: torch.nn.Module,
    cfg: C.Config,
    cases: Sequence[TestCase],
    spec: SamplingSpec,
    samples_per_mask: int,
    device: torch.device,
    seed: int,
    batch_size: int = 16,
    save_dir: Path | None = None,
) -> dict[str, Any]:
    """Sample every test mask ``samples_per_mask`` times with ``spec``; score against the truth.
    With ``save_dir`` the samples are written there as ``<case>_sample<j>.nii.gz`` (beside ``<case>_truth``)."""
    labels = cfg.data.labels
    cfg = spec.config(cfg)
    recipe = resolve(cfg, spec.sampler, spec.steps, spec.guidance)
    grids = [grid for grid in (ModelGridMask(c.mask.astype(np.uint8)) for c in cases) for _ in range(samples_per_mask)]
    seeds = [int(seed * 1000003 + 7919 * c + j) for c in range(len(cases)) for j in range(samples_per_mask)]
    start = time.perf_counter()
    volumes = [
        s.model_grid
        for s in generate(
            model,
            cfg,
            grids,
            seeds,
            sampler=spec.sampler,
            steps=spec.steps,
            guidance=spec.guidance,
            batch_size=batch_size,
            device=device,
        )
    ]
    seconds = time.perf_counter() - start
    unit = ((torch.stack(volumes)[:, 0] + 1) / 2).numpy()
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        affine = _affine(unit.shape[-1], SPACING)
        for c, case in enumerate(cases):
            save_nifti(case.truth[None], affine, save_dir / f"{case.name}_truth.nii.gz")
            if case.twin is not None:
                save_nifti(case.twin[None], affine, save_dir / f"{case.name}_twin.nii.gz")
            for j in range(samples_per_mask):
                save_nifti(unit[c * samples_per_mask + j][None], affine, save_dir / f"{case.name}_sample{j}.nii.gz")
    scores = score_samples(unit, cases, labels)
    guided = cfg.model.with_condition and recipe.guidance != 1.0  # cond and null: two network evaluations per call
    scores["evaluations"] = recipe.evaluations * (2 if guided else 1)
    scores["sampling_s_per_volume"] = seconds / len(seeds)
    return scores


def train_and_score(
    cfg: C.Config,
    cases: Sequence[TestCase],
    steps: int,
    eval_at: Sequence[int],
    specs: Sequence[SamplingSpec],
    samples_per_mask: int,
    device: torch.device,
    progress: Callable[[str], None] = lambda s: None,
    save_dir: Path | None = None,
    weights: Sequence[str] = ("ema",),
) -> list[dict[str, Any]]:
    """Train ``steps`` optimizer steps of ``cfg``; at each step in ``eval_at`` score every sampling spec with
    each of ``weights`` (``ema``: the averaged copy the trainer samples with; ``model``: the trained weights)."""
    cfg.train.train_num_steps = steps
    train_cases = discover(cfg)
    dataset = build_dataset(train_cases, cfg, None)
    trainer = Trainer(cfg, dataset, device)
    rows = []
    wall = cpu = 0.0
    losses: list[float] = []
    for step in range(1, steps + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        result = trainer.train_step()
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        losses.append(result.loss)
        if step in eval_at:
            for which in weights:
                model = trainer.ema.module if which == "ema" else trainer.model
                for spec in specs:
                    label = spec.label if which == "ema" else f"{spec.label} no-EMA"
                    where = save_dir / f"step_{step:06d}" / label.replace(" ", "_") if save_dir is not None else None
                    scores = evaluate_model(
                        model, cfg, cases, spec, samples_per_mask, device, cfg.train.seed, save_dir=where
                    )
                    row = {
                        "step": step,
                        "train_s": wall,
                        "train_cpu_s": cpu,
                        "loss": float(np.mean(losses[-50:])),
                        "sampling": label,
                        "weights": which,
                        **scores,
                    }
                    rows.append(row)
                    progress(format_row(row))
                trainer.model.train()  # sampling put it in eval mode; training goes on
    return rows


# ---- output ----------------------------------------------------------------------------------------
def _cell(value: Any, spec: str, missing: str = "–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def format_row(row: dict[str, Any]) -> str:
    cells = [
        f"{row.get('run', '')}",
        row["set"] if "set" in row else "",
        f"{row['step']}",
        f"{row['train_s']:.0f}",
        row["sampling"],
        f"{row['evaluations']}",
    ]
    row = dict(row)
    if "model_div" not in row and isinstance(row.get("diversity"), float):  # a report from before model_div
        row["model_div"] = 1.0 - row["diversity"]
    twinless = row.get("set") == "realistic" or "data_div" not in row  # no second real draw: n/a, not missing
    cells += [_cell(row.get(key), spec, "n/a" if key in NO_TWIN and twinless else "–") for _, key, spec in TABLE_KEYS]
    return " | ".join(cells)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ["run", "set", "step", "train s", "sampling", "NFE", *[h for h, _, _ in TABLE_KEYS]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + format_row(r) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }


# ---- the command line -------------------------------------------------------------------------------
def build_parser(prog: str = "python -m diffusion3d quality") -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog,
        description="Time to quality: train a config on seeded synthetic sets and score "
        "samples of unseen masks along the way (mask fidelity and realism against the truth).",
    )
    p.add_argument(
        "--config",
        default=None,
        help="the recipe to train: a path or a bundled config's name (default: default, the demo's)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeatable), e.g. --set prediction=flow --set sampler=euler",
    )
    p.add_argument("--name", default=None, help="the run's name in the table (default: config name + overrides)")
    p.add_argument("--sets", default="phantom,realistic", help="phantom, realistic or both (default)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the config's train_num_steps)")
    p.add_argument("--eval_every", type=int, default=250, help="score every N steps and at the end")
    p.add_argument(
        "--sampling",
        default=None,
        help=f"{SAMPLING_FORM},... (default: the config's); shift=S: a flow model's sampling_shift",
    )
    p.add_argument(
        "--weights",
        default="ema",
        help="ema, model or ema,model: sample with the EMA weights, the trained weights (rows 'no-EMA') or both",
    )
    p.add_argument("--n_train", type=int, default=24, help="training pairs per set")
    p.add_argument("--n_test", type=int, default=6, help="unseen test masks per set")
    p.add_argument("--samples_per_mask", type=int, default=2, help="samples of each test mask (2+: diversity)")
    p.add_argument("--size", type=int, default=None, help="grid side (default: the config's image_size)")
    p.add_argument("--data_seed", type=int, default=0, help="seed of the generated sets")
    p.add_argument("--real_pair", type=Path, default=REAL_PAIR, help="folder with image/ and mask/ sample_3.nii.gz")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch threads (set it to the cores you really have)")
    p.add_argument("--workdir", type=Path, default=None, help="where the sets are written (default: a temp folder)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument(
        "--save_samples",
        type=Path,
        default=None,
        help="also write every scored sample (and its truth) as NIfTI: DIR/<set>/step_N/<sampling>/",
    )
    p.add_argument("--table", type=Path, nargs="+", default=None, help="print one table from these JSON files and exit")
    return p


def run(args: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    config = configs.find(args.config)
    base = C.load(config)
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    for s in sets:
        if s not in SETS:
            raise QualityError(f"--sets: unknown set {s!r} (choose from {', '.join(SETS)})")
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not weights or any(w not in ("ema", "model") for w in weights) or len(set(weights)) != len(weights):
        raise QualityError(f"--weights: expected ema, model or ema,model, got {args.weights!r}")
    for flag in ("eval_every", "n_train", "n_test", "samples_per_mask"):
        if getattr(args, flag) < 1:
            raise QualityError(f"--{flag}: must be at least 1")
    device = torch.device(args.device)
    name = args.name or " ".join([base.name, *args.overrides])
    report: dict[str, Any] = {
        "name": name,
        "config": str(config),
        "overrides": args.overrides,
        "machine": machine(),
        "rows": [],
        "skipped": {},
    }
    with tempfile.TemporaryDirectory(prefix="d3d_quality_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        for kind in sets:
            size = args.size or base.data.image_size[0]
            if kind == "realistic" and not (args.real_pair / "image" / "sample_3.nii.gz").is_file():
                message = f"realistic set skipped: {args.real_pair / 'image' / 'sample_3.nii.gz'} not found"
                progress(message)
                report["skipped"][kind] = message
                continue
            root = work / kind
            cases = write_set(
                kind, root, args.n_train, args.n_test, args.data_seed, size, base.data.labels, args.real_pair
            )
            cfg = bench_config(base, root / "train", [*args.overrides, f"image_size=[{size},{size},{size}]"])
            cfg.train.precision = resolve_precision(cfg.train.precision, device)  # as train does
            steps = args.steps or cfg.train.train_num_steps
            eval_at = sorted({*range(args.eval_every, steps + 1, args.eval_every), steps})
            specs = parse_sampling(args.sampling, cfg)
            diffusion = make_diffusion(cfg)
            for spec in specs:
                if spec.sampler not in diffusion.samplers:
                    raise QualityError(
                        f"--sampling: {spec.sampler} does not fit prediction {cfg.diffusion.prediction} "
                        f"(use {' or '.join(diffusion.samplers)})"
                    )
            progress(
                f"{kind}: {args.n_train} training pairs, {args.n_test} test masks, {size}³, {steps} steps, "
                f"scored at {eval_at} with {', '.join(s.label for s in specs)}"
            )
            rows = train_and_score(
                cfg,
                cases,
                steps,
                eval_at,
                specs,
                args.samples_per_mask,
                device,
                progress=lambda line, k=kind: progress(f"{name} | {k} | {line}"),
                save_dir=args.save_samples / kind if args.save_samples else None,
                weights=weights,
            )
            report["rows"] += [{"run": name, "set": kind, **r} for r in rows]
    return report


def print_table(paths: Sequence[Path]) -> int:
    """--table: one table from the rows of several reports."""
    rows = []
    for path in paths:
        try:
            rows += json.loads(Path(path).read_text())["rows"]
        except (OSError, ValueError, KeyError) as e:
            raise QualityError(f"{path}: not a quality report ({type(e).__name__}: {e})") from None
    print(format_table(rows))
    return 0


def measure(args: argparse.Namespace) -> int:
    """Train and score, print the table and (with --out) write the report."""
    report = run(args, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(report["rows"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, report, indent=1)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m diffusion3d quality") -> int:
    configure_logging(logging.WARNING)
    args = build_parser(prog).parse_args(argv)
    # a missing file named by a flag is bad input here, not a storage fault
    return run_command(lambda: print_table(args.table) if args.table else measure(args), bad_input=(FileNotFoundError,))


if __name__ == "__main__":
    sys.exit(main())
