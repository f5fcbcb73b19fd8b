"""ds4/core/rules.py against the spec's statements of each rule, written out here by hand."""

import numpy as np
import pytest

from ds4.core import rules


@pytest.mark.parametrize("m", [2, 4, 128])
def test_visible_compressed_rows_are_the_closed_windows(m):
    # §3.5: compressed row r pools positions r·m .. r·m + m − 1 and exists once the last of them
    # has been seen; the query at t sees exactly the rows that exist then.
    for t in range(0, 3 * m + 2):
        closed = sum(1 for r in range(t + 1) if r * m + m - 1 <= t)
        assert rules.visible_compressed_rows(t, m) == closed
    t = np.arange(0, 3 * m + 2)
    expect = [sum(1 for r in range(int(x) + 1) if r * m + m - 1 <= x) for x in t]
    np.testing.assert_array_equal(rules.visible_compressed_rows(t, m), expect)


def test_overlapping_lanes_take_the_spec_candidates():
    # §3.5, m = 4: candidates for dim j are rows 0..3 at lane j and rows 4..7 at lane d + j
    rng = np.random.default_rng(7)
    m, d = 4, 3
    frontier = rng.standard_normal((2 * m, 2 * d)).astype(np.float32)
    out = rules.overlapping_lanes(frontier[:m], frontier[m:], d)
    assert out.shape == (2 * m, d)
    for j in range(d):
        cand = [frontier[r, j] for r in range(m)] + [frontier[m + r, d + j] for r in range(m)]
        np.testing.assert_array_equal(out[:, j], cand)


def test_router_weights_divide_by_the_floor_and_scale():
    w = np.array([[1.0, 3.0], [0.0, 0.0], [1e-6, 1e-6]], dtype=np.float32)
    got = rules.router_weights(w, 1.5)
    floor = np.float32(6.1035e-5)  # §3.7
    np.testing.assert_allclose(got[0], [0.375, 1.125], rtol=1e-7)
    np.testing.assert_array_equal(got[1], [0.0, 0.0])
    np.testing.assert_allclose(got[2], np.float32(1e-6) / floor * np.float32(1.5), rtol=1e-6)
    assert got.dtype == np.float32


def test_mhc_split_follows_section_3_2():
    rng = np.random.default_rng(11)
    HC, n, iters, eps = 4, 3, 20, 1e-6
    mix = rng.standard_normal((n, (2 + HC) * HC)).astype(np.float32)
    scale = rng.standard_normal(3).astype(np.float32)
    base = rng.standard_normal((2 + HC) * HC).astype(np.float32)
    pre, post, comb = rules.mhc_split(mix, scale, base, HC, iters, eps)
    sig = lambda x: 1 / (1 + np.exp(-x.astype(np.float64)))  # noqa: E731
    np.testing.assert_allclose(pre, sig(mix[:, :HC] * scale[0] + base[:HC]) + eps, rtol=1e-6)
    np.testing.assert_allclose(post, 2 * sig(mix[:, HC:2 * HC] * scale[1] + base[HC:2 * HC]),
                               rtol=1e-6)
    # the Sinkhorn of §3.2 in float64, loop by loop
    for t in range(n):
        C = (mix[t, 2 * HC:].astype(np.float64) * scale[2] + base[2 * HC:]).reshape(HC, HC)
        C = np.exp(C - C.max(axis=1, keepdims=True))
        C = C / C.sum(axis=1, keepdims=True) + eps
        C = C / (C.sum(axis=0, keepdims=True) + eps)
        for _ in range(iters - 1):
            C = C / (C.sum(axis=1, keepdims=True) + eps)
            C = C / (C.sum(axis=0, keepdims=True) + eps)
        np.testing.assert_allclose(comb[t], C, rtol=1e-5, atol=1e-7)
    # the head's collapse (§3.8) is the same pre rule on HC mixes
    np.testing.assert_array_equal(rules.mhc_pre_weights(mix[:, :HC], scale[0], base[:HC], eps), pre)


def test_mlx_runs_the_same_float32_operations():
    mx = pytest.importorskip("mlx.core")
    f32 = lambda v: mx.array(np.float32(v))  # noqa: E731
    rng = np.random.default_rng(5)
    HC = 4
    mix = rng.standard_normal((5, (2 + HC) * HC)).astype(np.float32)
    scale = rng.standard_normal(3).astype(np.float32)
    base = rng.standard_normal((2 + HC) * HC).astype(np.float32)
    R = rules.bind(mx, f32)
    ref = rules.mhc_split(mix, scale, base, HC, 20, 1e-6)
    got = R.mhc_split(mx.array(mix), mx.array(scale), mx.array(base), HC, 20, 1e-6)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(np.array(b), a, rtol=2e-6, atol=1e-7)
    w = np.abs(rng.standard_normal((5, 6))).astype(np.float32)
    np.testing.assert_allclose(np.array(R.router_weights(mx.array(w), 1.5)),
                               rules.router_weights(w, 1.5), rtol=1e-6)
    frontier = rng.standard_normal((3, 8, 6)).astype(np.float32)
    np.testing.assert_array_equal(np.array(R.overlapping_lanes(mx.array(frontier[:, :4]), mx.array(frontier[:, 4:]), 3)),
                                  rules.overlapping_lanes(frontier[:, :4], frontier[:, 4:], 3))


def test_softmax_pool_per_dimension_and_empty_windows():
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((4, 3)).astype(np.float32)
    values = rng.standard_normal((4, 3)).astype(np.float32)
    scores[:, 2] = -np.inf  # a dimension with no score yet pools to 0 (§3.5)
    got = rules.softmax_pool(scores, values, 0)
    for j in range(2):
        s = scores[:, j].astype(np.float64)
        e = np.exp(s - s.max())
        np.testing.assert_allclose(got[j], (e / e.sum()) @ values[:, j], rtol=1e-6)
    assert got[2] == 0.0


def test_csa_candidates_are_the_previous_window_then_this_one():
    # §3.5, m = 4: window w pools positions 4w − 4 .. 4w − 1 at lanes 0..d−1, then 4w .. 4w + 3
    # at lanes d..2d−1
    m, d = 4, 3
    for w in range(1, 4):
        for r in range(2 * m):
            assert rules.csa_candidate_position(w, r, m) == (4 * w - 4 + r if r < 4 else 4 * w + r - 4)
            assert rules.csa_candidate_lane(r, m, d) == (0 if r < 4 else d)


def test_bind_runs_this_module_code_with_the_given_namespace():
    calls = []

    class Spy:  # numpy, recording which of its functions the rules call
        def __getattr__(self, name):
            calls.append(name)
            return getattr(np, name)

    R = rules.bind(Spy(), np.float32)
    for name in rules.RULES:
        assert getattr(R, name).__code__ is getattr(rules, name).__code__
    c = np.random.default_rng(2).standard_normal((2, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(R.sinkhorn(c, 3, 1e-6), rules.sinkhorn(c, 3, 1e-6))
    assert calls.count("sum") == 6 and "exp" in calls and rules.xp is np


def test_every_function_of_the_module_is_a_bound_rule():
    # a rule left out of RULES would stay numpy's in every bound copy
    import inspect

    defined = {n for n, f in vars(rules).items() if inspect.isfunction(f) and f.__module__ == rules.__name__}
    assert defined - {"bind"} == set(rules.RULES)
