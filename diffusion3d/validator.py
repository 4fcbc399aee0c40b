"""Validation for the trainer: held-out cases loaded once, sampled at every ``sample_every``.

At construction each case's mask is brought to the model grid (``data.MaskGrid``, the file read once) and
its real image decoded through the training transforms, once for the whole run. At each validation the
EMA model samples volume 0 of every case with the run's seed, sampler and precision, through the same
``sampling.generate`` as the sample command, so that command reproduces these files from the checkpoint
of the same step. Each sample is written as NIfTI on its mask's grid, and a montage (mask, real image,
sample: three mid-planes each) goes to the Monitor.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from . import sampling
from .config import Config
from .data import Case, MaskGrid, data_items, training_transforms
from .monitor import Monitor, montage

log = logging.getLogger(__name__)


class Validator:
    def __init__(self, cfg: Config, cases: Sequence[Case], device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.cases = list(cases)
        self.device = torch.device(device)
        conditional = cfg.model.with_condition
        # an unconditional model takes only a grid to write on: the case's first image gives it
        self.grids = [MaskGrid(c.mask if conditional else c.images[0], cfg) for c in self.cases]
        self.seeds = [sampling.volume_seed(cfg.train.seed, c.name, 0) for c in self.cases]
        real = training_transforms(cfg)
        self.references = [self._reference(real(item)) for item in data_items(self.cases, conditional)]

    def _reference(self, item: dict) -> list[torch.Tensor]:
        """The montage's fixed columns on the model grid, in [0, 1]: the mask (conditional) and the real image."""
        columns = []
        if self.cfg.model.with_condition:
            columns.append(item["mask"][0].float() / max(self.cfg.data.labels))
        columns.append((item["image"][0] + 1) / 2)
        return columns

    @torch.no_grad()
    def run(self, model: torch.nn.Module, out_dir: Path, step: int, monitor: Monitor | None = None) -> list[Path]:
        """Sample every case in one batch, write ``<case>_sample0.nii.gz`` in ``out_dir``, log the montages."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        volumes = sampling.generate(
            model, self.cfg, self.grids, self.seeds, batch_size=len(self.cases), device=self.device
        )
        for sampled in volumes:
            case, grid = self.cases[sampled.index], self.grids[sampled.index]
            written.append(sampling.write_volume(sampled, grid, self.cfg, out_dir / f"{case.name}_sample0.nii.gz"))
            if monitor is not None:
                panel = montage([*self.references[sampled.index], (sampled.model_grid[0] + 1) / 2])
                monitor.image(f"samples/{case.name}", panel, step)
        if monitor is not None:
            monitor.flush()
        log.debug("validation at step %d: %d samples in %s", step, len(written), out_dir)
        return written
