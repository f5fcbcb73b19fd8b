"""The gate exchange of a tensor-parallel rank (the `Partner` of ds4/core/graph.py).

Two transports, one rule: each gate gathers the ranks' partial sublayer outputs and every rank
sums them in rank order, `p0 + p1`, so both ranks continue from the same bits whatever backend
each runs.

* `WirePartner` — DS4T gate records on the data connection (wire.md §2): the partial goes to
  the host, `GateChannel.all_reduce` swaps and sums it, and the sum goes back to the backend.
* `TorchPartner` — `torch.distributed` (NCCL between the GPUs of one host, gloo between CPU
  processes, which is how the tests cover this path): an all-gather of [header | partial] and
  the same rank-order sum, on the device when the backend's arrays are torch tensors.

Both count gate records with the same `seq` (from 1, one per record) and check the peer's
layer, gate, seq and row count before using its partial: a mismatch is a gate desync, never a
silently wrong sum. The torch transport first all-gathers a chunk record (position, rows,
logits, seq, rank) before a chunk's gates, since an all-gather whose sizes differ between the
ranks fails no better than by aborting or hanging. A `canonical` partner (ranks on different
backends) also swaps the ROUTE and HIDDEN records, and the worker adopts the leader's. With
`debug_hash` a partner records a hash of the hidden state after every layer, which the worker
reports and the leader compares (--debug-hash).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from ..core.tp_split import Gate
from ..wire import ds4t

F32 = np.float32
HEADER_WORDS = 8  # the header an all-gathered record carries, as int32 words (see _header)


def hidden_hash(x: np.ndarray) -> int:
    """A 64-bit hash of a hidden state's float32 bytes (blake2b)."""
    data = np.ascontiguousarray(x, dtype=F32).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass
class LayerHash:
    seq: int  # the seq of the layer's FFN gate record
    layer: int
    value: int


@dataclass
class _Base:
    rank: int
    debug_hash: bool = False
    canonical: bool = False  # the ranks run different backends: the leader's routing and state rule
    seq: int = 0  # gate records exchanged so far; the next one is seq + 1
    hashes: list[LayerHash] = field(default_factory=list)

    def _swap(self, il: int, gate: Gate, mine: np.ndarray) -> np.ndarray:
        """One record each way; -> the peer's [rows, width] f32."""
        raise NotImplementedError

    def _leaders(self, il: int, gate: Gate, mine: np.ndarray) -> np.ndarray:
        self.seq += 1
        theirs = self._swap(il, gate, np.ascontiguousarray(mine, dtype=F32))
        return mine if self.rank == 0 else theirs

    def routing(self, be, il: int, ids, weights):
        if not self.canonical:
            return ids, weights
        i = np.asarray(be.to_numpy(ids)).astype(np.int32)
        w = np.asarray(be.to_numpy(weights), dtype=F32)
        rows = self._leaders(il, Gate.ROUTE, np.concatenate([i.view(F32), w], axis=1))
        k = i.shape[1]
        return be.ids_from_numpy(np.ascontiguousarray(rows[:, :k]).view(np.int32)), be.from_numpy(rows[:, k:])

    def adopt(self, be, il: int, gate: Gate, X):
        if not self.canonical:
            return X
        x = np.asarray(be.to_numpy(X), dtype=F32)
        rows = self._leaders(il, Gate.HIDDEN, x.reshape(x.shape[0], -1))
        return X if self.rank == 0 else be.from_numpy(rows.reshape(x.shape))

    def begin_chunk(self, p0: int, rows: int, logits: bool) -> None:
        """Before a chunk's first gate (a WirePartner's records carry their row count, checked
        before their rows are read)."""

    def layer_done(self, be, il: int, X) -> None:
        if self.debug_hash:
            self.hashes.append(LayerHash(self.seq, il, hidden_hash(be.to_numpy(X))))

    def take_hashes(self) -> list[LayerHash]:
        out, self.hashes = self.hashes, []
        return out


