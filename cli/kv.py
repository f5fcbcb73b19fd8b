"""KV handoff commands: `ds4 prefill`, `ds4 decode`, `ds4 kv-send`, `ds4 kv-recv`.

A prefill node evaluates the prompt and writes (or sends) the DSV4 session payload; a decode node
loads (or receives) it and continues from the saved next-token logits, without re-evaluating
anything. Transfers use DS4K (wire.md §3). `register(app)` adds the four commands to a typer app.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ds4.core.chat import DEFAULT_SYSTEM
from ds4.wire.address import LOOPBACK, format_hostport

from .tp import (DEFAULT_GATE_TIMEOUT_MS, DEFAULT_TP_WAIT_S, DebugHashOption, GateTimeoutOption,
                 TpLeader, TpListenOption, TpTransportOption, TpWaitOption)
from .common import (CLIError, check_output, check_prefill_cap, err, human_bytes, library_errors,
                     listen_errors, open_engine, out, output_file, prompt_file_text, prompt_text, rate,
                     resolve_model, stream_reply)
from .wire_options import (DEFAULT_IO_TIMEOUT, AuthTokenFileOption, AuthTokenOption, IoTimeoutOption,
                           TlsCaOption, TlsCertOption, TlsKeyOption, client_tls, server_tls, warn,
                           warn_exposed, wire_token)
from .options import (MAX_SEED, PROMPT_HELP, BackendOption, CtxOption, MinPOption, ModelOption, NoThinkOption,
                      NumericsOption, PrefillCapOption, SeedOption, SystemOption, TempOption, TokensOption,
                      TopKOption, TopPOption, check_hostport, check_range)

KV_TEMP_PREFIX = "ds4-kv-"  # a received or to-be-sent payload waits in such a temporary directory

# ---- options ------------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_size(value: str, option: str = "--max-kv-bytes") -> int:
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS else ""
    number = text[: len(text) - len(unit)]
    try:
        n = int(float(number) * _SIZE_UNITS[unit])
    except (ValueError, OverflowError):  # (OverflowError: inf)
        raise typer.BadParameter(f"expected a size such as 4294967296, 512M or 16G, got {value!r}",
                                 param_hint=f"'{option}'") from None
    if n <= 0:
        raise typer.BadParameter(f"expected a positive size, got {value!r}", param_hint=f"'{option}'")
    return n


WaitOption = Annotated[Optional[float], typer.Option(
    "--wait", metavar="SECONDS", callback=check_range(0.0, lo_open=True), show_default="no limit",
    help="Give up when no payload has landed after this long. A bad, refused or slow sender is "
         "logged and dropped; the receiver keeps waiting for another until then.")]

HostOption = Annotated[str, typer.Option(
    "--host", metavar="ADDR",
    help="Address to listen on; the default accepts local senders only (0.0.0.0: any).")]

MaxKvBytesOption = Annotated[str, typer.Option(
    "--max-kv-bytes", metavar="SIZE",
    help="Refuse payloads larger than this (bytes, or with a K/M/G/T suffix).")]

ListenPort = Annotated[int, typer.Argument(
    metavar="PORT", callback=check_range(0, 65535), show_default=False,
    help="TCP port to listen on (0: any free port, printed on stderr).")]


# ---- prefill ------------------------------------------------------------------------------------

def prefill(
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", "-p", metavar="TEXT", show_default=False, help=PROMPT_HELP)] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", metavar="FILE", exists=True, dir_okay=False, readable=True, show_default=False,
        help="Read the user message from FILE: UTF-8, byte for byte (a trailing newline or a "
             "\\r\\n stays in the message).")] = None,
    save_kv: Annotated[Optional[str], typer.Option(  # (str: Path would drop a trailing "/")
        "--save-kv", metavar="FILE", show_default=False,
        help="Write the session payload to FILE (atomically).")] = None,
    send_kv: Annotated[Optional[str], typer.Option(
        "--send-kv", metavar="HOST:PORT", show_default=False,
        help="Send the session payload to a `ds4 decode --recv-kv` or `ds4 kv-recv` there "
             "(:PORT: on this machine; an IPv6 host in brackets, [::1]:PORT).")] = None,
    model: ModelOption = None,
    nothink: NoThinkOption = False,
    system: SystemOption = DEFAULT_SYSTEM,
    ctx: CtxOption = 4096,
    prefill_cap: PrefillCapOption = None,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
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
    """Prefill a prompt (no generation) and save or send the session for another node to decode.

    With --tp-listen HOST:PORT the prefill runs on a tensor-parallel pair (this process and a
    `ds4 tp-worker`); the payload is the same as one rank's and any node decodes it."""
    from ds4.core.chat import encode_prompt

    if (prompt is None) == (prompt_file is None):
        raise typer.BadParameter("give exactly one of --prompt and --prompt-file",
                                 param_hint="'--prompt' / '--prompt-file'")
    if (save_kv is None) == (send_kv is None):
        raise typer.BadParameter("give exactly one of --save-kv and --send-kv",
                                 param_hint="'--save-kv' / '--send-kv'")
    dest = check_hostport(send_kv, "--send-kv", default_host=LOOPBACK) if send_kv is not None else None
    with library_errors():
        check_prefill_cap(prefill_cap, ctx)
        prompt = prompt_file_text(prompt_file) if prompt_file is not None else prompt_text(prompt)
        token = wire_token(auth_token, auth_token_file) if send_kv is not None else None
        tls = client_tls(tls_cert, tls_key, tls_ca) if send_kv is not None else None
        # Where the payload goes is checked before the prefill, not after it: a directory that
        # is missing or may not be written; the probe runs the same hello and mutual proof as
        # the transfer, so a dead host, a listener that is not a DS4K receiver and a token
        # mismatch all fail here.
        if save_kv is not None:
            save_kv = output_file(save_kv, "--save-kv")
        if dest is not None:
            from ds4.wire.ds4k import probe_receiver

            probe_receiver(*dest, auth_token=token, timeout=io_timeout, tls=tls)
    tp = TpLeader.of(tp_listen, tp_transport, gate_timeout_ms, debug_hash, tp_wait)
    # The leader is a TLS server, --send-kv a client: --tls-ca alone (trust the receiver) leaves
    # the pair's link plain; with --tls-cert/--tls-key both use them (and --tls-ca also asks the
    # worker for a certificate).
    tp_tls = (tls_cert, tls_key, tls_ca) if tls_cert is not None or tls_key is not None else (None,) * 3
    eng = (tp.open(model, backend, numerics, ctx=ctx, auth_token=auth_token, auth_token_file=auth_token_file,
                   io_timeout=io_timeout, tls_files=tp_tls)
           if tp else open_engine(model, backend, numerics))
    with library_errors():
        if save_kv is not None:
            check_output(save_kv, "--save-kv", getattr(eng.model, "path", None))
        if ctx > eng.config.context_length:
            raise CLIError(f"--ctx {ctx} is more than the model's context_length "
                           f"{eng.config.context_length}")
        ids = encode_prompt(eng.tokenizer, prompt, system=system or None, think=not nothink)
        if len(ids) >= ctx:
            raise CLIError(f"the prompt has {len(ids)} tokens, which leaves no room in "
                           f"--ctx {ctx}; raise --ctx")
        session = eng.session(ctx=ctx, prefill_cap=prefill_cap)
        with err.status(f"prefilling {len(ids)} prompt tokens ..."):
            t0 = time.perf_counter()
            session.sync(ids)
            t_prefill = time.perf_counter() - t0
        if save_kv is not None:
            size = session.save_payload(save_kv)
            out.print(Text("saved ", style="green") + Text(str(save_kv), style="bold")
                      + Text(f" ({len(ids)} tokens, {human_bytes(size)}, {size:,} bytes)"),
                      soft_wrap=True)
        else:
            from ds4.core.atomic import temp_dir
            from ds4.wire.ds4k import PROBE_CONNECT_TIMEOUT, send_payload

            with temp_dir(KV_TEMP_PREFIX) as tmp:
                path = tmp / "session.dsv4"
                size = session.save_payload(path)
                with err.status(f"sending {human_bytes(size)} to {send_kv} ..."):
                    t0 = time.perf_counter()
                    # the probe found the receiver: a refused connection now is not a slow start
                    send_payload(path, *dest, fingerprint=eng.model.fingerprint,
                                 auth_token=token, timeout=io_timeout, tls=tls,
                                 connect_timeout=PROBE_CONNECT_TIMEOUT)
                    t_send = time.perf_counter() - t0
            out.print(Text("sent ", style="green") + Text(send_kv, style="bold")
                      + Text(f" ({len(ids)} tokens, {human_bytes(size)}, {size:,} bytes, "
                             f"{_mbps(size, t_send)})"), soft_wrap=True)
    err.print(Text(f"prompt: {len(ids)} tokens, {rate(len(ids), t_prefill)} · payload: "
                   f"{size / len(ids):,.0f} bytes/token", style="dim"), soft_wrap=True)


