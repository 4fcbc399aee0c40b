"""The whole run's configuration: typed dataclasses, YAML in, CLI overrides by key name, resolved YAML out.

YAML files are grouped in sections (``data``, ``model``, ``diffusion``, ``train``) but every key name is
unique across sections, so the command line overrides a key by its bare name (``--batch_size 2``). An optional
``wavelet`` section gives, by key name, the values the recipe takes where it trains in wavelet space.
Values given on the command line are parsed as YAML scalars/lists (``--labels [1,2,4]``) and then
checked against the field's type. A field's type carries its choices (``Literal``), its metadata its
meaning (shown by ``--help``) and lower bound; each section checks itself (``validate``), and
``Config.validate`` adds the checks that span sections.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message names the key or file."""


def key(
    default: Any,
    help: str,
    *,
    at_least: float | None = None,
    expect: str | None = None,
    breaks_resume: bool = False,
    cache: bool = False,
    wavelet_only: bool = False,
) -> Any:
    """A config field: its default, its meaning (``--help``, the docs' key table), optionally a lower bound
    and the words for what it expects (for a type error's message). ``breaks_resume``: a checkpoint trained
    with another value cannot be continued (model shape, data, randomness, noise schedule; see
    ``checkpoint.BREAKING_KEYS``). ``cache``: the cached training tensors depend on it (``data.transform_key``).
    ``wavelet_only``: it acts only in ``space: wavelet``, so a difference between two pixel-space configs breaks
    nothing."""
    metadata = {
        "help": help,
        "at_least": at_least,
        "expect": expect,
        "breaks_resume": breaks_resume,
        "cache": cache,
        "wavelet_only": wavelet_only,
    }
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ---- types: checking a value against a field's type hint -------------------------------------------
def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _describe(hint: Any) -> str:
    """What a value of this type looks like, in words for an error message."""
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) is list:
        return "a list"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]


def coerce(key: str, value: Any, hint: Any, expect: str | None = None) -> Any:
    """Check ``value`` against ``hint``; return it (ints widen to floats). ConfigError names the key."""
    if _is_union(hint):
        arms = typing.get_args(hint)
        if value is None and type(None) in arms:
            return None
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return coerce(key, value, arm)
            except ConfigError:
                if isinstance(value, list) and typing.get_origin(arm) is list:
                    raise  # a list with a bad element: say which
        expect = expect or " or ".join(_describe(arm) for arm in arms)
        raise ConfigError(f"{key}: expected {expect}, got {value!r}")
    if typing.get_origin(hint) is Literal:
        if value in typing.get_args(hint) and isinstance(value, str):
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(typing.get_args(hint))}")
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(key, v, typing.get_args(hint)[0]) for v in value]
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (hint is bool and isinstance(value, bool)) or (hint is str and isinstance(value, str)):
        return value
    if hint is int and number and isinstance(value, int):
        return value
    if hint is float and number:
        return float(value)
    raise ConfigError(f"{key}: expected {expect or _describe(hint)}, got {value!r}")


