"""Import a benchmark script under bench/ as a module, for the tests of its pieces."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(folder: str, name: str):
    """bench/<folder>/<name>.py as a module (its folder on sys.path while it imports, as when
    the script runs)."""
    sys.path.insert(0, str(BENCH / folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
