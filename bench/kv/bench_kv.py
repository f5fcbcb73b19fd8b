"""KV handoff benchmark: DSV4 payload size per token, save/load time, DS4K loopback throughput.

    PYTHONPATH=. python bench/kv/bench_kv.py            # writes bench/kv/results.csv
    PYTHONPATH=. python bench/kv/bench_kv.py --big      # adds a 1.3 GB (T = 100k) transfer

Three sections, one CSV:
* size      — measured: prefill T tokens on the reference backend (test and tiny presets), save
              the payload, record its bytes (checked against `payload_bytes`) and the save and
              load times.
* formula   — the real DS4 Flash shapes (43 layers, head_dim 512, vocab 129280): the exact size
              from `payload_bytes` at T = 1, 128, 10k, 100k, beside spec §4.1's figures.
* transfer  — DS4K over 127.0.0.1: `send_payload` from a file to a `Receiver` thread landing it
              in another file (sender SHA-256 pass, receiver SHA-256, header/size check, fsync,
              rename); best of N. Flash-shaped payloads are synthetic (valid header and counts,
              random tensor bytes); a test-preset payload is a real one.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import ds4
from ds4.core import payload as pl
from ds4.core.tiny import make_tiny, preset_config
from ds4.wire import ds4k

HERE = Path(__file__).resolve().parent
FIELDS = ["section", "model", "n_tokens", "ctx", "payload_bytes", "bytes_per_token",
          "spec_figure", "save_s", "load_s", "transfer_s", "hash_s", "mb_per_s"]
SPEC_FIGURES = {1: "12.2 MiB", 128: "24.6 MiB", 10_000: "154 MiB", 100_000: "1.34 GiB"}


def measured_sizes(tmp: Path, rows: list[dict]) -> None:
    plan = {"test": (4096, [1, 8, 64, 256, 1024, 4000]), "tiny": (8192, [1, 32, 128, 1024])}
    for preset, (ctx, counts) in plan.items():
        path = make_tiny(tmp / f"{preset}.gguf", preset=preset, seed=0)
        eng = ds4.Engine.open(path)
        vocab = eng.config.n_vocab
        tokens = [int(x) for x in np.random.default_rng(0).integers(0, vocab, max(counts))]
        s = eng.session(ctx=ctx)
        for T in counts:
            s.sync(tokens[:T])  # extends the held prefix
            f = io.BytesIO()
            t0 = time.perf_counter()
            n = s.save_payload(f)
            t_save = time.perf_counter() - t0
            assert n == pl.session_payload_bytes(eng.config, s.layout, T)
            d = eng.session(ctx=ctx)
            t0 = time.perf_counter()
            d.load_payload(f.getvalue())
            t_load = time.perf_counter() - t0
            rows.append(dict(section="size", model=preset, n_tokens=T, ctx=ctx, payload_bytes=n,
                             bytes_per_token=round(n / T, 1), save_s=round(t_save, 4),
                             load_s=round(t_load, 4)))
            print(f"size     {preset:5} T={T:6} {n:>12,} B  {n / T:>12,.1f} B/token  "
                  f"save {t_save * 1e3:7.1f} ms  load {t_load * 1e3:7.1f} ms", flush=True)


def formula_sizes(rows: list[dict]) -> None:
    cfg = preset_config("flash")
    for T, fig in SPEC_FIGURES.items():
        n = pl.payload_bytes(cfg, T)
        rows.append(dict(section="formula", model="flash", n_tokens=T, ctx="", payload_bytes=n,
                         bytes_per_token=round(n / T, 1), spec_figure=fig))
        print(f"formula  flash T={T:6} {n:>14,} B = {n / 2**20:9.1f} MiB = {n / 2**30:6.3f} GiB "
              f"(spec: {fig})", flush=True)


def synthetic_flash_payload(path: Path, T: int) -> int:
    """A structurally valid flash-shaped payload (header, counts) with random tensor bytes."""
    cfg = preset_config("flash")
    ctx = 1 << 20
    layout = pl.SessionLayout.create(cfg, ctx)
    h = pl.Header.for_session(cfg, layout, T)
    n_comp, n_index = pl.row_counts(cfg, T)
    size = pl.payload_bytes(cfg, T)
    block = np.random.default_rng(T).integers(0, 256, 1 << 22, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(h.pack())
        f.write(bytes(4 * T))  # token 0 everywhere
        f.write(bytes(4 * cfg.n_vocab))
        f.write(np.asarray(n_comp, "<u4").tobytes() + np.asarray(n_index, "<u4").tobytes())
        left = size - f.tell()
        while left:
            k = min(left, len(block))
            f.write(block[:k])
            left -= k
    return size


def transfer(path: Path, dest: Path, fingerprint: bytes, config, repeats: int) -> tuple[float, float]:
    best = float("inf")
    for _ in range(repeats):
        with ds4k.Receiver(0, fingerprint=fingerprint, config=config, timeout=60) as r:
            box: dict = {}
            th = threading.Thread(target=lambda: box.setdefault("m", r.receive(dest, accept_timeout=60)))
            th.start()
            t0 = time.perf_counter()
            ds4k.send_payload(path, "127.0.0.1", r.port, fingerprint=fingerprint, timeout=60)
            th.join()
            best = min(best, time.perf_counter() - t0)
        assert dest.stat().st_size == path.stat().st_size
        os.unlink(dest)
    t0 = time.perf_counter()
    ds4k.make_manifest(path, fingerprint)  # the sender's own hashing pass, for reference
    return best, time.perf_counter() - t0


def transfers(tmp: Path, rows: list[dict], big: bool, repeats: int) -> None:
    fp = bytes(32)
    # a real test-preset payload
    eng = ds4.Engine.open(tmp / "test.gguf")
    s = eng.session(ctx=4096)
    s.sync([int(x) for x in np.random.default_rng(1).integers(0, 512, 1024)])
    real = tmp / "test-1024.dsv4"
    s.save_payload(real)
    cases = [("test", 1024, real, eng.config, eng.model.fingerprint)]
    for T in [1, 128, 10_000] + ([100_000] if big else []):
        p = tmp / f"flash-{T}.dsv4"
        synthetic_flash_payload(p, T)
        cases.append(("flash", T, p, preset_config("flash"), fp))
    for model, T, path, cfg, fingerprint in cases:
        n = path.stat().st_size
        secs, hash_s = transfer(path, tmp / "landed.dsv4", fingerprint, cfg, repeats)
        rows.append(dict(section="transfer", model=model, n_tokens=T, payload_bytes=n,
                         bytes_per_token=round(n / T, 1), transfer_s=round(secs, 4),
                         hash_s=round(hash_s, 4), mb_per_s=round(n / secs / 1e6, 1)))
        print(f"transfer {model:5} T={T:6} {n:>14,} B  {secs:7.3f} s  {n / secs / 1e6:8.1f} MB/s "
              f"(sender SHA-256 pass alone: {n / hash_s / 1e6:.0f} MB/s)", flush=True)
        if model == "flash":
            os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results.csv")
    ap.add_argument("--big", action="store_true", help="also transfer a T = 100k flash payload (1.4 GB)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"# {platform.node()}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ds4-bench-kv-") as tmp:
        measured_sizes(Path(tmp), rows)
        formula_sizes(rows)
        transfers(Path(tmp), rows, args.big, args.repeats)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
