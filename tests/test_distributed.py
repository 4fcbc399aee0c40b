"""DDP through torchrun, on CPU with gloo and 2 processes.

The multi-process tests launch this very file with ``python -m torch.distributed.run`` (the real
launcher, so setup() reads real torchrun variables); the ``__main__`` block at the bottom is the worker
(``subprocess_env`` puts the repository on its PYTHONPATH, so it imports ``tests.helpers`` too).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion3d import checkpoint as ckpt
from diffusion3d import distributed
from diffusion3d.data import build_dataset, discover, split_cases
from diffusion3d.trainer import Trainer
from tests.helpers import ROOT, TORCHRUN_VARIABLES, subprocess_env, tiny, tiny_config

WORLD, ACCUM, STEPS = 2, 2, 3  # 2 processes × batch 1 × accum 2  ==  1 process × batch 1 × accum 4
TOLERANCE = 1e-5  # max |Δw| relative to the tensor's largest |w|
HANG_GUARD_S = 240  # generous: a job that is still running after this is hung, not slow
FAIL_MESSAGE = "rank one cannot read case_003.nii.gz"


# ---- helpers shared by the parent (pytest) and the torchrun workers ---------------------------------
def _record_and_train(trainer: Trainer) -> dict:
    """Train to train_num_steps, recording each step's reported loss and each micro-batch's local losses."""
    steps, local, ids, grads = [], [], [], []
    loss_fn, step_fn, optimizer_step_fn = trainer.diffusion.loss, trainer.train_step, trainer.optimizer.step

    def loss(model, x0, cond, sample_ids, autocast):
        out = loss_fn(model, x0, cond, sample_ids, autocast)
        local.append(out.detach().clone())
        ids.append(list(sample_ids))
        return out

    def step():
        result = step_fn()
        steps.append(result.loss)
        return result

    def optimizer_step(*args, **kwargs):  # the first step's gradient: all-reduced and clipped, before Adam
        if not grads:
            grads.append({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
        return optimizer_step_fn(*args, **kwargs)

    trainer.diffusion.loss, trainer.train_step, trainer.optimizer.step = loss, step, optimizer_step
    status = trainer.train()
    return {
        "status": status,
        "step_losses": steps,
        "local_losses": torch.cat(local),
        "ids": ids,
        "samples_seen": trainer.stream.samples_seen,
        "first_grad": grads[0] if grads else None,
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "ema": {k: v.detach().clone() for k, v in trainer.ema.module.state_dict().items()},
    }


def _data(cfg):
    train_cases, val_cases = split_cases(discover(cfg), cfg.data.num_val_cases)
    return build_dataset(train_cases, cfg), val_cases


def _torchrun(mode: str, job: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        __file__,
        mode,
        str(job),
    ]
    # own session: on a hang the whole tree (torchrun and its workers) is stopped by its group id
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=subprocess_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} did not end within {HANG_GUARD_S} s (hang):\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _relative_difference(got: dict, want: dict) -> float:
    """max |got - want| over all tensors, relative to the largest |want| of the model (its weight scale).

    Per tensor would be the wrong yardstick: zero-initialised convolutions consist of a few Adam steps of
    ±lr, and Adam's normalisation turns rounding differences of their tiny gradients into visible ones.
    """
    assert got.keys() == want.keys()
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[k] - w).abs().max().item() for k, w in want.items()) / scale


def _assert_close(got: dict, want: dict, what: str) -> None:
    diff = _relative_difference(got, want)
    assert diff <= TOLERANCE, f"{what}: max difference {diff:.2e} of the scale"


# ---- single process: no process group, helpers are identities --------------------------------------
@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_single_process_setup_creates_no_group(no_torchrun_env):
    info = distributed.setup("cpu")
    assert info == distributed.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    assert not torch.distributed.is_initialized()
    decision = {"resume": "runs/x/checkpoints/step_00000002.pt"}
    assert distributed.broadcast_object(decision) is decision
    distributed.barrier()  # no group: must not block or raise
    with pytest.raises(RuntimeError, match="boom"), distributed.fail_fast():
        raise RuntimeError("boom")  # one process: the exception reaches the command line unchanged
    with pytest.raises(SystemExit) as stop:
        distributed.end_process(3)  # one process: a plain sys.exit with the command line's code
    assert stop.value.code == 3


def test_world_size_one_is_single_process(no_torchrun_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert distributed.setup("cpu").world_size == 1
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, r"RANK=2 is outside 0\.\.1"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
    ],
)
def test_setup_names_the_bad_environment(no_torchrun_env, monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        distributed.setup("cpu")
    assert not torch.distributed.is_initialized()


def test_device_per_rank(monkeypatch):
    """Under torchrun each process takes cuda:LOCAL_RANK; a fixed other index or a missing GPU is refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.resolve_device("auto", 1, 2) == torch.device("cuda", 1)
    assert distributed.resolve_device("cuda", 1, 4) == torch.device("cuda", 1)
    assert distributed.resolve_device("cuda:1", 0, 1) == torch.device("cuda", 1)  # one process: as asked
    assert distributed.resolve_device("cpu", 1, 2) == torch.device("cpu")
    with pytest.raises(ValueError, match="cuda:LOCAL_RANK"):
        distributed.resolve_device("cuda:0", 1, 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but only 2"):
        distributed.resolve_device("cuda", 3, 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        distributed.resolve_device("cuda", 0, 2)


# ---- torchrun's error file: written so that torchrun never reads it torn ------------------------------
class _Exited(BaseException):
    """Stands in for os._exit, so abort() returns to the test instead of ending pytest."""


def _abort(exc: Exception, monkeypatch, tracer=None) -> None:
    """abort(exc) as fail_fast calls it (inside the except block), with ``tracer`` on for its duration."""

    def fake_exit(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    previous = sys.gettrace()
    try:
        raise exc
    except Exception as e:
        sys.settrace(tracer)
        try:
            distributed.abort(e)
        except _Exited:
            pass
        finally:
            sys.settrace(previous)


def _torchrun_reads(path: Path) -> dict:
    """The error file as torchrun's agent reads a failed rank's (it raises on a torn file and dies)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path)).error_file_data


def test_error_file_is_never_seen_incomplete_while_it_is_written(tmp_path, monkeypatch):
    """torchrun reads the error file of a rank it has just SIGTERMed, which can be mid-write.

    Deterministic version of that race: the agent reads the file after every line the writer executes
    (sys.settrace), i.e. at every point where a SIGTERM could end the rank. Each read must find no file
    or the complete report; torch's ErrorHandler.record_exception leaves the file empty after its open().
    """
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    reads, torn = 0, []

    def agent_reads(frame, event, arg):
        nonlocal reads
        if event == "line":
            reads += 1
            try:
                _torchrun_reads(path)
            except Exception as e:  # what crashed torchrun's own report in CI
                torn.append(f"{type(e).__name__}: {e}")
        return agent_reads

    _abort(RuntimeError(FAIL_MESSAGE), monkeypatch, agent_reads)
    assert reads > 0
    assert not torn, f"torchrun read a torn error file {len(torn)} times, first: {torn[0]}"
    # the same JSON as record_exception: torchrun's summary shows the rank's message and traceback
    data = _torchrun_reads(path)
    assert data["message"]["message"] == f"RuntimeError: {FAIL_MESSAGE}"
    assert FAIL_MESSAGE in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_two_failures_writing_at_once_leave_a_well_formed_error_file(tmp_path, monkeypatch):
    """A second failure reported while the first is mid-write: the file holds one whole report.

    The second report is longer, so torch's open-truncate-write would leave the first report's bytes
    followed by the second's tail (JSONDecodeError "Extra data").
    """
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    second = RuntimeError(f"rank zero also failed, and with a much longer message: {'x' * 200}")
    started = False

    def second_failure_mid_write(frame, event, arg):
        nonlocal started
        # the first line the first writer runs inside json (serialising/writing its report)
        if event == "line" and not started and os.sep + "json" + os.sep in frame.f_code.co_filename:
            started = True
            _abort(second, monkeypatch)
        return second_failure_mid_write

    _abort(RuntimeError(FAIL_MESSAGE), monkeypatch, second_failure_mid_write)
    assert started
    message = _torchrun_reads(path)["message"]["message"]
    assert message in (f"RuntimeError: {FAIL_MESSAGE}", f"RuntimeError: {second}")
    assert sorted(tmp_path.iterdir()) == [path]


def test_no_error_file_without_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    _abort(RuntimeError(FAIL_MESSAGE), monkeypatch)
    assert list(tmp_path.iterdir()) == []


# ---- 2 processes under torchrun ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "space, optimizer",
    [("pixel", "adamw"), ("wavelet", "adamw"), ("pixel", "muon"), ("wavelet", "muon")],
    ids=["pixel", "wavelet", "muon", "wavelet_muon"],
)
def test_two_processes_match_one_process_with_twice_the_accumulation(tmp_path, space, optimizer):
    """2 ranks × batch 1 × accum 2 == 1 process × batch 1 × accum 4, step by step; rank 0 alone writes;
    a checkpoint moves between 1 and 2 processes in both directions. In pixel and in wavelet space, and with
    Muon (each rank orthogonalises the same all-reduced momentum)."""
    base = tiny_config(
        tmp_path,
        space=space,
        optimizer=optimizer,
        batch_size=1,
        train_num_steps=STEPS,
        save_every=1,
        keep_last=STEPS,
        sample_every=100,
        num_samples=1,
        num_val_cases=1,
        max_grad_norm=1.0,
    )
    ref_cfg = copy.deepcopy(base)
    ref_cfg.train.gradient_accumulate_every = ACCUM * WORLD
    ddp_cfg = copy.deepcopy(base)
    ddp_cfg.train.gradient_accumulate_every = ACCUM

    dataset, _ = _data(ref_cfg)
    ref_trainer = Trainer(ref_cfg, dataset, "cpu", tmp_path / "ref", [])
    init = {k: v.detach().clone() for k, v in ref_trainer.model.state_dict().items()}
    ref = _record_and_train(ref_trainer)
    ref_step2 = tmp_path / "ref" / "checkpoints" / ckpt.checkpoint_name(2)

    job = tmp_path / "job"
    job.mkdir()
    (job / "spec.pkl").write_bytes(pickle.dumps({"cfg": ddp_cfg, "resume_from": str(ref_step2)}))
    proc = _torchrun("train", job)
    assert proc.returncode == 0, proc.stdout[-4000:]
    r0, r1 = (torch.load(job / f"result{r}.pt", weights_only=False) for r in range(WORLD))

    for r in (r0, r1):
        fresh = r["fresh"]
        assert fresh["status"] == "finished"
        # the stream position is global: 3 steps × 1 × 2 × 2 processes
        assert fresh["samples_seen"] == ref["samples_seen"] == STEPS * ACCUM * WORLD
        # the reported loss is the mean over both processes, identical on both
        assert fresh["step_losses"] == r0["fresh"]["step_losses"]
        assert fresh["step_losses"] == pytest.approx(ref["step_losses"], rel=1e-5)
        assert r["received_path"] == str(ref_step2)  # rank 0's resume decision reached every rank
    # the ranks see disjoint halves of each step's samples, and together the single process's samples
    per_step = ACCUM * WORLD
    for s in range(STEPS):
        mine = [i for micro in r0["fresh"]["ids"][s * ACCUM : (s + 1) * ACCUM] for i in micro]
        theirs = [i for micro in r1["fresh"]["ids"][s * ACCUM : (s + 1) * ACCUM] for i in micro]
        assert mine == [s * per_step + 0, s * per_step + 2] and theirs == [s * per_step + 1, s * per_step + 3]
        local0 = r0["fresh"]["local_losses"][s * ACCUM : (s + 1) * ACCUM].mean().item()
        local1 = r1["fresh"]["local_losses"][s * ACCUM : (s + 1) * ACCUM].mean().item()
        assert local0 != pytest.approx(local1, rel=1e-3)  # the mean below is not a trivial one
        assert r0["fresh"]["step_losses"][s] == pytest.approx((local0 + local1) / 2, rel=1e-6)

    # DDP keeps the replicas bitwise equal; they match the single process within float tolerance
    for name in r0["fresh"]["model"]:
        assert torch.equal(r0["fresh"]["model"][name], r1["fresh"]["model"][name]), name
    assert _relative_difference(init, ref["model"]) > 100 * TOLERANCE  # training moved them far beyond it
    # same weights before step 1, so its gradient differs by rounding only (sum order of 4 samples)
    _assert_close(r0["fresh"]["first_grad"], ref["first_grad"], "first-step gradient, 2 processes vs 1")
    _assert_close(r0["fresh"]["model"], ref["model"], "2 processes vs 1")
    _assert_close(r0["fresh"]["ema"], ref["ema"], "EMA, 2 processes vs 1")

    # only rank 0 wrote: checkpoints, TensorBoard, samples; rank 1's results folder was never created
    rank0, rank1 = job / "rank0", job / "rank1"
    assert [p.name for _, p in ckpt.list_checkpoints(rank0 / "checkpoints")] == [
        ckpt.checkpoint_name(s) for s in range(1, STEPS + 1)
    ]
    events = list((rank0 / "tb").glob("events.out.tfevents.*"))  # name: …tfevents.<time>.<host>.<pid>.<n>
    assert events and len({p.name.split(".")[-2] for p in events}) == 1, events  # one writing process
    assert list((rank0 / "samples").rglob("*_sample0.nii.gz"))
    assert not rank1.exists(), sorted(str(p) for p in rank1.rglob("*"))

    # 1 process → 2 processes: resumed from the single-process step-2 checkpoint, one more step
    assert r0["resumed"]["samples_seen"] == STEPS * ACCUM * WORLD
    _assert_close(r0["resumed"]["model"], ref["model"], "resumed 1 → 2 processes")

    # 2 processes → 1 process: the DDP checkpoint has plain keys and the global stream position
    state = ckpt.load(rank0 / "checkpoints" / ckpt.checkpoint_name(2))
    assert state["samples_seen"] == 2 * ACCUM * WORLD and state["model"].keys() == ref["model"].keys()
    single = Trainer(ref_cfg, dataset, "cpu", None, [])
    single.load_state_dict(state)
    resumed = _record_and_train(single)
    assert resumed["samples_seen"] == ref["samples_seen"]
    _assert_close(resumed["model"], ref["model"], "resumed 2 → 1 process")


@pytest.mark.slow
def test_exception_on_one_rank_ends_the_job_with_its_message(tmp_path):
    """Rank 1 raises while rank 0 waits in a barrier: the job exits non-zero with rank 1's message."""
    proc = _torchrun("fail", tmp_path)
    assert proc.returncode != 0
    assert "rank 1/2 on" in proc.stdout and FAIL_MESSAGE in proc.stdout, proc.stdout[-4000:]
    # torchrun's own failure summary carries rank 1's message, read from the error file fail_fast wrote
    # (which rank it calls "Root Cause" is decided by whole-second timestamps, so it is not asserted)
    summary = proc.stdout[proc.stdout.find("ChildFailedError") :]
    assert "ChildFailedError" in proc.stdout and FAIL_MESSAGE in summary, proc.stdout[-4000:]
    assert not (tmp_path / "rank0_passed_barrier").exists()


@pytest.mark.slow
def test_both_ranks_failing_at_once_end_the_job_with_a_message(tmp_path):
    """Both ranks raise together: torchrun SIGTERMs whichever is still writing and reads its error file."""
    proc = _torchrun("fail_both", tmp_path)
    assert proc.returncode != 0
    assert "JSONDecodeError" not in proc.stdout, proc.stdout[-4000:]  # torchrun's own report did not crash
    summary = proc.stdout[proc.stdout.find("ChildFailedError") :]
    assert "ChildFailedError" in proc.stdout and FAIL_MESSAGE in summary, proc.stdout[-4000:]


@pytest.mark.slow
def test_train_py_under_torchrun_then_resumed_in_one_process(tmp_path):
    """The command line itself under torchrun: rank 0 alone writes; a plain run resumes at the global position."""
    tiny_run = tiny(tmp_path, sampling_steps=2, batch_size=1)
    run, flags, env = tiny_run.results, tiny_run.flags, subprocess_env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        "train.py",
        *flags,
        "--accum",
        "1",
        "--train_num_steps",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("# diffusion3d resolved config") == 1  # rank 0 narrates
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) >= 1
    state = ckpt.load(run / "checkpoints" / "step_00000002.pt")
    assert state["samples_seen"] == 2 * WORLD  # 2 steps × batch 1 × accum 1 × 2 processes

    single = subprocess.run(
        [sys.executable, "train.py", *flags, "--accum", "2", "--train_num_steps", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert single.returncode == 0, single.stderr[-3000:]
    assert "resumed from" in single.stderr and "at step 2 (4 samples seen)" in single.stderr
    assert ckpt.load(run / "checkpoints" / "step_00000003.pt")["samples_seen"] == 6


@pytest.mark.slow
def test_batch_size_auto_under_torchrun_writes_a_checkpoint_that_samples(tmp_path):
    """effective_batch is global: 2 processes plan batch_size × accum = effective_batch / 2, and the
    checkpoint they write (batch_size 1, accum 2, effective_batch 4) loads for sampling (it used to be
    refused for not being batch_size × accum)."""
    tiny_run = tiny(tmp_path, batch_size="auto", effective_batch=4, max_batch=1, train_num_steps=1, save_every=1)
    run, masks, env = tiny_run.results, tiny_run.masks, subprocess_env()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        "train.py",
        *tiny_run.flags,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    state = ckpt.load(run / "checkpoints" / "step_00000001.pt")
    train = state["config"]["train"]
    assert (train["batch_size"], train["gradient_accumulate_every"], train["effective_batch"]) == (1, 2, 4)
    assert state["samples_seen"] == 4  # one step of the global effective batch

    out = tmp_path / "samples"
    sample = subprocess.run(
        [
            sys.executable,
            "-m",
            "diffusion3d",
            "sample",
            "--checkpoint",
            str(run),
            "--masks",
            str(masks / "case_000.nii.gz"),
            "--out",
            str(out),
            "--steps",
            "2",
            "--device",
            "cpu",
            "--quiet",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert sample.returncode == 0, sample.stderr[-3000:]
    assert (out / "case_000_sample0.nii.gz").is_file()


# ---- torchrun worker ---------------------------------------------------------------------------------
def _worker_train(job: Path) -> None:
    info = distributed.setup("cpu")
    with distributed.fail_fast():
        spec = pickle.loads((job / "spec.pkl").read_bytes())
        cfg = spec["cfg"]
        dataset, val_cases = _data(cfg)
        out = {}
        trainer = Trainer(cfg, dataset, info.device, job / f"rank{info.rank}", val_cases, info.rank, info.world_size)
        out["fresh"] = _record_and_train(trainer)
        # the command line's resume pattern: rank 0 decides, every rank loads that file
        path = distributed.broadcast_object(spec["resume_from"] if info.is_main else None)
        out["received_path"] = path
        resumed = Trainer(cfg, dataset, info.device, None, [], info.rank, info.world_size)
        resumed.load_state_dict(ckpt.load(Path(path)))
        out["resumed"] = _record_and_train(resumed)
        torch.save(out, job / f"result{info.rank}.pt")
        distributed.barrier()
    distributed.cleanup()


def _worker_fail(job: Path) -> None:
    info = distributed.setup("cpu")
    with distributed.fail_fast():
        if info.rank == 1:
            raise RuntimeError(FAIL_MESSAGE)
        distributed.barrier()  # waits for a rank that will never arrive
        (job / "rank0_passed_barrier").touch()
    distributed.cleanup()


def _worker_fail_both(job: Path) -> None:
    distributed.setup("cpu")
    with distributed.fail_fast():
        distributed.barrier()  # leave together, so that both failures race torchrun's read of the files
        raise RuntimeError(FAIL_MESSAGE)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    {"train": _worker_train, "fail": _worker_fail, "fail_both": _worker_fail_both}[sys.argv[1]](Path(sys.argv[2]))
