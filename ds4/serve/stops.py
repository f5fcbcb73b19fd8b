"""Stop strings matched across token boundaries: text that could still become a stop string
is held back until it either does (the stop string and anything after it is never emitted)
or cannot any more."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the text
        self.after = ""  # the text that came after it in the same push

    def push(self, text: str) -> str:
        """The part of `text` (after what was held) that is safe to emit; sets `hit` when a stop
        string completes, after which nothing more is emitted."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        first = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.hit = first[1]
            self.after = buf[first[0] + len(first[1]):]
            self._held = ""
            return buf[:first[0]]
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """What was held back, once the text has ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.hit is not None else held
