"""Pipeline split benchmark: what a split costs per token on loopback, and one frame's round trip.

    PYTHONPATH=. python bench/pipeline/bench_split.py            # writes bench/pipeline/results.json
    PYTHONPATH=. python bench/pipeline/bench_split.py --quick    # a smoke run (seconds)

Two measurements, both over 127.0.0.1 with the worker in its own process:

* decode  — a tiny synthetic model (default the `test` preset: 5 layers, 512-token vocabulary,
            so a step is ~10 ms and the wire's share is visible; `--preset tiny` for the embedded
            default, whose 129k-row output head dominates a reference step) on one backend,
            unsplit vs. head `0:A` + `ds4 pipe-worker A:n_layer`, greedy. Per-token decode time is the
            median over every step of several alternating rounds; the split's extra cost is the
            difference (head and worker compute the same layers one after the other, so what is
            left is the wire: serialising the row, two socket hops, the worker's frame checks and
            thread hand-offs). Prefill time for the prompt is reported alongside.
* frame   — the round trip of one EVAL frame carrying one real-model row (n_hc × n_embd =
            4 × 4096 float32 = 64 KiB, plus the 20-byte header and the token id) to a worker
            whose stage answers at once (no compute): the pure qkp + TCP cost of a decode step.
            Also with a tiny-model row (4 KiB), with 256 top-k candidates in the reply, and with
            5 ms of idle between frames (as in a decode, where each side waits while the other
            computes: the cost of waking an idle process shows up here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ds4  # noqa: E402
from ds4.core.atomic import atomic_file  # noqa: E402
from ds4.pipeline import SplitEngine, Worker  # noqa: E402
from ds4.wire import qkp  # noqa: E402

HERE = Path(__file__).resolve().parent


# ---- a stage that answers without computing (for the frame round trip) -----------------------------


class NullStage:
    """Duck-types `ds4.pipeline.Stage`: a last stage that replies greedy id 0 immediately."""

    def __init__(self, n_embd: int, n_hc: int, n_vocab: int = 129280, max_rows: int = 64):
        self.hello = qkp.Hello(1, 2, 2, n_embd, n_hc, 1, 4096, n_vocab, max_rows, 0)
        self.last, self.exact = True, False
        self._pairs = [(i, -float(i)) for i in range(qkp.TOPK_MAX)]

    def eval(self, frame, owner=None):
        h = frame.header
        return qkp.pack_eval_reply(np.zeros(h.n, "<u4"), self._pairs[:h.topk], h.topk)

    def save(self, h, owner=None):
        return qkp.STATUS_OK

    load = save

    def open(self, owner, slot):
        return qkp.STATUS_OK

    free = open

    def release(self, owner):
        pass


def serve_null(n_embd: int, n_hc: int) -> None:
    w = Worker(NullStage(n_embd, n_hc))
    print(f"listening on 127.0.0.1:{w.port}", flush=True)
    w.serve_forever()


def spawn(args: list[str]) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on \S+:(\d+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"{args} did not start: {line!r}")
    return proc, int(m.group(1))


def frame_rtt(port: int, n_embd: int, n_hc: int, iters: int, topk: int = 0,
              gap_ms: float = 0.0) -> dict:
    conn = qkp.Conn.connect("127.0.0.1", port, 10.0)
    hello = qkp.client_handshake(conn, None, exact=False)
    conn.send(qkp.Header(qkp.OPEN, 0, 0, 0, 0).pack())
    assert qkp.STATUS.unpack(bytes(conn.recv_exact(qkp.STATUS.size)))[0] == qkp.STATUS_OK
    row = np.random.default_rng(0).standard_normal((1, n_hc, n_embd)).astype("<f4")
    token = np.array([1], "<u4")
    reply = hello.eval_reply_bytes(1, topk)
    times = []
    for i in range(iters + max(10, iters // 10)):  # the first ones warm up
        if gap_ms:
            time.sleep(gap_ms / 1e3)  # both ends idle, as between the frames of a decode
        t0 = time.perf_counter()
        conn.send(qkp.Header(qkp.EVAL, 0, 1, 0, topk).pack(), token, row)
        conn.recv_exact(reply)
        if i >= max(10, iters // 10):
            times.append(time.perf_counter() - t0)
    conn.close()
    us = np.array(times) * 1e6
    return {"row_bytes": row.nbytes, "frame_bytes": qkp.HEADER.size + 4 + row.nbytes,
            "reply_bytes": reply, "topk": topk, "iters": iters, "gap_ms": gap_ms,
            "median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90))}


# ---- decode cost of a split ----------------------------------------------------------------------


def decode_steps(session, prompt: list[int], n: int, split: bool) -> tuple[float, list[float], list[int]]:
    t0 = time.perf_counter()
    session.sync(prompt)
    prefill = time.perf_counter() - t0
    steps, out = [], []
    for _ in range(n):
        t = session.greedy if split else int(np.argmax(session.logits))
        out.append(t)
        t0 = time.perf_counter()
        session.eval(t)
        steps.append(time.perf_counter() - t0)
    return prefill, steps, out


def decode_cost(model: Path, backend: str, a: int, prompt_len: int, tokens: int, rounds: int) -> dict:
    eng = ds4.Engine.open(model, backend=backend)
    n_layer = eng.config.n_layer
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, eng.config.n_vocab, prompt_len)]
    proc, port = spawn(["-m", "cli.pipe", "pipe-worker", "0", f"{a}:{n_layer}", "-m", str(model),
                        "--backend", backend, "--ctx", "4096"])
    try:
        split = SplitEngine.open(model, f"127.0.0.1:{port}", f"0:{a}", backend=backend)
        res = {"unsplit": {"prefill": [], "steps": []}, "split": {"prefill": [], "steps": []}}
        outs = {}
        decode_steps(eng.session(ctx=4096), prompt, 4, False)  # warm the weight caches
        with split.session(ctx=4096) as warm:
            decode_steps(warm, prompt, 4, True)
        for _ in range(rounds):
            for name, e, is_split in (("unsplit", eng, False), ("split", split, True)):
                s = e.session(ctx=4096)
                prefill, steps, out = decode_steps(s, prompt, tokens, is_split)
                res[name]["prefill"].append(prefill)
                res[name]["steps"].extend(steps)
                outs[name] = out
                if is_split:
                    s.close()
        split.close()
    finally:
        proc.kill()
        proc.wait()
    un, sp = (np.array(res[k]["steps"]) * 1e3 for k in ("unsplit", "split"))
    return {
        "model": model.name, "backend": backend, "n_layer": n_layer, "head_layers": f"0:{a}",
        "worker_layers": f"{a}:{n_layer}", "prompt_tokens": prompt_len, "decode_tokens": tokens,
        "rounds": rounds, "token_identical": outs["unsplit"] == outs["split"],
        "unsplit_ms_per_token": float(np.median(un)), "split_ms_per_token": float(np.median(sp)),
        "added_ms_per_token": float(np.median(sp) - np.median(un)),
        "unsplit_p10_ms": float(np.percentile(un, 10)), "split_p10_ms": float(np.percentile(sp, 10)),
        "added_p10_ms": float(np.percentile(sp, 10) - np.percentile(un, 10)),
        "unsplit_prefill_ms": statistics.median(res["unsplit"]["prefill"]) * 1e3,
        "split_prefill_ms": statistics.median(res["split"]["prefill"]) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few iterations only (smoke test)")
    ap.add_argument("--model", type=Path, help="GGUF to use (default: a fresh --preset model)")
    ap.add_argument("--preset", default="test", help="synthetic preset when no --model")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--split", type=int, default=3, help="the head runs layers 0:SPLIT")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--serve-null", nargs=2, type=int, metavar=("N_EMBD", "N_HC"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_null:
        serve_null(*args.serve_null)
        return
    iters, rounds, tokens = (50, 1, 8) if args.quick else (2000, 8, 24)

    frames = []
    for n_embd, n_hc, topk, gap in ((4096, 4, 0, 0), (4096, 4, 256, 0), (256, 4, 0, 0), (4096, 4, 0, 5)):
        proc, port = spawn([__file__, "--serve-null", str(n_embd), str(n_hc)])
        try:
            n = iters if not gap else max(20, iters // 8)
            frames.append({"n_embd": n_embd, "n_hc": n_hc,
                           **frame_rtt(port, n_embd, n_hc, n, topk, gap)})
        finally:
            proc.kill()
            proc.wait()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from ds4.core.tiny import make_tiny

            model = make_tiny(Path(tmp) / f"{args.preset}.gguf", preset=args.preset, seed=0)
        decode = decode_cost(model, args.backend, args.split, 32, tokens, rounds)

    result = {"host": platform.node(), "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version(),
              "machine": platform.machine(), "quick": args.quick, "frame": frames, "decode": decode}
    if not args.quick:
        with atomic_file(args.out, "w", private=False) as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print("frame round trip over loopback (the worker answers without computing):")
    for f in frames:
        gap = f", after {f['gap_ms']:g} ms idle" if f["gap_ms"] else ", back to back"
        print(f"  row {f['row_bytes'] // 1024:>3} KiB, topk {f['topk']:>3}{gap:<20}: median "
              f"{f['median_us']:7.1f} us  (p10 {f['p10_us']:.1f}, p90 {f['p90_us']:.1f}; "
              f"{f['iters']} frames)")
    d = decode
    print(f"decode, {d['model']} on {d['backend']}, head {d['head_layers']} + worker "
          f"{d['worker_layers']}: unsplit {d['unsplit_ms_per_token']:.2f} ms/token, split "
          f"{d['split_ms_per_token']:.2f} ms/token, added {d['added_ms_per_token']:+.2f} ms/token "
          f"(token-identical: {d['token_identical']}); 10th percentiles: unsplit "
          f"{d['unsplit_p10_ms']:.2f}, split {d['split_p10_ms']:.2f}, added {d['added_p10_ms']:+.2f}")
    print(f"prefill of {d['prompt_tokens']} tokens: unsplit {d['unsplit_prefill_ms']:.1f} ms, "
          f"split {d['split_prefill_ms']:.1f} ms")


if __name__ == "__main__":
    main()
