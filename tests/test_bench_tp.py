"""bench/tp/bench_gates.py: a few tokens on tiny sizes, two processes over real loopback TCP.

The sums both ranks got must be p0 + p1 bit-exactly, with p0 and p1 made here from the seeded
scheme the bench documents (`partials`), and the CSV must have the documented columns.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

SEED = 11
N_LAYER, N_EMBD = 2, 64
TOKENS, WARMUP, POOL = 4, 2, 3  # POOL < WARMUP + TOKENS, so the slots are reused
BULK_ROWS, BULK_CHUNKS, BULK_WARMUP, BULK_SLABS, BULK_STREAM = 8, 2, 1, 2, 1 << 20
GATES = 2

EXPECTED_COLUMNS = ["date", "machine", "cores", "device", "transport", "n_layer", "n_embd",
                    "rows", "tokens", "ms_median", "ms_p90", "ms_p99", "target_ms", "pass",
                    "bulk_rows", "bulk_chunks", "bulk_ms_median", "bulk_gb_s"]


@pytest.fixture
def bench(monkeypatch):
    # on sys.path for the whole test: the spawned ranks import the module by this name too
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "tp"))
    import bench_gates

    return bench_gates


def partial(rank: int, slot: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng((SEED, rank, slot)).standard_normal(shape, dtype=np.float32)


def expected_decode(t: int) -> np.ndarray:
    """[n_layer × 2, 1, n_embd]: layer-major, ATTN then FFN, as the ranks return them."""
    shape = (N_LAYER, GATES, 1, N_EMBD)
    p0, p1 = partial(0, t % POOL, shape), partial(1, t % POOL, shape)
    return (p0 + p1).reshape(N_LAYER * GATES, 1, N_EMBD)


def expected_bulk() -> np.ndarray:
    shape = (BULK_ROWS, N_EMBD)
    slabs = [partial(0, BULK_STREAM + s, shape) + partial(1, BULK_STREAM + s, shape)
             for s in range(BULK_SLABS)]
    return np.stack([slabs[(GATES * il + g) % BULK_SLABS]
                     for il in range(N_LAYER) for g in range(GATES)])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_tcp_gate_sums_are_exact_and_csv_has_the_columns(bench, tmp_path):
    cfg = bench.Config("tcp", N_LAYER, N_EMBD, TOKENS, WARMUP, POOL, BULK_ROWS, BULK_CHUNKS,
                       BULK_WARMUP, SEED, keep_sums=True)
    m = bench.measure(cfg)

    for rank in (0, 1):
        got = m.ranks[rank]
        assert len(got["decode_s"]) == TOKENS and len(got["bulk_s"]) == BULK_CHUNKS
        assert len(got["decode_sums"]) == WARMUP + TOKENS
        for t, s in enumerate(got["decode_sums"]):
            assert np.array_equal(bits(s), bits(expected_decode(t))), f"rank {rank} token {t}"
        assert len(got["bulk_sums"]) == BULK_WARMUP + BULK_CHUNKS
        for c, s in enumerate(got["bulk_sums"]):
            assert np.array_equal(bits(s), bits(expected_bulk())), f"rank {rank} chunk {c}"
    assert not np.array_equal(expected_decode(0), partial(0, 0, (N_LAYER * GATES, 1, N_EMBD)))

    rec = m.record
    assert rec["transport"] == "tcp" and rec["device"] == "cpu" and rec["pass"] in ("pass", "fail")
    assert 0 < rec["ms_median"] <= rec["ms_p90"] <= rec["ms_p99"]
    assert rec["bulk_gb_s"] > 0

    csv_path, json_path = bench.write_results([rec], tmp_path, "test")
    with csv_path.open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == EXPECTED_COLUMNS
    assert len(rows) == 1
    row = rows[0]
    assert (row["transport"], row["n_layer"], row["n_embd"], row["rows"], row["tokens"]) == (
        "tcp", str(N_LAYER), str(N_EMBD), "1", str(TOKENS))
    assert int(row["cores"]) >= 1 and row["machine"]

    # a later run of another transport keeps this row; a rerun of tcp replaces it
    bench.write_results([dict(rec, transport="gloo")], tmp_path, "test")
    bench.write_results([dict(rec, ms_median=9.5)], tmp_path, "test")
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["transport"], r["ms_median"]) for r in rows] == [
        ("gloo", str(rec["ms_median"])), ("tcp", "9.5")]
    assert json_path.exists()
