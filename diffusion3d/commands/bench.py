"""``python -m diffusion3d bench``: training throughput, memory, sampling and loader speed, FLOP/s.

Every figure is the median of ``--repeats`` timed runs after ``--warmup`` untimed ones, measured on
synthetic NIfTI phantoms written to a temporary folder at each grid size (so no data is needed).

Memory: on CUDA ``torch.cuda.max_memory_allocated`` (reset before each configuration). On CPU the process
peak RSS only grows, so each training configuration runs in a fresh subprocess (``--isolate``); its peak
RSS and the growth over the RSS before the first step are reported. Independently of any allocator,
``memory.measure_step`` reports the bytes the measured Trainer's own micro-batches (forward+backward) keep
alive at their peak (``est_step_gb``).

FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` counts the Trainer's micro-batches of one step once
(forward+backward: matmuls and convolutions; with activation checkpointing the recomputed forward is
counted too, since the device executes it). Achieved TFLOP/s = FLOPs per optimizer step / median step time; on a GPU in
``PEAK_TFLOPS`` also its fraction of the dense bf16/fp16 tensor-core peak.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import monai
import torch

from .. import config as C
from .. import configs
from ..data import SampleStream, build_dataset, discover, make_loader
from ..diffusion import SAMPLERS, make_diffusion
from ..memory import estimate_step, flop_counter, measure_step, step_memory, synthetic_cases, table_row
from ..model import build_model, count_parameters
from ..monitor import current_rss_bytes, peak_rss_bytes
from ..precision import autocast_factory, cpu_has_fast_bf16
from ..sampling import ModelGridMask, generate
from ..space import make_space
from ..synthetic import write_cases
from ..trainer import Trainer
from .common import (
    InputError,
    OneLineParser,
    comma_list,
    configure_logging,
    device_flag,
    int_list,
    run_command,
    write_json,
)

log = logging.getLogger(__name__)

# Dense (no sparsity) bf16/fp16 tensor-core peaks in TFLOP/s from NVIDIA's data sheets; the first name
# found in torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("L4", 121.0),
    ("V100", 125.0),
]


# ---- small helpers ---------------------------------------------------------------------------------
def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def supported_precisions(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return ["fp32", "fp16"] + (["bf16"] if torch.cuda.is_bf16_supported() else [])
    return ["fp32"] + (["bf16"] if cpu_has_fast_bf16() else [])  # emulated bf16 is no row to plan with


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": str(torch.__version__),
        "monai": str(monai.__version__),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_gb=props.total_memory / 2**30,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            peak_bf16_tflops=peak_tflops(props.name),
        )
    else:
        info["device_name"] = _cpu_name()
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def bench_config(
    base: C.Config,
    size: int,
    data: tuple[list[Path], Path],
    precision: str = "fp32",
    checkpointing: bool = False,
    batch_size: int = 1,
    accum: int = 1,
    cache: str = "memory",
) -> C.Config:
    """The base config's model and diffusion on the synthetic data at ``size``³."""
    image_dirs, mask_dir = data
    try:
        return base.override(
            image_dir=str(image_dirs[0]) if len(image_dirs) == 1 else [str(p) for p in image_dirs],
            mask_dir=str(mask_dir),
            manifest=None,
            image_suffix="",
            mask_suffix="",
            image_size=[size] * 3,
            spacing=None,
            intensity="range",
            intensity_range=[0.0, 1.0],
            cache=cache,
            num_val_cases=0,
            unknown_labels="error",
            activation_checkpointing=checkpointing,
            precision=precision,
            batch_size=batch_size,
            gradient_accumulate_every=accum,
            results_dir=None,
            quiet=True,
            compile=False,
            warmup_steps=0,
            train_num_steps=10**9,
        )
    except C.ConfigError as e:
        raise InputError(f"size {size}: {e}") from None


# ---- FLOPs -----------------------------------------------------------------------------------------
def count_train_flops(trainer: Trainer) -> int:
    """FLOPs of one optimizer step's micro-batches, forward and backward (``trainer.accumulate``), as
    counted by FlopCounterMode: convolutions, matmuls, attention. Deterministic for a given model and
    shape; the optimizer step is not counted. Takes one step's data from the trainer's stream."""
    counter = flop_counter()  # FlopCounterMode that also counts the CPU flash-attention kernel
    with counter:
        trainer.accumulate()
    trainer.model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


