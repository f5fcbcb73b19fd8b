"""The head side: `SplitEngine` (layers [0, a) here, the rest on the worker chain) and its
`SplitSession`, which has the `Session` API; `next_token` for either kind of session."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Container, Iterator
from dataclasses import dataclass

import numpy as np

from ..core.graph import chunk_bounds, run_layers
from ..core.sampling import GREEDY, Rng, SamplingParams, sample
from ..core.state import SessionLayout
from ..engine import Engine, EngineFront, Session, Snapshot, check_tokens, common_prefix
from ..wire import qkp
from ..wire.address import parse_hostport
from .common import (DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT, OPEN_RETRY_PAUSES, PipelineError,
                     PipelineRefused, covers, parse_layers, topk_for)
from .link import _Link

log = logging.getLogger("ds4.pipeline")


class SplitEngine(EngineFront):
    """An engine for layers [0, a) whose layers [a, n_layer) and output head run on the chain
    of workers behind `next_addr`. Same session API as `Engine` (see `SplitSession`).

    `slots`: how many sessions may exist at once (each owns one worker slot). `snapshots`: the
    worker's `--snapshots` (indices 0..snapshots-1). `sampling`: the default sampling of its
    sessions, which decides how many candidates the last stage returns (`topk_for`).
    """

    def __init__(self, engine: Engine, next_addr: str | tuple[str, int], *, slots: int = 1,
                 snapshots: int = 0, auth_token: str | None = None,
                 sampling: SamplingParams | None = None, ctx: int | None = None,
                 io_timeout: float = DEFAULT_IO_TIMEOUT,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT, tls=None):
        cfg = engine.config
        if engine.layers.start != 0 or engine.layers.stop >= cfg.n_layer:
            raise ValueError(f"layers: the head runs layers 0:A with A < {cfg.n_layer}, got "
                             f"{engine.layers.start}:{engine.layers.stop}")
        if slots < 1:
            raise ValueError(f"slots: expected at least 1, got {slots}")
        self.engine = engine
        self.n_slots = slots
        self.n_snapshots = snapshots
        self.sampling = sampling
        self.ctx = ctx
        addr = parse_hostport(next_addr, "next_addr") if isinstance(next_addr, str) else next_addr
        token = auth_token if auth_token is not None else os.environ.get("DS4_WIRE_TOKEN")
        self.link = _Link(addr, token=token or None, exact=engine.numerics == "exact",
                          check=self._check_hello, io_timeout=io_timeout,
                          connect_timeout=connect_timeout, tls=tls)
        self.lock = threading.RLock()
        self._free = list(range(slots))
        self._snapshots: dict[int, SplitSnapshot] = {}
        self._opened: set[int] = set()  # this engine's slots OPEN on the current connection
        self._generation_seen = 0

    @classmethod
    def open(cls, path, next_addr: str | tuple[str, int], layers: str | range | int,
             backend: str = "reference", numerics: str = "ds4", **kw) -> "SplitEngine":
        """Open layers [0, A) of the model locally (`layers` = '0:A', range(0, A) or A)."""
        from ..core.gguf_model import GGUFModel

        if isinstance(layers, int):
            layers = range(0, layers)
        if path is None:
            from ..core.default_model import default_model_path

            path = default_model_path()
        r = parse_layers(layers, GGUFModel(path).config.n_layer)
        return cls(Engine.open(path, backend=backend, numerics=numerics, layers=r), next_addr, **kw)

    # ---- Engine-like surface ----

    @property
    def layers(self) -> range:
        return self.engine.layers

    def session(self, ctx: int = 4096, prefill_cap: int | None = None,
                sampling: SamplingParams | None = None) -> "SplitSession":
        layout = SessionLayout.create(self.config, ctx, prefill_cap)
        with self.lock:
            if not self._free:
                raise PipelineError(f"all {self.n_slots} slots of this split engine are in use; "
                                    "close a session or open the engine with more slots")
            slot = self._free.pop(0)
        return SplitSession(self, slot, layout, self.sampling if sampling is None else sampling)

    def connect(self) -> qkp.Hello:
        """Connect now (the link is otherwise opened lazily by the first request)."""
        with self.lock:
            return self._ensure()

    def close(self) -> None:
        with self.lock:
            self.link.close()

    def __enter__(self) -> "SplitEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----

    def _check_hello(self, peer: qkp.Hello) -> None:
        cfg = self.config
        qkp.check_next_stage(peer, layer_end=self.layers.stop, n_layer=cfg.n_layer,
                             n_embd=cfg.n_embd, n_hc=cfg.n_hc, n_vocab=cfg.n_vocab,
                             fingerprint=self.model.fingerprint64, n_slots=self.n_slots,
                             n_ctx=self.ctx or 1)

    def _ensure(self) -> qkp.Hello:
        hello = self.link.ensure()
        if self.link.generation != self._generation_seen:
            self._generation_seen = self.link.generation
            self._snapshots.clear()  # a new connection may be a restarted worker: they are gone
            self._opened.clear()  # and the worker gave a closed connection's slots back
        return hello

    def _open(self, slot: int) -> None:
        """OPEN `slot` on the current connection unless it is open: the chain binds it to one
        of its slots, or refuses when every slot is held by other connections."""
        if slot in self._opened:
            return
        link = self.link
        # A worker frees a closed connection's slots when its thread for that connection sees
        # the close, which can be just after a reconnect's OPEN arrives: ask again a few times
        # before refusing (a bounded wait, never a hang).
        for pause in (*OPEN_RETRY_PAUSES, None):
            try:
                status = link.status(qkp.OPEN, slot, 0, 0)
            except (OSError, qkp.QkpError) as e:
                raise link.broken("OPEN", e) from None
            if status != qkp.STATUS_NO_SLOT or pause is None:
                break
            time.sleep(pause)
        if status == qkp.STATUS_NO_SLOT:
            raise PipelineRefused(
                f"the pipeline at {link.addr} has no free slot: every slot of a stage is held by "
                "another connection (another head or session; --slots is the total over all of "
                "them); retry when one finishes, or start the workers with a larger --slots")
        if status != qkp.STATUS_OK:
            raise PipelineError(f"the next stage at {link.addr} refused to open slot {slot} "
                                f"({qkp.STATUS_TEXT.get(status, status)})")
        self._opened.add(slot)

    def _release(self, slot: int) -> None:
        with self.lock:
            link = self.link
            if (slot in self._opened and link.conn is not None and link.in_flight == 0
                    and link.generation == self._generation_seen):
                try:  # give the worker's slot back now, not when the connection closes
                    link.status(qkp.FREE, slot, 0, 0)
                except (OSError, qkp.QkpError):
                    link.drop()
            self._opened.discard(slot)
            if slot not in self._free:
                self._free.append(slot)
                self._free.sort()


@dataclass
class SplitSnapshot:
    """A prefix saved on every stage: worker index `index`, the head's own state in `local`."""

    index: int
    tokens: list[int]
    local: Snapshot
    greedy: int | None
    pairs: np.ndarray | None
    topk: int
    generation: int
    row: np.ndarray | None = None