class WirePartner(_Base):
    """Gates over a DS4T data connection; sums on the host in float32."""

    def __init__(self, channel: ds4t.GateChannel, rank: int, debug_hash: bool = False,
                 canonical: bool = False):
        super().__init__(rank, debug_hash, canonical)
        self.channel = channel

    def _swap(self, il: int, gate: Gate, mine: np.ndarray) -> np.ndarray:
        return self.channel.exchange(il, ds4t.Gate(int(gate)), self.seq, mine)

    def gate(self, be, il: int, gate: Gate, partial):
        self.seq += 1
        mine = np.ascontiguousarray(be.to_numpy(partial), dtype=F32)
        return be.from_numpy(self.channel.all_reduce(il, ds4t.Gate(int(gate)), self.seq, mine))

    def close(self) -> None:
        self.channel.sock.close()


# the words of an all-gathered record's header (TorchPartner._header) and the field each is
RECORD_FIELDS = ("magic", "layer", "gate", "seq", "seq", "rows", "rank", "reserved")
# the torch transport's chunk record (TorchPartner._chunk_header), all-gathered before a chunk's
# first gate; not a wire record
CHUNK_MAGIC = 0x44533448  # "DS4H"
CHUNK_FIELDS = ("magic", "p0", "p0", "rows", "logits", "seq", "seq", "rank")


def _two_halves(head: list[int], word: int) -> int:
    return head[word] | (head[word + 1] << 31)


def _check_words(head: list[int], want: list[int], fields: tuple, rank: int, record: str, where: str) -> None:
    """GateDesync naming the first field of rank's `record` whose word differs from want's, with
    both values; a field named twice in `fields` is one value in two 31-bit halves."""
    for word, (got, exp) in enumerate(zip(head, want)):
        if got != exp:
            field = fields[word]
            if fields.count(field) == 2:
                first = fields.index(field)
                got, exp = _two_halves(head, first), _two_halves(want, first)
            raise ds4t.GateDesync(field, f"gate desync: rank {rank}'s {record} has {field} {got}, "
                                  f"expected {exp} ({where})")


def check_record_header(head: list[int], want: list[int], rank: int) -> None:
    """The words of TorchPartner._header against want's (_check_words)."""
    _check_words(head, want, RECORD_FIELDS, rank, "record",
                 f"layer {want[1]}, gate {want[2]}, seq {_two_halves(want, 3)}")


def check_chunk_header(head: list[int], want: list[int], rank: int) -> None:
    """The words of TorchPartner._chunk_header against want's (_check_words)."""
    _check_words(head, want, CHUNK_FIELDS, rank, "chunk",
                 f"chunk at position {_two_halves(want, 1)} of {want[3]} rows")


