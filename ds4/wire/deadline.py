"""Deadlines: one point in time (monotonic) that bounds a whole operation.

A per-read timeout alone lets a peer that sends one byte just before each timeout keep a
reader busy forever; a deadline bounds the whole hello, frame or transfer however the bytes
trickle in. Readers wait `min(per-read timeout, deadline.left())` and fail once it has passed.
"""

from __future__ import annotations

import math
import time


class DeadlineExceeded(TimeoutError):
    """The operation's deadline passed; `what` names the operation."""

    def __init__(self, what: str, seconds: float):
        super().__init__(f"{what} did not complete within {seconds:g} s")
        self.what = what


class Deadline:
    """`Deadline(seconds, what)`: `left()` seconds remain (never negative), `expired`, and
    `check()` raises DeadlineExceeded once it has passed. `seconds=None`: no deadline."""

    def __init__(self, seconds: float | None, what: str = "the operation"):
        self.seconds = seconds
        self.what = what
        self.at = math.inf if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def check(self) -> None:
        if self.expired:
            raise DeadlineExceeded(self.what, self.seconds)

    def timeout(self, per_read: float | None) -> float | None:
        """What one blocking read may wait: the smaller of its own timeout and the time left."""
        if self.at == math.inf:
            return per_read
        left = self.left()
        return left if per_read is None else min(per_read, left)
