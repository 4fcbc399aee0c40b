"""Checkpoints: exact resume, SIGKILL safety, atomic writes, corrupt files, config changes, retention, signals."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffusion3d import checkpoint as ckpt
from diffusion3d import storage
from diffusion3d.data import discover
from diffusion3d.trainer import build_trainer
from tests.helpers import ROOT, Tiny, subprocess_env, tiny, tiny_config


def train_cmd(run: Tiny, *extra: str) -> list[str]:
    """train.py on the tiny run (2 sampling steps), extra flags last (they win)."""
    return [sys.executable, "train.py", *run.flags, *extra]


def run_cli(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def assert_same_weights(a: dict, b: dict) -> None:
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} differs"


WAVELET_1, WAVELET_2 = {"space": "wavelet", "wavelet_levels": 1}, {"space": "wavelet", "wavelet_levels": 2}


@pytest.mark.parametrize(
    "space",
    [
        {},
        WAVELET_1,
        WAVELET_2,
        {"flip_axes": [0, 1, 2]},
        {**WAVELET_1, "affine_rotate": 10.0, "affine_scale": 0.1, "affine_translate": 0.05},
        {"optimizer": "muon"},
        {**WAVELET_1, "optimizer": "muon"},
    ],
    ids=["pixel", "wavelet1", "wavelet2", "pixel_flips", "wavelet1_affine", "muon", "wavelet1_muon"],
)
def test_exact_resume_in_process(tmp_path, space):
    """N steps straight == N/2 steps, checkpoint, a fresh Trainer, N/2 steps: bitwise (CPU, fp32), in every space,
    with flip and affine augmentation (each sample's flips and affine are drawn from (seed, sample id)) and with
    Muon (its momentum buffers and AdamW's moments come back from the checkpoint)."""
    cfg = tiny_config(tmp_path, batch_size=1, gradient_accumulate_every=2, train_num_steps=4, **space)
    cases = discover(cfg)
    straight = build_trainer(cfg, cases, "cpu", None)
    for _ in range(4):
        straight.train_step()

    first = build_trainer(cfg, cases, "cpu", tmp_path / "run")
    for _ in range(2):
        first.train_step()
    path = first.save_checkpoint()
    resumed = build_trainer(cfg, cases, "cpu", None)
    resumed.load_state_dict(ckpt.load(path))
    assert resumed.step == 2 and resumed.stream.samples_seen == 4
    for _ in range(2):
        resumed.train_step()
    assert_same_weights(straight.state_dict(), resumed.state_dict())
    resumed_state, straight_state = resumed.optimizer.state_dict()["state"], straight.optimizer.state_dict()["state"]
    assert resumed_state.keys() == straight_state.keys()
    for i, state in straight_state.items():
        assert state.keys() == resumed_state[i].keys()
        assert all(torch.equal(state[k], resumed_state[i][k]) for k in state)


def test_checkpoint_holds_everything(tmp_path):
    cfg = tiny_config(tmp_path, train_num_steps=1)
    trainer = build_trainer(cfg, discover(cfg), "cpu", tmp_path / "run")
    trainer.train_step()
    state = ckpt.load(trainer.save_checkpoint())
    for key in (*ckpt.REQUIRED_KEYS, "lr_schedule", "versions", "skipped_steps"):
        assert key in state
    assert state["step"] == 1 and state["samples_seen"] == 2
    assert state["versions"]["torch"] == str(torch.__version__)
    assert state["config"]["train"]["seed"] == cfg.train.seed


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path):
    """Killed after step 4's checkpoint, then the same command: bitwise the run that was never killed. A temp
    file the kill left (planted here, since the kill may land between writes) is never loaded and is removed."""
    tiny_run = tiny(tmp_path, sampling_steps=2, train_num_steps=8, save_every=2)
    straight = run_cli(train_cmd(tiny_run, "--results_dir", str(tmp_path / "straight")))
    assert straight.returncode == 0, straight.stderr[-2000:]

    run = tiny_run.results
    proc = subprocess.Popen(
        train_cmd(tiny_run), cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (run / "checkpoints" / "step_00000004.pt").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    folder = run / "checkpoints"
    done = ckpt.list_checkpoints(folder)
    assert done and done[-1][0] < 8, f"killed too late to test anything: {done}"
    # what a write interrupted at the next step leaves: a loadable checkpoint under the temp name
    stale = folder / f".{ckpt.checkpoint_name(done[-1][0] + 2)}.tmp.{proc.pid}"
    stale.write_bytes(done[-1][1].read_bytes())

    resumed = run_cli(train_cmd(tiny_run))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {done[-1][1]} at step {done[-1][0]}" in resumed.stderr  # not from the temp file
    assert not [p.name for p in folder.iterdir() if ckpt.TEMP_NAME.match(p.name)]  # removed by the next run
    a = ckpt.load(tmp_path / "straight" / "checkpoints" / "step_00000008.pt")
    b = ckpt.load(run / "checkpoints" / "step_00000008.pt")
    assert_same_weights(a, b)
    assert a["samples_seen"] == b["samples_seen"] == 16
    assert_tensorboard_steps_unique(run / "tb", 8)


def assert_tensorboard_steps_unique(tb: Path, last: int) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == list(range(1, last + 1)), steps


def test_find_checkpoint_takes_a_file_a_run_or_its_checkpoints_folder(tmp_path):
    """One lookup for sample --checkpoint and train --resume: a file as given, a folder's newest valid one."""
    cfg = tiny_config(tmp_path, train_num_steps=2)
    run = tmp_path / "run"
    trainer = build_trainer(cfg, discover(cfg), "cpu", run)
    trainer.train_step()
    first = trainer.save_checkpoint()
    trainer.train_step()
    newest = trainer.save_checkpoint()
    for where in (run, run / "checkpoints"):
        path, state = ckpt.find_checkpoint(where)
        assert path == newest and state["step"] == 2
    assert ckpt.find_checkpoint(first)[1]["step"] == 1
    newest.write_bytes(b"not a checkpoint")
    assert ckpt.find_checkpoint(run)[0] == first  # the newest *valid* one
    with pytest.raises(ckpt.CheckpointError, match="unreadable checkpoint"):
        ckpt.find_checkpoint(newest)  # a file named explicitly is never replaced by another
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckpt.CheckpointError, match=r"empty: no valid checkpoint \(step_\*\.pt\) in this folder"):
        ckpt.find_checkpoint(tmp_path / "empty")
    with pytest.raises(ckpt.CheckpointError, match="nope.pt: checkpoint not found"):
        ckpt.find_checkpoint(tmp_path / "nope.pt")


def test_truncated_newest_checkpoint_is_skipped(tmp_path, caplog):
    cfg = tiny_config(tmp_path, train_num_steps=2)
    trainer = build_trainer(cfg, discover(cfg), "cpu", tmp_path / "run")
    trainer.train_step()
    good = trainer.save_checkpoint()
    trainer.train_step()
    newest = trainer.save_checkpoint()
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    path, state = ckpt.load_latest_valid(good.parent)
    assert path == good and state["step"] == 1
    assert "skipping" in caplog.text and newest.name in caplog.text


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / ckpt.checkpoint_name(1)
    ckpt.save_atomic({"x": torch.zeros(3)}, path)
    original = path.read_bytes()

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(storage.StorageError, match="No space left on device"):
        ckpt.save_atomic({"x": torch.ones(3)}, path)
    assert path.read_bytes() == original
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_retention_keeps_last_k_and_milestones(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in range(1, 11):
        ckpt.save_atomic({"step": step}, folder / ckpt.checkpoint_name(step))
    removed = ckpt.apply_retention(folder, keep_last=2, milestone_every=4)
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [4, 8, 9, 10]
    assert len(removed) == 6
    ckpt.apply_retention(folder, keep_last=1, milestone_every=0, protect=folder / ckpt.checkpoint_name(9))
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [9, 10]


def test_config_differences_split_breaking_and_harmless(tmp_path):
    old = tiny_config(tmp_path).to_dict()
    new = tiny_config(tmp_path, channels=[8, 32], seed=3, train_num_steps=99, lr=5e-4).to_dict()
    breaking, harmless = ckpt.config_differences(old, new)
    assert any(line.startswith("model.channels") for line in breaking)
    assert any(line.startswith("train.seed") for line in breaking)
    assert any(line.startswith("train.train_num_steps") for line in harmless)
    assert any(line.startswith("train.lr") for line in harmless)


@pytest.mark.slow
def test_resume_rules_on_the_command_line(tmp_path):
    tiny_run = tiny(tmp_path, sampling_steps=2)
    run = tiny_run.results
    first = run_cli(train_cmd(tiny_run, "--train_num_steps", "2"))
    assert first.returncode == 0, first.stderr[-2000:]
    listing = sorted(p.name for p in run.rglob("*"))

    changed = run_cli(train_cmd(tiny_run, "--train_num_steps", "4", "--channels", "[8,32]"))
    assert changed.returncode == 2
    assert "model.channels: [8, 16] -> [8, 32]" in changed.stderr and "Traceback" not in changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1

    refused = run_cli(train_cmd(tiny_run, "--train_num_steps", "4", "--resume", "none"))
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    missing = run_cli(train_cmd(tiny_run, "--resume", str(run / "nope.pt")))
    assert missing.returncode == 2 and "nope.pt: checkpoint not found" in missing.stderr
    assert sorted(p.name for p in run.rglob("*")) == listing  # nothing written by the refused runs

    more = run_cli(train_cmd(tiny_run, "--train_num_steps", "3", "--lr", "5e-4"))
    assert more.returncode == 0, more.stderr[-2000:]
    assert "train.lr" in more.stderr and "resumed from" in more.stderr
    assert ckpt.load(run / "checkpoints" / "step_00000003.pt")["step"] == 3


def start_long_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    tiny_run = tiny(
        tmp_path, sampling_steps=2, train_num_steps=100000, save_every=100000, sample_every=100000, log_every=1
    )
    run = tiny_run.results
    proc = subprocess.Popen(
        train_cmd(tiny_run), cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and not list((run / "tb").glob("events.out.tfevents.*")):
        time.sleep(0.1)
    time.sleep(2.0)  # a few steps in
    return proc, run


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_step_saves_and_exits_0(tmp_path, sig):
    proc, run = start_long_run(tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "checkpoint saved" in out
    saved = ckpt.list_checkpoints(run / "checkpoints")
    assert len(saved) == 1 and saved[0][0] >= 1
    assert ckpt.load(saved[0][1])["step"] == saved[0][0]


@pytest.mark.slow
def test_second_sigint_exits_at_once(tmp_path):
    proc, run = start_long_run(tmp_path)
    proc.send_signal(signal.SIGINT)
    lines = []
    for line in proc.stderr:  # wait until the first SIGINT was handled; two pending signals coalesce
        lines.append(line)
        if "finishing the current step" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    assert not ckpt.list_checkpoints(run / "checkpoints")  # stopped before saving
