"""Forming a two-rank pair (wire.md §2): the leader listens, the worker dials twice.

The worker dials control, then data; on each the two ends swap hellos, check them
(`ds4t.check_peer`) and, with a shared secret, prove it both ways before any frame or gate
record moves. The leader runs each connection's handshake on a thread of its own and takes the
oldest that completed, waiting only for older ones whose peer proved the secret (`_Arrivals`;
without a secret, accept order), so a peer that stalls does not hold up the worker behind it. A
connection that fails its proof or breaks off is closed and the leader goes on waiting for a
real worker until its deadline; a worker whose hello does not fit (another model, other dims) is
refused at once (TPRefused names the field) once it has proven the secret (without one, at
once): a stranger's hello cannot end the wait. With TORCH_GATES the leader then opens a
torch.distributed store on its own address only, its keys under a random prefix, and sends the
port and prefix on the data connection.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from ..core.payload import session_payload_bytes
from ..core.payload_identity import IDENTITY_FOOTER_BYTES, MAX_MODEL_NAME_BYTES
from ..core.state import SessionLayout
from ..wire import ds4t, sniff
from ..wire.address import format_hostport, listen_socket
from ..wire.deadline import Deadline
from .partner import TorchPartner, WirePartner

log = logging.getLogger("ds4.tp")

TRANSPORTS = ("tcp", "nccl", "gloo")
STORE_PREFIX_BYTES = 16
# {u32 store_port, u32 record version, the store's key prefix}: TORCH_GATES only. The store has
# no secret of its own; its keys live under a prefix only the authenticated pair knows. (The
# version sits where the record without a prefix had a zero, so a worker from before it refuses
# the record at once instead of waiting on the store without the prefix.)
STORE_RECORD_VERSION = 2
STORE_RECORD = struct.Struct(f"<II{STORE_PREFIX_BYTES}s")
DEFAULT_WAIT_S = 300.0  # how long a leader waits for its worker
LISTEN_BACKLOG = 16
MAX_HANDSHAKES = 16  # connections a leader handshakes at once
ACCEPT_POLL_S = 0.05  # how often a waiting leader looks at the handshakes under way
# past its deadline, how long a leader with a secret still waits for a handshake whose peer has
# not proven it yet (a worker proves it within round trips of connecting; a stranger never does)
PROOF_GRACE_S = 2.0


class TPError(RuntimeError):
    """Tensor parallel failed; the message names the phase and what went wrong."""


class TPRefused(TPError):
    """The peer is not a worker (leader) this end can pair with."""


class TPClosed(TPError):
    """The leader's end of a connection closed or went silent before its handshake ended (not
    listening, busy, dropping it for a newer one, or past the io timeout): joining again may
    succeed."""


@dataclass
class Options:
    """What both ends of a pair need besides the model."""

    transport: str = "tcp"
    auth_token: str | None = None
    tls: ssl.SSLContext | None = None  # a server context on the leader, a client one on the worker
    gate_timeout_ms: int = ds4t.DEFAULT_GATE_TIMEOUT_MS
    io_timeout: float = 120.0
    debug_hash: bool = False  # the leader's choice (the worker adopts it)

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {self.transport!r}")


@dataclass
class Pair:
    """One end of a formed pair."""

    control: ds4t.ControlChannel
    partner: WirePartner | TorchPartner
    data: socket.socket
    limits: ds4t.Limits
    peer: ds4t.Hello
    ctx: int
    debug_hash: bool

    def close(self) -> None:
        for s in (self.control.sock, self.data):
            try:
                s.close()
            except OSError:
                pass
        if isinstance(self.partner, TorchPartner):
            self.partner.close()


def limits_for(model, hello: ds4t.Hello, ctx: int) -> ds4t.Limits:
    """A receiver's limits: bulk gates of up to one prefill chunk, STATE up to a full-ctx
    payload of this end's own model."""
    layout = SessionLayout.create(model.config, ctx)
    state = session_payload_bytes(model.config, layout, ctx) + IDENTITY_FOOTER_BYTES + MAX_MODEL_NAME_BYTES
    return ds4t.Limits.from_hello(hello, max_rows=layout.prefill_cap, ctx=ctx, max_state_bytes=state,
                                  n_hc=model.config.n_hc, n_route=model.config.n_expert_used)


