"""`ds4 bench`: prefill and generation speed as the context grows, on one backend or several.

Registered on the app by `register(app)`. CSV goes to stdout (or --csv FILE); the rich tables go
to the terminal: stderr when stdout carries the CSV, stdout otherwise.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ds4.core.atomic import atomic_file, signals_unwind

from .tp import (DEFAULT_GATE_TIMEOUT_MS, DEFAULT_TP_WAIT_S, DebugHashOption, GateTimeoutOption,
                 TpLeader, TpListenOption, TpTransportOption, TpWaitOption)
from .wire_options import AuthTokenFileOption, TlsCaOption, TlsCertOption, TlsKeyOption
from .common import (CLIError, check_prefill_cap, err, fail, human_bytes, library_errors, open_engine, out,
                     output_file, progress_callback, resolve_model)
from .options import BackendName, ModelOption, NumericsOption, PrefillCapOption, check_range

HELP = """Measure prefill and generation tokens/s as the context grows.

Walks one fixed token sequence (BOS + a built-in English text, repeated) to the context frontiers --ctx-start, then +--step-incr or ×--step-mul up to --ctx-max. Each row prefills only the tokens added since the previous frontier, then times a greedy probe of --gen-tokens decode steps from a snapshot of the session, and restores it before going on.

Plot existing results without running: ds4 bench --plot OUT.png --from a.csv --from b.csv
"""


def register(app: typer.Typer) -> None:
    app.command("bench", help=HELP)(bench)


def bench(
    model: ModelOption = None,
    backend: Annotated[Optional[BackendName], typer.Option(
        "--backend", "-b", show_default="auto",
        help="Compute backend: reference (numpy), triton (CUDA), mlx (Metal / CPU), or auto "
             "where the registry offers it.")] = None,
    numerics: NumericsOption = "ds4",
    ctx_start: Annotated[int, typer.Option(
        "--ctx-start", metavar="TOKENS", callback=check_range(1),
        help="The first frontier (its row prefills it from an empty session).")] = 128,
    ctx_max: Annotated[int, typer.Option(
        "--ctx-max", metavar="TOKENS", callback=check_range(1),
        help="The last frontier; the session holds --ctx-max + --gen-tokens tokens.")] = 1024,
    step_incr: Annotated[Optional[int], typer.Option(
        "--step-incr", metavar="TOKENS", callback=check_range(1), show_default=False,
        help="Frontiers grow by this many tokens.")] = None,
    step_mul: Annotated[Optional[float], typer.Option(
        "--step-mul", metavar="X", callback=check_range(1.0, lo_open=True), show_default="2",
        help="Frontiers grow by this factor (rounded up); the default when --step-incr is absent.")] = None,
    gen_tokens: Annotated[int, typer.Option(
        "--gen-tokens", "-n", metavar="N", callback=check_range(1),
        help="Decode steps of the greedy probe timed at each frontier.")] = 32,
    prefill_cap: PrefillCapOption = None,
    repeat: Annotated[int, typer.Option(
        "--repeat", "-r", metavar="N", callback=check_range(1),
        help="Time every interval and probe N times (from a restored snapshot) and keep the "
             "fastest, which filters out other load on the machine.")] = 1,
    warmup: Annotated[bool, typer.Option(
        "--warmup/--no-warmup",
        help="Run a short prefill and decode step first, so one-time costs miss the first row.")] = True,
    compare: Annotated[Optional[str], typer.Option(
        "--compare", metavar="B1,B2,...", show_default=False,
        help="Run these backends in turn on the same sequence and print each one's tokens/s "
             "over the first one's.")] = None,
    csv_path: Annotated[Optional[str], typer.Option(  # (str: Path would drop a trailing "/")
        "--csv", metavar="FILE", show_default=False,
        help="Write the CSV here instead of stdout. Rows are appended to an existing ds4 bench "
             "CSV (each as it is measured) unless --overwrite.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite",
        help="Replace an existing --csv FILE (the new file takes its place when the run "
             "finishes; an interrupted run leaves the old one).")] = False,
    plot: Annotated[Optional[str], typer.Option(  # (str: Path would drop a trailing "/")
        "--plot", metavar="OUT.png", show_default=False,
        help="Draw tokens/s against context (prefill and generation panels) as a PNG.")] = None,
    from_csv: Annotated[Optional[list[Path]], typer.Option(
        "--from", metavar="CSV", exists=True, dir_okay=False, show_default=False,
        help="With --plot: plot these CSVs (repeatable) instead of running a benchmark.")] = None,
    tp_listen: TpListenOption = None,
    tp_transport: TpTransportOption = "tcp",
    gate_timeout_ms: GateTimeoutOption = DEFAULT_GATE_TIMEOUT_MS,
    debug_hash: DebugHashOption = False,
    tp_wait: TpWaitOption = DEFAULT_TP_WAIT_S,
    auth_token_file: AuthTokenFileOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
) -> None:
    from ds4 import bench as lib
    from ds4.bench_plot import group_rows, plot_bench

    if from_csv:
        if plot is None:
            fail("--from needs --plot OUT.png (it plots existing CSVs without running)")
        if backend or compare or csv_path or model:
            fail("--from plots existing CSVs without running: leave out --backend, "
                 "--compare, --model and --csv")
        with library_errors():
            plot = output_file(plot, "--plot")  # (before reading the CSVs, as on a run)
            groups = [g for p in from_csv for g in group_rows(_read_csv(p))]
            if not groups:
                raise CLIError("the CSVs hold no rows to plot")
            plot_bench(groups, plot)
        out.print(Text("wrote ", style="green") + Text(str(plot), style="bold")
                  + Text(f" ({len(groups)} series from {len(from_csv)} CSV file(s))"), soft_wrap=True)
        return

    with library_errors():
        if overwrite and csv_path is None:
            raise CLIError("--overwrite replaces a --csv FILE: give --csv")
        if step_incr is not None and step_mul is not None:
            raise CLIError("give --step-incr or --step-mul, not both")
        if ctx_max < ctx_start:
            raise CLIError(f"--ctx-max {ctx_max} is less than --ctx-start {ctx_start}")
        check_prefill_cap(prefill_cap, ctx_max + gen_tokens, "--ctx-max + --gen-tokens =")
        points = lib.frontiers(ctx_start, ctx_max, step_incr,
                               step_mul if step_mul is not None or step_incr is not None else 2.0)
        if compare is not None:
            if backend is not None:
                raise CLIError("give --backend or --compare, not both")
            names = [n.strip() for n in compare.split(",") if n.strip()]
            if len(names) < 2:
                raise CLIError(f"--compare: expected at least two comma-separated backends, "
                               f"got {compare!r}")
            try:
                lib.check_backends(names)
            except (ValueError, RuntimeError) as e:
                raise CLIError(f"--compare {compare}: {e}") from None
            names = [_resolve(n) for n in names]
        else:
            names = [_resolve(backend or "auto")]
            try:  # before the CSV header is written: a run that cannot start prints nothing
                lib.check_backends(names)
            except (ValueError, RuntimeError) as e:
                raise CLIError(f"--backend {names[0]}: {e}") from None
        if tp_listen and compare is not None:
            raise CLIError("--tp-listen benchmarks one pair: leave out --compare")

        _check_model(model, ctx_max, gen_tokens)  # before the CSV is touched
        if plot is not None:  # (not after the whole run)
            plot = output_file(plot, "--plot")
        append = False
        if csv_path is not None:
            # rows are appended to a non-empty file in place, else written beside it and renamed
            append = not overwrite and os.path.isfile(csv_path) and os.path.getsize(csv_path) > 0
            csv_path = output_file(csv_path, "--csv", in_place=append)
            _check_csv_target(csv_path, append)

    table_console = out if csv_path is not None else err
    with contextlib.ExitStack() as stack:
        stack.enter_context(signals_unwind())
        with library_errors():
            if csv_path is None:
                sink = _Stdout()
            elif append:
                sink = stack.enter_context(open(csv_path, "a", newline=""))
            else:
                sink = stack.enter_context(atomic_file(csv_path, "w", private=False))
        if not append:
            lib.write_csv_header(sink)
        sink.flush()
        tp = TpLeader.of(tp_listen, tp_transport, gate_timeout_ms, debug_hash, tp_wait)
        runs = _run_all(names, model, numerics, ctx_max, gen_tokens, points, prefill_cap, warmup,
                        repeat, sink, table_console, tp, auth_token_file, (tls_cert, tls_key, tls_ca))

    if len(runs) > 1:
        _print_ratios(table_console, names, runs)
    if csv_path is not None:
        err.print(Text("wrote ", style="green") + Text(str(csv_path), style="bold"), soft_wrap=True)
    if plot is not None:
        with library_errors():
            plot_bench(runs, plot)
        err.print(Text("wrote ", style="green") + Text(str(plot), style="bold"), soft_wrap=True)


def _run_all(names, model, numerics, ctx_max, gen_tokens, points, prefill_cap, warmup, repeat,
             sink, table_console, tp: TpLeader | None = None, auth_token_file=None,
             tls_files: tuple = (None, None, None)) -> list[list]:
    """Each backend in turn, a CSV row written as soon as it is measured. `tp`: run the one
    backend as rank 0 of a tensor-parallel pair."""
    from ds4 import bench as lib

    runs: list[list] = []
    for name in names:
        if tp is not None:
            eng = tp.open(model, name, numerics, ctx=ctx_max + gen_tokens, auth_token_file=auth_token_file,
                          tls_files=tls_files)
        else:
            eng = open_engine(model, name, numerics)
        with library_errors():
            seq = lib.bench_tokens(eng.tokenizer, ctx_max)
            with progress_callback(f"bench {name}: {len(points)} frontiers up to {ctx_max}",
                                   transient=True) as progress:
                done: list = []

                def on_row(row, progress=progress, done=done):
                    lib.write_csv_rows([row], sink)
                    sink.flush()
                    done.append(row)
                    progress(len(done), len(points))

                progress(0, len(points))
                rows = lib.run_bench(eng, seq, points, gen_tokens, prefill_cap=prefill_cap,
                                     warmup=warmup, repeat=repeat, on_row=on_row)
        runs.append(rows)
        _print_run(table_console, rows)
        close = getattr(eng, "close", None)
        if close is not None:
            close()
        del eng  # one engine (and its device memory) at a time
    return runs


def _check_model(model: Path | None, ctx_max: int, gen_tokens: int) -> None:
    """The model opens and holds the walk (raises CLIError / ModelError)."""
    from ds4.core.gguf_model import GGUFModel

    cfg = GGUFModel(resolve_model(model)).config
    need = ctx_max + gen_tokens
    if need > cfg.context_length:
        raise CLIError(f"--ctx-max {ctx_max} + --gen-tokens {gen_tokens} = {need} is more than "
                       f"the model's context_length {cfg.context_length}")


def _check_csv_target(path: Path, append: bool) -> None:
    """--csv names a regular file where anything is there, and (`append`: a non-empty file
    without --overwrite, whose rows are appended to) a ds4 bench CSV. Anything else is refused
    rather than appended to or replaced without --overwrite."""
    from ds4.bench import CSV_COLUMNS, decode_utf8

    if path.exists() and not path.is_file():
        raise CLIError(f"--csv {path}: not a regular file")
    if not append:
        return
    with open(path, "rb") as f:
        first = f.readline()
    try:  # (the first line alone: the rows after it are not read)
        header = decode_utf8(first, f"--csv {path}").rstrip("\r\n")
    except ValueError as e:
        raise CLIError(f"{e}; pass --overwrite to replace it") from None
    if header != ",".join(CSV_COLUMNS):
        raise CLIError(f"--csv {path}: not a ds4 bench CSV (its first line is {header[:80]!r}, "
                       f"expected {','.join(CSV_COLUMNS)!r}); pass --overwrite to replace it")


def _read_csv(path: Path) -> list:
    """ds4.bench.read_csv, its errors naming --from."""
    from ds4 import bench as lib

    try:
        return lib.read_csv(path)
    except ValueError as e:  # (each names the file first)
        raise CLIError(f"--from {e}") from None


def _resolve(name: str) -> str:
    """A concrete backend name ("auto" is resolved where the registry knows how)."""
    import ds4.backends

    resolve = getattr(ds4.backends, "resolve_backend", None)
    return resolve(name) if resolve is not None else name


class _Stdout:
    """stdout looked up at write time (as the consoles do), so a test runner's capture works."""

    def write(self, s: str) -> int:
        return sys.stdout.write(s)

    def flush(self) -> None:
        sys.stdout.flush()


