"""The command line end to end: the demo path, the override rules, bad flags, bundled configs, and the
helper every command shares (one-line errors, exit codes)."""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from diffusion3d import checkpoint as ckpt
from diffusion3d import config as C
from diffusion3d import configs, storage
from diffusion3d.commands import common as _cli
from diffusion3d.commands import train as cli
from diffusion3d.data import DataError, DataProblems
from tests.helpers import ROOT, sections, subprocess_env, tiny


def test_tiny_flags_build_the_tiny_config(tmp_path):
    """The one tiny run: its flags, parsed as train.py parses them, give exactly its config."""
    for run in (
        tiny(tmp_path / "a"),
        tiny(
            tmp_path / "b",
            data=False,
            prediction="flow",
            sampler="heun",
            precision="bf16",
            spacing=[1.0, 1.0, 2.0],
            image_dir=["x", "y"],
        ),
        # in wavelet space the flags say what differs from the default config's wavelet values (velocity, AdamW)
        tiny(tmp_path / "d", data=False, prediction="flow", sampler="euler", space="wavelet"),
    ):
        assert sections(cli.parse(run.flags)[1]) == sections(run.cfg)
    assert {"--flow_output", "--optimizer", "--flow_shift"} <= set(run.flags)
    run = tiny(tmp_path / "c", base=C.load(configs.DEFAULT))  # on the default config: its recipe stays
    assert "--prediction" not in run.flags and cli.parse(run.flags)[1].diffusion.prediction == "flow"


@pytest.mark.slow
def test_demo_run_end_to_end(tmp_path):
    """train.py with the demo's flags, on the default config's recipe at 16³: exits 0 and leaves a
    checkpoint, an event file, a NIfTI sample and the resolved config."""
    run = tiny(tmp_path, base=C.load(configs.DEFAULT), sampling_steps=4, sample_every=4)
    proc = subprocess.run(
        [sys.executable, "train.py", *run.flags, "--with_condition", "--accum", "2"],  # the README's demo flags
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
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
    args = parser.parse_args(
        [
            "--batch_size",
            "3",
            "--accum",
            "4",
            "--lr",
            "2e-4",
            "--labels",
            "[1,2,4]",
            "--no_with_condition",
            "--precision",
            "bf16",
            "--spacing",
            "[1.0,1.0,2]",
        ]
    )
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
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag 1"),
        (["--train_num_steps", "two"], "train_num_steps: expected an integer"),
        (["--precision", "fp8"], "precision: 'fp8' is not one of"),
        (["--accum", "0"], "gradient_accumulate_every: must be at least 1"),
        (["--image_size", "[30,32,32]"], "must be divisible by"),
    ],
)
def test_bad_flags_exit_2(argv, message, capsys):
    """A bad flag or value: one line (no usage block), as in every other command, exit 2."""
    with pytest.raises(SystemExit) as exc:
        cli.run(argv)
    assert exc.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and message in line and line.endswith(" (see train.py --help)"), line


def test_batch_size_auto_keeps_the_effective_batch(tmp_path):
    """--batch_size auto picks the micro-batch (here capped by --max_batch) and derives accum."""
    run = tiny(tmp_path, batch_size="auto", effective_batch=6, max_batch=4, train_num_steps=1)
    with pytest.raises(SystemExit) as exc:
        cli.main(run.flags)
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
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and message in line, line


