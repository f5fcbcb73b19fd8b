"""The embedded default model: a synthetic `tiny` GGUF created on first use in the user cache."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0
# Bump when the generator's output changes, so an old cached file is not reused.
GENERATOR_VERSION = 1


def cache_dir() -> Path:
    if os.environ.get("DS4_CACHE"):
        return Path(os.environ["DS4_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ds4"


def default_model_path(progress=None) -> Path:
    """Path of the embedded default model, writing it (atomically) the first time."""
    path = cache_dir() / f"ds4-{DEFAULT_PRESET}-v{GENERATOR_VERSION}-seed{DEFAULT_SEED}.gguf"
    if not path.exists():
        from .tiny import make_tiny

        make_tiny(path, preset=DEFAULT_PRESET, seed=DEFAULT_SEED, progress=progress)
    return path
