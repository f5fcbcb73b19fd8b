"""A prompt prefilled with its chunks' FFN sublayers run together (the backend's
prefill_ffn_rows, graph.forward_chunks) and chunk by chunk, for the tests that hold the two to
the same bits on each backend."""

from __future__ import annotations

import numpy as np


def prefill_both_ways(eng, prompt: list[int], ctx: int, cap: int, rows: int, monkeypatch) -> dict:
    """{0: chunk by chunk, rows: grouped} -> (logits, {layer: {state name: numpy}}, session)."""
    be = eng.backend
    out = {}
    for r in (0, rows):
        monkeypatch.setattr(be, "prefill_ffn_rows", r)
        s = eng.session(ctx=ctx, prefill_cap=cap)
        s.sync(prompt)
        out[r] = (s.logits, {il: {k: be.state_to_numpy(st, k) for k in st} for il, st in s.states.items()}, s)
    return out


def assert_same_bits(got, want) -> None:
    """Logits and every state row equal bit for bit (NaN where the other has NaN)."""
    assert np.array_equal(got[0], want[0])
    for il, st in want[1].items():
        for k, w in st.items():
            assert np.array_equal(got[1][il][k], w, equal_nan=True), (il, k)
