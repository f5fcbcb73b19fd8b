"""Sweep of the Triton backend's linear-layer paths on the GPU, at the decode and prefill shapes of
DS4 Flash, through the backend's own ops (so the numbers are what a forward pass gets).

Decode (one token): Q8_0 matrix-vector products on the Q8C chunk layout (308, ds4/backends/triton/
layout.py); routed-expert gate/up in IQ2_XXS as packed-byte groups (216) or with four rows per
thread sharing x (416); Q2_K down as unrolled runs (110); `xq`: the routed experts on x and h in XQ form (418 gate/up,
111 down) through their tilings, against the float decoders (417, 110).
Each point replays a CUDA graph of calls over rotating weight copies / expert choices (8, or as
many as make COLD_L2 times the L2's size for the small shapes of `dec`), so neither Python
launches nor L2 hits flatter it: in a decode step every weight comes from HBM.
`dec` (and `decmoe`, the routed experts) times every decode product shape of the model through its
decoder variants (K-step, rows per program, warps, K split in parts, 308's rows per thread), set
through the backend's per-shape table, and --pick writes the fastest as that table
(ds4/backends/triton/mv_shapes_h200.json). `rows` reads matrices in the access pattern of a
matrix-vector kernel (rows × bytes per K-step) without its arithmetic.
Prefill (2048 tokens): dense Q8_0 and grouped-expert products: float32-decoded tiles on tf32×3,
Q8_0 blocks as bf16 integers (x in three bf16 terms), and the experts as exact integers on fp16
tensor cores with x in two fp16 terms (fp16x2, kernels_mm16.py: IQ2_XXS / Q2_K super-blocks).

`read` times kernels that only stream the same number of bytes: the floor for a product that
reads its weights once.

Every variant's output is compared with the reference variant's (relative max error); a table of
the best points goes to stdout and everything to --out (JSON).

    PYTHONPATH=. python bench/triton/tune_paths.py --out tune_paths.json [--budget 300]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch
import triton
import triton.language as tl

from ds4.backends.triton.backend import QWeight, TritonBackend
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.atomic import atomic_file
from ds4.core.quants import GGMLType as T, row_bytes
from ds4.core.tiny import preset_config

dev = "cuda"
COLD_L2 = 4  # `dec`: rotating copies of a weight make at least this many times the L2's size
g = torch.Generator(device=dev).manual_seed(0)
T0 = time.time()


def qweight(t: T, dims, copies=1):
    n = int(np.prod(dims))

    def data():
        if t == T.F16:
            return (torch.randn(n, device=dev, generator=g) / np.sqrt(dims[0])).half().view(torch.uint8)
        return _quant_blocks(t, n, 1.0 / np.sqrt(dims[0]), dev, g)

    return [QWeight.place(f"w{i}", t, dims, data()) for i in range(copies)]


def graph_time(fn, calls: int = 8, reps: int = 20) -> float:
    """Seconds per call of fn(i), i = 0..calls-1, replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for i in range(calls):
            fn(i)
    gr.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        gr.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e-3 / (reps * calls)