# ---- training --------------------------------------------------------------------------------------
def measure_training(cfg: C.Config, device: torch.device, warmup: int, repeats: int, estimate: bool) -> dict[str, Any]:
    """Median optimizer-step time of a real Trainer on the config's data, its memory and FLOPs."""
    trainer = Trainer(cfg, build_dataset(discover(cfg), cfg, None), device, None, [])
    t = cfg.train
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = current_rss_bytes()
    times, data_times = [], []
    for i in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        result = trainer.train_step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            data_times.append(result.data_time)
    out: dict[str, Any] = {
        "step_times_s": times,
        "s_per_step": median(times),
        "volumes_per_s": t.batch_size * t.gradient_accumulate_every / median(times),
        "data_time_s": median(data_times),
        "parameters": count_parameters(trainer.model),
    }
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["mem_kind"] = "cuda_max_allocated"
    else:  # read before anything else below runs in this process: the peak only grows
        out["peak_mem_gb"] = peak_rss_bytes() / 2**30
        out["rss_growth_gb"] = max(peak_rss_bytes() - rss_before, 0) / 2**30
        out["mem_kind"] = "process_peak_rss"
    flops = count_train_flops(trainer)
    out["flops_per_step"] = flops
    out["achieved_tflops"] = flops / out["s_per_step"] / 1e12
    if device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(device))
        if peak is not None:
            out["peak_fraction"] = out["achieved_tflops"] / peak
    if estimate:
        mem = measure_step(trainer)
        out["est_step_gb"] = mem.step_peak_bytes / 2**30
        out["est_total_gb"] = mem.total_bytes / 2**30
    return out


def run_isolated(
    cfg: C.Config, device: torch.device, warmup: int, repeats: int, estimate: bool, workdir: Path
) -> dict[str, Any]:
    """measure_training in a fresh interpreter, so its peak RSS belongs to this configuration alone."""
    spec = workdir / f"spec_{time.monotonic_ns()}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(
        json.dumps(
            {
                "config": cfg.to_dict(),
                "device": str(device),
                "warmup": warmup,
                "threads": torch.get_num_threads(),
                "repeats": repeats,
                "estimate": estimate,
                "out": str(out),
            }
        )
    )
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds the diffusion3d package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-m", "diffusion3d.commands.bench", "--_worker", str(spec)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{spec}: benchmark subprocess failed (exit {proc.returncode}): {tail[0]}")
    return json.loads(out.read_text())


def _worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    cfg = C.from_dict(spec["config"])
    torch.set_num_threads(spec["threads"])  # the parent's setting, so both processes measure alike
    result = measure_training(cfg, torch.device(spec["device"]), spec["warmup"], spec["repeats"], spec["estimate"])
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# ---- sampling --------------------------------------------------------------------------------------
class _TimedModel(torch.nn.Module):
    """Times each model evaluation (the unit of sampling cost)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model, self.device, self.times = model, device, []

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.model(*args, **kwargs)
        sync(self.device)
        self.times.append(time.perf_counter() - start)
        return out


def measure_sampling(
    cfg: C.Config, device: torch.device, sampler: str, steps: int | None, max_steps: int | None, repeats: int
) -> dict[str, Any]:
    """Seconds per volume (batch 1) for ``steps`` sampling steps (None: the sampler's default, 0: every
    training timestep); with ``max_steps`` < steps, that many steps run and the time is scaled by
    steps / steps_run (each step is one model evaluation). Runs ``sampling.generate``, as the command does."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg).to(device).eval()
    diffusion = make_diffusion(cfg)
    configured = cfg.diffusion.sampling_steps if sampler == cfg.diffusion.sampler else None  # the config's own
    steps = diffusion.timesteps if steps == 0 else steps or diffusion.default_steps(sampler, configured)
    run_steps = min(steps, max_steps) if max_steps else steps
    item = synthetic_cases(cfg, n=1, seed=cfg.train.seed)[0]
    grid = ModelGridMask(item["mask"] if cfg.model.with_condition else torch.zeros(1, *cfg.data.image_size))
    space = make_space(cfg)  # the warm-up evaluation sees what generate's do: the space's shapes
    shape = (1, *space.latent_shape(cfg.image_channels, cfg.data.image_size))
    cond = space.cond(grid.cond(cfg.data.labels)[None].to(device)) if cfg.model.with_condition else None
    timed = _TimedModel(model, device)
    with torch.no_grad(), autocast_factory(cfg.train.precision, device)():  # warm-up: one evaluation
        model(torch.randn(shape, device=device), torch.zeros(1, dtype=torch.long, device=device), cond)
    totals = []
    for _ in range(max(repeats, 1)):
        timed.times.clear()
        sync(device)
        start = time.perf_counter()
        for _ in generate(
            timed, cfg, [grid], [cfg.train.seed], sampler=sampler, steps=run_steps, batch_size=1, device=device
        ):
            pass
        sync(device)
        totals.append(time.perf_counter() - start)
    measured = median(totals)
    return {
        "sampler": sampler,
        "steps": steps,
        "steps_run": run_steps,
        "extrapolated": run_steps < steps,
        "s_per_volume": measured * steps / run_steps,
        "s_per_eval": median(timed.times),
    }


