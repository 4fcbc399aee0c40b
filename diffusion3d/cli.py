"""The training command line: parse, check everything, build, ``Trainer(...).train()``.

Only this layer prints and picks exit codes: 2 for bad input (config, flags, data, checkpoints, a
results folder another run holds), 1 for a fault (a run stopped by non-finite losses; storage: no space,
I/O error, read-only folder), 130 for a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
from pathlib import Path

from . import checkpoint as ckpt
from . import config as C
from . import distributed
from .data import DataError, DataProblems, build_dataset, discover, format_summary, split_cases, validate
from .trainer import NonFiniteError, Trainer, resolve_precision

log = logging.getLogger("diffusion3d")
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


class InputError(Exception):
    """Bad input found by the command line; printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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


def select_checkpoint(cfg: C.Config, results: Path) -> tuple[Path, dict] | None:
    """Apply --resume auto|none|PATH; raises InputError for what cannot be resumed."""
    folder = results / "checkpoints"
    resume = cfg.train.resume
    existing = ckpt.list_checkpoints(folder)
    if resume == "none":
        if existing and not cfg.train.overwrite:
            raise InputError(f"{folder}: holds {len(existing)} checkpoint(s); use --resume auto to continue "
                             "or --overwrite to start afresh")
        return None
    if resume == "auto":
        found = ckpt.load_latest_valid(folder)
        if found is None and existing:
            raise InputError(f"{folder}: no valid checkpoint among {len(existing)} file(s)")
    else:
        try:
            found = Path(resume), ckpt.load(Path(resume))
        except ckpt.CheckpointError as e:
            raise InputError(str(e)) from None
    if found is None:
        return None
    path, state = found
    breaking, harmless = ckpt.config_differences(state["config"], cfg.to_dict())
    if breaking:
        raise InputError(f"{path}: the config differs from the checkpoint's in ways that break the run: "
                         + "; ".join(breaking) + " (use another --results_dir, or --resume none --overwrite)")
    for line in harmless:
        log.info("config change since the checkpoint (allowed): %s", line)
    return path, state


