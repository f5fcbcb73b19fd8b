"""The head's connection to the next stage: `_Link` (lazy connect, hello checks, poisoned by
any error and reconnected on the next request)."""

from __future__ import annotations

import logging
import ssl

import numpy as np

from ..wire import qkp, sniff
from ..wire.address import format_hostport
from .common import PipelineError, PipelineRefused

log = logging.getLogger("ds4.pipeline")


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
        return format_hostport(self.host, self.port)

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
        except sniff.PlainPeer as e:  # (it names the stage and what to do)
            raise PipelineRefused(str(e)) from None
        except OSError as e:
            raise PipelineError(f"cannot reach the next stage at {self.addr}: "
                                f"{e.strerror or e}") from None
        try:
            hello = qkp.client_handshake(conn, self.token, self.exact)
            self.check(hello)
        except qkp.Refused as e:  # its reason names the field, the stage's value and ours
            conn.close()
            raise PipelineRefused(f"the next stage at {self.addr} refused this head: "
                                  f"{e.reason}") from None
        except qkp.HelloRefused as e:
            conn.close()
            raise PipelineRefused(f"the next stage at {self.addr} does not fit this head: {e}") from None
        except qkp.AuthRefused as e:
            conn.close()
            raise PipelineRefused(f"refused the next stage at {self.addr}: {e}") from None
        except (qkp.QkpClosed, ConnectionError):  # closed, or reset with our bytes unread
            conn.close()
            raise PipelineRefused(
                f"the next stage at {self.addr} closed the connection during the hello without "
                "a reason: it has --max-conns connections open, or it is not a ds4 pipe-worker "
                "of this version (qkp6); its log says which") from None
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