# ---- loader ----------------------------------------------------------------------------------------
def measure_loader(cfg: C.Config, warmup: int, repeats: int) -> dict[str, Any]:
    """Seconds per micro-batch out of the training loader; cache: memory decodes once up front (timed as
    cache_build_s), cache: none decodes and transforms every volume of every batch."""
    cases = discover(cfg)
    start = time.perf_counter()
    dataset = build_dataset(cases, cfg, None)
    build = time.perf_counter() - start
    loader = iter(make_loader(dataset, SampleStream(len(dataset), cfg.train.seed), cfg.train.batch_size, cfg, False))
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        next(loader)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "cached": cfg.data.cache == "memory",
        "s_per_batch": median(times),
        "batch_times_s": times,
        "cache_build_s": build,
        "batch_size": cfg.train.batch_size,
        "cases": len(cases),
    }


def measure_startup(cfg: C.Config, workers: int) -> dict[str, Any]:
    """Start-up before the first step: discovery + validation (every file decoded and checked, in ``workers``
    processes) and the memory cache build (decode + transforms, ``max(workers, 1)`` threads), in seconds."""
    from ..data import validate

    cfg.data.num_workers = workers
    start = time.perf_counter()
    cases = discover(cfg)
    validate(cases, cfg, workers=workers)
    validated = time.perf_counter()
    build_dataset(cases, cfg, None)
    built = time.perf_counter()
    return {
        "cases": len(cases),
        "workers": workers,
        "validate_s": validated - start,
        "cache_build_s": built - validated,
        "startup_s": built - start,
    }


# ---- the command line ------------------------------------------------------------------------------
def _int_list(text: str, name: str) -> list[int]:
    return int_list(text, f"--{name}", at_least=1)


