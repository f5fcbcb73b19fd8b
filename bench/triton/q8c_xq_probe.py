"""Probe: the Q8C decode products on x in XQ8 form (decoder 309: integer dot products, 2 bytes of x
a value) against the float decoder 308 (4 bytes a value), and 308 with eight rows per thread, at
every Q8C decode shape of DS4 Flash; and what producing x in XQ8 form costs (rms_kernel with the
form beside the float result, xq_kernel for a plain x).

Each point replays a CUDA graph of 8 calls over rotating weight copies (tune_paths.graph_time).
The product alone is timed: x's XQ8 form is made once beforehand. err is the relative max
difference to the shipped table's 308 on float x (309 differs by XQ's rounding of x, about 1e-5).

    PYTHONPATH=. python bench/triton/q8c_xq_probe.py --out q8c_xq_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tune_paths as tp  # noqa: E402

from ds4.backends.triton.backend import TritonBackend, _Normed  # noqa: E402
from ds4.core.quants import GGMLType as T  # noqa: E402
from ds4.core.tiny import preset_config  # noqa: E402

# (name, rows, K, rows per group (0: none), x width)
SHAPES = [("wq_b", 32768, 1024, 0, 1024), ("wo_a", 8192, 4096, 1024, 32768), ("wo_b", 4096, 8192, 0, 8192),
          ("head", 129280, 4096, 0, 4096), ("shared down", 4096, 2048, 0, 2048), ("wq_a", 1024, 4096, 0, 4096),
          ("wkv", 512, 4096, 0, 4096)]
# (decoder, K-step, rows per program, warps, K parts, rows per thread)
VARIANTS = [(309, 256, 8, 4, 1, 1), (309, 256, 16, 4, 1, 2), (309, 256, 16, 4, 1, 4), (309, 512, 4, 2, 1, 4),
            (309, 512, 8, 4, 1, 4), (309, 512, 8, 2, 1, 8), (309, 1024, 4, 4, 1, 4), (309, 1024, 8, 4, 1, 8),
            (309, 1024, 2, 4, 1, 2), (309, 2048, 2, 4, 1, 2), (309, 2048, 4, 8, 1, 4), (309, 1024, 4, 4, 2, 4),
            (309, 1024, 4, 4, 4, 4), (309, 512, 4, 2, 4, 4), (309, 1024, 8, 4, 2, 8), (309, 256, 32, 4, 1, 8),
            (309, 512, 16, 4, 1, 8),
            (308, 1024, 8, 4, 1, 8), (308, 512, 8, 2, 1, 8), (308, 512, 16, 4, 1, 8), (308, 1024, 8, 4, 2, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="q8c_xq_probe.json")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    a = ap.parse_args()
    be = TritonBackend(preset_config("flash"), device="cuda")
    rows = []
    want = set(a.shapes.split(","))
    for name, N, Kd, gr, width in SHAPES:
        if name not in want:
            continue
        ws = tp.qweight(T.Q8_0, (Kd, N), 8 if N * Kd < 1 << 28 else 4)
        key = ("linear", ws[0].kt, N, Kd)
        shipped = be.mv_shapes.get(key)
        x = torch.randn(1, width, device="cuda")
        f = _Normed(x, None)  # x, its float value and its XQ8 form all made: the product alone is timed
        f.val = x
        be._xq(f, perm=True)
        nbytes = ws[0].RB * N
        ref = None
        for v in [shipped] + VARIANTS:
            be.mv_shapes[key] = tuple(v)

            def fn(i):
                return be._linear(f, ws[i % len(ws)], group_rows=gr, group_stride=Kd if gr else 0)

            r = tp.try_variant(fn, ref, f"{name} {v}")
            if r is None:
                continue
            y, s, ref = r
            tp.emit(rows, dict(op=name, key=",".join(str(k) for k in key), variant=list(v), shipped=v is shipped,
                               us=s * 1e6, GBps=nbytes / s / 1e9, err=tp.rel(y, ref)))
        be.mv_shapes[key] = shipped
    # producers: the RMSNorm with and without the XQ8 form beside it, xq_kernel on a plain x
    for D in (1024, 4096):
        x = torch.randn(1, D, device="cuda")
        for xq in (False, True):
            def fn(i):
                return be._rms(_Normed(x, None), be._xq_new(1, D) if xq else None, perm=xq)
            s = tp.graph_time(fn)
            tp.emit(rows, dict(op=f"rms {D}" + (" + XQ8" if xq else ""), us=s * 1e6))
    for D in (8192, 32768):
        x = torch.randn(1, D, device="cuda")
        s = tp.graph_time(lambda i: be._xq(x, perm=True))
        tp.emit(rows, dict(op=f"xq_kernel {D}", us=s * 1e6))
    json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), open(a.out, "w"), indent=1)
    print("\nbest per shape: shipped 308, best 308, best 309 (us, GB/s, err)")
    for name in dict.fromkeys(r["op"] for r in rows if "variant" in r):
        rs = [r for r in rows if r["op"] == name]
        line = [name]
        for lab, sel in (("shipped", [r for r in rs if r["shipped"]]), ("308", [r for r in rs if r["variant"][0] == 308]),
                         ("309", [r for r in rs if r["variant"][0] == 309])):
            if sel:
                b = min(sel, key=lambda r: r["us"])
                line.append(f"{lab} {b['us']:.2f} {b['GBps']:.0f} {b['err']:.1e} {b['variant']}")
        print(" | ".join(line))
    for r in rows:
        if "variant" not in r:
            print(f"{r['op']}: {r['us']:.2f} us")


if __name__ == "__main__":
    main()
