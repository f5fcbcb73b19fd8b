"""Probe: decode products whose weights an L2 prefetch (l2_prefetch_kernel below) asked for
beforehand, against the same products reading DRAM.

Each point replays a CUDA graph of 8 calls over rotating weight copies (wo_a, wo_b: 8 copies of
35.6 MB; the routed experts: 8 choices of 6 of 256), each call a sequence on one stream:

    cold          spin, product                 (spin: one program waiting SPIN µs on the clock)
    spin          spin                          (subtracted from the others: the product's time)
    pf            prefetch, spin, product       (the prefetch's requests outlive its program?)
    pf_now        prefetch, product             (no time for it to land)
    pf_half       prefetch, spin / 4, product

so `product` below is the sequence's time less the spin's. For wo_a + wo_b (71 MB, more than the
50 MB L2): both prefetched before the spin, or wo_b's issued right before wo_a runs. For the
routed experts (be.moe: XQ of x, gate/up, down): the down's slices of the 6 experts, or the
gate/up's too.

On the H200 (results_h200/sched/run1_l2_prefetch/) every prefetched product was slower than the
cold one (wo_a 16.0-17.8 against 12.0 µs), so the decode step has no prefetch; this probe and
its kernel stay for the record. (That run had the same kernel in ds4/backends/triton/kernels.py,
its code.diff; moved here it was compiled for sm_90 but not run again.)

    PYTHONPATH=. python bench/triton/l2_prefetch_probe.py --out l2_prefetch_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
import tune_paths as tp  # noqa: E402

from ds4.backends.triton.backend import TritonBackend, _Normed, _cdiv  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.tiny import preset_config  # noqa: E402


# one bulk L2 prefetch of $2 bytes at $1 where $2 > 0 ($0: a dummy result); with the evict-last policy
_L2_PREFETCH = tl.constexpr("{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }")
_L2_PREFETCH_LAST = tl.constexpr("{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0; "
                                 "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                                 "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.b32 $0, 0; }")


@triton.jit
def l2_prefetch_kernel(base_ptr, nbytes, ids_ptr, stride, CHUNK: tl.constexpr, NT: tl.constexpr,
                       IDS: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    """Ask the L2 for bytes [0, nbytes) of a weight (base_ptr: uint8, 16-byte aligned), or with
    IDS those of expert ids[slot] (grid axis 1: base_ptr + ids[slot]·stride): every thread issues
    one bulk prefetch (sm_90 cp.async.bulk.prefetch.L2, served by the copy engine of the SM: no
    registers wait on it, and the program ends at once) of CHUNK bytes. A hint: nothing reads
    what it fetches but the products that follow, and they give the same results whether their
    rows then come from L2 or from DRAM. Why: a decode step's products are one chain, and while
    its small kernels run (attention, RoPE, the merge, the routing) DRAM idles; the next
    product's weights fetched then are read from L2 when it starts. EVICT_LAST: with the L2
    policy that keeps these lines past other traffic."""
    base = base_ptr
    if IDS:
        base += tl.load(ids_ptr + tl.program_id(1)).to(tl.int64) * stride
    off = (tl.program_id(0) * NT + tl.arange(0, NT)).to(tl.int64) * CHUNK
    size = (tl.minimum(nbytes - off, CHUNK) // 16 * 16).to(tl.int32)  # (a multiple of 16 bytes)
    if EVICT_LAST:
        tl.inline_asm_elementwise(_L2_PREFETCH_LAST, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        tl.inline_asm_elementwise(_L2_PREFETCH, "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def spin_kernel(out_ptr, ns):
    """One program that waits ns nanoseconds of the GPU's global timer."""
    n64 = ns.to(tl.int64)
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [n64], dtype=tl.int64, is_pure=False, pack=1)
    t = t0
    while t - t0 < n64:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [n64], dtype=tl.int64, is_pure=False,
                                      pack=1)
    tl.store(out_ptr, (t - t0).to(tl.int32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="l2_prefetch_probe.json")
    ap.add_argument("--spin-us", type=float, default=20.0)
    a = ap.parse_args()
    be = TritonBackend(preset_config("flash"), device="cuda")
    scratch = torch.zeros(16, dtype=torch.int32, device="cuda")
    rows = []

    def spin(us):
        if us > 0:
            spin_kernel[(1,)](scratch, int(us * 1000), num_warps=1)

    def pf(w, ids=None, chunk=(16384, 64), last=False):
        base = w.u8
        if ids is None:
            nb, stride, slots, ip = base.numel(), 0, 1, scratch
        else:
            stride = w.nbytes // w.n_exp
            nb, slots, ip = stride, ids.numel(), ids
        l2_prefetch_kernel[(_cdiv(nb, chunk[0] * chunk[1]), slots)](base, nb, ip, stride, CHUNK=chunk[0],
                                                                       NT=chunk[1], IDS=ids is not None,
                                                                       EVICT_LAST=last, num_warps=1)

    S = a.spin_us
    t_spin = tp.graph_time(lambda i: spin(S))
    t_spin4 = tp.graph_time(lambda i: spin(S / 4))
    tp.emit(rows, dict(op="spin", us=t_spin * 1e6))

    def point(op, label, fn, sub, nbytes):
        t = tp.graph_time(fn)
        tp.emit(rows, dict(op=op, case=label, us=(t - sub) * 1e6, GBps=nbytes / max(t - sub, 1e-9) / 1e9))

    # the attention's output products on x in XQ8 form (309, the shipped table), as q8c_xq_probe
    wa = tp.qweight(T.Q8_0, (4096, 8192), 8)
    wb = tp.qweight(T.Q8_0, (8192, 4096), 8)
    xa = _Normed(torch.randn(1, 32768, device="cuda"), None)
    xa.val = xa.x
    be._xq(xa, perm=True)
    xb = _Normed(torch.randn(1, 8192, device="cuda"), None)
    xb.val = xb.x
    be._xq(xb, perm=True)

    def mva(i):
        return be._linear(xa, wa[i], group_rows=1024, group_stride=4096)

    def mvb(i):
        return be._linear(xb, wb[i])

    nb = wa[0].nbytes
    point("wo_a", "cold", lambda i: (spin(S), mva(i)), t_spin, nb)
    for chunk in ((16384, 64), (4096, 64), (65536, 16)):
        point("wo_a", f"pf {chunk}", lambda i: (pf(wa[i], chunk=chunk), spin(S), mva(i)), t_spin, nb)
    point("wo_a", "pf evict_last", lambda i: (pf(wa[i], last=True), spin(S), mva(i)), t_spin, nb)
    point("wo_a", "pf_now", lambda i: (pf(wa[i]), mva(i)), 0.0, nb)
    point("wo_a", "pf_half", lambda i: (pf(wa[i]), spin(S / 4), mva(i)), t_spin4, nb)
    point("wo_a", "pf only (launch cost)", lambda i: (pf(wa[i]), spin(S)), t_spin, 0)
    point("wo_b", "cold", lambda i: (spin(S), mvb(i)), t_spin, nb)
    point("wo_b", "pf", lambda i: (pf(wb[i]), spin(S), mvb(i)), t_spin, nb)
    point("wo_a+wo_b", "cold", lambda i: (spin(S), mva(i), mvb(i)), t_spin, 2 * nb)
    point("wo_a+wo_b", "pf both first", lambda i: (pf(wa[i]), pf(wb[i]), spin(S), mva(i), mvb(i)), t_spin, 2 * nb)
    point("wo_a+wo_b", "pf a, then b beside a", lambda i: (pf(wa[i]), spin(S), pf(wb[i]), mva(i), mvb(i)), t_spin,
          2 * nb)
    point("wo_a+wo_b", "pf a only", lambda i: (pf(wa[i]), spin(S), mva(i), mvb(i)), t_spin, 2 * nb)
    del wa, wb
    torch.cuda.empty_cache()

    # the query's 32768-row product (309 on XQ8 x)
    wq = tp.qweight(T.Q8_0, (1024, 32768), 8)
    xq = _Normed(torch.randn(1, 1024, device="cuda"), None)
    xq.val = xq.x
    be._xq(xq, perm=True)

    def mvq(i):
        return be._linear(xq, wq[i])

    point("wq_b", "cold", lambda i: (spin(S), mvq(i)), t_spin, wq[0].nbytes)
    point("wq_b", "pf", lambda i: (pf(wq[i]), spin(S), mvq(i)), t_spin, wq[0].nbytes)
    point("wq_b", "pf_half", lambda i: (pf(wq[i]), spin(S / 4), mvq(i)), t_spin4, wq[0].nbytes)
    del wq
    torch.cuda.empty_cache()

    # the routed experts (gate/up 418 on XQ, down 111), 8 choices of 6 experts of 256
    E, F, NE = 4096, 2048, 256
    gate = tp.qweight(T.IQ2_XXS, (E, F, NE))[0]
    up = tp.qweight(T.IQ2_XXS, (E, F, NE))[0]
    down = tp.qweight(T.Q2_K, (F, E, NE))[0]
    x = torch.randn(1, E, device="cuda")
    rng = np.random.default_rng(0)
    ids = [torch.tensor(rng.choice(NE, 6, replace=False)[None], dtype=torch.int32, device="cuda") for _ in range(8)]
    wts = torch.rand(1, 6, device="cuda")
    nbe = 6 * (2 * gate.nbytes + down.nbytes) // NE

    def moe(i):
        return be.moe(x, ids[i], wts, gate, up, down, 3)

    point("routed experts", "cold", lambda i: (spin(S), moe(i)), t_spin, nbe)
    point("routed experts", "pf down", lambda i: (pf(down, ids[i]), spin(S), moe(i)), t_spin, nbe)
    point("routed experts", "pf down beside gate/up", lambda i: (pf(down, ids[i]), moe(i)), 0.0, nbe)
    point("routed experts", "pf down + gate/up", lambda i: (pf(down, ids[i]), pf(gate, ids[i]), pf(up, ids[i]),
                                                             spin(S), moe(i)), t_spin, nbe)
    point("routed experts", "no spin", lambda i: moe(i), 0.0, nbe)

    json.dump(dict(device=torch.cuda.get_device_name(0), spin_us=S, rows=rows), open(a.out, "w"), indent=1)
    print(f"\nproduct time (µs) with the spin's {t_spin * 1e6:.2f} µs taken off:")
    for r in rows:
        if "case" in r:
            print(f"{r['op']:16s} {r['case']:28s} {r['us']:8.2f} {r['GBps']:7.0f} GB/s")


if __name__ == "__main__":
    main()
