"""DS4T gate records on the data connection: the 24-byte `GateHeader` and its check against the
expected record, `reduce_in_rank_order` (the one summation order all ranks use), and
`GateChannel`, which sends this rank's partial while reading the peer's under one deadline and
refuses further exchanges once one failed.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from dataclasses import dataclass

import numpy as np

from ...core.tp_split import Gate
from .base import (DEFAULT_GATE_TIMEOUT_MS, F32, GATE_HEADER, GATE_MAGIC, DS4TClosed, DS4TError,
                   GateDesync, GateTimeout)
from .channels import _tls_pending
from .frames import Limits


@dataclass(frozen=True)
class GateHeader:
    layer: int
    gate: Gate
    seq: int
    rows: int
    rank: int

    def pack(self) -> bytes:
        return GATE_HEADER.pack(GATE_MAGIC, self.layer, self.gate, self.seq, self.rows, self.rank, 0)

    @classmethod
    def unpack(cls, buf: bytes) -> "GateHeader":
        if len(buf) != GATE_HEADER.size:
            raise DS4TError("gate header", f"expected {GATE_HEADER.size} bytes, got {len(buf)}")
        magic, layer, gate, seq, rows, rank, reserved = GATE_HEADER.unpack(buf)
        if magic != GATE_MAGIC:
            raise DS4TError("magic", f"expected {GATE_MAGIC:#010x} (DS4T gate record), "
                            f"got {magic:#010x}")
        if gate not in tuple(Gate):
            raise DS4TError("gate", f"expected 0 (ATTN), 1 (FFN), 2 (HIDDEN) or 3 (ROUTE), got {gate}")
        if reserved:
            raise DS4TError("reserved", f"expected zero, got {reserved}")
        return cls(layer, Gate(gate), seq, rows, rank)

    def describe(self) -> str:
        return f"layer {self.layer} {self.gate.name} seq {self.seq} ({self.rows} rows, rank {self.rank})"


def check_gate_header(got: GateHeader, expected: GateHeader) -> None:
    """GateDesync naming the first field where the peer's record is not the expected one."""
    for name in ("rank", "layer", "gate", "seq", "rows"):
        if getattr(got, name) != getattr(expected, name):
            raise GateDesync(name, f"gate desync: expected {expected.describe()}, the peer sent "
                             f"{got.describe()}")


def reduce_in_rank_order(partials: list[np.ndarray]) -> np.ndarray:
    """((p0 + p1) + p2) + …, f32: the same order on every rank, so bit-identical sums."""
    total = np.array(partials[0], dtype=F32, copy=True)
    for p in partials[1:]:
        total += p
    return total


