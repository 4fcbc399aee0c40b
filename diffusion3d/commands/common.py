"""What every command shares: one-line errors and exit codes (train, sample, evaluate, bench, quality).

The commands' side of the one-way imports: library modules raise exceptions that name the file and the
reason and never import this; a command runs its body through ``run_command``, which prints what escapes
as one line ``error: ...`` on stderr and picks the exit code:

- 2, bad input: InputError (a command's own checks), bad data (every bad file on its own line, then the
  count), a config, a checkpoint, or a folder another process holds; a bad flag exits 2 from the parser;
- 1, a fault: storage (``storage.StorageError``: no space, I/O error, read-only), any other OSError,
  and what a command adds (training: non-finite losses);
- 130, Ctrl-C.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..data import DataError, DataProblems
from ..storage import FolderError, StorageError, atomic_write_text

ExceptionTypes = tuple[type[BaseException], ...]


class InputError(Exception):
    """Bad input found by a command line (a flag, a folder, a combination); one line, exit code 2."""


BAD_INPUT: ExceptionTypes = (InputError, DataError, ConfigError, CheckpointError, FolderError)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line ``error: ...`` with exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


# ---- flags every command parses alike ---------------------------------------------------------------------
def comma_list(text: str) -> list[str]:
    """``"a, b,,c"`` → ``["a", "b", "c"]``."""
    return [v.strip() for v in text.split(",") if v.strip()]


def int_list(text: str, flag: str, *, distinct: bool = False, at_least: int | None = None) -> list[int]:
    """Comma-separated integers for ``flag``; InputError (one line, exit 2) for anything else, an empty
    list, repeated values (``distinct``) or a value below ``at_least``."""
    try:
        values = [int(v) for v in comma_list(text)]
    except ValueError:
        raise InputError(f"{flag}: expected integers separated by commas, got {text!r}") from None
    if not values or (distinct and len(set(values)) != len(values)):
        raise InputError(f"{flag}: expected {'distinct ' if distinct else ''}integers, got {text!r}")
    if at_least is not None and min(values) < at_least:
        raise InputError(f"{flag}: expected integers of at least {at_least}, got {text!r}")
    return values


def device_flag(request: str, flag: str = "--device"):
    """``--device auto|cpu|cuda|cuda:N`` as a torch.device; InputError for one this machine lacks."""
    from ..distributed import resolve_device

    try:
        return resolve_device(request)
    except (ValueError, RuntimeError) as e:
        raise InputError(f"{flag}: {e}") from None


def configure_logging(level: int = logging.INFO) -> None:
    """The commands' log format on stderr (stdout stays for results)."""
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def say(message: object) -> None:
    print(f"error: {message}", file=sys.stderr)


def run_command(body: Callable[[], int | None], bad_input: ExceptionTypes = (), faults: ExceptionTypes = ()) -> int:
    """Run a command's body and return its exit code (None counts as 0); map what escapes it to one line
    on stderr and a code. ``bad_input`` / ``faults``: more exception types that mean exit 2 / exit 1.
    SystemExit (the parser's exit 2, ``--help``) passes through; anything else unexpected raises, with
    its traceback, because it is a bug."""
    try:
        code = body()
    except DataProblems as e:  # every bad file, one line each, then how many cases
        for line in e.errors:
            say(line)
        say(f"{e.summary}; nothing was written")
        return 2
    except (*BAD_INPUT, *bad_input) as e:
        say(e)
        return 2
    except (StorageError, *faults) as e:
        say(e)
        return 1
    except OSError as e:  # a storage failure no library layer named: still one line, still a fault
        say(f"{e.filename}: {e.strerror or e}" if e.filename else e.strerror or e)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0 if code is None else code


# ---- what commands write beside their tables -----------------------------------------------------------
def json_safe(value: Any) -> Any:
    """Strict JSON: inf / NaN become null (e.g. the PSNR of an identical volume), keys become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, value: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(json_safe(value), indent=indent, allow_nan=False) + "\n", "JSON results")


def write_csv(path: Path, rows: Sequence[dict[str, Any]], header: Sequence[str] | None = None) -> None:
    """Rows as CSV with ``header`` (default: the first row's keys); None and missing values are blank."""
    header = list(header if header is not None else rows[0])
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=header)
    writer.writeheader()
    writer.writerows([{k: "" if r.get(k) is None else r.get(k) for k in header} for r in rows])
    atomic_write_text(path, text.getvalue(), "CSV results")
