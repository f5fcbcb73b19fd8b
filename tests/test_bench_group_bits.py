"""bench/triton/group_bits.py's comparison: any one bit of the logits or of a layer's state that
differs between the grouped and the chunk-by-chunk prefill is reported, NaN rows that agree are
not."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")  # (group_bits imports torch for the device's name and syncs)

from bench_modules import bench_module  # noqa: E402


@pytest.fixture(scope="module")
def group_bits():
    return bench_module("triton", "group_bits")


def _run(seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(32).astype(np.float32)
    raw = rng.standard_normal((4, 8)).astype(np.float32)
    raw[1] = np.nan  # a row not yet written: NaN on both sides
    states = {0: {"raw": raw}, 1: {"raw": raw.copy(), "comp": rng.standard_normal((2, 8)).astype(np.float32)}}
    return logits, states


def _next_up(x: np.float32) -> np.float32:
    return np.nextafter(x, np.float32(np.inf), dtype=np.float32)


def test_equal_runs_compare_equal(group_bits):
    r = group_bits.compare(_run(0), _run(0))
    assert r == dict(logits_equal=True, logits_max_rel=0.0, first_state_differing=None)


def test_one_ulp_anywhere_is_reported(group_bits):
    want = _run(0)
    logits, states = _run(0)
    states[1]["comp"][1, 5] = _next_up(states[1]["comp"][1, 5])
    r = group_bits.compare(want, (logits, states))
    assert r["logits_equal"] and r["first_state_differing"] == "1:comp"
    logits[7] = _next_up(logits[7])
    r = group_bits.compare(want, (logits, states))
    assert not r["logits_equal"]
    assert r["logits_max_rel"] == pytest.approx(abs(float(logits[7]) - float(want[0][7])) / np.abs(want[0]).max())
