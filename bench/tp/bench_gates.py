"""Tensor-parallel gate exchange benchmark: what the two ranks' gates cost per decode token.

    python bench/tp/bench_gates.py                  # tcp, socket, gloo; nccl where it can run
    python bench/tp/bench_gates.py --transport tcp,socket --repeat 5
    python bench/tp/bench_gates.py --quick          # a smoke run, writes nothing

Two processes (multiprocessing spawn) on this host play rank 0 and rank 1 of a DS4T pair and
run a simulated decode with no model: for every token, for every layer, the ATTN gate then the
FFN gate, each an all-reduce of a [1, n_embd] float32 partial (seq from 1, +1 per record),
through the engine's own partners:

* tcp  — `WirePartner` over `ds4t.GateChannel` on a real TCP connection over 127.0.0.1
         (listen on port 0, accept, dial, TCP_NODELAY as ds4/tp/link.py sets it);
* gloo — `TorchPartner` (torch.distributed all-gather) between two CPU processes;
* nccl — `TorchPartner` with rank r on cuda:r, the partials kept on the GPU; needs two CUDA
         devices (NCCL refuses two ranks on one GPU), otherwise skipped with a message;
* socket — not an engine path: the same bytes on the same kind of connection with plain
         blocking sendmsg / recv_into and no checks (`SocketPartner`), a baseline that shows
         what of `tcp`'s time is the loopback and what is GateChannel's own (decode only).

Measured: the wall time of one token's 2 × n_layer exchanges (perf_counter around the gates
alone; the partials are made before the timed loop), median / p90 / p99 over the tokens after
a warmup, against the 3 ms target; and a bulk prefill chunk (BULK_ROWS rows per record, one
record per layer and gate) as GB/s of partial payload each rank sends (as much comes back).

Every record's partial comes from a seeded generator (`partials`), so a run can be checked:
with `keep_sums` the ranks return every sum they got, which must be p0 + p1 bit-exactly on
both (tests/test_bench_tp.py). Results: `results/gates-<machine>.csv` and `.json`, a row per
transport (a run replaces the rows of the transports it measured and keeps the others),
written by gates_report.py.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _p in (ROOT, HERE):  # ds4 and gates_report from anywhere; spawned ranks inherit sys.path
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from ds4.tp.partner import TorchPartner, WirePartner  # noqa: E402
from ds4.wire import ds4t  # noqa: E402
from gates_report import (gpu_names, machine_slug, print_record, summarize,  # noqa: E402
                          write_results)

RESULTS = HERE / "results"

# The real model's gate sizes (DeepSeek V4 Flash): 43 layers × 2 gates × 16 KiB a token.
N_LAYER = 43
N_EMBD = 4096
N_VOCAB = 129_280  # only fills ds4t.Limits; no logits move here
GATES = (ds4t.Gate.ATTN, ds4t.Gate.FFN)  # the order every layer fires them

DECODE_TOKENS = 1000  # measured tokens: enough for a p99 that is not the single worst token
WARMUP_TOKENS = 50  # connection setup, page faults, allocator and TCP window growth
POOL_TOKENS = 8  # distinct tokens' partials, cycled, so no record reuses the last one's buffer
BULK_ROWS = 2048  # one prefill chunk's rows per record (32 MiB at n_embd 4096)
BULK_CHUNKS = 3  # measured prefill chunks (each 2 × n_layer records)
BULK_WARMUP = 1
BULK_SLABS = 2  # distinct bulk partials per rank, alternated (a 32 MiB slab each)
SEED = 20260
REPEAT = 3  # fresh pairs per transport (see measure_interleaved)

# The bench measures speed, not liveness: a generous deadline keeps a loaded machine (or a
# slow bulk record) from failing a run that the engine's 750 ms default would fail.
GATE_TIMEOUT_MS = 30_000
RUN_TIMEOUT_S = 600.0  # a whole pair's run, from spawn to the last result
JOIN_TIMEOUT_S = 10.0
LOOPBACK = "127.0.0.1"
TRANSPORTS = ("tcp", "socket", "gloo", "nccl")
# A record this small fits the loopback socket buffers on both ends, so the baseline's blocking
# send cannot wait on a peer that is itself still sending (a decode row is 16 KiB + 24 B);
# a bulk record does not, and GateChannel's full-duplex loop is what serves it.
SOCKET_INLINE_BYTES = 64 * 1024
BULK_STREAM = 1 << 20  # keeps the bulk generators' seeds apart from the decode slots'


@dataclass(frozen=True)
class Config:
    transport: str = "tcp"
    n_layer: int = N_LAYER
    n_embd: int = N_EMBD
    tokens: int = DECODE_TOKENS
    warmup: int = WARMUP_TOKENS
    pool: int = POOL_TOKENS
    bulk_rows: int = BULK_ROWS
    bulk_chunks: int = BULK_CHUNKS  # 0: no bulk measurement
    bulk_warmup: int = BULK_WARMUP
    seed: int = SEED
    keep_sums: bool = False  # return every sum each rank got (small sizes only: tests)


def partials(seed: int, rank: int, slot: int, shape: tuple[int, ...]) -> np.ndarray:
    """A rank's seeded float32 partials: decode slot s is [n_layer, 2, 1, n_embd] (token t uses
    slot t % pool); bulk slab s is [rows, n_embd], generated with slot BULK_STREAM + s (the record
    of layer l, gate g uses slab (2l + g) % BULK_SLABS)."""
    return np.random.default_rng((seed, rank, slot)).standard_normal(shape, dtype=np.float32)


# ---- the stand-in backends: what a partner needs of the engine's backend ------------------------


class HostBackend:
    """Partials as host numpy arrays (the reference backend's view)."""

    def put(self, a: np.ndarray):
        return a

    def to_numpy(self, x) -> np.ndarray:
        return x

    def from_numpy(self, a: np.ndarray):
        return a

    def sync(self) -> None:
        pass


class CudaBackend:
    """Partials as torch tensors on the rank's GPU: `torch_value` keeps TorchPartner's gather and
    sum on the device, as with the Triton backend."""

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, device

    def put(self, a: np.ndarray):
        return self.torch.from_numpy(a).to(self.device)

    def torch_value(self, x):
        return x

    def to_numpy(self, x) -> np.ndarray:
        return x.cpu().numpy()

    def from_numpy(self, a: np.ndarray):
        return self.put(a)

    def sync(self) -> None:  # the token is done when the device is, not when it was queued
        self.torch.cuda.synchronize(self.device)


# ---- one rank ---------------------------------------------------------------------------------


def _loopback_pair(rank: int, port_q) -> socket.socket:
    """Rank 0 listens on 127.0.0.1:0 and sends its port to rank 1, which dials: a real TCP
    connection, as ds4/tp/link.py makes it (TCP_NODELAY: no Nagle wait on a 16 KiB record)."""
    if rank == 0:
        with socket.create_server((LOOPBACK, 0)) as listener:
            port_q.put(listener.getsockname()[1])
            sock, _ = listener.accept()
    else:
        sock = socket.create_connection((LOOPBACK, port_q.get(timeout=RUN_TIMEOUT_S)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _connect_tcp(rank: int, cfg: Config, port_q) -> WirePartner:
    sock = _loopback_pair(rank, port_q)
    max_rows = max(1, cfg.bulk_rows)
    limits = ds4t.Limits(cfg.n_layer, cfg.n_embd, N_VOCAB, ctx=max_rows, max_rows=max_rows)
    return WirePartner(ds4t.GateChannel(sock, limits, rank, 1 - rank, GATE_TIMEOUT_MS), rank)


class SocketPartner:
    """The baseline for `tcp`: the same bytes (a gate header, then the partial) on the same kind
    of connection, one blocking sendmsg and blocking recv_into, no checks, then p0 + p1: the
    plainest exchange a Python rank can make, not an engine path; decode rows only."""

    def __init__(self, sock: socket.socket, rank: int):
        self.sock, self.rank, self.seq = sock, rank, 0
        # blocking, no timeout: a timeout makes CPython poll around every call, which is
        # GateChannel's kind of cost, not the baseline's (a dead peer: the parent's RUN_TIMEOUT_S)
        sock.settimeout(None)

    def gate(self, be, il: int, gate, partial):
        self.seq += 1
        mine = np.ascontiguousarray(partial, dtype=np.float32).reshape(-1, partial.shape[-1])
        head = ds4t.GateHeader(il, ds4t.Gate(int(gate)), self.seq, mine.shape[0], self.rank).pack()
        buf = np.empty(len(head) + mine.nbytes, np.uint8)  # (not zero-filled, as GateChannel's)
        # both ends send before they read: safe only while a record fits the socket buffers
        if buf.nbytes > SOCKET_INLINE_BYTES:
            raise ValueError(f"socket baseline: a {buf.nbytes}-byte record is over the "
                             f"{SOCKET_INLINE_BYTES}-byte bound (decode rows only)")
        if self.sock.sendmsg([head, mine]) != buf.nbytes:  # (blocking: all of it, or an error)
            raise ConnectionError("socket baseline: a short send")
        view, got = memoryview(buf), 0
        while got < buf.nbytes:
            k = self.sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError("the peer closed the connection")
            got += k
        peer = buf[len(head):].view(np.float32).reshape(mine.shape)
        return ds4t.reduce_in_rank_order([mine, peer] if self.rank == 0 else [peer, mine])

    def close(self) -> None:
        self.sock.close()


def _connect_torch(rank: int, cfg: Config, port_q):
    import torch

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo over loopback, like the tcp run
    device = torch.device("cpu")
    if cfg.transport == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    store = None
    if rank == 0:
        store, port = TorchPartner.open_store(LOOPBACK, GATE_TIMEOUT_MS)
        port_q.put(port)
    else:
        port = port_q.get(timeout=RUN_TIMEOUT_S)
    partner = TorchPartner.join(cfg.transport, LOOPBACK, port, rank, GATE_TIMEOUT_MS,
                                device=device, store=store)
    return partner, CudaBackend(device) if cfg.transport == "nccl" else HostBackend()


def _timed(partner, be, record, count: int, n_layer: int, keep: bool):
    """`count` rounds of 2 × n_layer gates; -> (seconds per round, sums per round if keep)."""
    times, sums = [], []
    for t in range(count):
        t0 = time.perf_counter()
        out = [partner.gate(be, il, g, record(t, il, g)) for il in range(n_layer) for g in GATES]
        be.sync()
        times.append(time.perf_counter() - t0)
        if keep:
            sums.append(np.stack([be.to_numpy(o) for o in out]))
    return times, sums


def run_rank(rank: int, cfg: Config, port_q) -> dict:
    """One rank's whole run: make the partials, connect, decode, prefill chunks, close."""
    decode = [partials(cfg.seed, rank, s, (cfg.n_layer, len(GATES), 1, cfg.n_embd))
              for s in range(cfg.pool)]
    slabs = [partials(cfg.seed, rank, BULK_STREAM + s, (cfg.bulk_rows, cfg.n_embd))
             for s in range(BULK_SLABS)] if cfg.bulk_chunks else []
    if cfg.transport == "tcp":
        partner, be = _connect_tcp(rank, cfg, port_q), HostBackend()
    elif cfg.transport == "socket":
        partner, be = SocketPartner(_loopback_pair(rank, port_q), rank), HostBackend()
    else:
        partner, be = _connect_torch(rank, cfg, port_q)
    try:
        decode = [be.put(p) for p in decode]  # (on the GPU for nccl, before the clock starts)
        slabs = [be.put(s) for s in slabs]
        def row(t: int, il: int, g: int):
            return decode[t % cfg.pool][il, g]

        def slab(t: int, il: int, g: int):
            return slabs[(len(GATES) * il + g) % BULK_SLABS]

        dec_s, dec_sums = _timed(partner, be, row, cfg.warmup + cfg.tokens, cfg.n_layer,
                                 cfg.keep_sums)
        bulk_s, bulk_sums = [], []
        if cfg.bulk_chunks:
            bulk_s, bulk_sums = _timed(partner, be, slab, cfg.bulk_warmup + cfg.bulk_chunks,
                                       cfg.n_layer, cfg.keep_sums)
    finally:
        partner.close()
    out = {"decode_s": dec_s[cfg.warmup:], "bulk_s": bulk_s[cfg.bulk_warmup:]}
    if cfg.keep_sums:
        out["decode_sums"], out["bulk_sums"] = dec_sums, bulk_sums
    return out


def _rank_main(rank: int, cfg: Config, port_q, out_q) -> None:
    try:
        out_q.put((rank, "ok", run_rank(rank, cfg, port_q)))
    except BaseException:  # the parent reports the rank's traceback instead of waiting it out
        out_q.put((rank, "error", traceback.format_exc()))


# ---- the pair, the record ---------------------------------------------------------------------


@dataclass
class Measurement:
    record: dict  # gates_report.COLUMNS and the details the JSON keeps
    ranks: dict  # rank -> run_rank's result


def run_pair(cfg: Config) -> dict:
    """Spawn rank 0 and rank 1, run them, -> {rank: run_rank's result}; raises if one failed."""
    ctx = mp.get_context("spawn")  # fresh interpreters: no forked torch / socket state
    port_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, port_q, out_q), daemon=True)
             for r in range(ds4t.N_RANK)]
    for p in procs:
        p.start()
    got = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(got) < len(procs):
            try:
                rank, status, payload = out_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{cfg.transport}: no result within "
                                   f"{RUN_TIMEOUT_S:g} s") from None
            if status != "ok":
                raise RuntimeError(f"{cfg.transport}: rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
    return got


def measure(cfg: Config) -> Measurement:
    ranks = run_pair(cfg)
    return Measurement(summarize(cfg, ranks, ds4t.N_RANK), ranks)


def best_of(recs: list[dict]) -> dict:
    """The record of the lowest decode median, with every run's median and bulk GB/s beside it:
    on a machine other jobs share, the quietest run is the closest to what the exchange itself
    costs, and the spread says how much the others moved it."""
    best = min(recs, key=lambda r: r["ms_median"])
    best["details"]["repeat_ms_median"] = [r["ms_median"] for r in recs]
    best["details"]["repeat_bulk_gb_s"] = [r["bulk_gb_s"] for r in recs]
    return best


def measure_interleaved(cfgs: list[Config], repeat: int) -> list[dict]:
    """`repeat` rounds of one fresh pair per transport, the transports taking turns, so a burst
    of other load falls on all of them alike; -> each transport's best_of."""
    runs: dict[str, list[dict]] = {c.transport: [] for c in cfgs}
    for i in range(repeat):
        for cfg in cfgs:
            rec = measure(cfg).record
            runs[cfg.transport].append(rec)
            print(f"  ({cfg.transport} run {i + 1}/{repeat}: median {rec['ms_median']:.3f} ms)",
                  flush=True)
    return [best_of(runs[c.transport]) for c in cfgs]


def transports_to_run(choice: str) -> list[str]:
    """`choice`: "all" or a comma list. tcp and socket always; gloo where torch is; nccl where
    two CUDA devices are (a message otherwise)."""
    wanted = list(TRANSPORTS) if choice == "all" else choice.split(",")
    for t in wanted:
        if t not in TRANSPORTS:
            raise SystemExit(f"--transport: expected all or a comma list of "
                             f"{', '.join(TRANSPORTS)}, got {t!r}")
    run = []
    for t in wanted:
        if t in ("tcp", "socket"):
            run.append(t)
            continue
        try:
            import torch.distributed as dist
        except ImportError:
            print(f"{t}: skipped: torch is not installed")
            continue
        if t == "gloo" and not dist.is_gloo_available():
            print("gloo: skipped: this torch has no gloo")
        elif t == "nccl" and not (dist.is_nccl_available() and len(gpu_names()) >= ds4t.N_RANK):
            print(f"nccl: skipped: {len(gpu_names())} CUDA device(s) visible; NCCL refuses two "
                  "ranks on one GPU, so it needs two")
        else:
            run.append(t)
    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="all",
                    help=f"all, or a comma list of {', '.join(TRANSPORTS)}")
    ap.add_argument("--n-layer", type=int, default=N_LAYER)
    ap.add_argument("--n-embd", type=int, default=N_EMBD)
    ap.add_argument("--tokens", type=int, default=DECODE_TOKENS)
    ap.add_argument("--warmup", type=int, default=WARMUP_TOKENS)
    ap.add_argument("--bulk-rows", type=int, default=BULK_ROWS)
    ap.add_argument("--bulk-chunks", type=int, default=BULK_CHUNKS, help="0: no bulk measurement")
    ap.add_argument("--repeat", type=int, default=REPEAT,
                    help="rounds of a fresh pair per transport (taking turns); the run of "
                    "the lowest median is kept")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", help="results file name (default: the machine)")
    ap.add_argument("--quick", action="store_true", help="a few tokens, small bulk; writes nothing")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.tokens, a.warmup, a.bulk_rows, a.bulk_chunks, a.repeat = 50, 5, 256, 1, 1
        a.no_write = True
    cfgs = [Config(t, a.n_layer, a.n_embd, a.tokens, a.warmup, POOL_TOKENS, a.bulk_rows,
                   0 if t == "socket" else a.bulk_chunks)  # (the baseline is for decode rows)
            for t in transports_to_run(a.transport)]
    records = measure_interleaved(cfgs, a.repeat)
    for rec in records:
        print_record(rec)
    if records and not a.no_write:
        for p in write_results(records, a.out, a.name or machine_slug()):
            print(f"wrote {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}")


if __name__ == "__main__":
    main()