class TorchPartner(_Base):
    """Gates through a torch.distributed process group of two ranks (NCCL or gloo)."""

    def __init__(self, rank: int, device, debug_hash: bool = False, canonical: bool = False,
                 group=None):
        super().__init__(rank, debug_hash, canonical)
        import torch

        self.torch, self.device, self.group = torch, device, group

    @classmethod
    def join(cls, backend: str, host: str, store_port: int, rank: int, timeout_ms: int,
             device=None, debug_hash: bool = False, canonical: bool = False,
             store=None, prefix: str = "") -> "TorchPartner":
        """Join (rank 1: the store at host:store_port, its keys under `prefix`) or form (rank 0,
        with the `store` it opened, open_store) the two-rank group."""
        import torch
        import torch.distributed as dist

        if store is None:
            store = dist.PrefixStore(prefix, dist.TCPStore(host, store_port, 2, False,
                                                           timeout=timedelta(milliseconds=timeout_ms * 20)))
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, store=store, rank=rank, world_size=ds4t.N_RANK,
                                timeout=timedelta(milliseconds=timeout_ms),
                                **({"device_id": device} if backend == "nccl" else {}))
        return cls(rank, device, debug_hash, canonical)

    @staticmethod
    def open_store(host: str, timeout_ms: int, prefix: str):
        """The leader's TCPStore on a free port of `host` alone (TCPStore itself would listen on
        every interface), its keys under `prefix` (-> store, port)."""
        import torch.distributed as dist

        sock = socket.create_server((host, 0), backlog=ds4t.N_RANK)
        port = sock.getsockname()[1]
        fd = sock.detach()  # (the store's server listens on this descriptor and owns it from here)
        try:
            store = dist.TCPStore(host, port, ds4t.N_RANK, True, timeout=timedelta(milliseconds=timeout_ms * 20),
                                  wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        return dist.PrefixStore(prefix, store), store.port

    def _header(self, il: int, gate: Gate, rows: int) -> list[int]:
        # seq as two 32-bit halves: int32 words travel bit-exactly inside the f32 record
        return [ds4t.GATE_MAGIC, il, int(gate), self.seq & 0x7FFFFFFF, self.seq >> 31,
                rows, self.rank, 0]

    def _chunk_header(self, p0: int, rows: int, logits: bool) -> list[int]:
        return [CHUNK_MAGIC, p0 & 0x7FFFFFFF, p0 >> 31, rows, int(logits),
                self.seq & 0x7FFFFFFF, self.seq >> 31, self.rank]

    def begin_chunk(self, p0: int, rows: int, logits: bool) -> None:
        """Both ranks' chunks checked alike before any gate: an all-gather of unequal sizes
        is no error the group can report (gloo aborts the process, NCCL waits out its timeout),
        and a gate's record size follows from the chunk's rows. One record of len(CHUNK_FIELDS)
        words a chunk, so a decode step pays one small collective."""
        torch = self.torch
        mine = torch.tensor(self._chunk_header(p0, rows, logits), dtype=torch.int32,
                            device=self.device).view(torch.float32)
        parts = [torch.empty_like(mine) for _ in range(ds4t.N_RANK)]
        self._all_gather(parts, mine, f"chunk at position {p0} of {rows} rows")
        for r, part in enumerate(parts):
            want = self._chunk_header(p0, rows, logits)
            want[7] = r
            check_chunk_header(part.view(torch.int32).cpu().tolist(), want, r)

    def _all_gather(self, parts, mine, what: str) -> None:
        try:
            self.torch.distributed.all_gather(parts, mine, group=self.group)
        except Exception as e:  # (a dead or frozen peer: the group's timeout, or its error)
            raise ds4t.DS4TClosed("gate", f"{what}: torch.distributed all-gather failed: {e}") from None

    def _swap(self, il: int, gate: Gate, mine: np.ndarray) -> np.ndarray:
        both = self._gather(il, gate, self.torch.from_numpy(mine).to(self.device))
        return both[1 - self.rank].cpu().numpy()

    def gate(self, be, il: int, gate: Gate, partial):
        torch = self.torch
        self.seq += 1
        on_device = hasattr(be, "torch_value")
        x = be.torch_value(partial) if on_device else torch.from_numpy(
            np.ascontiguousarray(be.to_numpy(partial), dtype=F32))
        both = self._gather(il, gate, x.reshape(-1, x.shape[-1]).to(self.device, torch.float32))
        total = both[0] + both[1]  # rank order: p0 + p1
        return total if on_device else be.from_numpy(total.cpu().numpy())

    def _gather(self, il: int, gate: Gate, x):
        """All-gather this rank's [rows, width] record with its header; the peer's header is
        checked before its rows are used. -> [2, rows, width], rank order."""
        torch = self.torch
        rows, width = x.shape
        mine = torch.empty(HEADER_WORDS + rows * width, dtype=torch.float32, device=self.device)
        mine[:HEADER_WORDS].view(torch.int32).copy_(
            torch.tensor(self._header(il, gate, rows), dtype=torch.int32, device=self.device))
        mine[HEADER_WORDS:].copy_(x.reshape(-1))
        parts = [torch.empty_like(mine) for _ in range(ds4t.N_RANK)]
        self._all_gather(parts, mine, f"gate layer {il} {Gate(gate).name} seq {self.seq}")
        both = torch.stack(parts)
        heads = both[:, :HEADER_WORDS].contiguous().view(torch.int32).cpu().tolist()
        for r, head in enumerate(heads):
            want = self._header(il, gate, rows)
            want[6] = r
            check_record_header(head, want, r)
        return both[:, HEADER_WORDS:].reshape(ds4t.N_RANK, rows, width)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
