"""Side streams of a decode step: the parts of a layer that do not feed each other run side by side.

A decode step is about a thousand kernels, most of them too small to fill the GPU, so one
stream leaves it idle between them. graph.py marks work whose result is not needed at once
(`Backend.branch`: the KV path and the compressors beside the query path, the indexer beside
the attention inputs, the shared expert beside the routing); inside a decode step each branch's
launches go to a side stream. Which launch waits for which is worked out from the buffers they
touch, not from the graph, so a branch cannot race its consumers:

* an arena buffer (an op's result, allocated for the step) is written by the first launch that
  takes it and only read after that: a reader on another stream waits for that launch;
* a session state tensor (KV ring, compressor frontier, compressed rows) is read and written:
  a launch that takes one waits for every earlier launch of another stream that took it;
* weights and constants are read-only and order nothing.

Waits target the event recorded after the launch in question, not the stream's latest work.
Capturing a step records the same kernels with these waits as the graph's edges, so a replay
overlaps the branches with no host involvement. Each stream has its own split-K tickets
(`_split_store`), which a launch leaves at zero for the next one on that stream.
"""

from __future__ import annotations

import torch


def storage_key(t: torch.Tensor) -> int:
    """Views of one buffer (a reshape, a slice) are the same resource."""
    return t.untyped_storage().data_ptr()


class Lanes:
    """The streams of the decode steps of one backend. Lane 0 is the stream the step runs on
    (the capture stream while capturing); lanes 1..n are side streams, taken in turn by branches.
    `new_stream` / `new_event` are torch.cuda's unless a test passes recorders."""

    def __init__(self, n_side: int, device, tickets: int, new_stream=None, new_event=None):
        self.n_side = int(n_side)
        self.new_event = new_event or (lambda: torch.cuda.Event())
        mk = new_stream or (lambda: torch.cuda.Stream(device))
        self.side = [mk() for _ in range(self.n_side)]
        self.side_tickets = [torch.zeros(tickets, dtype=torch.int32, device=device) for _ in range(self.n_side)]
        self.active = False

    def begin(self, main_stream, main_tickets: torch.Tensor) -> None:
        """Start a step on main_stream: forget the previous step's accesses."""
        self.streams = [main_stream] + self.side
        self.tickets_of = [main_tickets] + self.side_tickets
        self.lane = 0
        self._next = 0
        self.count = [0] * len(self.streams)  # launches issued per lane
        self.events: list[list] = [[] for _ in self.streams]  # event after each launch, per lane
        self.seen = [[0] * len(self.streams) for _ in self.streams]  # seen[a][b]: launches of b a waits for
        self.forked = [True] + [False] * self.n_side
        self.kind: dict[int, str] = {}  # storage -> "arena" | "state"
        self.writer: dict[int, tuple[int, int]] = {}  # storage -> (lane, launch number)
        self.active = True

    def end(self) -> None:
        """Join every side stream that did work back into lane 0 (a capture must end joined)."""
        if not self.active:
            return
        for ln in range(1, len(self.streams)):
            if self.count[ln]:
                self._wait(0, ln, self.count[ln])
        self.active = False

    def arena(self, t: torch.Tensor) -> None:
        self.kind[storage_key(t)] = "arena"

    def state(self, t: torch.Tensor) -> None:
        self.kind[storage_key(t)] = "state"

    def take(self) -> int:
        """The side lane for the next branch (round robin); lane 0 when there are none."""
        if not self.n_side:
            return 0
        self._next = self._next % self.n_side + 1
        return self._next

    def hold_main(self) -> None:
        """Lane 0's later launches wait for the current lane's last launch, though they do not
        read what it wrote. A large kernel on lane 0 fills every SM with its programs, and the
        small kernels of a branch that become ready after it then wait for SM slots: where that
        branch is the critical one (the indexer's chain), it goes first."""
        if self.lane != 0 and self.count[self.lane]:
            self._wait(0, self.lane, self.count[self.lane])

    def follow_main(self) -> None:
        """The current lane's later launches wait for everything lane 0 has been given so far,
        launches or not: a buffer allocated and filled by torch on lane 0 (the current torch
        stream) after this lane forked is then ready before this lane's kernels touch it."""
        if self.lane != 0 and self.forked[self.lane]:
            self.streams[self.lane].wait_stream(self.streams[0])
            self.seen[self.lane][0] = self.count[0]

    def tickets(self) -> torch.Tensor:
        return self.tickets_of[self.lane]

    def _wait(self, a: int, b: int, n: int) -> None:
        """Lane a waits for launch n of lane b."""
        if a == b or n <= self.seen[a][b]:
            return
        self.streams[a].wait_event(self.events[b][n - 1])
        self.seen[a][b] = n

    def before(self, args) -> object:
        """Order the launch about to be issued on the current lane after the launches it depends
        on; returns the stream to issue it on."""
        ln = self.lane
        if not self.forked[ln]:  # a side stream joins the step (and the capture) after lane 0's work
            self.streams[ln].wait_stream(self.streams[0])
            self.seen[ln][0] = self.count[0]
            self.forked[ln] = True
        n = self.count[ln] + 1
        for t in args:
            if not isinstance(t, torch.Tensor):
                continue
            key = storage_key(t)
            kind = self.kind.get(key)
            if kind is None:
                continue
            w = self.writer.get(key)
            if kind == "arena":
                if w is None:  # its producer
                    self.writer[key] = (ln, n)
                else:  # a reader; nothing writes it again, so readers order nothing among themselves
                    self._wait(ln, *w)
            else:  # every access writes: the last one is ordered after all earlier ones
                if w is not None:
                    self._wait(ln, *w)
                self.writer[key] = (ln, n)
        return self.streams[ln]

    def after(self) -> None:
        """Record the event that later waits on this launch target."""
        ln = self.lane
        ev = self.new_event()
        ev.record(self.streams[ln])
        self.events[ln].append(ev)
        self.count[ln] += 1
