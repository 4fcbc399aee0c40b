"""The benchmark command and its FLOP count, on the tiny 16³ model (never asserting timings)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from diffusion3d import memory
from diffusion3d.commands import bench
from diffusion3d.memory import synthetic_trainer
from tests.helpers import ROOT, subprocess_env, tiny, tiny_config


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


# ---- the benchmark command -----------------------------------------------------------------------
def test_quick_bench_in_process_writes_json_with_positive_numbers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "cpu_has_fast_bf16", lambda: True)  # bf16 rows, as on a CPU with AVX-512 or AMX
    config = tiny(tmp_path).yaml()
    out = tmp_path / "bench.json"
    code = bench.main(
        [
            "--config",
            str(config),
            "--sizes",
            "16",
            "--precisions",
            "fp32,bf16",
            "--checkpointing",
            "off",
            "--quick",
            "--isolate",
            "off",
            "--sampling",
            "ddpm,dpmpp2m",
            "--sampling_max_steps",
            "2",
            "--loader",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert {"device", "device_name", "torch", "monai", "torch_threads", "load_average"} <= set(report["machine"])
    assert report["machine"]["torch_threads"] == 1
    assert [(r["precision"], r["size"]) for r in report["train"]] == [("fp32", 16), ("bf16", 16)]
    for r in report["train"]:
        for key in ("s_per_step", "volumes_per_s", "peak_mem_gb", "flops_per_step", "achieved_tflops", "est_step_gb"):
            assert _positive(r[key]), (key, r[key])
        assert len(r["step_times_s"]) == 1  # --quick: one timed step
        assert "peak_fraction" not in r  # no GPU peak on CPU
    samplers = [
        (r["sampler"], r["steps"], r["steps_run"], r["extrapolated"])
        for r in report["sampling"]
        if r["precision"] == "fp32"
    ]
    # ddpm runs all 50 training timesteps of the tiny config; capped at 2 and reported as extrapolated
    assert samplers == [("ddpm", 50, 2, True), ("dpmpp2m", 20, 2, True)]
    assert all(_positive(r["s_per_volume"]) and _positive(r["s_per_eval"]) for r in report["sampling"])
    assert {r["cached"] for r in report["loader"]} == {True, False}
    assert all(_positive(r["s_per_batch"]) for r in report["loader"])
    table = capsys.readouterr().out
    assert "training" in table and "sampling" in table and "loader" in table and "extrapolated" in table


def test_training_is_measured_in_each_space_asked_for(tmp_path, capsys):
    """--spaces: one row per size × space, labelled; wavelet-1 runs the UNet on an eighth of the voxels."""
    config = tiny(tmp_path).yaml()
    out = tmp_path / "bench.json"
    argv = ["--config", str(config), "--parts", "train", "--sizes", "16", "--spaces", "pixel,wavelet1"]
    argv += ["--precisions", "fp32", "--checkpointing", "off", "--quick", "--isolate", "off", "--no_estimate"]
    assert bench.main([*argv, "--device", "cpu", "--threads", "1", "--json", str(out)]) == 0
    pixel, wavelet = json.loads(out.read_text())["train"]
    assert (pixel["space"], wavelet["space"]) == ("pixel", "wavelet1")
    assert wavelet["flops_per_step"] < pixel["flops_per_step"] / 2
    printed = capsys.readouterr()
    assert "× row 1" in printed.out
    # each row's result is on stderr as soon as it is measured, before the table at the end
    assert len(re.findall(r"\d+\.\d{3} s/step, peak \d+\.\d\d GiB", printed.err)) == 2


def test_memory_table_part_traces_each_configuration(tmp_path, capsys):
    """--parts memory_table: one row per grid × space × precision × checkpointing, a side the space cannot
    divide padded up (20 → 24 for wavelet-2 on the 2-level UNet: 8 | side), fewer bytes per sample and FLOPs in
    wavelet-1, wavelet-2's weights grown by its first level raised to 256 input channels, checkpointing saving
    memory, the largest batch growing with the card."""
    config = tiny(tmp_path).yaml()
    out = tmp_path / "table.json"
    code = bench.main(
        [
            "--config",
            str(config),
            "--parts",
            "memory_table",
            "--table_sizes",
            "16x16x20:2",
            "--table_spaces",
            "pixel,wavelet1,wavelet2",
            "--table_precisions",
            "bf16",
            "--checkpointing",
            "both",
            "--table_cards",
            "1,2",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["memory_table"]
    assert [(r["space"], r["checkpointing"], r["image_size"]) for r in rows] == [
        ("pixel", False, [16, 16, 20]),
        ("pixel", True, [16, 16, 20]),
        ("wavelet-1", False, [16, 16, 20]),
        ("wavelet-1", True, [16, 16, 20]),
        ("wavelet-2", False, [16, 16, 24]),
        ("wavelet-2", True, [16, 16, 24]),
    ]
    assert all(r["image_channels"] == 2 and r["precision"] == "bf16" for r in rows)
    pixel, pixel_ckpt, wavelet, _, wavelet2, _ = rows
    assert pixel_ckpt["total_gb"] < pixel["total_gb"]
    assert wavelet["per_sample_gb"] < pixel["per_sample_gb"]
    assert wavelet["tflops_per_sample"] < pixel["tflops_per_sample"]
    assert wavelet2["total_gb"] > 10 * pixel["total_gb"]  # 256-channel first level: its weights dominate
    assert all(0 < r["largest_batch"]["1"] <= r["largest_batch"]["2"] for r in rows)
    assert "| 16×16×20 | 2 | pixel | bf16 | off |" in capsys.readouterr().out


@pytest.mark.slow
def test_isolated_training_measures_each_config_in_its_own_process(tmp_path):
    run = tiny(tmp_path)
    cfg, config = run.cfg, run.yaml()
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffusion3d",
            "bench",
            "--config",
            str(config),
            "--sizes",
            "16",
            "--precisions",
            "fp32",
            "--checkpointing",
            "off",
            "--accum",
            "2",
            "--quick",
            "--parts",
            "train",
            "--isolate",
            "on",
            "--no_estimate",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["train"]
    assert row["accum"] == 2 and row["batch_size"] == cfg.train.batch_size
    assert row["mem_kind"] == "process_peak_rss" and _positive(row["peak_mem_gb"]) and row["rss_growth_gb"] >= 0
    assert "est_step_gb" not in row
    # FLOPs are counted, not timed: an optimizer step is accum micro-batches of the same work
    micro = bench.count_train_flops(synthetic_trainer(cfg, cfg.train.batch_size, accum=1))
    assert row["flops_per_step"] == 2 * micro


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--precisions", "fp16"], "fp16 is not supported on cpu"),
        (["--sizes", "16,x"], "--sizes"),
        (["--sampling", "warp"], "unknown sampler"),
        (
            ["--sampling", "euler"],
            "euler does not fit prediction",
        ),  # the test config is Gaussian: flow samplers do not fit
        (["--json", "/nonexistent/folder/out.json"], "does not exist"),
        (["--parts", "memory_table", "--table_sizes", "16x16"], "--table_sizes"),
        (["--parts", "memory_table", "--table_spaces", "wavelet3"], "unknown space"),
        (["--parts", "train", "--spaces", "pixel,wavelet3"], "--spaces: unknown space"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, argv, needle):
    config = tiny(tmp_path).yaml()
    code = bench.main(["--config", str(config), "--device", "cpu", "--sizes", "16", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_bf16_is_refused_on_a_cpu_that_would_emulate_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "cpu_has_fast_bf16", lambda: False)
    config = tiny(tmp_path).yaml()
    assert bench.supported_precisions(bench.torch.device("cpu")) == ["fp32"]
    code = bench.main(["--config", str(config), "--device", "cpu", "--sizes", "16", "--precisions", "bf16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "bf16 is not supported on cpu" in err[0]


def test_bad_config_file_is_an_error_line(tmp_path, capsys):
    assert bench.main(["--config", str(tmp_path / "missing.yaml"), "--device", "cpu"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_peak_table_lookup():
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.peak_tflops("NVIDIA H200") == 989.0
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bench.peak_tflops("Some Future GPU") is None


# ---- FLOPs -----------------------------------------------------------------------------------------
def test_flop_count_is_positive_and_scales_with_voxels(tmp_path):
    """Convolutions and per-voxel matmuls are linear in the voxel count; the attention of the UNet's middle
    block (MONAI puts one there whatever attention_levels says) quadratic in its tokens, and counted: torch
    has no FLOP formula for the CPU flash-attention kernel, memory.flop_counter adds it."""
    cfg16 = tiny_config(tmp_path / "a", attention_levels=[False, False])
    cfg32 = tiny_config(tmp_path / "b", size=32, n=1, attention_levels=[False, False])

    def split(cfg) -> tuple[int, int]:
        with memory.flop_counter() as counter:
            synthetic_trainer(cfg, 1, accum=1).accumulate()
        counts = counter.get_flop_counts()["Global"]
        attention = sum(v for k, v in counts.items() if "flash_attention_for_cpu" in str(k))
        return counter.get_total_flops() - attention, attention

    (rest16, att16), (rest32, att32) = split(cfg16), split(cfg32)
    assert att16 > 0
    assert 6.0 < rest32 / rest16 < 10.0
    assert att32 == 64 * att16  # 8× the tokens, each attending to 8× as many
    f16 = bench.count_train_flops(synthetic_trainer(cfg16, 1, accum=1))
    assert f16 == rest16 + att16
    assert bench.count_train_flops(synthetic_trainer(cfg16, 2, accum=1)) == 2 * f16  # deterministic, linear in batch
    assert (
        bench.count_train_flops(synthetic_trainer(cfg16, 1, accum=3)) == 3 * f16
    )  # one optimizer step's micro-batches


def test_default_samplers_follow_the_configs_objective(tmp_path):
    """--sampling auto (the default) times the samplers that fit the config: a flow config gets
    euler, heun and euler_a."""
    flow = tiny(tmp_path / "f", prediction="flow", sampler="heun", loss="l2").yaml()
    gauss = tiny(tmp_path / "g").yaml()
    args = bench.build_parser().parse_args(["--config", str(flow), "--device", "cpu", "--sizes", "16"])
    assert bench.resolve_args(args).samplers == ["euler", "heun", "euler_a"]
    args = bench.build_parser().parse_args(["--config", str(gauss), "--device", "cpu", "--sizes", "16", "--quick"])
    plan = bench.resolve_args(args)
    assert plan.samplers == ["ddim", "ddpm", "dpmpp2m"] or set(plan.samplers) == {"ddim", "ddpm", "dpmpp2m"}
    assert (plan.repeats, plan.warmup, plan.sampling_max_steps) == (1, 1, 4) and args.repeats == 5  # args untouched