# ---- decode -------------------------------------------------------------------------------------

def decode(
    load_kv: Annotated[Optional[Path], typer.Option(
        "--load-kv", metavar="FILE", dir_okay=False, show_default=False,
        help="Continue the session saved in FILE (by `ds4 prefill --save-kv`).")] = None,
    recv_kv: Annotated[Optional[int], typer.Option(
        "--recv-kv", metavar="PORT", callback=check_range(0, 65535), show_default=False,
        help="Wait for a session on this TCP port (from `ds4 prefill --send-kv` or `ds4 kv-send`; "
             "0: any free port, printed on stderr), then continue it.")] = None,
    n: TokensOption = 64,
    temp: TempOption = 1.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    min_p: MinPOption = 0.05,
    seed: SeedOption = None,
    model: ModelOption = None,
    ctx: Annotated[Optional[int], typer.Option(
        "--ctx", "-c", metavar="TOKENS", callback=check_range(2), show_default="the saved ctx",
        help="Session context size; at least the saved one.")] = None,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
    host: HostOption = "127.0.0.1",
    auth_token_file: AuthTokenFileOption = None,
    auth_token: AuthTokenOption = None,
    max_kv_bytes: MaxKvBytesOption = "16G",
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    wait: WaitOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
    tp_listen: TpListenOption = None,
    tp_transport: TpTransportOption = "tcp",
    gate_timeout_ms: GateTimeoutOption = DEFAULT_GATE_TIMEOUT_MS,
    debug_hash: DebugHashOption = False,
    tp_wait: TpWaitOption = DEFAULT_TP_WAIT_S,
) -> None:
    """Continue a prefilled session (from a file or the network), streaming the text to stdout.

    With --tp-listen HOST:PORT the decode runs on a tensor-parallel pair (this process and a
    `ds4 tp-worker`, which gets the loaded session's state over the pair's control connection)."""
    from ds4.core.payload import check_payload
    from ds4.core.sampling import Rng, SamplingParams

    if (load_kv is None) == (recv_kv is None):
        raise typer.BadParameter("give exactly one of --load-kv and --recv-kv",
                                 param_hint="'--load-kv' / '--recv-kv'")
    limit = _parse_size(max_kv_bytes)
    with contextlib.suppress(AttributeError, ValueError):  # any text must reach a non-UTF-8 stdout
        sys.stdout.reconfigure(errors="replace")
    if seed is None:
        seed = time.time_ns() & MAX_SEED
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    rng = Rng(seed)

    with library_errors():
        token = wire_token(auth_token, auth_token_file) if recv_kv is not None else None
        tls = server_tls(tls_cert, tls_key, tls_ca) if recv_kv is not None else None
        # bound before the model is loaded (minutes for a large one): a port in use says so at once
        recv_sock = None
        if recv_kv is not None:
            from ds4.wire.ds4k.receiver import listen

            with listen_errors("--recv-kv", "--host"):
                recv_sock = listen(host, recv_kv)
    # (closed on every way out; the Receiver owns it once it is made)
    with recv_sock if recv_sock is not None else contextlib.nullcontext():
        tp = TpLeader.of(tp_listen, tp_transport, gate_timeout_ms, debug_hash, tp_wait)
        eng = (tp.open(model, backend, numerics, ctx=ctx, auth_token=auth_token,
                       auth_token_file=auth_token_file, io_timeout=io_timeout,
                       tls_files=(tls_cert, tls_key, tls_ca))
               if tp else open_engine(model, backend, numerics))
        with library_errors():  # (the vocabulary is read here, on first use)
            tok = eng.tokenizer
        from ds4.core.atomic import temp_dir

        with library_errors(), temp_dir(KV_TEMP_PREFIX) as tmp:
            if recv_kv is not None:
                path = tmp / "session.dsv4"
                _receive(recv_kv, path, host, eng.model.fingerprint, eng.config, limit, token,
                         io_timeout, wait, tls, port_option="--recv-kv", sock=recv_sock)
            else:
                path = load_kv
                if not path.is_file():
                    raise CLIError(f"KV file not found: {path}")
            # (with the model: the header's counts and the file's size are checked before the
            # session it asks for is allocated)
            h = check_payload(path, eng.config)
            session_ctx = h.ctx if ctx is None else ctx
            if h.ctx > session_ctx:
                raise CLIError(f"--ctx {session_ctx} is smaller than the saved session's ctx {h.ctx}")
            session = eng.session(ctx=session_ctx, prefill_cap=h.prefill_cap)
            t0 = time.perf_counter()
            session.load_payload(path)
            t_load = time.perf_counter() - t0
            size = path.stat().st_size
    n_prompt = len(session.tokens)

    generated, stop, t_gen = stream_reply(session, tok, n, params, rng)
    stats = (f"loaded: {n_prompt} tokens ({human_bytes(size)}) in {t_load:.2f} s · "
             f"generated: {generated} tokens, {rate(generated, t_gen)}")
    if temp > 0:
        stats += f" · seed {seed}"
    err.print(Text(stats, style="dim"), soft_wrap=True)
    if stop == "interrupted":
        raise typer.Exit(130)


