"""Must the loss be divided by the accumulation steps with AMP? Measured with the project's own Trainer.

On tiny seeded phantoms (16³, a small UNet; the default config's flow recipe otherwise) it measures:

- **gradients**: ``accum`` micro-batches of ``batch_size`` (the Trainer, which backpropagates
  ``loss.sum() / batch_size / accum``) against one batch of ``batch_size × accum`` (the same samples, times
  and noise: the stream depends on (seed, k) only), in every precision the device runs (CPU: fp32, bf16
  autocast, fp16 autocast with ``GradScaler("cpu")``; CUDA: fp32, fp16 with the GradScaler, bf16): the
  largest element-wise difference relative to the largest gradient. And without the division (each
  micro-batch backpropagates its own mean, ``loss.sum() / batch_size``): the gradient norm over the divided one;
- **updates**: one optimizer step from the same weights with divided and undivided gradients, clipping off
  (``max_grad_norm`` 1e9): the relative update difference ‖Δθ_undiv − Δθ_div‖ / ‖Δθ_div‖ and the norm ratio
  ‖Δθ_undiv‖ / ‖Δθ_div‖, for AdamW (the Trainer's) and SGD; for AdamW also after ``--steps`` steps;
- **clipping**: the fraction of ``--steps`` steps whose gradient norm exceeds ``max_grad_norm``;
- **loss curves**: the true mean loss per step over ``--steps`` steps, divided against undivided, for AdamW
  with each clipping norm of ``--clips`` and for SGD (``--sgd_lr``) without clipping.

Command line: ``python -m diffusion3d bench --parts accumulation [--accum 4 --batch_size 2 --steps 50]``
(the answers with measured numbers: docs/accumulation.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import config as C
from .. import configs
from ..data import SampleStream, build_dataset, discover
from ..trainer import NonFiniteError, Trainer
from .common import OneLineParser, configure_logging, run_command, write_json
from .quality import bench_config, write_phantom_set

PART = "accumulation"
TINY_MODEL = (
    "channels=[8,16]",
    "attention_levels=[false,true]",
    "num_head_channels=8",
    "norm_num_groups=4",
    "warmup_steps=0",
    "ema_decay=0.9",
)


class UndividedTrainer(Trainer):
    """The common mistake: every micro-batch backpropagates its own mean loss, ``loss.sum() / batch_size``,
    not divided by ``accum``. Everything else (clip, scaler, optimizer, EMA) is the Trainer's."""

    def accumulate(self) -> tuple[torch.Tensor, float]:
        t = self.cfg.train
        losses = []
        for _ in range(t.gradient_accumulate_every):
            x0, cond, ids = self._next_batch()
            loss = self.diffusion.loss(self.forward, x0, cond, ids, self.autocast)
            self.scaler.scale(loss.sum() / t.batch_size).backward()
            losses.append(loss.detach())
        self.stream.samples_seen += t.batch_size * t.gradient_accumulate_every
        return torch.cat(losses), 0.0


class Bench:
    """Trainers on one tiny phantom set; every trainer of one Bench starts from the same weights (seed 0)."""

    def __init__(self, root: Path, size: int = 16, n: int = 8, device: str = "cpu", config: str | None = None) -> None:
        write_phantom_set(root, n, seed=0, split=1, size=size)
        self.root, self.size, self.device = root, size, torch.device(device)
        self.base = C.load(configs.find(config))

    def trainer(
        self,
        batch_size: int,
        accum: int,
        precision: str = "fp32",
        divided: bool = True,
        optimizer: str = "adamw",
        lr: float = 1e-3,
        max_grad_norm: float = 1e9,
        steps: int = 50,
    ) -> Trainer:
        overrides = [
            *TINY_MODEL,
            f"image_size=[{self.size},{self.size},{self.size}]",
            f"batch_size={batch_size}",
            f"gradient_accumulate_every={accum}",
            f"precision={precision}",
            f"lr={lr}",
            f"max_grad_norm={max_grad_norm}",
            f"train_num_steps={steps}",
            "lr_schedule=constant",
        ]
        cfg = bench_config(self.base, self.root, overrides)
        dataset = build_dataset(discover(cfg), cfg, None)
        trainer = (Trainer if divided else UndividedTrainer)(cfg, dataset, self.device)
        if optimizer == "sgd":
            trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=lr)
        return trainer


