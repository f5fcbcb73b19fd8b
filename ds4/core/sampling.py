"""Next-token sampling, the way ds4 does it (spec §6: `sample_top_p_min_p`, `sample_full_vocab`).

Three paths, picked by the (normalized) parameters:

* temperature <= 0: greedy, the first index of the maximum; no random draw.
* top_k <= 0 and top_p >= 1 (the default): relative probabilities `p_i = exp((l_i - l_max)/T)`,
  so the best token has p = 1; min-p drops `p_i < min_p`; one draw `r = U·Σp` picks the token by
  scanning ids in ascending order.
* otherwise the candidates are sorted by logit, descending (ties: lower id first) -- all finite
  logits, or only the top_k -- and a prefix of them is kept: while `p_i/Σ >= (p_0/Σ)·min_p` (the
  first always stays) and until the cumulative mass reaches top_p. One draw picks inside the prefix
  in sorted order. Σ is the mass of every sorted candidate: the whole vocabulary without top_k,
  only the top_k with it.

Randomness is ds4's xorshift64* stream (`Rng`). One sample with T > 0 consumes exactly one
uniform, except where ds4 consumes none (min_p > 1 on the default path leaves nothing to draw
from, and ds4 returns the best token); matching that keeps a seeded stream in step with ds4.

Non-finite logits (-inf masks, and NaN/+inf, which ds4's `isfinite` test also skips) are never
candidates. A vector with no finite logit at all is a bug upstream: ValueError, where ds4 would
quietly return token 0.

Numerics against ds4's float32 C code. The parameters are rounded to float32 first, as ds4 holds
them (top_p=0.9 is 0.899999976, min_p=0.05 is 0.0500000007), and U is a 24-bit fraction, exact
in both. Everything after that is float64 here and float32 in ds4, so a draw can differ only
where float32 rounding moves a decision across a boundary:
* `expf` and the sequential float32 Σ make ds4's p_i and Σ differ from ours by ~1e-7 relative;
  a draw r that falls within that distance of a cumulative-mass boundary picks the neighbouring
  token. ds4 also subtracts p_i from r one by one, where we compare r with a running sum.
* a token whose p_i (or p_i/Σ) lies within float32 rounding of the min-p threshold may be kept
  by one and dropped by the other.
* the top_p stop `cumulative/Σ >= top_p`: float32 reaches top_p (notably 1.0 on the top_k path
  with top_p = 1, where ds4 can cut a tail of tiny probabilities) a little earlier than float64.
* ties in the sort: ds4 used `qsort`, whose order among equal logits the C standard leaves open
  (glibc happens to merge-sort stably); here the order is defined, lower id first.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

TOP_K_MAX = 1024  # ds4 keeps the top_k candidates in a fixed array of this size
_NUCLEUS_GUESS = 1024  # how many of the best tokens the top_p path sorts before sorting them all

_MASK64 = (1 << 64) - 1
_XORSHIFT_ZERO_STATE = 0x9E3779B97F4A7C15  # xorshift never leaves state 0, so ds4 replaces it
_XORSHIFT_MULTIPLIER = 0x2545F4914F6CDD1D


@dataclass(frozen=True)
class SamplingParams:
    """ds4's sampling knobs; the defaults are ds4's (ds4.h), min_p = 0.05 included."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.05

    def normalized(self) -> SamplingParams:
        """The clamps ds4 applies before sampling (a NaN top_p or min_p is treated as off)."""
        top_p = self.top_p if 0.0 < self.top_p <= 1.0 else 1.0
        min_p = self.min_p if self.min_p >= 0.0 else 0.0
        top_k = min(self.top_k, TOP_K_MAX)
        return dataclasses.replace(self, top_p=top_p, min_p=min_p, top_k=top_k)


GREEDY = SamplingParams(temperature=0.0)


