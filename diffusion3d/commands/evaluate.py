"""Evaluation: samples against the real images of their masks, and the samples of one mask against each other.

Pairing: ``<samples>/<case>_sample<i>.nii.gz`` is compared with ``<images>/<case>.nii.gz`` and, for the
per-label statistics, ``<masks>/<case>.nii.gz`` (``.nii`` works too). The sample must have the real image's
shape (the sampling command writes on the mask's grid, which is the image's).

Intensity: every metric is computed on volumes mapped to [0, 1] (and clipped), so the data range of SSIM and
PSNR is 1.0 and MAE is in units of that range:

- the real image by ``--real_range LO HI`` if given, else by its own ``--real_percentiles`` (default 0 100:
  min to max; pass 0 99.5 to match training with ``intensity: percentile``);
- a sample by ``--sample_range LO HI`` (default 0 1: what the sampling command writes with the default
  ``output_intensity: unit``; use the run's ``intensity_range`` for ``source``, -1 1 for ``model``).

Metrics (MONAI's where they exist):

- per sample: SSIM (Gaussian window 11, or the largest odd size that fits the smallest side), PSNR
  (``inf`` for an identical volume; ``null`` in the JSON), MAE;
- per mask with ≥ 2 samples: diversity as the mean MS-SSIM over all pairs of its samples (lower = more
  diverse). Window 7 and as many of MONAI's five scale weights (renormalised) as the smallest side allows:
  32³ → 3 scales, 128³ → 5. Under 14 voxels on a side MS-SSIM is not defined here and is left empty, with
  a note;
- with ``--second_images DIR`` (a second real image of each mask, ``<case>.nii.gz``, e.g. a test-retest scan,
  scaled like the first): ``model_div`` (1 − mean pairwise SSIM of the samples), ``data_div`` (1 − SSIM
  between the two real images), ``div_ratio`` = model_div / data_div over the masks that have both (1: as
  varied as the data; below 1: regression toward the mean), ``ssim_twin`` and ``sharpness_twin`` (the second
  image against the first: the reference for the samples' SSIM and sharpness). Without it the summary's
  ``diversity_note`` says the samples' diversity has no reference;
- per mask label (``--labels``, default: every label in the mask, background 0 included): mean and standard
  deviation of intensity inside the label, in the real image and in the sample.
- with masks, mask fidelity and sharpness (``diffusion3d.evaluation.metrics``, the same as the quality benchmark's):
  ``head_dice`` (Otsu threshold of the sample vs. all labels), ``lesion_dice`` (the extreme class of a
  three-class Otsu inside the head vs. the last label), ``truth_*_dice`` (the same on the real image: the
  ceiling), ``contrast_ratio`` (lesion / rest-of-head contrast, sample over real), ``abs_mean_error_max``
  (the largest per-label mean intensity error) and ``sharpness_ratio`` (mean gradient magnitude in the head,
  sample over real: blur < 1, noise > 1). Unlike correlation, none of these hides an offset or a scale.

Written to ``--out``: ``metrics.csv`` (one row per sample), ``cases.csv`` (one row per mask),
``metrics.json`` (settings, summary, everything per case), ``report.html`` (mid-slice montages, the tables,
per-label intensity histograms; ``report.Report``) and TensorBoard summaries in ``--out/tb`` at ``--step``.
Bad input → one line ``error: <file>: <problem>``, exit code 2, nothing written.

``python -m diffusion3d evaluate downstream ...`` (segmentation Dice of networks trained on real, synthetic and
both) and ``... distribution ...`` (FID / MMD on MedicalNet features) are subcommands: ``evaluate_cli``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from .. import storage
from ..evaluation.report import Report
from ..evaluation.scores import evaluate, flat_rows, pair
from . import evaluate_tools as evaluate_cli
from .common import InputError, OneLineParser, configure_logging, int_list, run_command, write_csv, write_json
from .evaluate_tools import SUBCOMMANDS, add_intensity_flags, scaling_from

log = logging.getLogger("diffusion3d.evaluate")  # not __name__: "__main__" under python -m
OUTPUTS = ("metrics.csv", "cases.csv", "metrics.json", "report.html")


def parse_labels(text: str | None) -> list[int] | None:
    return None if text is None else int_list(text, "--labels", distinct=True)


def write_outputs(result: dict[str, Any], out: Path, step: int, report: Report | None = None) -> list[Path]:
    from torch.utils.tensorboard import SummaryWriter

    out.mkdir(parents=True, exist_ok=True)
    header, flat = flat_rows(result["samples"])
    write_csv(out / "metrics.csv", flat, header)
    case_header = [
        "case",
        "n_samples",
        "ms_ssim",
        "ms_ssim_pairs",
        "ms_ssim_note",
        "model_div",
        "data_div",
        "div_ratio",
        "ssim_twin",
        "sharpness_twin",
        "image",
        "mask",
        "second_image",
    ]
    write_csv(out / "cases.csv", result["cases"], case_header)
    write_json(out / "metrics.json", result)
    if report is not None:
        (out / "report.html").write_text(report.evaluation_page(result, header, flat), encoding="utf-8")
    with SummaryWriter(str(out / "tb")) as writer:
        for key, value in result["summary"].items():
            if isinstance(value, float) and math.isfinite(value):
                writer.add_scalar(f"eval/{key}", value, step)
        table = "| " + " | ".join(header[:6]) + " |\n|" + "---|" * 6 + "\n"
        table += "\n".join("| " + " | ".join(str(r[k]) for k in header[:6]) + " |" for r in flat)
        writer.add_text("eval/samples", table, step)
    return [out / name for name in OUTPUTS if (out / name).exists()]


# ---- the command line -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m diffusion3d evaluate",
        description="SSIM / PSNR / MAE of each <case>_sample<i>.nii.gz against <images>/<case>.nii.gz, MS-SSIM "
        "among the samples of one mask, and per-label intensity statistics; written as CSV, JSON, report.html and "
        "TensorBoard. Subcommands (see their --help): 'downstream' (segmentation Dice of networks trained on real, "
        "synthetic and both), 'distribution' (FID and MMD on MedicalNet features).",
    )
    p.add_argument("--samples", required=True, type=Path, help="folder of <case>_sample<i>.nii.gz")
    p.add_argument("--images", required=True, type=Path, help="folder of real images <case>.nii.gz")
    p.add_argument("--masks", type=Path, default=None, help="folder of masks <case>.nii.gz (per-label statistics)")
    p.add_argument("--out", required=True, type=Path, help="output folder: metrics.csv, cases.csv, metrics.json, tb/")
    p.add_argument(
        "--second_images",
        type=Path,
        default=None,
        metavar="DIR",
        help="a second real image of each mask, <case>.nii.gz (test-retest scans): the samples' diversity "
        "is then reported against the data's own (model_div, data_div, div_ratio)",
    )
    p.add_argument("--labels", default=None, help="e.g. 0,1,2 (default: every label in each mask)")
    add_intensity_flags(p)
    p.add_argument("--step", type=int, default=0, help="TensorBoard step of these results (e.g. the checkpoint's)")
    p.add_argument(
        "--report_cases",
        type=int,
        default=6,
        metavar="N",
        help="report.html shows the mid-slices of the first N cases (0: no report; default 6)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing metrics files in --out")
    return p


def run(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    scaling = scaling_from(args)
    labels = parse_labels(args.labels)
    if args.report_cases < 0:
        raise InputError(f"--report_cases: expected a number >= 0, got {args.report_cases}")
    storage.check_target(args.out, OUTPUTS, args.overwrite)  # before the work; writes nothing
    cases = pair(args.samples, args.images, args.masks, args.second_images)
    report = Report(max_cases=args.report_cases) if args.report_cases else None
    result = evaluate(cases, labels, scaling.real_range, scaling.real_percentiles, scaling.sample_range, report)
    result["settings"]["step"] = args.step
    # one writer per output folder, taken again once the inputs are known good (bad input writes nothing)
    with storage.claim_folder(args.out, "evaluation", OUTPUTS, args.overwrite):
        write_outputs(result, args.out, args.step, report)
    return result


def evaluate_and_report(argv: list[str] | None = None) -> int:
    s = run(argv)["summary"]

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.4f}"

    identical = f" (+{s['psnr_infinite']} identical)" if s["psnr_infinite"] else ""
    print(
        f"{s['n_samples']} samples of {s['n_cases']} masks: SSIM {fmt(s['ssim'])}, PSNR {fmt(s['psnr'])} dB"
        f"{identical}, MAE {fmt(s['mae'])}, "
        f"MS-SSIM among samples {fmt(s['ms_ssim'])}"
    )
    if s["div_ratio"] is not None:
        print(
            f"diversity: samples {fmt(s['model_div'])} (1 - SSIM between samples of a mask), data "
            f"{fmt(s['data_div'])} (1 - SSIM between its two real images), ratio {fmt(s['div_ratio'])} "
            f"over {s['div_ratio_cases']} masks"
        )
    else:
        print(f"diversity: {s['diversity_note']}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``diffusion3d-evaluate``): exit 0; 2 with one line for bad input; 1 for a storage fault.
    ``downstream ...`` and ``distribution ...`` run those subcommands (``evaluate_cli``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        evaluate_cli.main(argv[0], argv[1:])
    configure_logging()
    sys.exit(run_command(lambda: evaluate_and_report(argv)))


if __name__ == "__main__":
    main()
