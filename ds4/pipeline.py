"""Pipeline split: one model served as contiguous layer ranges over qkp5 (ds4/wire/qkp.py).

The worker side is a `Stage` (layers [a, b) of one model, per-slot state and snapshots) behind a
`Worker` (the TCP server; a middle stage forwards every frame to its own next stage). The head
side is `SplitEngine`, which runs layers [0, a) locally and looks like an `Engine`:

    eng = SplitEngine.open("model.gguf", "127.0.0.1:9000", layers="0:3", sampling=params)
    s = eng.session(ctx=4096)
    s.sync(prompt_ids)
    token = s.next_token(params, rng)   # or ds4.pipeline.next_token(s, params, rng)
    s.eval(token)

What crosses a link: the mHC state rows (n_hc × n_embd float32 per token) and the token ids
(the hash-routed layers pick experts by token id). A prefill streams one frame per chunk as each
chunk's local layers finish, at most two frames in flight; the last stage answers with the greedy
id after every position and, when the head samples (temperature > 0), what sampling reads of the
final position: its top_k candidates (top_k in 1..256), else its whole logits row. The head
samples with `ds4.core.sampling.sample` and its own seeded generator, so a split run draws the
same uniforms from the same vector as an unsplit run: token-identical for every sampler and
seed. `SplitSession.sample(n, params, rng, stop)` is `Session.sample`'s loop.

Sessions own worker slots: each session OPENs its slot on the engine's connection, the worker
binds it to one of its `--slots` (the total over all heads) or refuses when all are held, and
closing the session (or the connection) gives it back (qkp.py's docstring has the protocol).

Failure: any socket or protocol error poisons the link. The request in progress fails with a
`PipelineError` (a RuntimeError: the CLI prints it as one error line); the link reconnects on the
next request; every session whose worker-side state belonged to the old connection re-prefills
its tokens from position 0 on its next sync/eval, and saved snapshots are forgotten.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Container, Iterator
from dataclasses import dataclass
from queue import Queue

import numpy as np

from .core.graph import chunk_bounds, run_layers
from .core.sampling import GREEDY, Rng, SamplingParams, argmax, sample, top_candidates
from .core.state import FILL, SessionLayout, layer_state_shapes
from .engine import Engine, Session, Snapshot, check_tokens, common_prefix
from .wire import qkp
from .wire.deadline import Deadline

log = logging.getLogger("ds4.pipeline")

DEFAULT_MAX_ROWS = 512
DEFAULT_IO_TIMEOUT = 120.0
DEFAULT_IDLE_TIMEOUT = 3600.0
DEFAULT_CONNECT_TIMEOUT = 10.0
OPEN_RETRY_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8)  # seconds between OPENs a full worker refused
DEFAULT_MAX_CONNS = 64


class PipelineError(RuntimeError):
    """A split request failed (the link broke, a stage refused); the message says what to do."""


class PipelineRefused(PipelineError):
    """The next stage refused the hello, or the head refused the next stage's hello."""


def parse_layers(text: str | range, n_layer: int) -> range:
    """'A:B' (or a range) -> range(A, B), checked against the model's layer count."""
    if isinstance(text, range):
        r = text
    else:
        try:
            a, b = (int(x) for x in str(text).split(":"))
        except ValueError:
            raise ValueError(f"layers: expected A:B (e.g. 0:3), got {text!r}") from None
        r = range(a, b)
    if r.step != 1 or not 0 <= r.start < r.stop <= n_layer:
        raise ValueError(f"layers: expected A:B with 0 <= A < B <= {n_layer}, got {r.start}:{r.stop}")
    return r


