"""Backends by name. ds4.core never imports a backend; the engine finds one here.

`--backend auto` (``backend_class("auto")``) picks, in order:

1. ``triton`` when torch is installed and sees a CUDA GPU (and the Triton backend imports);
2. ``mlx`` on macOS when MLX is installed and Metal is available;
3. ``reference`` otherwise.

So a machine with both a CUDA GPU and MLX runs Triton. MLX on Linux (``mlx[cpu]``) is never
chosen automatically: on the CPU the numpy reference is the faster of the two (measured on two
cores, decode tokens/s reference vs mlx[cpu]: about 160 vs 23 on the `test` preset, 20 vs 10 on
the `tiny` preset with the real vocabulary), so `auto` keeps MLX for Metal; `--backend mlx`
still selects it explicitly.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# name -> "module:Class"; a backend's framework is imported only when it is chosen.
BACKENDS = {
    "reference": "ds4.backends.reference.backend:ReferenceBackend",
    "mlx": "ds4.backends.mlx.backend:MLXBackend",
    "triton": "ds4.backends.triton.backend:TritonBackend",
    "auto": "",  # resolved by resolve_backend() to one of the above
}


def _cuda_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.device_count() > 0)
    except Exception:
        return False


def _metal_mlx() -> bool:
    if sys.platform != "darwin" or importlib.util.find_spec("mlx") is None:
        return False
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:
        return False


def _importable(name: str) -> bool:
    try:
        importlib.import_module(BACKENDS[name].split(":")[0])
        return True
    except ImportError:
        return False


def resolve_backend(name: str) -> str:
    """The concrete backend for `name`: "auto" by the rule in this module's docstring, any
    other name unchanged."""
    if name != "auto":
        return name
    if _cuda_gpu() and _importable("triton"):
        return "triton"
    if _metal_mlx() and _importable("mlx"):
        return "mlx"
    return "reference"


def backend_class(name: str):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
    name = resolve_backend(name)
    module, cls = BACKENDS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"backend {name!r} is not available here: {e}") from e
    return getattr(mod, cls)


def available() -> list[str]:
    """The concrete backends that can run on this machine (never "auto")."""
    out = []
    for name in BACKENDS:
        if name == "auto":
            continue
        try:
            cls = backend_class(name)
        except RuntimeError:
            continue
        runs_here = getattr(cls, "runs_here", None)
        if runs_here is None or runs_here():
            out.append(name)
    return out
