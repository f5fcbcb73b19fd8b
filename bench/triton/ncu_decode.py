"""One launch each of the decode step's heaviest products at DS4 Flash shapes, for Nsight Compute:
the routed experts' IQ2_XXS gate/up and Q2_K down on x and h in XQ form (418 / 113 on Q2S; the gate/up
with its group loads a step ahead, then without: mv_prefetch), the Q8C wo_b product (308), and
the Q2C probe's down kernel (q2k_rows_probe.py), so their stall reasons, occupancy and L1
traffic can be read side by side. (results_h200/tune_paths/ncu_decode.txt was recorded with the
416 of the time, which looked up levels and sign masks as 8-byte words. The regex below misses
matvec_kernel, whose name has no "mv_kernel": that run has no 308 section; it names matvec now.)

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --kernel-name regex:'mv_kernel|q2c|xq_kernel|matvec' python bench/triton/ncu_decode.py
"""

from __future__ import annotations

import numpy as np
import torch

from ds4.backends.triton.backend import QWeight, TritonBackend
from ds4.backends.triton.synthetic import _quant_blocks
from ds4.core.quants import GGMLType as T
from ds4.core.tiny import preset_config

import q2k_rows_probe as Q2

dev = "cuda"


def main():
    g = torch.Generator(device=dev).manual_seed(0)
    be = TritonBackend(preset_config("flash"), numerics="exact", cuda_graphs=False)
    E, F, NE, k = 4096, 2048, 16, 6
    ids = torch.arange(k, device=dev, dtype=torch.int32).view(1, k)
    wts = torch.ones(1, k, device=dev)
    x = torch.randn(1, E, device=dev)
    gate = QWeight.place("gate", T.IQ2_XXS, (E, F, NE), _quant_blocks(T.IQ2_XXS, NE * F * E, 1 / np.sqrt(E), dev, g))
    up = QWeight.place("up", T.IQ2_XXS, (E, F, NE), _quant_blocks(T.IQ2_XXS, NE * F * E, 1 / np.sqrt(E), dev, g))
    dq = _quant_blocks(T.Q2_K, NE * E * F, 1 / np.sqrt(F), dev, g)
    down = QWeight.place("down", T.Q2_K, (F, E, NE), dq)  # Q2S, a copy (dq stays GGUF blocks for q2c)
    wo_b = QWeight.place("wo_b", T.Q8_0, (8192, 4096), _quant_blocks(T.Q8_0, 8192 * 4096, 1 / 90.5, dev, g))
    for pf in (True, False):  # 418 loading a K-step ahead, then not
        be.mv_prefetch = pf
        be._routed_mv(x, gate, up, down, ids, wts, 1, k, 1e9)
    be.linear(torch.randn(1, 8192, device=dev), wo_b)
    h = be._gateup_mv(x, gate, up, ids, wts, k, k, 1e9)
    dc = Q2.q2c(dq, NE * E, F)
    out = torch.empty(1, E, device=dev)
    RW = F // 256 * 84 // 4
    Q2.q2c_down_kernel[(E // 8, 1)](h, ids, dc.view(torch.int32), dc, dc.view(torch.int16), out,
                                    E, F, RW, E * RW, KSLOTS=k, BN=8, NB=8, R=1, num_warps=4)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
