"""Instruction counts in the PTX of the routed gate/up kernel, 416 against 417 (its level lookups
from shared memory), compiled for sm_90 without a GPU from the configuration the full-size model
records (aot_check.py's step 1), and the registers / shared memory of each.

    PYTHONPATH=. python bench/triton/aot_check.py --preset flash --prefill 16 --step record --configs /tmp/cfg.json
    PYTHONPATH=. python bench/triton/ptx_counts.py --configs /tmp/cfg.json
"""

from __future__ import annotations

import argparse
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aot_check import _resources
from ds4.backends.triton import kernels as K

PATTERNS = {"bar.sync": r"bar\.sync", "ld.shared": r"ld\.shared", "st.shared": r"st\.shared",
            "ld.global": r"ld\.global", "prmt": r"prmt", "fma.f32": r"fma\.rn\.f32"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="/tmp/ds4_triton_configs.json")
    a = ap.parse_args()
    for name, sig, const, warps, stages, aligned, _ in json.load(open(a.configs)):
        if name != "moe_gateup_mv_kernel" or const.get("TYPE") not in (416, 417):
            continue
        for ty in (416, 417):
            c = dict(const, TYPE=ty)
            attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
            k = triton.compile(ASTSource(fn=K.moe_gateup_mv_kernel, signature=sig, constexprs=c, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
            counts = {n: len(re.findall(p, k.asm["ptx"])) for n, p in PATTERNS.items()}
            regs, spill = _resources(k.asm["cubin"])
            print(f"TYPE {ty} {c}: registers {regs}, spill {spill}, shared {k.metadata.shared} B, PTX {counts}")


if __name__ == "__main__":
    main()