def parse_addr(text: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def topk_for(params: SamplingParams | None) -> int:
    """What the last stage must return of the final position for the head to sample with
    `params` exactly as `ds4.core.sampling.sample` samples the whole vector: nothing (greedy:
    its argmax), the top_k candidates (top_k in 1..TOPK_MAX: the sampler reads only those), or
    the whole logits row (qkp.TOPK_LOGITS: the min-p path, top-p and larger top_k read
    tokens anywhere in the vocabulary)."""
    if params is None:
        return 0
    p = params.normalized()
    if float(np.float32(p.temperature)) <= 0.0:
        return 0
    return p.top_k if 0 < p.top_k <= qkp.TOPK_MAX else qkp.TOPK_LOGITS


def covers(have: int, need: int) -> bool:
    """Whether a reply asked with topk `have` holds what sampling needing `need` reads."""
    if need == 0 or have == qkp.TOPK_LOGITS:
        return True
    return need != qkp.TOPK_LOGITS and have >= need


def next_token(session, params: SamplingParams, rng) -> int:
    """The next token of an unsplit `Session` or a `SplitSession`, the same way for both."""
    if isinstance(session, SplitSession):
        return session.next_token(params, rng)
    return sample(session.logits, params, rng)


# ==== worker side ===================================================================================


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
        return {il: be.alloc_state(layer_state_shapes(cfg, self.layout, il), FILL) for il in self.layers}

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
            be = self.backend
            arrays = {il: {name: be.state_to_numpy(st, name) for name in st}
                      for il, st in slot.states.items()}
            self.snapshots[index] = _StageSnapshot(slot.pos, arrays)
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
            for il, st in slot.states.items():
                for name in st:
                    self.backend.state_from_numpy(st, name, snap.arrays[il][name])
            slot.pos = snap.count
            return qkp.STATUS_OK


def rows_to_backend(be, rows: np.ndarray):
    """The mHC rows a stage receives, [n, n_hc, n_embd] float32, as the backend's array type."""
    return be.from_numpy(rows)


def _greedy_or_none(logits: np.ndarray) -> int:
    return argmax(logits) if np.isfinite(logits).any() else qkp.NO_TOKEN


class Worker:
    """The TCP server of one stage: `ds4 pipe-worker`.

    One thread per connection; the stage's lock serialises compute. A middle stage (`next_addr`)
    opens its own connection to the next stage for every client connection, proves the chain
    behind it fits before answering the client's hello, forwards each frame as soon as its rows
    are computed and relays the replies in order on a second thread, so the next stage's work on
    frame k overlaps this stage's work on frame k + 1.
    """

    def __init__(self, stage: Stage, *, host: str = "127.0.0.1", port: int = 0,
                 auth_token: str | None = None, next_addr: str | tuple[str, int] | None = None,
                 io_timeout: float = DEFAULT_IO_TIMEOUT, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 max_conns: int = DEFAULT_MAX_CONNS, tls_server=None, tls_client=None):
        if next_addr is not None and stage.last:
            raise ValueError("next: the last stage has no next stage")
        if max_conns < 1:
            raise ValueError(f"max_conns: expected at least 1, got {max_conns}")
        self.stage = stage
        self.host = host
        self.auth_token = auth_token or None
        self.next_addr = parse_addr(next_addr) if isinstance(next_addr, str) else next_addr
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.max_conns = max_conns
        self.tls_server = tls_server  # ssl.SSLContext for clients of this stage, or None
        self.tls_client = tls_client  # ssl.SSLContext for the link to the next stage, or None
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._owners = itertools.count(1)  # one owner id per connection: its slots, its snapshots
        self._last_refused = None
        self._thread: threading.Thread | None = None
        self.refused_conns = 0  # connections closed at once because max_conns were open

    # ---- lifecycle ----

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sock, addr = self._sock.accept()
                except socket.timeout:
                    continue
                except OSError as e:
                    if self._stop.is_set():
                        break
                    # out of file descriptors, an aborted connection: the worker goes on
                    log.warning("qkp: accept failed: %s", e)
                    self._stop.wait(0.05)
                    continue
                with self._conns_lock:
                    full = len(self._conns) >= self.max_conns
                    if not full:
                        self._conns.add(sock)
                if full:  # nothing allocated for it: closed before its hello is read
                    self.refused_conns += 1
                    log.warning("qkp %s:%s: refused: %d connections are open (--max-conns)",
                                addr[0], addr[1], self.max_conns)
                    sock.close()
                    continue
                threading.Thread(target=self._serve_conn, args=(sock, addr), daemon=True,
                                 name=f"qkp-{addr[0]}:{addr[1]}").start()
        finally:
            self._sock.close()

    def start(self) -> "Worker":
        """Serve on a background thread (tests, benchmarks)."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True, name="qkp-accept")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._conns_lock:
            for s in list(self._conns):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- one client connection ----

    def _serve_conn(self, sock: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        owner = next(self._owners)
        down: qkp.Conn | None = None
        relay: _Relay | None = None
        clean = False
        conn = None
        try:
            if self.tls_server is not None:
                sock.settimeout(self.io_timeout)  # bounds the TLS handshake too
                raw, sock = sock, self.tls_server.wrap_socket(sock, server_side=True)
                with self._conns_lock:  # stop() must reach the socket that owns the fd now
                    self._conns.discard(raw)
                    self._conns.add(sock)
            conn = qkp.Conn(sock, self.io_timeout, peer)
            flags = qkp.read_client_hello(conn, self.auth_token, self.stage.exact)
            conn.trusted = self.auth_token is not None  # it proved the token
            if self.next_addr is not None:
                down = self._connect_next(flags)
                relay = _Relay(conn, down, self.stage.hello)
            conn.send(self.stage.hello.pack())
            log.info("qkp %s: connected", peer)
            self._frames(conn, down, relay, owner)
            clean = True
        except qkp.QkpClosed as e:
            if e.field != "eof" or relay is None or not relay.failed:
                log.info("qkp %s: closed: %s", peer, e)
        except qkp.QkpError as e:
            log.warning("qkp %s: closing the connection: %s", peer, e)
        except OSError as e:
            log.warning("qkp %s: closing the connection: socket error: %s", peer, e)
        except Exception as e:  # a compute failure must not take the worker down
            log.error("qkp %s: closing the connection: %s: %s", peer, type(e).__name__, e)
        finally:
            if relay is not None:
                if not clean:
                    down.shutdown()  # the relay must not wait for replies nobody will take
                relay.finish()
            if conn is not None:
                conn.close()
            else:
                sock.close()
            if down is not None:
                down.close()
            self.stage.release(owner)  # after the relay: nothing of this connection runs now
            with self._conns_lock:
                self._conns.discard(sock)

    def _connect_next(self, flags: int) -> qkp.Conn:
        host, port = self.next_addr
        try:
            down = qkp.Conn.connect(host, port, self.io_timeout, self.connect_timeout,
                                    tls=self.tls_client)
        except OSError as e:
            raise qkp.QkpError("next", f"cannot reach the next stage at {host}:{port}: {e}") from None
        try:
            peer = qkp.client_handshake(down, self.auth_token, bool(flags & qkp.FLAG_EXACT))
            h = self.stage.hello
            qkp.check_next_stage(peer, layer_end=h.layer_end, n_layer=h.n_layer, n_embd=h.n_embd,
                                 n_hc=h.n_hc, n_vocab=h.n_vocab, fingerprint=h.fingerprint,
                                 n_slots=h.n_slots, n_ctx=h.n_ctx, max_rows=h.max_rows)
        except (qkp.QkpError, OSError) as e:
            down.close()
            raise qkp.QkpError("next", f"the next stage at {host}:{port} does not fit: {e}") from None
        return down

    def _frames(self, conn: qkp.Conn, down: qkp.Conn | None, relay: "_Relay | None",
                owner) -> None:
        stage = self.stage
        answers_topk = stage.last or down is not None
        while not self._stop.is_set():
            header = conn.recv_exact(qkp.HEADER.size, timeout=self.idle_timeout)
            # the rest of the frame, however it trickles in, within one io timeout
            deadline = Deadline(self.io_timeout, f"a frame from {conn.peer}")
            frame = qkp.read_frame(lambda n: conn.recv_exact(n, deadline=deadline), stage.hello,
                                   answers_topk=answers_topk, header=header)
            h = frame.header
            if h.op == qkp.BYE:
                if relay is not None:
                    relay.put(("bye", None))
                    down.send(h.pack())
                return
            if h.op == qkp.EVAL:
                out = stage.eval(frame, owner)
                if relay is None:
                    conn.send(out)
                else:
                    relay.put(("eval", h))
                    down.send(h.pack(), frame.tokens, out)
            else:
                status = self._status_op(h, owner)
                if relay is None:
                    conn.send(qkp.STATUS.pack(status))
                elif status != qkp.STATUS_OK:
                    relay.put(("local", qkp.STATUS.pack(status)))
                else:
                    # an OPEN the next stage refuses gives this stage's slot back too
                    undo = (lambda: stage.free(owner, h.slot)) if h.op == qkp.OPEN else None
                    relay.put(("status", undo))
                    down.send(h.pack())
            if relay is not None and relay.failed:
                raise qkp.QkpClosed("next", "the link to the next stage broke")

    def _status_op(self, h: qkp.Header, owner) -> int:
        stage = self.stage
        if h.op == qkp.OPEN:
            status = stage.open(owner, h.slot)
            if status == qkp.STATUS_NO_SLOT and self._last_refused != owner:
                self._last_refused = owner  # once per connection: a head asks a few times
                log.warning("qkp: refused an OPEN: all %d slots are held (--slots is the total "
                            "over all connections)", len(stage.slots))
            return status
        if h.op == qkp.FREE:
            return stage.free(owner, h.slot)
        return stage.save(h, owner) if h.op == qkp.SAVE else stage.load(h, owner)


class _Relay:
    """A middle stage's reply path: reads the next stage's replies in order and passes them up."""

    def __init__(self, up: qkp.Conn, down: qkp.Conn, limits: qkp.Hello):
        self.up, self.down, self.limits = up, down, limits
        self.failed = False
        self._q: Queue = Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"qkp-relay-{up.peer}")
        self._thread.start()

    def put(self, item) -> None:
        self._q.put(item)

    def _run(self) -> None:
        try:
            while True:
                kind, h = item = self._q.get()
                if kind in ("stop", "bye"):
                    return
                if kind == "local":
                    self.up.send(h)
                elif kind == "eval":
                    self.up.send(self.down.recv_exact(self.limits.eval_reply_bytes(h.n, h.topk)))
                elif kind == "status":  # h: None, or what to undo when the next stage refuses
                    reply = bytes(self.down.recv_exact(qkp.STATUS.size))
                    if h is not None and qkp.STATUS.unpack(reply)[0] != qkp.STATUS_OK:
                        h()
                    self.up.send(reply)
                else:  # pragma: no cover
                    raise AssertionError(item)
        except (qkp.QkpError, OSError) as e:
            self.failed = True
            log.warning("qkp %s: the next stage failed: %s; closing the connection", self.up.peer, e)
            self.up.shutdown()  # wakes the reader thread, which cleans up
            self.down.shutdown()

    def finish(self) -> None:
        """Wait for the replies still owed (after BYE), or give up on error."""
        self._q.put(("stop", None))
        self._thread.join(timeout=self.down.timeout + 1)


# ==== head side =====================================================================================


class _Link:
    """The head's connection to the next stage: lazy, poisoned by any error, reconnected on the
    next request. `generation` counts successful connects; worker-side state belongs to one."""

    def __init__(self, addr: tuple[str, int], *, token: str | None, exact: bool, check,
                 io_timeout: float, connect_timeout: float, tls=None):
        self.host, self.port = addr
        self.token, self.exact, self.check = token, exact, check
        self.tls = tls
        self.io_timeout, self.connect_timeout = io_timeout, connect_timeout
        self.conn: qkp.Conn | None = None
        self.hello: qkp.Hello | None = None
        self.generation = 0
        self.in_flight = 0

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def ensure(self) -> qkp.Hello:
        if self.conn is not None and self.in_flight == 0 and self.conn.closed_by_peer():
            log.info("pipeline: the link to %s was closed while idle; reconnecting", self.addr)
            self.drop()
        if self.conn is None:
            self._connect()
        return self.hello

    def _connect(self) -> None:
        try:
            conn = qkp.Conn.connect(self.host, self.port, self.io_timeout, self.connect_timeout,
                                    tls=self.tls)
        except OSError as e:
            raise PipelineError(f"cannot reach the next stage at {self.addr}: "
                                f"{e.strerror or e}") from None
        try:
            hello = qkp.client_handshake(conn, self.token, self.exact)
            self.check(hello)
        except qkp.HelloRefused as e:
            conn.close()
            raise PipelineRefused(f"the next stage at {self.addr} does not fit this head: {e}") from None
        except qkp.AuthRefused as e:
            conn.close()
            raise PipelineRefused(f"refused the next stage at {self.addr}: {e}") from None
        except (qkp.QkpClosed, ConnectionError):  # closed, or reset with our bytes unread
            conn.close()
            numerics = "exact" if self.exact else "ds4"
            why = ("it refused the auth token" if self.token else
                   "it may require an auth token (--auth-token-file / DS4_WIRE_TOKEN)")
            raise PipelineRefused(
                f"the next stage at {self.addr} closed the connection during the hello: {why}, "
                f"or it runs numerics other than this head's ({numerics}), or it cannot reach "
                "its own next stage; its log says which") from None
        except ssl.SSLError as e:
            conn.close()
            raise PipelineRefused(f"TLS with the next stage at {self.addr} failed: {e} (does it "
                                  "require a client certificate, --tls-cert/--tls-key?)") from None
        except (qkp.QkpError, OSError) as e:
            conn.close()
            raise PipelineRefused(f"the next stage at {self.addr} sent a bad hello: {e}") from None
        self.conn, self.hello, self.in_flight = conn, hello, 0
        self.generation += 1

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn, self.in_flight = None, 0

    def broken(self, what: str, e: BaseException) -> PipelineError:
        self.drop()
        detail = str(e) if isinstance(e, qkp.QkpError) else (getattr(e, "strerror", None) or str(e) or type(e).__name__)
        return PipelineError(f"the pipeline failed during {what}: the link to the next stage at "
                             f"{self.addr} broke ({detail}); the next request reconnects")

    def send_eval(self, slot: int, base: int, tokens: np.ndarray, rows: np.ndarray, topk: int) -> None:
        h = qkp.Header(qkp.EVAL, slot, len(tokens), base, topk)
        self.conn.send(h.pack(), np.ascontiguousarray(tokens, dtype="<u4"), rows)
        self.in_flight += 1

    def recv_eval(self, n: int, topk: int) -> tuple[np.ndarray, np.ndarray]:
        buf = self.conn.recv_exact(self.hello.eval_reply_bytes(n, topk))
        self.in_flight -= 1
        return qkp.unpack_eval_reply(bytes(buf), n, topk)

    def status(self, op: int, slot: int, index: int, count: int) -> int:
        if self.in_flight:  # the spec: SAVE/LOAD wait until nothing is in flight
            raise RuntimeError("SAVE/LOAD with EVAL frames still in flight")
        self.conn.send(qkp.Header(op, slot, index, 0, count).pack())
        (status,) = qkp.STATUS.unpack(bytes(self.conn.recv_exact(qkp.STATUS.size)))
        return status

    def close(self) -> None:
        if self.conn is not None and self.in_flight == 0:
            try:
                self.conn.send(qkp.Header(qkp.BYE, 0, 0, 0, 0).pack())
            except OSError:
                pass
        self.drop()


class SplitEngine:
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
        addr = parse_addr(next_addr) if isinstance(next_addr, str) else next_addr
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
        from .core.gguf_model import GGUFModel

        if isinstance(layers, int):
            layers = range(0, layers)
        if path is None:
            from .core.default_model import default_model_path

            path = default_model_path()
        r = parse_layers(layers, GGUFModel(path).config.n_layer)
        return cls(Engine.open(path, backend=backend, numerics=numerics, layers=r), next_addr, **kw)

    # ---- Engine-like surface ----

    @property
    def config(self):
        return self.engine.config

    @property
    def model(self):
        return self.engine.model

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def backend(self):
        return self.engine.backend

    @property
    def numerics(self) -> str:
        return self.engine.numerics

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


# ==== command-line entry (the CLI's `ds4 pipe-worker` is cli/pipe.py) ===============================

def serve(path, layers: str | range, *, port: int = 0, backend: str = "reference",
          numerics: str = "ds4", slots: int = 1, ctx: int = 4096, snapshots: int = 0,
          max_rows: int = DEFAULT_MAX_ROWS, **worker_kw) -> Worker:
    """Open layers A:B of the model and bind a worker for them (call `serve_forever()`)."""
    from .core.gguf_model import GGUFModel

    if path is None:
        from .core.default_model import default_model_path

        path = default_model_path()
    n_layer = GGUFModel(path).config.n_layer
    r = parse_layers(layers, n_layer)
    if r.start == 0:
        raise ValueError(f"layers: a worker serves A:B with A >= 1 (the head runs 0:A), got "
                         f"{r.start}:{r.stop}")
    if r.stop < n_layer and worker_kw.get("next_addr") is None:
        raise ValueError(f"layers {r.start}:{r.stop} end before the model's last layer "
                         f"({n_layer}): a middle stage needs --next HOST:PORT")
    engine = Engine.open(path, backend=backend, numerics=numerics, layers=r)
    if ctx > engine.config.context_length:
        raise ValueError(f"ctx: {ctx} is more than the model's context_length "
                         f"{engine.config.context_length}")
    stage = Stage(engine, slots=slots, ctx=ctx, snapshots=snapshots, max_rows=min(max_rows, ctx))
    return Worker(stage, port=port, **worker_kw)
