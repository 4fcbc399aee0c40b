"""Process-wide settings for the test run (the shared helpers live in tests/helpers.py)."""

from __future__ import annotations

import os

# Tiny models gain nothing from a second thread, and on a shared CPU oversubscription made tests up to
# 10x slower (measured); subprocesses inherit this too. Set before torch is imported anywhere.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
