"""Prefill and generation speed as the context grows (the library behind `ds4 bench`).

One fixed token sequence is walked to a list of context frontiers. Prefill is incremental: the
session already holds the tokens up to the previous frontier, so each row times only the interval
added since (`Session.sync` reuses the common prefix). At each frontier the session is
snapshotted, a greedy probe of `gen_tokens` decode steps is timed, and the snapshot is restored,
so the probe never leaks into the next interval and every backend walks the same sequence.

    eng = ds4.Engine.open(path, backend="reference")
    seq = bench_tokens(eng.tokenizer, 1024)
    rows = run_bench(eng, seq, frontiers(128, 1024, step_mul=2), gen_tokens=32)
    write_csv(rows, sys.stdout)

The sequence is BOS followed by the BPE ids of `BENCH_TEXT`, repeated: valid for any vocabulary
the tokenizer encodes (the real one and the small test ones), and the same ids on every backend
and every run. Timing is `time.perf_counter` around `sync` and the probe (`Session.greedy`); both
end only once the next-token logits are a host numpy array, which forces an asynchronous backend
to finish. The probe is `eval(argmax)` in a loop; a backend that chooses the argmax on the device
runs its steps back to back.
"""

from __future__ import annotations

import csv
import io
import math
import os
import platform
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterable, TextIO

import numpy as np

# Plain prose, tokenized once and repeated; its content only needs to be ordinary text.
BENCH_TEXT = (
    "A benchmark walks one fixed sequence of tokens to a growing context. At every frontier the "
    "engine has already seen everything before it, so only the newly added interval is prefilled, "
    "and a short greedy probe measures how fast it generates with that much context behind it. "
    "Rivers carry sand to the sea; the sea returns it as rain, and the mountains wear down slowly "
    "over ten thousand years. Numbers such as 3.14159, 2.71828 and 1.41421 appear in the text too, "
    "along with punctuation: commas, colons; quotes \"like these\" and (parentheses).\n"
)

CSV_COLUMNS = ("backend", "device", "model", "frontier", "prefill_tokens", "prefill_s",
               "prefill_tok_s", "gen_tokens", "gen_s", "gen_tok_s", "kv_bytes", "state_bytes")


@dataclass
class BenchRow:
    """One frontier: the interval prefilled to reach it and the probe generated from it."""

    backend: str
    device: str
    model: str
    frontier: int        # context length after this row's prefill (tokens)
    prefill_tokens: int  # tokens in the interval prefilled to reach the frontier
    prefill_s: float
    prefill_tok_s: float
    gen_tokens: int      # decode steps of the greedy probe
    gen_s: float
    gen_tok_s: float
    kv_bytes: int        # state bytes holding live data at the frontier (see live_state_bytes)
    state_bytes: int     # the whole session state as a snapshot holds it (Snapshot.nbytes)
    probe: list[int] = field(default_factory=list)  # the generated token ids (not in the CSV)


