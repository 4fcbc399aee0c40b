"""The one precision module: which precision a device runs, and the autocast every part wraps a model call in."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from diffusion3d import precision
from diffusion3d.data import discover
from diffusion3d.precision import autocast_factory, resolve_precision
from diffusion3d.trainer import build_trainer
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "requested, device, expected, warns",
    [
        ("fp32", "cpu", "fp32", False),
        ("bf16", "cpu", "bf16", False),
        ("fp16", "cpu", "fp32", True),  # fp16 exists only on CUDA
        ("fp16", "cuda", "fp16", False),
        ("bf16", "cuda:1", "bf16", False),
    ],
)
def test_resolution_table(caplog, monkeypatch, requested, device, expected, warns):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)  # a CPU with AVX-512 or AMX
    with caplog.at_level(logging.WARNING):
        assert resolve_precision(requested, torch.device(device)) == expected
    assert ("needs CUDA" in caplog.text) == warns


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_that_would_emulate_it_runs_in_fp32(caplog, monkeypatch, fast):
    """Without AVX-512/AMX torch emulates bf16 (a conv3d 175x slower than fp32, measured): fp32 instead."""
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: fast)
    with caplog.at_level(logging.WARNING):
        assert resolve_precision("bf16", "cpu") == ("bf16" if fast else "fp32")
        assert resolve_precision("bf16", "cuda") == "bf16"  # the CPU's instructions do not matter there
    assert ("emulated" in caplog.text) == (not fast)


@pytest.mark.parametrize("fast", [True, False])
def test_the_python_apis_trainer_runs_the_precision_the_cpu_allows(tmp_path, monkeypatch, fast):
    """build_trainer (the README's Python example) resolves as the train command does: no emulated bf16."""
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: fast)
    cfg = tiny_config(tmp_path, precision="bf16")
    trainer = build_trainer(cfg, discover(cfg), "cpu", None)
    assert trainer.precision == cfg.train.precision == ("bf16" if fast else "fp32")


def test_the_cpu_check_answers_a_bool():
    assert isinstance(precision.cpu_has_fast_bf16(), bool)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        resolve_precision("fp8", "cpu")
    with pytest.raises(ValueError, match="fp8"):
        autocast_factory("fp8", "cpu")


def _matmul_dtype(factory) -> torch.dtype:
    a = torch.randn(4, 4)
    with factory():
        return (a @ a).dtype


def test_fp32_runs_without_autocast():
    factory = autocast_factory("fp32", torch.device("cpu"))
    assert factory is contextlib.nullcontext
    assert _matmul_dtype(factory) == torch.float32


def test_bf16_autocasts_on_the_cpu_too():
    factory = autocast_factory("bf16", "cpu")
    with factory():
        assert torch.is_autocast_enabled("cpu")
    assert _matmul_dtype(factory) == torch.bfloat16
    assert _matmul_dtype(factory) == _matmul_dtype(
        autocast_factory("bf16", torch.device("cpu"))
    )  # new context each call


def test_the_factory_takes_the_precision_as_given():
    """Resolving is the caller's step: the trainer's tests run fp16 autocast (and its GradScaler) on the CPU."""
    assert _matmul_dtype(autocast_factory("fp16", "cpu")) == torch.float16
    assert _matmul_dtype(autocast_factory(resolve_precision("fp16", "cpu"), "cpu")) == torch.float32
