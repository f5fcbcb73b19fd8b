"""Reliability under strangers and slow peers (issue #32, points 4-6).

    python bench/reliability/bench_reliability.py [--conns 1000] [--out FILE.json]

(default --out: results/strangers.json in this folder, and the .csv beside it)

1. Strangers against a `ds4 pipe-worker` (its own process, the test model, --max-rows 512):
   N connections are opened and left stalled, in three ways, and the worker's resident memory
   (VmRSS of /proc/PID/status) is read before, with them open, and after they closed:
   * `silent`: connect, send nothing;
   * `eval`:   a worker without a token; the client hello, then an EVAL header announcing
               max_rows rows and its token ids, then nothing (the announced rows are 2 MiB);
   * `auth`:   a worker with a token; the client hello and nonce, then no proof.
2. Slow peers against a DS4K receiver (io timeout 2 s): a sender that drips its record header,
   and one that drips the payload, one byte every 0.5 s; the time from the first byte to the
   receiver dropping the connection (never without a deadline: each byte resets a timeout).

Results (JSON, and a CSV beside it) name the machine. The functions are imported by the tests
(tests/test_wire_security.py) with small N.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds4.core.atomic import atomic_file  # noqa: E402
from ds4.wire import auth, ds4k, qkp  # noqa: E402

MAX_ROWS = 512
SETTLE_S = 1.0  # time for the worker to accept and park every connection before reading RSS


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


def start_worker(model: Path, *, token_file: Path | None, max_conns: int,
                 io_timeout: float = 120.0) -> tuple[subprocess.Popen, int]:
    argv = [sys.executable, "-m", "cli.pipe", "pipe-worker", "0", "3:5", "-m", str(model),
            "--max-rows", str(MAX_ROWS), "--max-conns", str(max_conns),
            "--io-timeout", str(io_timeout)]
    if token_file is not None:
        argv += ["--auth-token-file", str(token_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DS4_WIRE_TOKEN", None)
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    m = re.search(r"listening on \S+:(\d+)", line or "")
    if not m:
        p.kill()
        raise RuntimeError(f"the worker did not start: {line!r}")
    return p, int(m.group(1))


def _stranger(port: int, mode: str, hello: qkp.Hello | None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    if mode == "eval":
        s.sendall(qkp.CLIENT_HELLO.pack(qkp.MAGIC, 0))
        got = b""
        while len(got) < qkp.HELLO.size:
            got += s.recv(qkp.HELLO.size - len(got))
        h = qkp.Hello.unpack(got)
        s.sendall(qkp.Header(qkp.EVAL, 0, h.max_rows, 0, 0).pack()
                  + struct.pack(f"<{h.max_rows}I", *([1] * h.max_rows)))
    elif mode == "auth":
        s.sendall(qkp.CLIENT_HELLO.pack(qkp.MAGIC, qkp.FLAG_AUTH) + auth.new_nonce())
    return s


def strangers(model: Path, n: int, mode: str, *, settle: float = SETTLE_S) -> dict:
    """Open n stalled connections of one mode against a fresh worker; RSS before/with/after."""
    with tempfile.TemporaryDirectory() as tmp:
        token_file = None
        if mode == "auth":
            token_file = Path(tmp) / "token"
            token_file.write_text("bench-secret")
            token_file.chmod(0o600)
        p, port = start_worker(model, token_file=token_file, max_conns=n + 16)
        socks: list[socket.socket] = []
        try:
            time.sleep(settle)
            before = rss_bytes(p.pid)
            for _ in range(n):
                socks.append(_stranger(port, mode, None))
            time.sleep(settle)
            with_them = rss_bytes(p.pid)
            for s in socks:
                s.close()
            socks.clear()
            time.sleep(settle)
            after = rss_bytes(p.pid)
        finally:
            for s in socks:
                s.close()
            p.kill()
            p.wait(10)
    return {"mode": mode, "connections": n, "rss_before": before, "rss_with": with_them,
            "rss_after": after, "bytes_per_connection": (with_them - before) / n}


def slow_receiver(where: str, *, io_timeout: float = 2.0, drip_s: float = 0.5,
                  limit_s: float = 30.0, min_rate: float = ds4k.DEFAULT_MIN_RATE) -> dict:
    """A DS4K sender that drips one byte every drip_s; seconds until the receiver drops it."""
    payload_bytes = 4096
    with tempfile.TemporaryDirectory() as tmp:
        r = ds4k.Receiver(0, timeout=io_timeout, min_rate=min_rate)
        result: dict = {}

        def land():
            try:
                r.receive(Path(tmp) / "p.dsv4", accept_timeout=limit_s, max_failures=1)
            except ds4k.DS4KError as e:
                result["reason"] = e.reason
            result["t_end"] = time.monotonic()

        t = threading.Thread(target=land, daemon=True)
        t.start()
        s = socket.create_connection(("127.0.0.1", r.port), timeout=limit_s)
        s.sendall(ds4k.OPENER.pack(ds4k.MAGIC))
        s.recv(ds4k.HELLO.size)
        if where == "header":  # a record header and a (padded) manifest
            m = b" " * 200 + b"{}"
            data = ds4k.RECORD.pack(ds4k.MAGIC, ds4k.VERSION, 0, len(m)) + m
        else:  # a valid record and manifest, then the payload byte by byte
            m = ds4k.Manifest(None, payload_bytes, "0" * 64, 1, 64, 2, 0).encode()
            s.sendall(ds4k.RECORD.pack(ds4k.MAGIC, ds4k.VERSION, 0, len(m)))
            s.recv(ds4k.REPLY.size)
            s.sendall(m)
            s.recv(ds4k.REPLY.size)
            data = bytes(payload_bytes)
        t0 = time.monotonic()
        try:
            for i in range(len(data)):
                if not t.is_alive() or time.monotonic() - t0 > limit_s:
                    break
                s.sendall(data[i: i + 1])
                time.sleep(drip_s)
        except OSError:
            pass
        t.join(limit_s)
        s.close()
        r.close()
    end = result.get("t_end")
    return {"where": where, "io_timeout_s": io_timeout, "drip_interval_s": drip_s,
            "seconds_to_refusal": None if end is None else round(end - t0, 3),
            "reason": result.get("reason")}


def machine() -> dict:
    cpu = "?"
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conns", type=int, default=1000)
    ap.add_argument("--model", type=Path, default=None, help="default: a fresh test-preset model")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "strangers.json")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from ds4.core.tiny import make_tiny

            model = make_tiny(Path(tmp) / "test.gguf", preset="test", seed=1)
        rows = [strangers(model, args.conns, mode) for mode in ("silent", "eval", "auth")]
    slow = [slow_receiver("header"), slow_receiver("payload", min_rate=1024.0)]
    for r in rows:
        print(f"{r['mode']:>6}: {r['connections']} stalled connections: worker RSS "
              f"{r['rss_before'] / 2**20:.1f} -> {r['rss_with'] / 2**20:.1f} MiB "
              f"({r['bytes_per_connection'] / 1024:.1f} KiB each), "
              f"{r['rss_after'] / 2**20:.1f} MiB after they closed")
    for r in slow:
        print(f"slow {r['where']}: dropped after {r['seconds_to_refusal']} s ({r['reason']})")
    doc = {"machine": machine(), "max_rows": MAX_ROWS, "strangers": rows, "slow_peers": slow}
    with atomic_file(args.out, "w", private=False) as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    with atomic_file(args.out.with_suffix(".csv"), "w", private=False) as f:
        w = csv.writer(f)
        w.writerow(["test", "case", "connections", "rss_before", "rss_with", "rss_after",
                    "bytes_per_connection", "seconds_to_refusal", "machine"])
        for r in rows:
            w.writerow(["strangers", r["mode"], r["connections"], r["rss_before"], r["rss_with"],
                        r["rss_after"], round(r["bytes_per_connection"]), "", doc["machine"]["cpu"]])
        for r in slow:
            w.writerow(["slow_peer", r["where"], 1, "", "", "", "", r["seconds_to_refusal"],
                        doc["machine"]["cpu"]])


if __name__ == "__main__":
    main()
