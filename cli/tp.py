"""`ds4 tp-worker` and the leader side of `--tp-listen` (tensor parallel, wire.md §2).

    ds4 generate -m model.gguf --tp-listen 127.0.0.1:9300 -p "..."      # rank 0: waits for ...
    ds4 tp-worker -m model.gguf --leader 127.0.0.1:9300                  # ... rank 1

The leader holds experts [0, E/2), the first half of the heads and of the vocabulary and the
shared expert; the worker the other halves (ds4/core/tp_split.py). generate, prefill, decode,
bench and serve take `--tp-listen` and open their pair with `TpLeader.open`; the session
they get behaves like a one-rank session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ds4.wire.address import format_hostport

from .common import CLIError, bound_first, choose_backend, err, library_errors, resolve_model
from .options import BackendOption, ModelOption, NumericsOption, check_hostport, check_range
from .wire_options import (DEFAULT_IO_TIMEOUT, AuthTokenFileOption, AuthTokenOption, IoTimeoutOption, TlsCaOption,
                           TlsCertOption, TlsKeyOption, client_tls, server_tls, warn_exposed,
                           wire_token)

DEFAULT_GATE_TIMEOUT_MS = 750
DEFAULT_TP_WAIT_S = 300.0

# ---- options the leader commands share ---------------------------------------------------------

TpListenOption = Annotated[Optional[str], typer.Option(
    "--tp-listen", metavar="HOST:PORT", show_default=False, rich_help_panel="Tensor parallel",
    help="Run as rank 0 of a tensor-parallel pair: listen on HOST:PORT and wait for a "
         "`ds4 tp-worker --leader HOST:PORT`, which holds the other half of the experts, heads "
         "and vocabulary. Port 0 picks a free one (the wait line says which).")]

TpTransportOption = Annotated[str, typer.Option(
    "--tp-transport", metavar="tcp|nccl|gloo", rich_help_panel="Tensor parallel",
    help="How the per-layer partial sums travel: tcp (DS4T gate records, any two machines), "
         "nccl (torch.distributed between two GPU processes of one host) or gloo (the same "
         "between CPU processes). Both ranks must use the same one.")]

GateTimeoutOption = Annotated[int, typer.Option(
    "--gate-timeout-ms", metavar="MS", callback=check_range(1, 3_600_000),
    rich_help_panel="Tensor parallel",
    help="Longest wait for the other rank at one gate; past it the command fails naming the "
         "phase instead of hanging.")]

DebugHashOption = Annotated[bool, typer.Option(
    "--debug-hash", rich_help_panel="Tensor parallel",
    help="Compare a hash of both ranks' hidden state after every layer and step; fail on the "
         "first difference, naming the layer and step.")]

TpWaitOption = Annotated[float, typer.Option(
    "--tp-wait", metavar="SECONDS", callback=check_range(0.0, lo_open=True),
    rich_help_panel="Tensor parallel",
    help="How long the leader waits for its worker to join.")]


@dataclass(frozen=True)
class TpLeader:
    """What a leader command's --tp-* options ask for (`of` gives None without --tp-listen), so
    that generate, prefill, decode, bench and serve open their pair one way."""

    listen: str
    transport: str = "tcp"
    gate_timeout_ms: int = DEFAULT_GATE_TIMEOUT_MS
    debug_hash: bool = False
    wait_s: float = DEFAULT_TP_WAIT_S

    @classmethod
    def of(cls, listen: str | None, transport: str, gate_timeout_ms: int, debug_hash: bool,
           wait_s: float) -> "TpLeader | None":
        return cls(listen, transport, gate_timeout_ms, debug_hash, wait_s) if listen else None

    def open(self, model: Path | None, backend: str, numerics: str, *, ctx: int, **wire):
        """open_tp_engine with these options; wire: the auth, TLS, io_timeout and announce ones."""
        return open_tp_engine(model, backend, numerics, self.listen, ctx=ctx, transport=self.transport,
                              gate_timeout_ms=self.gate_timeout_ms, debug_hash=self.debug_hash,
                              wait_s=self.wait_s, **wire)


def open_tp_engine(model: Path | None, backend: str, numerics: str, listen: str, *, ctx: int,
                   transport: str = "tcp", gate_timeout_ms: int = DEFAULT_GATE_TIMEOUT_MS,
                   debug_hash: bool = False, wait_s: float = DEFAULT_TP_WAIT_S,
                   auth_token: str | None = None, auth_token_file: Path | None = None,
                   io_timeout: float = DEFAULT_IO_TIMEOUT, tls_files: tuple = (None, None, None),
                   announce: bool = True):
    """The leader's engine (`ds4.tp.TPEngine`), once its worker has joined: a visible wait line,
    a timeout, and one `error:` line for any failure (a refused hello names the field)."""
    from ds4.tp import TPEngine
    from ds4.tp.link import Options, listen as tp_listen

    with library_errors():
        # (port 0: a free port, which the wait line names, as every other listener takes it)
        addr = check_hostport(listen, "--tp-listen", any_port=True)
        token = wire_token(auth_token, auth_token_file)
        warn_exposed(addr[0], token)
        opts = Options(transport=transport, auth_token=token, tls=server_tls(*tls_files),
                       gate_timeout_ms=gate_timeout_ms, io_timeout=io_timeout, debug_hash=debug_hash)
        path = resolve_model(model)
        backend = choose_backend(backend, announce)

        def waiting(where):
            err.print(Text(f"tensor parallel: rank 0 ({backend}) waiting up to {wait_s:g} s for "
                           f"`ds4 tp-worker --leader {format_hostport(*where)}` ...", style="dim"),
                      soft_wrap=True)

        with bound_first(lambda: tp_listen(*addr), "--tp-listen") as listener:
            eng = TPEngine.open(path, addr, backend=backend, numerics=numerics, ctx=ctx, opts=opts,
                                wait_s=wait_s, on_wait=waiting, listener=listener)
        peer = eng.pair.peer
        err.print(Text(f"tensor parallel: worker joined ({peer.backend.name.lower()} backend, "
                       f"{transport})", style="dim"), soft_wrap=True)
        return eng


# ---- the worker ---------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    app.command("tp-worker")(tp_worker)


def tp_worker(
    leader: Annotated[str, typer.Option(
        "--leader", metavar="HOST:PORT", show_default=False,
        help="The leader's --tp-listen address.")],
    model: ModelOption = None,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
    transport: TpTransportOption = "tcp",
    gate_timeout_ms: GateTimeoutOption = DEFAULT_GATE_TIMEOUT_MS,
    rejoin: Annotated[bool, typer.Option(
        "--rejoin/--once",
        help="After the leader stops or the pair fails, join the leader again (a leader that "
             "stays up, like `ds4 serve`, gets its worker back); --once exits instead.")] = False,
    connect_timeout: Annotated[float, typer.Option(
        "--connect-timeout", metavar="SECONDS", callback=check_range(0.0, lo_open=True),
        help="How long to keep trying to reach the leader.")] = 60.0,
    auth_token_file: AuthTokenFileOption = None,
    auth_token: AuthTokenOption = None,
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
) -> None:
    """Run rank 1 of a tensor-parallel pair for the leader at --leader (its --tp-listen).

    Binds the second half of the routed experts, attention heads and vocabulary (and everything
    replicated), joins the leader, and runs every command it mirrors until it stops.
    """
    import time

    from ds4.tp import TPClosed, TPError, TPRefused, TPWorker
    from ds4.tp.link import Options
    from ds4.tp.rank import open_rank
    from ds4.tp.worker import WORKER_RANK

    with library_errors():
        addr = check_hostport(leader, "--leader")
        token = wire_token(auth_token, auth_token_file)
        opts = Options(transport=transport, auth_token=token, tls=client_tls(tls_cert, tls_key, tls_ca),
                       gate_timeout_ms=gate_timeout_ms, io_timeout=io_timeout)
        path = resolve_model(model)
        backend = choose_backend(backend)
        engine = open_rank(path, WORKER_RANK, backend, numerics)
    while True:
        with library_errors():
            deadline = time.monotonic() + connect_timeout
            while True:
                try:
                    worker = TPWorker.open(path, addr, opts=opts, engine=engine)
                    break
                except TPRefused:
                    raise
                except TPError as e:
                    # (a leader not listening yet, or one that closed the connection before the
                    # handshake ended, e.g. for a newer one while strangers kept it busy)
                    if time.monotonic() > deadline or not isinstance(e, TPClosed):
                        raise
                    time.sleep(0.2)
            err.print(Text(f"tensor parallel: rank 1 ({backend}) joined the leader at {leader}",
                           style="dim"), soft_wrap=True)
            try:
                worker.serve()
                err.print(Text("tensor parallel: the leader stopped", style="dim"), soft_wrap=True)
            except TPError as e:
                if not rejoin:
                    raise CLIError(str(e)) from None
                err.print(Text(f"tensor parallel: {e}; joining again", style="yellow"), soft_wrap=True)
        if not rejoin:
            return
