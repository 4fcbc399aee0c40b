"""The training command line: parse, check everything, build, ``Trainer(...).train()``.

Only this layer prints and picks exit codes (``commands.common.run_command``): 2 for bad input (config, flags, data,
checkpoints, a results folder another run holds), 1 for a fault (a run stopped by non-finite losses;
storage: no space, I/O error, read-only folder), 130 for a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import sys
from pathlib import Path

from .. import checkpoint as ckpt
from .. import config as C
from .. import configs, distributed, storage
from ..data import discover, format_summary, validate
from ..precision import resolve_precision
from ..trainer import NonFiniteError, Trainer, build_trainer
from .common import BAD_INPUT, InputError, OneLineParser, configure_logging, run_command

log = logging.getLogger("diffusion3d")
DEFAULT_CONFIG = configs.DEFAULT  # inside the package: found by a wheel install too


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(  # a bad flag or config value: one line, exit 2, as every command
        prog="train.py",
        usage="%(prog)s [-h] [--config YAML] [--check_data] [--KEY VALUE ...]",  # every key: see --help
        description="Train a conditional 3D diffusion model (mask → MRI volume). Every config key can be "
        "overridden by its name, e.g. --batch_size 2 --lr 2e-4 --labels [1,2,4]; values are read as YAML.",
    )
    p.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG.name} of this project)")
    p.add_argument("--check_data", action="store_true", help="only validate the data and print a summary")
    try:
        shipped = C.load(DEFAULT_CONFIG)  # --help shows what the default config sets, too
    except C.ConfigError:
        shipped = None
    C.add_arguments(p, shipped)
    return p


def resolve_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> C.Config:
    try:
        cfg = C.load(args.config or DEFAULT_CONFIG)
        C.apply_arguments(cfg, args)
        cfg.validate()
        try:
            world_size = distributed.env_world_size()
        except ValueError:
            world_size = None  # a bad torchrun environment: distributed.setup names it
        if world_size is not None:
            cfg.train.check_processes(world_size)
    except C.ConfigError as e:
        parser.error(str(e))
    return cfg


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, C.Config]:
    """The flags and the resolved config; a bad flag or config exits 2 from the parser."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.config = configs.find(args.config)  # a path or the name of a bundled config
    except C.ConfigError as e:
        parser.error(str(e))
    return args, resolve_config(args, parser)


