"""Many heads on one pipe worker at once: every head token-identical to unsplit, tokens/s each.

    PYTHONPATH=. python bench/reliability/concurrent_heads.py             # 16 heads, writes results/
    PYTHONPATH=. python bench/reliability/concurrent_heads.py --quick     # 3 heads, writes nothing

One `ds4 pipe-worker A:n_layer --slots N` process and N head processes (each a `SplitEngine`
on its own connection, as N concurrent `ds4 generate --split-next` would be), all on 127.0.0.1.
Each head has its own prompt and seed and samples with ds4's default sampler (T 1, min-p 0.05:
the path that needs the last stage's whole logits row); the heads are released together once
every one is connected and holds its slot, then each prefills its prompt and decodes
`--tokens` tokens with `SplitSession.sample`. The parent computes every head's unsplit run with
`Session.sample` (same prompt, same seed) and checks the tokens are identical. One more head
then asks for a slot while all N are held: it must be refused (PipelineRefused), not queued.

Written: results/concurrent_heads-<machine>.json (everything) and .csv (one row per head), the
machine named by host, CPU model, core count and load average, since the heads, the worker and
anything else on the machine share its cores.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import platform
import re
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
from ds4.core.sampling import Rng, SamplingParams  # noqa: E402

HERE = Path(__file__).resolve().parent
PARAMS = SamplingParams()  # ds4's defaults: T 1, min-p 0.05
CTX = 512


def prompt_of(i: int, n_vocab: int, length: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(1000 + i).integers(0, n_vocab, length)]


def seed_of(i: int) -> int:
    return 7 + i


# ---- one head (a child process) -------------------------------------------------------------------


def run_head(model: Path, addr: str, a: int, i: int, prompt_len: int, tokens: int) -> None:
    """Connect, take a slot, say `ready`, wait for `go` on stdin, then prefill and decode."""
    from ds4.pipeline import SplitEngine

    eng = SplitEngine.open(model, addr, f"0:{a}", sampling=PARAMS)
    s = eng.session(ctx=CTX)
    prompt = prompt_of(i, eng.config.n_vocab, prompt_len)
    s.sync(prompt[:1])  # holds its slot from here on
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    s.sync(prompt)
    t1 = time.perf_counter()
    out = list(s.sample(tokens, PARAMS, Rng(seed_of(i))))
    t2 = time.perf_counter()
    s.close()
    eng.close()
    print(json.dumps({"head": i, "tokens": out, "prefill_s": t1 - t0, "decode_s": t2 - t1,
                      "start": t0, "end": t2}), flush=True)


# ---- the parent --------------------------------------------------------------------------------------


def spawn(argv: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DS4_WIRE_TOKEN", None)
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True, **kw)


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "loadavg_before": os.getloadavg(), "gpu": None}


def bench(model: Path, heads: int, a: int, prompt_len: int, tokens: int) -> dict:
    from ds4.pipeline import PipelineRefused, SplitEngine

    from ds4.core.gguf_model import GGUFModel

    n_layer = GGUFModel(model).config.n_layer
    worker = spawn(["-m", "cli.pipe", "pipe-worker", "0", f"{a}:{n_layer}", "-m", str(model),
                    "--slots", str(heads), "--ctx", str(CTX)], stdout=subprocess.PIPE)
    m = re.search(r"listening on \S+:(\d+)", worker.stdout.readline())
    if not m:
        worker.kill()
        raise RuntimeError("the pipe worker did not start")
    addr = f"127.0.0.1:{m.group(1)}"
    procs = []
    try:
        for i in range(heads):
            procs.append(spawn([__file__, "--head", str(i), "--addr", addr, "--model", str(model),
                                "--split", str(a), "--prompt-len", str(prompt_len),
                                "--tokens", str(tokens)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a head did not get ready")
        # every slot is held now: one more head must be refused, promptly
        extra = SplitEngine.open(model, addr, f"0:{a}", sampling=PARAMS)
        t0 = time.perf_counter()
        try:
            extra.session(ctx=CTX).sync([1, 2, 3])
            refusal = None
        except PipelineRefused as e:
            refusal = str(e)
        refusal_s = time.perf_counter() - t0
        extra.close()
        wall0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a head failed (exit {p.wait()})")
            results.append(json.loads(line))
        wall = time.perf_counter() - wall0
    finally:
        for p in procs:
            p.kill()
            p.wait()
        worker.kill()
        worker.wait()

    unsplit = ds4.Engine.open(model)
    rows = []
    for r in sorted(results, key=lambda r: r["head"]):
        i = r["head"]
        s = unsplit.session(ctx=CTX)
        s.sync(prompt_of(i, unsplit.config.n_vocab, prompt_len))
        want = list(s.sample(tokens, PARAMS, Rng(seed_of(i))))
        rows.append({"head": i, "seed": seed_of(i), "prompt_tokens": prompt_len,
                     "decode_tokens": len(r["tokens"]), "token_identical": r["tokens"] == want,
                     "prefill_ms": round(r["prefill_s"] * 1e3, 2),
                     "decode_tokens_per_s": round(len(r["tokens"]) / r["decode_s"], 2)})
    overlap = min(r["end"] for r in results) - max(r["start"] for r in results)
    return {"heads": heads, "worker_slots": heads, "head_layers": f"0:{a}",
            "worker_layers": f"{a}:{n_layer}", "sampling": dataclasses.asdict(PARAMS),
            "all_token_identical": all(r["token_identical"] for r in rows),
            # all heads' decode tokens over the wall time from `go` to the last head's result
            "aggregate_tokens_per_s": round(sum(r["decode_tokens"] for r in rows) / wall, 2),
            "wall_s": round(wall, 3), "all_heads_running_together_s": round(overlap, 3),
            "extra_head_refused": refusal is not None, "extra_head_refusal": refusal,
            "extra_head_refusal_s": round(refusal_s, 3), "per_head": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="3 heads, few tokens, writes nothing")
    ap.add_argument("--model", type=Path, help="GGUF to use (default: a fresh --preset model)")
    ap.add_argument("--preset", default="test", help="synthetic preset when no --model")
    ap.add_argument("--split", type=int, default=2, help="the heads run layers 0:SPLIT")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--head", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.head is not None:
        run_head(args.model, args.addr, args.split, args.head, args.prompt_len, args.tokens)
        return
    heads, tokens = (3, 6) if args.quick else (args.heads, args.tokens)
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from ds4.core.tiny import make_tiny

            model = make_tiny(Path(tmp) / f"{args.preset}.gguf", preset=args.preset, seed=0)
        res = bench(model, heads, args.split, args.prompt_len, tokens)
    info["loadavg_after"] = os.getloadavg()
    result = {"machine": info, "model": args.model.name if args.model else f"preset {args.preset}",
              "backend": "reference", **res}
    for r in res["per_head"]:
        print(f"head {r['head']:2d}: {r['decode_tokens_per_s']:7.2f} tokens/s, prefill "
              f"{r['prefill_ms']:8.1f} ms, token-identical to unsplit: {r['token_identical']}")
    print(f"{heads} heads together: {res['aggregate_tokens_per_s']} tokens/s in all, every head "
          f"token-identical: {res['all_token_identical']}; head {heads + 1} refused: "
          f"{res['extra_head_refused']} after {res['extra_head_refusal_s']} s")
    if args.quick:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{info['host']}-{info['cpu_count']}cpu")
    stem = args.out / f"concurrent_heads-{heads}-{name}"
    with atomic_file(stem.with_suffix(".json"), "w", private=False) as f:
        f.write(json.dumps(result, indent=2) + "\n")
    with atomic_file(stem.with_suffix(".csv"), "w", private=False) as f:
        w = csv.writer(f)
        w.writerow(["machine", "cpu", "heads", "head", "decode_tokens", "decode_tokens_per_s",
                    "prefill_ms", "token_identical"])
        for r in res["per_head"]:
            w.writerow([info["host"], f"{info['cpu']} x{info['cpu_count']}", heads, r["head"],
                        r["decode_tokens"], r["decode_tokens_per_s"], r["prefill_ms"],
                        r["token_identical"]])
    print(f"wrote {stem}.json and .csv")


if __name__ == "__main__":
    main()
