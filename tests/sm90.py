"""Triton kernels compiled for sm_90 (the H200's architecture) on a machine without a GPU, for
tests that check what the compiler makes of them: the interpreter never runs a kernel's compiled
branches. Triton compiles only without TRITON_INTERPRET, which the test process sets, so the
compilation runs in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

out = []
for module, name, constexprs, types, options, aligned in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module("ds4.backends.triton." + module), name)
    # a constexpr parameter the case leaves out takes its default, as a launch does
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {a: "constexpr" if a in constexprs else types.get(a, "*fp32" if a.endswith("_ptr") else "i32")
           for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in aligned}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    out.append([k.asm["ptx"], k.metadata.shared])
print(json.dumps(out))
"""


def compile_sm90(cases: list[tuple]) -> list[tuple[str, int]]:
    """(PTX, shared memory bytes) for sm_90 of each case: (module under ds4.backends.triton,
    kernel name, its constexprs, argument types by name where not *fp32 for a *_ptr and i32
    otherwise, compile options such as num_warps, and optionally the arguments to compile as
    16-byte aligned, as a launch specialises them: the pipeliner stages only aligned loads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cases = [tuple(c) + ((),) * (6 - len(c)) for c in cases]
    run = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(cases), capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return [(ptx, int(shared)) for ptx, shared in json.loads(run.stdout.splitlines()[-1])]


def ptx_sm90(cases: list[tuple]) -> list[str]:
    """The PTX for sm_90 of each case (compile_sm90)."""
    return [ptx for ptx, _ in compile_sm90(cases)]
