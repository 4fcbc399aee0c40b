"""Fault injection: hostile datatypes and headers, colliding runs, failing storage, kills mid-write, damaged
files. Each test asserts the exit code, the one line the user sees, and that nothing valid was lost.

Storage faults are injected by monkeypatching (the tests run as root, where chmod does not stop writes);
kills use real subprocesses and SIGKILL.
"""

from __future__ import annotations

import errno
import gzip
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from diffusion3d import checkpoint as ckpt
from diffusion3d import data as D
from diffusion3d import storage
from diffusion3d.commands import train as cli
from tests.helpers import ROOT, make_dataset, phantom, subprocess_env, tiny, write_nifti

SIZE = 16


def args_for(data: Path, run: Path, *extra: str) -> list[str]:
    """The tiny run's flags (20 timesteps, 2 sampling steps, 5 checkpoints kept) on data/{images,masks},
    writing to run; extra flags last."""
    flags = tiny(run.parent, data=data, results_dir=str(run), timesteps=20, sampling_steps=2, keep_last=5).flags
    return [*flags, *extra]


def call_main(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """cli.main in this process: (exit code, the stderr lines starting with 'error:', all of stderr)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    return exc.value.code, [line for line in err.splitlines() if line.startswith("error:")], err


def no_temp_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if ".tmp" in p.name]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 phantom pairs and a 2-step run with its step-2 checkpoint (copied by each test that changes it)."""
    root = tmp_path_factory.mktemp("trained")
    make_dataset(root / "data", n=6, size=SIZE)
    with pytest.raises(SystemExit) as exc:
        cli.main(args_for(root / "data", root / "run", "--train_num_steps", "2"))
    assert exc.value.code == 0
    assert [p.name for p in (root / "run" / "checkpoints").iterdir()] == ["step_00000002.pt"]
    return root


@pytest.fixture
def run_copy(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    return trained / "data", tmp_path / "run"


def never_read_voxels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("voxels were read")

    monkeypatch.setattr(nib.arrayproxy.ArrayProxy, "__array__", refuse)
    monkeypatch.setattr(nib.arrayproxy.ArrayProxy, "get_unscaled", refuse)


# ---- 1. datatypes ----------------------------------------------------------------------------------------
ACCEPTED = ["uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float32", "float64"]


@pytest.mark.parametrize("dtype", ACCEPTED)
def test_every_real_datatype_is_accepted(tmp_path, dtype):
    image, mask = phantom(SIZE, 0)
    scaled = image * 100 if np.dtype(dtype).kind in "iu" else image
    path, mpath = tmp_path / "x.nii.gz", tmp_path / "m.nii.gz"
    nib.save(nib.Nifti1Image(scaled.astype(dtype), np.eye(4), dtype=dtype), path)  # explicit: nibabel asks for it
    nib.save(nib.Nifti1Image(mask.astype(dtype), np.eye(4), dtype=dtype), mpath)  # for 64-bit integers
    info, data = D.read_volume(path)
    assert info.shape == (SIZE,) * 3 and data.dtype == np.dtype(dtype)
    counts, _ = D.check_mask_labels(mpath, D.read_volume(mpath)[1], [1, 2])
    assert set(counts) == {0, 1, 2}


RGB = np.dtype([("R", "u1"), ("G", "u1"), ("B", "u1")])
RGBA = np.dtype([("R", "u1"), ("G", "u1"), ("B", "u1"), ("A", "u1")])


@pytest.mark.parametrize(
    "dtype, label, words",
    [
        (RGB, "RGB", "colour channels"),
        (RGBA, "RGBA", "colour channels"),
        (np.complex64, "complex64", "complex voxels"),
        (np.complex128, "complex128", "complex voxels"),
    ],
    ids=["rgb", "rgba", "complex64", "complex128"],
)
def test_rgb_and_complex_are_refused_before_any_voxel_is_read(tmp_path, monkeypatch, dtype, label, words):
    path = write_nifti(tmp_path / "x.nii.gz", np.zeros((SIZE,) * 3, dtype=dtype))
    never_read_voxels(monkeypatch)
    with pytest.raises(D.DataError) as exc:
        D.read_volume(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: datatype {label} ") and words in message and "\n" not in message


def test_unknown_datatype_code_is_one_line(tmp_path):
    """A datatype code nibabel does not know (here DT_BINARY, 1 bit per voxel) is refused, not a traceback."""
    path = write_nifti(tmp_path / "x.nii", np.zeros((SIZE,) * 3, np.uint8))
    raw = bytearray(path.read_bytes())
    raw[70:72] = np.array([1], "<i2").tobytes()  # datatype field of the NIfTI-1 header
    raw[72:74] = np.array([1], "<i2").tobytes()  # bitpix
    path.write_bytes(bytes(raw))
    with pytest.raises(D.DataError) as exc:
        D.read_volume(path)
    assert str(exc.value) == f"{path}: datatype binary (code 1) is not supported (not a real integer or float type)"


# ---- 2. declared size ------------------------------------------------------------------------------------
def lying_header(path: Path, shape=(4000, 4000, 4000), gz: bool = False) -> Path:
    """A NIfTI header claiming ``shape`` float32 followed by 1000 bytes of voxels."""
    img = nib.Nifti1Image(np.zeros((2, 2, 2), np.float32), np.eye(4))
    img.header.set_data_shape(shape)
    img.header.set_data_offset(352)
    raw = img.header.binaryblock + b"\0" * 4 + b"\1" * 1000
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.mark.parametrize("gz", [False, True], ids=["nii", "nii.gz"])
def test_header_declaring_more_than_the_file_holds(tmp_path, monkeypatch, gz):
    path = lying_header(tmp_path / ("big.nii.gz" if gz else "big.nii"), gz=gz)
    never_read_voxels(monkeypatch)
    with pytest.raises(D.DataError) as exc:
        D.read_volume(path)
    message = str(exc.value)
    assert message.startswith(
        f"{path}: truncated file or wrong header: it declares shape (4000, 4000, 4000) float32 (238.4 GiB)"
    ), message
    assert "\n" not in message


def test_ceiling_refuses_a_real_volume_over_max_volume_gb(tmp_path, monkeypatch, capsys):
    images, masks = make_dataset(tmp_path / "data", n=3, size=SIZE)
    never_read_voxels(monkeypatch)
    code, lines, err = call_main(
        ["--check_data", *args_for(tmp_path / "data", tmp_path / "run", "--max_volume_gb", "1e-6")], capsys
    )
    assert code == 2 and len(lines) == 7, err  # 3 cases × (image, mask) + the summary
    assert lines[0].startswith(
        f"error: {images / 'case_000.nii.gz'}: header declares shape (16, 16, 16) float32 "
        "(16.0 KiB), over the ceiling of 1.0 KiB per volume (max_volume_gb"
    )
    assert lines[-1] == "error: 3 of 3 cases are bad; nothing was written"


def test_multi_member_gzip_is_measured_not_refused(tmp_path):
    """ISIZE covers only the last gzip member: a valid two-member file is counted by streaming."""
    image, _ = phantom(SIZE, 1)
    good = write_nifti(tmp_path / "one.nii.gz", image)
    raw = gzip.decompress(good.read_bytes())
    two = tmp_path / "two.nii.gz"
    two.write_bytes(gzip.compress(raw[: len(raw) - 100]) + gzip.compress(raw[len(raw) - 100 :]))
    _, data = D.read_volume(two)
    np.testing.assert_array_equal(data, image)


# ---- 5. every problem at once ------------------------------------------------------------------------------
@pytest.mark.slow
def test_check_data_reports_every_bad_file_then_a_summary(tmp_path):
    """Eight cases, five broken in five ways: one line each (in case order), the count, exit 2, no traceback."""
    images, masks = make_dataset(tmp_path / "data", n=8, size=SIZE)
    write_nifti(images / "case_001.nii.gz", np.zeros((SIZE,) * 3, RGB))
    write_nifti(images / "case_002.nii.gz", phantom(SIZE, 2)[0].astype(np.complex64))
    lying_header(images / "case_004.nii.gz", gz=True)
    (masks / "case_005.nii.gz").write_bytes(b"")
    mask6 = phantom(SIZE, 6)[1]
    mask6[0, 0, 0] = 7
    write_nifti(masks / "case_006.nii.gz", mask6)
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--check_data",
            "--num_workers",
            "2",
            *args_for(tmp_path / "data", tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    expected = [
        (images / "case_001.nii.gz", "datatype RGB"),
        (images / "case_002.nii.gz", "datatype complex64"),
        (images / "case_004.nii.gz", "truncated file or wrong header"),
        (masks / "case_005.nii.gz", "empty file"),
        (masks / "case_006.nii.gz", "labels [7] are not in the configured labels"),
    ]
    assert len(lines) == len(expected) + 1, proc.stderr
    for line, (path, words) in zip(lines, expected):
        assert line.startswith(f"error: {path}: ") and words in line, line
    assert lines[-1] == "error: 5 of 8 cases are bad; nothing was written"
    assert not (tmp_path / "run").exists()


def test_workers_report_the_same_as_one_process(tmp_path):
    run = tiny(tmp_path)
    images, masks, cfg = run.images, run.masks, run.cfg
    (images / "case_003.nii.gz").write_bytes(b"garbage")
    cases = D.discover(cfg)
    outcomes = []
    for workers in (0, 2):
        with pytest.raises(D.DataProblems) as exc:
            D.validate(cases, cfg, workers=workers)
        outcomes.append((exc.value.errors, exc.value.summary))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == "1 of 6 cases are bad" and outcomes[0][0][0].startswith(f"{images / 'case_003.nii.gz'}: ")
    (images / "case_003.nii.gz").unlink()
    (masks / "case_003.nii.gz").unlink()
    cases = D.discover(cfg)
    assert D.validate(cases, cfg, workers=0) == D.validate(cases, cfg, workers=2)


def test_every_unpaired_file_is_reported(tmp_path):
    run = tiny(tmp_path, n=4)
    images, masks = run.images, run.masks
    (masks / "case_001.nii.gz").unlink()
    (images / "case_003.nii.gz").unlink()
    with pytest.raises(D.DataProblems) as exc:
        D.discover(run.cfg)
    assert exc.value.errors == [
        f"{images / 'case_001.nii.gz'}: image without mask (no case 'case_001' in {masks})",
        f"{masks / 'case_003.nii.gz'}: mask without image (no case 'case_003' in {images})",
    ]


# ---- 3. one run per folder -------------------------------------------------------------------------------
HOLD = textwrap.dedent("""
    import sys, time
    from diffusion3d import storage
    lock = storage.lock_folder(sys.argv[1], "run")
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
def test_second_run_on_a_folder_stops_and_a_killed_holder_leaves_no_stale_lock(run_copy, capsys):
    data, run = run_copy
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4"), capsys)
        assert code == 2, err
        assert lines == [
            f"error: {run}: in use by another run (pid {holder.pid}); wait for it to end or use another folder"
        ]
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing written, nothing removed
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (run / ".lock").exists()  # the killed holder's file stays; its lock went with the process
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4"), capsys)
    assert code == 0 and not lines, err
    assert ckpt.load(run / "checkpoints" / "step_00000004.pt")["step"] == 4
    assert not (run / ".lock").exists()  # a clean end removes it


def test_lock_is_exclusive_within_one_process_too(tmp_path):
    with storage.lock_folder(tmp_path / "out", "sampling run"):
        with pytest.raises(storage.FolderLockedError, match=rf"in use by another sampling run \(pid {os.getpid()}\)"):
            storage.lock_folder(tmp_path / "out", "sampling run")
    storage.lock_folder(tmp_path / "out").release()  # free again once released


def test_sample_and_evaluate_refuse_an_output_folder_in_use(trained, tmp_path, capsys):
    from diffusion3d.commands import evaluate, sample

    out = tmp_path / "out"
    with storage.lock_folder(out, "sampling run"):
        with pytest.raises(SystemExit) as exc:
            sample.main(
                [
                    "--checkpoint",
                    str(trained / "run"),
                    "--masks",
                    str(trained / "data" / "masks"),
                    "--out",
                    str(out),
                    "--quiet",
                    "--steps",
                    "1",
                ]
            )
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert err.strip().splitlines() == [
            f"error: {out}: in use by another sampling run (pid {os.getpid()}); "
            "wait for it to end or use another folder"
        ]
        samples = tmp_path / "samples"
        samples.mkdir()
        shutil.copy(trained / "data" / "images" / "case_000.nii.gz", samples / "case_000_sample0.nii.gz")
        with pytest.raises(SystemExit) as exc:
            evaluate.main(["--samples", str(samples), "--images", str(trained / "data" / "images"), "--out", str(out)])
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {out}: in use by another")
    assert sorted(p.name for p in out.iterdir()) == []  # nothing written by either


def test_an_output_path_that_is_a_file_is_refused_in_one_line(trained, tmp_path, capsys):
    """train's results_dir, sample's and evaluate's --out: a file standing there is bad input (exit 2, one
    line), not a fault; it used to be exit 1 with "cannot write the folder's lock file: File exists"."""
    from diffusion3d.commands import evaluate, sample
    from diffusion3d.commands import train as cli

    taken = tmp_path / "taken"
    taken.write_text("a user's file")
    runs = {
        "train": lambda: cli.main(args_for(trained / "data", taken, "--train_num_steps", "1")),
        "sample": lambda: sample.main(
            [
                "--checkpoint",
                str(trained / "run"),
                "--masks",
                str(trained / "data" / "masks"),
                "--out",
                str(taken),
                "--quiet",
                "--steps",
                "1",
            ]
        ),
        "evaluate": lambda: evaluate.main(
            [
                "--samples",
                str(trained / "data" / "images"),
                "--images",
                str(trained / "data" / "images"),
                "--out",
                str(taken),
            ]
        ),
    }
    for name, run in runs.items():
        with pytest.raises(SystemExit) as exc:
            run()
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2, (name, err)
        assert err[-1] == f"error: {taken}: exists and is not a folder", (name, err)
    assert taken.read_text() == "a user's file"


# ---- 4. storage failures ---------------------------------------------------------------------------------
class FailingFile:
    """A real file whose writes fail with ``err`` once ``after`` bytes went through."""

    def __init__(self, f, err: int, after: int = 0) -> None:
        self._f, self._err, self._left = f, err, after

    def write(self, data) -> int:
        if len(data) > self._left:
            raise OSError(self._err, os.strerror(self._err))
        self._left -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def fail_checkpoint_writes(monkeypatch, err: int, name: str = "step_00000004", after: int = 4096) -> None:
    def fake_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return FailingFile(f, err, after) if name in str(path) else f

    monkeypatch.setattr(ckpt, "open", fake_open, raising=False)


def test_disk_full_during_a_checkpoint_then_the_same_command_resumes(run_copy, monkeypatch, capsys):
    data, run = run_copy
    folder = run / "checkpoints"
    good = (folder / "step_00000002.pt").read_bytes()
    argv = args_for(data, run, "--train_num_steps", "4")
    fail_checkpoint_writes(monkeypatch, errno.ENOSPC)
    code, lines, err = call_main(argv, capsys)
    assert code == 1, err
    assert lines == [
        f"error: {folder / 'step_00000004.pt'}: cannot write checkpoint: No space left on device "
        "(ENOSPC); free some space and run the same command again"
    ]
    assert "Traceback" not in err
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002.pt"]  # no temp file, nothing half-written
    assert (folder / "step_00000002.pt").read_bytes() == good
    monkeypatch.undo()  # space is back
    code, lines, err = call_main(argv, capsys)
    assert code == 0 and not lines, err
    assert ckpt.load(folder / "step_00000004.pt")["step"] == 4
    assert no_temp_files(run)


@pytest.mark.parametrize(
    "where, err, words",
    [
        ("write", errno.EIO, "Input/output error (EIO)"),
        ("fsync", errno.EIO, "Input/output error (EIO)"),
        ("open", errno.EROFS, "Read-only file system (EROFS)"),
        ("open", errno.EACCES, "Permission denied (EACCES)"),
        ("replace", errno.ENOSPC, "No space left on device (ENOSPC)"),
    ],
)
def test_os_errors_while_saving_leave_the_old_checkpoint_and_no_temp(tmp_path, monkeypatch, where, err, words):
    path = tmp_path / "checkpoints" / ckpt.checkpoint_name(1)
    ckpt.save_atomic({"x": torch.zeros(1000)}, path)
    original = path.read_bytes()
    new = tmp_path / "checkpoints" / ckpt.checkpoint_name(2)

    def boom(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    if where == "write":
        fail_checkpoint_writes(monkeypatch, err, name="step_00000002", after=100)
    elif where == "fsync":
        monkeypatch.setattr(storage.os, "fsync", boom)
    elif where == "open":
        monkeypatch.setattr(ckpt, "open", boom, raising=False)
    else:
        monkeypatch.setattr(storage.os, "replace", boom)
    with pytest.raises(storage.StorageError) as exc:
        ckpt.save_atomic({"x": torch.ones(1000)}, new)
    assert str(exc.value).startswith(f"{new}: cannot write checkpoint: {words}")
    assert exc.value.errno == err
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name] and path.read_bytes() == original


def test_a_save_that_cannot_fit_is_not_started(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / ckpt.checkpoint_name(1)
    path.parent.mkdir()
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 2**19, 2**19))
    opened = []
    monkeypatch.setattr(ckpt, "open", lambda *a, **k: opened.append(a), raising=False)
    with pytest.raises(storage.StorageError) as exc:
        ckpt.save_atomic({"x": torch.zeros(2**20)}, path)  # 4 MiB of tensors, 0.5 MiB free
    assert str(exc.value) == (
        f"{path.parent}: not enough free space for checkpoint {path.name}: needs about 5.2 MiB, "
        "0.5 MiB free; free some space and run the same command again"
    )
    assert exc.value.errno == errno.ENOSPC and not opened and not list(path.parent.iterdir())


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into read-only folders; the EROFS/EACCES cases above inject it"
)
def test_read_only_results_folder_for_real(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(storage.StorageError, match="Permission denied"):
            ckpt.save_atomic({"x": torch.zeros(3)}, folder / ckpt.checkpoint_name(1))
    finally:
        folder.chmod(0o700)


def test_disk_full_while_writing_events(run_copy, monkeypatch, capsys):
    from tensorboard.summary.writer import record_writer

    data, run = run_copy

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4"), capsys)
    assert code == 1, err
    assert len(lines) == 1 and lines[0].startswith(f"error: {run / 'tb'}/events.out.tfevents."), lines
    assert lines[0].endswith(
        ": cannot write TensorBoard events: No space left on device (ENOSPC); "
        "free some space and run the same command again"
    )
    assert ckpt.load_latest_valid(run / "checkpoints")[1]["step"] == 2  # the good checkpoint is untouched
    monkeypatch.undo()
    assert call_main(args_for(data, run, "--train_num_steps", "4"), capsys)[0] == 0


def test_disk_full_while_writing_the_config(run_copy, monkeypatch, capsys):
    data, run = run_copy
    original = (run / "config.yaml").read_text()
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if "config.yaml" in self.name:
            real(self, "tr")  # a partial write, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4"), capsys)
    assert code == 1, err
    assert lines == [
        f"error: {run / 'config.yaml'}: cannot write the resolved config: No space left on device "
        "(ENOSPC); free some space and run the same command again"
    ]
    assert (run / "config.yaml").read_text() == original and no_temp_files(run)


def test_disk_full_while_writing_samples(trained, tmp_path, monkeypatch, capsys):
    from diffusion3d.commands import sample

    out = tmp_path / "out"
    real_save = nib.save

    def save(img, filename):
        real_save(img, filename)  # the file exists, partly, when the disk fills up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(nib, "save", save)
    with pytest.raises(SystemExit) as exc:
        sample.main(
            [
                "--checkpoint",
                str(trained / "run"),
                "--masks",
                str(trained / "data" / "masks" / "case_000.nii.gz"),
                "--out",
                str(out),
                "--quiet",
                "--steps",
                "1",
            ]
        )
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert err.strip().splitlines() == [
        f"error: {out / 'case_000_sample0.nii.gz'}: cannot write the NIfTI file: "
        "No space left on device (ENOSPC); free some space and run the same command again"
    ]
    assert sorted(p.name for p in out.iterdir()) == []  # no temp file, no partial sample


# ---- 6. kills and damaged files ----------------------------------------------------------------------------
KILL_DURING_SAVE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from diffusion3d import checkpoint as ckpt
    folder = Path(sys.argv[1])
    state = ckpt.load(folder / "step_00000002.pt")
    state["step"] = 4
    real_open = open

    class Slow:
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, data):
            self.n += 1
            if self.n == 3:
                self.f.flush()
                print("writing", flush=True)
                time.sleep(120)
            return self.f.write(data)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()

    ckpt.open = lambda path, mode="r": Slow(real_open(path, mode))
    ckpt.save_atomic(state, folder / "step_00000004.pt")
""")


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write(run_copy, capsys):
    """The writer is SIGKILLed mid-file: its temp file is never taken for a checkpoint, the newest valid
    one is resumed from, and the next run (holding the lock) removes the orphan."""
    data, run = run_copy
    folder = run / "checkpoints"
    writer = subprocess.Popen(
        [sys.executable, "-c", KILL_DURING_SAVE, str(folder)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    temps = [p for p in folder.iterdir() if ".tmp." in p.name]
    assert len(temps) == 1 and temps[0].stat().st_size > 0
    assert [p.name for _, p in ckpt.list_checkpoints(folder)] == ["step_00000002.pt"]
    path, state = ckpt.load_latest_valid(folder)
    assert path.name == "step_00000002.pt" and state["step"] == 2
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4"), capsys)
    assert code == 0 and not lines, err
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002.pt", "step_00000004.pt"]


def test_truncated_events_file_does_not_stop_a_resume(run_copy, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, run = run_copy
    events = max((run / "tb").glob("events.out.tfevents.*"), key=lambda f: f.stat().st_size)  # the scalars' file
    raw = events.read_bytes()
    events.write_bytes(raw[: len(raw) * 2 // 3])  # cut mid-record, as a crash during a flush leaves it
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4", "--log_every", "1"), capsys)
    assert code == 0 and not lines, err
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert {e.step for e in acc.Scalars("train/loss")} >= {3, 4}  # the resumed steps are logged and readable
    assert events.read_bytes() == raw[: len(raw) * 2 // 3]  # the old file is left as it was, not rewritten


def test_checkpoint_with_good_tensors_but_a_garbage_config(run_copy, capsys):
    data, run = run_copy
    folder = run / "checkpoints"
    state = torch.load(folder / "step_00000002.pt", weights_only=True)
    bad_configs = {3: "garbage", 4: {"model": {"channels": "many"}}, 5: {"model": 7}}
    for step, config in bad_configs.items():
        torch.save({**state, "step": step, "config": config}, folder / ckpt.checkpoint_name(step))
    for step in bad_configs:
        with pytest.raises(ckpt.CheckpointError, match="the checkpoint's config section is unusable"):
            ckpt.load(folder / ckpt.checkpoint_name(step))
    bad = folder / ckpt.checkpoint_name(5)
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "4", "--resume", str(bad)), capsys)
    assert (
        code == 2
        and len(lines) == 1
        and lines[0].startswith(f"error: {bad}: the checkpoint's config section is unusable")
    )

    from diffusion3d.commands import sample

    with pytest.raises(SystemExit) as exc:
        sample.main(["--checkpoint", str(bad), "--masks", str(data / "masks"), "--out", str(run.parent / "s")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {bad}: the checkpoint's config section")
    # resume auto skips the three garbage files and continues from the newest valid one (step 2)
    code, lines, err = call_main(args_for(data, run, "--train_num_steps", "6"), capsys)
    assert code == 0 and not lines, err
    assert ckpt.load(folder / "step_00000006.pt")["samples_seen"] == 12  # 2 + 4 steps of batch 2 from step 2