# ---- kv-send / kv-recv --------------------------------------------------------------------------

def kv_send(
    file: Annotated[Path, typer.Argument(
        metavar="FILE", dir_okay=False, show_default=False, help="The payload to send.")],
    dest: Annotated[str, typer.Argument(
        metavar="HOST:PORT", show_default=False, help="Where a `ds4 kv-recv` or "
        "`ds4 decode --recv-kv` listens (:PORT: on this machine; an IPv6 host in brackets, "
        "[::1]:PORT).")],
    model: ModelOption = None,
    auth_token_file: AuthTokenFileOption = None,
    auth_token: AuthTokenOption = None,
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
) -> None:
    """Send a saved session payload to another node (DS4K).

    The manifest names the model the file names (its identity trailer); with -m the file is
    also checked against that model. A bare payload (no trailer) is sent for the model of -m."""
    from ds4.core.gguf_model import GGUFModel
    from ds4.core.payload import ModelRef, check_payload, read_identity, verify_digest
    from ds4.wire.ds4k import send_payload

    host, port = check_hostport(dest, "HOST:PORT", default_host=LOOPBACK)
    with library_errors():
        token = wire_token(auth_token, auth_token_file)
        tls = client_tls(tls_cert, tls_key, tls_ca)
        if not file.is_file():
            raise CLIError(f"KV file not found: {file}")
        size = file.stat().st_size
        ident = read_identity(file)
        if model is not None or ident is None:
            m = GGUFModel(resolve_model(model))
            # refuse locally what the receiver would refuse, another model's file included
            check_payload(file, m.config, size, ModelRef.of(m))
        else:
            check_payload(file)
        if ident is not None:
            verify_digest(file, ident)
        fingerprint = ident.model.fingerprint if ident is not None else m.fingerprint
        with err.status(f"sending {human_bytes(size)} to {dest} ..."):
            t0 = time.perf_counter()
            manifest = send_payload(file, host, port, fingerprint=fingerprint,
                                    auth_token=token, timeout=io_timeout, tls=tls)
            dt = time.perf_counter() - t0
    out.print(Text("sent ", style="green") + Text(str(file), style="bold")
              + Text(f" to {dest} ({manifest.n_tokens} tokens, {size:,} bytes, {_mbps(size, dt)}, "
                     f"sha256 {manifest.sha256[:16]}…)"), soft_wrap=True)