def _sampling_steps(text: str | None) -> dict[str, int | None]:
    steps: dict[str, int | None] = dict.fromkeys(SAMPLERS)  # None: the sampler's default (diffusion.SAMPLERS)
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        if name not in SAMPLERS or not value:
            raise InputError(f"--sampling_steps: expected sampler=steps (samplers {', '.join(SAMPLERS)}), got {part!r}")
        try:
            steps[name] = 0 if value == "all" else int(value)
        except ValueError:
            raise InputError(f"--sampling_steps: {part!r}: steps must be an integer or 'all'") from None
    return steps


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m diffusion3d bench", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        default=None,
        help="YAML config whose model/diffusion to measure: a path or a bundled config's name (default: default)",
    )
    p.add_argument("--sizes", default="32,64,128", help="grid sizes (cubes) for training, comma-separated")
    p.add_argument(
        "--spaces",
        default=None,
        help="training: spaces to measure at each size, from pixel, wavelet1, wavelet2 (default: the config's)",
    )
    p.add_argument("--precisions", default="auto", help="auto (all the device supports) or e.g. fp32,bf16")
    p.add_argument("--batch_size", default=None, help="micro-batch size(s), comma-separated (default: the config's)")
    p.add_argument("--accum", default=None, help="accumulation step(s), comma-separated (default: the config's)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed ones")
    p.add_argument("--checkpointing", choices=("both", "on", "off"), default="both")
    p.add_argument(
        "--parts",
        default="train,sampling",
        help="what to measure: train, sampling, loader; or quality alone (time to quality: see "
        "python -m diffusion3d bench --parts quality --help)",
    )
    p.add_argument("--loader", action="store_true", help="also measure the loader (cached vs uncached)")
    p.add_argument("--sampling", default="auto", help="samplers to time (auto: all of the config's objective), or none")
    p.add_argument(
        "--sampling_steps",
        default=None,
        help="e.g. ddpm=all,ddim=50,heun=5 (default: the config's "
        "sampling_steps for its sampler, else its default in diffusion.SAMPLERS)",
    )
    p.add_argument(
        "--sampling_max_steps",
        type=int,
        default=None,
        help="run at most this many steps and scale the time up (reported as extrapolated)",
    )
    p.add_argument("--sampling_sizes", default=None, help="sizes for sampling (default: the smallest of --sizes)")
    p.add_argument("--sampling_repeats", type=int, default=1, help="timed sampling runs per figure")
    p.add_argument("--loader_sizes", default=None, help="sizes for the loader (default: --sizes)")
    p.add_argument("--startup_cases", type=int, default=100, help="--parts startup: synthetic cases (default 100)")
    p.add_argument("--startup_size", type=int, default=128, help="--parts startup: their size (cube, default 128)")
    p.add_argument(
        "--startup_workers",
        default="1,2",
        help="--parts startup: validation processes to compare (1: in this process; default 1,2)",
    )
    p.add_argument(
        "--isolate",
        choices=("auto", "on", "off"),
        default="auto",
        help="each training configuration in a fresh process (auto: on for CPU, where RSS is the memory measure)",
    )
    p.add_argument("--no_estimate", action="store_true", help="skip the allocator-free step-memory measurement")
    p.add_argument(
        "--table_sizes",
        default="64,128,256,192x192x144:4",
        help="--parts memory_table: grids (N for N³, or DxHxW) with :C image channels (default 1)",
    )
    p.add_argument("--table_spaces", default="pixel,wavelet1,wavelet2", help="--parts memory_table: spaces")
    p.add_argument(
        "--table_precisions",
        default="fp16,bf16",
        help="--parts memory_table: precisions, replayed with CUDA's autocast rules on any machine",
    )
    p.add_argument("--table_cards", default="16,24,40,80", help="--parts memory_table: GPU memory sizes in GiB")
    p.add_argument(
        "--check_sizes",
        default="32,64",
        help="--parts memory_check: cube sizes where the meta trace (CPU autocast rules) is compared with "
        "the step run for real on the CPU, for --table_spaces × fp32,bf16 × --checkpointing",
    )
    p.add_argument("--json", default=None, help="also write the results here as JSON")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); on a shared CPU fewer threads can be much faster",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 repeat, 1 warm-up, sampling capped at 4 steps (extrapolated), 2 loader batches",
    )
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    return p


PARTS = ("train", "sampling", "loader", "startup", "memory_table", "memory_check")


@dataclass
class Plan:
    """Every input resolved and checked before anything runs (the args themselves are never changed)."""

    base: C.Config
    device: torch.device
    precisions: list[str]
    sizes: list[int]
    batch_sizes: list[int]
    accums: list[int]
    checkpointing: list[bool]
    parts: set[str]
    samplers: list[str]
    sampling_steps: dict[str, int | None]
    sampling_sizes: list[int]
    loader_sizes: list[int]
    isolate: bool
    repeats: int
    warmup: int
    sampling_max_steps: int | None
    threads: int | None
    table: TableSpec | None = None
    spaces: list[tuple[str, int]] | None = None  # training: (space, wavelet levels); None: the config's


def _resolve_precisions(text: str, device: torch.device) -> list[str]:
    supported = supported_precisions(device)
    precisions = supported if text == "auto" else comma_list(text)
    for p in precisions:
        if p not in supported:
            raise InputError(f"--precisions: {p} is not supported on {device.type} (supported: {', '.join(supported)})")
    return precisions


def _resolve_samplers(text: str, base: C.Config) -> list[str]:
    """auto: every sampler of the config's objective (``diffusion.SAMPLERS``)."""
    fitting = make_diffusion(base).samplers
    if text == "auto":
        return list(fitting)
    samplers = [] if text == "none" else comma_list(text)
    for s in samplers:
        if s not in SAMPLERS:
            raise InputError(f"--sampling: unknown sampler {s!r} (choose from {', '.join(fitting)}, auto or none)")
        if s not in fitting:
            raise InputError(
                f"--sampling: {s} does not fit prediction {base.diffusion.prediction} "
                f"(choose from {', '.join(fitting)}, auto or none)"
            )
    return samplers


def _resolve_parts(args: argparse.Namespace) -> set[str]:
    parts = set(comma_list(args.parts)) | ({"loader"} if args.loader else set())
    if parts - set(PARTS):
        raise InputError(f"--parts: unknown part(s) {', '.join(sorted(parts - set(PARTS)))}")
    return parts


