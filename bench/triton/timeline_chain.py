"""Per-sublayer medians of a decode step's timeline (bench_full.py --trace: decode_timeline_*.csv).

A sublayer runs from one mHC mixing kernel's start to the next (the step has 87: 43 attention,
43 FFN, the head's; each collapse has one mixing launch, and one or two finalize launches), so
the intervals alternate attention, FFN; attention also apart for the layers with an indexer (a
top-k launch inside) and without. Also the median durations of the routed gate/up (the longer
half of moe_gateup_mv_kernel's calls: the shared expert's are the shorter) and of the down.

    python bench/triton/timeline_chain.py bench/triton/results_h200/decode_timeline_4096.csv
"""

from __future__ import annotations

import csv
import statistics
import sys


def chain(path: str) -> dict:
    rows = list(csv.DictReader(open(path)))
    starts = sorted(float(r["start_us"]) for r in rows if r["kernel"] == "hc_mix_kernel")
    topk = [float(r["start_us"]) for r in rows if r["kernel"] in ("topk_kernel", "topk_one_kernel")]
    spans = list(zip(starts, starts[1:]))
    gaps = [b - a for a, b in spans]
    att = spans[0::2]
    idx = [b - a for a, b in att if any(a <= t < b for t in topk)]
    other = [b - a for a, b in att if not any(a <= t < b for t in topk)]
    dur = lambda k: sorted(float(r["dur_us"]) for r in rows if r["kernel"] == k)  # noqa: E731
    gu = dur("moe_gateup_mv_kernel")
    return dict(attention_us=statistics.median(gaps[0::2]), attention_indexer_us=statistics.median(idx),
                attention_other_us=statistics.median(other), ffn_us=statistics.median(gaps[1::2]),
                routed_gateup_us=statistics.median(gu[len(gu) // 2:]),
                down_us=statistics.median(dur("moe_down_mv_kernel")))


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p, " ".join(f"{k}={v:.1f}" for k, v in chain(p).items()))