def event_time(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e-3 / reps


def emit(rows, r):
    rows.append(r)
    print("  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def try_variant(fn, ref, label, calls: int = 8):
    """(output of fn(0), seconds per call of fn in a CUDA graph of calls, the reference output: the
    first variant's), or None where the variant fails to build or run (printed)."""
    try:
        y = fn(0)
        ref = y.clone() if ref is None else ref
        return y, graph_time(fn, calls), ref
    except Exception as e:  # noqa: BLE001
        print(f"  {label}: {type(e).__name__} {str(e)[:300]}")
        return None


def decode_linear(be, rows, name, t, N, Kd, types, caps, bns, warps):
    ws = qweight(t, (Kd, N), 8)
    x = torch.randn(1, Kd, device=dev)
    nbytes = row_bytes(t, Kd) * N
    ref = None
    for ty, cap, BN, nw in itertools.product(types, caps, bns, warps):
        be.mv_types = {ws[0].kt: ty}
        be.mv_tune[ty] = (cap, BN, nw)
        r = try_variant(lambda i: be.linear(x, ws[i]), ref, f"{name} {ty} {cap} {BN} {nw}")
        if r is None:
            continue
        y, s, ref = r
        emit(rows, dict(part="decode", op=name, type=ty, cap=cap, BN=BN, warps=nw, us=s * 1e6,
                         GBps=nbytes / s / 1e9, err=rel(y, ref)))


@triton.jit
def _read_kernel(src, out, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Streams STEPS blocks of int32 words per program and keeps one word: the floor of a kernel
    that only reads its weights (no decode, no activations)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK * STEPS + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(STEPS):
        acc ^= tl.load(src + offs + i * BLOCK, mask=offs + i * BLOCK < n_words, other=0)
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def weight_bytes(kind: str, ttype, N: int, Kd: int, slots: int = 1) -> int:
    """Bytes of weights one decode product of this shape reads (gateup: the gate and the up)."""
    return row_bytes(ttype, Kd) * N * slots * (2 if kind == "gateup" else 1)


def cold_copies(nbytes: int, least: int = 8) -> int:
    """Rotating copies of a weight of nbytes that keep each call's weights out of the L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(least, -(-COLD_L2 * l2 // nbytes))


def decode_variants(be, rows, kind, ttype, N, Kd, variants, copies=8, group_rows=0, NE=256):
    """One decode product shape through every (decoder, tuning) variant, set in the backend's
    per-shape table exactly as the forward pass looks it up. kind: linear (group_rows: grouped
    rows), gateup (Q8_0: the shared expert; else 6 routed experts of NE), down (6 routed).
    copies: at least that many rotating copies, more where they would fit in the L2."""
    routed = kind == "down" or (kind == "gateup" and ttype != T.Q8_0)
    ne = NE if routed else 1
    if not routed:
        copies = cold_copies(weight_bytes(kind, ttype, N, Kd), copies)
    ws = qweight(ttype, (Kd, N, ne) if routed else (Kd, N), copies)
    key = (kind, ws[0].kt, N, Kd)
    us = qweight(ttype, (Kd, N, ne) if routed else (Kd, N), copies) if kind == "gateup" else ws
    x = torch.randn(1, Kd * (N // group_rows if group_rows else 1), device=dev)
    h = torch.randn(6, Kd, device=dev)
    rng = np.random.default_rng(0)
    ids = [torch.tensor(rng.choice(NE, 6, replace=False)[None], dtype=torch.int32, device=dev) for _ in range(8)]
    wts = torch.rand(1, 6, device=dev)
    slots = 6 if routed else 1
    nbytes = weight_bytes(kind, ttype, N, Kd, slots)

    def fn(i):
        w, u = ws[i % copies], us[i % copies]
        if kind == "gateup":
            return be._gateup_mv(x, w, u, ids[i] if routed else None, wts if routed else None, slots, slots, 10.0)
        if kind == "down":
            return be._down_mv(h, ids[i], w, 1, 6)
        if group_rows:
            return be._linear(x, w, group_rows=group_rows, group_stride=Kd)
        return be.linear(x, w)

    ref = None
    name = f"{kind} {ttype.name} {N}x{Kd}"
    for v in variants:
        be.mv_shapes[key] = tuple(v)
        r = try_variant(fn, ref, f"{name} {v}", calls=8 if routed else copies)
        if r is None:
            continue
        y, s, ref = r
        emit(rows, dict(part="decode", op=name, key=",".join(str(k) for k in key), type=v[0], cap=0,
                        BN=list(v[1:]), warps=0, us=s * 1e6, GBps=nbytes / s / 1e9, err=rel(y, ref), copies=copies))
    del be.mv_shapes[key]


def pick(rows, path):
    """The per-shape table of the fastest variants (those within 1e-5 of the first): JSON for
    DS4_TRITON_MV_SHAPES / ds4/backends/triton/mv_shapes_h200.json."""
    best = {}
    for r in rows:
        if r.get("key") and r["err"] < 1e-5 and (r["key"] not in best or r["us"] < best[r["key"]]["us"]):
            best[r["key"]] = r
    table = {k: [r["type"], *r["BN"]] for k, r in sorted(best.items())}
    json.dump(dict(device=torch.cuda.get_device_name(0), shapes=table,
                   us={k: round(r["us"], 2) for k, r in sorted(best.items())}), open(path, "w"), indent=1)
    print(f"picked {len(table)} shapes -> {path}")


# (decoder, K-step, rows per program, warps, K split(, rows per thread)); the Q8C points are those
# that won some shape in an earlier per-shape probe, and K splits of them for the few-row shapes
Q8_VARIANTS = ([(308, 256, 8, 4, 1, 1), (308, 256, 16, 4, 1, 2), (308, 256, 16, 4, 1, 4), (308, 512, 4, 2, 1, 4),
                (308, 512, 8, 4, 1, 4), (308, 1024, 4, 4, 1, 4), (308, 1024, 2, 4, 1, 2), (308, 2048, 2, 4, 1, 2),
                (308, 4096, 2, 8, 1, 2)]
               + [(308, 512, 4, 2, sp, 4) for sp in (2, 4)] + [(308, 1024, 4, 4, sp, 4) for sp in (2, 4)]
               + [(308, 256, 8, 4, 4, 1), (308, 1024, 2, 4, 2, 2)])
F16_VARIANTS = [(1, c, b, w, sp) for c, b, w, sp in ((512, 4, 4, 1), (512, 4, 4, 2), (512, 4, 4, 4), (512, 8, 4, 4),
                                                     (1024, 4, 4, 4), (256, 16, 4, 8), (1024, 2, 4, 1))]
GATEUP_VARIANTS = [(416, 1024, 32, 4, sp) for sp in (1, 2, 4)]
DOWN_VARIANTS = [(110, 1024, 8, 4, sp) for sp in (1, 2, 4)] + [(110, 1024, 16, 4, 2)]


@triton.jit
def _read_rows_kernel(src, out, RW, NR, BN: tl.constexpr, SW: tl.constexpr):
    """Streams BN rows of RW int32 words (a matrix's row-major bytes) SW words per row per step:
    the access pattern of a matrix-vector kernel without its arithmetic."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rw = rows.to(tl.int64)[:, None] * RW
    kk = tl.arange(0, SW)[None, :]
    acc = tl.zeros([BN, SW], tl.int32)
    for k in range(0, RW, SW):
        acc ^= tl.load(src + rw + k + kk, mask=(rows[:, None] < NR) & (k + kk < RW), other=0)
    tl.store(out + pid, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


def read_rows(rows_out, name, NR, RB, copies=8):
    """Time of reading an NR × RB-byte matrix in the access pattern of BN rows × S bytes per step."""
    RW = RB // 4
    bufs = [torch.randint(0, 1 << 30, (NR * RW,), dtype=torch.int32, device=dev) for _ in range(copies)]
    nbytes = NR * RB
    for BN, SW, warps in ((16, 64, 4), (64, 64, 4), (16, 256, 4), (8, 256, 4), (4, 512, 4), (2, 1024, 4),
                          (1, 1024, 4), (1, 2048, 8), (32, 128, 4)):
        grid = (NR + BN - 1) // BN
        out = torch.empty(grid, dtype=torch.int32, device=dev)
        s = graph_time(lambda i: _read_rows_kernel[(grid,)](bufs[i % copies], out, RW, NR, BN=BN, SW=SW, num_warps=warps))
        emit(rows_out, dict(part="decode", op=f"read rows {name}", type="read", cap=4 * SW, BN=BN, warps=warps,
                            us=s * 1e6, GBps=nbytes / s / 1e9, err=0.0))


def read_floor(rows, name, nbytes, copies=8):
    """Time of a pure read of nbytes (8 rotating buffers, one CUDA graph), at a few grid shapes."""
    n = nbytes // 4
    bufs = [torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device=dev) for _ in range(copies)]
    for BLOCK, STEPS, warps in ((1024, 1, 4), (1024, 4, 4), (2048, 4, 8), (4096, 4, 8), (4096, 8, 8)):
        grid = (n + BLOCK * STEPS - 1) // (BLOCK * STEPS)
        out = torch.empty(grid, dtype=torch.int32, device=dev)
        s = graph_time(lambda i: _read_kernel[(grid,)](bufs[i % copies], out, n, BLOCK=BLOCK, STEPS=STEPS, num_warps=warps))
        emit(rows, dict(part="decode", op=f"read {name}", type="read", cap=BLOCK * STEPS, BN=grid, warps=warps,
                         us=s * 1e6, GBps=nbytes / s / 1e9, err=0.0))


def decode_moe(be, rows, kind, types, caps, bns, warps, NE=256):
    E, F = 4096, 2048
    gate = qweight(T.IQ2_XXS, (E, F, NE))[0]
    up = qweight(T.IQ2_XXS, (E, F, NE))[0]
    down = qweight(T.Q2_K, (F, E, NE))[0]
    x = torch.randn(1, E, device=dev)
    rng = np.random.default_rng(0)
    ids = [torch.tensor(rng.choice(NE, 6, replace=False)[None], dtype=torch.int32, device=dev) for _ in range(8)]
    wts = torch.rand(1, 6, device=dev)
    tt = int(T.IQ2_XXS) if kind == "gateup" else int(T.Q2_K)
    nbytes = 6 * (2 * F * gate.RB if kind == "gateup" else E * down.RB)
    ref = None
    base = dict(be.mv_types)
    h = torch.randn(6, F, device=dev)
    for ty, cap, BN, nw in itertools.product(types, caps, bns, warps):
        be.mv_types = {**base, tt: ty}
        be.mv_tune[ty] = (cap, BN, nw)
        if kind == "gateup":
            def fn(i):
                return be._gateup_mv(x, gate, up, ids[i], wts, 6, 6, 10.0)
        else:
            def fn(i):
                return be._down_mv(h, ids[i], down, 1, 6)
        r = try_variant(fn, ref, f"moe {kind} {ty} {cap} {BN} {nw}")
        if r is None:
            continue
        y, s, ref = r
        emit(rows, dict(part="decode", op=f"moe_{kind}", type=ty, cap=cap, BN=BN, warps=nw, us=s * 1e6,
                         GBps=nbytes / s / 1e9, err=rel(y, ref)))


# the routed experts on x and h in XQ form (418 gate/up, 111 down) against the float decoders
# (bench/triton/README.md, "What was tried", has the variants that were not kept)
XQ_GATEUP_VARIANTS = [(418, c, b, w, sp) for c, b, w, sp in (
    (1024, 32, 4, 1), (1024, 16, 4, 1), (1024, 16, 2, 1), (512, 32, 4, 1), (512, 16, 4, 1), (2048, 16, 4, 1),
    (2048, 32, 8, 1), (1024, 32, 4, 2), (1024, 16, 4, 2), (512, 16, 2, 2), (1024, 64, 8, 1))] + [(417, 1024, 32, 4, 1)]
XQ_DOWN_VARIANTS = [(111, c, b, w, sp) for c, b, w, sp in (
    (1024, 8, 4, 1), (1024, 4, 4, 1), (1024, 8, 4, 2), (1024, 16, 4, 2), (2048, 8, 4, 1), (2048, 4, 2, 1),
    (512, 8, 4, 1), (1024, 8, 2, 1), (1024, 4, 2, 2), (2048, 16, 8, 2), (512, 4, 2, 1))] + [(110, 1024, 8, 4, 1)]


def decode_xq(be, rows, NE=256):
    """The routed gate/up and down of one decode token through the per-shape table, as
    TritonBackend._routed_mv launches them (x and h in XQ form for 418 / 111; the gate/up also
    stores h in XQ form), each product timed alone."""
    E, F = 4096, 2048
    gate = qweight(T.IQ2_XXS, (E, F, NE))[0]
    up = qweight(T.IQ2_XXS, (E, F, NE))[0]
    down = qweight(T.Q2_K, (F, E, NE))[0]
    x = torch.randn(1, E, device=dev)
    h = torch.randn(6, F, device=dev) * 0.1
    rng = np.random.default_rng(0)
    ids = [torch.tensor(rng.choice(NE, 6, replace=False)[None], dtype=torch.int32, device=dev) for _ in range(8)]
    wts = torch.rand(1, 6, device=dev)
    xq, hq = be._xq(x), be._xq(h)
    hq_out = be._xq_new(6, F)
    for kind, w, variants, nbytes in (("gateup", gate, XQ_GATEUP_VARIANTS, 6 * 2 * F * gate.RB),
                                      ("down", down, XQ_DOWN_VARIANTS, 6 * E * down.RB)):
        key = (kind, w.kt, w.N, w.K)
        ref = None
        for v in variants:
            be.mv_shapes[key] = tuple(v)
            c = be._mv_cfg(w.kt, w.N, w.K, 6 if kind == "gateup" else 1, kind=kind, xq=True)
            if kind == "gateup":
                def fn(i):
                    return be._gateup_mv(x, gate, up, ids[i], wts, 6, 6, 10.0, c=c, xq=xq, hq=hq_out)
            else:
                def fn(i):
                    return be._down_mv(h, ids[i], down, 1, 6, c=c, hq=hq)
            r = try_variant(fn, ref, f"xq {kind} {v}")
            if r is None:
                continue
            y, sec, ref = r
            emit(rows, dict(part="decode", op=f"xq_{kind}", key=",".join(str(k) for k in key), type=v[0], cap=0,
                            BN=list(v[1:]), warps=0, us=sec * 1e6, GBps=nbytes / sec / 1e9, err=rel(y, ref),
                            prefetch=be.mv_prefetch))
        del be.mv_shapes[key]


def prefill_linear(be, rows, M, N, Kd, tiles, units):
    w = qweight(T.Q8_0, (Kd, N))[0]
    x = torch.randn(M, Kd, device=dev)
    flops = 2 * M * N * Kd
    be.prec = "tf32x3"
    be.mm_tile = (64, 64, 8)
    ref = be.linear(x, w).clone()
    s = event_time(lambda: be.linear(x, w))
    emit(rows, dict(part="prefill", op=f"q8 {N}x{Kd}", prec="tf32x3", tile=[64, 64, 8], ms=s * 1e3,
                     TFLOPS=flops / s / 1e12, err=0.0))
    be.prec = "bf16x3"
    for tile, u in itertools.product(tiles, units):
        be.mm_tile, be.units_per_step = tile, u
        try:
            y = be.linear(x, w)
            s = event_time(lambda: be.linear(x, w))
        except Exception as e:  # noqa: BLE001
            print(f"  mm {tile} {u}: {type(e).__name__} {str(e)[:200]}")
            continue
        emit(rows, dict(part="prefill", op=f"q8 {N}x{Kd}", prec="bf16x3", tile=list(tile), units=u, ms=s * 1e3,
                         TFLOPS=flops / s / 1e12, err=rel(y, ref)))


def prefill_moe(be, rows, M, gus, downs, units, mm16_tiles, NE=256):
    E, F = 4096, 2048
    gate = qweight(T.IQ2_XXS, (E, F, NE))[0]
    up = qweight(T.IQ2_XXS, (E, F, NE))[0]
    down = qweight(T.Q2_K, (F, E, NE))[0]
    x = torch.randn(M, E, device=dev)
    ids = torch.stack([torch.randperm(NE, device=dev, generator=g)[:6] for _ in range(M)]).to(torch.int32)
    wts = torch.rand(M, 6, device=dev)
    flops = 2 * M * 6 * 3 * E * F
    be.prec = "tf32x3"
    be.moe_int16 = False
    be.moe_tile = {"gateup": (32, 8), "down": (64, 8)}
    ref = be.moe(x, ids, wts, gate, up, down, 3).clone()
    s = event_time(lambda: be.moe(x, ids, wts, gate, up, down, 3), reps=3)
    emit(rows, dict(part="prefill", op="moe", prec="tf32x3", gateup=[32, 8], down=[64, 8], ms=s * 1e3,
                     TFLOPS=flops / s / 1e12, err=0.0))
    be.prec = "bf16x3"
    for gu, dn, u in itertools.product(gus, downs, units):
        be.moe_tile = {"gateup": gu, "down": dn}
        be.units_per_step = u
        try:
            y = be.moe(x, ids, wts, gate, up, down, 3)
            s = event_time(lambda: be.moe(x, ids, wts, gate, up, down, 3), reps=3)
        except Exception as e:  # noqa: BLE001
            print(f"  moe mm {gu} {dn} {u}: {type(e).__name__} {str(e)[:200]}")
            continue
        emit(rows, dict(part="prefill", op="moe", prec="bf16x3", gateup=list(gu), down=list(dn), units=u,
                         ms=s * 1e3, TFLOPS=flops / s / 1e12, err=rel(y, ref)))
    be.moe_int16 = True  # exact integers on fp16 tensor cores (kernels_mm16.py)
    for tile in mm16_tiles:
        be.moe16_tile = {"gateup": tile, "down": tile}
        try:
            y = be.moe(x, ids, wts, gate, up, down, 3)
            s = event_time(lambda: be.moe(x, ids, wts, gate, up, down, 3), reps=3)
        except Exception as e:  # noqa: BLE001
            print(f"  moe mm16 {tile}: {type(e).__name__} {str(e)[:200]}")
            continue
        emit(rows, dict(part="prefill", op="moe", prec="fp16x2", tile=list(tile), ms=s * 1e3,
                         TFLOPS=flops / s / 1e12, err=rel(y, ref)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_paths.json")
    ap.add_argument("--parts", default="read,rows,dec,q8,gateup,down,mm,moe")
    ap.add_argument("--pick", default="", help="write the per-shape table of the fastest decode variants here")
    ap.add_argument("--dec-max-mb", type=float, default=float("inf"),
                    help="`dec`: only the shapes whose weights are at most this many MB")
    a = ap.parse_args()
    cfg = preset_config("flash")
    be = TritonBackend(cfg, numerics="exact", cuda_graphs=False)
    be.mv_shapes = {}
    rows: list[dict] = []
    parts = a.parts.split(",")
    def save():
        with atomic_file(a.out, "w", private=False) as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)

    if "q8" in parts:
        for name, N, Kd in (("q8 wo_b 4096x8192", 4096, 8192), ("q8 wq_b 32768x1024", 32768, 1024),
                            ("q8 wo_a 8192x4096", 8192, 4096)):
            decode_linear(be, rows, name, T.Q8_0, N, Kd, [308], [256, 512, 1024], [4, 8, 16], [2, 4])
            print(f"[{time.time() - T0:.0f}s] {name}", flush=True)
            save()
    if "dec" in parts:  # every decode product shape of the model, each through its variants
        q8 = (("linear", 4096, 8192, {}), ("linear", 32768, 1024, {}), ("linear", 8192, 4096, dict(group_rows=1024)),
              ("linear", 129280, 4096, dict(copies=3)), ("linear", 1024, 4096, {}), ("linear", 512, 4096, {}),
              ("linear", 4096, 2048, {}), ("gateup", 2048, 4096, {}))
        mb = a.dec_max_mb * 1e6
        for kind, N, Kd, kw in q8:
            if weight_bytes(kind, T.Q8_0, N, Kd) > mb:
                continue
            decode_variants(be, rows, kind, T.Q8_0, N, Kd, Q8_VARIANTS, **kw)
            print(f"[{time.time() - T0:.0f}s] {kind} {N}x{Kd}", flush=True)
            save()
        for N, Kd in ((1024, 4096), (8192, 1024), (512, 4096), (256, 4096), (64, 4096)):
            if weight_bytes("linear", T.F16, N, Kd) > mb:
                continue
            decode_variants(be, rows, "linear", T.F16, N, Kd, F16_VARIANTS)
        print(f"[{time.time() - T0:.0f}s] f16", flush=True)
        save()
        if a.pick:
            pick(rows, a.pick)
        if "decmoe" in parts:  # (the unrolled IQ2_XXS decoder takes tens of seconds to compile)
            decode_variants(be, rows, "gateup", T.IQ2_XXS, 2048, 4096, GATEUP_VARIANTS, copies=1)
            print(f"[{time.time() - T0:.0f}s] moe gateup", flush=True)
            decode_variants(be, rows, "down", T.Q2_K, 4096, 2048, DOWN_VARIANTS, copies=1)
            print(f"[{time.time() - T0:.0f}s] moe down", flush=True)
            save()
            if a.pick:
                pick(rows, a.pick)
    if "xq" in parts:  # 418 loading a K-step ahead (mv_prefetch), then not
        default = be.mv_prefetch
        for pf in (True, False):
            be.mv_prefetch = pf
            decode_xq(be, rows)
        be.mv_prefetch = default
        print(f"[{time.time() - T0:.0f}s] xq", flush=True)
        save()
    if "rows" in parts:  # the floor in a matrix's access pattern: rows × bytes per step
        for name, NR, RB in (("wo_b 4096x8704B", 4096, 8704), ("head 129280x4352B", 129280, 4352),
                             ("wq_b 32768x1088B", 32768, 1088)):
            read_rows(rows, name, NR, RB, copies=3 if NR * RB > 1e8 else 8)
            save()
        print(f"[{time.time() - T0:.0f}s] read rows", flush=True)
    if "read" in parts:  # the floor: the same bytes read by a kernel that does nothing else
        for name, nb in (("35.6 MB (a Q8_0 attention matrix)", 35651584), ("9.4 MB", 9437184),
                         ("563 MB (the output head)", 562954240)):
            read_floor(rows, name, nb, copies=8 if nb < 1e8 else 2)
            save()
        print(f"[{time.time() - T0:.0f}s] read", flush=True)
    if "gateup" in parts:
        be.mv_types = {int(T.Q2_K): 110}
        decode_moe(be, rows, "gateup", [216], [512], [16], [4])
        decode_moe(be, rows, "gateup", [416], [256, 512, 1024], [16, 32], [4])
        print(f"[{time.time() - T0:.0f}s] gateup", flush=True)
        save()
    if "down" in parts:
        be.mv_types = {int(T.IQ2_XXS): 216}
        decode_moe(be, rows, "down", [110], [1024], [8, 16, 32], [4])
        print(f"[{time.time() - T0:.0f}s] down", flush=True)
        save()
    if "mm" in parts:
        prefill_linear(be, rows, 2048, 4096, 4096, [(64, 128, 4)], [2])
        print(f"[{time.time() - T0:.0f}s] mm", flush=True)
        save()
    if "moe" in parts:
        prefill_moe(be, rows, 2048, [(32, 8)], [(64, 8)], [2], [(64, 64, 4, 1), (64, 128, 8, 1), (32, 64, 4, 1)])
        print(f"[{time.time() - T0:.0f}s] moe mm", flush=True)
        save()
    print("\nbest per op (err: max relative difference to the first variant)")
    for op in dict.fromkeys(r["op"] for r in rows):
        rs = [r for r in rows if r["op"] == op]
        key = (lambda r: r["us"]) if rs[0]["part"] == "decode" else (lambda r: r["ms"])
        first = rs[0]
        best = min(rs, key=key)
        for r in (first, best):
            print("  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        if rs[0]["part"] == "decode":  # best per decoded type
            for ty in dict.fromkeys(r["type"] for r in rs):
                b = min((r for r in rs if r["type"] == ty), key=key)
                print(f"    type {ty}: {b['us']:.1f} us {b['GBps']:.0f} GB/s cap={b['cap']} BN={b['BN']} w={b['warps']}"
                      f" err={b['err']:.2g}")
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
