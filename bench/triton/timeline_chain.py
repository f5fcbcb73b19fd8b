"""Per-sublayer medians of a decode step's timeline (bench_full.py --trace: decode_timeline_*.csv).

A sublayer runs from one mHC finalize to the next; the step has 87 finalizes (43 attention, 43
FFN, the head's), so the intervals alternate attention, FFN. Also the median durations of the
routed gate/up (the longer half of moe_gateup_mv_kernel's calls: the shared expert's are the
shorter) and of the down.

    python bench/triton/timeline_chain.py bench/triton/results_h200/decode_timeline_4096.csv
"""

from __future__ import annotations

import csv
import statistics
import sys


def chain(path: str) -> dict:
    rows = list(csv.DictReader(open(path)))
    ends = [float(r["start_us"]) + float(r["dur_us"]) for r in rows if r["kernel"] == "hc_finalize_kernel"]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    dur = lambda k: sorted(float(r["dur_us"]) for r in rows if r["kernel"] == k)  # noqa: E731
    gu = dur("moe_gateup_mv_kernel")
    return dict(attention_us=statistics.median(gaps[0::2]), ffn_us=statistics.median(gaps[1::2]),
                routed_gateup_us=statistics.median(gu[len(gu) // 2:]),
                down_us=statistics.median(dur("moe_down_mv_kernel")))


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p, " ".join(f"{k}={v:.1f}" for k, v in chain(p).items()))
