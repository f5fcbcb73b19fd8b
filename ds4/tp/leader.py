"""The leader of a tensor-parallel pair: `TPEngine` / `TPSession`, used like Engine / Session.

    eng = TPEngine.open("model.gguf", ("127.0.0.1", 9300), backend="triton")  # waits for a worker
    s = eng.session(ctx=4096)
    s.sync(prompt_ids); s.logits        # the whole vocabulary: this rank's part + the worker's
    for t in s.sample(64, params, rng): ...

Every session call is mirrored to the worker on the control connection before this rank runs
it (SYNC, EVAL, REWIND, INVALIDATE, SESSION_CREATE/DESTROY, STATE); inside the forward pass the
two ranks meet at every gate. After each command the worker reports (its layer hashes with
--debug-hash,) its vocabulary part of the logits and a COMMAND_ACK.

Failure: any error while the pair works on a command (a dead or frozen worker, a desync, a
failed ack) marks the pair failed; the session is invalidated (its tokens and state dropped)
and TPError names the phase. The engine keeps listening: the next session call waits (up to
`wait_s`) for a worker to join again, and sessions continue from an empty state.
"""

from __future__ import annotations

import io
import logging
import select
import socket
import threading
import weakref
from collections.abc import Container, Iterator

import numpy as np

from ..engine import Engine, EngineFront, Session, Snapshot
from ..wire import ds4t
from .link import DEFAULT_WAIT_S, Options, Pair, TPError, accept_worker, listen
from .partner import LayerHash
from .rank import open_rank

log = logging.getLogger("ds4.tp")

LEADER_RANK = 0
PROBE_WAIT_S = 1.0  # how long a health probe waits for a worker to join


