"""The per-session state layout every backend allocates, and the DSV4 payload reads and writes.

Per layer: the raw sliding window as a ring of `raw_cap` rows (row of position p at p % raw_cap),
and on compressed layers the append-only compressed rows plus the compressor frontier (spec §3.5);
CSA layers add the indexer's rows and frontier. Row counts are not state: after T tokens a layer of
ratio m holds exactly T // m compressed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import CSA, ModelConfig

DEFAULT_PREFILL_CAP = 2048
MAX_RAW_CAP = 8192

# array name -> fill value at session start (scores start at −∞: an empty window pools to 0)
FILL = {"raw": 0.0, "comp": 0.0, "comp_kv": 0.0, "comp_score": -np.inf,
        "index": 0.0, "index_kv": 0.0, "index_score": -np.inf}


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class SessionLayout:
    ctx: int
    prefill_cap: int
    raw_window: int
    raw_cap: int
    comp_cap: int  # header value: ctx / (smallest ratio) + 2

    @classmethod
    def create(cls, cfg: ModelConfig, ctx: int, prefill_cap: int | None = None) -> "SessionLayout":
        if ctx < 2:
            raise ValueError(f"ctx: expected at least 2 tokens, got {ctx}")
        if ctx > cfg.context_length:
            raise ValueError(f"ctx: expected at most the model's context_length "
                             f"{cfg.context_length}, got {ctx}")
        cap = min(ctx, DEFAULT_PREFILL_CAP) if prefill_cap is None else prefill_cap
        if not 1 <= cap <= ctx:
            raise ValueError(f"prefill_cap: expected 1..ctx={ctx}, got {cap}")
        raw_window = min(cfg.sliding_window, ctx)
        # A chunk of `cap` queries reaches back raw_window−1 rows before its first token, so the
        # ring must hold both at once (ds4's GPU rule, generalised from a 128-row window).
        raw_cap = min(ctx, MAX_RAW_CAP, _align(raw_window + cap, 256))
        raw_cap = max(raw_cap, min(ctx, raw_window + cap - 1))
        comp_cap = ctx // cfg.min_ratio + 2 if cfg.min_ratio else 0
        return cls(ctx, cap, raw_window, raw_cap, comp_cap)

    def layer_comp_cap(self, cfg: ModelConfig, il: int) -> int:
        r = cfg.ratio(il)
        return self.ctx // r + 2 if r else 0


def layer_state_shapes(cfg: ModelConfig, layout: SessionLayout, il: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the float32 arrays that hold layer `il`'s state."""
    D = cfg.head_dim
    shapes = {"raw": (layout.raw_cap, D)}
    m = cfg.ratio(il)
    if m:
        c = cfg.compressor_lanes(il)
        shapes["comp"] = (layout.layer_comp_cap(cfg, il), D)
        shapes["comp_kv"] = shapes["comp_score"] = (c * m, c * D)
    if cfg.layer_kind(il) == CSA:
        ID = cfg.indexer_head_dim
        shapes["index"] = (layout.layer_comp_cap(cfg, il), ID)
        shapes["index_kv"] = shapes["index_score"] = (2 * m, 2 * ID)
    return shapes


# The one place a session's state is allocated and copied (engine sessions, pipeline stages,
# snapshots, DSV4 payloads), so every holder lays it out and fills it the same way. `be` is any
# ds4.backends.base.Backend; a layer's state is its dict name -> backend array.

def alloc_states(be, cfg: ModelConfig, layout: SessionLayout, layers) -> dict[int, dict]:
    """Fresh state (FILL values) on backend `be` for each layer index in `layers`."""
    return {il: be.alloc_state(layer_state_shapes(cfg, layout, il), FILL) for il in layers}


def host_layer_state(cfg: ModelConfig, layout: SessionLayout, il: int) -> dict[str, np.ndarray]:
    """Layer il's fresh state as host float32 arrays, as `alloc_states` fills it on a device."""
    return {name: np.full(shape, FILL[name], dtype=np.float32)
            for name, shape in layer_state_shapes(cfg, layout, il).items()}


def states_to_host(be, states: dict[int, dict]) -> dict[int, dict[str, np.ndarray]]:
    """A host copy of every layer's state arrays (a snapshot's body)."""
    return {il: {name: be.state_to_numpy(st, name) for name in st} for il, st in states.items()}


def layer_from_host(be, st: dict, arrays: dict[str, np.ndarray]) -> None:
    """Overwrite one layer's state with host arrays of the same shapes (the backend checks them)."""
    for name in st:
        be.state_from_numpy(st, name, arrays[name])


def states_from_host(be, states: dict[int, dict], arrays: dict[int, dict[str, np.ndarray]]) -> None:
    """Overwrite every layer's state with the host copy `states_to_host` made."""
    for il, st in states.items():
        layer_from_host(be, st, arrays[il])
