"""The Triton kernels run the core's model rules (ds4/core/rules.py), not restatements of them:
the compiled copies are the core's code objects, they give numpy's numbers under the
interpreter, and the kernels that call them compile for the H200 (sm_90) on this machine."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ds4.backends.triton.kernels.rules import rules  # noqa: E402
from ds4.core import rules as core  # noqa: E402
from seeds import rng_for_test  # noqa: E402
from sm90 import ptx_sm90  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 16  # elements of the element-wise rules' inputs
RATIO, LANE = 4, 3  # a CSA window and lane width
ITERS, EPS = 5, 1e-6


def test_every_rule_is_the_core_code():
    for name in core.RULES:
        assert getattr(rules, name).fn.__code__ is getattr(core, name).__code__, name


@triton.jit
def _rules_kernel(x_ptr, y_ptr, z_ptr, c_ptr, out_ptr, comb_ptr, scale, eps, ITERS,
                  N: tl.constexpr, RATIO: tl.constexpr, LANE: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    z = tl.load(z_ptr + i)
    tl.store(out_ptr + 0 * N + i, rules.sigmoid(x))
    tl.store(out_ptr + 1 * N + i, rules.router_scale(tl.abs(x), tl.abs(y), scale))
    tl.store(out_ptr + 2 * N + i, rules.csa_candidate_position(3, i % (2 * RATIO), RATIO).to(tl.float32))
    tl.store(out_ptr + 3 * N + i, rules.csa_candidate_lane(i % (2 * RATIO), RATIO, LANE).to(tl.float32))
    shift = rules.pool_shift(z)
    tl.store(out_ptr + 4 * N + i, shift)
    tl.store(out_ptr + 5 * N + i, rules.pool_weight(x, shift))
    tl.store(out_ptr + 6 * N + i, rules.pool_finish(x, y))
    tl.store(out_ptr + 7 * N + i, rules.visible_compressed_rows(i, RATIO).to(tl.float32))
    tl.store(out_ptr + 8 * N + i, rules.mhc_pre_weights(x, scale, y, eps))
    tl.store(out_ptr + 9 * N + i, rules.mhc_post_weights(x, scale, y))
    k = tl.arange(0, 4)
    cidx = k[:, None, None] * 16 + k[None, :, None] * 4 + k[None, None, :]
    tl.store(comb_ptr + cidx, rules.sinkhorn(tl.load(c_ptr + cidx), ITERS, eps))


def test_compiled_rules_give_numpys_numbers(request):
    rng = rng_for_test(request)
    x, y, z = (rng.standard_normal(N).astype(np.float32) for _ in range(3))
    y[::3] = 0.0  # pool_finish's empty dimensions
    z[::4] = -np.inf  # pool_shift's dimensions with no score
    c = rng.standard_normal((4, 4, 4)).astype(np.float32)
    scale, eps = np.float32(1.5), np.float32(EPS)
    dev = {k: torch.from_numpy(v).to(DEVICE) for k, v in dict(x=x, y=y, z=z, c=c).items()}
    out = torch.zeros(10 * N, device=DEVICE)
    comb = torch.zeros(64, device=DEVICE)
    _rules_kernel[(1,)](dev["x"], dev["y"], dev["z"], dev["c"], out, comb, float(scale), float(eps), ITERS,
                        N=N, RATIO=RATIO, LANE=LANE)
    got = out.cpu().numpy().reshape(10, N)
    r = np.arange(N) % (2 * RATIO)
    want = [core.sigmoid(x), core.router_scale(np.abs(x), np.abs(y), scale),
            core.csa_candidate_position(3, r, RATIO), core.csa_candidate_lane(r, RATIO, LANE),
            core.pool_shift(z), core.pool_weight(x, core.pool_shift(z)), core.pool_finish(x, y),
            core.visible_compressed_rows(np.arange(N), RATIO), core.mhc_pre_weights(x, scale, y, eps),
            core.mhc_post_weights(x, scale, y)]
    for name, g, w in zip(["sigmoid", "router_scale", "position", "lane", "pool_shift", "pool_weight",
                           "pool_finish", "visible", "pre", "post"], got, want):
        np.testing.assert_allclose(g, np.asarray(w, np.float32), rtol=2e-6, atol=0, err_msg=name)
    np.testing.assert_allclose(comb.cpu().numpy().reshape(4, 4, 4), core.sinkhorn(c, ITERS, eps), rtol=2e-6)


# The kernels that call the rules, compiled for sm_90. The one-token mHC collapse's Sinkhorn loop
# must be warp shuffles, no block barrier (the reason the kernel once held the 4 × 4 comb as 16
# scalars per thread), and at a decode step's split (128 partial sums) no more shuffles than the
# 4 × 4 tile's own layout needs (RELOAD; without it the loop takes 8).
_INT = {"pos_ptr", "tid_ptr", "tok_ptr", "ids_ptr"}
_FLOAT = {"eps", "hc_eps", "scale"}
_CASES = [("hc_finalize_kernel", dict(SPLIT=128, HC=4, NM=24, BE=256, BT=1, HEAD=False, PART=2, RELOAD=True)),
          ("hc_finalize_kernel", dict(SPLIT=4, HC=4, NM=24, BE=512, BT=1, HEAD=False, PART=0, RELOAD=True)),
          ("comp_pool_kernel", dict(M=4, D=512, C=1024, NROT=64, CSA=True, NCAND=8, RB=8, MODE=1,
                                    QS=0.04, LOGD=9, HDP=256)),
          ("router_kernel", dict(KSEL=6, KP=8, BE=256, HAS_BIAS=True, HASH=False))]


def test_rule_kernels_compile_for_sm90_with_a_barrier_free_sinkhorn():
    types = {**{a: "*i32" for a in _INT}, **{a: "fp32" for a in _FLOAT}}
    ptx = ptx_sm90([("kernels", name, cx, types, {}) for name, cx in _CASES])
    for p in ptx[:2]:  # decode's PART 2 and the whole collapse
        loop = re.findall(r"// %\.lr\.ph\n(.*?)\n\s*@%p\d+ bra", p, re.S)[0]
        assert loop.count("shfl.sync") == 4 and loop.count("div.") == 2, loop
        assert "bar.sync" not in loop and "shared" not in loop, loop