def gradient(trainer: Trainer) -> torch.Tensor:
    """The accumulated, unscaled gradient of one optimizer step, flattened (the weights are not stepped)."""
    trainer.accumulate()
    trainer.scaler.unscale_(trainer.optimizer)  # a no-op without the GradScaler
    return torch.cat([p.grad.detach().float().flatten() for p in trainer.model.parameters()])


def weights(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().clone() for p in trainer.model.parameters()])


def precisions(device: torch.device) -> list[str]:
    """fp32, bf16 and fp16 (with the GradScaler) where autocast and the scaler run on ``device``."""
    out = ["fp32", "bf16"]
    try:
        with torch.autocast(device.type, dtype=torch.float16):
            torch.nn.functional.conv3d(
                torch.ones(1, 1, 3, 3, 3, device=device), torch.ones(1, 1, 3, 3, 3, device=device)
            )
        torch.amp.GradScaler(device.type)
        out.append("fp16")
    except (RuntimeError, TypeError, ValueError):  # an old torch: no fp16 autocast or no GradScaler on this device
        pass
    return out


def scaled_gradients(bench: Bench, batch_size: int, accum: int, precision: str) -> tuple[torch.Tensor, ...]:
    """(one big batch, accumulated, undivided) gradients from fresh trainers. With the GradScaler the first loss
    scale (2^16) overflows fp16 at once, as in training, where the scaler skips and halves; here the trainers
    are made again with a 16× smaller initial scale until all three gradients are finite (the same scale
    for the three, so it is the division alone that differs)."""
    for scale in (2.0**16, 2.0**12, 2.0**8, 2.0**4, 1.0):
        trainers = [
            bench.trainer(batch_size * accum, 1, precision),
            bench.trainer(batch_size, accum, precision),
            bench.trainer(batch_size, accum, precision, divided=False),
        ]
        for t in trainers:
            if t.scaler.is_enabled():
                t.scaler = torch.amp.GradScaler(bench.device.type, init_scale=scale)
        grads = tuple(gradient(t) for t in trainers)
        if not trainers[0].scaler.is_enabled() or all(torch.isfinite(g).all() for g in grads):
            break
    return (*grads, trainers[1].scaler)


def gradient_rows(bench: Bench, batch_size: int, accum: int) -> list[dict[str, Any]]:
    """Per precision: accumulated vs one large batch (max relative difference), and undivided / divided norm."""
    rows = []
    for precision in precisions(bench.device):
        big, acc, und, grad_scaler = scaled_gradients(bench, batch_size, accum, precision)
        scaler = grad_scaler.is_enabled()
        rows.append(
            {
                "precision": precision,
                "grad_scaler": scaler,
                "loss_scale": float(grad_scaler.get_scale()) if scaler else None,
                "finite": bool(torch.isfinite(acc).all() and torch.isfinite(big).all()),
                "max_rel_diff": float((acc - big).abs().max() / big.abs().max()),
                "undivided_norm_ratio": float(und.norm() / acc.norm()),
                "undivided_max_rel_diff_from_accum_x": float(
                    (und - accum * acc).abs().max() / (accum * acc).abs().max()
                ),
            }
        )
    return rows


def update_rows(bench: Bench, batch_size: int, accum: int, steps: int, sgd_lr: float) -> list[dict[str, Any]]:
    """Divided vs undivided from the same weights, clipping off: after 1 step (AdamW, SGD) and ``steps`` (AdamW)."""
    rows = []
    for optimizer, lr, n in (("adamw", 1e-3, 1), ("adamw", 1e-3, steps), ("sgd", sgd_lr, 1)):
        deltas = []
        for divided in (True, False):
            trainer = bench.trainer(batch_size, accum, optimizer=optimizer, lr=lr, divided=divided, steps=n)
            start = weights(trainer)
            for _ in range(n):
                trainer.train_step()
            deltas.append(weights(trainer) - start)
        div, und = deltas
        rows.append(
            {
                "optimizer": optimizer,
                "lr": lr,
                "steps": n,
                "rel_update_diff": float((und - div).norm() / div.norm()),
                "update_norm_ratio": float(und.norm() / div.norm()),
            }
        )
    return rows