class Rng:
    """xorshift64*, bit for bit ds4's `rng_next` / `rng_f32`.

    `state` is the whole generator: a session saves it and restores it to resume the stream.
    """

    __slots__ = ("_state",)

    def __init__(self, seed: int) -> None:
        self._state = int(seed) & _MASK64

    @property
    def state(self) -> int:
        return self._state

    @state.setter
    def state(self, value: int) -> None:
        self._state = int(value) & _MASK64

    def next_u64(self) -> int:
        x = self._state or _XORSHIFT_ZERO_STATE
        x ^= x >> 12
        x ^= (x << 25) & _MASK64
        x ^= x >> 27
        self._state = x
        return (x * _XORSHIFT_MULTIPLIER) & _MASK64

    def uniform(self) -> float:
        """U in [0, 1): the top 24 bits of the output, as ds4 turns them into a float."""
        return ((self.next_u64() >> 40) & 0xFFFFFF) / 16777216.0


def argmax(logits) -> int:
    """First index of the largest finite logit (what T <= 0 samples)."""
    x = _as_logits(logits)
    finite = np.isfinite(x)
    if finite.all():
        return int(np.argmax(x))
    if not finite.any():
        raise _no_finite_logit(x)
    return int(np.argmax(np.where(finite, x, -np.inf)))


def top_candidates(logits, k: int) -> list[tuple[int, float]]:
    """The k best finite logits as (token id, logit), best first, ties to the lower id.

    Fewer than k come back when fewer logits are finite.
    """
    x = _as_logits(logits)
    if k <= 0:
        return []
    ids = np.flatnonzero(np.isfinite(x))
    if ids.size == 0:
        raise _no_finite_logit(x)
    best = ids[_top_k_order(x[ids], k)]
    return [(int(i), float(x[i])) for i in best]


def sample(logits: np.ndarray, params: SamplingParams, rng: Rng) -> int:
    """Draw the next token id from `logits` the way ds4 does (see the module docstring).

    `rng` only needs `uniform()`; it is called once per sample with T > 0 (none when greedy).
    """
    params = params.normalized()
    # ds4 holds these as C floats; rounding here makes our thresholds ds4's thresholds.
    temperature = _f32(params.temperature)
    top_p = _f32(params.top_p)
    min_p = _f32(params.min_p)
    if temperature <= 0.0:
        return argmax(logits)
    if math.isnan(temperature):
        raise ValueError("sampling temperature is NaN")

    x = _as_logits(logits)
    ids = np.flatnonzero(np.isfinite(x))
    if ids.size == 0:
        raise _no_finite_logit(x)
    vals = x[ids].astype(np.float64)

    if params.top_k > 0:
        return _sample_top_k(ids, vals, temperature, params.top_k, top_p, min_p, rng)
    if top_p >= 1.0:
        return _sample_min_p(ids, vals, temperature, min_p, rng)
    return _sample_top_p(ids, vals, temperature, top_p, min_p, rng)


def unsorted_path(params: SamplingParams) -> tuple[float, float] | None:
    """(temperature, min_p) as `sample` uses them (float32 values) where it takes a path without
    a sort: greedy (temperature <= 0), or the default min-p path with min_p <= 1, where the best
    token always stays and one uniform is drawn. None for the others (top_k, top_p < 1,
    min_p > 1, a NaN temperature). These are the paths a sampler on a device repeats."""
    params = params.normalized()
    temperature, min_p = _f32(params.temperature), _f32(params.min_p)
    if temperature <= 0.0:
        return temperature, min_p
    if math.isnan(temperature) or params.top_k > 0 or _f32(params.top_p) < 1.0 or min_p > 1.0:
        return None
    return temperature, min_p


# --- the three random paths; `ids` are the finite token ids ascending, `vals` their logits ---


def _sample_min_p(ids, vals, temperature, min_p, rng) -> int:
    """The default path: min-p relative to the best token, scan in id order."""
    p = np.exp((vals - vals.max()) / temperature)
    kept = p >= min_p
    if not kept.any():
        # Only when min_p > 1: ds4 finds Σ = 0 and returns the best token without a draw.
        return int(ids[int(np.argmax(vals))])
    ids, p = ids[kept], p[kept]
    # The running sum's last entry is Σ itself, so a draw r <= Σ always lands inside.
    return _draw_in_order(ids, np.cumsum(p), rng)


