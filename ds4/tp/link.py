"""Forming a two-rank pair (wire.md §2): the leader listens, the worker dials twice.

The first connection the leader accepts is control, the second data; on each the two ends
swap hellos, check them (`ds4t.check_peer`) and, with a shared secret, prove it both ways
before any frame or gate record moves. A connection that fails its proof or breaks off is
closed and the leader goes on waiting for a real worker until its deadline; a worker whose
hello does not fit (another model, other dims) is refused at once (TPRefused names the field). With TORCH_GATES the
leader then opens a torch.distributed store and sends its port on the data connection.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import time
from dataclasses import dataclass

from ..core.payload import session_payload_bytes
from ..core.payload_identity import IDENTITY_FOOTER_BYTES, MAX_MODEL_NAME_BYTES
from ..core.state import SessionLayout
from ..wire import ds4t
from .partner import TorchPartner, WirePartner

log = logging.getLogger("ds4.tp")

TRANSPORTS = ("tcp", "nccl", "gloo")
STORE_PORT = struct.Struct("<II")  # {u32 store_port, u32 reserved}: TORCH_GATES only
DEFAULT_WAIT_S = 300.0  # how long a leader waits for its worker


class TPError(RuntimeError):
    """Tensor parallel failed; the message names the phase and what went wrong."""


class TPRefused(TPError):
    """The peer is not a worker (leader) this end can pair with."""


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


def _shake(sock: socket.socket, mine: ds4t.Hello, opts: Options, role: ds4t.Role):
    auth = ds4t.mutual_auth(opts.auth_token, role, opts.io_timeout) if opts.auth_token else None
    return ds4t.handshake(sock, mine, timeout=opts.io_timeout, authenticate=auth)


def listen(host: str, port: int) -> socket.socket:
    s = socket.create_server((host, port), reuse_port=False)
    s.listen(4)
    return s


def _accept_one(listener: socket.socket, deadline: float, opts: Options, mine: ds4t.Hello,
                what: str, wait_s: float) -> tuple[socket.socket, ds4t.Hello, int]:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TPError(f"no worker joined within the wait of {wait_s:g} s ({what} connection)")
        listener.settimeout(left)
        try:
            sock, addr = listener.accept()
        except TimeoutError:
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if opts.tls is not None:
                sock.settimeout(opts.io_timeout)
                sock = opts.tls.wrap_socket(sock, server_side=True)
            theirs, ctx = _shake(sock, mine, opts, ds4t.Role.LEADER)
            return sock, theirs, ctx
        except (ds4t.DS4TError, OSError, ssl.SSLError) as e:
            log.warning("tensor parallel: refused %s:%s on the %s connection: %s", *addr[:2], what, e)
            sock.close()
            if isinstance(e, ds4t.HelloRefused):
                raise TPRefused(f"a worker from {addr[0]} does not fit this leader: {e}") from None


def accept_worker(listener: socket.socket, model, ctx: int, opts: Options,
                  wait_s: float = DEFAULT_WAIT_S, backend: str = "reference",
                  numerics: str = "ds4") -> Pair:
    """The leader's side: wait (up to wait_s) for a worker's control and data connections."""
    mine = _hello(model, ds4t.Role.LEADER, ctx, opts, backend, numerics)
    deadline = time.monotonic() + wait_s
    control, peer, agreed = _accept_one(listener, deadline, opts, mine, "control", wait_s)
    try:
        # (the worker dials its data connection right after the control one: a short probe
        # wait that the control handshake used up must not turn it away)
        data_wait = max(deadline - time.monotonic(), opts.io_timeout)
        data, _, _ = _accept_one(listener, time.monotonic() + data_wait, opts, mine, "data", data_wait)
    except BaseException:
        control.close()
        raise
    limits = limits_for(model, mine, agreed)
    canonical = peer.backend != mine.backend
    try:
        if opts.transport == "tcp":
            partner = WirePartner(ds4t.GateChannel(data, limits, 0, 1, opts.gate_timeout_ms), 0,
                                  opts.debug_hash, canonical)
        else:
            store, port = TorchPartner.open_store(data.getsockname()[0], opts.gate_timeout_ms)
            data.sendall(STORE_PORT.pack(port, 0))
            partner = TorchPartner.join(opts.transport, "", port, 0, opts.gate_timeout_ms,
                                        debug_hash=opts.debug_hash, canonical=canonical, store=store)
    except BaseException:
        control.close()
        data.close()
        raise
    return Pair(ds4t.ControlChannel(control, limits, ds4t.Role.WORKER, opts.io_timeout), partner,
                data, limits, peer, agreed, opts.debug_hash)


def _dial(host: str, port: int, opts: Options, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if opts.tls is not None:
        sock = opts.tls.wrap_socket(sock, server_hostname=host)
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
            raw = ds4t.recv_exact(socks[1], STORE_PORT.size, opts.io_timeout, "the store port")
            store_port, reserved = STORE_PORT.unpack(bytes(raw))
            if reserved or not 0 < store_port < 65536:
                raise ds4t.DS4TError("store_port", f"expected a port and a zero, got {store_port}, {reserved}")
            partner = TorchPartner.join(opts.transport, host, store_port, 1, opts.gate_timeout_ms,
                                        debug_hash=debug_hash, canonical=canonical)
    except ds4t.HelloRefused as e:
        for s in socks:
            s.close()
        raise TPRefused(f"the leader at {host}:{port} does not fit this worker: {e}") from None
    except (ds4t.DS4TError, OSError, ssl.SSLError) as e:
        for s in socks:
            s.close()
        raise TPError(f"joining the leader at {host}:{port}: {e}") from None
    return Pair(ds4t.ControlChannel(socks[0], limits, ds4t.Role.LEADER, opts.io_timeout), partner,
                socks[1], limits, peer, ctx, debug_hash)
