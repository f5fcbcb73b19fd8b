"""The seed of the tests' random inputs.

Fixed, so that every run, CI's included, draws the same inputs; DS4_TEST_SEED=<n> draws another
set (and repeats it). Per-test generators are seeded from the seed and the test's id, so a test
draws the same inputs whatever ran before it in the same process (pytest-xdist splits the
modules between workers).
"""

from __future__ import annotations

import os
import zlib

import numpy as np

SEED = int(os.environ.get("DS4_TEST_SEED", "0"))


def rng_for_test(request) -> np.random.Generator:
    """A generator for one test (pytest's `request`), seeded by SEED and the test's id."""
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])