class Section:
    """A config section. ``validate`` checks every field's type, choices and lower bound (values built
    directly, not through ``set_key``, are checked too); subclasses add their own rules after it."""

    def validate(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = coerce(f.name, getattr(self, f.name), hints[f.name], f.metadata.get("expect"))
            setattr(self, f.name, value)
            low = f.metadata.get("at_least")
            if low is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value < low:
                raise ConfigError(f"{f.name}: must be at least {low}, got {value}")


# ---- the sections -----------------------------------------------------------------------------------
@dataclass
class DataConfig(Section):
    image_dir: str | list[str] = key(
        "data/demo/images", "image folder, or a list of folders (one image channel each, in order)", breaks_resume=True
    )
    mask_dir: str = key("data/demo/masks", "mask folder (label maps)", breaks_resume=True)
    manifest: str | None = key(
        None, "CSV with columns case, image (or image_0, image_1, ...), mask, instead of folders", breaks_resume=True
    )
    image_channels: int | None = key(
        None,
        "image volumes per case (the model's image channels); found by discovery: one per image_dir "
        "folder or manifest image column. The run records it, so sampling needs no data; set it only to check",
        at_least=1,
    )
    image_suffix: str = key("", "stripped from image file names to find the case name (e.g. _t1)", breaks_resume=True)
    mask_suffix: str = key("", "stripped from mask file names (e.g. _seg)", breaks_resume=True)
    labels: list[int] = key([1, 2], "mask labels -> one-hot condition channels, in order", breaks_resume=True)
    unknown_labels: Literal["error", "warn"] = key(
        "error", "mask values outside {0} and labels: refuse, or warn and treat them as background"
    )
    orientation: str | None = key(
        "RAS", "axis codes everything is reoriented to (null: keep the file's)", breaks_resume=True, cache=True
    )
    spacing: list[float] | None = key(
        None, "resample to this spacing in mm (null: keep the file's grid)", breaks_resume=True, cache=True
    )
    intensity: Literal["percentile", "range", "none"] = key(
        "percentile", "how each volume is scaled to [-1, 1]", breaks_resume=True, cache=True
    )
    lower_percentile: float = key(0.0, "for intensity: percentile", breaks_resume=True, cache=True)
    upper_percentile: float = key(99.5, "for intensity: percentile", breaks_resume=True, cache=True)
    intensity_range: list[float] = key(
        [0.0, 1.0], "[low, high] mapped to [-1, 1], for intensity: range", breaks_resume=True, cache=True
    )
    image_size: list[int] = key(
        [32, 32, 32], "the model's grid; divisible by 2^(levels-1)", breaks_resume=True, cache=True
    )
    space: Literal["pixel", "wavelet"] = key(
        "pixel", "diffusion on the voxels, or on their Haar subbands (WDM-3D)", breaks_resume=True
    )
    wavelet_levels: int = key(
        1,
        "for space: wavelet, 1 or 2 levels (8 or 64 subbands at size/2 or size/4)",
        at_least=1,
        breaks_resume=True,
        wavelet_only=True,
    )
    wavelet_cond: Literal["haar", "pool", "labelmap"] = key(
        "haar",
        "for space: wavelet, the mask on the subband grid: the one-hot's Haar subbands (8^levels channels per "
        "label), its block-pooled label fractions (one channel per label) or the Haar subbands of one "
        "label-index map (8^levels channels in all)",
        breaks_resume=True,
        wavelet_only=True,
    )
    flip_axes: list[int] = key(
        [],
        "augmentation: each listed axis of the model grid (0, 1, 2; after orientation) mirrors image and mask "
        "together with probability 1/2 per sample, drawn from (seed, sample id)",
    )
    affine_rotate: float = key(
        0.0,
        "augmentation: each sample is rotated about each axis by an angle drawn uniformly within ± this many "
        "degrees, image and mask together, drawn from (seed, sample id) (0: off)",
        at_least=0,
    )
    affine_scale: float = key(
        0.0,
        "augmentation: each sample is scaled by a factor drawn uniformly within 1 ± this (isotropic; 0: off)",
        at_least=0,
    )
    affine_translate: float = key(
        0.0,
        "augmentation: each sample is shifted along each axis by up to ± this fraction of the grid (0: off)",
        at_least=0,
    )
    affine_prob: float = key(
        1.0,
        "augmentation: the share of samples the affine_* ranges move, drawn from (seed, sample id); the rest train "
        "on the volumes as they are, unresampled",
        at_least=0,
    )
    output_intensity: Literal["unit", "model", "source"] = key(
        "unit", "written samples in [0, 1] (unit), [-1, 1] (model) or intensity_range (source)"
    )
    resize_mode: Literal["pad_crop", "resize"] = key(
        "pad_crop", "how volumes are fit to the model's grid", breaks_resume=True, cache=True
    )
    cache: Literal["memory", "disk", "none"] = key(
        "memory",
        "decoded training set kept in memory (CacheDataset), on disk in cache_dir (PersistentDataset), or not at all",
    )
    cache_dir: str | None = key(None, "for cache: disk (null: results_dir/cache)")
    num_workers: int = key(0, "loader workers, validation processes and cache-build threads")
    pin_memory: bool = key(True, "pinned host memory for batches (CUDA)")
    num_val_cases: int = key(
        2, "cases held out for validation sampling (when at least four remain for training)", breaks_resume=True
    )
    shape_tolerance_mm: float = key(1e-3, "how far image and mask affines may differ")
    max_volume_gb: float | None = key(
        2.0,
        "refuse a file whose header declares more voxel data (shape × "
        "datatype size), before reading it (null: no ceiling)",
    )

    def validate(self) -> None:
        super().validate()
        if len(self.image_size) != 3 or min(self.image_size) < 1:
            raise ConfigError(f"image_size: expected three positive sizes, got {self.image_size}")
        if len(set(self.labels)) != len(self.labels) or 0 in self.labels:
            raise ConfigError(f"labels: must be distinct and non-zero, got {self.labels}")
        if self.spacing is not None and (len(self.spacing) != 3 or min(self.spacing) <= 0):
            raise ConfigError(f"spacing: expected three positive values, got {self.spacing}")
        low_high = self.intensity_range
        if len(low_high) != 2 or low_high[0] >= low_high[1]:
            raise ConfigError(f"intensity_range: expected [low, high] with low < high, got {low_high}")
        if not 0 <= self.lower_percentile < self.upper_percentile <= 100:
            raise ConfigError("lower_percentile/upper_percentile: need 0 <= lower < upper <= 100")
        if len(set(self.flip_axes)) != len(self.flip_axes) or any(a not in (0, 1, 2) for a in self.flip_axes):
            raise ConfigError(f"flip_axes: distinct spatial axes from 0, 1, 2, got {self.flip_axes}")
        if self.affine_rotate > 180 or self.affine_scale >= 1 or self.affine_translate >= 1:
            raise ConfigError(
                "affine_rotate/affine_scale/affine_translate: need a rotation of at most 180 degrees and a scale and "
                f"shift under 1, got {self.affine_rotate}, {self.affine_scale}, {self.affine_translate}"
            )
        if self.affine_prob > 1:
            raise ConfigError(f"affine_prob: a probability, at most 1, got {self.affine_prob}")
        if self.wavelet_levels not in (1, 2):
            raise ConfigError(f"wavelet_levels: must be 1 or 2, got {self.wavelet_levels}")
        if self.output_intensity == "source" and self.intensity != "range":
            raise ConfigError(
                "output_intensity: source needs intensity: range (percentile scaling has no fixed source range)"
            )


@dataclass
class ModelConfig(Section):
    with_condition: bool = key(
        True, "concatenate the mask's label channels to the noisy image", breaks_resume=True, cache=True
    )
    channels: list[int] = key(
        [32, 64, 64],
        "channels per UNet level (the first is raised to the model's input channels where narrower: wavelet space)",
        breaks_resume=True,
    )
    num_res_blocks: int = key(1, "residual blocks per level", breaks_resume=True)
    attention_levels: list[bool] = key([False, False, True], "self-attention (SDPA) per level", breaks_resume=True)
    num_head_channels: int = key(32, "attention head width", breaks_resume=True)
    norm_num_groups: int = key(8, "GroupNorm groups", breaks_resume=True)
    activation_checkpointing: bool = key(False, "recompute blocks in backward (less memory, same gradients)")

    def validate(self) -> None:
        super().validate()
        if len(self.attention_levels) != len(self.channels):
            raise ConfigError("attention_levels: needs one entry per entry of channels")
        if any(c % self.norm_num_groups for c in self.channels):
            raise ConfigError(f"channels: each must be divisible by norm_num_groups={self.norm_num_groups}")


@dataclass
class DiffusionConfig(Section):
    timesteps: int = key(250, "training timesteps of Gaussian diffusion", at_least=1, breaks_resume=True)
    schedule: Literal["cosine", "linear"] = key("cosine", "noise schedule", breaks_resume=True)
    prediction: Literal["eps", "v", "x0", "flow"] = key(
        "eps", "network target: eps, v or x0 (Gaussian diffusion) or flow (rectified flow)", breaks_resume=True
    )
    loss: Literal["l1", "l2"] = key("l1", "loss on the network's target")
    min_snr_gamma: float | None = key(None, "min-SNR-gamma loss weighting (Gaussian diffusion only)")
    sampler: Literal["ddim", "ddpm", "dpmpp2m", "euler", "heun", "euler_a"] = key(
        "ddim",
        "ddim, ddpm or dpmpp2m (Gaussian diffusion); euler, heun or euler_a (ancestral: fresh noise each step) (flow)",
    )
    sampling_steps: int = key(50, "sampler steps (heun: 2 network evaluations per step but the last)", at_least=1)
    ddim_eta: float = key(0.0, "DDIM stochasticity")
    clip_x0: bool = key(True, "clip the predicted x0 to [-1, 1] while sampling")
    flow_shift: float | None = key(
        None,
        "flow time shift toward noise (null: (voxels / 32^3)^(1/3), as MONAI's RFlowScheduler: 1 at 32^3, 4 at 128^3)",
    )
    sampling_shift: float | None = key(
        None,
        "flow sampling: the time grid's shift (null: the training's, flow_shift); below it the last steps sit nearer "
        "t = 0, which sharpens x0-output samples (docs/performance.md, session 12)",
    )
    flow_time_sampling: Literal["logit_normal", "uniform"] = key("logit_normal", "training times of the flow")
    flow_output: Literal["velocity", "x0"] = key(
        "velocity",
        "what the flow's network outputs: the velocity, or x0 (JiT's x-prediction: the velocity (x_t - x0) / t is "
        "derived, the loss is the velocity's with t at least flow_x0_min_t)",
        breaks_resume=True,
    )
    flow_x0_min_t: float = key(
        0.05,
        "flow_output x0: the velocity loss's 1 / t takes t at least this (JiT's 0.05); larger weights the near-clean "
        "times less, toward the anatomy (0.3: realistic SSIM at 64^3 +0.011, docs/performance.md, session 12)",
    )
    cond_drop_prob: float = key(0.0, "classifier-free guidance: fraction of samples trained with the null condition")
    guidance_scale: float = key(
        1.0, "sampling: uncond + scale * (cond - uncond); 1 = the conditional model alone (no extra cost)"
    )

    def validate(self) -> None:
        super().validate()
        # imported here, not on top: the registry's step classes need torch, the config module does not
        from .diffusion import SAMPLERS, samplers_of

        flow = self.prediction == "flow"
        objective = "flow" if flow else "gaussian"
        if SAMPLERS[self.sampler].objective != objective:
            raise ConfigError(
                f"sampler: {self.sampler!r} does not fit prediction {self.prediction!r} "
                f"(use {' or '.join(samplers_of(objective))})"
            )
        if not flow and self.flow_output != "velocity":
            raise ConfigError("flow_output: applies to prediction: flow (Gaussian diffusion has prediction: x0)")
        if flow and self.min_snr_gamma is not None:
            raise ConfigError("min_snr_gamma: applies to Gaussian diffusion (eps / v / x0), not to prediction: flow")
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise ConfigError(f"flow_shift: must be positive, got {self.flow_shift}")
        if self.sampling_shift is not None and self.sampling_shift <= 0:
            raise ConfigError(f"sampling_shift: must be positive, got {self.sampling_shift}")
        if not flow and self.sampling_shift is not None:
            raise ConfigError(f"sampling_shift: applies to prediction: flow, not {self.prediction}")
        if not 0.0 < self.flow_x0_min_t <= 1.0:
            raise ConfigError(f"flow_x0_min_t: must be in (0, 1], got {self.flow_x0_min_t}")
        if not 0.0 <= self.cond_drop_prob < 1.0:
            raise ConfigError(f"cond_drop_prob: must be in [0, 1), got {self.cond_drop_prob}")
        if self.guidance_scale < 0:
            raise ConfigError(f"guidance_scale: must be at least 0, got {self.guidance_scale}")


@dataclass
class TrainConfig(Section):
    batch_size: int | Literal["auto"] = key(
        1,
        "micro-batch size per process, or auto: the largest that fits (needs effective_batch)",
        at_least=1,
        expect="a positive integer or auto",
    )
    gradient_accumulate_every: int = key(1, "micro-batches per optimizer step (--accum)", at_least=1)
    effective_batch: int | None = key(
        None,
        "samples per optimizer step over all processes: batch_size x "
        "accum x processes. With batch_size auto, accum is derived to keep it",
        at_least=1,
    )
    max_batch: int = key(64, "the largest micro-batch batch_size: auto tries", at_least=1)
    train_num_steps: int = key(1000, "optimizer steps", at_least=1)
    optimizer: Literal["adamw", "muon"] = key(
        "adamw",
        "adamw, or muon: Muon on the hidden weights, AdamW on the first and last layers, biases and norms, "
        "with the same lr (Muon's update is scaled to AdamW's RMS; diffusion3d/optimizer.py)",
        breaks_resume=True,
    )
    muon_lr_ratio: float = key(
        1.0, "optimizer muon only: the hidden weights' lr over lr (1: the same update RMS as AdamW's)"
    )
    lr: float = key(1e-4, "learning rate (AdamW's; Muon's is lr x muon_lr_ratio)")
    weight_decay: float = key(0.0, "AdamW weight decay (0: Adam, as Med-DDPM)")
    warmup_steps: int = key(0, "linear warmup, in optimizer steps")
    lr_schedule: Literal["constant", "cosine"] = key("constant", "learning rate after warmup")
    min_lr_ratio: float = key(0.1, "cosine decays to lr x min_lr_ratio")
    adam_betas: list[float] = key([0.9, 0.999], "AdamW betas")
    max_grad_norm: float = key(1.0, "gradient clipping norm")
    ema_decay: float = key(0.995, "EMA of the weights (used for sampling)")
    ema_update_every: int = key(1, "optimizer steps between EMA updates", at_least=1)
    ema_start_step: int = key(0, "first step with an EMA update")
    ema_warmup: bool = key(True, "decay min(ema_decay, (1 + n) / (10 + n)) after n updates: early EMA tracks the model")
    precision: Literal["fp32", "fp16", "bf16"] = key(
        "fp32", "autocast of the forward pass (fp16: CUDA only, with a GradScaler)"
    )
    device: str = key("auto", "auto, cpu, cuda or cuda:N")
    seed: int = key(0, "the whole run's randomness derives from it", breaks_resume=True)
    results_dir: str | None = key(None, "where checkpoints, logs and samples go (null: runs/<config name>)")
    save_every: int = key(100, "optimizer steps between checkpoints", at_least=1)
    sample_every: int = key(250, "optimizer steps between validation samplings", at_least=1)
    num_samples: int = key(2, "validation masks sampled at each sample_every")
    log_every: int = key(1, "optimizer steps between TensorBoard scalars", at_least=1)
    keep_last: int = key(3, "checkpoints kept", at_least=1)
    milestone_every: int = key(0, "also keep every M-th step's checkpoint (0: none)")
    resume: str = key("auto", "auto (newest valid checkpoint), none, or a checkpoint path")
    overwrite: bool = key(False, "with resume none: delete the folder's checkpoints, logs and samples")
    max_nonfinite_steps: int = key(
        10,
        "consecutive non-finite steps before the run stops (fp16 gets 24 more for the scaler's back-off)",
        at_least=1,
    )
    compile: bool = key(False, "torch.compile the denoiser")
    quiet: bool = key(False, "no progress bar")

    def validate(self) -> None:
        super().validate()
        if self.batch_size == "auto" and self.effective_batch is None:
            raise ConfigError("batch_size: auto needs effective_batch (the samples per optimizer step to keep)")
        if self.batch_size != "auto" and self.effective_batch is not None:
            per_process = self.batch_size * self.gradient_accumulate_every
            if self.effective_batch % per_process:
                raise ConfigError(
                    f"effective_batch: {self.effective_batch} is not batch_size {self.batch_size} × "
                    f"accum {self.gradient_accumulate_every} × a number of processes"
                )
        if self.lr <= 0:
            raise ConfigError(f"lr: must be positive, got {self.lr}")
        if self.muon_lr_ratio <= 0:
            raise ConfigError(f"muon_lr_ratio: must be positive, got {self.muon_lr_ratio}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay: must be in [0, 1), got {self.ema_decay}")
        if len(self.adam_betas) != 2:
            raise ConfigError("adam_betas: expected two values")

    def check_processes(self, world_size: int) -> None:
        """A fixed batch split must give effective_batch with this many processes (auto is planned to)."""
        if self.batch_size == "auto" or self.effective_batch is None:
            return
        global_batch = self.batch_size * self.gradient_accumulate_every * world_size
        if global_batch != self.effective_batch:
            raise ConfigError(
                f"effective_batch: {self.effective_batch} is not batch_size {self.batch_size} × accum "
                f"{self.gradient_accumulate_every} × {world_size} process(es) = {global_batch} "
                "(use --batch_size auto to derive the split)"
            )


SECTIONS: dict[str, type[Section]] = {
    "data": DataConfig,
    "model": ModelConfig,
    "diffusion": DiffusionConfig,
    "train": TrainConfig,
}
ALIASES = {"accum": "gradient_accumulate_every"}
WAVELET = "wavelet"  # the config section of values for space: wavelet (``Config.wavelet``)


@dataclass
class Config:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = dataclasses.field(default_factory=DiffusionConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    name: str = "default"
    # A config file's ``wavelet:`` section: keys (any section's, by name) and the values they take where the run
    # trains in wavelet space, the recipe that space needs. ``validate`` applies them once the space is wavelet
    # and empties this; a key set by name before that (the command line, ``override``) keeps its own value.
    wavelet: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def override(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /, **more: Any) -> Config:
        """A validated copy with keys set by name, as the command line sets them (type-checked, ``accum``
        allowed): first ``values`` (a mapping or (key, value) pairs, in order), then ``more``. ConfigError
        names the key; ``self`` is untouched."""
        cfg = copy.deepcopy(self)
        pairs = values.items() if isinstance(values, Mapping) else values
        for name, value in [*pairs, *more.items()]:
            set_by_name(cfg, name, value)
        cfg.validate()
        return cfg

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @property
    def image_channels(self) -> int:
        """The model's image channels: as discovery found them (``data.image_channels``). Before discovery,
        and for checkpoints older than that key, one per image_dir folder. Reads no file."""
        if self.data.image_channels is not None:
            return self.data.image_channels
        dirs = self.data.image_dir
        return len(dirs) if isinstance(dirs, list) else 1

    @property
    def cond_channels(self) -> int:
        return len(self.data.labels) if self.model.with_condition else 0

    def validate(self) -> None:
        """The wavelet section's values where the space is wavelet; each section checks itself; then the checks
        that span sections."""
        apply_wavelet_values(self)
        for section in SECTIONS:
            getattr(self, section).validate()
        d, m = self.data, self.model
        factor = 2 ** (len(m.channels) - 1)
        wavelet = 2**d.wavelet_levels if d.space == "wavelet" else 1  # the UNet sees size / 2^wavelet_levels
        if any(s % (factor * wavelet) for s in d.image_size):
            why = f"2^(levels-1) for {len(m.channels)} levels"
            why += f" × 2^{d.wavelet_levels} for the wavelet levels" if wavelet > 1 else ""
            raise ConfigError(f"image_size: {d.image_size} must be divisible by {factor * wavelet} ({why})")
        if not d.labels and m.with_condition:
            raise ConfigError("labels: at least one label is needed with with_condition")
        if self.diffusion.guidance_scale != 1.0 and not m.with_condition:
            raise ConfigError("guidance_scale: needs with_condition (there is no condition to guide by)")


def validate(cfg: Config) -> None:
    cfg.validate()


# ---- keys by name, dicts and YAML -------------------------------------------------------------------
def key_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every leaf key name -> (section, field). Names are unique across sections."""
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in index, f"duplicate config key {f.name}"
            index[f.name] = (section, f)
    return index


def keys_where(flag: str) -> dict[str, tuple[str, ...]]:
    """section -> its key names whose metadata sets ``flag`` (``breaks_resume``, ``cache``, ``wavelet_only``), in field
    order; sections without one are left out."""
    found = {section: tuple(f.name for f in fields(cls) if f.metadata.get(flag)) for section, cls in SECTIONS.items()}
    return {section: names for section, names in found.items() if names}


def hint_of(key: str) -> Any:
    """The type hint of a leaf key (``name`` is a string)."""
    if key == "name":
        return str
    section, _ = key_index()[key]
    return typing.get_type_hints(SECTIONS[section])[key]


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set one leaf key by name, type-checked; raises ConfigError naming the key."""
    key = ALIASES.get(key, key)
    if key == "name":
        cfg.name = coerce(key, value, str)
        return
    index = key_index()
    if key not in index:
        raise ConfigError(f"unknown config key {key!r}")
    section, f = index[key]
    setattr(getattr(cfg, section), key, coerce(key, value, hint_of(key), f.metadata.get("expect")))


def set_by_name(cfg: Config, key: str, value: Any) -> None:
    """``set_key`` for a value the user names (the command line, ``override``): it also outranks the config's
    ``wavelet`` value of that key."""
    set_key(cfg, key, value)
    cfg.wavelet.pop(ALIASES.get(key, key), None)


def apply_wavelet_values(cfg: Config) -> None:
    """Where the run trains in wavelet space, set the config's ``wavelet`` values and empty it: from then on they
    are the config's own (a checkpoint stores them so; sampling and resume need no flag)."""
    if cfg.data.space != "wavelet" or not cfg.wavelet:
        return
    for key, value in cfg.wavelet.items():
        set_key(cfg, key, value)
    cfg.wavelet = {}


def _wavelet_values(values: Any, source: str) -> dict[str, Any]:
    """A config's ``wavelet`` section, each key known and each value of its type (checked now, not only when a
    run first trains in wavelet space)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section {WAVELET!r} must be a mapping")
    index, checked = key_index(), {}
    for key, value in values.items():
        key = ALIASES.get(key, key)
        if key == "space":
            raise ConfigError(f"{source}: 'space' cannot be set in section {WAVELET!r} (it is what selects it)")
        if key not in index:
            raise ConfigError(f"{source}: unknown key {key!r} in section {WAVELET!r}")
        try:
            checked[key] = coerce(key, value, hint_of(key), index[key][1].metadata.get("expect"))
        except ConfigError as e:
            raise ConfigError(f"{source}: {WAVELET}.{e}") from None
    return checked


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from a (possibly partial) sectioned dict, as read from YAML."""
    cfg = Config()
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    for section, values in raw.items():
        if section == "name":
            cfg.name = str(values)
            continue
        if section == WAVELET:
            cfg.wavelet = _wavelet_values(values, source)
            continue
        if section not in SECTIONS:
            expected = ", ".join([*SECTIONS, WAVELET])
            raise ConfigError(f"{source}: unknown section {section!r} (expected one of {expected})")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section {section!r} must be a mapping")
        for key, value in values.items():
            if key not in {f.name for f in fields(SECTIONS[section])}:
                raise ConfigError(f"{source}: unknown key {key!r} in section {section!r}")
            try:
                set_key(cfg, key, value)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
    return cfg


def load(path: str | Path) -> Config:
    """Read a YAML config. The run's name defaults to the file's stem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if isinstance(raw, dict):
        raw.setdefault("name", path.stem)
    return from_dict(raw, str(path))


def parse_value(text: str) -> Any:
    """A command-line value, read as a YAML scalar or list (``2`` -> 2, ``[1,2]`` -> [1, 2])."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def results_dir(cfg: Config) -> Path:
    return Path(cfg.train.results_dir or f"runs/{cfg.name}")


# ---- the command line: one flag per key --------------------------------------------------------------
def show(value: Any) -> str:
    """A value as it is typed on the command line or in YAML (null, true, [1, 2])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value) if value != "" else '""'


def _metavar(hint: Any) -> str:
    if _is_union(hint):
        return "|".join(_metavar(arm) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return "{" + ",".join(choices) + "}" if len(choices) > 1 else choices[0]
    if typing.get_origin(hint) is list:
        return f"[{_metavar(typing.get_args(hint)[0])},...]"
    return {type(None): "null"}.get(hint) or hint.__name__.upper()


def _help(f: dataclasses.Field, section: str, shipped: Config | None) -> str:
    """Meaning and default (the choices are in the metavar: ``--sampler {ddim,ddpm,...}``)."""
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    text = f"{f.metadata['help']} (default: {show(default)}"
    if shipped is not None and getattr(getattr(shipped, section), f.name) != default:
        text += f"; the default config sets {show(getattr(getattr(shipped, section), f.name))}"
    if shipped is not None and f.name in shipped.wavelet:
        text += f"; {show(shipped.wavelet[f.name])} in wavelet space"
    return (text + ")").replace("%", "%%")  # argparse formats help with %


def add_arguments(parser: argparse.ArgumentParser, shipped: Config | None = None) -> None:
    """One flag per key (``--batch_size 2``; booleans also ``--no_with_condition``), grouped by section,
    each with its meaning, default (and the value ``shipped``, the default config, sets) and choices
    (in the metavar, as argparse shows them).
    Values stay text here: ``apply_arguments`` reads them as YAML and type-checks them."""
    for alias, target in ALIASES.items():
        parser.add_argument(f"--{alias}", dest=target, default=None, metavar="N", help=f"short for --{target}")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            text = _help(f, section, shipped)
            if hints[f.name] is bool:
                group.add_argument(
                    f"--{f.name}", dest=f.name, nargs="?", const="true", default=None, metavar="BOOL", help=text
                )
                group.add_argument(
                    f"--no_{f.name}", dest=f.name, action="store_const", const="false", help=f"--{f.name} false"
                )
            else:
                group.add_argument(f"--{f.name}", dest=f.name, default=None, metavar=_metavar(hints[f.name]), help=text)
    parser.add_argument("--name", default=None, help="run name (default: the config file's stem)")


def apply_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """Set every key given on the command line (parsed as YAML, type-checked); ConfigError names the key."""
    for name in [*key_index(), "name"]:
        value = getattr(args, name, None)
        if value is not None:
            set_by_name(cfg, name, parse_value(value))


# ---- the docs' key table -------------------------------------------------------------------------------
TABLE_BEGIN = "<!-- key table: generated from diffusion3d/config.py by `python -m diffusion3d.config`; do not edit -->"
TABLE_END = "<!-- end of the key table -->"
KEY_TABLE_DOC = Path("docs/configuration.md")  # relative to the repository root


def _values(hint: Any, at_least: float | None) -> str:
    """What a key takes, for the table: its choices, or its type (and lower bound)."""
    if _is_union(hint):
        return " or ".join(_values(arm, at_least) for arm in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return ", ".join(f"`{c}`" for c in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return (
            "list of " + {bool: "booleans", int: "integers", float: "numbers", str: "strings"}[typing.get_args(hint)[0]]
        )
    if hint is type(None):
        return "`null`"
    word = {bool: "`true`, `false`", int: "integer", float: "number", str: "string"}[hint]
    return f"{word} ≥ {show(at_least)}" if at_least is not None else word


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (``|`` splits cells, ``<x`` would start an HTML tag)."""
    return text.replace("|", "\\|").replace("<", "\\<")


def key_table_markdown(shipped: Config | None = None) -> str:
    """The Markdown table of every key, from the sections' metadata: section, key, built-in (dataclass)
    default, the value ``shipped`` (default: the bundled default.yaml, the demo) sets where it differs,
    what it takes, whether a change breaks a resume or invalidates the disk cache, and its meaning."""
    if shipped is None:
        # configs imports this module: import it only when called
        from .configs import DEFAULT

        shipped = load(DEFAULT)
    header = [
        "section",
        "key",
        "built-in default",
        "default.yaml",
        "values",
        "breaks resume",
        "invalidates cache",
        "meaning",
    ]
    rows = ["| " + " | ".join(header) + " |", "| --- | --- | --- | --- | --- | :---: | :---: | --- |"]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            demo = getattr(getattr(shipped, section), f.name)
            demo_cell = f"`{show(demo)}`" if demo != default else ""
            if f.name in shipped.wavelet:
                demo_cell += f" (wavelet: `{show(shipped.wavelet[f.name])}`)"
            cells = [
                section,
                f"`{f.name}`",
                f"`{show(default)}`",
                demo_cell.strip(),
                _values(hints[f.name], f.metadata.get("at_least")),
                "yes" if f.metadata.get("breaks_resume") else "",
                "yes" if f.metadata.get("cache") else "",
                _cell(f.metadata["help"]),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def with_key_table(text: str, table: str, source: str = "<text>") -> str:
    """``text`` with ``table`` between the TABLE_BEGIN and TABLE_END lines (ConfigError if they are missing)."""
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ConfigError(f"{source}: no key table markers ({TABLE_BEGIN} ... {TABLE_END})")
    return text[: start + len(TABLE_BEGIN)] + "\n\n" + table + "\n" + text[end:]  # blank lines: Markdown blocks


def write_key_table(path: str | Path = KEY_TABLE_DOC) -> None:
    """Regenerate the key table inside ``path`` (between its markers), leaving the prose around it."""
    path = Path(path)
    path.write_text(with_key_table(path.read_text(), key_table_markdown(), str(path)))


if __name__ == "__main__":  # python -m diffusion3d.config [docs/configuration.md]
    import sys

    # the package's module, not this __main__ copy of it
    from diffusion3d.config import write_key_table as _write

    _write(*sys.argv[1:2])
