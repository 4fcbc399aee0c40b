"""Seeds: every random stream of a run is a pure function of integers (run seed, purpose, index).

The bottom layer (numpy only): the data stream's permutations, the training noise and times, condition
dropout and the sampling noise each take their own salt, so they never share a stream, and a sample's
randomness depends on (seed, k) alone: how the batch is split, resumed or spread over processes does not
change it (invariant 1).
"""

from __future__ import annotations

import zlib

import numpy as np

# Salts that keep the independent random streams of one run apart.
SALT_NOISE = 1
SALT_PERMUTATION = 2
SALT_SAMPLING = 3
SALT_COND_DROP = 4
SALT_FLIP = 5
SALT_AFFINE = 6


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (run seed, purpose, index, ...)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def volume_seed(seed: int, case: str, index: int) -> int:
    """The seed of sample ``index`` of mask ``case``: the same volume whatever its batch mates or device."""
    return derive_seed(seed, zlib.crc32(case.encode("utf-8")), index)