def bench_tokens(tokenizer, n: int, text: str = BENCH_TEXT) -> list[int]:
    """The benchmark sequence: BOS, then the ids of `text` repeated, cut to `n` tokens."""
    if n < 0:
        raise ValueError(f"n: expected a token count >= 0, got {n}")
    unit = tokenizer.encode(text)
    if not unit:
        raise ValueError("bench text encodes to no tokens")
    reps = -(-max(n - 1, 0) // len(unit))
    return ([tokenizer.bos_id] + unit * reps)[:n]


def frontiers(ctx_start: int, ctx_max: int, step_incr: int | None = None,
              step_mul: float | None = None) -> list[int]:
    """ctx_start, then +step_incr or ×step_mul (rounded up, at least +1) while below ctx_max;
    the last frontier is always ctx_max."""
    if (step_incr is None) == (step_mul is None):
        raise ValueError("expected exactly one of step_incr and step_mul")
    if ctx_start < 1:
        raise ValueError(f"ctx_start: expected at least 1 token, got {ctx_start}")
    if ctx_max < ctx_start:
        raise ValueError(f"ctx_max: expected at least ctx_start={ctx_start}, got {ctx_max}")
    if step_incr is not None and step_incr < 1:
        raise ValueError(f"step_incr: expected at least 1, got {step_incr}")
    if step_mul is not None and not (math.isfinite(step_mul) and step_mul > 1):
        raise ValueError(f"step_mul: expected a number > 1, got {step_mul}")
    out = [ctx_start]
    while out[-1] < ctx_max:
        f = out[-1]
        nxt = f + step_incr if step_incr is not None else max(f + 1, math.ceil(f * step_mul - 1e-9))
        out.append(min(nxt, ctx_max))
    return out


def live_state_bytes(snap, cfg, n_tokens: int) -> int:
    """Bytes of a snapshot's state that hold data after `n_tokens` tokens: the raw rows inside
    the sliding window, the T // ratio compressed and indexer rows, and the compressor frontiers
    (fixed-size buffers). The rest of the session's allocation is capacity for a longer context."""
    total = 0
    for il, arrays in snap.arrays.items():
        ratio = cfg.ratio(il)
        for name, a in arrays.items():
            row = a.nbytes // a.shape[0] if a.shape[0] else 0
            if name == "raw":
                total += row * min(n_tokens, snap.layout.raw_window, a.shape[0])
            elif name in ("comp", "index"):
                total += row * min(n_tokens // ratio, a.shape[0])
            else:
                total += a.nbytes
    return total


def cpu_description() -> str:
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return f"{name}, {cores} core{'s' if cores != 1 else ''}"


def describe_device(backend) -> str:
    """The backend's device, with the processor spelled out when it is the CPU."""
    dev = str(getattr(backend, "device", "cpu") or "cpu")
    if dev.lower().startswith("cpu") and ":" not in dev:
        return f"{dev}: {cpu_description()}"
    return dev


def model_label(engine) -> str:
    name = engine.config.name
    return name or os.path.splitext(os.path.basename(str(engine.model.path)))[0]


def warm_up(engine, tokens: list[int]) -> None:
    """One short prefill and decode step on a throwaway session, so that one-time costs (weight
    uploads and decodes, kernel compilation) do not land in the first row."""
    n = max(1, min(16, len(tokens)))
    s = engine.session(ctx=n + 2)
    s.sync(tokens[:n])
    s.eval(int(np.argmax(s.logits)))


def run_bench(engine, tokens: list[int], points: Iterable[int], gen_tokens: int,
              prefill_cap: int | None = None, session=None, warmup: bool = True, repeat: int = 1,
              on_row: Callable[[BenchRow], None] | None = None) -> list[BenchRow]:
    """Walk `tokens` to each frontier in `points`, timing the new interval and a greedy probe.

    `session` (default: a new one of ctx = last frontier + gen_tokens) must start empty; it ends
    holding exactly the sequence up to the last frontier. With `repeat` > 1 each interval and
    each probe runs that many times from a restored snapshot and the fastest time is kept
    (a shared or throttled machine only ever slows a run down).
    """
    if repeat < 1:
        raise ValueError(f"repeat: expected at least 1, got {repeat}")
    points = list(points)
    if not points or any(b <= a for a, b in zip(points, points[1:])) or points[0] < 1:
        raise ValueError(f"frontiers: expected increasing positive token counts, got {points}")
    if gen_tokens < 1:
        raise ValueError(f"gen_tokens: expected at least 1, got {gen_tokens}")
    if len(tokens) < points[-1]:
        raise ValueError(f"tokens: the sequence has {len(tokens)} tokens, fewer than the last "
                         f"frontier {points[-1]}")
    need = points[-1] + gen_tokens
    if session is None:
        session = engine.session(ctx=need, prefill_cap=prefill_cap)
    if session.ctx < need:
        raise ValueError(f"session: ctx={session.ctx} cannot hold the last frontier {points[-1]} "
                         f"plus {gen_tokens} generated tokens")
    if session.tokens:
        raise ValueError("session: expected an empty session")
    if warmup:
        warm_up(engine, tokens)

    backend = getattr(engine, "bench_label", engine.backend.name)  # (a tensor-parallel pair's)
    device, model = describe_device(engine.backend), model_label(engine)
    rows: list[BenchRow] = []
    prev = 0
    for f in points:
        before = session.snapshot() if repeat > 1 else None
        t_prefill = math.inf
        for i in range(repeat):
            if i:
                session.restore(before)
            t0 = time.perf_counter()
            session.sync(tokens[:f])  # only tokens[prev:f] are new
            t_prefill = min(t_prefill, time.perf_counter() - t0)

        snap = session.snapshot()
        t_gen = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            probe = list(session.greedy(gen_tokens))  # eval(argmax) in a loop, as fast as it runs
            t_gen = min(t_gen, time.perf_counter() - t0)
            session.restore(snap)

        row = BenchRow(backend=backend, device=device, model=model, frontier=f,
                       prefill_tokens=f - prev, prefill_s=t_prefill,
                       prefill_tok_s=_rate(f - prev, t_prefill), gen_tokens=gen_tokens,
                       gen_s=t_gen, gen_tok_s=_rate(gen_tokens, t_gen),
                       kv_bytes=live_state_bytes(snap, engine.config, f),
                       state_bytes=snap.nbytes, probe=probe)
        rows.append(row)
        if on_row is not None:
            on_row(row)
        prev = f
    return rows


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else math.inf


# ---- comparing backends -------------------------------------------------------------------------

def check_backends(names: list[str]) -> None:
    """Raise one RuntimeError naming every backend in `names` that cannot run here."""
    from .backends import BACKENDS, backend_class

    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(map(repr, unknown))}: expected names "
                         f"from {', '.join(BACKENDS)}")
    missing = []
    for n in dict.fromkeys(names):
        try:
            cls = backend_class(n)
        except RuntimeError as e:
            missing.append(f"{n} ({e.__cause__ or e})")
            continue
        runs_here = getattr(cls, "runs_here", None)
        if runs_here is not None and not runs_here():
            missing.append(f"{n} (its device is not on this machine)")
    if missing:
        raise RuntimeError(f"backend(s) not available here: {'; '.join(missing)}")