class GateChannel:
    """One rank's end of the data connection: exchanges gate records with one peer.

    The socket is switched to non-blocking; every exchange sends and receives at once under
    one deadline. A failed exchange (desync, timeout, closed peer, bad record) marks the
    channel failed; later exchanges are refused.
    """

    def __init__(self, sock: socket.socket, limits: Limits, rank: int, peer_rank: int,
                 gate_timeout_ms: int = DEFAULT_GATE_TIMEOUT_MS):
        self.sock, self.limits = sock, limits
        self.rank, self.peer_rank = rank, peer_rank
        self.timeout = gate_timeout_ms / 1000
        self.failed: DS4TError | None = None
        sock.setblocking(False)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLOUT)

    def exchange(self, layer: int, gate: Gate, seq: int, partial: np.ndarray) -> np.ndarray:
        """Send this rank's partial [rows, n_embd] f32 and return the peer's."""
        if self.failed is not None:
            raise DS4TError("failed", f"the gate channel already failed ({self.failed})")
        if partial.dtype != F32:  # partials are f32 on the wire; a silent cast would hide a bug
            raise ValueError(f"partial: expected float32, got {partial.dtype}")
        mine = np.ascontiguousarray(partial)
        if mine.ndim == 1:
            mine = mine.reshape(1, -1)
        rows = mine.shape[0]
        width = self.limits.width(Gate(gate))
        if mine.ndim != 2 or mine.shape[1] != width or not 1 <= rows <= self.limits.max_rows:
            raise ValueError(f"partial: expected [1..{self.limits.max_rows}, {width}], "
                             f"got {list(partial.shape)}")
        if not 0 <= layer < self.limits.n_layer:
            raise ValueError(f"layer: expected 0..{self.limits.n_layer - 1}, got {layer}")
        out = GateHeader(layer, Gate(gate), seq, rows, self.rank)
        expected = GateHeader(layer, Gate(gate), seq, rows, self.peer_rank)
        try:
            return self._exchange(out, expected, mine)
        except DS4TError as e:
            self.failed = e
            raise

    def all_reduce(self, layer: int, gate: Gate, seq: int, partial: np.ndarray) -> np.ndarray:
        """Exchange, then partial_rank0 + partial_rank1 (both ranks get the same bits). Two f32
        addends commute, so the rank order only shows from three ranks on; the same reduce
        serves both."""
        peer = self.exchange(layer, gate, seq, partial)
        # p0 + p1 into the peer's fresh buffer: one f32 addition is commutative bit for bit
        peer += np.asarray(partial, dtype=F32).reshape(peer.shape)
        return peer

    @staticmethod
    def _io(op, view: memoryview, expected: GateHeader) -> int:
        """One non-blocking send or recv_into; -1 when it would block (nothing moved)."""
        try:
            return op(view)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return -1
        except OSError as e:
            raise DS4TClosed("eof", f"gate {expected.describe()}: {e}") from None

    def _exchange(self, out: GateHeader, expected: GateHeader, mine: np.ndarray) -> np.ndarray:
        # Each pass tries every pending send and receive at once and waits in poll only when
        # neither moved a byte: a decode record (16 KiB) usually goes out in one send and the
        # peer's is often in already, so most exchanges skip the poll's bookkeeping.
        sends = [memoryview(out.pack()), memoryview(mine).cast("B")]
        want = expected.pack()  # (equal bytes pass every check of check_gate_header at once)
        head = bytearray(GATE_HEADER.size)
        peer = np.empty_like(mine)
        recvs = [memoryview(head), memoryview(peer).cast("B")]
        si = sent = ri = got = 0
        deadline = None
        sock, io = self.sock, self._io
        while ri < 2 or si < 2:
            moved = False
            while si < 2:
                k = io(sock.send, sends[si][sent:], expected)
                if k <= 0:
                    break
                moved, sent = True, sent + k
                if sent == len(sends[si]):
                    si, sent = si + 1, 0
            while ri < 2:
                k = io(sock.recv_into, recvs[ri][got:], expected)
                if k == 0:
                    raise DS4TClosed("eof", f"gate {expected.describe()}: the peer closed "
                                     "the data connection")
                if k < 0:
                    break
                moved, got = True, got + k
                if got == len(recvs[ri]):
                    if ri == 0 and head != want:  # the header decides before a payload byte is read
                        check_gate_header(GateHeader.unpack(bytes(head)), expected)
                    ri, got = ri + 1, 0
            if moved or (ri == 2 and si == 2):
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout
            left = deadline - now
            if left <= 0:
                raise GateTimeout("timeout", f"gate {expected.describe()} not done within "
                                  f"{self.timeout * 1000:g} ms (ours {'sent' if si == 2 else 'not sent'}"
                                  f", the peer's {'in' if ri == 2 else 'not in'})")
            if ri < 2 and _tls_pending(sock):
                continue  # (TLS holds decrypted bytes a poll of the descriptor cannot see)
            # wait only for what is still to do, so a finished direction cannot spin the loop
            self._poll.modify(sock, (select.POLLIN if ri < 2 else 0) | (select.POLLOUT if si < 2 else 0))
            self._poll.poll(max(1, int(left * 1000)))
        return peer
