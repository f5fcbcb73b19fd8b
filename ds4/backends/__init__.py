"""Backends by name. ds4.core never imports a backend; the engine finds one here."""

from __future__ import annotations

import importlib

# name -> "module:Class"; a backend's framework is imported only when it is chosen.
BACKENDS = {
    "reference": "ds4.backends.reference.backend:ReferenceBackend",
    "mlx": "ds4.backends.mlx.backend:MLXBackend",
    "triton": "ds4.backends.triton.backend:TritonBackend",
}


def backend_class(name: str):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
    module, cls = BACKENDS[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"backend {name!r} is not available here: {e}") from e
    return getattr(mod, cls)


def available() -> list[str]:
    out = []
    for name in BACKENDS:
        try:
            backend_class(name)
            out.append(name)
        except RuntimeError:
            pass
    return out
