"""Nothing half-written: files that appear whole or not at all, and signals that unwind.

    with atomic_file("out.dsv4") as f:     # a temporary `.out.dsv4.*.part` beside the target,
        f.write(data)                      # fsynced and renamed when the block finishes

    with atomic_path("model.gguf") as tmp: # the same, for writers that open a file by name
        writer(tmp)

    with temp_dir("ds4-kv-") as d:         # removed on return, error, SIGTERM, SIGINT or SIGHUP
        ...

A temporary name is only removed by code that runs, and a process killed by SIGTERM's default
action runs none. So while a writer is open, `signals_unwind()` turns SIGTERM and SIGHUP into
`Terminated` (a SystemExit with exit code 128 + signal number, the shell's convention) raised in
the main thread; SIGINT already raises KeyboardInterrupt. Either unwinds every `with`/`finally`
on the way out, which removes the temporary. The handlers are restored when the outermost block
ends, and nothing is installed off the main thread (Python only delivers signals there).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import IO, Iterator

PART_SUFFIX = ".part"
UNWOUND_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
                        if s is not None)
SIGNAL_EXIT_BASE = 128  # a process ended by signal N exits with 128 + N


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM or SIGHUP arrives inside `signals_unwind()`."""

    def __init__(self, signum: int):
        super().__init__(SIGNAL_EXIT_BASE + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


_depth = 0  # nesting of signals_unwind() in the main thread


def _raise_terminated(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """While the block runs, SIGTERM / SIGHUP raise `Terminated` in the main thread (so `finally`
    clauses and context managers clean up); nested blocks share the outermost one's handlers."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    if _depth == 0:
        for s in UNWOUND_SIGNALS:
            if signal.getsignal(s) is signal.SIG_IGN:
                continue  # whoever started us asked for this signal to be ignored
            saved[s] = signal.signal(s, _raise_terminated)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for s, old in saved.items():
            signal.signal(s, old)


def fsync_dir(d: str | os.PathLike) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem can fsync a directory
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, private: bool = True) -> Iterator[Path]:
    """The name of an empty temporary file beside `path` (for writers that open files by name)
    that becomes `path` (fsynced, renamed) only if the block finishes; on any error or signal it
    is removed and `path` is left as it was. `private` keeps the owner-only mode; otherwise the
    umask decides, as for open()."""
    path = Path(path)
    with signals_unwind():
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PART_SUFFIX,
                                   dir=path.parent if str(path.parent) else ".")
        try:
            if not private:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(fd, 0o666 & ~umask)
            os.close(fd)
            yield Path(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)  # whoever wrote it, through whichever descriptor
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", private: bool = True) -> Iterator[IO]:
    """`atomic_path` opened for writing in `mode` ("wb" or "w", closed before the rename)."""
    with atomic_path(path, private) as tmp:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            yield f


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    """A private temporary directory, removed with its contents however the block ends."""
    with signals_unwind():
        d = tempfile.mkdtemp(prefix=prefix)
        try:
            yield Path(d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