def curve_rows(
    bench: Bench, batch_size: int, accum: int, steps: int, sgd_lr: float, clips: Sequence[float]
) -> list[dict[str, Any]]:
    """Loss per step and the clipped fraction, divided vs undivided: AdamW with each clipping norm in ``clips``,
    and SGD without clipping (clipping would hide its larger step: both gradients cut to the same norm)."""
    rows = []
    for optimizer, lr, max_grad_norm in [*(("adamw", 1e-3, c) for c in clips), ("sgd", sgd_lr, 1e9)]:
        for divided in (True, False):
            trainer = bench.trainer(
                batch_size, accum, optimizer=optimizer, lr=lr, divided=divided, max_grad_norm=max_grad_norm, steps=steps
            )
            results, stopped = [], None
            for step in range(steps):
                try:
                    results.append(trainer.train_step())
                except NonFiniteError:  # diverged: the Trainer stops after too many non-finite steps in a row
                    stopped = step + 1
                    break
            losses = [r.loss for r in results]
            rows.append(
                {
                    "optimizer": optimizer,
                    "lr": lr,
                    "divided": divided,
                    "max_grad_norm": max_grad_norm,
                    "clipped_fraction": float(np.mean([r.grad_norm > max_grad_norm for r in results])),
                    "median_grad_norm": float(np.median([r.grad_norm for r in results])),
                    "loss_first10": float(np.mean(losses[:10])),
                    "loss_last10": float(np.mean(losses[-10:])),
                    "losses": losses,
                    "stopped_nonfinite_at": stopped,
                }
            )
    return rows


def measure(
    batch_size: int = 2,
    accum: int = 4,
    steps: int = 50,
    sgd_lr: float = 0.05,
    clips: Sequence[float] = (1.0, 5.0),
    size: int = 16,
    device: str = "cpu",
    config: str | None = None,
    curves: bool = True,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Everything above on a fresh tiny phantom set in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="d3d_accum_") as tmp:
        bench = Bench(Path(tmp), size=size, device=device, config=config)
        report: dict[str, Any] = {
            "batch_size": batch_size,
            "accum": accum,
            "steps": steps,
            "size": size,
            "device": str(bench.device),
            "torch": str(torch.__version__),
        }
        progress("gradients")
        report["gradients"] = gradient_rows(bench, batch_size, accum)
        progress("updates")
        report["updates"] = update_rows(bench, batch_size, accum, steps, sgd_lr)
        report["coverage"] = [epoch_coverage(24, b, a, w) for b, a, w in COVERAGE_SPLITS]
        if curves:
            progress("loss curves")
            report["curves"] = curve_rows(bench, batch_size, accum, steps, sgd_lr, clips)
    return report