@dataclass
class Ratio:
    frontier: int
    prefill: float  # other / base prefill tokens/s
    gen: float      # other / base generation tokens/s
    same_probe: bool  # both backends generated the same greedy tokens


def ratios(base: list[BenchRow], other: list[BenchRow]) -> list[Ratio]:
    """Per frontier both ran: other's speed over base's (>1: other is faster)."""
    by_f = {r.frontier: r for r in base}
    return [Ratio(r.frontier, _div(r.prefill_tok_s, by_f[r.frontier].prefill_tok_s),
                  _div(r.gen_tok_s, by_f[r.frontier].gen_tok_s), r.probe == by_f[r.frontier].probe)
            for r in other if r.frontier in by_f]


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


# ---- CSV ----------------------------------------------------------------------------------------

def _cell(name: str, value) -> str:
    if name in ("prefill_s", "gen_s"):
        return f"{value:.6f}"
    if name in ("prefill_tok_s", "gen_tok_s"):
        return f"{value:.3f}"
    return str(value)


def write_csv_header(f: TextIO) -> None:
    csv.writer(f, lineterminator="\n").writerow(CSV_COLUMNS)


def write_csv_rows(rows: Iterable[BenchRow], f: TextIO) -> None:
    w = csv.writer(f, lineterminator="\n")
    for r in rows:
        w.writerow([_cell(c, getattr(r, c)) for c in CSV_COLUMNS])


def write_csv(rows: Iterable[BenchRow], f: TextIO) -> None:
    write_csv_header(f)
    write_csv_rows(rows, f)


def decode_utf8(data: bytes, what: str) -> str:
    """data as UTF-8 text, or a ValueError `WHAT: not UTF-8 text (byte N is 0xNN)`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None


def read_csv(path: str | os.PathLike) -> list[BenchRow]:
    """Rows of a CSV that `write_csv` wrote (extra columns are ignored). A file that is not one
    (not UTF-8, a column missing, a bad value) is a ValueError that starts with the path."""
    types = {f.name: f.type for f in fields(BenchRow)}
    # (decoded whole, so a byte that is not UTF-8 is named by its offset in the file)
    text = decode_utf8(Path(path).read_bytes(), str(path))
    with io.StringIO(text, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a ds4 bench CSV (missing column(s) {', '.join(missing)})")
        rows = []
        for i, rec in enumerate(reader, start=2):
            try:
                kw = {c: (int(rec[c]) if types[c] in (int, "int") else
                          float(rec[c]) if types[c] in (float, "float") else rec[c])
                      for c in CSV_COLUMNS}
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{i}: bad value ({e})") from None
            rows.append(BenchRow(**kw))
    return rows
