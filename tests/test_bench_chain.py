"""bench/triton/decode_chain.py: a decode step's critical chain and serial stretches from its
timeline, on a timeline written out by hand."""

from __future__ import annotations

import pytest

from bench_modules import bench_module


@pytest.fixture(scope="module")
def chain():
    return bench_module("triton", "decode_chain")


# kernel, stream, start, duration (µs): A and B overlap, C waits for B, D runs inside C
CSV = """kernel,stream,start_us,dur_us
A,7,0.0,10.0
B,8,5.0,10.0
C,7,20.0,5.0
D,8,21.0,2.0
"""


def test_chain_alone_and_concurrency(chain, tmp_path):
    p = tmp_path / "decode_timeline_64.csv"
    p.write_text(CSV)
    spans = chain.read_timeline(str(p))
    assert spans == [("A", 0.0, 10.0), ("B", 5.0, 15.0), ("C", 20.0, 25.0), ("D", 21.0, 23.0)]
    # C ends last; the last kernel to end before C starts (20) is B (15); none ends by B's start
    assert [spans[i][0] for i in chain.critical_chain(spans)] == ["B", "C"]
    rows, by_count = chain.step_table(spans)
    got = {r["kernel"]: (r["calls"], r["time_us"], r["chain_calls"], r["chain_us"], r["alone_us"]) for r in rows}
    assert got == {
        "B": (1, 10.0, 1, 10.0, 5.0),  # alone over [10, 15]
        "C": (1, 5.0, 1, 5.0, 3.0),  # alone over [20, 21] and [23, 25]
        "A": (1, 10.0, 0, 0.0, 5.0),  # alone over [0, 5]
        "D": (1, 2.0, 0, 0.0, 0.0),
        chain.GAPS: (0, 5.0, 2, 5.0, 0.0),  # B's end to C's start, between the chain's 2 kernels
        chain.IDLE: (0, 5.0, 0, 0.0, 5.0),
    }
    assert [r["kernel"] for r in rows][:2] == ["B", "C"]  # the longest chain time first
    assert by_count == {0: 5.0, 1: 13.0, 2: 7.0}  # [15, 20]; A, B, C alone; [5, 10] and [21, 23]


def test_chain_walk_ends_on_zero_length_kernels(chain):
    """Kernels of no duration at one instant (the profiler rounds) are each on the chain once."""
    spans = [("A", 0.0, 4.0), ("X", 5.0, 5.0), ("Y", 5.0, 5.0), ("B", 5.0, 9.0)]
    assert [spans[i][0] for i in chain.critical_chain(spans)] == ["A", "X", "Y", "B"]
