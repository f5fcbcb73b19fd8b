"""`ds4 pipe-worker` and the head side of `ds4 generate --split-next` (wire.md §1).

    ds4 pipe-worker 9001 3:5 -m model.gguf                    # the last stage
    ds4 pipe-worker 9000 1:3 -m model.gguf --next host:9001   # a middle stage
    ds4 generate -m model.gguf --split-next host:9000 --layers 0:1 -p "..."

cli/main.py registers the worker with `register(app)`; `generate` opens its engine with
`open_split_engine(...)` when --split-next is given and draws every token with the session's
`sample(n, params, rng, stop)` (the same loop, and the same tokens, for split and unsplit).
`python -m cli.pipe pipe-worker ...` runs the same command without cli/main.py.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ds4.core.atomic import signals_unwind
from ds4.wire.address import format_hostport

from .common import CLIError, bound_first, choose_backend, library_errors, resolve_model
from .options import BackendOption, CtxOption, ModelOption, NumericsOption, check_hostport, check_range
from .wire_options import (DEFAULT_IO_TIMEOUT, AuthTokenFileOption, AuthTokenOption, IoTimeoutOption, TlsCaOption,
                           TlsCertOption, TlsKeyOption, client_tls, server_tls, warn_exposed,
                           wire_token)

# ---- options generate can reuse ------------------------------------------------------------------

SplitNextOption = Annotated[Optional[str], typer.Option(
    "--split-next", metavar="HOST:PORT", show_default=False,
    help="Run only layers --layers 0:A here and the rest on the `ds4 pipe-worker` chain at "
         "HOST:PORT (an IPv6 host in brackets, [::1]:PORT).")]

LayersOption = Annotated[Optional[str], typer.Option(
    "--layers", metavar="0:A", show_default=False,
    help="With --split-next: the layers this head runs (it owns the embedding, so 0:A).")]

MaxConnsOption = Annotated[int, typer.Option(
    "--max-conns", metavar="N", callback=check_range(1, 1 << 16),
    help="Most client connections open at once; more are closed as soon as they connect.")]


def open_split_engine(model: Path | None, backend: str, numerics: str, split_next: str,
                      layers: str | None, *, ctx: int | None = None, slots: int = 1,
                      snapshots: int = 0, sampling=None, auth_token: str | None = None,
                      auth_token_file: Path | None = None, io_timeout: float = DEFAULT_IO_TIMEOUT,
                      tls_files: tuple = (None, None, None), connect: bool = True,
                      announce: bool = True):
    """The head of a pipeline split, for `generate --split-next HOST:PORT --layers 0:A`.

    Returns a `ds4.pipeline.SplitEngine` (`.session(ctx)`, `.tokenizer`, `.config`, `.close()`);
    its sessions have `sync`, `eval`, `tokens`, `sample(n, params, rng, stop)` and
    `next_token(params, rng)`. `sampling` (the command's SamplingParams) decides what the last
    stage returns after the prompt (its argmax, top-k candidates or the logits row), so pass the
    parameters the session will sample with. `connect` checks the chain now, so a refused
    hello is an error before the prompt is prefilled. Failures end the command with one
    `error:` line (exit code 1), like every other library error. The token comes from
    `auth_token_file`, else DS4_WIRE_TOKEN (`auth_token` is refused); `tls_files` is
    (--tls-cert, --tls-key, --tls-ca).
    """
    from ds4.pipeline import SplitEngine

    next_addr = check_hostport(split_next, "--split-next")
    with library_errors():
        if not layers:
            raise CLIError("--split-next needs --layers 0:A (the layers this head runs)")
        token = wire_token(auth_token, auth_token_file)
        tls = client_tls(*tls_files)
        path = resolve_model(model)
        backend = choose_backend(backend, announce)
        eng = SplitEngine.open(path, next_addr, layers, backend=backend, numerics=numerics,
                               slots=slots, snapshots=snapshots, sampling=sampling,
                               auth_token=token or "", ctx=ctx, io_timeout=io_timeout, tls=tls)
        if connect:
            eng.connect()
        return eng


def register(app: typer.Typer) -> None:
    app.command("pipe-worker")(pipe_worker)


def pipe_worker(
    port: Annotated[int, typer.Argument(
        metavar="PORT", callback=check_range(0, 65535),
        help="TCP port to listen on (0 picks a free one; the first stdout line says which).")],
    layers: Annotated[str, typer.Argument(
        metavar="A:B", help="The layers this stage serves, [A, B); B = the model's layer count "
                            "makes it the last stage, which also runs the output head.")],
    model: ModelOption = None,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
    slots: Annotated[int, typer.Option(
        "--slots", metavar="N", callback=check_range(1, 4096),
        help="Sequences this stage holds at once, in total over every head connected to it "
             "(each session takes one; a head beyond that is refused, not queued).")] = 1,
    ctx: CtxOption = 4096,
    snapshots: Annotated[int, typer.Option(
        "--snapshots", metavar="N", callback=check_range(0, 1 << 16),
        help="Snapshot entries for SAVE/LOAD (keep equal on every stage and the head).")] = 0,
    max_rows: Annotated[int, typer.Option(
        "--max-rows", metavar="N", callback=check_range(1),
        help="Most token rows in one frame (prefill chunk); at most --ctx.")] = 512,
    host: Annotated[str, typer.Option(
        "--host", help="Address to bind; 0.0.0.0 serves other machines.")] = "127.0.0.1",
    auth_token_file: AuthTokenFileOption = None,
    auth_token: AuthTokenOption = None,
    next_stage: Annotated[Optional[str], typer.Option(
        "--next", metavar="HOST:PORT", show_default=False,
        help="The next stage (required unless B is the model's layer count; an IPv6 host in "
             "brackets, [::1]:PORT).")] = None,
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    idle_timeout: Annotated[float, typer.Option(
        "--idle-timeout", metavar="SECONDS", callback=check_range(0.0, lo_open=True),
        help="Close a client connection that sends no frame for this long.")] = 3600.0,
    max_conns: MaxConnsOption = 64,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every connection.")] = False,
) -> None:
    """Serve layers A:B of a model as one pipeline stage (qkp6: wire.md §1 and ds4/wire/qkp.py)."""
    from ds4.pipeline import serve
    from ds4.pipeline.worker import listen

    next_addr = check_hostport(next_stage, "--next") if next_stage is not None else None
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="pipe-worker: %(message)s")
    with library_errors():
        token = wire_token(auth_token, auth_token_file)
        warn_exposed(host, token)
        # --tls-* secure both this stage's listener and its link to --next (same CA)
        tls_server = server_tls(tls_cert, tls_key, tls_ca)
        tls_client = client_tls(tls_cert, tls_key, tls_ca) if next_stage and tls_server else None
        path = resolve_model(model)
        backend = choose_backend(backend)
        with bound_first(lambda: listen(host, port), "PORT", "--host") as sock:
            worker = serve(path, layers, port=port, backend=backend, numerics=numerics, slots=slots,
                           ctx=ctx, snapshots=snapshots, max_rows=min(max_rows, ctx), host=host,
                           auth_token=token, next_addr=next_addr, io_timeout=io_timeout,
                           idle_timeout=idle_timeout, max_conns=max_conns, tls_server=tls_server,
                           tls_client=tls_client, sock=sock)
    st = worker.stage
    h = st.hello
    role = "last stage" if st.last else f"next {next_stage}"
    print(f"listening on {format_hostport(host, worker.port)} (layers {h.layer_first}:{h.layer_end} of "
          f"{h.n_layer}, {role}, {st.backend.name}, slots {h.n_slots}, ctx {h.n_ctx})", flush=True)

    # Ctrl-C exits 130 and SIGTERM / SIGHUP 128 + the signal (signals_unwind's Terminated), as
    # every other command does, each after the worker has stopped
    try:
        with signals_unwind():
            worker.serve_forever()
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        worker.stop()


def _standalone() -> typer.Typer:
    app = typer.Typer(add_completion=False, no_args_is_help=True)

    @app.callback()
    def _root() -> None:
        """ds4 pipeline commands (the same as `ds4 pipe-worker`)."""

    register(app)
    return app


if __name__ == "__main__":
    _standalone()()
