"""A `ds4 serve` (or `pipe-worker`) in its own process, for the tests of the HTTP head."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class Proc:
    """A CLI command in its own process; `port` comes from its first stdout line."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.argv = [sys.executable, "-m", "cli.main", *args]
        self.log = log
        full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        full_env.pop("DS4_API_KEY", None)
        full_env.pop("DS4_WIRE_TOKEN", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.port: int | None = None

    def _pump(self):
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_listening(self, timeout: float = 120.0) -> "Proc":
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        m = line and re.search(r"listening on \S*?:(\d+)", line)
        if not m:
            self.kill()
            raise AssertionError(f"{self.argv} did not start: {line!r}\n{self.log.read_text()}")
        self.port = int(m.group(1))
        return self

    def wait_healthy(self, timeout: float = 60.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.argv} never became healthy:\n{self.log.read_text()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=20)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=5).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not in /metrics"
    return total


def wait_idle(url: str, headers: dict | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(url, "ds4_generations_running", headers) == 0 and \
                metric(url, "ds4_queue_depth", headers) == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server never went idle")
