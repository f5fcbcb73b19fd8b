"""The next-token kernels of a decode step (greedy_next_kernel, sample_next_kernel) against
ds4.core.sampling's argmax and its default sampling path. Without a GPU they run under
TRITON_INTERPRET=1; with one, compiled."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from triton_pair import DEVICE  # noqa: E402
from triton_pair import rng  # noqa: E402,F401  (fixture)


def test_greedy_next_is_the_first_largest_finite_logit(rng):
    """greedy_next_kernel against sampling.argmax: the first index among equal maxima, NaN and
    ±inf never chosen; with no finite logit the host gets -1 and the next step token 0. The
    token lands in the ring at the position's remainder, and the position advances by one."""
    from ds4.core.sampling import argmax

    V = 1000
    ties = rng.integers(-3, 4, V).astype(np.float32)  # many equal maxima
    spiked = rng.standard_normal(V).astype(np.float32)
    spiked[rng.choice(V, 40, replace=False)] = np.nan
    spiked[rng.choice(V, 3, replace=False)] = np.inf
    spiked[rng.choice(V, 3, replace=False)] = -np.inf
    late = np.full(V, -np.inf, np.float32)
    late[V - 1] = -1e30  # the only finite logit, in the last lane of the partial block
    masked = np.full(V, np.nan, np.float32)
    masked[::7] = -np.inf
    for x, pos in [(rng.standard_normal(V).astype(np.float32), 42), (ties, 41), (spiked, 7), (late, 40),
                   (masked, 43)]:
        want = argmax(x) if np.isfinite(x).any() else -1
        ring, tok, after, cnt = _greedy_next(x, pos)
        assert ring == [want if i == pos % 4 else -5 for i in range(4)]
        assert tok == max(want, 0) and after == pos + 1
        assert cnt == 0  # the ticket is back to zero for the next step


def _greedy_next(x, pos, draw=None):
    """greedy_next_kernel, then sample_next_kernel with draw = (T, min_p, U) at the ring slot
    (T = 0 without), on 256-logit programs (four, the last one partial, for 1000 logits):
    (ring, token, position, ticket) after them; the slot's T is 0 after, the others' untouched."""
    from ds4.backends.triton import kernels as K

    G = 4
    best = torch.full((G,), 123.0, device=DEVICE)
    at = torch.full((G,), -9, dtype=torch.int32, device=DEVICE)
    mass = torch.full((G,), 5.0, dtype=torch.float64, device=DEVICE)
    cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    top = torch.zeros(1, device=DEVICE)
    tok = torch.full((1,), 77, dtype=torch.int32, device=DEVICE)
    p = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    ring = torch.full((4,), -5, dtype=torch.int32, device=DEVICE)
    draws = torch.full((4, 3), 9.0, dtype=torch.float64, device=DEVICE)  # other slots: T = 9
    draws[pos % 4] = torch.tensor(draw or (0.0, 0.0, 0.0), dtype=torch.float64)
    logits = torch.from_numpy(x).to(DEVICE)
    K.greedy_next_kernel[(G,)](logits, x.size, best, at, cnt, top, tok, p, ring, R=4, BLOCK=256, G=G)
    K.sample_next_kernel[(G,)](logits, x.size, mass, cnt, top, tok, p, ring, draws, R=4, BLOCK=256, G=G)
    assert draws[pos % 4, 0] == 0 and (draws[[i for i in range(4) if i != pos % 4], 0] == 9).all()
    return ring.cpu().tolist(), int(tok.item()), int(p.item()), int(cnt.item())


class _Uniform:
    def __init__(self, u):
        self.u = u

    def uniform(self):
        return self.u


def test_sample_next_is_ds4s_default_sampling_path(rng):
    """sample_next_kernel against sampling.sample on its default path (min-p relative to the best
    token, one draw scanned in id order), on random logits, some not finite, over draws U from 0
    to just below 1 and temperatures / min-p values that keep one to hundreds of tokens; the
    token lands where greedy's did (ring slot, next token)."""
    from ds4.core.sampling import SamplingParams, sample

    V = 1000
    for k, (temp, min_p) in enumerate([(1.0, 0.05), (0.7, 0.0), (2.0, 0.5), (0.25, 0.05), (1.0, 1.0)]):
        x = (rng.standard_normal(V) * 3).astype(np.float32)
        if k % 2:
            x[rng.choice(V, 30, replace=False)] = np.nan
            x[rng.choice(V, 30, replace=False)] = -np.inf
        x[rng.integers(V)] = x[np.isfinite(x)].max()  # a tie at the top
        params = SamplingParams(temperature=temp, min_p=min_p)
        t32, m32 = float(np.float32(temp)), float(np.float32(min_p))
        for u in [0.0, 1 - 2 ** -24, *rng.random(6)]:
            want = sample(x, params, _Uniform(u))
            pos = int(rng.integers(0, 1000))
            ring, tok, after, cnt = _greedy_next(x, pos, (t32, m32, u))
            assert ring[pos % 4] == want == tok, (temp, min_p, u)
            assert after == pos + 1 and cnt == 0