def plan_batch(cfg: C.Config, device, dist) -> None:
    """--batch_size auto: the largest micro-batch that fits, accum derived so that batch_size × accum ×
    processes is effective_batch (the samples per optimizer step, over all processes)."""
    from ..memory import MemoryPlanError, find_max_batch, plan_accumulation

    effective = cfg.train.effective_batch
    if effective % dist.world_size:
        raise InputError(f"effective_batch: {effective} is not divisible by {dist.world_size} processes")
    try:
        largest = find_max_batch(cfg, device, max_batch=cfg.train.max_batch)
    except MemoryPlanError as e:
        raise InputError(str(e)) from None
    largest = distributed.broadcast_object(largest)  # every rank uses rank 0's plan
    cfg.train.batch_size, cfg.train.gradient_accumulate_every = plan_accumulation(effective // dist.world_size, largest)
    log.info(
        "batch_size auto: largest micro-batch %d -> batch_size %d x accum %d (effective %d)",
        largest,
        cfg.train.batch_size,
        cfg.train.gradient_accumulate_every,
        effective,
    )


def install_signal_handlers(trainer: Trainer) -> None:
    """SIGTERM/SIGINT: finish the step, save, exit 0. A second SIGINT stops at once."""

    def request_stop(signum, frame):
        if trainer.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        print(
            f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
            "(Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def write_config(cfg: C.Config, path: Path) -> None:
    """The resolved config, written atomically (temp file, replace); StorageError on an OS failure."""
    storage.atomic_write_text(path, cfg.to_yaml(), "the resolved config")


def start_processes(cfg: C.Config) -> distributed.DistInfo:
    """torchrun's processes (one without it), the precision the device allows, --batch_size auto."""
    try:
        dist = distributed.setup(cfg.train.device)  # torchrun's RANK/WORLD_SIZE; one process without them
    except ValueError as e:
        raise InputError(str(e)) from None
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # one rank narrates, every rank warns
    cfg.train.precision = resolve_precision(cfg.train.precision, dist.device)
    if cfg.train.batch_size == "auto":
        plan_batch(cfg, dist.device, dist)
    return dist


def claim_results(
    cfg: C.Config, results: Path, dist: distributed.DistInfo, held: contextlib.ExitStack
) -> tuple[str | None, tuple[Path, dict] | None]:
    """Rank 0 alone locks the results folder (``held`` until run() returns; the kernel drops it on death)
    and decides what to resume, or why not; every rank follows that decision. Returns (checkpoint path,
    (path, state) on rank 0)."""
    decision: tuple[str | None, str | None, int] = (None, None, 2)  # (checkpoint path, error, exit code)
    found = None
    if dist.is_main:
        try:
            held.enter_context(storage.claim_folder(results, "run"))
            ckpt.remove_stale_temps(results / "checkpoints")  # a killed writer's; nobody else writes here now
            found = ckpt.select_checkpoint(
                cfg.train.resume, cfg.train.overwrite, results / "checkpoints", cfg.to_dict()
            )
            decision = (str(found[0]) if found else None, None, 2)
        except BAD_INPUT as e:
            decision = (None, str(e), 2)
        except storage.StorageError as e:
            decision = (None, str(e), 1)
    resume_path, error, code = distributed.broadcast_object(decision)
    if error is not None:
        raise (InputError if code == 2 else storage.StorageError)(error)
    return resume_path, found


def prepare_results(cfg: C.Config, results: Path, dist: distributed.DistInfo) -> None:
    """Rank 0 prints the resolved config, clears the folder for --overwrite and writes config.yaml."""
    if dist.is_main:
        print(f"# diffusion3d resolved config ({results})\n{cfg.to_yaml()}", flush=True)
        if cfg.train.resume == "none" and cfg.train.overwrite:
            for sub in ("checkpoints", "tb", "samples"):
                shutil.rmtree(results / sub, ignore_errors=True)
        write_config(cfg, results / "config.yaml")
    distributed.barrier()  # nobody reads results_dir (cache, checkpoint) before rank 0 has prepared it


def resume(
    trainer: Trainer, resume_path: str | None, found: tuple[Path, dict] | None, dist: distributed.DistInfo
) -> None:
    """Load the chosen checkpoint: rank 0 has it already, the others read it from the shared folder."""
    if resume_path is None:
        return
    try:
        state = found[1] if found is not None else ckpt.load(Path(resume_path))
    except ckpt.CheckpointError as e:
        raise InputError(
            f"{e} (rank {dist.rank}: every node must see results_dir, e.g. on a shared filesystem)"
        ) from None
    trainer.load_state_dict(state)
    log.info("resumed from %s at step %d (%d samples seen)", resume_path, trainer.step, trainer.stream.samples_seen)


def train(trainer: Trainer, dist: distributed.DistInfo) -> str:
    """'finished' or 'interrupted' (SIGTERM/SIGINT: the step finished and a checkpoint saved)."""
    cfg = trainer.cfg
    log.info(
        "%d training cases, %d validation cases, device %s, precision %s, effective batch %d "
        "(batch_size × accum × %d processes)",
        len(trainer.dataset),
        len(trainer.val_cases),
        dist.device,
        cfg.train.precision,
        cfg.train.batch_size * cfg.train.gradient_accumulate_every * dist.world_size,
        dist.world_size,
    )
    install_signal_handlers(trainer)
    return trainer.train()


def report(status: str, trainer: Trainer, results: Path, dist: distributed.DistInfo) -> int:
    if not dist.is_main:
        return 0
    if status == "interrupted":
        print(
            f"stopped at step {trainer.step} on request; checkpoint saved in {results / 'checkpoints'}. "
            "Run the same command again to resume.",
            flush=True,
        )
    else:
        print(f"done: {trainer.step} steps; results in {results}", flush=True)
    return 0


def run(argv: list[str] | None = None) -> int:
    """The command without its exit: 0, or an exception that main maps to one line and an exit code."""
    with contextlib.ExitStack() as held:  # the results folder's lock, released when run() returns
        return _run(argv, held)


def _run(argv: list[str] | None, held: contextlib.ExitStack) -> int:
    args, cfg = parse(argv)
    configure_logging()
    cases = discover(cfg)
    summaries = validate(cases, cfg)
    if args.check_data:
        print(format_summary(summaries))
        return 0
    dist = start_processes(cfg)
    results = C.results_dir(cfg)
    resume_path, found = claim_results(cfg, results, dist, held)
    prepare_results(cfg, results, dist)
    trainer = build_trainer(cfg, cases, dist.device, results, dist.rank, dist.world_size)
    resume(trainer, resume_path, found, dist)
    return report(train(trainer, dist), trainer, results, dist)


def main(argv: list[str] | None = None) -> None:
    # under torchrun, anything unexpected on one rank ends the whole job with that rank's traceback
    with distributed.fail_fast():
        code = run_command(lambda: run(argv), faults=(NonFiniteError,))
    distributed.end_process(code)  # failures leave at once: a clean exit could wait on a stuck peer


if __name__ == "__main__":
    main()
