"""Full-size synthetic DS4 Flash on one GPU with the Triton backend.

The model is a GGUF whose data is a hole (`write_sparse_gguf`: the real header, ~87 GB virtual,
no disk used) opened with `Engine.open(..., backend="triton", synthetic=True)`: every weight is
generated on the GPU as random valid blocks of its real type (IQ2_XXS / Q2_K experts, Q8_0
attention and shared experts, F16 compressors / indexer / mHC, F32 norms).

Measures: device-to-device copy bandwidth (the roofline's denominator), batch-1 decode tokens/s
at the given contexts (state filled with random rows, CUDA-graph replay) three ways: as
`ds4 generate` runs it, greedy and with ds4's default sampling parameters (`Session.sample`: each
token chosen on the device, the next step queued before the host reads it), and given tokens
through `Session.eval` (the logits copied to the host after every step, as a sampler on the host
needs them); prefill tokens/s,
and per-kernel tables of one eager decode step and one prefill chunk (time from the profiler,
bytes each launch must move, bandwidth against the copy rate; for the prefill products also
TFLOP/s against the bf16 peak).

    PYTHONPATH=. python bench/triton/bench_full.py --out results/ [--preset flash]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

import ds4
from ds4.core.atomic import atomic_file
from ds4.core.gguf_write import write_sparse_gguf
from ds4.core.sampling import Rng, SamplingParams
from ds4.core.tiny import preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (run as a script or imported by path)
from decode_chain import step_table  # noqa: E402
from settings import SESSION_KEYS, apply_settings, check_settings  # noqa: E402

BF16_PEAK_TFLOPS = 790.0  # the H200's dense bf16 / fp16 tensor-core peak: the prefill table's yardstick


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / float(np.median(times))


def _qweights(obj):
    from ds4.backends.triton.backend import QWeight

    if isinstance(obj, QWeight):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _qweights(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name != "cfg":
                yield from _qweights(getattr(obj, f.name))


def decode_weight_bytes(eng) -> int:
    """Bytes of weights one decode token reads: all but the embedding table (one row of it), the
    routed experts counted for the n_expert_used selected ones."""
    cfg = eng.config
    total = 0
    for w in _qweights(eng.weights):
        if w.name == "token_embd.weight":
            total += w.RB
        elif w.n_exp > 1:
            total += w.nbytes * cfg.n_expert_used // w.n_exp
        else:
            total += w.nbytes
    return total


def fill_state(session, rng_seed: int = 0) -> None:
    """Random rows in every state array (f16-exact cache rows, finite frontier scores; the
    indexer's rows exact in bfloat16 too, as numerics "ds4" makes them, so that index_bf16
    variants read the same values)."""
    g = torch.Generator(device="cuda").manual_seed(rng_seed)
    for st in session.states.values():
        for name, t in st.items():
            x = torch.randn(t.shape, device="cuda", generator=g)
            if name in ("raw", "comp"):
                x = x.half().float()
            elif name == "index":
                x = x.bfloat16().float()
            t.copy_(x)


def bench_decode(eng, ctx: int, steps: int, seed: int, trace: str | None = None) -> dict:
    cfg = eng.config
    rng = np.random.default_rng(seed)
    s = eng.session(ctx=ctx + 3 * steps + 8)
    fill_state(s, seed)
    s._tokens = [int(x) for x in rng.integers(0, cfg.n_vocab, ctx)]  # the history the state stands for
    toks = [int(x) for x in rng.integers(0, cfg.n_vocab, steps + 3)]
    t0 = time.perf_counter()
    s.eval(toks[0])  # eager: compiles, sizes the step's buffers
    t_warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    s.eval(toks[1])  # captured into a CUDA graph, then replayed
    t_cap = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    each = []  # wall time of every step: a few slow steps or all of them?
    for t in toks[2: 2 + steps]:
        ts = time.perf_counter()
        s.eval(t)
        each.append(time.perf_counter() - ts)
    dt = time.perf_counter() - t0
    assert np.isfinite(s.logits).all()
    # the same seed gives the same tokens and history: variants that only reorder work (side
    # streams) must end on the same logits, bit for bit
    digest = hashlib.sha256(np.ascontiguousarray(s.logits, dtype=np.float32).tobytes()).hexdigest()[:16]
    # greedy decoding as `ds4 generate --temperature 0` and `ds4 bench` run it (Session.greedy):
    # each token chosen on the device, the next step queued before the host has read it
    t0 = time.perf_counter()
    greedy = list(s.greedy(steps))
    dt_greedy = time.perf_counter() - t0
    assert len(greedy) == steps
    # and with ds4's default sampling parameters (T 1, min-p 0.05), drawn on the device too
    t0 = time.perf_counter()
    drawn = list(s.sample(steps, SamplingParams(), Rng(seed)))
    dt_sample = time.perf_counter() - t0
    assert len(drawn) == steps
    be = eng.backend
    entry = next((e for e in be._graphs.values() if e.states is s.states), None)
    gpu = None
    if entry is not None and entry.graph is not None:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            entry.graph.replay()
        e1.record()
        torch.cuda.synchronize()
        gpu = e0.elapsed_time(e1) / 10 / 1e3
    timeline = None
    if trace and entry is not None and entry.graph is not None:
        timeline = replay_timeline(entry.graph, trace)
    each_ms = np.sort(np.array(each)) * 1e3
    return dict(ctx=ctx, steps=steps, tokens_per_s=steps / dt, ms_per_token=1e3 * dt / steps, logits_sha=digest,
                greedy_tokens_per_s=steps / dt_greedy, greedy_ms_per_token=1e3 * dt_greedy / steps,
                sample_tokens_per_s=steps / dt_sample, sample_ms_per_token=1e3 * dt_sample / steps,
                step_ms_min=float(each_ms[0]), step_ms_median=float(np.median(each_ms)), step_ms_max=float(each_ms[-1]),
                timeline=timeline,
                gpu_ms_per_step=None if gpu is None else 1e3 * gpu, warm_s=t_warm, capture_s=t_cap,
                n_graph_ops=None if entry is None else len(entry.names))


def replay_timeline(graph, path: str) -> dict:
    """One profiled replay of a captured decode step: every kernel's stream, start and duration
    (CSV at path), and how much of the step's span the GPU was busy, the side streams being
    what lets kernels overlap."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    tmp = path + ".trace.json"
    prof.export_chrome_trace(tmp)
    with open(tmp) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    os.remove(tmp)
    events.sort(key=lambda e: e["ts"])
    t0 = events[0]["ts"]
    rows = [dict(kernel=e["name"], stream=e.get("args", {}).get("stream"), start_us=round(e["ts"] - t0, 2),
                 dur_us=round(e["dur"], 2)) for e in events]
    _write_csv(path, rows)
    # per kernel: on the critical chain, alone (from the rows as written, as decode_chain.py reads them)
    chain_rows, _ = step_table([(r["kernel"], r["start_us"], r["start_us"] + r["dur_us"]) for r in rows])
    _write_csv(path.replace("decode_timeline_", "decode_chain_"), chain_rows)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    busy, (cs, ce) = 0.0, (events[0]["ts"], events[0]["ts"] + events[0]["dur"])
    for e in events[1:]:  # union of the kernels' intervals
        if e["ts"] > ce:
            busy, cs, ce = busy + ce - cs, e["ts"], e["ts"] + e["dur"]
        else:
            ce = max(ce, e["ts"] + e["dur"])
    busy += ce - cs
    return dict(kernels=len(rows), streams=len({r["stream"] for r in rows}), span_us=round(span, 1),
                busy_us=round(busy, 1), kernel_sum_us=round(sum(r["dur_us"] for r in rows), 1))


