"""Monitoring: TensorBoard scalars and slice montages, process memory, the progress bar."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from .storage import storage_error


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes (getrusage: Linux reports kB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def peak_rss_gb() -> float:
    """This process's peak resident memory in GiB."""
    return peak_rss_bytes() / 2**30


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc/self/statm); 0 where unknown."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def mid_slices(volume: torch.Tensor) -> torch.Tensor:
    """[D, H, W] → the three orthogonal mid-slices, each resized to the largest side, as [3, S, S]."""
    d, h, w = volume.shape
    size = max(d, h, w)
    slices = [volume[d // 2], volume[:, h // 2], volume[:, :, w // 2]]
    resized = [
        torch.nn.functional.interpolate(s[None, None].float(), size=(size, size), mode="nearest")[0, 0] for s in slices
    ]
    return torch.stack([torch.rot90(s, 1) for s in resized])


def montage(columns: list[torch.Tensor]) -> torch.Tensor:
    """Volumes [D, H, W] in [0, 1] (mask, real, sample, ...) → one image [1, 3·S, n·S]: rows = planes."""
    stacked = torch.stack([mid_slices(v) for v in columns])  # [n, 3, S, S]
    return rearrange(stacked, "n plane h w -> 1 (plane h) (n w)").clamp(0, 1)


def _quiet_event_writer_failures() -> None:
    """TensorBoard's writer thread re-raises a failed write, and Python prints that as a thread traceback.
    The Monitor reports the same error as one line at its next call, so that traceback is silenced."""
    hook = threading.excepthook
    if getattr(hook, "_diffusion3d", False):
        return
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    def excepthook(args) -> None:
        if isinstance(args.thread, _AsyncWriterThread) and isinstance(args.exc_value, OSError):
            return
        hook(args)

    excepthook._diffusion3d = True  # type: ignore[attr-defined]
    threading.excepthook = excepthook


class Monitor:
    """TensorBoard writer (rank 0 only) plus the progress bar. ``purge_step`` drops stale events on resume.

    TensorBoard writes from a background thread and reports a failed write (ENOSPC, EIO) at the next call;
    every call here turns that OSError into a StorageError naming the event file. After one failure the
    writer is dropped: close() does not raise the same error again over the first.
    """

    def __init__(
        self, log_dir: Path | None, total_steps: int, start_step: int, quiet: bool, purge_step: int | None = None
    ):
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.writer = None
        if log_dir is not None:
            _quiet_event_writer_failures()
            try:
                self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)
            except OSError as e:
                files = sorted(Path(log_dir).glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime)
                raise storage_error(files[-1] if files else log_dir, e, "TensorBoard events") from None
        self.bar = tqdm(total=total_steps, initial=start_step, desc="training", disable=quiet, dynamic_ncols=True)

    def event_file(self) -> Path | None:
        try:
            return Path(self.writer.file_writer.event_writer._file_name)
        except AttributeError:
            return self.log_dir

    def _write(self, call, *args, **kwargs) -> None:
        if self.writer is None:
            return
        try:
            call(*args, **kwargs)
        except OSError as e:
            where = self.event_file()
            self._drop_writer()
            raise storage_error(where, e, "TensorBoard events") from None

    def _drop_writer(self) -> None:
        writer, self.writer = self.writer, None
        with contextlib.suppress(Exception):
            writer.close()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self._write(self.writer.add_scalar, tag, value, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self._write(self.writer.add_text, tag, text, step)

    def hparams(self, hparams: dict[str, Any]) -> None:
        if self.writer is not None:
            clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
            self._write(self.writer.add_hparams, clean, {}, run_name=".")

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        if self.writer is not None:
            self._write(self.writer.add_image, tag, image, step, dataformats="CHW")

    def progress(self, step: int, postfix: dict[str, str]) -> None:
        self.bar.n = step
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def flush(self) -> None:
        if self.writer is not None:
            self._write(self.writer.flush)

    def close(self) -> None:
        """Flush and close; an OS failure raises StorageError unless an exception is already on its way
        (``close`` runs in the trainer's ``finally``: the first error is the one to report)."""
        self.bar.close()
        if self.writer is None:
            return
        if sys.exc_info()[0] is not None:
            self._drop_writer()
            return
        self._write(self.writer.close)
        self.writer = None