def _hello(model, role: ds4t.Role, ctx: int, opts: Options, backend: str, numerics: str) -> ds4t.Hello:
    return ds4t.Hello.for_gguf(model, role, ctx, auth=bool(opts.auth_token),
                               debug_hash=opts.debug_hash and role == ds4t.Role.LEADER,
                               torch_gates=opts.transport != "tcp", backend=backend,
                               exact=numerics == "exact")


def _shake(sock: socket.socket, mine: ds4t.Hello, opts: Options, role: ds4t.Role,
           proven: threading.Event | None = None):
    """Swap and check hellos on sock, with the shared secret's mutual proof where there is one;
    `proven` is set once the peer has proven the secret."""
    auth = None
    if opts.auth_token:
        prove = ds4t.mutual_auth(opts.auth_token, role, opts.io_timeout)

        def auth(s: socket.socket) -> None:
            prove(s)
            if proven is not None:
                proven.set()
    return ds4t.handshake(sock, mine, timeout=opts.io_timeout, authenticate=auth)


def listen(host: str, port: int) -> socket.socket:
    """The leader's listener (a port in use or a foreign host: ListenError, naming the address)."""
    return listen_socket(host, port, LISTEN_BACKLOG, v6only=True)


class _Arrival:
    """One accepted connection and its handshake (on a thread of its own)."""

    def __init__(self, sock: socket.socket, addr):
        self.sock = sock  # (the TLS socket once wrapped: what close() must shut down)
        self.addr = addr
        self.done = Future()  # -> (socket, peer hello, agreed ctx), or the error
        self.proven = threading.Event()  # its peer proved the shared secret
        self.started = time.monotonic()
        self.dropped = False  # cut for a newer connection (its handshake is ending)

    def cut(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class _Arrivals:
    """The leader's accepted connections, each handshaken on a daemon thread of its own (at most
    MAX_HANDSHAKES at once: a newer connection takes the place of the oldest whose peer has not
    proven the secret, so strangers that connect and stay silent cannot keep the worker out).
    `next` hands out the oldest that completed: the worker dials control, then data, each after
    the one before has completed, so an older connection whose peer proved the secret (about to
    complete) is waited for, and one that has not (a stranger stalling) is passed by; without a
    secret, accept order."""

    def __init__(self, listener: socket.socket, opts: Options, mine: ds4t.Hello):
        self.listener, self.opts, self.mine = listener, opts, mine
        self.pending: deque[_Arrival] = deque()  # in accept order
        self.lock = threading.Lock()
        self.closed = False

    def _shake(self, a: _Arrival) -> None:
        sock = a.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.opts.tls is not None:
                sock.settimeout(self.opts.io_timeout)
                sock = _accept_tls(sock, self.opts)
                with self.lock:
                    a.sock = sock
                    if self.closed:
                        raise OSError("the leader stopped waiting")
            theirs, ctx = _shake(sock, self.mine, self.opts, ds4t.Role.LEADER, a.proven)
            with self.lock:
                if self.closed:  # (the leader has its pair, or gave up, meanwhile)
                    sock.close()
                    return
                a.done.set_result((sock, theirs, ctx))
        except (ds4t.DS4TError, OSError, ssl.SSLError) as e:
            sock.close()
            # A refused hello ends the wait only when it came from a peer that speaks DS4T and
            # proved the secret (or where there is none): a worker that will never fit. A TLS
            # mismatch or a refusal record proves no such thing (any stranger can send a
            # ClientHello, an HTTP request or "DS4R"), so those are logged and dropped by _take.
            ends_the_wait = (isinstance(e, ds4t.HelloRefused)
                             and not isinstance(e, (ds4t.TlsMismatch, ds4t.PeerRefused))
                             and (a.proven.is_set() or not self.opts.auth_token))
            a.done.set_exception(TPRefused(f"a worker from {a.addr[0]} does not fit this leader: {e}")
                                 if ends_the_wait else e)
        except BaseException as e:  # (a bug: the waiting leader raises it)
            sock.close()
            a.done.set_exception(e)

    def _take(self, what: str):
        """The oldest completed handshake that nothing older and proven is about to beat, or
        None; failed ones are logged and dropped (TPRefused goes up)."""
        for a in list(self.pending):
            if a.done.done():
                self.pending.remove(a)
                try:
                    return a.done.result()
                except (ds4t.DS4TError, OSError, ssl.SSLError) as e:  # (TPRefused and bugs go up)
                    log.warning("tensor parallel: refused %s on the %s connection: %s",
                                format_hostport(*a.addr[:2]), what, e)
            elif a.proven.is_set() or not self.opts.auth_token:
                # a worker's connection, about to complete, comes first (without a secret any
                # peer may be the worker: accept order)
                return None
        return None

    def next(self, deadline: float, what: str, wait_s: float) -> tuple[socket.socket, ds4t.Hello, int]:
        """The next connection to complete its handshake (-> socket, peer hello, agreed ctx),
        accepting until `deadline`; handshakes under way then may finish within the io timeout.
        TPRefused for a worker that does not fit."""
        while True:
            got = self._take(what)
            if got is not None:
                return got
            now = time.monotonic()
            if now >= deadline:
                if any(self._may_be_the_worker(a, now) for a in self.pending) \
                        and now < deadline + self.opts.io_timeout:
                    time.sleep(ACCEPT_POLL_S)  # (one that began in time may finish, as before)
                    continue
                raise TPError(f"no worker joined within the wait of {wait_s:g} s ({what} connection)")
            self.listener.settimeout(min(deadline - now, ACCEPT_POLL_S))
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            busy = [a for a in self.pending if not a.done.done() and not a.dropped]
            if len(busy) >= MAX_HANDSHAKES:
                victim = next((a for a in busy if not a.proven.is_set()), None)
                if victim is None:
                    log.warning("tensor parallel: refused %s: %d handshakes under way already",
                                format_hostport(*addr[:2]), MAX_HANDSHAKES)
                    sock.close()
                    continue
                log.warning("tensor parallel: dropped %s, the oldest of %d handshakes under way, whose "
                            "peer had not proven the secret, for a newer connection",
                            format_hostport(*victim.addr[:2]), MAX_HANDSHAKES)
                victim.dropped = True
                victim.cut()
            a = _Arrival(sock, addr)
            self.pending.append(a)
            threading.Thread(target=self._shake, args=(a,), daemon=True, name="ds4-tp-handshake").start()

    def _may_be_the_worker(self, a: _Arrival, now: float) -> bool:
        """Whether a handshake under way past the deadline is worth waiting for: its peer proved
        the secret, or it began less than PROOF_GRACE_S ago; without a secret, any."""
        if a.done.done() or a.dropped:
            return False
        return not self.opts.auth_token or a.proven.is_set() or now - a.started < PROOF_GRACE_S

    def close(self) -> None:
        """Drop the connections not handed out (their handshakes end on the closed socket)."""
        with self.lock:
            self.closed = True
            pending, self.pending = list(self.pending), deque()
        for a in pending:
            a.cut()
            if a.done.done() and a.done.exception() is None:
                a.done.result()[0].close()


def accept_worker(listener: socket.socket, model, ctx: int, opts: Options,
                  wait_s: float = DEFAULT_WAIT_S, backend: str = "reference",
                  numerics: str = "ds4") -> Pair:
    """The leader's side: wait (up to wait_s) for a worker's control and data connections."""
    mine = _hello(model, ds4t.Role.LEADER, ctx, opts, backend, numerics)
    deadline = time.monotonic() + wait_s
    arrivals = _Arrivals(listener, opts, mine)
    try:
        control, peer, agreed = arrivals.next(deadline, "control", wait_s)
        try:
            # (the worker dials its data connection right after the control one: a short probe
            # wait that the control handshake used up must not turn it away)
            data_wait = max(deadline - time.monotonic(), opts.io_timeout)
            data, _, _ = arrivals.next(time.monotonic() + data_wait, "data", data_wait)
        except BaseException:
            control.close()
            raise
    finally:
        arrivals.close()
    limits = limits_for(model, mine, agreed)
    canonical = peer.backend != mine.backend
    try:
        if opts.transport == "tcp":
            partner = WirePartner(ds4t.GateChannel(data, limits, 0, 1, opts.gate_timeout_ms), 0,
                                  opts.debug_hash, canonical)
        else:
            prefix = secrets.token_bytes(STORE_PREFIX_BYTES)
            store, port = TorchPartner.open_store(data.getsockname()[0], opts.gate_timeout_ms, prefix.hex())
            data.sendall(STORE_RECORD.pack(port, STORE_RECORD_VERSION, prefix))
            partner = TorchPartner.join(opts.transport, "", port, 0, opts.gate_timeout_ms,
                                        debug_hash=opts.debug_hash, canonical=canonical, store=store)
    except BaseException:
        control.close()
        data.close()
        raise
    return Pair(ds4t.ControlChannel(control, limits, ds4t.Role.WORKER, opts.io_timeout), partner,
                data, limits, peer, agreed, opts.debug_hash)


def _accept_tls(sock: socket.socket, opts: Options) -> ssl.SSLSocket:
    """The leader's TLS socket for a worker; one that connected in plain text gets DS4T's
    refusal and TlsMismatch is raised (`sniff.accept_tls`), so that it fails at once instead of
    retrying a closed connection."""
    return sniff.accept_tls(opts.tls, sock, Deadline(opts.io_timeout, "the worker's first bytes"),
                            _plain_worker)


def _plain_worker() -> tuple[ds4t.TlsMismatch, bytes]:
    e = ds4t.TlsMismatch("tls", sniff.plain_client_reason("worker", "leader"))
    return e, ds4t.refusal_record(str(e))


def _dial(host: str, port: int, opts: Options, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if opts.tls is not None:
        try:
            sock = sniff.wrap_client(opts.tls, sock, host, f"the leader at {format_hostport(host, port)}")
        except BaseException:
            sock.close()
            raise
    return sock


def join_leader(host: str, port: int, model, opts: Options, connect_timeout: float = 10.0,
                backend: str = "reference", numerics: str = "ds4") -> Pair:
    """The worker's side: dial the leader twice; raises TPRefused / TPError naming why."""
    mine = _hello(model, ds4t.Role.WORKER, 1, opts, backend, numerics)  # (it adopts the leader's ctx)
    socks = []
    try:
        socks.append(_dial(host, port, opts, connect_timeout))
        peer, ctx = _shake(socks[0], mine, opts, ds4t.Role.WORKER)
        socks.append(_dial(host, port, opts, connect_timeout))
        _shake(socks[1], mine, opts, ds4t.Role.WORKER)
        limits = limits_for(model, mine, ctx)
        debug_hash = bool(peer.flags & ds4t.FLAG_DEBUG_HASH)
        canonical = peer.backend != mine.backend
        if opts.transport == "tcp":
            partner = WirePartner(ds4t.GateChannel(socks[1], limits, 1, 0, opts.gate_timeout_ms), 1,
                                  debug_hash, canonical)
        else:
            raw = ds4t.recv_exact(socks[1], STORE_RECORD.size, opts.io_timeout, "the store record")
            store_port, version, prefix = STORE_RECORD.unpack(bytes(raw))
            if version != STORE_RECORD_VERSION:
                raise ds4t.DS4TError("store record", f"version: expected {STORE_RECORD_VERSION}, got {version} "
                                     "(the leader runs another ds4)")
            if not 0 < store_port < 65536:
                raise ds4t.DS4TError("store_port", f"expected a port in 1..65535, got {store_port}")
            partner = TorchPartner.join(opts.transport, host, store_port, 1, opts.gate_timeout_ms,
                                        debug_hash=debug_hash, canonical=canonical, prefix=prefix.hex())
    except ds4t.PeerRefused as e:
        for s in socks:
            s.close()
        raise TPRefused(f"the leader at {format_hostport(host, port)} refused this worker: {e.reason}") from None
    except sniff.PlainPeer as e:  # (not a closed connection: joining again cannot help)
        for s in socks:
            s.close()
        raise TPRefused(f"joining the leader: {e}") from None
    except (ds4t.HelloRefused, ValueError) as e:  # (ValueError: a ctx this model cannot hold)
        for s in socks:
            s.close()
        raise TPRefused(f"the leader at {format_hostport(host, port)} does not fit this worker: {e}") from None
    except (ds4t.DS4TError, OSError, ssl.SSLError) as e:
        for s in socks:
            s.close()
        closed = isinstance(e, (ds4t.DS4TClosed, ConnectionError))
        raise (TPClosed if closed else TPError)(f"joining the leader at {format_hostport(host, port)}: {e}") from None
    return Pair(ds4t.ControlChannel(socks[0], limits, ds4t.Role.LEADER, opts.io_timeout), partner,
                socks[1], limits, peer, ctx, debug_hash)