def _sample_top_p(ids, vals, temperature, top_p, min_p, rng) -> int:
    """top_p < 1 without top_k: the sorted prefix over the whole vocabulary."""
    p = np.exp((vals - vals.max()) / temperature)
    total = p.sum()
    # Only tokens that pass the min-p test can be in the prefix, so only those are sorted:
    # p_best = 1, hence the threshold (p_0/Σ)·min_p is (1/Σ)·min_p. The best stays regardless.
    candidates = p / total >= (1.0 / total) * min_p
    candidates[int(np.argmax(vals))] = True
    ids, vals, p = ids[candidates], vals[candidates], p[candidates]
    # A nucleus is usually short: sort the best few first, and everything only if it runs past
    # them (with min_p = 0 a full sort is ~20 ms of the vocabulary's 129280 logits).
    if vals.size > _NUCLEUS_GUESS:
        order = _top_k_order(vals, _NUCLEUS_GUESS)
        cumulative = _sorted_prefix_mass(p[order], total, top_p, min_p)
        if cumulative.size < order.size:
            return _draw_in_order(ids[order], cumulative, rng)
    order = np.argsort(-vals, kind="stable")
    return _draw_in_order(ids[order], _sorted_prefix_mass(p[order], total, top_p, min_p), rng)


def _sample_top_k(ids, vals, temperature, top_k, top_p, min_p, rng) -> int:
    """top_k > 0: the top_k by logit, then the same prefix rule with Σ over the top_k only."""
    order = _top_k_order(vals, top_k)
    ids, vals = ids[order], vals[order]
    p = np.exp((vals - vals[0]) / temperature)
    return _draw_in_order(ids, _sorted_prefix_mass(p, p.sum(), top_p, min_p), rng)


def _sorted_prefix_mass(p, total, top_p, min_p) -> np.ndarray:
    """The running mass of the kept prefix of `p` (sorted by logit, descending; Σ = `total`)."""
    # min-p: stop at the first token (after the first) with p_i/Σ < (p_0/Σ)·min_p.
    too_small = p[1:] / total < (p[0] / total) * min_p
    n = 1 + (int(np.argmax(too_small)) if too_small.any() else too_small.size)
    # top-p: the token that brings the cumulative mass to top_p is the last one kept.
    cumulative = np.cumsum(p[:n])
    reached = cumulative / total >= top_p
    if reached.any():
        cumulative = cumulative[: int(np.argmax(reached)) + 1]
    return cumulative


def _draw_in_order(ids, cumulative, rng) -> int:
    """One draw r = U·(kept mass), then the first token in order whose running mass reaches r."""
    r = rng.uniform() * cumulative[-1]
    return int(ids[_first_reaching(cumulative, r)])


# --- helpers ---


def _first_reaching(cumulative: np.ndarray, r: float) -> int:
    """The first j with cumulative[j] >= r, i.e. where ds4's `r -= p_j` first reaches <= 0.

    Clamped to the last entry, where ds4 also falls back.
    """
    j = int(np.searchsorted(cumulative, r, side="left"))
    return min(j, cumulative.size - 1)


def _top_k_order(vals: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest of `vals`, largest first, equal values in position order."""
    k = min(k, vals.size)
    kth_largest = np.partition(vals, vals.size - k)[vals.size - k]
    # Everything above the k-th value is in; of the values equal to it, the first ones by
    # position -- a stable sort of the (ascending) positions keeps exactly those in front.
    at_least = np.flatnonzero(vals >= kth_largest)
    return at_least[np.argsort(-vals[at_least], kind="stable")[:k]]


def _as_logits(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D vector, got shape {x.shape}")
    return x


def _no_finite_logit(x: np.ndarray) -> ValueError:
    return ValueError(
        f"cannot sample: none of the {x.size} logits is finite (all -inf or NaN), "
        "so every token is masked"
    )


def _f32(value: float) -> float:
    return float(np.float32(value))
