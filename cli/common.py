"""What every command shares: the two consoles, one-line errors, progress bars, opening models."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import typer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

from .options import check_text

# Results go to stdout; progress, status and diagnostics to stderr, so `ds4 ... > file` keeps
# only the result. Both consoles look sys.stdout/sys.stderr up at write time.
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class CLIError(Exception):
    """A failure to report as one red line (no traceback) and exit with `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code


def check_prefill_cap(prefill_cap: int | None, ctx: int, ctx_name: str = "--ctx") -> None:
    """--prefill-cap against the session's context (a chunk cannot be longer than the session)."""
    if prefill_cap is not None and prefill_cap > ctx:
        raise CLIError(f"--prefill-cap {prefill_cap} is more than {ctx_name} {ctx}")


def print_error(message: str) -> None:
    """`error: message` in red on stderr."""
    # soft_wrap: a tensor name or path is never split across lines; the terminal wraps instead.
    err.print(Text.assemble(("error: ", "bold red"), (message, "red")), soft_wrap=True)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print `error: message` in red on stderr and exit with `code`."""
    print_error(message)
    raise typer.Exit(code)


def print_field(key: str, value: str, width: int = 14) -> None:
    """One `  key   value` line of a result on stdout."""
    out.print(Text.assemble((f"  {key:<{width}}", "cyan"), value), soft_wrap=True)


@contextlib.contextmanager
def library_errors() -> Iterator[None]:
    """Turn the library's expected failures (bad file, bad model, bad value) into `fail`."""
    try:
        yield
    except CLIError as e:
        fail(e.message, e.code)
    except BrokenPipeError:
        raise  # the reader went away: not a failure to report
    except (ValueError, RuntimeError, OSError) as e:  # ModelError and ConfigError are ValueErrors
        fail(str(e) or type(e).__name__)


def progress_bar(transient: bool = False) -> Progress:
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                    console=err, transient=transient)


@contextlib.contextmanager
def progress_callback(description: str, transient: bool = False) -> Iterator[Callable[[int, int], None]]:
    """A `progress(i, n)` callback for the library that shows a bar once it is first called."""
    state: dict = {}

    def update(i: int, n: int) -> None:
        if not err.is_terminal:  # a log gets one line, not a redrawn bar
            if not state:
                state["said"] = True
                err.print(Text(f"{description} ...", style="dim"), soft_wrap=True)
            return
        if "bar" not in state:
            state["bar"] = progress_bar(transient)
            state["bar"].start()
            state["task"] = state["bar"].add_task(description, total=n)
        state["bar"].update(state["task"], completed=i, total=n)

    try:
        yield update
    finally:
        if "bar" in state:
            state["bar"].stop()


# ---- the prompt ---------------------------------------------------------------------------------

STDIN_PROMPT = "-"  # `-p -`: the prompt is stdin's text
# the line ends a prompt from stdin may end with, longest first ("\r\n" is one newline, not "\n"
# after a kept "\r")
_NEWLINES = ("\r\n", "\n")


def strip_one_newline(text: str) -> str:
    """`text` less one trailing newline ("\n" or "\r\n"), if it ends with one."""
    for newline in _NEWLINES:
        if text.endswith(newline):
            return text[:-len(newline)]
    return text


def read_stdin_text() -> str:
    """All of stdin as text. A byte that is not UTF-8 becomes a lone surrogate (as in argv), which
    check_text names, rather than a UnicodeDecodeError where the locale makes stdin strict."""
    with contextlib.suppress(AttributeError, ValueError):  # (a stand-in stdin may not reconfigure)
        sys.stdin.reconfigure(errors="surrogateescape")
    return sys.stdin.read()


def prompt_text(prompt: str, option: str = "--prompt") -> str:
    """The user message of `-p PROMPT`: PROMPT, or for `-p -` stdin's text less one trailing
    newline. `echo` and a shell's here-string (`<<<`) end the text with a newline that is not
    part of the message; a second one, typed on purpose, is kept. Text that is not UTF-8 is a
    command-line error naming `option` (check_text)."""
    if prompt == STDIN_PROMPT:
        return check_text(strip_one_newline(read_stdin_text()), option, "stdin")
    return check_text(prompt, option)


def prompt_file_text(path: Path, option: str = "--prompt-file") -> str:
    """The user message in FILE, byte for byte as UTF-8: no newline is stripped or translated
    ("\r\n" stays), since a file, unlike stdin, holds exactly what its writer meant to send."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise typer.BadParameter(f"{path} is not UTF-8 text: byte {e.start} is {data[e.start]:#04x}",
                                 param_hint=f"'{option}'") from None


def output_file(value: str | os.PathLike, option: str, *, in_place: bool = False) -> Path:
    """The path an output FILE option names, checked before any long work (the one check of every
    option that writes a file: --save-kv, kv-recv --out, bench --csv and --plot, chat's /save).

    Refused, as a CLIError naming `option`: a path that names a directory (it ends with a
    separator or in "." or "..", which Path would drop: 'out/' would write a file 'out'; or it is
    an existing directory), a directory that does not exist, and one this process may not create
    a file in (os.access, which also says no on a read-only mount). Files are written as a
    temporary file beside the target renamed into place, so the directory must take new files;
    `in_place`: the file is opened where it is (bench --csv appending), so where it exists the
    file itself must be writable instead."""
    text = os.fspath(value)
    if os.path.basename(text) in ("", ".", ".."):
        raise CLIError(f"{option}: expected a file path, got a directory path {text!r}")
    path = Path(text)
    # (os.path's tests, not Path's: they say False, not PermissionError, under a directory this
    # process may not search, which the access check below then names)
    if os.path.isdir(path):
        raise CLIError(f"{option}: expected a file path, got the directory {text!r}")
    parent = path.parent
    if not os.path.isdir(parent):
        if os.path.lexists(parent):
            raise CLIError(f"{option}: not a directory: {parent}")
        raise CLIError(f"{option}: directory does not exist: {parent}")
    if in_place and os.path.exists(path):
        if not _may(path, os.W_OK):
            raise CLIError(f"{option}: file not writable: {path}")
    elif not _may(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{option}: directory not writable: "
                       f"{parent if parent != Path('.') else Path.cwd()}")
    return path


def _may(path: Path, mode: int) -> bool:
    """os.access for this process's effective user where the platform can say (a setuid run)."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


@contextlib.contextmanager
def listen_errors(port_option: str, host_option: str | None = None) -> Iterator[None]:
    """A listener that cannot bind (ds4.wire.address.ListenError) as the CLIError
    `OPTION: cannot listen on HOST:PORT: reason`: OPTION is `host_option` where the host is at
    fault (it does not resolve, or is not an address of this machine), else `port_option` (a
    port in use or not allowed). The one way every listening command says it."""
    from ds4.wire.address import ListenError

    try:
        yield
    except ListenError as e:
        option = host_option if host_option is not None and e.host_fault else port_option
        raise CLIError(f"{option}: {e}") from None


@contextlib.contextmanager
def bound_first(listen: Callable[[], socket.socket], port_option: str,
                host_option: str | None = None) -> Iterator[socket.socket]:
    """A listener bound before the block loads the model (minutes for a large one), so that a
    port in use says so at once (listen_errors words it); the block hands it to what serves on
    it, and it is closed only if the block fails."""
    with listen_errors(port_option, host_option):
        sock = listen()
    try:
        yield sock
    except BaseException:
        sock.close()
        raise


def check_output(dest: Path, option: str, model_path: Path | None) -> None:
    """Refuse an output path that is the model file the command reads: the output's rename
    would replace the model with a payload."""
    if model_path is not None and dest.exists() and model_path.exists() and dest.samefile(model_path):
        raise CLIError(f"{option}: {dest} is the model file this command reads; give another path")


def resolve_model(path: Path | None) -> Path:
    """The model file to open: `path`, or the embedded default (created on first use)."""
    if path is not None:
        if not path.exists():
            raise CLIError(f"model file not found: {path}")
        if not path.is_file():
            raise CLIError(f"model path is not a file: {path}")
        return path
    from ds4.core.default_model import cache_dir, default_model_path

    with progress_callback(f"creating the embedded default model in {cache_dir()} "
                           "(first run only)") as progress:
        return default_model_path(progress=progress)


def choose_backend(name: str, announce: bool = True) -> str:
    """The concrete backend for `--backend NAME`: "auto" picks by machine (triton where CUDA is
    present, mlx on Apple silicon, else reference; ds4.backends.resolve_backend), and the
    choice is printed on stderr unless `announce` is False (the caller shows it itself)."""
    from ds4.backends import resolve_backend

    chosen = resolve_backend(name)
    if name == "auto" and announce:
        err.print(Text(f"backend: {chosen} (--backend auto)", style="dim"))
    return chosen


def open_engine(path: Path | None, backend: str = "auto", numerics: str = "ds4",
                announce: bool = True):
    """Resolve the model (creating the default one if needed) and open it on `backend`."""
    import ds4

    with library_errors():
        model_path = resolve_model(path)
        backend = choose_backend(backend, announce)
        return ds4.Engine.open(model_path, backend=backend, numerics=numerics)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# ---- streaming a reply ----------------------------------------------------------------------------

def write_text(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:.1f} tokens/s" if count and seconds > 0 else "- tokens/s"


def stream_reply(session, tokenizer, n: int, params, rng) -> tuple[int, str | None, float]:
    """Sample up to n tokens after the session's tokens, streaming their text to stdout.

    Stops at end-of-sentence, when the context is full, or on Ctrl-C. Returns (generated,
    why it stopped early or None, seconds). Works on a plain or a split (pipeline) session.
    Both go through their `sample` (`Session.sample`, `SplitSession.sample`: the same tokens
    for the same parameters and seed), which evaluates each token before yielding it, so the
    session also holds the end-of-sentence token."""
    stream = tokenizer.stream_decoder()
    room = session.ctx - len(session.tokens)
    eos = tokenizer.eos_id
    tokens = session.sample(n, params, rng, stop={eos})
    generated, stop = 0, None
    t0 = time.perf_counter()
    try:
        with library_errors(), contextlib.closing(tokens):
            for token in tokens:
                if token == eos:
                    break
                write_text(stream.push(token))
                generated += 1
        if generated == room < n:
            stop = f"the context is full (ctx {session.ctx})"
    except KeyboardInterrupt:
        stop = "interrupted"
    seconds = time.perf_counter() - t0
    write_text(stream.flush() + "\n")
    if stop:
        err.print(Text(f"stopped: {stop}", style="yellow"))
    return generated, stop, seconds
