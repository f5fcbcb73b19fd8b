"""Probe: the routed experts' Q2_K down product of a decode step (6 experts × 4096 rows × 2048
values, 16.5 MB of Q2_K blocks) on Q2S (layout.py), decoder 113 against 111, on h in XQ form.

Both decoders read the same Q2S tensor through the backend (`_down_mv`, the launch parameters
from `_mv_cfg` with a per-shape entry for each tiling). 111 takes a 64-value unit of one row per
tile element (four word loads of quants, a load per scale byte, two for d and dmin); 113 a
128-value half of a block of R rows (two 16-byte loads of quants, one 8-byte load of scales, one
word of d and dmin per row; x loaded once for the R rows). Each call's 6 experts differ from the
7 calls before it (48 experts, 132 MB: more than the 60 MB L2), timed as one CUDA graph of 8
calls (tune_paths.graph_time). Every variant is checked against the float64 product of the
dequantized experts (numpy's decode of the GGUF bytes) with the h the XQ words stand for.
--pick writes the shipped per-shape table with the fastest 113 tiling (what the benchmark of
the same call then ran, DS4_TRITON_MV_SHAPES).

    PYTHONPATH=.:bench/triton python bench/triton/q2s_down_probe.py --out q2s_down_probe.json

The committed results also hold variants of 113 measured with code that is not kept
(bench/triton/results_h200/q2s/, README there): "113 IS=0" (a K-step loop counted at run time),
"113 PF=0" (each slot's weights loaded after the slot before computed), "113 RT" (the tile
[halves, row sets]: a warp's lanes along rows; code_rt_pf.diff has the last two), and runs 1-3
the code before the slots added into one tile (a reduction per slot).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from ds4.backends.triton import backend as B
from ds4.backends.triton.backend import QWeight, TritonBackend
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.quants import GGMLType as T
from ds4.core.quants import dequantize_rows
from ds4.core.tiny import preset_config

dev = "cuda"
TABLE = os.path.join(os.path.dirname(B.__file__), "mv_shapes_h200.json")  # the shipped per-shape table
# (K-step values, rows per program, warps, K parts, rows per thread)
TILES_113 = [(2048, 8, 2, 1, 2), (2048, 4, 2, 1, 1), (2048, 4, 1, 1, 2), (2048, 8, 4, 1, 1), (2048, 16, 2, 1, 4),
             (2048, 16, 4, 1, 2), (1024, 8, 2, 2, 2), (1024, 4, 1, 2, 1), (512, 8, 1, 4, 1), (512, 16, 2, 4, 2)]
TILES_111 = [(1024, 4, 2, 2), (1024, 8, 4, 2), (1024, 4, 2, 1)]


def xq_values(words: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The values [n, K] that XQ words [n, K/2] and block scales [n, K/32] stand for (the layout
    of kernels._xq_store: per 8 values j, words 4j, 4j+1 hi bytes of values 8j..8j+7, 4j+2, 4j+3
    their lo bytes)."""
    n = words.shape[0]
    b = words.reshape(n, -1, 4, 4).view(np.int8).reshape(n, -1, 4, 4, 4)  # [n, block, j, word, byte]
    hi = b[:, :, :, 0:2].reshape(n, -1, 4, 8).astype(np.int64)
    lo = b[:, :, :, 2:4].reshape(n, -1, 4, 8).astype(np.int64)
    q = (256 * hi + lo).reshape(n, -1, 32)
    return (q * scales[:, :, None].astype(np.float64)).reshape(n, -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="q2s_down_probe.json")
    ap.add_argument("--pick", default="", help="write the shipped per-shape table with the fastest 113 tiling here")
    a = ap.parse_args()
    T0 = time.time()
    from tune_paths import emit, graph_time

    g = torch.Generator(device=dev).manual_seed(0)
    cfg = preset_config("flash")
    be = TritonBackend(cfg, numerics="exact", cuda_graphs=False)
    E, F, NE, k, calls = 4096, 2048, 48, 6, 8  # DS4 Flash: model width, expert rows; experts probed, used
    raw = _quant_blocks(T.Q2_K, NE * E * F, 1.0 / np.sqrt(F), dev, g)
    RB = F // 256 * 84
    down = QWeight.place("down", T.Q2_K, (F, E, NE), raw)  # (Q2S is a new tensor: raw stays GGUF blocks)
    ids = [torch.tensor([(6 * i + j) % NE for j in range(k)], device=dev, dtype=torch.int32).view(1, k)
           for i in range(calls)]
    h = torch.randn(k, F, device=dev) * 0.1
    hq = be._xq(h)
    hx = xq_values(hq[0].cpu().numpy(), hq[1].cpu().numpy())  # [k, F] float64
    want = np.zeros(E)
    rawh = raw.cpu().numpy()
    for j, e in enumerate(ids[0][0].tolist()):
        w = dequantize_rows(rawh[e * E * RB:(e + 1) * E * RB].reshape(E, RB), T.Q2_K, F).astype(np.float64)
        want += w @ hx[j]
    scale = np.abs(want).max()
    nbytes = k * E * RB + 4 * k * F
    rows: list[dict] = []
    key = ("down", int(T.Q2_K), E, F)

    def measure(path, tile):
        be.mv_shapes = {key: tile}
        try:
            c = be._mv_cfg(T.Q2_K, E, F, 1, kind="down", xq=True)
            launch = lambda i: be._down_mv(h, ids[i], down, 1, k, c=c, hq=hq)  # noqa: E731
            got = launch(0).double().cpu().numpy()[0]
            err = float(np.abs(got - want).max() / scale)
            s = graph_time(launch, calls=calls)
        except Exception as e:  # noqa: BLE001
            print(f"  {path} {tile}: {type(e).__name__} {str(e)[:300]}", flush=True)
            return
        emit(rows, dict(path=path, tile=list(tile), cfg={x: c[x] for x in ("BN", "NB", "VA", "S", "num_warps")},
                        us=s * 1e6, GBps=nbytes / s / 1e9, err=err))

    for t in TILES_111:
        measure("111", (111,) + t)
    for t in TILES_113:
        measure("113", (113,) + t)
    res = dict(device=torch.cuda.get_device_name(0), shape=[k, E, F], nbytes=nbytes, rows=rows)
    json.dump(res, open(a.out, "w"), indent=1)
    if a.pick:  # the shipped per-shape table with the fastest 113 tiling for this shape
        best = min((r for r in rows if r["path"] == "113"), key=lambda r: r["us"])
        table = json.load(open(TABLE))
        table["shapes"][",".join(map(str, key))] = best["tile"]
        table["us"][",".join(map(str, key))] = round(best["us"], 2)
        json.dump(table, open(a.pick, "w"), indent=1)
        print(f"picked {best['tile']} ({best['us']:.2f} us) -> {a.pick}")
    print("\npath | tile | us | GB/s | err")
    for r in sorted(rows, key=lambda r: r["us"])[:12]:
        print(f"{r['path']} | {r['tile']} | {r['us']:.2f} | {r['GBps']:.0f} | {r['err']:.2g}")
    print(f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