def _check_counts(args: argparse.Namespace) -> None:
    if args.threads is not None and args.threads < 1:
        raise InputError(f"--threads: must be at least 1, got {args.threads}")
    if args.repeats < 1 or args.warmup < 0:
        raise InputError("--repeats must be at least 1 and --warmup at least 0")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise InputError(f"{args.json}: folder {Path(args.json).resolve().parent} does not exist")


def resolve_args(args: argparse.Namespace) -> Plan:
    """Check every input before anything runs; returns the resolved plan."""
    base = C.load(configs.find(args.config))  # a ConfigError is bad input: one line, exit 2
    C.validate(base)
    device = device_flag(args.device)
    _check_counts(args)
    sizes = _int_list(args.sizes, "sizes")
    return Plan(
        base=base,
        device=device,
        precisions=_resolve_precisions(args.precisions, device),
        sizes=sizes,
        batch_sizes=_int_list(args.batch_size, "batch_size") if args.batch_size else [base.train.batch_size],
        accums=_int_list(args.accum, "accum") if args.accum else [base.train.gradient_accumulate_every],
        checkpointing={"both": [False, True], "on": [True], "off": [False]}[args.checkpointing],
        parts=_resolve_parts(args),
        samplers=_resolve_samplers(args.sampling, base),
        sampling_steps=_sampling_steps(args.sampling_steps),
        sampling_sizes=_int_list(args.sampling_sizes, "sampling_sizes") if args.sampling_sizes else [min(sizes)],
        loader_sizes=_int_list(args.loader_sizes, "loader_sizes") if args.loader_sizes else sizes,
        isolate=args.isolate == "on" or (args.isolate == "auto" and device.type == "cpu"),
        repeats=1 if args.quick else args.repeats,
        warmup=1 if args.quick else args.warmup,
        sampling_max_steps=args.sampling_max_steps or (4 if args.quick else None),
        threads=args.threads,
        table=_resolve_table(args) if {"memory_table", "memory_check"} & _resolve_parts(args) else None,
        spaces=[_space(name, "--spaces") for name in comma_list(args.spaces)] if args.spaces else None,
    )


@dataclass
class TableSpec:
    """--parts memory_table: (grid, image channels) pairs, (space, wavelet levels), precisions, cards (GiB)."""

    sizes: list[tuple[list[int], int]]
    spaces: list[tuple[str, int]]
    precisions: list[str]
    cards: list[int]


def _resolve_table(args: argparse.Namespace) -> TableSpec:
    sizes = []
    for item in comma_list(args.table_sizes):
        grid, _, channels = item.partition(":")
        try:
            sides = [int(v) for v in grid.split("x")]
            sides = sides * 3 if len(sides) == 1 else sides
            count = int(channels) if channels else 1
        except ValueError:
            raise InputError(f"--table_sizes: expected N or DxHxW with an optional :channels, got {item!r}") from None
        if len(sides) != 3 or min(sides) < 1 or count < 1:
            raise InputError(f"--table_sizes: expected three positive sides and channels, got {item!r}")
        sizes.append((sides, count))
    spaces = [_space(name, "--table_spaces") for name in comma_list(args.table_spaces)]
    precisions = comma_list(args.table_precisions)
    for p in precisions:
        if p not in ("fp32", "fp16", "bf16"):
            raise InputError(f"--table_precisions: {p!r} is not one of fp32, fp16, bf16")
    return TableSpec(sizes, spaces, precisions, _int_list(args.table_cards, "table_cards"))


SPACES = {"pixel": ("pixel", 1), "wavelet1": ("wavelet", 1), "wavelet2": ("wavelet", 2)}


def _space(name: str, flag: str) -> tuple[str, int]:
    """A space's bench name (pixel, wavelet1, wavelet2) → (data.space, data.wavelet_levels)."""
    if name not in SPACES:
        raise InputError(f"{flag}: unknown space {name!r} (choose from {', '.join(SPACES)})")
    return SPACES[name]


def space_label(space: str, levels: int) -> str:
    return f"{space}{levels if space == 'wavelet' else ''}"


class _Data:
    """Synthetic NIfTI cases per grid size, written once into the benchmark's temp folder."""

    def __init__(self, work: Path, base: C.Config) -> None:
        self.work, self.base, self.sets = work, base, {}

    def __call__(self, size: int) -> tuple[list[Path], Path]:
        if size not in self.sets:
            self.sets[size] = write_cases(
                self.work / f"data_{size}", size, 4, self.base.data.labels, self.base.image_channels
            )
        return self.sets[size]


