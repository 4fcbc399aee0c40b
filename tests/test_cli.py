"""The command line end to end: the demo path, the override rules, bad flags."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, make_dataset
from diffusion3d import cli
from diffusion3d import config as C


def tiny_args(tmp_path, *extra):
    images, masks = make_dataset(tmp_path / "data", n=6, size=16)
    return [
        "--image_dir", str(images), "--mask_dir", str(masks), "--image_size", "[16,16,16]",
        "--channels", "[8,16]", "--attention_levels", "[false,true]", "--num_head_channels", "8",
        "--norm_num_groups", "4", "--timesteps", "50", "--sampling_steps", "4", "--batch_size", "2",
        "--train_num_steps", "4", "--save_every", "2", "--sample_every", "4", "--num_val_cases", "1",
        "--results_dir", str(tmp_path / "run"), "--device", "cpu", "--quiet", *extra,
    ]


def test_demo_run_end_to_end(tmp_path):
    """train.py exits 0 and leaves a checkpoint, an event file, a NIfTI sample and the resolved config."""
    proc = subprocess.run(
        [sys.executable, "train.py", "--with_condition", "--accum", "2", *tiny_args(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002.pt", "step_00000004.pt"]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert list((run / "samples").rglob("*_sample0.nii.gz"))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["gradient_accumulate_every"] == 2
    assert "# diffusion3d resolved config" in proc.stdout


def test_overrides_by_key_name(tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["--batch_size", "3", "--accum", "4", "--lr", "2e-4", "--labels", "[1,2,4]",
                              "--no_with_condition", "--precision", "bf16", "--spacing", "[1.0,1.0,2]"])
    cfg = cli.resolve_config(args, parser)
    assert cfg.train.batch_size == 3
    assert cfg.train.gradient_accumulate_every == 4
    assert cfg.train.lr == pytest.approx(2e-4)
    assert cfg.data.labels == [1, 2, 4]
    assert cfg.model.with_condition is False
    assert cfg.train.precision == "bf16"
    assert cfg.data.spacing == [1.0, 1.0, 2.0]
    # untouched keys keep the default config's values
    assert cfg.model.channels == C.load(cli.DEFAULT_CONFIG).model.channels


def test_with_condition_flag_and_config_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model:\n  with_condition: false\ntrain:\n  seed: 7\n")
    parser = cli.build_parser()
    cfg = cli.resolve_config(parser.parse_args(["--config", str(path), "--with_condition"]), parser)
    assert cfg.model.with_condition is True and cfg.train.seed == 7 and cfg.name == "mine"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no_such_flag", "1"], "unrecognized arguments"),
        (["--train_num_steps", "two"], "train_num_steps: expected an integer"),
        (["--precision", "fp8"], "precision: 'fp8' is not one of"),
        (["--accum", "0"], "gradient_accumulate_every: must be at least 1"),
        (["--image_size", "[30,32,32]"], "must be divisible by"),
    ],
)
def test_bad_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.run(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_batch_size_auto_keeps_the_effective_batch(tmp_path):
    """--batch_size auto picks the micro-batch (here capped by --max_batch) and derives accum."""
    args = tiny_args(tmp_path, "--batch_size", "auto", "--effective_batch", "6", "--max_batch", "4",
                     "--train_num_steps", "1", "--sample_every", "100")
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]
    assert (saved["batch_size"], saved["gradient_accumulate_every"]) == (3, 2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch_size", "auto"], "auto needs effective_batch"),
        (["--batch_size", "big"], "expected a positive integer or auto"),
        (["--batch_size", "2", "--accum", "2", "--effective_batch", "8"], "is not batch_size 2 × accum 2"),
    ],
)
def test_batch_size_auto_bad_values_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.run(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