class SplitSession:
    """One sequence on a split engine; the `Session` API (`sync`, `eval`, `sample`, `greedy`,
    `logits`) plus `next_token` and worker snapshots.

    What the last stage returns of the final position follows `sampling` (the session's, else
    the engine's; `sample()` sets it): its argmax only when greedy, the top_k candidates, or
    the whole logits row (`topk_for`). `logits` is that row, or the candidates with -inf
    elsewhere. Asking for more than the last reply holds replays the sequence once with the new
    parameters (exact, but a prefill's cost): set `sampling` before `sync` to avoid it.
    """

    def __init__(self, split: SplitEngine, slot: int, layout: SessionLayout,
                 sampling: SamplingParams | None):
        self.split = split
        self.slot = slot
        self.layout = layout
        self.ctx = layout.ctx
        self.sampling = sampling
        self._local = Session(split.engine, layout)  # holds the states of layers [0, a)
        self._tokens: list[int] = []
        self._generation: int | None = None  # link generation the worker-side state belongs to
        self._broken = False
        self._greedy: int | None = None
        self._pairs: np.ndarray | None = None
        self._row: np.ndarray | None = None  # the final position's logits (topk TOPK_LOGITS)
        self._topk = 0
        self._closed = False

    # ---- read-only views ----

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def greedy(self) -> int:
        if self._greedy is None:
            raise RuntimeError("session has no next token yet: sync or eval at least one token")
        return self._greedy

    @property
    def candidates(self) -> list[tuple[int, float]]:
        """The last stage's top-k (id, logit) for the next token, best first."""
        if self._pairs is None:
            return []
        return [(int(i), float(v)) for i, v in zip(self._pairs["id"], self._pairs["logit"])]

    @property
    def logits(self) -> np.ndarray:
        self.greedy  # noqa: B018 -- raises before the first token
        if self._row is not None:
            return self._row
        if not self._topk:
            raise RuntimeError("a split session has no logits on a greedy run (only the last "
                               "stage's argmax): use next_token() or sample(), or give the "
                               "session sampling parameters with temperature > 0")
        vec = np.full(self.split.config.n_vocab, -np.inf, dtype=np.float32)
        vec[self._pairs["id"]] = self._pairs["logit"]
        return vec

    def next_token(self, params: SamplingParams, rng) -> int:
        """The next token, drawn as `ds4.core.sampling.sample(logits, params, rng)` draws it
        from the unsplit vector: the last stage's argmax at temperature 0, else `sample` over
        what it returned (the top_k candidates or the whole row; see `topk_for`)."""
        greedy = self.greedy
        need = topk_for(params)
        if not covers(self._topk, need):
            self._replay(params)
            greedy = self.greedy
        if need == 0:
            return greedy
        return sample(self.logits, params, rng)

    def sample(self, n: int, params: SamplingParams = GREEDY, rng: Rng | None = None,
               stop: Container[int] = ()) -> Iterator[int]:
        """`Session.sample` for a split session: up to n tokens, each drawn with `params` and
        `rng` exactly as the unsplit session draws them and evaluated before it is yielded;
        ends after a token in `stop` (evaluated too) or when the context is full. The session's
        `sampling` becomes `params`, so every step asks the last stage for what they need."""
        if float(np.float32(params.temperature)) > 0.0 and rng is None:
            raise ValueError("sample: a temperature above 0 needs an rng (ds4.core.sampling.Rng)")
        self.sampling = params
        n = min(int(n), self.ctx - len(self._tokens))
        while n > 0:
            token = self.next_token(params, rng)
            self.eval(token)
            n -= 1
            yield token
            if token in stop:
                return

    def _replay(self, params: SamplingParams) -> None:
        """Evaluate the held tokens again from position 0, asking for what `params` need."""
        log.info("pipeline: replaying %d tokens: sampling needs more of the last stage's reply "
                 "than the session's sampling asked for", len(self._tokens))
        tokens = self.tokens
        with self.split.lock:
            self.sampling = params
            self._begin()
            self._reset()
            self._advance(tokens, 0)

    # ---- requests ----

    def _check_tokens(self, tokens) -> list[int]:
        return check_tokens(tokens, self.split.config.n_vocab, self.ctx)

    def _begin(self) -> qkp.Hello:
        if self._closed:
            raise RuntimeError("this session is closed")
        hello = self.split._ensure()
        if self.ctx > hello.n_ctx:
            raise PipelineRefused(f"the session's ctx {self.ctx} is more than the next stage's "
                                  f"ctx {hello.n_ctx}")
        self.split._open(self.slot)
        return hello

    def _reset(self) -> None:
        self._local = Session(self.split.engine, self.layout)
        self._tokens, self._generation = [], None
        self._greedy, self._pairs, self._row, self._topk = None, None, None, 0

    def sync(self, tokens) -> None:
        """Make the session hold exactly `tokens`, reusing the common prefix the chain holds."""
        tokens = self._check_tokens(tokens)
        with self.split.lock:
            self._begin()
            self._broken = False
            if self._generation != self.split.link.generation:
                self._reset()  # the chain lost (or never had) this session's state
            if not tokens:
                self._reset()
                return
            common = common_prefix(self._tokens, tokens)
            if common == len(tokens) == len(self._tokens) and covers(self._topk, self._want_topk()):
                return
            if common < len(self._tokens) or common == len(tokens):
                self._reset()  # compressor frontiers cannot be un-run: start again at 0
                common = 0
            self._advance(tokens, common)

    def eval(self, token: int) -> None:
        """Append one token (a decode step)."""
        if len(self._tokens) + 1 > self.ctx:
            raise ValueError(f"eval: the session is full (ctx={self.ctx})")
        (token,) = self._check_tokens([token])
        with self.split.lock:
            if self._broken:
                raise PipelineError("this session lost its state in an earlier pipeline failure; "
                                    "sync it again")
            self._begin()
            tokens = self._tokens + [token]
            if self._generation != self.split.link.generation:
                self._reset()  # reconnected since: replay the whole sequence from position 0
                self._advance(tokens, 0)
            else:
                self._advance(tokens, len(tokens) - 1)

    def rewind(self, pos: int) -> None:
        if not 0 <= pos <= len(self._tokens):
            raise ValueError(f"rewind: expected a position in [0, {len(self._tokens)}], got {pos}")
        if pos != len(self._tokens):
            self.sync(self._tokens[:pos])

    def _want_topk(self) -> int:
        return topk_for(self.sampling)

    def _advance(self, tokens: list[int], start: int) -> None:
        """Evaluate tokens[start:] (the chain holds tokens[:start] for this slot), streaming one
        frame per chunk as its local layers finish, at most two frames in flight."""
        split, link = self.split, self.split.link
        be, w = split.backend, split.engine.weights
        cap = min(self.layout.prefill_cap, link.hello.max_rows)
        bounds = chunk_bounds(start, len(tokens), cap)
        topk = self._want_topk()
        pending: deque = deque()
        reply = None
        what = "prefill" if len(tokens) - start > 1 else "decode"
        try:
            for a, b in bounds:
                chunk = np.asarray(tokens[a:b], dtype=np.int64)
                X = be.embed(w.token_embd, chunk)
                X = run_layers(be, w, self._local.states, X, chunk, a, split.layers)
                rows = np.ascontiguousarray(be.to_numpy(X), dtype="<f4")
                if len(pending) == 2:
                    reply = link.recv_eval(*pending.popleft())
                k = topk if b == len(tokens) else 0
                link.send_eval(self.slot, a, chunk, rows, k)
                pending.append((b - a, k))
            while pending:
                reply = link.recv_eval(*pending.popleft())
        except (OSError, qkp.QkpError) as e:
            self._lose()
            raise link.broken(what, e) from None
        except BaseException:
            self._lose()
            link.drop()  # replies may still be owed on this connection
            raise
        ids, payload = reply
        greedy = int(ids[-1])
        if greedy >= split.config.n_vocab:
            self._lose()
            raise PipelineError("the last stage found no finite logit for the next token")
        self._tokens = tokens
        self._generation = link.generation
        self._greedy, self._topk = greedy, topk
        if topk == qkp.TOPK_LOGITS:
            self._row, self._pairs = payload.astype(np.float32), None
        else:
            keep = (payload["id"] < split.config.n_vocab) & np.isfinite(payload["logit"])
            self._row, self._pairs = None, payload[keep].copy()

    def _lose(self) -> None:
        self._reset()
        self._broken = True

    # ---- snapshots (ops SAVE / LOAD) ----

    def snapshot(self, index: int) -> SplitSnapshot:
        """Save the session's prefix on every stage under worker snapshot `index`."""
        split = self.split
        if not 0 <= index < split.n_snapshots:
            raise ValueError(f"snapshot index: expected 0..{split.n_snapshots - 1}, got {index}")
        with split.lock:
            self._begin()
            if not self._tokens or self._broken:
                raise RuntimeError("snapshot: the session holds no tokens")
            if self._generation != split.link.generation:
                tokens = self._tokens
                self._reset()
                self._advance(tokens, 0)
            status = self._status(qkp.SAVE, index, len(self._tokens))
            if status != qkp.STATUS_OK:
                raise PipelineError(f"snapshot {index}: a stage refused the SAVE "
                                    f"({qkp.STATUS_TEXT.get(status, status)})")
            snap = SplitSnapshot(index, list(self._tokens), self._local.snapshot(), self._greedy,
                                 None if self._pairs is None else self._pairs.copy(), self._topk,
                                 split.link.generation,
                                 None if self._row is None else self._row.copy())
            split._snapshots[index] = snap
            return snap

    def restore(self, snap: SplitSnapshot) -> None:
        """Continue from a snapshot saved by any session of this engine."""
        split = self.split
        with split.lock:
            self._begin()
            if split._snapshots.get(snap.index) is not snap or snap.generation != split.link.generation:
                raise PipelineError(f"snapshot {snap.index} is gone: it was overwritten, or the "
                                    "pipeline reconnected since (a restarted worker lost it)")
            status = self._status(qkp.LOAD, snap.index, len(snap.tokens))
            if status != qkp.STATUS_OK:
                self._lose()
                raise PipelineError(f"snapshot {snap.index}: a stage refused the LOAD "
                                    f"({qkp.STATUS_TEXT.get(status, status)})")
            self._local.restore(snap.local)
            self._tokens = list(snap.tokens)
            self._generation = split.link.generation
            self._greedy, self._topk = snap.greedy, snap.topk
            self._pairs = None if snap.pairs is None else snap.pairs.copy()
            self._row = None if snap.row is None else snap.row.copy()
            self._broken = False

    def _status(self, op: int, index: int, count: int) -> int:
        link = self.split.link
        try:
            return link.status(op, self.slot, index, count)
        except (OSError, qkp.QkpError) as e:
            self._lose()
            raise link.broken(qkp.OPS[op], e) from None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.split._release(self.slot)

    def __enter__(self) -> "SplitSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def next_token(session, params: SamplingParams, rng) -> int:
    """The next token of an unsplit `Session` or a `SplitSession`, the same way for both."""
    if isinstance(session, SplitSession):
        return session.next_token(params, rng)
    return sample(session.logits, params, rng)