def kv_recv(
    port: ListenPort,
    out_file: Annotated[str, typer.Option(  # (str: Path would drop a trailing "/")
        "--out", "-o", metavar="FILE", show_default=False,
        help="Where to put the payload (written atomically; nothing is left there on failure).")],
    model: Annotated[Optional[Path], typer.Option(
        "--model", "-m", metavar="GGUF", dir_okay=False, show_default=False,
        help="Accept only payloads for this model (fingerprint, layout and exact size are "
             "checked). Without it any DSV4 payload is accepted.")] = None,
    host: HostOption = "127.0.0.1",
    auth_token_file: AuthTokenFileOption = None,
    auth_token: AuthTokenOption = None,
    max_kv_bytes: MaxKvBytesOption = "16G",
    io_timeout: IoTimeoutOption = DEFAULT_IO_TIMEOUT,
    wait: WaitOption = None,
    tls_cert: TlsCertOption = None,
    tls_key: TlsKeyOption = None,
    tls_ca: TlsCaOption = None,
) -> None:
    """Receive one session payload from another node (DS4K) into a file."""
    limit = _parse_size(max_kv_bytes)
    with library_errors():
        token = wire_token(auth_token, auth_token_file)
        tls = server_tls(tls_cert, tls_key, tls_ca)
        fingerprint = config = None
        # (at startup: a directory that cannot take the file would fail every transfer late)
        out_file = output_file(out_file, "--out")
        if model is not None:
            from ds4.core.gguf_model import GGUFModel

            m = GGUFModel(resolve_model(model))
            fingerprint, config = m.fingerprint, m.config
            check_output(out_file, "--out", m.path)
        t0 = time.perf_counter()
        manifest = _receive(port, out_file, host, fingerprint, config, limit, token, io_timeout,
                            wait, tls, port_option="PORT")
        dt = time.perf_counter() - t0
    out.print(Text("received ", style="green") + Text(str(out_file), style="bold")
              + Text(f" ({manifest.n_tokens} tokens, {manifest.payload_bytes:,} bytes, "
                     f"sha256 {manifest.sha256[:16]}…, {dt:.2f} s)"), soft_wrap=True)


