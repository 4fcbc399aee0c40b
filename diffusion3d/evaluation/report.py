"""An evaluation as a page people read: per-case mid-slice montages, the metric tables, per-label intensity
histograms of real vs. synthetic volumes.

The page is one self-contained HTML file: montages are PNG data URIs (written by the stdlib PNG encoder
below: no imaging dependency), histograms inline SVG, styles inline; no script, no network. The collector
keeps one montage per case (at most ``max_cases``) and fixed-bin histogram counts, never the volumes, so a
large evaluation does not hold its data in memory for the report.
"""

from __future__ import annotations

import base64
import html
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..monitor import montage

PALETTE = np.array(
    [
        (0, 0, 0),
        (31, 119, 180),
        (255, 127, 14),
        (44, 160, 44),
        (214, 39, 40),
        (148, 103, 189),
        (140, 86, 75),
        (227, 119, 194),
        (127, 127, 127),
        (188, 189, 34),
        (23, 190, 207),
    ],
    np.uint8,
)
REAL_COLOUR, SYNTHETIC_COLOUR = "#00897b", "#c2185b"  # teal, magenta: unlike any label colour
Table = tuple[str, Sequence[str], Sequence[dict[str, Any]]]  # heading, columns, rows
TILE_PX = 96  # on-screen size of a slice: the PNG keeps the voxels, the browser enlarges it by a whole factor


# ---- PNG ------------------------------------------------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(image: np.ndarray) -> bytes:
    """uint8 [H, W] (grey) or [H, W, 3] (RGB) → PNG bytes (8 bits per channel, filter 0 on every row)."""
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise ValueError(f"expected uint8 [H, W] or [H, W, 3], got {image.dtype} {image.shape}")
    height, width = image.shape[:2]
    colour_type = 0 if image.ndim == 2 else 2
    rows = np.ascontiguousarray(image).reshape(height, -1)
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rows], axis=1).tobytes()
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    )


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ---- what is collected per case -------------------------------------------------------------------------
@dataclass
class CaseFigure:
    case: str
    png: bytes
    columns: list[str]
    tile: int  # pixels per slice side in the PNG


@dataclass
class LabelHistogram:
    real: np.ndarray
    synthetic: np.ndarray
    real_sum: float = 0.0
    synthetic_sum: float = 0.0


def case_montage(
    real: np.ndarray, samples: Sequence[np.ndarray], mask: np.ndarray | None, labels: Sequence[int]
) -> np.ndarray:
    """RGB uint8 [3·S, n·S, 3]: rows are the three mid-planes, columns mask (coloured) | real | samples."""
    columns = [torch.from_numpy(np.asarray(v, np.float32)) for v in (real, *samples)]
    grey = montage(columns)[0].numpy()  # [3S, nS] in [0, 1]
    rgb = np.repeat(np.round(grey * 255).astype(np.uint8)[..., None], 3, axis=2)
    if mask is None:
        return rgb
    # Label index / 255 survives montage's nearest resize and [0, 1] clamp exactly; the palette maps it back.
    index = np.searchsorted(np.asarray(sorted(labels)), mask).astype(np.float32) / 255.0
    tiles = np.round(montage([torch.from_numpy(index)])[0].numpy() * 255).astype(np.int64)
    colours = np.stack([label_colour(label) for label in sorted(labels)])
    return np.concatenate([colours[tiles], rgb], axis=1)


def label_colour(label: int) -> np.ndarray:
    """Background (0) black; label k the palette's k-th colour, repeating after ten."""
    return PALETTE[0] if label == 0 else PALETTE[1 + (label - 1) % (len(PALETTE) - 1)]


