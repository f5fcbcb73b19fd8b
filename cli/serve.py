"""`ds4 serve`: the OpenAI- and Anthropic-compatible HTTP head (ds4/serve/).

    ds4 serve -m model.gguf                       # http://127.0.0.1:8000/v1
    ds4 serve -m model.gguf --split-next host:9000 --layers 0:20   # the head of a pipeline

The first stdout line says where it listens (`listening on http://HOST:PORT`), so --port 0
(a free port) can be used by scripts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ds4.serve import DEFAULT_MAX_BODY
from ds4.wire.address import listen_socket

from .common import CLIError, check_prefill_cap, err, library_errors, listen_errors, open_engine
from .options import BackendOption, CtxOption, ModelOption, NumericsOption, PrefillCapOption, check_range
from .pipe import LayersOption, SplitNextOption, open_split_engine
from .tp import (DEFAULT_GATE_TIMEOUT_MS, DEFAULT_TP_WAIT_S, DebugHashOption, GateTimeoutOption,
                 TpLeader, TpListenOption, TpTransportOption, TpWaitOption)
from .wire_options import (DEFAULT_IO_TIMEOUT, AuthTokenFileOption, AuthTokenOption, IoTimeoutOption, TlsCaOption,
                           TlsCertOption, TlsKeyOption)

API_KEY_ENV = "DS4_API_KEY"
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 16
LISTEN_BACKLOG = 128  # connections the kernel holds before uvicorn accepts them
SHUTDOWN_GRACE_S = 5  # how long open streams may run on after Ctrl-C / SIGTERM


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def read_api_key(path: Path | None) -> str | None:
    """The key from --api-key-file (its first line), else from DS4_API_KEY, else None."""
    if path is not None:
        try:
            key = path.read_text(encoding="utf-8").strip().splitlines()
        except OSError as e:
            raise CLIError(f"--api-key-file {path}: {e.strerror or e}") from None
        if not key or not key[0].strip():
            raise CLIError(f"--api-key-file {path}: the file is empty")
        return key[0].strip()
    key = os.environ.get(API_KEY_ENV, "").strip()
    return key or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, key: str | None) -> str | None:
    """What to warn about before serving on `host` with this key (None: nothing)."""
    if is_loopback(host) or key is not None:
        return None
    return (f"serving on {host} without an API key: anyone who can reach this port can use the "
            f"model (--api-key-file or {API_KEY_ENV})")


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket (a failure: `--port: cannot listen on HOST:PORT: reason`,
    or --host's where the host is at fault)."""
    with listen_errors("--port", "--host"):
        sock = listen_socket(host, port, LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def serve(
    model: ModelOption = None,
    host: Annotated[str, typer.Option(
        "--host", help="Address to bind; anything but loopback serves other machines (set an "
                       "API key then).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", callback=check_range(0, 65535),
        help="TCP port (0 picks a free one; the first stdout line says which).")] = DEFAULT_PORT,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
    ctx: CtxOption = 4096,
    prefill_cap: PrefillCapOption = None,
    queue: Annotated[int, typer.Option(
        "--queue", metavar="N", callback=check_range(0, 1 << 16),
        help="Requests that may wait while one generates; more get 429 with Retry-After.")] = DEFAULT_QUEUE,
    api_key_file: Annotated[Optional[Path], typer.Option(
        "--api-key-file", metavar="FILE", dir_okay=False, show_default=False,
        help=f"Require this key (the file's first line) as 'Authorization: Bearer KEY' or "
             f"'x-api-key: KEY'; {API_KEY_ENV} sets it too.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(
        "--max-tokens-limit", metavar="N", callback=check_range(1), show_default="--ctx",
        help="Largest max_tokens a request may ask for (400 above it; a max_tokens past --ctx "
             "with the prompt's tokens is a 400 too).")] = None,
    max_body: Annotated[int, typer.Option(
        "--max-body", metavar="BYTES", callback=check_range(1024),
        help="Largest request body (413 above it).")] = DEFAULT_MAX_BODY,
    model_id: Annotated[Optional[str], typer.Option(
        "--model-id", metavar="NAME", show_default="the model file's name; ds4-default for the embedded model",
        help="The model name /v1/models lists; a reply carries the request's model, or this one "
             "where the request names none.")] = None,
    snapshots: Annotated[bool, typer.Option(
        "--prompt-snapshots/--no-prompt-snapshots",
        help="Keep a host copy of the session at each prompt (less its last token), so that a "
             "history that resends the prompt but not the reply as generated (think-mode chats, "
             "stop strings, edited replies) still reuses it; costs one state copy per prompt.")] = True,
    split_next: SplitNextOption = None,
    layers: LayersOption = None,
    auth_token: AuthTokenOption = None,
    auth_token_file: AuthTokenFileOption = None,
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request.")] = False,
    tp_listen: TpListenOption = None,
    tp_transport: TpTransportOption = "tcp",
    gate_timeout_ms: GateTimeoutOption = DEFAULT_GATE_TIMEOUT_MS,
    debug_hash: DebugHashOption = False,
    tp_wait: TpWaitOption = DEFAULT_TP_WAIT_S,
) -> None:
    """Serve the model over HTTP: the OpenAI API (/v1/chat/completions, /v1/completions,
    /v1/models) and the Anthropic API (/v1/messages, /v1/messages/count_tokens), streaming as
    server-sent events, plus /health and /metrics (Prometheus).

    One generation runs at a time; the session is kept between requests, so a chat or an agent
    that resends its history prefills only the new part (reported as cached tokens).
    """
    import uvicorn

    from ds4.serve.app import create_app
    from ds4.serve.driver import Driver

    with library_errors():
        check_prefill_cap(prefill_cap, ctx)
        key = read_api_key(api_key_file)
        warning = exposure_warning(host, key)
        if warning:
            err.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)
        sock = bind(host, port)
        tp = TpLeader.of(tp_listen, tp_transport, gate_timeout_ms, debug_hash, tp_wait)
        if split_next and tp:
            raise CLIError("--split-next and --tp-listen do not combine: choose one split")
        if split_next:
            eng = open_split_engine(model, backend, numerics, split_next, layers, ctx=ctx,
                                    auth_token=auth_token, auth_token_file=auth_token_file,
                                    io_timeout=io_timeout, tls_files=(tls_cert, tls_key, tls_ca))
        elif tp:
            # (a worker that dies is an error on the request under way, and then 503 on /health
            # and on every request until a `ds4 tp-worker --rejoin` is back; --tp-wait is the
            # wait for the first worker only)
            eng = tp.open(model, backend, numerics, ctx=ctx, auth_token=auth_token, auth_token_file=auth_token_file,
                          io_timeout=io_timeout, tls_files=(tls_cert, tls_key, tls_ca))
        elif layers:
            raise CLIError("--layers is only used with --split-next")
        else:
            eng = open_engine(model, backend, numerics)
        if ctx > eng.config.context_length:
            raise CLIError(f"--ctx {ctx} is more than the model's context_length "
                           f"{eng.config.context_length}")
        name = model_id or (model.stem if model is not None else "ds4-default")
        driver = Driver(eng, ctx=ctx, queue_size=queue, snapshots=snapshots, prefill_cap=prefill_cap)
    app = create_app(driver, model_id=name, max_tokens_limit=max_tokens or ctx, api_key=key,
                     max_body=max_body)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    print(f"listening on http://{shown}:{actual} (model {name}, ctx {ctx}, queue {queue})", flush=True)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    try:
        _run_server(config, sock, driver.stop_all)
    finally:
        driver.close()


def _run_server(config, sock: socket.socket, on_exit) -> None:
    """uvicorn's server, calling on_exit first on Ctrl-C / SIGTERM: the driver then ends open
    streams with an error event (their clients know the reply is cut) within the grace period,
    instead of uvicorn closing them mid-reply when the period runs out."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_exit()
            super().handle_exit(sig, frame)

    Server(config).run(sockets=[sock])
