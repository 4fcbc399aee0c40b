"""The whole run's configuration: dataclasses, YAML in, CLI overrides by key name, resolved YAML out.

YAML files are grouped in sections (``data``, ``model``, ``diffusion``, ``train``) but every key name is
unique across sections, so the command line overrides a key by its bare name (``--batch_size 2``).
Values given on the command line are parsed as YAML scalars/lists (``--labels [1,2,4]``) and then
checked against the field's type.
"""

from __future__ import annotations

import csv
import dataclasses
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message names the key or file."""


@dataclass
class DataConfig:
    image_dir: str | list[str] = "data/demo/images"  # several folders = several image channels, in order
    mask_dir: str = "data/demo/masks"
    manifest: str | None = None  # CSV with columns case, image (or image_0, image_1, ...), mask
    image_suffix: str = ""  # stripped from image file names to find the case name (e.g. "_t1")
    mask_suffix: str = ""  # stripped from mask file names (e.g. "_seg")
    labels: list[int] = field(default_factory=lambda: [1, 2])  # mask labels -> one-hot channels, in order
    unknown_labels: str = "error"  # error | warn : mask values outside {0} ∪ labels
    orientation: str | None = "RAS"
    spacing: list[float] | None = None  # resample to this spacing (mm); None keeps the file's grid
    intensity: str = "percentile"  # percentile | range | none : how each volume is scaled to [-1, 1]
    lower_percentile: float = 0.0
    upper_percentile: float = 99.5
    intensity_range: list[float] = field(default_factory=lambda: [0.0, 1.0])  # for intensity: range
    image_size: list[int] = field(default_factory=lambda: [32, 32, 32])  # the model's grid
    output_intensity: str = "unit"  # unit ([0, 1]) | model ([-1, 1]) | source (intensity_range) for written samples
    resize_mode: str = "pad_crop"  # pad_crop | resize
    cache: str = "memory"  # memory | disk | none
    cache_dir: str | None = None  # for cache: disk (default results_dir/cache)
    num_workers: int = 0
    pin_memory: bool = True
    num_val_cases: int = 2  # held out from training, sampled for monitoring
    shape_tolerance_mm: float = 1e-3  # image/mask affines may differ by this much
    max_volume_gb: float | None = 2.0  # refuse a file whose header declares more voxel data (None: no ceiling)


@dataclass
class ModelConfig:
    with_condition: bool = True  # concatenate the mask channels to the noisy image
    channels: list[int] = field(default_factory=lambda: [32, 64, 64])
    num_res_blocks: int = 1
    attention_levels: list[bool] = field(default_factory=lambda: [False, False, True])
    num_head_channels: int = 32
    norm_num_groups: int = 8
    activation_checkpointing: bool = False


@dataclass
class DiffusionConfig:
    timesteps: int = 250
    schedule: str = "cosine"  # cosine | linear
    prediction: str = "eps"  # eps | v | x0 (Gaussian diffusion) | flow (rectified flow)
    loss: str = "l1"  # l1 | l2
    min_snr_gamma: float | None = None
    sampler: str = "ddim"  # ddim | ddpm | dpmpp2m (Gaussian) ; euler | heun (flow)
    sampling_steps: int = 50
    ddim_eta: float = 0.0
    clip_x0: bool = True
    flow_shift: float | None = None  # flow time shift; None: (voxels / 32³)^(1/3) as MONAI's RFlowScheduler
    flow_time_sampling: str = "logit_normal"  # logit_normal | uniform : training times of the flow
    cond_drop_prob: float = 0.0  # classifier-free guidance: drop the mask condition of this fraction of samples
    guidance_scale: float = 1.0  # sampling: uncond + scale * (cond - uncond); 1 = the conditional model alone


@dataclass
class TrainConfig:
    batch_size: int | str = 1  # or "auto": the largest micro-batch that fits (needs effective_batch)
    gradient_accumulate_every: int = 1
    effective_batch: int | None = None  # batch_size × accum to keep; with batch_size auto, accum is derived
    max_batch: int = 64  # upper bound searched by batch_size: auto
    train_num_steps: int = 1000
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0
    ema_decay: float = 0.995
    ema_update_every: int = 1
    ema_start_step: int = 0
    ema_warmup: bool = True  # decay min(ema_decay, (1 + n) / (10 + n)) after n updates: early EMA tracks the model
    precision: str = "fp32"  # fp32 | fp16 | bf16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    results_dir: str | None = None  # default runs/<config name>
    save_every: int = 100
    sample_every: int = 250
    num_samples: int = 2  # validation masks sampled at each sample_every
    log_every: int = 1
    keep_last: int = 3
    milestone_every: int = 0  # also keep every M-th step's checkpoint (0: none)
    resume: str = "auto"  # auto | none | PATH
    overwrite: bool = False
    max_nonfinite_steps: int = 10
    compile: bool = False
    quiet: bool = False


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "diffusion": DiffusionConfig,
    "train": TrainConfig,
}
CHOICES: dict[str, tuple[str, ...]] = {
    "unknown_labels": ("error", "warn"),
    "intensity": ("percentile", "range", "none"),
    "resize_mode": ("pad_crop", "resize"),
    "output_intensity": ("unit", "model", "source"),
    "cache": ("memory", "disk", "none"),
    "schedule": ("cosine", "linear"),
    "prediction": ("eps", "v", "x0", "flow"),
    "loss": ("l1", "l2"),
    "sampler": ("ddim", "ddpm", "dpmpp2m", "euler", "heun"),
    "flow_time_sampling": ("logit_normal", "uniform"),
    "lr_schedule": ("constant", "cosine"),
    "precision": ("fp32", "fp16", "bf16"),
}
ALIASES = {"accum": "gradient_accumulate_every"}


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    name: str = "default"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @property
    def image_channels(self) -> int:
        """One per image folder, or per manifest column image / image_0, image_1, ..."""
        if self.data.manifest and Path(self.data.manifest).is_file():
            with open(self.data.manifest, newline="") as f:
                header = next(csv.reader(f), [])
            if "image" not in header:
                return max(1, sum(1 for c in header if c.startswith("image_") and c[6:].isdigit()))
            return 1
        dirs = self.data.image_dir
        return len(dirs) if isinstance(dirs, list) else 1

    @property
    def cond_channels(self) -> int:
        return len(self.data.labels) if self.model.with_condition else 0

    @property
    def effective_batch(self) -> int:
        if isinstance(self.train.batch_size, str):  # "auto" before it is resolved
            return self.train.effective_batch
        return self.train.batch_size * self.train.gradient_accumulate_every


def key_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every leaf key name -> (section, field). Names are unique across sections."""
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f.name not in index, f"duplicate config key {f.name}"
            index[f.name] = (section, f)
    return index


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the type hint of ``key``; return it (ints widen to floats)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not a valid value ({'; '.join(errors)})")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [coerce(key, v, args[0]) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {hint}")


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
    obj = getattr(cfg, section)
    hint = _type_hints(type(obj))[f.name]
    setattr(obj, f.name, coerce(key, value, hint))


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a Config from a (possibly partial) sectioned dict, as read from YAML."""
    cfg = Config()
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    for section, values in raw.items():
        if section == "name":
            cfg.name = str(values)
            continue
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section {section!r} (expected one of {', '.join(SECTIONS)})")
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
    raw.setdefault("name", path.stem)
    return from_dict(raw, str(path))


def parse_value(text: str) -> Any:
    """A command-line value, read as a YAML scalar or list (``2`` -> 2, ``[1,2]`` -> [1, 2])."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def validate(cfg: Config) -> None:
    """Cross-field checks that no single type hint can express."""
    for key, allowed in CHOICES.items():
        section, _ = key_index()[key]
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    d, m, t, df = cfg.data, cfg.model, cfg.train, cfg.diffusion
    if isinstance(t.batch_size, str):
        if t.batch_size != "auto":
            raise ConfigError(f"batch_size: expected a positive integer or auto, got {t.batch_size!r}")
        if t.effective_batch is None:
            raise ConfigError("batch_size: auto needs effective_batch (the batch_size × accum to keep)")
    elif t.effective_batch is not None and t.batch_size * t.gradient_accumulate_every != t.effective_batch:
        raise ConfigError(
            f"effective_batch: {t.effective_batch} is not batch_size {t.batch_size} × accum {t.gradient_accumulate_every}"
        )
    if t.effective_batch is not None and t.effective_batch < 1:
        raise ConfigError(f"effective_batch: must be at least 1, got {t.effective_batch}")
    positive = {
        **({"batch_size": t.batch_size} if isinstance(t.batch_size, int) else {}),
        "max_batch": t.max_batch,
        "gradient_accumulate_every": t.gradient_accumulate_every,
        "train_num_steps": t.train_num_steps,
        "timesteps": df.timesteps,
        "sampling_steps": df.sampling_steps,
        "save_every": t.save_every,
        "sample_every": t.sample_every,
        "log_every": t.log_every,
        "ema_update_every": t.ema_update_every,
        "keep_last": t.keep_last,
        "max_nonfinite_steps": t.max_nonfinite_steps,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be at least 1, got {value}")
    if t.lr <= 0:
        raise ConfigError(f"lr: must be positive, got {t.lr}")
    if not 0.0 <= t.ema_decay < 1.0:
        raise ConfigError(f"ema_decay: must be in [0, 1), got {t.ema_decay}")
    if len(d.image_size) != 3 or min(d.image_size) < 1:
        raise ConfigError(f"image_size: expected three positive sizes, got {d.image_size}")
    factor = 2 ** (len(m.channels) - 1)
    if any(s % factor for s in d.image_size):
        raise ConfigError(
            f"image_size: {d.image_size} must be divisible by {factor} (2^(levels-1) for {len(m.channels)} levels)"
        )
    if len(m.attention_levels) != len(m.channels):
        raise ConfigError("attention_levels: needs one entry per entry of channels")
    if any(c % m.norm_num_groups for c in m.channels):
        raise ConfigError(f"channels: each must be divisible by norm_num_groups={m.norm_num_groups}")
    if not d.labels and m.with_condition:
        raise ConfigError("labels: at least one label is needed with with_condition")
    if len(set(d.labels)) != len(d.labels) or 0 in d.labels:
        raise ConfigError(f"labels: must be distinct and non-zero, got {d.labels}")
    if d.spacing is not None and (len(d.spacing) != 3 or min(d.spacing) <= 0):
        raise ConfigError(f"spacing: expected three positive values, got {d.spacing}")
    if len(d.intensity_range) != 2 or d.intensity_range[0] >= d.intensity_range[1]:
        raise ConfigError(f"intensity_range: expected [low, high] with low < high, got {d.intensity_range}")
    if not 0 <= d.lower_percentile < d.upper_percentile <= 100:
        raise ConfigError("lower_percentile/upper_percentile: need 0 <= lower < upper <= 100")
    if d.output_intensity == "source" and d.intensity != "range":
        raise ConfigError("output_intensity: source needs intensity: range (percentile scaling has no fixed source range)")
    if len(t.adam_betas) != 2:
        raise ConfigError("adam_betas: expected two values")
    flow = df.prediction == "flow"
    if flow != (df.sampler in ("euler", "heun")):
        kind = "euler or heun" if flow else "ddim, ddpm or dpmpp2m"
        raise ConfigError(f"sampler: {df.sampler!r} does not fit prediction {df.prediction!r} (use {kind})")
    if flow and df.min_snr_gamma is not None:
        raise ConfigError("min_snr_gamma: applies to Gaussian diffusion (eps / v / x0), not to prediction: flow")
    if df.flow_shift is not None and df.flow_shift <= 0:
        raise ConfigError(f"flow_shift: must be positive, got {df.flow_shift}")
    if not 0.0 <= df.cond_drop_prob < 1.0:
        raise ConfigError(f"cond_drop_prob: must be in [0, 1), got {df.cond_drop_prob}")
    if df.guidance_scale < 0:
        raise ConfigError(f"guidance_scale: must be at least 0, got {df.guidance_scale}")
    if df.guidance_scale != 1.0 and not m.with_condition:
        raise ConfigError("guidance_scale: needs with_condition (there is no condition to guide by)")


def results_dir(cfg: Config) -> Path:
    return Path(cfg.train.results_dir or f"runs/{cfg.name}")
