"""The accumulation questions (docs/accumulation.md): the script's core at tiny size asserts the math facts, so
it fails if the Trainer's loss division, its GradScaler handling or its accumulation breaks."""

from __future__ import annotations

import pytest

from diffusion3d.commands import accumulation as A
from diffusion3d.commands.bench import main as bench_main


@pytest.fixture(scope="module")
def report():
    return A.measure(batch_size=1, accum=3, steps=2, sgd_lr=0.05, size=8)


def test_accumulated_gradient_equals_one_large_batch_in_every_precision(report):
    rows = {g["precision"]: g for g in report["gradients"]}
    assert {"fp32", "bf16"} <= set(rows)
    assert rows["fp32"]["max_rel_diff"] < 1e-4 and not rows["fp32"]["grad_scaler"]
    for g in rows.values():  # autocast rounds differently per batch shape, the division is still right
        assert g["finite"] and g["max_rel_diff"] < 0.05, g
    if "fp16" in rows:  # GradScaler: the scale multiplies and unscale_ divides; the accum division is untouched
        assert rows["fp16"]["grad_scaler"] and rows["fp16"]["loss_scale"] > 1


def test_without_the_division_the_gradient_is_accum_times_larger(report):
    for g in report["gradients"]:
        assert g["undivided_norm_ratio"] == pytest.approx(3.0, rel=1e-3 if g["precision"] == "fp32" else 0.05), g
    fp32 = next(g for g in report["gradients"] if g["precision"] == "fp32")
    assert fp32["undivided_max_rel_diff_from_accum_x"] < 1e-5  # exactly 3× the divided one, element by element


def test_adam_barely_notices_sgd_takes_an_accum_times_larger_step(report):
    adam_one, adam_many, sgd = report["updates"]
    assert adam_one["optimizer"] == "adamw" and adam_one["steps"] == 1 and adam_one["rel_update_diff"] < 1e-3
    assert adam_many["rel_update_diff"] < 0.05
    assert sgd["optimizer"] == "sgd" and sgd["update_norm_ratio"] == pytest.approx(3.0, rel=1e-4)
    assert sgd["rel_update_diff"] == pytest.approx(2.0, rel=1e-4)  # ‖3Δ − Δ‖ / ‖Δ‖


def test_curves_and_the_bench_hand_over(report, tmp_path, capsys, monkeypatch):
    curves = {(c["optimizer"], c["divided"]): c for c in report["curves"]}
    divided, undivided = curves[("adamw", True)], curves[("adamw", False)]
    assert undivided["median_grad_norm"] == pytest.approx(3 * divided["median_grad_norm"], rel=0.1)
    assert undivided["clipped_fraction"] >= divided["clipped_fraction"]
    assert len(divided["losses"]) == 2
    assert A.split_argv(["--parts", "accumulation", "--accum", "2"]) == ["--accum", "2"]
    assert A.split_argv(["--parts", "train"]) is None
    monkeypatch.setattr(A, "measure", lambda *args, **kwargs: report)  # measured above: the hand-over alone here
    code = bench_main(["--parts", "accumulation", "--json", str(tmp_path / "a.json")])
    out = capsys.readouterr().out
    assert code == 0 and "| precision | GradScaler |" in out and (tmp_path / "a.json").is_file()


@pytest.mark.parametrize("batch_size,accum,ranks", [(1, 1, 1), (3, 7, 1), (5, 1, 1), (2, 3, 2)])
def test_every_case_once_per_epoch_whatever_the_split(batch_size, accum, ranks):
    """Splits that do not divide the 24 cases still read each case exactly once per epoch (also
    tests/test_data.py::test_stream_epochs_are_permutations); a step may straddle an epoch's end."""
    c = A.epoch_coverage(24, batch_size, accum, ranks, steps=40)
    assert c["complete_epochs"] >= 1 and c["min_uses"] == c["max_uses"] == 1
    assert c["samples"] == 40 * batch_size * accum * ranks
    assert (c["steps_across_an_epoch_end"] == 0) == (24 % (batch_size * accum * ranks) == 0)