def _fmt_rate(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def _print_run(console: Console, rows: list) -> None:
    r0 = rows[0]
    t = Table(title=f"{r0.backend} · {r0.device} · {r0.model}", title_justify="left",
              show_edge=False)
    for col in ("context", "+prefill", "prefill tok/s", "gen tok/s", "KV", "state"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r.frontier:,}", f"{r.prefill_tokens:,}", _fmt_rate(r.prefill_tok_s),
                  _fmt_rate(r.gen_tok_s), human_bytes(r.kv_bytes), human_bytes(r.state_bytes))
    console.print()
    console.print(t)


def _print_ratios(console: Console, names: list[str], runs: list[list]) -> None:
    from ds4.bench import ratios

    base = names[0]
    t = Table(title=f"tokens/s relative to {base} (>1: faster)", title_justify="left",
              show_edge=False)
    t.add_column("context", justify="right")
    per = [ratios(runs[0], run) for run in runs[1:]]
    for name in names[1:]:
        t.add_column(f"prefill {name}/{base}", justify="right")
        t.add_column(f"gen {name}/{base}", justify="right")
        t.add_column("same probe", justify="center")
    for i, r0 in enumerate(per[0]):
        cells = [f"{r0.frontier:,}"]
        for rs in per:
            r = rs[i]
            cells += [f"{r.prefill:.2f}×", f"{r.gen:.2f}×", "yes" if r.same_probe else "no"]
        t.add_row(*cells)
    console.print()
    console.print(t)