def plan_batch(cfg: C.Config, device, dist) -> None:
    """--batch_size auto: the largest micro-batch that fits, accum derived so that batch_size × accum ×
    processes is effective_batch (the samples per optimizer step, over all processes)."""
    from .memory import MemoryPlanError, find_max_batch, plan_accumulation

    effective = cfg.train.effective_batch
    if effective % dist.world_size:
        raise InputError(f"effective_batch: {effective} is not divisible by {dist.world_size} processes")
    try:
        largest = find_max_batch(cfg, device, max_batch=cfg.train.max_batch)
    except MemoryPlanError as e:
        raise InputError(str(e)) from None
    largest = distributed.broadcast_object(largest)  # every rank uses rank 0's plan
    cfg.train.batch_size, cfg.train.gradient_accumulate_every = plan_accumulation(effective // dist.world_size, largest)
    log.info("batch_size auto: largest micro-batch %d -> batch_size %d x accum %d (effective %d)", largest,
             cfg.train.batch_size, cfg.train.gradient_accumulate_every, effective)


def build_trainer(cfg: C.Config, cases: list, device, results: Path | None, rank: int = 0, world_size: int = 1) -> Trainer:
    """Split the cases, cache the training set, and build the Trainer."""
    train_cases, val_cases = split_cases(cases, cfg.data.num_val_cases)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else (results or Path(".")) / "cache"
    dataset = build_dataset(train_cases, cfg, cache_dir)
    return Trainer(cfg, dataset, device, results, val_cases, rank, world_size)


def install_signal_handlers(trainer: Trainer) -> None:
    """SIGTERM/SIGINT: finish the step, save, exit 0. A second SIGINT stops at once."""

    def request_stop(signum, frame):
        if trainer.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


_held_locks: list[ckpt.FolderLock] = []  # the results folder's lock, held until run() returns


def write_config(cfg: C.Config, path: Path) -> None:
    """The resolved config, written atomically (temp file, replace); StorageError on an OS failure."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(cfg.to_yaml())
        tmp.replace(path)
    except OSError as e:
        raise ckpt.storage_error(path, e, "the resolved config") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def run(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    finally:
        while _held_locks:
            _held_locks.pop().release()


def _run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = resolve_config(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cases = discover(cfg)
    summaries = validate(cases, cfg)
    if args.check_data:
        print(format_summary(summaries))
        return 0

    try:
        dist = distributed.setup(cfg.train.device)  # torchrun's RANK/WORLD_SIZE; one process without them
    except ValueError as e:
        raise InputError(str(e)) from None
    if not dist.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # one rank narrates, every rank warns
    device = dist.device
    cfg.train.precision = resolve_precision(cfg.train.precision, device)
    if cfg.train.batch_size == "auto":
        plan_batch(cfg, device, dist)
    results = C.results_dir(cfg)
    # rank 0 alone decides what to resume (or why not) and prepares the folder; the others follow it
    decision: tuple[str | None, str | None, int] = (None, None, 2)  # (checkpoint path, error, exit code)
    found = None
    if dist.is_main:
        # one run per folder: rank 0 holds the lock until this process ends (the kernel drops it on death)
        try:
            lock = ckpt.lock_folder(results, "run")
            _held_locks.append(lock)
            ckpt.remove_stale_temps(results / "checkpoints")  # a killed writer's; nobody else writes here now
            found = select_checkpoint(cfg, results)
            decision = (str(found[0]) if found else None, None, 2)
        except (InputError, ckpt.FolderLockedError) as e:
            decision = (None, str(e), 2)
        except ckpt.StorageError as e:
            decision = (None, str(e), 1)
    resume_path, error, code = distributed.broadcast_object(decision)
    if error is not None:
        raise (InputError if code == 2 else ckpt.StorageError)(error)

    if dist.is_main:
        print(f"# diffusion3d resolved config ({results})\n{cfg.to_yaml()}", flush=True)
        if cfg.train.resume == "none" and cfg.train.overwrite:
            for sub in ("checkpoints", "tb", "samples"):
                shutil.rmtree(results / sub, ignore_errors=True)
        write_config(cfg, results / "config.yaml")
    distributed.barrier()  # nobody reads results_dir (cache, checkpoint) before rank 0 has prepared it

    trainer = build_trainer(cfg, cases, device, results, dist.rank, dist.world_size)
    if resume_path is not None:
        try:
            state = found[1] if found is not None else ckpt.load(Path(resume_path))
        except ckpt.CheckpointError as e:
            raise InputError(f"{e} (rank {dist.rank}: every node must see results_dir, e.g. on a shared "
                             "filesystem)") from None
        trainer.load_state_dict(state)
        log.info("resumed from %s at step %d (%d samples seen)", resume_path, trainer.step, trainer.stream.samples_seen)
    log.info("%d training cases, %d validation cases, device %s, precision %s, effective batch %d "
             "(batch_size × accum × %d processes)", len(trainer.dataset), len(trainer.val_cases), device,
             cfg.train.precision,
             cfg.train.batch_size * cfg.train.gradient_accumulate_every * dist.world_size, dist.world_size)
    install_signal_handlers(trainer)
    status = trainer.train()
    if not dist.is_main:
        return 0
    if status == "interrupted":
        print(f"stopped at step {trainer.step} on request; checkpoint saved in {results / 'checkpoints'}. "
              "Run the same command again to resume.", flush=True)
    else:
        print(f"done: {trainer.step} steps; results in {results}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    # under torchrun, anything unexpected on one rank ends the whole job with that rank's traceback
    with distributed.fail_fast():
        try:
            code = run(argv)
        except DataProblems as e:  # every bad file, one line each, then how many cases
            for line in e.errors:
                print(f"error: {line}", file=sys.stderr)
            print(f"error: {e.summary}; nothing was written", file=sys.stderr)
            code = 2
        except (InputError, DataError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        except (NonFiniteError, ckpt.StorageError) as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
        except OSError as e:  # a storage failure no library layer named: still one line, still a fault
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or e}", file=sys.stderr)
            code = 1
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            code = 130
    distributed.end_process(code)  # failures leave at once: a clean exit could wait on a stuck peer


if __name__ == "__main__":
    main()
