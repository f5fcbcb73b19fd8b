"""`ds4`: inspect DS4 GGUF models, write synthetic ones, generate text.

Each command parses its options, calls the `ds4` library and renders the result with rich.
Results go to stdout, progress and diagnostics to stderr. Expected failures (a missing or invalid
model, a bad value) end with one red `error:` line and exit code 1; a bad command line with exit
code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import typer
from typer.core import TyperGroup
from rich.table import Table
from rich.text import Text

from ds4.core.atomic import signals_unwind
from ds4.core.chat import DEFAULT_SYSTEM
from ds4.core.tiny import EXPERT_MIXES, PRESETS

from . import bench, chat, kv, pipe, serve, tp
from .pipe import LayersOption, SplitNextOption, open_split_engine
from .tp import (DEFAULT_GATE_TIMEOUT_MS, DEFAULT_TP_WAIT_S, DebugHashOption, GateTimeoutOption,
                 TpLeader, TpListenOption, TpTransportOption, TpWaitOption)
from .wire_options import (DEFAULT_IO_TIMEOUT, AuthTokenFileOption, AuthTokenOption, IoTimeoutOption, TlsCaOption,
                           TlsCertOption, TlsKeyOption)
from .common import (CLIError, rate, stream_reply, err, human_bytes, library_errors, open_engine, out, print_error,
                     print_field, progress_callback, prompt_text, resolve_model, check_prefill_cap)
from .options import (MAX_SEED, BackendOption, CtxOption, MinPOption, ModelArgument, ModelOption,
                      NoThinkOption, NumericsOption, PrefillCapOption, PromptOption, SeedOption, SystemOption,
                      TempOption, TokensOption, TopKOption, TopPOption, check_range)

try:  # typer >= 0.26 carries its own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException


class _Group(TyperGroup):
    """typer's group, except that a command-line error is one red line, not a panel."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            # SIGTERM / SIGHUP unwind like Ctrl-C, so no command leaves a temporary file behind
            with signals_unwind():
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as e:
            ctx = getattr(e, "ctx", None)
            message = e.format_message()
            if message.strip():  # (no command at all: the help was the answer, no error line)
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                print_error(message + hint)
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print(Text("aborted", style="red"))
            sys.exit(1)
        # Without standalone mode an Exit comes back as its code; a finished command as None.
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_Group,
    name="ds4",
    help="DeepSeek V4 Flash inference: inspect models, write synthetic ones, generate text.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

def _print_version(value: bool) -> None:
    if value:
        import ds4

        out.print(f"ds4 {ds4.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print ds4's version and exit.")] = False,
) -> None:
    """DeepSeek V4 Flash inference: inspect models, write synthetic ones, generate text."""


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
ExpertsName = Literal[tuple(EXPERT_MIXES)]  # type: ignore[valid-type]


# ---- inspect ------------------------------------------------------------------------------------

@app.command()
def inspect(model: ModelArgument = None) -> None:
    """Show a model's identity, hyperparameters, layer kinds and tensor census, and validate it."""
    from ds4.core.gguf_model import GGUFModel

    with library_errors():  # an invalid file's ModelError lists every problem, one per line
        m = GGUFModel(resolve_model(model))
    _render_model(m)


def _render_model(m) -> None:
    cfg = m.config
    out.print(Text("model", style="bold"))
    for key, value in (("file", str(m.path)),
                       ("size", f"{human_bytes(m.file_size)} ({m.file_size:,} bytes)"),
                       ("name", cfg.name or "(none)"),
                       ("fingerprint", m.fingerprint.hex()),
                       ("fingerprint64", f"{m.fingerprint64:#018x}")):
        print_field(key, value)

    hyper = Table(title="hyperparameters", title_justify="left", show_edge=False)
    hyper.add_column("parameter", style="cyan")
    hyper.add_column("value", justify="right")
    for f in dataclasses.fields(cfg):
        if f.name in ("compress_ratios", "swiglu_clamp", "name"):
            continue
        hyper.add_row(f.name, _fmt(getattr(cfg, f.name)))
    out.print()
    out.print(hyper)

    layers = Table(title=f"layers ({cfg.n_layer}; hash-routed: {_layer_list(cfg, True)})",
                   title_justify="left", show_edge=False)
    for col in ("layer", "compress ratio", "attention", "routing", "swiglu clamp"):
        layers.add_column(col, justify="right" if col in ("layer", "compress ratio") else "left")
    for il in range(cfg.n_layer):
        layers.add_row(str(il), str(cfg.ratio(il)), cfg.layer_kind(il),
                       "hash" if cfg.is_hash_layer(il) else f"top-{cfg.n_expert_used}",
                       _fmt(cfg.swiglu_clamp[il]))
    out.print()
    out.print(layers)

    census = m.census()
    total_n = sum(n for n, _ in census.values())
    total_b = sum(b for _, b in census.values())
    table = Table(title="tensors by type", title_justify="left", show_edge=False, show_footer=True)
    table.add_column("type", style="cyan", footer="total")
    table.add_column("tensors", justify="right", footer=str(total_n))
    table.add_column("bytes", justify="right", footer=f"{total_b:,}")
    table.add_column("share", justify="right", footer="100.0%" if total_b else "-")
    for name, (n, b) in sorted(census.items(), key=lambda kv: -kv[1][1]):
        table.add_row(name, str(n), f"{b:,}", f"{100 * b / total_b:.1f}%" if total_b else "-")
    out.print()
    out.print(table)
    out.print()
    out.print(Text(f"✓ valid DS4 layout ({total_n} tensors)", style="bold green"))


