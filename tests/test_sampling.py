"""Sampling (spec §6): the RNG stream, each filter on hand-made logits, and the distribution.

Most filter tests drive `sample` with a scripted U (any object with `uniform()` will do) and
sweep U over a fine grid: the set of tokens that comes out is exactly the kept set, and each
token's share of the grid is its renormalized probability, both worked out by hand below.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4.core.sampling import GREEDY, Rng, SamplingParams, argmax, sample, top_candidates, unsorted_path

NEG_INF = -np.inf


class ScriptedU:
    """Stands in for Rng: hands out the given U values in order and counts the draws."""

    def __init__(self, *us: float) -> None:
        self._us = list(us)
        self.draws = 0

    def uniform(self) -> float:
        self.draws += 1
        return self._us.pop(0)


def logits_for(rel_probs) -> np.ndarray:
    """Logits whose exp is proportional to rel_probs (0 -> -inf, a masked token)."""
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(rel_probs, dtype=np.float64))


GRID = 2000


def sweep(logits, params) -> dict[int, float]:
    """Token -> share of a uniform grid of U values in (0, 1) that picks it."""
    counts: dict[int, int] = {}
    for i in range(GRID):
        token = sample(logits, params, ScriptedU((i + 0.5) / GRID))
        counts[token] = counts.get(token, 0) + 1
    return {token: n / GRID for token, n in sorted(counts.items())}


def assert_shares(shares: dict[int, float], expected: dict[int, float]) -> None:
    assert set(shares) == set(expected)
    total = sum(expected.values())
    for token, weight in expected.items():
        assert shares[token] == pytest.approx(weight / total, abs=1.5 / GRID), token


# --- RNG -------------------------------------------------------------------------------------


def spec_xorshift64star(seed: int, n: int) -> list[int]:
    """Written out again from the spec formula, independently of ds4.core.sampling."""
    two64 = 2**64
    x = seed % two64
    out = []
    for _ in range(n):
        if x == 0:
            x = 0x9E3779B97F4A7C15
        x = x ^ (x // 2**12)
        x = (x ^ (x * 2**25)) % two64
        x = x ^ (x // 2**27)
        out.append((x * 0x2545F4914F6CDD1D) % two64)
    return out


def test_rng_first_output_for_seed_1_by_hand():
    # x = 1: x ^= x>>12 -> 1; x ^= x<<25 -> 0x2000001; x ^= x>>27 -> 0x2000001 (x>>27 is 0).
    # out = 0x2000001 * M = (M << 25) + M mod 2^64
    #     = 0x229ED9BA3A000000 + 0x2545F4914F6CDD1D = 0x47E4CE4B896CDD1D.
    rng = Rng(1)
    assert rng.next_u64() == 0x47E4CE4B896CDD1D
    assert rng.state == 0x2000001
    # U is the top 24 bits, 0x47E4CE = 4711630, over 2^24.
    rng = Rng(1)
    assert rng.uniform() == 4711630 / 16777216


@pytest.mark.parametrize("seed", [1, 2, 42, 0xDEADBEEF, 2**63, 2**64 - 1])
def test_rng_matches_spec_formula(seed):
    rng = Rng(seed)
    assert [rng.next_u64() for _ in range(64)] == spec_xorshift64star(seed, 64)


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_rng_matches_spec_formula_any_seed(seed):
    rng = Rng(seed)
    expected = spec_xorshift64star(seed, 8)
    assert [rng.next_u64() for _ in range(8)] == expected
    rng = Rng(seed)
    assert [rng.uniform() for _ in range(8)] == [(o >> 40) / 2**24 for o in expected]


def test_rng_zero_state_is_replaced():
    assert Rng(0).next_u64() == Rng(0x9E3779B97F4A7C15).next_u64()
    assert Rng(0).next_u64() == spec_xorshift64star(0, 1)[0]


def test_rng_uniform_range_and_same_seed_same_stream():
    a, b = Rng(1234), Rng(1234)
    us = [a.uniform() for _ in range(1000)]
    assert us == [b.uniform() for _ in range(1000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert us != [Rng(1235).uniform() for _ in range(1000)]


def test_rng_state_save_and_restore():
    rng = Rng(7)
    for _ in range(5):
        rng.next_u64()
    saved = rng.state
    ahead = [rng.next_u64() for _ in range(10)]
    rng.state = saved
    assert [rng.next_u64() for _ in range(10)] == ahead
    other = Rng(999)
    other.state = saved
    assert [other.next_u64() for _ in range(10)] == ahead


# --- parameters ------------------------------------------------------------------------------


def test_defaults_are_ds4s():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.05)
    assert GREEDY.temperature == 0.0


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (SamplingParams(top_p=0.0), SamplingParams(top_p=1.0)),
        (SamplingParams(top_p=-0.5), SamplingParams(top_p=1.0)),
        (SamplingParams(top_p=1.5), SamplingParams(top_p=1.0)),
        (SamplingParams(top_p=math.nan), SamplingParams(top_p=1.0)),
        (SamplingParams(top_p=0.9), SamplingParams(top_p=0.9)),
        (SamplingParams(top_p=1.0), SamplingParams(top_p=1.0)),
        (SamplingParams(min_p=-0.1), SamplingParams(min_p=0.0)),
        (SamplingParams(min_p=0.0), SamplingParams(min_p=0.0)),
        (SamplingParams(min_p=0.2), SamplingParams(min_p=0.2)),
        (SamplingParams(top_k=5000), SamplingParams(top_k=1024)),
        (SamplingParams(top_k=1024), SamplingParams(top_k=1024)),
        (SamplingParams(top_k=40), SamplingParams(top_k=40)),
        (SamplingParams(temperature=0.3), SamplingParams(temperature=0.3)),
    ],
)
def test_normalized_clamps(given, expected):
    assert given.normalized() == expected


# --- greedy ----------------------------------------------------------------------------------


def test_argmax_first_of_ties_and_skips_non_finite():
    assert argmax(np.array([1.0, 3.0, 2.0, 3.0], dtype=np.float32)) == 1
    assert argmax([NEG_INF, -5.0, math.nan, -5.0]) == 1
    assert argmax([math.nan, 0.5, 0.5]) == 1


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_temperature_zero_is_first_argmax_without_a_draw(temperature):
    rng = Rng(5)
    logits = np.array([0.0, 2.0, 1.0, 2.0, NEG_INF], dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=3, top_p=0.5, min_p=0.5)
    assert sample(logits, params, rng) == 1
    assert sample(logits, GREEDY, rng) == 1
    assert rng.state == 5  # greedy never touches the stream


def test_all_masked_is_an_error():
    masked = np.full(6, NEG_INF, dtype=np.float32)
    for params in (
        GREEDY,
        SamplingParams(),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=3),
    ):
        with pytest.raises(ValueError, match="finite"):
            sample(masked, params, Rng(1))
    with pytest.raises(ValueError, match="finite"):
        argmax(masked)
    with pytest.raises(ValueError, match="finite"):
        top_candidates(masked, 2)


# --- default path: min-p, id-order scan ------------------------------------------------------


def test_min_p_drops_exactly_the_tokens_below_it():
    # Relative to the best (id 0, p = 1): ids 2 (0.04) and 5 (0.01) are below min_p = 0.05.
    rel = [1.0, 0.5, 0.04, 0.06, 0.2, 0.01]
    shares = sweep(logits_for(rel), SamplingParams(min_p=0.05))
    assert_shares(shares, {0: 1.0, 1: 0.5, 3: 0.06, 4: 0.2})
    # min_p = 0 keeps them all.
    assert_shares(sweep(logits_for(rel), SamplingParams(min_p=0.0)), dict(enumerate(rel)))


def test_default_path_scans_ids_in_ascending_order():
    # Kept, in id order: 0 (0.2), 1 (1.0), 3 (0.5) -> Σ = 1.7, boundaries 0.2 | 1.2 | 1.7.
    logits = logits_for([0.2, 1.0, 0.03, 0.5])
    params = SamplingParams()
    assert sample(logits, params, ScriptedU(0.0)) == 0  # r = 0: the first kept id
    assert sample(logits, params, ScriptedU(0.1 / 1.7)) == 0
    assert sample(logits, params, ScriptedU(0.3 / 1.7)) == 1
    assert sample(logits, params, ScriptedU(1.19 / 1.7)) == 1
    assert sample(logits, params, ScriptedU(1.21 / 1.7)) == 3  # not 2: it was dropped
    assert sample(logits, params, ScriptedU(1.0 - 2**-24)) == 3


def test_temperature_sharpens_before_min_p():
    logits = np.array([1.0, 0.0])  # relative p of id 1: e^(-1/T)
    # T = 1: 0.368 stays above min_p = 0.2; T = 0.5: e^-2 = 0.135 is dropped.
    assert_shares(sweep(logits, SamplingParams(min_p=0.2)), {0: 1.0, 1: math.exp(-1)})
    assert sweep(logits, SamplingParams(temperature=0.5, min_p=0.2)) == {0: 1.0}
    assert_shares(
        sweep(logits, SamplingParams(temperature=0.5, min_p=0.0)), {0: 1.0, 1: math.exp(-2)}
    )
    assert_shares(
        sweep(logits, SamplingParams(temperature=2.0, min_p=0.0)), {0: 1.0, 1: math.exp(-0.5)}
    )


def test_min_p_above_one_returns_best_without_a_draw():
    # ds4 finds nothing left, Σ = 0, and returns the best token before drawing.
    u = ScriptedU()
    assert sample(np.array([0.0, 2.0, 2.0]), SamplingParams(min_p=2.0), u) == 1
    assert u.draws == 0


def test_masked_tokens_are_never_drawn():
    logits = np.array([NEG_INF, 0.0, math.nan, 0.0, NEG_INF], dtype=np.float32)
    for params in (
        SamplingParams(min_p=0.0),
        SamplingParams(top_p=0.99, min_p=0.0),
        SamplingParams(top_k=4, min_p=0.0),
    ):
        assert_shares(sweep(logits, params), {1: 1.0, 3: 1.0})


# --- top_p path: sorted prefix over the whole vocabulary -------------------------------------


# Relative p = [0.25, 1, 0.5, 0.75], Σ = 2.5; sorted: id 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1).
TOP_P_LOGITS = logits_for([0.25, 1.0, 0.5, 0.75])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {1: 1.0}),  # 0.4 >= 0.3 after the first token
        (0.65, {1: 1.0, 3: 0.75}),  # 0.4, then 0.7
        (0.75, {1: 1.0, 3: 0.75, 2: 0.5}),  # 0.4, 0.7, then 0.9
        (0.95, {1: 1.0, 3: 0.75, 2: 0.5, 0: 0.25}),
    ],
)
def test_top_p_keeps_the_prefix(top_p, kept):
    assert_shares(sweep(TOP_P_LOGITS, SamplingParams(top_p=top_p, min_p=0.0)), kept)


@pytest.mark.parametrize(
    ("min_p", "kept"),
    [
        (0.2, {1: 1.0, 3: 0.75, 2: 0.5, 0: 0.25}),  # threshold 0.4·0.2 = 0.08: all pass
        (0.3, {1: 1.0, 3: 0.75, 2: 0.5}),  # 0.12: id 0 (0.1) fails
        (0.6, {1: 1.0, 3: 0.75}),  # 0.24: id 2 (0.2) fails
        (0.9, {1: 1.0}),  # 0.36: id 3 (0.3) fails; the first always stays
    ],
)
def test_top_p_path_min_p_relative_to_the_first(min_p, kept):
    assert_shares(sweep(TOP_P_LOGITS, SamplingParams(top_p=0.99, min_p=min_p)), kept)


def test_top_p_samples_in_sorted_order():
    params = SamplingParams(top_p=0.75, min_p=0.0)
    # Prefix 1, 3, 2 with masses 1, 0.75, 0.5 (Σ 2.25): boundaries 1 | 1.75 | 2.25.
    assert sample(TOP_P_LOGITS, params, ScriptedU(0.0)) == 1  # the best, not the lowest id
    assert sample(TOP_P_LOGITS, params, ScriptedU(0.99 / 2.25)) == 1
    assert sample(TOP_P_LOGITS, params, ScriptedU(1.01 / 2.25)) == 3
    assert sample(TOP_P_LOGITS, params, ScriptedU(1.76 / 2.25)) == 2


def test_top_p_ties_go_to_the_lower_id():
    # Relative p = [e^-1, 1, 1, e^-2], Σ ≈ 2.503: one tied token is 0.40 of the mass.
    logits = np.array([1.0, 2.0, 2.0, 0.0], dtype=np.float32)
    assert sweep(logits, SamplingParams(top_p=0.3, min_p=0.0)) == {1: 1.0}
    assert_shares(sweep(logits, SamplingParams(top_p=0.5, min_p=0.0)), {1: 1.0, 2: 1.0})


# --- top_k path ------------------------------------------------------------------------------


TOP_K_LOGITS = np.array([0.5, 3.0, 1.0, 3.0, 2.0, NEG_INF], dtype=np.float32)


@pytest.mark.parametrize(
    ("top_k", "kept"),
    [
        (1, {1: 1.0}),  # of the tied best, the lower id
        (2, {1: 1.0, 3: 1.0}),
        (3, {1: 1.0, 3: 1.0, 4: math.exp(-1)}),
        (5, {1: 1.0, 3: 1.0, 4: math.exp(-1), 2: math.exp(-2), 0: math.exp(-2.5)}),
        (1024, {1: 1.0, 3: 1.0, 4: math.exp(-1), 2: math.exp(-2), 0: math.exp(-2.5)}),
    ],
)
def test_top_k_keeps_the_best_k(top_k, kept):
    assert_shares(sweep(TOP_K_LOGITS, SamplingParams(top_k=top_k, min_p=0.0)), kept)


def test_top_k_then_min_p():
    # Top 4: ids 1, 3 (p 1), 4 (e^-1 = 0.37), 2 (e^-2 = 0.14). min_p = 0.5 keeps only the ties.
    assert_shares(sweep(TOP_K_LOGITS, SamplingParams(top_k=4, min_p=0.5)), {1: 1.0, 3: 1.0})
    assert_shares(
        sweep(TOP_K_LOGITS, SamplingParams(top_k=4, min_p=0.3)),
        {1: 1.0, 3: 1.0, 4: math.exp(-1)},
    )


def test_top_k_top_p_mass_is_over_the_top_k_only():
    # Four equal tokens. With top_k = 2, Σ covers two of them: the first alone is 0.5 of it,
    # enough for top_p = 0.5. (Over the whole vocabulary it would be 0.25 and two would stay.)
    logits = np.zeros(4, dtype=np.float32)
    assert sweep(logits, SamplingParams(top_k=2, top_p=0.5, min_p=0.0)) == {0: 1.0}
    assert_shares(sweep(logits, SamplingParams(top_k=2, top_p=0.6, min_p=0.0)), {0: 1, 1: 1})
    assert_shares(sweep(logits, SamplingParams(top_p=0.5, min_p=0.0)), {0: 1, 1: 1})


def test_top_candidates_best_first_ties_to_lower_id():
    assert top_candidates(TOP_K_LOGITS, 3) == [(1, 3.0), (3, 3.0), (4, 2.0)]
    assert top_candidates(TOP_K_LOGITS, 10) == [(1, 3.0), (3, 3.0), (4, 2.0), (2, 1.0), (0, 0.5)]
    assert top_candidates(TOP_K_LOGITS, 0) == []
    assert top_candidates(np.zeros(5), 2) == [(0, 0.0), (1, 0.0)]


# --- distribution and reproducibility with the real generator --------------------------------


def test_frequencies_match_probabilities():
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.log(probs).astype(np.float32)
    rng = Rng(20240601)
    n = 20_000
    counts = np.bincount(
        [sample(logits, SamplingParams(min_p=0.0), rng) for _ in range(n)], minlength=4
    )
    chi2 = float((((counts - n * probs) ** 2) / (n * probs)).sum())
    assert chi2 < 16.27, (counts, chi2)  # χ²(3 dof) at p = 0.001


def test_same_seed_same_tokens():
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32) * 3
    for params in (
        SamplingParams(),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=40, temperature=0.7),
    ):
        a, b = Rng(99), Rng(99)
        first = [sample(logits, params, a) for _ in range(50)]
        assert first == [sample(logits, params, b) for _ in range(50)]
        assert a.state == b.state
        assert len(set(first)) > 1


def test_one_draw_per_sample():
    logits = np.array([0.0, 1.0, 2.0])
    for params in (SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=2)):
        u = ScriptedU(0.5)
        sample(logits, params, u)
        assert u.draws == 1


def test_full_vocabulary_is_fast_and_in_range():
    vocab = 129_280
    logits = np.random.default_rng(1).normal(size=vocab).astype(np.float32) * 2
    logits[::7] = NEG_INF
    rng = Rng(3)
    for params in (
        SamplingParams(),
        SamplingParams(min_p=0.0),
        SamplingParams(top_p=0.95, min_p=0.0),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=2000),
    ):
        for _ in range(3):
            token = sample(logits, params, rng)
            assert 0 <= token < vocab and np.isfinite(logits[token])


# --- against a plain loop written straight from the spec -------------------------------------


def spec_sample(logits, params, u: float) -> int:
    """§6 as scalar loops (float64, ties to the lower id), for comparison with the numpy code."""
    params = params.normalized()
    t, top_p, min_p = (
        float(np.float32(v)) for v in (params.temperature, params.top_p, params.min_p)
    )
    finite = [(float(v), i) for i, v in enumerate(logits) if math.isfinite(v)]
    if params.top_k <= 0 and top_p >= 1.0:
        best = max(v for v, _ in finite)
        kept = [(math.exp((v - best) / t), i) for v, i in finite]
        kept = [(p, i) for p, i in kept if p >= min_p]
        total = 0.0
        for p, _ in kept:
            total += p
        r, acc = u * total, 0.0
        for p, i in kept:
            acc += p
            if acc >= r:
                return i
        return kept[-1][1]
    ranked = sorted(finite, key=lambda vi: (-vi[0], vi[1]))
    if params.top_k > 0:
        ranked = ranked[: params.top_k]
    probs = [math.exp((v - ranked[0][0]) / t) for v, _ in ranked]
    total = float(np.sum(probs))
    prefix, acc = [], 0.0
    for k, p in enumerate(probs):
        if k > 0 and p / total < (probs[0] / total) * min_p:
            break
        prefix.append((p, ranked[k][1]))
        acc += p
        if acc / total >= top_p:
            break
    r, acc = u * acc, 0.0
    for p, i in prefix:
        acc += p
        if acc >= r:
            return i
    return prefix[-1][1]


@settings(max_examples=300, deadline=None)
@given(
    levels=st.lists(
        st.sampled_from([-math.inf, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=12
    ),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([0, 0, 1, 2, 3, 5, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.3]),
    min_p=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
    u=st.integers(min_value=0, max_value=2**24 - 1),
)
def test_matches_spec_loops(levels, temperature, top_k, top_p, min_p, u):
    logits = np.array(levels, dtype=np.float32)
    if not np.isfinite(logits).any():
        return
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    u = u / 2**24
    assert sample(logits, params, ScriptedU(u)) == spec_sample(logits, params, u)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])  # nucleus inside / past the best 1024
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_large_vocabulary_matches_spec_loops(temperature, min_p):
    gen = np.random.default_rng(11)
    logits = (gen.normal(size=3000) * 2).astype(np.float32)
    logits[gen.integers(0, 3000, size=200)] = np.round(logits[:200])  # some ties
    logits[::13] = NEG_INF
    for params in (
        SamplingParams(temperature=temperature, top_p=0.9, min_p=min_p),
        SamplingParams(temperature=temperature, top_k=300, top_p=0.8, min_p=min_p),
        SamplingParams(temperature=temperature, min_p=min_p),
    ):
        for u in (0.0, 0.3, 0.77, 1.0 - 2**-24):
            assert sample(logits, params, ScriptedU(u)) == spec_sample(logits, params, u)


def test_unsorted_path_names_the_paths_without_a_sort():
    """Greedy and the default min-p path (min_p <= 1) give (T, min_p) as float32 values, as
    ds4 holds them (spec §6); top_k, top_p < 1, min_p > 1 and a NaN temperature give None."""
    assert unsorted_path(SamplingParams(temperature=0.0)) == (0.0, float(np.float32(0.05)))
    assert unsorted_path(SamplingParams(temperature=-1.0, top_k=5)) == (-1.0, float(np.float32(0.05)))
    assert unsorted_path(SamplingParams()) == (1.0, float(np.float32(0.05)))
    assert unsorted_path(SamplingParams(temperature=0.7, min_p=1.0)) == (float(np.float32(0.7)), 1.0)
    assert unsorted_path(SamplingParams(top_p=1.5, min_p=-2.0)) == (1.0, 0.0)  # clamped: off
    for off in (SamplingParams(top_k=40), SamplingParams(top_p=0.9), SamplingParams(min_p=1.5),
                SamplingParams(temperature=float("nan"))):
        assert unsorted_path(off) is None, off
