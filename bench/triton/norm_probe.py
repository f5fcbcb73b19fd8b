"""How the RMSNorm fused into a decode product costs, per product shape of DS4 Flash, on the GPU.

Each shape runs through the per-shape table's variants (tune_paths.Q8_VARIANTS / F16_VARIANTS),
every one a CUDA graph of 8 calls over rotating weight copies (tune_paths.graph_time):
  plain     x already normalised (what tune_paths times);
  prologue  the norm fused, K split: its scale computed by every program over all of x;
  loop      the norm fused, K whole: its scale from the x values the K loop loads.
(norm_fuse_max is lifted so that the norm stays fused.) Outputs are checked against the plain
variant's. The committed run (results_h200/decode_chain/run2_norm_probe_partials/) also has a
`partials` mode: the scale from 4 partial sums of squares left by the mHC collapse, a path
measured there and removed.

    PYTHONPATH=. python bench/triton/norm_probe.py --out norm_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from ds4.backends.triton import backend as B
from ds4.backends.triton.backend import QWeight, TritonBackend
from ds4.core.quants import GGMLType as T
from ds4.core.quants import row_bytes
from ds4.core.tiny import preset_config
from tune_paths import F16_VARIANTS, Q8_VARIANTS, dev, graph_time, qweight, rel

SHAPES = [("wq_b", T.Q8_0, 32768, 1024), ("wq_a", T.Q8_0, 1024, 4096), ("wkv", T.Q8_0, 512, 4096),
          ("router", T.F16, 256, 4096), ("compressor", T.F16, 1024, 4096), ("indexer q_b", T.F16, 8192, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="norm_probe.json")
    a = ap.parse_args()
    be = TritonBackend(preset_config("flash"), numerics="exact", cuda_graphs=False)
    be.mv_shapes = {}
    be.norm_fuse_max = 1 << 62
    rows = []
    for name, t, N, Kd in SHAPES:
        ws = qweight(t, (Kd, N), 8)
        key = ("linear", ws[0].kt, N, Kd)
        x = torch.randn(1, Kd, device=dev) * 3
        nwv = torch.rand(Kd, device=dev) + 0.5
        nw = QWeight.place("nw", T.F32, (Kd,), nwv.view(torch.uint8))
        xn = x / torch.sqrt((x.double() ** 2).mean() + be.cfg.rms_eps).float() * nwv
        nbytes = row_bytes(t, Kd) * N
        modes = {
            "plain": lambda i: be.linear(xn, ws[i]),
            "fused": lambda i: be.linear(B._Normed(x, nw), ws[i]),
        }
        for v in (Q8_VARIANTS if t == T.Q8_0 else F16_VARIANTS):
            be.mv_shapes[key] = tuple(v)
            ref = None
            line = []
            for mode, fn in modes.items():
                y = fn(0)
                ref = y.clone() if ref is None else ref
                s = graph_time(fn)
                S = be._mv_cfg(ws[0].kt, N, Kd)["S"]
                label = mode if mode != "fused" else ("loop" if S == 1 else "prologue")
                r = dict(op=name, shape=f"{N}x{Kd}", variant=list(v), mode=label, us=s * 1e6,
                         GBps=nbytes / s / 1e9, err=rel(y, ref))
                rows.append(r)
                line.append(f"{label} {s * 1e6:6.2f}")
            print(f"{name:12s} {str(list(v)):28s} " + "  ".join(line), flush=True)
        del be.mv_shapes[key]
        json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), open(a.out, "w"), indent=1)
    print("\nbest per op and mode (us)")
    for name, *_ in SHAPES:
        for mode in ("plain", "prologue", "loop"):
            rs = [r for r in rows if r["op"] == name and r["mode"] == mode and r["err"] < 1e-5]
            if rs:
                b = min(rs, key=lambda r: r["us"])
                print(f"  {name:12s} {mode:9s} {b['us']:6.2f} {b['GBps']:6.0f} GB/s {b['variant']}")


if __name__ == "__main__":
    main()