def _fmt(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _layer_list(cfg, hash_layers: bool) -> str:
    ils = [il for il in range(cfg.n_layer) if cfg.is_hash_layer(il) == hash_layers]
    if not ils:
        return "none"
    if ils == list(range(ils[0], ils[-1] + 1)) and len(ils) > 2:
        return f"{ils[0]}-{ils[-1]}"
    return ", ".join(map(str, ils))


# ---- make-tiny ----------------------------------------------------------------------------------

@app.command("make-tiny")
def make_tiny(
    out_path: Annotated[Path, typer.Argument(
        metavar="OUT.gguf", dir_okay=False, show_default=False,
        help="Where to write the model (written atomically; an existing file is replaced).")],
    preset: Annotated[PresetName, typer.Option(
        "--preset",
        help="tiny: the embedded default (real vocabulary, 6 layers); test: a small vocabulary "
             "and windows for fast tests; flash: the real DS4 Flash shapes (~87 GB).")] = "tiny",
    experts: Annotated[ExpertsName, typer.Option(
        "--experts",
        help="Block format of the routed experts: q2 (IQ2_XXS gate/up, Q2_K down, as DS4 Flash "
             "ships), q4 (Q4_K), q8 (Q8_0), f16, f32.")] = "q2",
    seed: Annotated[int, typer.Option(
        "--seed", "-s", callback=check_range(0, MAX_SEED),
        help="Seed of the random weights; the same arguments give a byte-identical file.")] = 0,
    yes: Annotated[bool, typer.Option(
        "--yes", "-y", help="Confirm writing a very large model (required for --preset flash).")] = False,
) -> None:
    """Write a synthetic DS4-layout GGUF with random weights (for tests, examples, benchmarks)."""
    from ds4.core import tiny
    from ds4.core.gguf_model import GGUFModel

    with library_errors():
        need = _estimated_bytes(preset, experts)
        if preset == "flash" or need > (8 << 30):
            err.print(Text(f"warning: --preset {preset} writes a file of about "
                           f"{human_bytes(need)} of random weights", style="yellow"), soft_wrap=True)
            if not yes:
                raise CLIError(f"not writing {out_path}: pass --yes to confirm the "
                               f"{human_bytes(need)} file")
        parent = out_path.resolve().parent
        probe = parent if parent.exists() else next(p for p in parent.parents if p.exists())
        free = shutil.disk_usage(probe).free
        if need > free:
            raise CLIError(f"not enough disk space for {out_path}: about {human_bytes(need)} "
                           f"needed, {human_bytes(free)} free")
        with progress_callback(f"writing {out_path.name} ({preset}, {experts} experts)") as cb:
            tiny.make_tiny(out_path, preset=preset, experts=experts, seed=seed, progress=cb)
        m = GGUFModel(out_path)
    out.print(Text.assemble(("wrote ", "green"), (str(out_path), "bold")), soft_wrap=True)
    print_field("size", f"{human_bytes(m.file_size)} ({m.file_size:,} bytes)", 12)
    print_field("fingerprint", m.fingerprint.hex(), 12)


def _estimated_bytes(preset: str, experts: str) -> int:
    """Tensor bytes `make_tiny` will write (metadata and vocabulary are a few MB on top)."""
    from ds4.core.layout import expected_tensors
    from ds4.core.quants import row_bytes
    from ds4.core.tiny import preset_config

    gate_type, down_type = EXPERT_MIXES[experts]
    total = 0
    for spec in expected_tensors(preset_config(preset)).values():
        ttype = spec.shipped
        if spec.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            ttype = gate_type
        elif spec.name.endswith("ffn_down_exps.weight"):
            ttype = down_type
        rows = 1
        for d in spec.dims[1:]:
            rows *= d
        total += row_bytes(ttype, spec.dims[0]) * rows
    return total


# ---- generate -----------------------------------------------------------------------------------

@app.command()
def generate(
    prompt: PromptOption,
    model: ModelOption = None,
    n: TokensOption = 64,
    temp: TempOption = 1.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    min_p: MinPOption = 0.05,
    seed: SeedOption = None,
    nothink: NoThinkOption = False,
    system: SystemOption = DEFAULT_SYSTEM,
    ctx: CtxOption = 4096,
    prefill_cap: PrefillCapOption = None,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
    split_next: SplitNextOption = None,
    layers: LayersOption = None,
    auth_token_file: AuthTokenFileOption = None,
    auth_token: AuthTokenOption = None,
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
    tp_listen: TpListenOption = None,
    tp_transport: TpTransportOption = "tcp",
    gate_timeout_ms: GateTimeoutOption = DEFAULT_GATE_TIMEOUT_MS,
    debug_hash: DebugHashOption = False,
    tp_wait: TpWaitOption = DEFAULT_TP_WAIT_S,
) -> None:
    """Generate a reply to one prompt, streaming the text to stdout (stats go to stderr).

    With --split-next HOST:PORT --layers 0:A this process runs layers [0, A) and the
    `ds4 pipe-worker` chain at HOST:PORT runs the rest (token-identical to an unsplit run).
    With --tp-listen HOST:PORT it is rank 0 of a tensor-parallel pair with a `ds4 tp-worker`.
    """
    from ds4.core.sampling import Rng, SamplingParams

    prompt = prompt_text(prompt)
    with contextlib.suppress(AttributeError, ValueError):  # any text must reach a non-UTF-8 stdout
        sys.stdout.reconfigure(errors="replace")
    if seed is None:
        seed = time.time_ns() & MAX_SEED
    with library_errors():
        check_prefill_cap(prefill_cap, ctx)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    rng = Rng(seed)

    tp = TpLeader.of(tp_listen, tp_transport, gate_timeout_ms, debug_hash, tp_wait)
    if split_next and tp:
        with library_errors():
            raise CLIError("--split-next and --tp-listen do not combine: choose one split")
    if split_next:
        eng = open_split_engine(model, backend, numerics, split_next, layers, ctx=ctx,
                                sampling=params, auth_token=auth_token,
                                auth_token_file=auth_token_file, io_timeout=io_timeout,
                                tls_files=(tls_cert, tls_key, tls_ca), announce=False)
    elif tp:
        eng = tp.open(model, backend, numerics, ctx=ctx, auth_token=auth_token, auth_token_file=auth_token_file,
                      io_timeout=io_timeout, tls_files=(tls_cert, tls_key, tls_ca), announce=False)
    elif layers:
        with library_errors():
            raise CLIError("--layers is only used with --split-next")
    else:
        eng = open_engine(model, backend, numerics, announce=False)
    try:
        _generate(eng, prompt, n, params, rng, seed, nothink, system, ctx, prefill_cap,
                  backend_note=f"backend {eng.backend.name} (auto)" if backend == "auto" else None)
    finally:
        close = getattr(eng, "close", None)
        if close:
            close()


def _generate(eng, prompt, n, params, rng, seed, nothink, system, ctx, prefill_cap=None, backend_note=None) -> None:
    from ds4.core.chat import encode_prompt

    with library_errors():
        tok = eng.tokenizer  # (the vocabulary is read here, on first use)
        if ctx > eng.config.context_length:
            raise CLIError(f"--ctx {ctx} is more than the model's context_length "
                           f"{eng.config.context_length}")
        ids = encode_prompt(tok, prompt, system=system or None, think=not nothink)
        if len(ids) >= ctx:
            raise CLIError(f"the prompt has {len(ids)} tokens, which leaves no room in "
                           f"--ctx {ctx}; raise --ctx")
        session = eng.session(ctx=ctx, prefill_cap=prefill_cap)
        with err.status(f"prefilling {len(ids)} prompt tokens ..."):
            t0 = time.perf_counter()
            session.sync(ids)
            t_prefill = time.perf_counter() - t0

    generated, stop, t_gen = stream_reply(session, tok, n, params, rng)
    stats = (f"prompt: {len(ids)} tokens, {rate(len(ids), t_prefill)} · "
             f"generated: {generated} tokens, {rate(generated, t_gen)}")
    if params.temperature > 0:
        stats += f" · seed {seed}"
    if backend_note:  # `--backend auto` says what it chose, once, on the stats line
        stats += f" · {backend_note}"
    err.print(Text(stats, style="dim"), soft_wrap=True)
    if stop == "interrupted":
        raise typer.Exit(130)


# Commands that live in their own modules (KV handoff, pipeline, bench).
kv.register(app)
pipe.register(app)
tp.register(app)
bench.register(app)
serve.register(app)
chat.register(app)


def main() -> None:
    """Console-script entry point (`ds4`)."""
    app()


if __name__ == "__main__":
    main()