class Report:
    """Collects what the page shows while an evaluation runs over its cases; ``render`` writes the HTML."""

    def __init__(self, max_cases: int = 12, max_samples: int = 4, bins: int = 50) -> None:
        self.max_cases = max_cases
        self.max_samples = max_samples
        self.edges = np.linspace(0.0, 1.0, bins + 1)
        self.figures: list[CaseFigure] = []
        self.histograms: dict[int, LabelHistogram] = {}
        self.n_cases = 0

    def add_case(
        self, case: str, real: np.ndarray, samples: Sequence[np.ndarray], mask: np.ndarray | None = None
    ) -> None:
        """Volumes [D, H, W] in [0, 1] (as evaluated); mask: the label map on the same grid, or None."""
        self.n_cases += 1
        labels = sorted(int(v) for v in np.unique(mask)) if mask is not None else []
        if len(self.figures) < self.max_cases:
            shown = list(samples[: self.max_samples])
            image = case_montage(real, shown, mask, labels)
            names = (["mask"] if mask is not None else []) + ["real"] + [f"sample {i}" for i in range(len(shown))]
            self.figures.append(CaseFigure(case, encode_png(image), names, image.shape[0] // 3))
        if mask is None:
            return
        for label in labels:
            inside = mask == label
            h = self.histograms.setdefault(
                label, LabelHistogram(np.zeros(len(self.edges) - 1), np.zeros(len(self.edges) - 1))
            )
            r = real[inside]
            h.real += np.histogram(np.clip(r, 0, 1), self.edges)[0]
            h.real_sum += float(r.sum())
            for s in samples:
                v = s[inside]
                h.synthetic += np.histogram(np.clip(v, 0, 1), self.edges)[0]
                h.synthetic_sum += float(v.sum())

    def render(
        self, title: str, summary: Sequence[Table], details: Sequence[Table] = (), notes: Sequence[str] = ()
    ) -> str:
        """The page: notes, the montages first (people look at samples before they read numbers), then the
        ``summary`` tables beside the histograms, and last the ``details`` tables. A table is (heading,
        columns, rows)."""
        parts = [f"<h1>{html.escape(title)}</h1>"]
        parts += [f"<p class=note>{html.escape(n)}</p>" for n in notes]
        if self.figures:
            shown = (
                f"{len(self.figures)} of {self.n_cases}" if self.n_cases > len(self.figures) else f"all {self.n_cases}"
            )
            parts.append(
                f"<h2>Mid-slices ({shown} cases)</h2><p class=note>Rows: the three orthogonal mid-planes; "
                "columns: mask (labels coloured), real image, samples.</p>"
            )
            parts.append("<div class=cases>" + "".join(figure_html(f) for f in self.figures) + "</div>")
        side = [table_section(t) for t in summary]
        if self.histograms:
            side.append(
                "<div><h2>Intensity inside each mask label, real vs. synthetic</h2>"
                f"<p class=note>Density over [0, 1] (the evaluated intensity scale), pooled over "
                f"{self.n_cases} case(s); dashed: the means; "
                f"<b style='color:{REAL_COLOUR}'>real</b>, <b style='color:{SYNTHETIC_COLOUR}'>synthetic</b>.</p>"
                "<div class=plots>"
                + "".join(histogram_svg(label, h, self.edges) for label, h in sorted(self.histograms.items()))
                + "</div></div>"
            )
        parts.append("<div class=row>" + "".join(side) + "</div>")
        parts += [table_section(t) for t in details]
        return PAGE.format(title=html.escape(title), body="\n".join(parts))

    def evaluation_page(self, result: dict[str, Any], columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
        """The page of ``evaluate.evaluate``'s result: summary, per-sample rows (``columns`` of ``rows``, label
        statistics left to the histograms) and per-mask diversity."""
        summary = [{"metric": k, "value": v} for k, v in result["summary"].items()]
        settings = ", ".join(f"{k} {v}" for k, v in result["settings"].items() if v is not None)
        return self.render(
            "diffusion3d evaluation",
            summary=[("Summary (means over samples)", ["metric", "value"], summary)],
            details=[
                ("Per sample", [c for c in columns if not c.startswith("label")], rows),
                (
                    "Per mask: diversity (MS-SSIM among its samples; lower = more diverse)",
                    ["case", "n_samples", "ms_ssim", "ms_ssim_pairs", "ms_ssim_note"],
                    result["cases"],
                ),
            ],
            notes=[f"Settings: {settings}. Every metric is computed on volumes mapped to [0, 1]."],
        )


# ---- HTML pieces ------------------------------------------------------------------------------------------
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.15em; margin-top: 1.6em; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ border-bottom: 1px solid #ddd; padding: 2px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:first-child, th:first-child {{ text-align: left; }}
.note {{ color: #555; max-width: 60em; }}
.plots {{ display: flex; flex-wrap: wrap; gap: 12px; max-width: 700px; }}
.row {{ display: flex; flex-wrap: wrap; gap: 32px; align-items: flex-start; }}
.scroll {{ overflow-x: auto; }}
.cases {{ display: flex; flex-wrap: wrap; gap: 16px; }} .case {{ margin: 0.5em 0; }}
.case img {{ image-rendering: pixelated; display: block; }}
.cols {{ display: flex; }} .cols span {{ text-align: center; font-size: 12px; color: #555; }}
</style></head>
<body>
{body}
</body></html>
"""


def fmt(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "∞" if value > 0 else "-∞"
        return f"{value:.4g}"
    return str(value)


def table_section(table: Table) -> str:
    heading, columns, rows = table
    return f"<div><h2>{html.escape(heading)}</h2><div class=scroll>{table_html(columns, rows)}</div></div>"


def table_html(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure_html(figure: CaseFigure) -> str:
    tile = figure.tile * max(1, TILE_PX // figure.tile)  # 32³: 3× (96 px); 128³ and up: 1×, never shrunk
    captions = "".join(f"<span style='width:{tile}px'>{html.escape(c)}</span>" for c in figure.columns)
    return (
        f"<div class=case><b>{html.escape(figure.case)}</b><div class=cols>{captions}</div>"
        f"<img alt='mid-slices of {html.escape(figure.case)}' src='{data_uri(figure.png)}' "
        f"width='{tile * len(figure.columns)}' height='{tile * 3}'></div>"
    )


def _step_path(density: np.ndarray, edges: np.ndarray, x, y) -> str:
    points = [(x(edges[0]), y(0.0))]
    for i, d in enumerate(density):
        points += [(x(edges[i]), y(d)), (x(edges[i + 1]), y(d))]
    points.append((x(edges[-1]), y(0.0)))
    return " ".join(f"{px:.1f},{py:.1f}" for px, py in points)


def histogram_svg(label: int, h: LabelHistogram, edges: np.ndarray, width: int = 320, height: int = 170) -> str:
    """One label's real and synthetic intensity densities as two step curves on a shared axis."""
    left, right, top, bottom = 36, 10, 24, 26
    width_bins = np.diff(edges)
    densities = [c / c.sum() / width_bins if c.sum() else np.zeros_like(c) for c in (h.real, h.synthetic)]
    peak = max(float(d.max()) for d in densities) or 1.0

    def x(v: float) -> float:
        return left + (v - edges[0]) / (edges[-1] - edges[0]) * (width - left - right)

    def y(v: float) -> float:
        return height - bottom - v / peak * (height - top - bottom)

    means = [
        s / c.sum() if c.sum() else float("nan") for s, c in ((h.real_sum, h.real), (h.synthetic_sum, h.synthetic))
    ]
    title = f"label {label}: mean real {fmt(means[0])}, synthetic {fmt(means[1])}"
    ticks = "".join(
        f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{height - bottom}' y2='{height - bottom + 4}' stroke='#444'/>"
        f"<text x='{x(t):.1f}' y='{height - bottom + 16}' text-anchor='middle'>{t:g}</text>"
        for t in (0.0, 0.25, 0.5, 0.75, 1.0)
    )
    curves = "".join(
        f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{_step_path(d, edges, x, y)}'/>"
        for d, colour in zip(densities, (REAL_COLOUR, SYNTHETIC_COLOUR))
    )
    mean_lines = "".join(
        f"<line x1='{x(m):.1f}' x2='{x(m):.1f}' y1='{top}' y2='{height - bottom}' stroke='{colour}' "
        "stroke-dasharray='3,3'/>"
        for m, colour in zip(means, (REAL_COLOUR, SYNTHETIC_COLOUR))
        if math.isfinite(m)
    )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-size='11' "
        f"role='img' aria-label='{html.escape(title)}' class='histogram' data-label='{label}'>"
        f"<text x='{left}' y='14'>{html.escape(title)}</text>"
        f"<line x1='{left}' x2='{width - right}' y1='{height - bottom}' y2='{height - bottom}' stroke='#444'/>"
        f"{ticks}{mean_lines}{curves}</svg>"
    )