def _bench_train(plan: Plan, data: _Data, args, progress) -> list[dict[str, Any]]:
    rows = []
    estimate = plan.device.type == "cpu" and not args.no_estimate
    spaces = plan.spaces or [(plan.base.data.space, plan.base.data.wavelet_levels)]
    for size, (space, levels), precision, ckpt, bs, accum in itertools.product(
        plan.sizes, spaces, plan.precisions, plan.checkpointing, plan.batch_sizes, plan.accums
    ):
        cfg = bench_config(plan.base, size, data(size), precision, ckpt, bs, accum)
        cfg = cfg.override(space=space, wavelet_levels=levels)
        label = space_label(space, levels)
        progress(
            f"train {size}³ {label} {precision} checkpointing={'on' if ckpt else 'off'} batch {bs} × accum {accum}"
        )
        if plan.isolate:
            r = run_isolated(cfg, plan.device, plan.warmup, plan.repeats, estimate, data.work)
        else:
            r = measure_training(cfg, plan.device, plan.warmup, plan.repeats, estimate)
            if plan.device.type == "cpu":
                r["mem_kind"] = "process_peak_rss_shared"  # the same process ran earlier configs
        rows.append(
            {
                "size": size,
                "space": label,
                "precision": precision,
                "checkpointing": ckpt,
                "batch_size": bs,
                "accum": accum,
                **r,
            }
        )
        # each row as it is measured: a run killed later (a shared GPU's time limit) keeps what it printed
        progress(f"  {r['s_per_step']:.3f} s/step, peak {r['peak_mem_gb']:.2f} GiB ({r['mem_kind']})")
    return rows


def _bench_sampling(plan: Plan, data: _Data, args, progress) -> list[dict[str, Any]]:
    rows = []
    for size, precision in itertools.product(plan.sampling_sizes, plan.precisions):
        cfg = bench_config(plan.base, size, data(size), precision)
        for sampler in plan.samplers:
            progress(f"sampling {size}³ {precision} {sampler}")
            r = measure_sampling(
                cfg,
                plan.device,
                sampler,
                plan.sampling_steps.get(sampler),
                plan.sampling_max_steps,
                args.sampling_repeats,
            )
            rows.append({"size": size, "precision": precision, **r})
    return rows


def _bench_loader(plan: Plan, data: _Data, args, progress) -> list[dict[str, Any]]:
    rows = []
    for size, cache in itertools.product(plan.loader_sizes, ("memory", "none")):
        cfg = bench_config(plan.base, size, data(size), batch_size=plan.batch_sizes[0], cache=cache)
        progress(f"loader {size}³ cache={cache}")
        rows.append({"size": size, **measure_loader(cfg, plan.warmup, max(plan.repeats, 2))})
    return rows


def _bench_startup(plan: Plan, data: _Data, args, progress) -> list[dict[str, Any]]:
    """Validation + cache of --startup_cases synthetic cases at --startup_size³, per worker count."""
    size, rows = args.startup_size, []
    folders = write_cases(
        data.work / "startup", size, args.startup_cases, plan.base.data.labels, plan.base.image_channels
    )
    for workers in _int_list(args.startup_workers, "startup_workers"):
        progress(f"start-up {args.startup_cases} cases at {size}³, {workers} workers")
        rows.append({"size": size, **measure_startup(bench_config(plan.base, size, folders), workers)})
    return rows


def _bench_memory_table(plan: Plan, data: _Data, args, progress) -> list[dict[str, Any]]:
    """Memory and FLOPs of the config's training step per size, space, precision and checkpointing, traced
    on the meta device (``memory.estimate_step``): nothing is allocated or computed, any size runs here."""
    rows = []
    spec = plan.table
    for (size, channels), (space, levels), precision, ckpt in itertools.product(
        spec.sizes, spec.spaces, spec.precisions, plan.checkpointing
    ):
        progress(
            f"memory table {'x'.join(map(str, size))}:{channels} {space_label(space, levels)} "
            f"{precision} checkpointing={'on' if ckpt else 'off'}"
        )
        row = table_row(plan.base, size, channels, space, levels, precision, ckpt, spec.cards)
        rows.append({**vars(row), "total_gb": row.total_gb})
    return rows


