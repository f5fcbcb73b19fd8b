"""Where a replayed decode step's time goes, from its timeline (bench_full.py --trace writes
decode_timeline_<ctx>.csv: every kernel's stream, start and duration).

The side streams overlap most kernels, so a kernel's summed duration says little about the step's
length. Two views that do, per kernel name:

* chain: the step's critical chain as the timeline shows it, walked back from the kernel that
  ends last, each time to the kernel that ended last before the current one started (the one it
  most likely waited for; the timeline holds no dependency edges). The chain's kernels and the
  gaps between them (launch latency, waits) add up to the step from the chain's first start; a
  kernel's chain time is what shortening it can gain at most, until another chain takes over.
  A kernel launched early (programmatic dependent launch) counts whole, its wait included, and
  the kernel it waited for drops out of the chain.
* alone: the time the kernel ran with no other kernel running, the serial stretches of the step.

It also gives the time with nothing running and with 1, 2, ... kernels at once.

    python bench/triton/decode_chain.py results_h200/decode_timeline_4096-2026-12-05.csv \
        --out results_h200/decode_chain_4096-2026-12-05.csv
"""

from __future__ import annotations

import argparse
import bisect
import csv
from collections import defaultdict

IDLE = "(nothing running)"
GAPS = "(gaps in the chain)"


def read_timeline(path: str) -> list[tuple[str, float, float]]:
    """(kernel, start µs, end µs) per row of a decode_timeline CSV."""
    with open(path, newline="") as f:
        return [(r["kernel"], float(r["start_us"]), float(r["start_us"]) + float(r["dur_us"]))
                for r in csv.DictReader(f)]


def critical_chain(spans: list[tuple[str, float, float]]) -> list[int]:
    """Indices of spans on the chain (module docstring), first to last."""
    if not spans:
        return []
    order = sorted(range(len(spans)), key=lambda i: (spans[i][2], i))
    ends = [spans[i][2] for i in order]
    at = len(order) - 1
    chain = [order[at]]
    while True:
        # the last to end at or before the current one starts, and before it in `order` (a
        # zero-length span ends where it starts, so the walk would otherwise stay in place)
        at = min(bisect.bisect_right(ends, spans[order[at]][1]) - 1, at - 1)
        if at < 0:
            break
        chain.append(order[at])
    return chain[::-1]


def step_table(spans: list[tuple[str, float, float]]) -> tuple[list[dict], dict[int, float]]:
    """Per kernel name: calls, summed duration, calls and time on the chain, time alone (µs),
    the longest chain time first, then the chain's gaps (its kernel count as calls on it) and the
    idle time; and the time with k kernels running, per k, over the span from the first start to
    the last end."""
    events = []
    for i, (_, s, e) in enumerate(spans):
        events += [(s, 1, i), (e, -1, i)]
    events.sort(key=lambda ev: (ev[0], ev[1]))  # (an end before a start at the same instant)
    running: set[int] = set()
    alone: dict[str, float] = defaultdict(float)
    by_count: dict[int, float] = defaultdict(float)
    last = events[0][0] if events else 0.0
    for t, kind, i in events:
        dt = t - last
        by_count[len(running)] += dt
        if len(running) == 1:
            alone[spans[next(iter(running))][0]] += dt
        last = t
        if kind == 1:
            running.add(i)
        else:
            running.discard(i)
    on_chain: dict[str, float] = defaultdict(float)
    chain_calls: dict[str, int] = defaultdict(int)
    gaps = 0.0
    chain = critical_chain(spans)
    prev_end = spans[chain[0]][1] if chain else 0.0
    for i in chain:
        name, s, e = spans[i]
        gaps += s - prev_end  # (>= 0: each chain kernel ended before the next one started)
        on_chain[name] += e - s
        chain_calls[name] += 1
        prev_end = e
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for name, s, e in spans:
        calls[name] += 1
        total[name] += e - s
    rows = [dict(kernel=k, calls=calls[k], time_us=round(total[k], 1), chain_calls=chain_calls[k],
                 chain_us=round(on_chain[k], 1), alone_us=round(alone[k], 1))
            for k in sorted(calls, key=lambda k: (-on_chain[k], -alone[k], k))]
    rows.append(dict(kernel=GAPS, calls=0, time_us=round(gaps, 1), chain_calls=len(chain), chain_us=round(gaps, 1),
                     alone_us=0.0))
    rows.append(dict(kernel=IDLE, calls=0, time_us=round(by_count[0], 1), chain_calls=0, chain_us=0.0,
                     alone_us=round(by_count[0], 1)))
    return rows, dict(sorted(by_count.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", help="a decode_timeline_<ctx>.csv from bench_full.py --trace")
    ap.add_argument("--out", default="", help="write the table here as CSV")
    a = ap.parse_args()
    rows, by_count = step_table(read_timeline(a.timeline))
    span = sum(by_count.values())
    print(f"span {span:.1f} us; with k kernels running: "
          + ", ".join(f"{k}: {v:.1f}" for k, v in by_count.items()))
    print(f"{'kernel':28s}{'calls':>6s}{'time us':>10s}{'on chain':>9s}{'chain us':>10s}{'alone us':>10s}")
    for r in rows:
        print(f"{r['kernel']:28s}{r['calls']:6d}{r['time_us']:10.1f}{r['chain_calls']:9d}{r['chain_us']:10.1f}"
              f"{r['alone_us']:10.1f}")
    if a.out:
        with open(a.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
