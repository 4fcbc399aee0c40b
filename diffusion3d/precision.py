"""Mixed precision: which precision a device runs, and the one autocast factory every part uses.

The trainer, the memory planner, sampling (the trainer's validation and the sample command alike) and the
benchmark all take their autocast from ``autocast_factory``, so a bf16 CPU run's validation sample and
the sample command's sample of the same checkpoint run the same arithmetic.

Autocast wraps the denoiser's forward only (the caller decides where): noising, the loss and the master
weights stay fp32. fp16 exists only on CUDA (``resolve_precision``); bf16 autocasts on any device, but on a
CPU it runs in bf16 only where oneDNN computes bf16 natively (AVX-512 or AMX): elsewhere torch emulates it,
and a bf16 conv3d measured 175x slower than fp32 on a 2-core AMD EPYC without AVX-512, so ``resolve_precision``
runs such a CPU in fp32 (with a warning).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16")
AUTOCAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
Autocast = Callable[[], contextlib.AbstractContextManager]


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN computes bf16 on this CPU in hardware (its own check: AVX-512 on x86, or the ARM
    equivalent). A torch without that check is trusted to have it."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return True if check is None else bool(check())
    except RuntimeError:
        return True


def resolve_precision(requested: str, device: torch.device | str) -> str:
    """The precision ``device`` runs for ``requested``: fp16 off CUDA becomes fp32, and so does bf16 on a CPU
    that would emulate it (``cpu_has_fast_bf16``); each with a warning."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision: {requested!r} is not one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    if requested == "fp16" and device.type != "cuda":
        log.warning("precision fp16 needs CUDA; running in fp32 on %s", device.type)
        return "fp32"
    if requested == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
        log.warning("precision bf16 is emulated on this CPU (no AVX-512/AMX), far slower than fp32; running in fp32")
        return "fp32"
    return requested


def autocast_factory(precision: str, device: torch.device | str) -> Autocast:
    """A zero-argument factory of the context that wraps a model call: autocast to fp16/bf16, or (fp32)
    nothing. ``precision`` is taken as given; resolve it first where fp16 must not reach a CPU (the
    trainer's tests do run fp16 autocast and its GradScaler on the CPU on purpose)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    device_type = torch.device(device).type
    return lambda: torch.autocast(device_type, dtype=dtype)