def _bench_memory_check(plan: Plan, data: _Data, args, progress) -> list[dict[str, Any]]:
    """The meta trace against the real step on the CPU (``memory.step_memory``: live bytes of the same
    Trainer.accumulate, batch 1 × accum 2), with the CPU's autocast rules so both run the same casts."""
    rows = []
    for size, (space, levels), precision, ckpt in itertools.product(
        _int_list(args.check_sizes, "check_sizes"), plan.table.spaces, ("fp32", "bf16"), plan.checkpointing
    ):
        cfg = C.from_dict(plan.base.to_dict())
        cfg.data.space, cfg.data.wavelet_levels, cfg.data.image_size = space, levels, [size] * 3
        cfg.train.precision, cfg.model.activation_checkpointing = precision, ckpt
        try:
            C.validate(cfg)
        except C.ConfigError as e:
            raise InputError(f"--check_sizes: {e}") from None
        label = space_label(space, levels)
        progress(f"memory check {size}³ {label} {precision} checkpointing={'on' if ckpt else 'off'}")
        start = time.perf_counter()
        estimate = estimate_step(cfg, 1, rules="cpu")
        traced = time.perf_counter() - start
        real = step_memory(cfg, 1)
        rows.append(
            {
                "size": size,
                "space": label,
                "precision": precision,
                "checkpointing": ckpt,
                "estimate_gb": estimate.total_bytes / 2**30,
                "measured_gb": real.total_bytes / 2**30,
                "ratio": estimate.total_bytes / real.total_bytes,
                "trace_s": traced,
                "run_s": time.perf_counter() - start - traced,
            }
        )
    return rows