def epoch_coverage(
    num_cases: int, batch_size: int, accum: int, world_size: int = 1, steps: int = 100, seed: int = 0
) -> dict[str, Any]:
    """Which cases the optimizer steps of one split read, from the SampleStream as the trainer advances it
    (``samples_seen`` += batch_size × accum × world_size per step): per complete epoch (sample ids
    [e·n, (e+1)·n)), the fewest and most times a case was used, and how many steps straddle an epoch's end."""
    stream = SampleStream(num_cases, seed)
    ids: list[int] = []
    for _ in range(steps):
        for micro in range(accum):
            for rank in range(world_size):
                ids += stream.micro_batch_ids(micro, batch_size, rank, world_size)
        stream.samples_seen += batch_size * accum * world_size
    assert sorted(ids) == list(range(len(ids)))  # no sample id is skipped or read twice, whatever the split
    epochs = len(ids) // num_cases
    counts = np.zeros((epochs, num_cases), int)
    for k in ids[: epochs * num_cases]:
        counts[k // num_cases, stream.index(k)] += 1
    per_step = batch_size * accum * world_size
    straddling = sum(1 for s in range(steps) if (s * per_step) // num_cases != ((s + 1) * per_step - 1) // num_cases)
    return {
        "num_cases": num_cases,
        "batch_size": batch_size,
        "accum": accum,
        "world_size": world_size,
        "steps": steps,
        "samples": len(ids),
        "complete_epochs": epochs,
        "min_uses": int(counts.min()),
        "max_uses": int(counts.max()),
        "steps_across_an_epoch_end": straddling,
    }


COVERAGE_SPLITS = ((1, 1, 1), (1, 8, 1), (2, 4, 1), (5, 1, 1), (3, 7, 1), (1, 5, 2), (7, 3, 4))


# ---- output ----------------------------------------------------------------------------------------
def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def format_report(r: dict[str, Any]) -> str:
    a, b = r["accum"], r["batch_size"]
    parts = [
        f"batch {b} × accum {a} vs one batch of {a * b}; {r['size']}³, {r['device']}, torch {r['torch']}",
        "",
        _table(
            [
                "precision",
                "GradScaler",
                "max rel diff accum vs big batch",
                "undivided / divided grad norm",
                f"undivided vs {a}× divided (max rel diff)",
            ],
            [
                [
                    g["precision"],
                    "yes" if g["grad_scaler"] else "no",
                    f"{g['max_rel_diff']:.2e}",
                    f"{g['undivided_norm_ratio']:.4f}",
                    f"{g['undivided_max_rel_diff_from_accum_x']:.2e}",
                ]
                for g in r["gradients"]
            ],
        ),
        "",
        _table(
            ["optimizer", "lr", "steps", "rel update diff (undiv vs div)", "update norm ratio"],
            [
                [
                    u["optimizer"],
                    f"{u['lr']:g}",
                    u["steps"],
                    f"{u['rel_update_diff']:.2e}",
                    f"{u['update_norm_ratio']:.4f}",
                ]
                for u in r["updates"]
            ],
        ),
    ]
    if r.get("coverage"):
        parts += [
            "",
            _table(
                [
                    "cases",
                    "batch",
                    "accum",
                    "ranks",
                    "steps",
                    "samples",
                    "complete epochs",
                    "min uses per case per epoch",
                    "max",
                    "steps across an epoch end",
                ],
                [
                    [
                        c["num_cases"],
                        c["batch_size"],
                        c["accum"],
                        c["world_size"],
                        c["steps"],
                        c["samples"],
                        c["complete_epochs"],
                        c["min_uses"],
                        c["max_uses"],
                        c["steps_across_an_epoch_end"],
                    ]
                    for c in r["coverage"]
                ],
            ),
        ]
    if r.get("curves"):
        parts += [
            "",
            _table(
                [
                    "optimizer",
                    "lr",
                    "loss",
                    "max_grad_norm",
                    "clipped fraction",
                    "median grad norm",
                    "loss steps 1-10",
                    f"loss steps {r['steps'] - 9}-{r['steps']}",
                ],
                [
                    [
                        c["optimizer"],
                        f"{c['lr']:g}",
                        "divided" if c["divided"] else "undivided",
                        "off" if c["max_grad_norm"] >= 1e9 else f"{c['max_grad_norm']:g}",
                        f"{c['clipped_fraction']:.2f}",
                        f"{c['median_grad_norm']:.3f}",
                        f"{c['loss_first10']:.4f}",
                        f"{c['loss_last10']:.4f}"
                        + (f" (diverged at step {c['stopped_nonfinite_at']})" if c["stopped_nonfinite_at"] else ""),
                    ]
                    for c in r["curves"]
                ],
            ),
        ]
    return "\n".join(parts)


# ---- the command line -------------------------------------------------------------------------------
def split_argv(argv: Sequence[str]) -> list[str] | None:
    """``--parts accumulation`` (or ``--parts=accumulation``): the rest of the command line; otherwise None."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--parts" and i + 1 < len(argv) and argv[i + 1] == PART:
            return argv[:i] + argv[i + 2 :]
        if arg == f"--parts={PART}":
            return argv[:i] + argv[i + 1 :]
    return None


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=prog,
        description="Must the loss be divided by the accumulation steps with AMP? "
        "Gradients, updates, clipping and loss curves, divided and undivided, with the Trainer.",
    )
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=50, help="steps of the loss curves and of the AdamW update")
    p.add_argument("--sgd_lr", type=float, default=0.05)
    p.add_argument("--clips", default="1,5", help="max_grad_norm of the AdamW loss curves (1: the default config's)")
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--config", default=None, help="the recipe (default: default); the model is made tiny")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m diffusion3d bench --parts accumulation") -> int:
    configure_logging(logging.WARNING)
    args = build_parser(prog).parse_args(argv)

    def work() -> int:
        if args.threads:
            torch.set_num_threads(args.threads)
        clips = [float(c) for c in args.clips.split(",") if c.strip()]
        report = measure(
            args.batch_size,
            args.accum,
            args.steps,
            args.sgd_lr,
            clips,
            args.size,
            args.device,
            args.config,
            progress=lambda s: print(f"... {s}", file=sys.stderr, flush=True),
        )
        print(format_report(report))
        if args.json:
            write_json(args.json, report, indent=1)
        return 0

    return run_command(work)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m diffusion3d.commands.accumulation"))
