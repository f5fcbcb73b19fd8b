"""The side-stream ordering of a decode step (ds4/backends/triton/lanes.py), on recorders instead of
CUDA streams: which launch waits for which event follows from the buffers each one touches."""

import pytest

torch = pytest.importorskip("torch")

from ds4.backends.triton.lanes import Lanes  # noqa: E402


class Stream:
    def __init__(self, name):
        self.name = name
        self.log = []  # ("event", event) / ("stream", other stream)

    def wait_event(self, ev):
        self.log.append(("event", ev))

    def wait_stream(self, other):
        self.log.append(("stream", other))


class Event:
    def __init__(self):
        self.stream = None

    def record(self, stream):
        self.stream = stream


def _lanes():
    names = iter(["side1", "side2"])
    ln = Lanes(2, "cpu", 16, new_stream=lambda: Stream(next(names)), new_event=Event)
    main = Stream("main")
    ln.begin(main, torch.zeros(16, dtype=torch.int32))
    return ln, main, ln.side[0], ln.side[1]


def _launch(ln, lane, *bufs):
    ln.lane = lane
    s = ln.before(bufs)
    ln.after()
    return s, ln.events[lane][-1]


def test_waits_follow_the_buffers():
    ln, main, s1, s2 = _lanes()
    a, b, c, d = (torch.empty(4) for _ in range(4))
    st = torch.empty(8)
    for t in (a, b, c, d):
        ln.arena(t)
    ln.state(st)
    weight = torch.empty(4)  # not registered: read-only, orders nothing

    s, ev_a = _launch(ln, 0, a, weight)  # produces a
    assert s is main and main.log == []
    # a branch: its stream first joins lane 0's work so far, so reading a adds no event wait
    s, ev_st1 = _launch(ln, 1, a, st, weight)
    assert s is s1 and s1.log == [("stream", main)]
    _, ev_b = _launch(ln, 0, a, b)  # produces b after the fork; a second reader of a waits for nothing
    assert main.log == []
    # lane 1 reads b: it waits for exactly the launch that wrote b, nothing later
    _launch(ln, 0, c)
    _launch(ln, 1, b, d)
    assert s1.log == [("stream", main), ("event", ev_b)]
    # the other side stream reads a: joins lane 0, and does not wait for lane 1 (both only read a)
    _launch(ln, 2, a)
    assert s2.log == [("stream", main)]
    # lane 0 touches the state lane 1 wrote: it waits for that launch's event
    _launch(ln, 0, st)
    assert main.log == [("event", ev_st1)]
    # and a later state access on lane 1 waits for lane 0's
    ev_st0 = ln.events[0][-1]
    _launch(ln, 1, st)
    assert s1.log[-1] == ("event", ev_st0)
    # reading d on lane 0 waits for lane 1's producer, once
    ev_d = ln.events[1][1]  # lane 1's second launch produced d
    _launch(ln, 0, d)
    _launch(ln, 0, d)
    assert main.log == [("event", ev_st1), ("event", ev_d)]
    # the end of the step joins both side streams into lane 0 at their last launches
    ln.end()
    assert main.log[-2:] == [("event", ln.events[1][-1]), ("event", ln.events[2][-1])]
    assert not ln.active


def test_branches_take_side_lanes_in_turn_and_keep_their_tickets():
    ln, main, s1, s2 = _lanes()
    assert [ln.take() for _ in range(5)] == [1, 2, 1, 2, 1]
    ln.lane = 0
    t0 = ln.tickets()
    ln.lane = 2
    assert ln.tickets() is ln.side_tickets[1] and ln.tickets() is not t0
    assert Lanes(0, "cpu", 4).take() == 0


def test_unused_side_streams_are_not_joined():
    ln, main, s1, s2 = _lanes()
    x = torch.empty(2)
    ln.arena(x)
    _launch(ln, 0, x)
    ln.end()
    assert main.log == [] and s1.log == [] and s2.log == []


def test_hold_main_orders_lane_0_after_the_branch():
    ln, main, s1, s2 = _lanes()
    a, b = torch.empty(2), torch.empty(2)
    ln.arena(a)
    ln.arena(b)
    _launch(ln, 0, a)
    _launch(ln, 1, b)  # the branch: joins lane 0, then produces b
    _, ev = _launch(ln, 1)
    ln.hold_main()  # on lane 1: lane 0 waits for lane 1's last launch, once
    assert main.log == [("event", ev)]
    ln.hold_main()
    assert main.log == [("event", ev)]
    ln.lane = 0
    ln.hold_main()  # on lane 0 itself: nothing to wait for
    ln.lane = 2
    ln.hold_main()  # a side lane with no launches yet: nothing either
    assert main.log == [("event", ev)]
    _launch(ln, 0, b)  # a later read of b on lane 0 needs no second wait
    assert main.log == [("event", ev)]


def test_follow_main_orders_a_branch_after_lane_0s_untracked_work():
    """A buffer torch fills on lane 0 after a branch forked (the indexer's top-k buckets on the
    first decode step) is not a launch the branch can wait for: follow_main makes the branch's
    stream wait for lane 0's whole stream, and a branch that has not forked yet needs nothing
    (its fork joins lane 0 anyway)."""
    ln, main, s1, s2 = _lanes()
    _launch(ln, 1)  # the branch forks: joins lane 0
    assert s1.log == [("stream", main)]
    _launch(ln, 0)  # lane 0 goes on (and torch fills a buffer there)
    ln.lane = 1
    ln.follow_main()
    assert s1.log == [("stream", main), ("stream", main)]
    assert ln.seen[1][0] == ln.count[0]  # lane 0's launches so far need no event waits later
    ln.lane = 2
    ln.follow_main()  # not forked yet
    assert s2.log == []
    ln.lane = 0
    ln.follow_main()  # lane 0 itself
    assert main.log == []
