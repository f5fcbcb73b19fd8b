"""Sweep of the Triton backend's linear-layer paths on the GPU, at the decode and prefill shapes of
DS4 Flash, through the backend's own ops (so the numbers are what a forward pass gets).

Decode (one token): Q8_0 matrix-vector products as raw 16-byte segments (208) against 16-bit
quant pairs (108); routed-expert gate/up in IQ2_XXS as packed-byte groups (216) or with four
rows per thread sharing x (416); Q2_K down as unrolled runs (110).
Each point replays a CUDA graph of 8 calls over rotating weight copies / expert choices, so
neither Python launches nor L2 hits flatter it.
Prefill (2048 tokens): dense Q8_0 and grouped-expert products: float32-decoded tiles on tf32×3,
Q8_0 blocks as bf16 integers (x in three bf16 terms), and exact integers on fp16 tensor cores
with x in two fp16 terms (fp16x2, kernels_mm16.py: Q8_0 blocks, IQ2_XXS / Q2_K super-blocks).

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

from ds4.backends.triton import kernels as K
from ds4.backends.triton.backend import QWeight, TritonBackend
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.quants import GGMLType as T, row_bytes
from ds4.core.tiny import preset_config

dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
T0 = time.time()


def qweight(t: T, dims, copies=1):
    n = int(np.prod(dims))
    return [QWeight(f"w{i}", t, dims, _quant_blocks(t, n, 1.0 / np.sqrt(dims[0]), dev, g)) for i in range(copies)]


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


def decode_linear(be, rows, name, t, N, Kd, types, caps, bns, warps):
    ws = qweight(t, (Kd, N), 8)
    x = torch.randn(1, Kd, device=dev)
    nbytes = row_bytes(t, Kd) * N
    ref = None
    for ty, cap, BN, nw in itertools.product(types, caps, bns, warps):
        be.mv_types = {int(t): ty}
        be.mv_tune[ty] = (cap, BN, nw)
        try:
            y = be.linear(x, ws[0])
            if ref is None:
                ref = y.clone()
            s = graph_time(lambda i: be.linear(x, ws[i]))
        except Exception as e:  # noqa: BLE001
            print(f"  {name} {ty} {cap} {BN} {nw}: {type(e).__name__} {str(e)[:200]}")
            continue
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
        try:
            if kind == "gateup":
                def fn(i):
                    return be._gateup_mv(x, gate, up, ids[i], wts, 6, 6, 10.0)
            else:
                def fn(i):
                    c = be._mv_cfg(down.type, E, F, 1)
                    out = torch.empty(1, E, device=dev)
                    be._launch(K.moe_down_mv_kernel, ((E + c["BN"] - 1) // c["BN"], 1), h, ids[i], down.u8,
                               down.i16, down.f32, be._gridp, be._ksigns, out, E, F, down.RB, E * down.RB,
                               KSLOTS=6, **c)
                    return out
            y = fn(0)
            if ref is None:
                ref = y.clone()
            s = graph_time(fn)
        except Exception as e:  # noqa: BLE001
            print(f"  moe {kind} {ty} {cap} {BN} {nw}: {type(e).__name__} {str(e)[:200]}")
            continue
        emit(rows, dict(part="decode", op=f"moe_{kind}", type=ty, cap=cap, BN=BN, warps=nw, us=s * 1e6,
                         GBps=nbytes / s / 1e9, err=rel(y, ref)))


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
    be.q8_int16 = True  # x in two fp16 terms (kernels_mm16.py)
    for tile in ((64, 64, 4, 1), (64, 128, 8, 1), (128, 64, 8, 1)):
        be.q8_16_tile = {**be.q8_16_tile, "linear": tile}
        try:
            y = be.linear(x, w)
            s = event_time(lambda: be.linear(x, w))
        except Exception as e:  # noqa: BLE001
            print(f"  mm16 {tile}: {type(e).__name__} {str(e)[:200]}")
            continue
        emit(rows, dict(part="prefill", op=f"q8 {N}x{Kd}", prec="fp16x2", tile=list(tile), ms=s * 1e3,
                         TFLOPS=flops / s / 1e12, err=rel(y, ref)))
    be.q8_int16 = False


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
    ap.add_argument("--parts", default="read,q8,gateup,down,mm,moe")
    a = ap.parse_args()
    cfg = preset_config("flash")
    be = TritonBackend(cfg, numerics="exact", cuda_graphs=False)
    be.q8_segments_from = 1 << 30  # the sweep picks 108 or 208 itself
    rows: list[dict] = []
    parts = a.parts.split(",")
    def save():
        json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), open(a.out, "w"), indent=1)

    if "q8" in parts:
        for name, N, Kd in (("q8 wo_b 4096x8192", 4096, 8192), ("q8 wq_b 32768x1024", 32768, 1024),
                            ("q8 wo_a 8192x4096", 8192, 4096)):
            decode_linear(be, rows, name, T.Q8_0, N, Kd, [108], [256], [16, 32], [4, 8])
            decode_linear(be, rows, name, T.Q8_0, N, Kd, [208], [256, 512], [8, 32], [4, 8])
            print(f"[{time.time() - T0:.0f}s] {name}", flush=True)
            save()
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