class TPEngine(EngineFront):
    """Rank 0 of two: its own share of the model (an Engine) and the pair's connections."""

    def __init__(self, engine: Engine, listener: socket.socket, ctx: int, opts: Options,
                 wait_s: float = DEFAULT_WAIT_S, on_wait=None):
        self.engine = engine
        self.listener = listener
        self.ctx = ctx
        self.opts = opts
        self.wait_s = wait_s
        self.on_wait = on_wait  # called with the address before each full wait for a worker
        self.pair: Pair | None = None
        self.generation = 0  # pairs formed so far; a session belongs to one
        self._next_session = 1
        self._joining = threading.Lock()
        self._dead: list[tuple[int, list[int]]] = []  # (session, its generation cell) gone here

    @classmethod
    def open(cls, path, listen_addr: tuple[str, int], backend: str = "reference",
             numerics: str = "ds4", ctx: int | None = None, opts: Options | None = None,
             wait_s: float = DEFAULT_WAIT_S, on_wait=None, connect: bool = True,
             listener: socket.socket | None = None, **backend_options) -> "TPEngine":
        """Bind rank 0's share of the model, listen, and (connect=True) wait for the worker.
        `ctx`: the largest session the pair serves (default the model's context_length).
        `listener`: a socket already listening on listen_addr (`ds4.tp.link.listen`), so that a
        caller binds before it loads the model; the engine owns it once open returns."""
        opts = opts or Options()
        engine = open_rank(path, LEADER_RANK, backend, numerics, **backend_options)
        ctx = engine.config.context_length if ctx is None else ctx
        if ctx > engine.config.context_length:
            raise ValueError(f"ctx: expected at most the model's context_length "
                             f"{engine.config.context_length}, got {ctx}")
        if listener is None:
            listener = listen(*listen_addr)
        eng = cls(engine, listener, ctx, opts, wait_s, on_wait)
        if connect:
            eng.ensure_worker()
        return eng

    # ---- what Engine has ------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    @property
    def bench_label(self) -> str:
        """`ds4 bench`'s backend column: both ranks' backends."""
        peer = self.pair.peer.backend.name.lower() if self.pair is not None else "?"
        return f"tp2:{self.backend.name}+{peer}"

    def session(self, ctx: int | None = None, prefill_cap: int | None = None) -> "TPSession":
        ctx = self.ctx if ctx is None else ctx
        if ctx > self.ctx:
            raise ValueError(f"ctx: this pair was formed for ctx {self.ctx}, got {ctx}")
        from ..core.state import SessionLayout

        layout = SessionLayout.create(self.config, ctx, prefill_cap)
        sid = self._next_session
        self._next_session += 1
        s = TPSession(self, layout, sid)
        # a session dropped here is destroyed on the worker before the next command
        weakref.finalize(s, self._dead.append, (sid, s.worker_generation))
        return s

    def _bury(self, pair: Pair) -> None:
        """SESSION_DESTROY for the sessions dropped on this side that the worker still holds."""
        while self._dead:
            sid, generation = self._dead.pop()
            if generation[0] != self.generation:
                continue
            pair.control.send(ds4t.SessionDestroy(sid))
            while not isinstance(pair.control.recv(idle_timeout=pair.control.io_timeout),
                                 ds4t.CommandAck):
                pass

    # ---- the pair -------------------------------------------------------------------------------

    def ensure_worker(self, wait_s: float | None = None) -> Pair:
        """The pair, once a worker has joined (waiting up to wait_s, default the engine's)."""
        with self._joining:  # (ds4 serve's health probe runs beside its generation thread)
            if self._drop_if_left():
                # an error for the command that finds it, at once (as a death during a command
                # is); the next call waits for a worker to join again
                raise self.fail("the wait between commands", ConnectionError("the worker closed its connection"))
            if self.pair is None:
                if self.on_wait is not None and wait_s is None:  # (not for a probe's short wait)
                    self.on_wait(self.address)
                self.pair = accept_worker(self.listener, self.model, self.ctx, self.opts,
                                          self.wait_s if wait_s is None else wait_s, self.backend.name,
                                          self.numerics)
                self.engine.partner = self.pair.partner
                self.generation += 1
                log.info("tensor parallel: worker joined (pair %d)", self.generation)
            return self.pair

    def worker_present(self) -> bool:
        """Whether a worker is joined, dropping one that left while idle. Only between commands:
        during one, the worker's replies would read as its end of stream."""
        with self._joining:
            self._drop_if_left()
            return self.pair is not None

    def _drop_if_left(self) -> bool:
        """Drop the pair if its worker closed the control connection; -> whether it did."""
        pair = self.pair
        if pair is None or not _closed_by_peer(pair.control.sock):
            return False
        log.warning("tensor parallel: the worker left while idle")
        pair.close()
        self.pair, self.engine.partner = None, None
        return True

    def connect(self, wait_s: float = PROBE_WAIT_S) -> None:
        """Take a worker that is waiting to join, within wait_s (ds4 serve's /health probe)."""
        self.ensure_worker(min(self.wait_s, wait_s))

    def fail(self, phase: str, e: BaseException) -> TPError:
        """Drop the pair after a failed command; -> the error to raise."""
        if self.pair is not None:
            self.pair.close()
        self.pair = None
        self.engine.partner = None
        why = str(e) or type(e).__name__
        return TPError(f"tensor parallel failed during {phase}: {why}; the session was "
                       "invalidated, and the next request waits for the worker to join again")

    def close(self) -> None:
        if self.pair is not None:
            try:
                self.pair.control.send(ds4t.Stop())
            except ds4t.DS4TError:
                pass
            self.pair.close()
            self.pair = None
        self.listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TPSession(Session):
    """A session whose every call the worker mirrors; logits cover the whole vocabulary."""

    def __init__(self, tp: TPEngine, layout, sid: int):
        self.tp = tp
        self.sid = sid
        # the pair this session's worker side lives on (0: none yet), in a list the engine's
        # finalizer can read after this object is gone
        self.worker_generation = [0]
        super().__init__(tp.engine, layout)

    @property
    def generation(self) -> int:
        return self.worker_generation[0]

    @generation.setter
    def generation(self, value: int) -> None:
        self.worker_generation[0] = value

    @property
    def tokens(self) -> list[int]:
        """The tokens the pair holds for this session: none once its worker has gone (a new one
        starts it empty at the next command)."""
        return super().tokens if self.generation == self.tp.generation else []

    # ---- the mirrored command -------------------------------------------------------------------

    def _pair(self) -> Pair:
        pair = self.tp.ensure_worker()
        if self.tp._dead:
            try:
                self.tp._bury(pair)
            except ds4t.DS4TError as e:
                raise self.tp.fail("session destroy", e) from None
        if self.generation != self.tp.generation:
            # a new worker: it has no state for this session; continue from an empty one
            if self._tokens:
                log.warning("tensor parallel: session %d restarts empty on the new worker", self.sid)
            Session._reset_state(self)
            if self.layout.prefill_cap > pair.limits.max_rows:
                raise ValueError(f"prefill_cap: expected at most {pair.limits.max_rows} (the pair's "
                                 f"bulk gate bound), got {self.layout.prefill_cap}")
            self._command(pair, ds4t.SessionCreate(self.sid, self.ctx, self.layout.prefill_cap),
                          "session create", None)
            self.generation = self.tp.generation
        return pair

    def _command(self, pair: Pair, frame, phase: str, local) -> None:
        """Send `frame`, run `local()` on this rank, then read the worker's report."""
        try:
            pair.control.send(frame)
            if local is not None:
                local()
            self._report(pair)
        except BaseException as e:  # whatever broke, the two ranks are no longer in step
            Session._reset_state(self)
            self.generation = 0
            err = self.tp.fail(phase, e)
            if not isinstance(e, Exception):
                raise
            raise err from None

    def _report(self, pair: Pair) -> None:
        mine = pair.partner.take_hashes()
        theirs: list[ds4t.Hash] = []
        worker_logits = None
        while True:
            frame = pair.control.recv(idle_timeout=pair.control.io_timeout)
            if isinstance(frame, ds4t.Hash):
                if not pair.debug_hash:  # (unasked-for hashes would pile up here)
                    raise ds4t.DS4TError("HASH", "the worker sent a hidden-state hash, but this pair "
                                         "runs without --debug-hash")
                theirs.append(frame)
            elif isinstance(frame, ds4t.Logits):
                worker_logits = np.array(frame.logits, dtype=np.float32)
            elif isinstance(frame, ds4t.CommandAck):
                if frame.session != self.sid:
                    raise ds4t.DS4TError("session", f"ack for session {frame.session}, expected {self.sid}")
                if frame.status != ds4t.AckStatus.OK:
                    raise TPError(f"the worker answered {frame.status.name} (its log says why)")
                break
        if pair.debug_hash:
            _compare_hashes(mine, theirs, len(self._tokens))
        if worker_logits is not None:
            # (a command with logits leaves the leader's part here, short of the vocabulary; a
            # no-op one, such as a rewind to where the session is, leaves them whole)
            if self._logits is None or self._logits.size + worker_logits.size != self.engine.config.n_vocab:
                raise ds4t.DS4TError("LOGITS", "the worker sent logits for a command that has none")
            self._logits = np.concatenate([self._logits, worker_logits])
        elif self._logits is not None and self._logits.size != self.engine.config.n_vocab:
            raise ds4t.DS4TError("LOGITS", "the worker sent no logits for a command that has them")

    # ---- Session's calls, mirrored --------------------------------------------------------------

    def sync(self, tokens) -> None:
        tokens = self._check_tokens(tokens)
        pair = self._pair()
        self._command(pair, ds4t.Sync(self.sid, np.asarray(tokens, dtype=np.uint32)), "prefill",
                      lambda: Session.sync(self, tokens))

    def eval(self, token: int) -> None:
        if len(self._tokens) + 1 > self.ctx:
            raise ValueError(f"eval: the session is full (ctx={self.ctx})")
        token = self._check_tokens([token])[0]
        pair = self._pair()
        self._command(pair, ds4t.Eval(self.sid, pair.partner.seq + 1, token), "decode",
                      lambda: Session.eval(self, token))

    def rewind(self, pos: int) -> None:
        if not 0 <= pos <= len(self._tokens):
            raise ValueError(f"rewind: expected a position in [0, {len(self._tokens)}], got {pos}")
        pair = self._pair()
        # (Session.rewind would call self.sync, a second mirrored command)
        self._command(pair, ds4t.Rewind(self.sid, pos), "rewind",
                      lambda: Session.sync(self, self._tokens[:pos]) if pos != len(self._tokens) else None)

    def invalidate(self) -> None:
        """Drop the session's tokens and state on both ranks."""
        pair = self._pair()
        self._command(pair, ds4t.Invalidate(self.sid), "invalidate", lambda: Session._reset_state(self))

    def close(self) -> None:
        """Free the worker's side of the session (this rank's goes with the object)."""
        if self.generation and self.generation == self.tp.generation and self.tp.pair is not None:
            self._command(self.tp.pair, ds4t.SessionDestroy(self.sid), "session destroy", None)
            self.generation = 0

    def sample(self, n: int, params=None, rng=None, stop: Container[int] = ()) -> Iterator[int]:
        from ..core.sampling import GREEDY

        return Session.sample(self, n, GREEDY if params is None else params, rng, stop)

    # ---- whole-state moves: the worker gets the same state as a DSV4 payload ----------------------

    def _send_state(self, pair: Pair, phase: str) -> None:
        buf = io.BytesIO()
        Session.save_payload(self, buf)
        self._command(pair, ds4t.State(self.sid, buf.getvalue()), phase, None)

    def load_payload(self, src, nbytes: int | None = None) -> None:
        pair = self._pair()  # (first: a worker that joins anew resets the session)
        Session.load_payload(self, src, nbytes)
        self._send_state(pair, "load")

    def restore(self, snap: Snapshot) -> None:
        pair = self._pair()
        Session.restore(self, snap)
        if snap.tokens:
            self._send_state(pair, "restore")
        else:
            self._command(pair, ds4t.Invalidate(self.sid), "restore", None)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle control connection was closed by the worker (nothing is due from it
    between commands, so anything readable is its end of stream or a protocol error)."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


def _compare_hashes(mine: list[LayerHash], theirs: list[ds4t.Hash], step: int) -> None:
    """--debug-hash: the ranks' hidden states after every layer must be equal bit for bit."""
    if len(mine) != len(theirs):
        raise TPError(f"debug hash at step {step}: this rank hashed {len(mine)} layers, the "
                      f"worker {len(theirs)}")
    for m, t in zip(mine, theirs):
        if m.seq != t.seq:
            raise ds4t.GateDesync("seq", f"debug hash at step {step}: expected seq {m.seq} "
                                  f"(layer {m.layer}), the worker sent {t.seq}")
        if m.value != t.value:
            raise TPError(f"debug hash: the ranks' hidden states differ after layer {m.layer} at "
                          f"step {step} (the session then held {step} tokens; gate seq {m.seq}): "
                          f"leader {m.value:016x}, worker {t.value:016x}")
