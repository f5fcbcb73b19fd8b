"""Binding one rank's share of the model: what the leader, the worker and their commands open."""

from __future__ import annotations

from ..core.gguf_model import GGUFModel
from ..core.tp_split import RankPart
from ..engine import Engine
from ..wire import ds4t


def open_rank(path, rank: int, backend: str = "reference", numerics: str = "ds4",
              **backend_options) -> Engine:
    """Rank `rank` of a pair bound to `backend` (path None: the embedded default model)."""
    if path is None:
        from ..core.default_model import default_model_path

        path = default_model_path()
    cfg = GGUFModel(path).config
    if backend == "triton":
        backend_options.setdefault("cuda_graphs", False)  # a step meets the other rank mid-way
    return Engine.open(path, backend=backend, numerics=numerics,
                       part=RankPart.of(cfg, ds4t.N_RANK, rank), **backend_options)