def run_benchmark(args: argparse.Namespace, progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    plan = resolve_args(args)
    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    report: dict[str, Any] = {
        "machine": machine_info(plan.device),
        "settings": {
            "config": str(configs.find(args.config)),
            "channels": plan.base.model.channels,
            "attention_levels": plan.base.model.attention_levels,
            "repeats": plan.repeats,
            "warmup": plan.warmup,
            "quick": args.quick,
            "isolated": plan.isolate,
            "sampling_max_steps": plan.sampling_max_steps,
        },
        "train": [],
        "sampling": [],
        "loader": [],
    }
    parts = {
        "train": _bench_train,
        "sampling": _bench_sampling,
        "loader": _bench_loader,
        "startup": _bench_startup,
        "memory_table": _bench_memory_table,
        "memory_check": _bench_memory_check,
    }
    with tempfile.TemporaryDirectory(prefix="d3d_bench_") as tmp:
        data = _Data(Path(tmp), plan.base)
        for name in PARTS:
            if name in plan.parts:
                report[name] = parts[name](plan, data, args, progress)
    report["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return report


def format_tables(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        f"# {m['device_name']} ({m['device']}), torch {m['torch']}, monai {m['monai']}, "
        f"{m['torch_threads']} threads, load average {m.get('load_average')} → {m.get('load_average_end')}"
    ]
    if report["train"]:
        lines += [
            "",
            "training (median of timed optimizer steps; × row 1: s/step over the first row's)",
            f"{'size':>5} {'space':>8} {'prec':>5} {'ckpt':>4} {'bs':>3} {'acc':>3} {'s/step':>8} "
            f"{'× row 1':>7} {'vol/s':>8} {'peak GB':>8} {'Δrss GB':>8} {'est GB':>8} {'GFLOP/step':>11} "
            f"{'TFLOP/s':>8} {'of peak':>7}",
        ]
        first = report["train"][0]["s_per_step"]
        for r in report["train"]:
            lines.append(
                f"{r['size']:>5} {r.get('space', '-'):>8} {r['precision']:>5} "
                f"{'on' if r['checkpointing'] else 'off':>4} {r['batch_size']:>3} {r['accum']:>3} "
                f"{r['s_per_step']:>8.3f} {r['s_per_step'] / first:>7.2f} "
                f"{r['volumes_per_s']:>8.2f} {r['peak_mem_gb']:>8.3f} "
                f"{_fmt(r.get('rss_growth_gb'))} {_fmt(r.get('est_step_gb'))} {r['flops_per_step'] / 1e9:>11.1f} "
                f"{r['achieved_tflops']:>8.3f} {_fmt(r.get('peak_fraction'), 7, '.1%')}"
            )
        kind = report["train"][0]["mem_kind"]
        lines.append(f"peak GB: {kind}; est GB: allocator-free peak of one micro-batch's forward+backward")
    if report["sampling"]:
        lines += [
            "",
            "sampling (batch 1)",
            f"{'size':>5} {'prec':>5} {'sampler':>8} {'steps':>6} {'run':>5} {'s/volume':>9} {'s/eval':>8}",
        ]
        for r in report["sampling"]:
            note = "  (extrapolated from the steps run)" if r["extrapolated"] else ""
            lines.append(
                f"{r['size']:>5} {r['precision']:>5} {r['sampler']:>8} {r['steps']:>6} {r['steps_run']:>5} "
                f"{r['s_per_volume']:>9.2f} {r['s_per_eval']:>8.4f}{note}"
            )
    if report["loader"]:
        lines += [
            "",
            "loader (median seconds per micro-batch)",
            f"{'size':>5} {'cached':>6} {'bs':>3} {'s/batch':>9} {'cache build s':>14}",
        ]
        for r in report["loader"]:
            lines.append(
                f"{r['size']:>5} {'yes' if r['cached'] else 'no':>6} {r['batch_size']:>3} {r['s_per_batch']:>9.4f} "
                f"{r['cache_build_s'] if r['cached'] else 0:>14.2f}"
            )
    if report.get("startup"):
        lines += [
            "",
            "start-up (discovery + validation, then the memory cache build)",
            f"{'size':>5} {'cases':>6} {'workers':>7} {'validate s':>11} {'cache s':>8} {'total s':>8}",
        ]
        for r in report["startup"]:
            lines.append(
                f"{r['size']:>5} {r['cases']:>6} {r['workers']:>7} {r['validate_s']:>11.2f} "
                f"{r['cache_build_s']:>8.2f} {r['startup_s']:>8.2f}"
            )
    if report.get("memory_table"):
        lines += ["", format_memory_table(report["memory_table"])]
    if report.get("memory_check"):
        lines += [
            "",
            "| grid | space | prec | ckpt | traced GiB | measured GiB | ratio | trace s | run s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["memory_check"]:
            lines.append(
                f"| {r['size']}³ | {r['space']} | {r['precision']} | {'on' if r['checkpointing'] else 'off'} | "
                f"{r['estimate_gb']:.3f} | {r['measured_gb']:.3f} | {r['ratio']:.4f} | {r['trace_s']:.1f} | "
                f"{r['run_s']:.1f} |"
            )
    return "\n".join(lines)


def format_memory_table(rows: list[dict[str, Any]]) -> str:
    """The memory table as Markdown: one micro-batch of 1 and the largest micro-batch per card."""
    cards = list(rows[0]["largest_batch"])
    head = [
        "grid",
        "ch",
        "space",
        "prec",
        "ckpt",
        "GiB, batch 1",
        "+GiB/sample",
        "TFLOP/sample",
        *[f"max batch {c} GB" for c in cards],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            "×".join(map(str, r["image_size"])),
            str(r["image_channels"]),
            r["space"],
            r["precision"],
            "on" if r["checkpointing"] else "off",
            f"{r['total_gb']:.2f}",
            f"{r['per_sample_gb']:.2f}",
            f"{r['tflops_per_sample']:.2f}",
            *[str(r["largest_batch"][c]) for c in cards],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, width: int = 8, spec: str = ".3f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _split_quality(argv: list[str]) -> list[str] | None:
    """``--parts quality`` hands the rest of the command line to the time-to-quality benchmark."""
    for i, arg in enumerate(argv):
        if arg == "--parts" and i + 1 < len(argv) and argv[i + 1] == "quality":
            return argv[:i] + argv[i + 2 :]
        if arg == "--parts=quality":
            return argv[:i] + argv[i + 1 :]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from . import accumulation  # --parts accumulation: the loss-division questions (docs/accumulation.md)

    if (rest := accumulation.split_argv(argv)) is not None:
        return accumulation.main(rest)
    rest = _split_quality(argv)
    if rest is not None:
        from . import quality

        return quality.main(rest, prog="python -m diffusion3d bench --parts quality")
    args = build_parser().parse_args(argv)
    if args._worker:
        return _worker(args._worker)
    configure_logging(logging.WARNING)
    return run_command(lambda: benchmark(args))


def benchmark(args: argparse.Namespace) -> int:
    """Measure, print the tables and (with --json) write the report."""
    report = run_benchmark(args, lambda s: print(f"... {s}", file=sys.stderr, flush=True))
    print(format_tables(report), flush=True)
    if args.json:
        path = Path(args.json)
        write_json(path, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
