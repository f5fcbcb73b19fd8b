"""What the HTTP head costs: `ds4 serve` against `ds4 generate` on the same backend and prompt.

    PYTHONPATH=. python bench/serve/bench_serve.py                       # embedded default model
    PYTHONPATH=. python bench/serve/bench_serve.py -m flash.gguf --backend triton --tokens 256

Both run in their own process, greedy (temperature 0), think mode on (the CLI's default), with
the CLI's default system text, one after the other on the same machine:

* generate — `ds4 generate -t 0 -n N`: its stats line gives the prefill and decode tokens/s the
             CLI measures; time to first token = prefill time + one decode step. A fresh
             process pays first-call costs (allocation; on a GPU, graph capture), so the same
             path (Session.sync + Session.sample, as the CLI runs it) is also timed warm in a
             process of its own: that is the row the head is compared with.
* serve    — `ds4 serve` with one warm-up request, then `--runs` streamed requests through the
             OpenAI API (httpx, server-sent events): time to first token is from sending the
             request to the first text chunk; decode tokens/s counts the chunks after the first
             over the time from the first chunk to the last (what a client sees, the head's
             JSON, SSE and event-loop work included). Each run's user text starts with the run's
             number, so no run reuses the previous one's prefill.

The head's cost is 1 - serve decode / warm generate-path decode. Both also report the CPU time
their process spent per decoded token (all threads; Linux /proc): on a machine shared with other
work, wall-clock rates move with the load, CPU time much less, and the head's own work shows up
there as the difference. Results go to
bench/serve/results-<device>.csv and .json (the device named in both).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from serve_helpers import Proc  # noqa: E402

from ds4.core.atomic import atomic_file  # noqa: E402
from ds4.core.chat import DEFAULT_SYSTEM  # noqa: E402

STATS = re.compile(r"prompt: (\d+) tokens, ([\d.]+) tokens/s · generated: (\d+) tokens, ([\d.]+) tokens/s")
PROMPT = ("Explain, step by step, how a compressed sparse attention layer decides which earlier "
          "tokens a new token may attend to, and why that keeps long contexts cheap.")


def device_name(backend: str) -> str:
    if backend in ("triton", "auto"):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except ImportError:
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"CPU {platform.machine()} x{os.cpu_count()}"


def run_generate(args, env) -> dict:
    argv = [sys.executable, "-m", "cli.main", "generate", "-p", f"0 {PROMPT}", "-n", str(args.tokens),
            "-t", "0", "--backend", args.backend, "--ctx", str(args.ctx)]
    if args.model:
        argv += ["-m", args.model]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    m = STATS.search(r.stderr)
    if r.returncode != 0 or not m:
        raise SystemExit(f"ds4 generate failed: {r.stderr}")
    n_prompt, prefill, n_gen, decode = int(m[1]), float(m[2]), int(m[3]), float(m[4])
    return {"prompt_tokens": n_prompt, "generated": n_gen, "prefill_tps": prefill, "decode_tps": decode,
            "ttft_s": n_prompt / prefill + 1 / decode}


def run_library(args, eng=None) -> list[dict]:
    """`ds4 generate`'s own path (Session.sync, then Session.sample greedy, as the CLI's
    stream_reply runs it) in this process, after one warm-up run, so that neither side pays for
    first-call work (allocation, graph capture) in its timed runs. The same timing as the
    server's: first token = prefill + one step; decode = tokens after the first over the time
    from the first token to the end."""
    import ds4
    from ds4.core.chat import encode_prompt
    from ds4.core.sampling import GREEDY

    if eng is None:
        eng = ds4.Engine.open(args.model, backend=args.backend)
    tok = eng.tokenizer
    s = eng.session(ctx=args.ctx)
    rows = []
    for i in [999] + list(range(args.runs)):
        ids = encode_prompt(tok, f"{i} {PROMPT}", system=DEFAULT_SYSTEM, think=True)
        t0 = time.perf_counter()
        s.sync(ids)
        t_first = cpu_first = None
        n = 0
        for _ in s.sample(args.tokens if i != 999 else 4, GREEDY, None, stop={tok.eos_id}):
            n += 1
            if t_first is None:
                t_first, cpu_first = time.perf_counter(), time.process_time()
        t_end, cpu_end = time.perf_counter(), time.process_time()
        if i != 999:
            rows.append({"prompt_tokens": len(ids), "generated": n, "ttft_s": t_first - t0,
                         "decode_tps": (n - 1) / (t_end - t_first) if n > 1 else float("nan"),
                         "decode_cpu_ms": 1e3 * (cpu_end - cpu_first) / (n - 1) if n > 1 else float("nan")})
    return rows


def run_synthetic(args) -> dict:
    """Full-size shapes without the file: a GGUF whose data is a hole (the real header and
    vocabulary) opened with the Triton backend's weights generated on the GPU (as
    bench/triton/bench_full.py does). One process, one engine: the generate path warm, then the
    same engine behind the HTTP head (uvicorn in a thread on a loopback port), then the generate
    path again, so that drift in either direction shows."""
    import socket
    import threading

    import uvicorn

    import ds4
    from ds4.core.gguf_write import write_sparse_gguf
    from ds4.core.tiny import preset_config, preset_vocabulary
    from ds4.serve.app import create_app
    from ds4.serve.driver import Driver

    path = "/tmp/ds4-serve-synthetic.gguf"
    write_sparse_gguf(path, preset_config(args.synthetic), {}, *preset_vocabulary(args.synthetic))
    eng = ds4.Engine.open(path, backend="triton", synthetic=True)
    before = run_library(args, eng)
    driver = Driver(eng, ctx=args.ctx, queue_size=1)
    app = create_app(driver, model_id="ds4", max_tokens_limit=args.ctx)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started:
        time.sleep(0.05)
    try:
        stream_once(url, 999, min(args.tokens, 4))
        serves = [stream_once(url, i, args.tokens) for i in range(args.runs)]
    finally:
        server.should_exit = True
        thread.join()
        driver.close()
    driver.session = None
    after = run_library(args, eng)
    return {"generate": before + after, "serve": serves, "prompt_tokens": serves[0]["prompt_tokens"]}


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process, all its threads (Linux; 0 elsewhere)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_once(url: str, i: int, tokens: int, pid: int | None = None) -> dict:
    body = {"model": "ds4", "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": DEFAULT_SYSTEM},
                         {"role": "user", "content": f"{i} {PROMPT}"}]}
    stamps, usage = [], None
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", ()):
                d = ch.get("delta", {})
                if d.get("content") or d.get("reasoning_content"):
                    if not stamps:
                        cpu_first = process_cpu_s(pid)
                    stamps.append(time.perf_counter())
                if ch.get("finish_reason"):
                    t_end, cpu_end = time.perf_counter(), process_cpu_s(pid)
    # (a token whose text is an unfinished UTF-8 sequence sends no chunk of its own: the count
    # of tokens comes from usage, the span from the first text to the end of the reply)
    n = usage["completion_tokens"]
    return {"prompt_tokens": usage["prompt_tokens"], "generated": n,
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "ttft_s": stamps[0] - t0,
            "decode_tps": (n - 1) / (t_end - stamps[0]) if n > 1 else float("nan"),
            "decode_cpu_ms": 1e3 * (cpu_end - cpu_first) / (n - 1) if n > 1 and pid else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the embedded default model)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per run")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", default=str(ROOT / "bench" / "serve"), help="folder for the results")
    ap.add_argument("--library-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--synthetic", default=None, metavar="PRESET",
                    help="full-size shapes on the Triton backend with weights generated on the GPU "
                         "(e.g. flash), instead of -m")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    from ds4.backends import resolve_backend

    args.backend = resolve_backend(args.backend)  # both commands run the same concrete backend
    device = device_name(args.backend)

    if args.library_only:  # (the child process of the library measurement)
        print(json.dumps(run_library(args)))
        return
    if args.synthetic:
        args.backend = "triton"
        syn = run_synthetic(args)
        g_dec, s_dec = (statistics.median(r["decode_tps"] for r in syn[k]) for k in ("generate", "serve"))
        g_ttft, s_ttft = (statistics.median(r["ttft_s"] for r in syn[k]) for k in ("generate", "serve"))
        summary = {"device": device, "backend": "triton", "model": f"synthetic {args.synthetic} (weights on the GPU)",
                   "tokens": args.tokens, "runs": args.runs, "prompt_tokens": syn["prompt_tokens"],
                   "generate": {"ttft_s": g_ttft, "decode_tps": g_dec},
                   "serve": {"ttft_s": s_ttft, "decode_tps": s_dec},
                   "head_cost_decode": 1 - s_dec / g_dec, "raw": syn}
        slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{device}-{args.synthetic}").strip("-").lower()
        out = Path(args.out)
        with atomic_file(out / f"results-{slug}.json", "w", private=False) as f:
            f.write(json.dumps(summary, indent=2) + "\n")
        with atomic_file(out / f"results-{slug}.csv", "w", private=False) as f:
            w = csv.writer(f)
            w.writerow(["device", "backend", "model", "path", "prompt_tokens", "tokens", "runs",
                        "ttft_s", "decode_tokens_per_s"])
            for name, key in (("ds4 generate path (Session.sample, warm)", "generate"),
                              ("ds4 serve (HTTP, SSE, warm)", "serve")):
                w.writerow([device, "triton", summary["model"], name, syn["prompt_tokens"], args.tokens,
                            args.runs, f"{summary[key]['ttft_s']:.4f}", f"{summary[key]['decode_tps']:.3f}"])
        print(f"device {device}, {summary['model']}: generate path {g_dec:.2f} tokens/s (TTFT "
              f"{g_ttft * 1e3:.1f} ms), serve {s_dec:.2f} tokens/s (TTFT {s_ttft * 1e3:.1f} ms); "
              f"head's cost of decode tokens/s: {summary['head_cost_decode'] * 100:+.2f}%")
        return
    gens = [run_generate(args, env) for _ in range(args.runs)]
    argv = [sys.executable, __file__, "--library-only", "--backend", args.backend, "--tokens",
            str(args.tokens), "--runs", str(args.runs), "--ctx", str(args.ctx)]
    if args.model:
        argv += ["-m", args.model]
    # its own process, so that its memory is gone before the server loads the model
    lib = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if lib.returncode != 0:
        raise SystemExit(f"the library run failed: {lib.stderr}")
    libs = json.loads(lib.stdout.strip().splitlines()[-1])

    argv = ["serve", "--port", "0", "--backend", args.backend, "--ctx", str(args.ctx)]
    if args.model:
        argv += ["-m", args.model]
    log = Path(args.out) / "serve.log"
    server = Proc(argv, log).wait_listening(timeout=3600).wait_healthy()
    try:
        stream_once(server.url, 999, min(args.tokens, 4))  # warm-up (compiles, captures, allocates)
        serves = [stream_once(server.url, i, args.tokens, server.proc.pid) for i in range(args.runs)]
    finally:
        server.kill()
        log.unlink(missing_ok=True)

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    g_dec, s_dec = med(libs, "decode_tps"), med(serves, "decode_tps")
    summary = {"device": device, "backend": args.backend, "model": args.model or "embedded default",
               "tokens": args.tokens, "runs": args.runs, "prompt_tokens": gens[0]["prompt_tokens"],
               "generate_cli": {"ttft_s": med(gens, "ttft_s"), "decode_tps": med(gens, "decode_tps"),
                                "prefill_tps": med(gens, "prefill_tps")},
               "generate": {"ttft_s": med(libs, "ttft_s"), "decode_tps": g_dec,
                            "decode_cpu_ms": med(libs, "decode_cpu_ms")},
               "serve": {"ttft_s": med(serves, "ttft_s"), "decode_tps": s_dec,
                         "decode_cpu_ms": med(serves, "decode_cpu_ms"),
                         "cached_tokens": max(r["cached_tokens"] for r in serves)},
               "head_cost_decode": 1 - s_dec / g_dec, "raw": {"generate_cli": gens, "generate": libs, "serve": serves}}
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    out = Path(args.out)
    with atomic_file(out / f"results-{slug}.json", "w", private=False) as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    with atomic_file(out / f"results-{slug}.csv", "w", private=False) as f:
        w = csv.writer(f)
        w.writerow(["device", "backend", "model", "path", "prompt_tokens", "tokens", "runs",
                    "ttft_s", "decode_tokens_per_s", "decode_cpu_ms_per_token"])
        for name, rows in (("ds4 generate (CLI, cold process)", gens),
                           ("ds4 generate path (Session.sample, warm)", libs),
                           ("ds4 serve (HTTP, SSE, warm)", serves)):
            w.writerow([device, args.backend, summary["model"], name, rows[0]["prompt_tokens"], args.tokens,
                        args.runs, f"{med(rows, 'ttft_s'):.4f}", f"{med(rows, 'decode_tps'):.3f}",
                        f"{med(rows, 'decode_cpu_ms'):.2f}" if "decode_cpu_ms" in rows[0] else ""])
    print(f"device {device}, backend {args.backend}, {summary['prompt_tokens']} prompt tokens, "
          f"{args.tokens} generated, median of {args.runs}")
    for label, key in (("ds4 generate (CLI)   ", "generate_cli"), ("generate path (warm)", "generate"),
                       ("ds4 serve (warm)    ", "serve")):
        row = summary[key]
        cpu = f", {row['decode_cpu_ms']:7.1f} CPU ms/token" if "decode_cpu_ms" in row else ""
        print(f"  {label}: TTFT {row['ttft_s'] * 1e3:8.1f} ms, decode {row['decode_tps']:8.2f} tokens/s{cpu}")
    print(f"  head's cost of decode tokens/s: {summary['head_cost_decode'] * 100:+.2f}%")


if __name__ == "__main__":
    main()
