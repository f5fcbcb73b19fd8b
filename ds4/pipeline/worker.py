"""The worker side's server: `Worker` (one thread per qkp connection, TLS, auth, deadlines,
--max-conns), a middle stage's `_Relay`, and `serve` (what `ds4 pipe-worker` runs)."""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from queue import Queue

from ..engine import Engine
from ..wire import qkp, sniff
from ..wire.address import format_hostport, listen_socket, parse_hostport
from ..wire.deadline import Deadline
from .common import (DEFAULT_CONNECT_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_IO_TIMEOUT,
                     DEFAULT_MAX_CONNS, DEFAULT_MAX_ROWS, parse_layers)
from .stage import Stage

log = logging.getLogger("ds4.pipeline")


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
                 max_conns: int = DEFAULT_MAX_CONNS, tls_server=None, tls_client=None,
                 sock: socket.socket | None = None):
        """`sock`: a socket already listening (see `listen`), which the worker then owns, so that
        a caller binds before it loads the model; None: bind host:port here."""
        if next_addr is not None and stage.last:
            raise ValueError("next: the last stage has no next stage")
        if max_conns < 1:
            raise ValueError(f"max_conns: expected at least 1, got {max_conns}")
        self.stage = stage
        self.host = host
        self.auth_token = auth_token or None
        self.next_addr = parse_hostport(next_addr, "next_addr") if isinstance(next_addr, str) else next_addr
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.max_conns = max_conns
        self.tls_server = tls_server  # ssl.SSLContext for clients of this stage, or None
        self.tls_client = tls_client  # ssl.SSLContext for the link to the next stage, or None
        self._sock = sock if sock is not None else listen(host, port)  # (a failure: ListenError)
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
                    log.warning("qkp %s: refused: %d connections are open (--max-conns)",
                                format_hostport(*addr[:2]), self.max_conns)
                    sock.close()
                    continue
                threading.Thread(target=self._serve_conn, args=(sock, addr), daemon=True,
                                 name=f"qkp-{format_hostport(*addr[:2])}").start()
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
        peer = format_hostport(*addr[:2])
        owner = next(self._owners)
        down: qkp.Conn | None = None
        relay: _Relay | None = None
        clean = False
        conn = None
        try:
            if self.tls_server is not None:
                sock.settimeout(self.io_timeout)  # bounds the TLS handshake too
                raw, sock = sock, self._accept_tls(sock)
                with self._conns_lock:  # stop() must reach the socket that owns the fd now
                    self._conns.discard(raw)
                    self._conns.add(sock)
            conn = qkp.Conn(sock, self.io_timeout, peer)
            try:
                flags = qkp.read_client_hello(conn, self.auth_token, self.stage.exact)
                conn.trusted = self.auth_token is not None  # it proved the token
                if self.next_addr is not None:
                    down = self._connect_next(flags)
            except qkp.QkpClosed:
                raise  # (nobody left to tell)
            except qkp.QkpError as e:
                qkp.refuse(sock, e)  # the client reads why, not a bare close
                raise
            if down is not None:
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

    def _accept_tls(self, sock: socket.socket):
        """The TLS socket of a client; one that connected in plain text gets qkp's refusal
        (`sniff.accept_tls`), so that it learns why instead of reading a closed connection."""
        return sniff.accept_tls(self.tls_server, sock,
                                Deadline(self.io_timeout, "the client's first bytes"),
                                _plain_client)

    def _connect_next(self, flags: int) -> qkp.Conn:
        host, port = self.next_addr
        try:
            down = qkp.Conn.connect(host, port, self.io_timeout, self.connect_timeout,
                                    tls=self.tls_client)
        except OSError as e:
            raise qkp.QkpError("next", f"cannot reach the next stage at {format_hostport(host, port)}: {e}") from None
        try:
            peer = qkp.client_handshake(down, self.auth_token, bool(flags & qkp.FLAG_EXACT))
            h = self.stage.hello
            qkp.check_next_stage(peer, layer_end=h.layer_end, n_layer=h.n_layer, n_embd=h.n_embd,
                                 n_hc=h.n_hc, n_vocab=h.n_vocab, fingerprint=h.fingerprint,
                                 n_slots=h.n_slots, n_ctx=h.n_ctx, max_rows=h.max_rows)
        except qkp.Refused as e:
            down.close()
            raise qkp.QkpError("next", f"the next stage at {format_hostport(host, port)} refused: "
                               f"{e.reason}") from None
        except (qkp.QkpError, OSError) as e:
            down.close()
            raise qkp.QkpError("next", f"the next stage at {format_hostport(host, port)} does not fit: {e}") from None
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


def _plain_client() -> tuple[qkp.TlsMismatch, bytes]:
    e = qkp.TlsMismatch("tls", sniff.plain_client_reason("client", "stage"))
    return e, qkp.refusal_record(e)


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


def listen(host: str, port: int) -> socket.socket:
    """A worker's listener (a port in use or a foreign host: ListenError, naming the address):
    bound before the model is loaded, it is Worker's (and serve's) `sock`."""
    return listen_socket(host, port, v6only=True)


def serve(path, layers: str | range, *, port: int = 0, backend: str = "reference",
          numerics: str = "ds4", slots: int = 1, ctx: int = 4096, snapshots: int = 0,
          max_rows: int = DEFAULT_MAX_ROWS, **worker_kw) -> Worker:
    """Open layers A:B of the model and bind a worker for them (call `serve_forever()`);
    `sock=` (in worker_kw) serves on a socket bound beforehand (see `listen`) instead."""
    from ..core.gguf_model import GGUFModel

    if path is None:
        from ..core.default_model import default_model_path

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
