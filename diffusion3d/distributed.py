"""torchrun / DistributedDataParallel set-up and the few collectives the command line needs.

``torchrun --nproc_per_node N train.py ...`` starts N copies of train.py with RANK, WORLD_SIZE and
LOCAL_RANK (and MASTER_ADDR/PORT) in their environment; :func:`setup` reads them and joins the process
group (NCCL on CUDA, gloo otherwise). Without those variables, or with WORLD_SIZE=1, it is a plain
single process and no process group is created, so ``python train.py`` runs unchanged.

Failure behaviour (why :func:`fail_fast` exists): a rank that raises while the others wait in a
collective must *leave*, not tidy up. A normal interpreter exit may call ``destroy_process_group`` or
NCCL destructors that block on the very peers that wait for it, and then nothing ever ends. So on an
exception in a multi-process job :func:`fail_fast` logs it with the rank, writes it to torchrun's error
file (``TORCHELASTIC_ERROR_FILE``, shown by torchrun as the root cause) and ends the process at once with
``os._exit``. torchrun sees a worker exit non-zero and stops the other workers of the job (SIGTERM, then
SIGKILL after 30 s), so the whole job ends with that rank's message. The process-group ``timeout`` is
the back-stop for a rank that hangs without exiting: a collective that waits longer than it aborts
(NCCL: the watchdog crashes the process; gloo: the collective raises). It must be longer than the
longest thing rank 0 does alone between two steps (a checkpoint, validation sampling).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# torch's own default for gloo; NCCL's is 10 min. Rank 0 sampling 128³ volumes alone can take minutes.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment: {name} is not set (launch several processes with torchrun)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment: {name}={raw!r} is not an integer") from None


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it; 1 when absent."""
    return _env_int("WORLD_SIZE", 1)


def _launched_multi() -> bool:
    """True in a multi-process job, also before setup() or when it failed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    try:
        return env_world_size() > 1
    except ValueError:
        return False


def resolve_device(request: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of this process: ``auto``/``cpu``/``cuda``/``cuda:N``; under torchrun ``cuda:LOCAL_RANK``."""
    if request == "auto":
        request = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(request)
    except RuntimeError:
        raise ValueError(f"device: {request!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device: {request!r} asked for, but CUDA is not available")
    if world_size == 1:
        return device
    # One GPU per process, chosen by torchrun's LOCAL_RANK; a fixed index would put every rank on it.
    if device.index is not None and device.index != local_rank:
        raise ValueError(
            f"device: {request!r} cannot be used with {world_size} processes; each process uses cuda:LOCAL_RANK. "
            "Use --device cuda (or auto) and choose GPUs with CUDA_VISIBLE_DEVICES"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"environment: LOCAL_RANK={local_rank} but only {count} CUDA device(s) are visible (lower --nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


def _info_from_group(device_request: str) -> DistInfo:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = _env_int("LOCAL_RANK", rank)
    return DistInfo(rank, world, local_rank, resolve_device(device_request, local_rank, world), rank == 0)


def setup(device_request: str = "auto", timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> DistInfo:
    """Read torchrun's environment, pick this process's device and join the process group when N > 1.

    Raises ValueError (naming the variable or the device) for an environment that cannot work.
    Calling it again in a process that already joined returns the same answer.
    """
    if dist.is_available() and dist.is_initialized():
        return _info_from_group(device_request)
    world = env_world_size()
    if world < 1:
        raise ValueError(f"environment: WORLD_SIZE={world} must be at least 1")
    if world == 1:
        return DistInfo(0, 1, 0, resolve_device(device_request), True)
    rank = _env_int("RANK", None)
    local_rank = _env_int("LOCAL_RANK", None)
    if not 0 <= rank < world:
        raise ValueError(f"environment: RANK={rank} is outside 0..{world - 1}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"environment: WORLD_SIZE={world} but {name} is not set (launch with torchrun)")
    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed; run in one process")
    device = resolve_device(device_request, local_rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and every bare .to("cuda") of this process use its own GPU
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    log.info(
        "rank %d of %d (local rank %d on %s) on %s, backend %s",
        rank,
        world,
        local_rank,
        socket.gethostname(),
        device,
        dist.get_backend(),
    )
    return DistInfo(rank, world, local_rank, device, rank == 0)


def is_multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def cleanup() -> None:
    """Leave the process group (after a normal end only; see fail_fast for the failing case)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank, e.g. until rank 0 has prepared the results folder. No-op in one process."""
    if is_multi_process():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (e.g. the resume decision); identity in one process.

    For small objects only: it is pickled and sent whole. Checkpoint *paths* go through here, not states.
    """
    if not is_multi_process():
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _rank_label() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()}/{dist.get_world_size()}"
    return f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}"


def write_error_file(exc: BaseException) -> None:
    """Write ``exc`` to torchrun's error file (``TORCHELASTIC_ERROR_FILE``) atomically; no-op when unset.

    torchrun prints this file's message as the job's root cause (without it: "error_file: <N/A>"). The JSON
    is what torch's ``ErrorHandler.record_exception`` writes, but that opens the final path (creating it
    empty) before writing. When one rank fails, torchrun SIGTERMs the others and then parses the error file
    of every rank that has exited; a rank killed between that open and the write leaves an empty file, and
    torchrun itself dies with a JSONDecodeError instead of reporting the failure. So: write a temporary file
    in the same folder and ``os.replace`` it onto the path, which is then either absent or complete.
    Call it from inside the ``except`` block that caught ``exc``: the file takes the active traceback.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    # a unique name per writer: two failing writers to one path never share (or truncate) a temporary file
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as fp:
            json.dump(data, fp)
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def abort(exc: BaseException, exit_code: int = 1) -> NoReturn:
    """Report ``exc`` as this rank's failure and end the process now (no clean-up that could block).

    Call it from inside the ``except`` block that caught ``exc``: the error file takes the active traceback.
    """
    try:
        write_error_file(exc)
    except Exception as e:  # reporting must never stop the exit below
        log.warning("could not write torchrun's error file: %s", e)
    log.critical(
        "%s on %s failed, ending the job: %s: %s",
        _rank_label(),
        socket.gethostname(),
        type(exc).__name__,
        exc,
        exc_info=exc,
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_code)


@contextlib.contextmanager
def fail_fast(exit_code: int = 1) -> Iterator[None]:
    """An exception escaping the block ends the whole torchrun job instead of hanging it.

    In a multi-process job (WORLD_SIZE > 1, before or after setup) the exception is logged with the rank
    and this process exits with ``exit_code`` at once; torchrun then stops the other ranks. In a single
    process the exception propagates unchanged. KeyboardInterrupt and SystemExit keep their meaning.
    """
    try:
        yield
    except Exception as e:
        if _launched_multi():
            abort(e, exit_code)
        raise


def end_process(code: int) -> NoReturn:
    """The command line's exit: leaves the group cleanly on success, at once (os._exit) on failure."""
    if code != 0 and _launched_multi():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)  # destroy_process_group could wait on a peer that is still inside a collective
    cleanup()
    sys.exit(code)