def _profile(be, fn, copy_bw: float) -> list[dict]:
    """Run fn under the profiler with the backend's launch ledger on; one row per kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    be.ledger, be.flop_ledger = [], []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ledger, flop_ledger, be.ledger, be.flop_ledger = be.ledger, be.flop_ledger, None, None
    kbytes, kcalls, kflops = defaultdict(int), defaultdict(int), defaultdict(int)
    for name, nb in ledger:
        kbytes[name] += nb
        kcalls[name] += 1
    for name, fl in flop_ledger:
        kflops[name] += fl
    ktime = defaultdict(float)
    other = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        hit = [name for name in kbytes if ev.key == name or ev.key.startswith(name)]
        if hit:
            ktime[hit[0]] += t  # microseconds
        elif t:
            other += t
    rows = []
    for name in sorted(kbytes, key=lambda k: -ktime[k]):
        us = ktime[name]
        bw = kbytes[name] / (us * 1e-6) if us else float("nan")
        tf = kflops[name] / (us * 1e-6) / 1e12 if us and kflops[name] else 0.0
        rows.append(dict(kernel=name, calls=kcalls[name], time_us=round(us, 1), bytes=kbytes[name],
                         gb_per_s=round(bw / 1e9, 1), pct_of_copy_bw=round(100 * bw / copy_bw, 1),
                         tflop_per_s=round(tf, 1), pct_of_bf16_peak=round(100 * tf / BF16_PEAK_TFLOPS, 1)))
    if other:
        rows.append(dict(kernel="(torch glue)", calls=0, time_us=round(other, 1), bytes=0, gb_per_s=0,
                         pct_of_copy_bw=0, tflop_per_s=0, pct_of_bf16_peak=0))
    return rows


def kernel_table(eng, ctx: int, seed: int, copy_bw: float) -> list[dict]:
    """One eager decode step at context ctx, per kernel."""
    cfg = eng.config
    rng = np.random.default_rng(seed)
    be = eng.backend
    s = eng.session(ctx=ctx + 8)
    fill_state(s, seed)
    s._tokens = [int(x) for x in rng.integers(0, cfg.n_vocab, ctx)]
    old = be.cuda_graphs
    be.cuda_graphs = False
    s.eval(1)  # warm
    rows = _profile(be, lambda: s.eval(2), copy_bw)
    be.cuda_graphs = old
    return rows


def prefill_table(eng, n: int, copy_bw: float, cap: int | None = None) -> list[dict]:
    """One n-token prefill (kernels already compiled; one chunk unless cap is smaller), per kernel."""
    cfg = eng.config
    s = eng.session(ctx=n + 64, prefill_cap=cap)
    toks = [int(x) for x in np.random.default_rng(5).integers(0, cfg.n_vocab, n)]
    return _profile(eng.backend, lambda: s.sync(toks), copy_bw)


def _write_csv(path, rows):
    with atomic_file(path, "w", private=False) as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def bench_prefill(eng, n: int, seed: int, cap: int | None = None) -> dict:
    """An n-token prompt in chunks of cap tokens (None: the session's default)."""
    cfg = eng.config
    rng = np.random.default_rng(seed)
    s = eng.session(ctx=n + 64, prefill_cap=cap)
    toks = [int(x) for x in rng.integers(0, cfg.n_vocab, n)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    s.sync(toks)
    dt = time.perf_counter() - t0
    assert np.isfinite(s.logits).all()
    return dict(prompt=n, seconds=dt, tokens_per_s=n / dt, prefill_cap=s.layout.prefill_cap)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/triton/results")
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers of the preset to load (0: all); fewer fit a smaller GPU, per-layer costs stay")
    ap.add_argument("--variant-tables", action="store_true",
                    help="also profile the first prefill size per kernel under each prefill variant "
                         "(prefill_kernels_<variant>.csv)")
    ap.add_argument("--ctx", default="4096,32768")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later parts are skipped past it")
    ap.add_argument("--gguf", default="/tmp/ds4-flash-sparse.gguf")
    ap.add_argument("--prefill-table", default="2048",
                    help="prompt sizes profiled per kernel (prefill_kernels.csv for the first, "
                         "prefill_kernels_<n>.csv for the others)")
    ap.add_argument("--prefill-variants", default="{}",
                    help="JSON {name: {backend attribute: value}}: the first prefill size also measured with each "
                         "(\"prefill_cap\": the session's chunk instead of a backend attribute)")
    ap.add_argument("--trace", action="store_true",
                    help="profile one graph replay per decode context: decode_timeline_<ctx>.csv (every kernel's "
                         "stream, start, duration), decode_chain_<ctx>.csv (per kernel: time on the step's "
                         "critical chain and alone, decode_chain.py) and its busy time in results.json")
    ap.add_argument("--set", default="{}",
                    help='JSON {backend attribute: value} set after loading, before anything is measured '
                         '(the run\'s own configuration, traces included)')
    ap.add_argument("--variants", default="{}",
                    help='JSON {name: {backend attribute: value}}: decode also measured with each, same run '
                         '(e.g. {"gateup_216": {"mv_types": {"80": 308, "16": 216, "10": 110}}}: an attribute is replaced whole)')
    a = ap.parse_args()
    T0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    res: dict = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                     triton=__import__("triton").__version__, preset=a.preset,
                     dot_precision=os.environ.get("DS4_TRITON_DOT") or None)
    res["copy_bw_GBps"] = copy_bandwidth() / 1e9
    log(f"device {res['device']}, copy {res['copy_bw_GBps']:.0f} GB/s")

    cfg = preset_config(a.preset, **({"n_layer": a.layers} if a.layers else {}))
    res["layers"] = cfg.n_layer
    tokens = [f"<t{i}>" for i in range(cfg.n_vocab)]
    write_sparse_gguf(a.gguf, cfg, {}, tokens, [])
    t0 = time.time()
    eng = ds4.Engine.open(a.gguf, backend="triton", synthetic=True)
    torch.cuda.synchronize()
    res["load_s"] = time.time() - t0
    settings = json.loads(a.set)
    apply_settings(eng.backend, settings, "--set")
    if settings:
        res["set"] = settings
    variants, prefill_variants = json.loads(a.variants), json.loads(a.prefill_variants)
    for name, attrs in variants.items():  # (before anything is measured)
        check_settings(eng.backend, attrs, f"--variants {name}")
    for name, attrs in prefill_variants.items():
        check_settings(eng.backend, attrs, f"--prefill-variants {name}", SESSION_KEYS)
    res["gpu_mem_GB"] = torch.cuda.memory_allocated() / 1e9
    wb = decode_weight_bytes(eng)
    res["decode_weight_bytes"] = wb
    res["weights_roofline_tok_s"] = res["copy_bw_GBps"] * 1e9 / wb
    log(f"loaded in {res['load_s']:.1f}s, {res['gpu_mem_GB']:.1f} GB on the GPU; decode reads "
        f"{wb / 1e9:.2f} GB of weights/token -> roofline {res['weights_roofline_tok_s']:.0f} tok/s")

    res["decode"] = []
    for ctx in [int(c) for c in a.ctx.split(",") if c]:
        if time.time() - T0 > a.budget:
            log(f"skip decode ctx {ctx}: over budget")
            continue
        r = bench_decode(eng, ctx, a.steps, seed=ctx)
        res["decode"].append(r)
        log(f"decode ctx {ctx}: greedy on the device {r['greedy_tokens_per_s']:.1f} tok/s "
            f"({r['greedy_ms_per_token']:.2f} ms/token), sampled on the device {r['sample_tokens_per_s']:.1f}; "
            f"eval with logits to the host "
            f"{r['tokens_per_s']:.1f} tok/s ({r['ms_per_token']:.2f} ms/token, "
            f"GPU replay {r['gpu_ms_per_step']} ms, {r['n_graph_ops']} ops/graph; one step's wall time "
            f"min / median / max {r['step_ms_min']:.2f} / {r['step_ms_median']:.2f} / {r['step_ms_max']:.2f} ms)")
        for name, attrs in variants.items():
            be = eng.backend
            saved = {k: getattr(be, k) for k in attrs}
            from ds4.backends.triton.backend import parse_mv_shapes  # (here: a base tree may lack it)

            for k, v in attrs.items():  # mv_shapes: entries over the shipped table
                setattr(be, k, {int(t): x for t, x in v.items()} if k == "mv_types" else
                        {**be.mv_shapes, **parse_mv_shapes(v, f"variant {name}")} if k == "mv_shapes" else v)
            be._graphs.clear()  # recapture under the variant
            rv = bench_decode(eng, ctx, a.steps, seed=ctx)
            for k, v in saved.items():
                setattr(be, k, v)
            be._graphs.clear()
            res.setdefault("decode_variants", []).append(dict(variant=name, **attrs, **rv))
            same = "same logits" if rv["logits_sha"] == r["logits_sha"] else "different logits"
            log(f"  variant {name}: greedy {rv['greedy_tokens_per_s']:.1f}, sampled {rv['sample_tokens_per_s']:.1f}, eval {rv['tokens_per_s']:.1f} tok/s (GPU replay {rv['gpu_ms_per_step']} ms, {same}; "
                f"step median {rv['step_ms_median']:.2f} ms)")
        with atomic_file(os.path.join(a.out, "results.json"), "w", private=False) as f:
            json.dump(res, f, indent=1)

    res["prefill"] = []
    for n in [int(c) for c in a.prefill.split(",") if c]:
        if time.time() - T0 > a.budget:
            log(f"skip prefill {n}: over budget")
            continue
        # compile the prefill kernels: a prompt of this size, since later chunks run kernels the
        # first one does not (the indexer's scores and top-k once a chunk sees more than top-k rows)
        w = bench_prefill(eng, n, seed=99)
        log(f"prefill warm-up {w['prompt']}: {w['seconds']:.1f}s")
        r = bench_prefill(eng, n, seed=n)
        first = not res["prefill"]
        res["prefill"].append(r)
        log(f"prefill {n}: {r['tokens_per_s']:.0f} tok/s ({r['seconds']:.2f}s)")
        for name, attrs in (prefill_variants.items() if first else ()):
            be = eng.backend
            cap = attrs.get("prefill_cap")
            saved = {k: getattr(be, k) for k in attrs if k not in SESSION_KEYS}
            for k in saved:
                setattr(be, k, attrs[k])
            try:
                bench_prefill(eng, n, seed=98, cap=cap)  # compile the variant's kernels
                rv = bench_prefill(eng, n, seed=n, cap=cap)
                if a.variant_tables:  # per kernel, still under the variant's settings
                    rv["kernels"] = prefill_table(eng, n, res["copy_bw_GBps"] * 1e9, cap=cap)
                    _write_csv(os.path.join(a.out, f"prefill_kernels_{name}.csv"), rv["kernels"])
            except Exception as e:  # noqa: BLE001  (a tile that does not fit is a result too)
                log(f"  variant {name}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            finally:
                for k, v in saved.items():
                    setattr(be, k, v)
            res.setdefault("prefill_variants", []).append({"variant": name, **attrs, **rv})
            log(f"  variant {name}: {rv['tokens_per_s']:.0f} tok/s ({rv['seconds']:.2f}s)")
        with atomic_file(os.path.join(a.out, "results.json"), "w", private=False) as f:
            json.dump(res, f, indent=1)

    # Everything timed, then what runs under the profiler: once torch.profiler has run, every later
    # graph launch in the process pays for its instrumentation on the host, so a step timed after a
    # trace would count the profiler's host time as the engine's
    for r in res["decode"] if a.trace else ():
        ctx = r["ctx"]
        trace = os.path.join(a.out, f"decode_timeline_{ctx}.csv")
        tl = bench_decode(eng, ctx, a.steps, seed=ctx, trace=trace)["timeline"]
        r["timeline"] = tl
        if tl:
            log(f"decode ctx {ctx}, one replay: {tl['kernels']} kernels on {tl['streams']} streams, span "
                f"{tl['span_us']} us, GPU busy {tl['busy_us']} us, kernel durations sum to {tl['kernel_sum_us']} us")
    try:
        if res["decode"]:
            res["kernels"] = kernel_table(eng, 4096, 1, res["copy_bw_GBps"] * 1e9)
            _write_csv(os.path.join(a.out, "decode_kernels.csv"), res["kernels"])
    except Exception as e:  # noqa: BLE001
        log(f"kernel table failed: {type(e).__name__}: {e}")
    with atomic_file(os.path.join(a.out, "results.json"), "w", private=False) as f:
        json.dump(res, f, indent=1)

    for i, n in enumerate(int(c) for c in a.prefill_table.split(",") if c):
        try:
            if res["prefill"] and time.time() - T0 < a.budget:
                rows = prefill_table(eng, n, res["copy_bw_GBps"] * 1e9)
                key, name = ("prefill_kernels", "prefill_kernels.csv") if i == 0 else \
                    (f"prefill_kernels_{n}", f"prefill_kernels_{n}.csv")
                res[key] = rows
                _write_csv(os.path.join(a.out, name), rows)
        except Exception as e:  # noqa: BLE001
            log(f"prefill table {n} failed: {type(e).__name__}: {e}")
    with atomic_file(os.path.join(a.out, "results.json"), "w", private=False) as f:
        json.dump(res, f, indent=1)
    with atomic_file(os.path.join(a.out, "summary.csv"), "w", private=False) as f:
        wr = csv.writer(f)
        wr.writerow(["device", "metric", "value", "unit"])
        wr.writerow([res["device"], "copy_bandwidth", f"{res['copy_bw_GBps']:.0f}", "GB/s"])
        wr.writerow([res["device"], "weights_roofline_decode", f"{res['weights_roofline_tok_s']:.0f}", "tokens/s"])
        for r in res["decode"]:
            wr.writerow([res["device"], f"decode_greedy_ctx{r['ctx']}", f"{r['greedy_tokens_per_s']:.1f}", "tokens/s"])
            wr.writerow([res["device"], f"decode_sample_ctx{r['ctx']}", f"{r['sample_tokens_per_s']:.1f}", "tokens/s"])
            wr.writerow([res["device"], f"decode_eval_ctx{r['ctx']}", f"{r['tokens_per_s']:.1f}", "tokens/s"])
        for r in res["prefill"]:
            wr.writerow([res["device"], f"prefill_{r['prompt']}", f"{r['tokens_per_s']:.0f}", "tokens/s"])
    print("\n| metric | value |\n|---|---|")
    print(f"| device | {res['device']} |\n| copy bandwidth | {res['copy_bw_GBps']:.0f} GB/s |")
    print(f"| weights-only roofline | {res['weights_roofline_tok_s']:.0f} tok/s |")
    for r in res["decode"]:
        print(f"| decode ctx {r['ctx']}, greedy on the device | {r['greedy_tokens_per_s']:.1f} tok/s |")
        print(f"| decode ctx {r['ctx']}, sampled on the device (T 1, min-p 0.05) | {r['sample_tokens_per_s']:.1f} tok/s |")
        print(f"| decode ctx {r['ctx']}, eval + logits to the host | {r['tokens_per_s']:.1f} tok/s "
              f"(GPU {r['gpu_ms_per_step']} ms/step) |")
    for r in res["prefill"]:
        print(f"| prefill {r['prompt']} | {r['tokens_per_s']:.0f} tok/s |")
    tables = [("decode step", "kernels"), ("prefill chunk 2048", "prefill_kernels")]
    tables += [(f"prefill {k[16:]}", k) for k in res if k.startswith("prefill_kernels_")]
    for title, key in tables:
        print(f"\n{title}:")
        for k in res.get(key, [])[:14]:
            print(f"| {k['kernel']} x{k['calls']} | {k['time_us']} us, {k['gb_per_s']} GB/s ({k['pct_of_copy_bw']}%) |")


if __name__ == "__main__":
    main()
