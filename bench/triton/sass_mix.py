"""Instructions per decoded weight value in the K loop of the matrix-vector kernels, from the SASS
of each configuration compiled for sm_90 (no GPU needed: Triton ships ptxas and cuobjdump).

    PYTHONPATH=. python bench/triton/sass_mix.py > bench/triton/sass_sm90.txt

The loop is the longest backward branch of the kernel; its instruction count × threads / values
per K-step is what one value costs to issue. (For moe_gateup_mv_kernel the gate and the up loops
are separate, so the count is per value of one weight.)
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ds4.backends.triton import kernels as K  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = dict(x_ptr="*fp32", nw_ptr="*fp32", wb="*u8", wh="*i16", wf="*i32", gridp="*i32", ksigns="*i32",
            out_ptr="*fp32", ids_ptr="*i32", wts_ptr="*fp32", gb="*u8", gh="*i16", gf="*i32", ub="*u8",
            uh="*i16", uf="*i32", h_ptr="*fp32", db="*u8", dh="*i16", df="*i32", ws_ptr="*fp32", cnt_ptr="*i32",
            xw_ptr="*i32", xs_ptr="*fp32", hw_ptr="*i32", hs_ptr="*fp32", hsum_ptr="*fp32")


def sass(kern, const: dict, warps: int) -> str:
    sig = {}
    const = dict(const)
    for prm in kern.params:  # constexprs left out take their defaults, as in a launch
        if prm.is_constexpr and prm.name not in const and prm.default is not inspect.Parameter.empty:
            const[prm.name] = prm.default
    for name in kern.arg_names:
        sig[name] = "constexpr" if name in const else PTRS.get(name, "fp32" if name in ("eps", "clamp") else "i32")
    k = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout


def hot_loop(txt: str) -> list[str]:
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in txt.splitlines()) if m]
    best: list[str] = []
    for addr, s in ins:
        t = re.search(r"BRA.*?0x([0-9a-f]+)", s)
        if t and int(t.group(1), 16) < addr:
            body = [x for a, x in ins if int(t.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def main() -> None:
    cases = [  # (label, kernel, constexprs, warps, values per K-step)
        ("Q8C 308 (four rows per thread)", K.matvec_kernel, dict(TYPE=308, BN=4, NB=2, VB=256, VA=4, NORM=0, S=1), 2,
         4 * 2 * 256),
        ("IQ2_XXS 216 (one row per thread)", K.moe_gateup_mv_kernel,
         dict(TYPE=216, BN=16, NB=16, VB=32, VA=1, ROUTED=True, S=1, QOUT=False), 4, 16 * 16 * 32),
        ("IQ2_XXS 416 (four rows per thread)", K.moe_gateup_mv_kernel,
         dict(TYPE=416, BN=32, NB=32, VB=32, VA=1, ROUTED=True, S=1, QOUT=False), 4, 32 * 32 * 32),
        ("IQ2_XXS 418 (x in XQ form, dp4a)", K.moe_gateup_mv_kernel,
         dict(TYPE=418, BN=32, NB=32, VB=32, VA=1, ROUTED=True, S=1, QOUT=True), 4, 32 * 32 * 32),
        ("IQ2_XXS 418, loads a step ahead (PF)", K.moe_gateup_mv_kernel,
         dict(TYPE=418, BN=32, NB=32, VB=32, VA=1, ROUTED=True, S=1, QOUT=True, PF=True), 4, 32 * 32 * 32),
        ("Q2_K 110", K.moe_down_mv_kernel, dict(TYPE=110, BN=8, NB=16, VB=64, VA=1, KSLOTS=6, S=1), 4, 8 * 16 * 64),
        ("Q2_K 111 (h in XQ form, dp4a)", K.moe_down_mv_kernel, dict(TYPE=111, BN=8, NB=16, VB=64, VA=1, KSLOTS=6, S=1),
         4, 8 * 16 * 64),
    ]
    print(f"{'decoder':36s} {'instr/value':>11s}  most frequent")
    for label, kern, const, warps, values in cases:
        body = hot_loop(sass(kern, const, warps))
        mix = collections.Counter(re.sub(r"^@!?U?P\d+\s+", "", s).split()[0].split(".")[0] for s in body)
        per = len(body) * 32 * warps / values
        print(f"{label:36s} {per:11.2f}  {dict(mix.most_common(6))}")


if __name__ == "__main__":
    main()
