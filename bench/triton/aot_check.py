"""Compile every Triton kernel configuration a model uses for a GPU target, without a GPU.

Step 1 (interpreter process): run one prefill chunk and one decode step of the model's graph on
the Triton backend with launches recorded instead of executed (heuristics as on the GPU) and
weights replaced by empty stand-ins, so even the full-size `flash` shapes cost nothing.
Step 2 (compiler process): `triton.compile` each distinct (kernel, signature, constexprs) for
sm_90 and print registers, spills and shared memory. Catches compile errors before device time.

    PYTHONPATH=. python bench/triton/aot_check.py --preset flash --prefill 2048
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time


def record(preset: str, prefill: int, out: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import torch

    from ds4.backends.triton import backend as B
    from ds4.backends.triton.layout import kernel_type
    from ds4.core.graph import forward_chunk
    from ds4.core.layout import expected_tensors
    from ds4.core.state import FILL, SessionLayout, layer_state_shapes
    from ds4.core.tiny import preset_config
    from ds4.core.weights import ModelWeights, bind_weights

    cfg = preset_config(preset)
    be = B.TritonBackend(cfg, device="cpu")
    be.interpret = False  # GPU heuristics (block sizes), interpreter imports
    be.mv_shapes = B.load_mv_shapes(os.path.join(os.path.dirname(B.__file__), "mv_shapes_h200.json"))  # as on the GPU
    if os.environ.get("DS4_TRITON_MV_SHAPES"):  # entries over it (a probe's variants)
        be.mv_shapes.update(B.load_mv_shapes(os.environ["DS4_TRITON_MV_SHAPES"]))
    # the GPU's defaults: the constructor saw the interpreter and chose ieee for float tiles
    be.prec = os.environ.get("DS4_TRITON_DOT", "bf16x3")
    be.prec_f = "tf32x3" if be.prec == "bf16x3" else be.prec
    be.topk_bucket, be.topk_rows = 256, 1024  # the one-query top-k's GPU tiling (small under the interpreter)
    seen = {}

    def launch(self, kern, grid, *args, nbytes=0, **kw):
        stages = kw.pop("num_stages", 3)  # Triton's default for CUDA
        warps = kw.pop("num_warps", 4)
        sig, const, aligned = {}, {}, []
        # every parameter in order: given by position or keyword, else its default (a None
        # runtime argument is a constexpr None, as the JIT specialises it)
        params = list(inspect.signature(kern.fn).parameters.values())
        given = {**dict(zip([p.name for p in params], args)), **kw}
        for i, prm in enumerate(params):
            a = given[prm.name] if prm.name in given else prm.default
            if "constexpr" in str(prm.annotation) or a is None:
                sig[prm.name] = "constexpr"
                const[prm.name] = a
                continue
            # the JIT's specialisation: 16-byte aligned pointers and ints divisible by 16
            if (a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else
                    isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0):
                aligned.append(i)
            if isinstance(a, torch.Tensor):
                sig[prm.name] = {torch.float32: "*fp32", torch.float16: "*fp16", torch.uint8: "*u8",
                                 torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}[a.dtype]
            elif isinstance(a, bool):
                sig[prm.name] = "i1"
            elif isinstance(a, int):
                sig[prm.name] = "i64" if abs(a) >= 2**31 else "i32"
            else:
                sig[prm.name] = "fp32"
        key = json.dumps([kern.fn.__name__, sig, const, warps, stages, aligned], sort_keys=True)
        seen[key] = seen.get(key, 0) + 1

    B.TritonBackend._launch = launch
    orig_new = B.TritonBackend._new
    B.TritonBackend._new = lambda self, shape, dtype=torch.float32: torch.zeros(
        tuple(int(s) for s in shape), dtype=dtype)

    class Stub:
        def __init__(self, spec):
            self.name, self.type, self.dims = spec.name, spec.shipped, spec.dims

    specs = expected_tensors(cfg)

    class FakeModel:
        config = cfg

        def tensor(self, name):
            return Stub(specs[name])

        def get(self, name):
            return Stub(specs[name]) if name in specs else None

    def upload(t):  # the device layout's type (Q8C for chunked Q8_0) over a stand-in buffer
        n = 64
        return B.QWeight(t.name, t.type, t.dims, torch.zeros(n, dtype=torch.uint8), kernel_type(t.type, t.dims[0]))

    w: ModelWeights = bind_weights(FakeModel(), upload)
    layout = SessionLayout.create(cfg, max(4096, prefill + 64))
    states = {il: be.alloc_state(layer_state_shapes(cfg, layout, il), FILL) for il in range(cfg.n_layer)}
    toks = np.arange(prefill) % cfg.n_vocab
    forward_chunk(be, w, states, toks, 0)
    forward_chunk(be, w, states, toks[:1], 4000)  # a decode step (eager path)
    B.TritonBackend._new = orig_new
    with open(out, "w") as f:
        json.dump([json.loads(k) + [c] for k, c in seen.items()], f)
    print(f"recorded {len(seen)} kernel configurations", file=sys.stderr)


def compile_all(path: str, arch: int) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ds4.backends.triton import kernels as K
    from ds4.backends.triton import kernels_mm16 as K16

    configs = json.load(open(path))
    bad = 0
    print(f"{'kernel':24s} {'warps':>5s} {'st':>2s} {'regs':>5s} {'spill':>6s} {'smem':>7s} {'s':>5s}  constexprs")
    for name, sig, const, warps, stages, aligned, count in sorted(configs, key=lambda c: c[0]):
        fn = getattr(K, name, None) or getattr(K16, name)
        t0 = time.time()
        try:
            attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
            src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": warps, "num_stages": stages})
            regs, spill = _resources(k.asm["cubin"])
            print(f"{name:24s} {warps:5d} {stages:2d} {str(regs):>5s} {str(spill):>6s} {k.metadata.shared:7d} "
                  f"{time.time() - t0:5.1f}  {const}")
        except Exception as e:  # noqa: BLE001
            bad += 1
            cause = f"\ncaused by {type(e.__cause__).__name__}: {str(e.__cause__)[:2000]}" if e.__cause__ else ""
            print(f"{name:24s} FAILED {const}\n{type(e).__name__}: {str(e)[:2000]}{cause}")
    return bad


def _resources(cubin: bytes) -> tuple[str, str]:
    """(registers, spill bytes) from `cuobjdump --dump-resource-usage` (shipped with Triton)."""
    import re
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            txt = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return "?", "?"
    regs = re.search(r"REG:(\d+)", txt)
    stack = re.search(r"STACK:(\d+)", txt)
    return (regs.group(1) if regs else "?"), (stack.group(1) if stack else "?")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--configs", default="/tmp/ds4_triton_configs.json")
    ap.add_argument("--step", choices=["all", "record", "compile"], default="all")
    a = ap.parse_args()
    if a.step == "record":
        record(a.preset, a.prefill, a.configs)
        return
    if a.step == "compile":
        sys.exit(1 if compile_all(a.configs, a.arch) else 0)
    env = dict(os.environ)
    base = [sys.executable, __file__, "--preset", a.preset, "--prefill", str(a.prefill), "--configs", a.configs,
            "--arch", str(a.arch)]
    subprocess.run(base + ["--step", "record"], check=True, env=env)
    env.pop("TRITON_INTERPRET", None)
    sys.exit(subprocess.run(base + ["--step", "compile"], env=env).returncode)


if __name__ == "__main__":
    main()