class _WarnFailures(logging.Handler):
    """Each dropped sender as one `warning:` line on stderr (the receiver keeps waiting)."""

    def emit(self, record: logging.LogRecord) -> None:
        warn(record.getMessage())


def _receive(port, path, host, fingerprint, config, limit, token, io_timeout, wait, tls, *,
             port_option: str, sock=None):
    """Listen on host:port (a failure names `port_option` or --host), or on `sock` when bound
    already (the receiver closes it), until a payload lands at path."""
    from ds4.core.atomic import signals_unwind
    from ds4.wire.ds4k import Receiver

    warn_exposed(host, token)
    handler = _WarnFailures(logging.WARNING)
    logger = logging.getLogger("ds4.wire.ds4k")
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # one line per failure, not two
    try:
        # SIGTERM unwinds the receiver, which removes its partial file
        with signals_unwind():
            with listen_errors(port_option, "--host"):
                r = Receiver(port, host=host, fingerprint=fingerprint, config=config,
                             max_bytes=limit, auth_token=token, timeout=io_timeout, tls=tls,
                             sock=sock)
            with r:
                err.print(Text(f"listening on {format_hostport(r.host, r.port)}", style="dim"),
                          soft_wrap=True)
                return r.receive(path, wait)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# ---- helpers ------------------------------------------------------------------------------------

def _mbps(size: int, seconds: float) -> str:
    return f"{size / seconds / 1e6:.1f} MB/s" if seconds > 0 else "- MB/s"


def register(app: typer.Typer) -> None:
    """Add `prefill`, `decode`, `kv-send` and `kv-recv` to a typer app."""
    app.command("prefill")(prefill)
    app.command("decode")(decode)
    app.command("kv-send")(kv_send)
    app.command("kv-recv")(kv_recv)