# ---- bundled configs -------------------------------------------------------------------------------------
def test_config_by_bundled_name_or_path(tmp_path, capsys):
    """--config takes a bundled config's name (with or without .yaml) or a path; the default ships inside
    the package, so an install without the source tree finds it."""
    assert (
        cli.DEFAULT_CONFIG == configs.DEFAULT and configs.DEFAULT.parent == Path(cli.__file__).parent.parent / "configs"
    )
    assert {"default", "whole_head_128"} <= set(configs.names())
    args, cfg = cli.parse(["--config", "whole_head_128"])
    assert cfg.name == "whole_head_128" and cfg.data.image_size == [128, 128, 128]
    assert cli.parse(["--config", "whole_head_128.yaml"])[1].name == "whole_head_128"
    assert cli.parse([])[1].name == "default"
    mine = tmp_path / "whole_head_128"  # a file that exists wins over a bundled name
    mine.write_text("train:\n  seed: 5\n")
    assert configs.find(mine) == mine and configs.find(str(mine)) == mine
    with pytest.raises(SystemExit) as exc:
        cli.run(["--config", "no_such_recipe"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: no_such_recipe: config file not found (bundled configs: brats_192, default, whole_head_128) "
        "(see train.py --help)"
    ]
    with pytest.raises(C.ConfigError):
        configs.find("configs/default.yaml")  # a path with folders is never taken for a bundled name


def test_resume_from_a_run_folder(tmp_path, caplog):
    """--resume takes a run folder as sample --checkpoint does (checkpoint.find_checkpoint): its newest
    valid checkpoint."""
    caplog.set_level(logging.INFO, logger="diffusion3d")
    first = tiny(tmp_path, train_num_steps=2).flags
    with pytest.raises(SystemExit) as exc:
        cli.main(first)
    assert exc.value.code == 0
    with pytest.raises(SystemExit) as exc:
        cli.main(
            [
                *first,
                "--results_dir",
                str(tmp_path / "more"),
                "--resume",
                str(tmp_path / "run"),
                "--train_num_steps",
                "3",
            ]
        )
    assert exc.value.code == 0, caplog.text
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_00000002.pt'} at step 2" in caplog.text
    assert [p.name for p in (tmp_path / "more" / "checkpoints").iterdir()] == ["step_00000003.pt"]


# ---- the shared command-line helper ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "error, code, line",
    [
        (_cli.InputError("--n: expected a positive integer"), 2, "error: --n: expected a positive integer"),
        (DataError("a.nii.gz: not a 3D volume"), 2, "error: a.nii.gz: not a 3D volume"),
        (C.ConfigError("lr: expected a number"), 2, "error: lr: expected a number"),
        (ckpt.CheckpointError("s.pt: unreadable checkpoint"), 2, "error: s.pt: unreadable checkpoint"),
        (
            storage.FolderLockedError("out: in use by another run (pid 1)"),
            2,
            "error: out: in use by another run (pid 1)",
        ),
        (
            storage.StorageError("s.pt: cannot write checkpoint: No space left on device (ENOSPC)"),
            1,
            "error: s.pt: cannot write checkpoint: No space left on device (ENOSPC)",
        ),
        (OSError(errno.EIO, "Input/output error", "/x/y"), 1, "error: /x/y: Input/output error"),
        (OSError(errno.EIO, "Input/output error"), 1, "error: Input/output error"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ],
)
def test_run_command_maps_each_failure_to_one_line_and_its_exit_code(error, code, line, capsys):
    def body():
        raise error

    assert _cli.run_command(body) == code
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_run_command_codes_extras_and_what_passes_through(capsys):
    assert _cli.run_command(lambda: None) == 0 and _cli.run_command(lambda: 3) == 3

    def problems():
        raise DataProblems(["a.nii.gz: empty", "b.nii.gz: not NIfTI"], "2 of 5 cases are bad")

    assert _cli.run_command(problems) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: a.nii.gz: empty",
        "error: b.nii.gz: not NIfTI",
        "error: 2 of 5 cases are bad; nothing was written",
    ]

    def missing():
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "q.json")

    assert _cli.run_command(missing) == 1  # an OSError is a fault unless the command says otherwise
    assert _cli.run_command(missing, bad_input=(FileNotFoundError,)) == 2

    def diverged():
        raise RuntimeError("loss is NaN")

    assert _cli.run_command(diverged, faults=(RuntimeError,)) == 1
    capsys.readouterr()
    with pytest.raises(RuntimeError):  # anything else is a bug: it keeps its traceback
        _cli.run_command(diverged)
    with pytest.raises(SystemExit):  # the parser's exit and --help pass through
        _cli.run_command(lambda: sys.exit(2))


def test_one_line_parser_error(capsys):
    parser = _cli.OneLineParser(prog="python -m diffusion3d.thing")
    parser.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--n", "x"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: argument --n: invalid int value: 'x' (see python -m diffusion3d.thing --help)"
    ]


def test_commands_share_one_input_error():
    """Every command raises the helper's InputError (one line, exit 2); that the library never imports the
    command layer is tests/test_architecture.py's job."""
    from diffusion3d.commands import bench, evaluate, quality, sample

    for module in (cli, sample, evaluate, bench, quality):
        assert module.InputError is _cli.InputError, module.__name__
    assert quality.QualityError is _cli.InputError


def test_a_checkpoint_older_than_a_key_still_resumes(tmp_path, caplog):
    """A checkpoint written before a resume-breaking key existed (its config lacks data.wavelet_cond) ran
    with that key's default: the run resumes from it, rather than stopping on 'None -> haar'."""
    caplog.set_level(logging.INFO, logger="diffusion3d")
    flags = tiny(tmp_path, train_num_steps=2).flags
    with pytest.raises(SystemExit) as exc:
        cli.main(flags)
    assert exc.value.code == 0
    path = tmp_path / "run" / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, map_location="cpu", weights_only=False)
    del state["config"]["data"]["wavelet_cond"]
    torch.save(state, path)
    with pytest.raises(SystemExit) as exc:
        cli.main([*flags, "--train_num_steps", "3"])
    assert exc.value.code == 0, caplog.text
    assert f"resumed from {path} at step 2" in caplog.text
