"""The worker side's compute: `Stage`, layers [a, b) of one model with per-connection slots
and snapshots (qkp OPEN / FREE / SAVE / LOAD)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..core.graph import run_layers
from ..core.sampling import argmax, top_candidates
from ..core.state import SessionLayout, alloc_states, states_from_host, states_to_host
from ..engine import Engine
from ..wire import qkp
from .common import DEFAULT_MAX_ROWS


@dataclass
class _Slot:
    states: dict | None = None
    pos: int = -1  # tokens held; -1: nothing valid, only base 0 is accepted
    owner: object = None  # the connection that opened it; None: in the free pool


@dataclass
class _StageSnapshot:
    count: int
    arrays: dict  # layer -> name -> numpy


class Stage:
    """Layers [a, b) of one model for `slots` sequences: what one worker computes.

    Holds only its own layers' weights (the engine was opened with `layers=range(a, b)`) and
    only their state. Every method is called with frames that `qkp.read_frame` validated.

    Slots and snapshot entries belong to connections (`owner`: any hashable the worker picks
    per connection). A frame's slot number and snapshot index are the owner's own names,
    bound by `open` / the first `save` to a stage slot / entry from the free pool, and given
    back by `free` / `release` (the connection closed). No owner reaches another's state.
    """

    def __init__(self, engine: Engine, *, slots: int = 1, ctx: int = 4096, snapshots: int = 0,
                 max_rows: int = DEFAULT_MAX_ROWS):
        cfg = engine.config
        if engine.layers.start == 0:
            raise ValueError("layers: a worker cannot start at layer 0 (the head runs the embedding)")
        if slots < 1 or snapshots < 0:
            raise ValueError(f"slots: expected at least 1 (and snapshots >= 0), got {slots}, {snapshots}")
        if not 1 <= max_rows <= ctx:
            raise ValueError(f"max_rows: expected 1..ctx={ctx}, got {max_rows}")
        self.engine = engine
        self.backend = engine.backend
        self.layers = engine.layers
        # A frame is a chunk of up to max_rows positions: the raw ring must hold one.
        self.layout = SessionLayout.create(cfg, ctx, prefill_cap=max_rows)
        self.slots = [_Slot() for _ in range(slots)]
        self.snapshots: list[_StageSnapshot | None] = [None] * snapshots
        self._slot_of: dict[object, dict[int, int]] = {}  # owner -> its slot -> stage slot
        self._snap_of: dict[object, dict[int, int]] = {}  # owner -> its index -> stage entry
        self.lock = threading.Lock()
        self.hello = qkp.Hello(self.layers.start, self.layers.stop, cfg.n_layer, cfg.n_embd,
                               cfg.n_hc, slots, ctx, cfg.n_vocab, max_rows,
                               engine.model.fingerprint64)
        self.hello.check()

    @property
    def last(self) -> bool:
        return self.hello.last

    @property
    def exact(self) -> bool:
        return self.engine.numerics == "exact"

    def _alloc(self) -> dict:
        be, cfg = self.backend, self.engine.config
        return alloc_states(be, cfg, self.layout, self.layers)

    # ---- ownership ----

    def open(self, owner, local: int) -> int:
        """OPEN: bind the owner's slot `local` to a free stage slot (already bound: keep it)."""
        with self.lock:
            mine = self._slot_of.setdefault(owner, {})
            if local in mine:
                return qkp.STATUS_OK
            free = next((i for i, s in enumerate(self.slots) if s.owner is None), None)
            if free is None:
                return qkp.STATUS_NO_SLOT
            self.slots[free] = _Slot(owner=owner)
            mine[local] = free
            return qkp.STATUS_OK

    def free(self, owner, local: int) -> int:
        """FREE: give the owner's slot `local` back; its state is dropped."""
        with self.lock:
            index = self._slot_of.get(owner, {}).pop(local, None)
            if index is None:
                return qkp.STATUS_SLOT_NOT_OPEN
            self.slots[index] = _Slot()
            return qkp.STATUS_OK

    def release(self, owner) -> None:
        """The owner's connection closed: every slot and snapshot entry it held is free again."""
        with self.lock:
            for index in self._slot_of.pop(owner, {}).values():
                self.slots[index] = _Slot()
            for index in self._snap_of.pop(owner, {}).values():
                self.snapshots[index] = None

    def _slot(self, owner, local: int) -> _Slot | None:
        index = self._slot_of.get(owner, {}).get(local)
        return None if index is None else self.slots[index]

    # ---- frames ----

    def eval(self, frame: qkp.Frame, owner=None) -> bytes | np.ndarray:
        """Run the frame's rows through the stage's layers. The last stage returns the reply
        (greedy ids, then top-k pairs or the logits row); any other stage the rows at its
        output. A slot the owner has not opened is a protocol violation (QkpError)."""
        h = frame.header
        with self.lock:
            slot = self._slot(owner, h.slot)
            if slot is None:
                raise qkp.QkpError("slot", f"slot {h.slot} is not open on this connection (send "
                                   "OPEN first; a connection uses only the slots it opened)")
            if h.base != 0 and h.base != slot.pos:
                held = "nothing" if slot.pos < 0 else f"{slot.pos} tokens"
                raise qkp.QkpError("base", f"slot {h.slot} holds {held}; expected base 0 or "
                                   f"{max(slot.pos, 0)}, got {h.base}")
            if h.base == 0:
                slot.states, slot.pos = self._alloc(), 0
            slot.pos = -1  # until this frame has gone through every layer
            be, w = self.backend, self.engine.weights
            tokens = frame.tokens.astype(np.int64)
            X = rows_to_backend(be, frame.rows)
            X = run_layers(be, w, slot.states, X, tokens, h.base, self.layers)
            slot.pos = h.base + h.n
            if not self.last:
                return np.ascontiguousarray(be.to_numpy(X), dtype="<f4")
            # the greedy id after every position, as the spec says; the final position's
            # logits also give the top-k candidates or the whole row
            logits = np.asarray(be.to_numpy(be.output_logits(
                X, w.output_hc, w.output_norm, w.output)), dtype=np.float32)
            ids = np.empty(h.n, dtype="<u4")
            if h.n > 1:
                ids[:-1] = be.output_argmax(X[:-1], w.output_hc, w.output_norm, w.output)
            ids[-1] = _greedy_or_none(logits)
            if h.topk == qkp.TOPK_LOGITS:
                return qkp.pack_eval_reply(ids, [], h.topk, logits)
            pairs = []
            if h.topk and np.isfinite(logits).any():
                pairs = top_candidates(logits, h.topk)
            return qkp.pack_eval_reply(ids, pairs, h.topk)

    def save(self, h: qkp.Header, owner=None) -> int:
        with self.lock:
            if h.n >= len(self.snapshots):
                return qkp.STATUS_BAD_INDEX
            slot = self._slot(owner, h.slot)
            if slot is None:
                return qkp.STATUS_SLOT_NOT_OPEN
            if slot.pos < 0 or slot.pos != h.topk:
                return qkp.STATUS_COUNT_MISMATCH
            mine = self._snap_of.setdefault(owner, {})
            index = mine.get(h.n)
            if index is None:
                taken = {i for entries in self._snap_of.values() for i in entries.values()}
                index = next((i for i in range(len(self.snapshots)) if i not in taken), None)
                if index is None:
                    return qkp.STATUS_SNAPSHOTS_FULL
            self.snapshots[index] = _StageSnapshot(slot.pos, states_to_host(self.backend, slot.states))
            mine[h.n] = index
            return qkp.STATUS_OK

    def load(self, h: qkp.Header, owner=None) -> int:
        with self.lock:
            if h.n >= len(self.snapshots):
                return qkp.STATUS_BAD_INDEX
            index = self._snap_of.get(owner, {}).get(h.n)
            snap = None if index is None else self.snapshots[index]
            if snap is None or snap.count != h.topk:
                return qkp.STATUS_NO_SNAPSHOT
            slot = self._slot(owner, h.slot)
            if slot is None:
                return qkp.STATUS_SLOT_NOT_OPEN
            if slot.states is None:
                slot.states = self._alloc()
            slot.pos = -1
            states_from_host(self.backend, slot.states, snap.arrays)
            slot.pos = snap.count
            return qkp.STATUS_OK


def rows_to_backend(be, rows: np.ndarray):
    """The mHC rows a stage receives, [n, n_hc, n_embd] float32, as the backend's array type."""
    return be.from_numpy(rows)


def _greedy_or_none(logits: np.ndarray) -> int:
    return argmax(logits) if np.isfinite(logits).any() else qkp.NO_TOKEN
