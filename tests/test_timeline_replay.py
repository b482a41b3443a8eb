"""The replay's device pass on hand-made records: one kernel at a time per device, whatever its stream;
of kernels that could start at once, the one ready longest first; a later-recorded op that is ready
earlier takes the gap an earlier one leaves; collectives and copies run beside kernels; a collective's
members end together. (What a GPU does with two streams' kernels that each fill it.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dpqlab.timeline.record import Op
from dpqlab.timeline.replay import Busy, _device_pass


@dataclass(frozen=True)
class Stream:
    sid: int
    place: int
    name: str = ""


S1, S2, OTHER = Stream(0, 1), Stream(1, 1), Stream(2, 2)


def kernel(i: int, stream: Stream, deps=(), kind="kernel", group=None, size=1) -> Op:
    return Op(i, f"op{i}", kind, "main", stream=stream, deps=list(deps), group=group, group_size=size)


def run(ops, durations, issue=None):
    issue = issue or {op.id: 0.0 for op in ops}
    return _device_pass(ops, issue, durations)


def test_timeline_two_streams_share_a_device():
    ops = [kernel(0, S1), kernel(1, S2), kernel(2, OTHER)]
    start, end = run(ops, {0: 3.0, 1: 2.0, 2: 5.0})
    assert (start[0], end[0]) == (0.0, 3.0)
    assert (start[1], end[1]) == (3.0, 5.0)  # the same device: after the first
    assert (start[2], end[2]) == (0.0, 5.0)  # another device: beside them


def test_timeline_the_kernel_ready_longest_goes_first():
    """Stream 1 queues two kernels; stream 2's one becomes ready while the first runs: it goes before
    stream 1's second (ready only when the first ends), though recorded after it."""
    ops = [kernel(0, S1), kernel(1, S1), kernel(2, S2)]
    start, _ = run(ops, {0: 4.0, 1: 4.0, 2: 1.0}, issue={0: 0.0, 1: 0.0, 2: 1.0})
    assert start[2] == 4.0 and start[1] == 5.0


def test_timeline_a_stream_waits_for_its_dependencies():
    wait = Op(2, "wait_event", "wait", "main", stream=S2, deps=[0])
    ops = [kernel(0, OTHER), kernel(1, S1), wait, kernel(3, S2)]
    start, _ = run(ops, {0: 6.0, 1: 1.0, 2: 0.0, 3: 1.0})
    assert start[3] == 6.0  # after the event it waited for, on another device


def test_timeline_collectives_run_beside_kernels_and_end_together():
    ops = [kernel(0, S1), kernel(1, S2, kind="collective", group=7, size=2),
           kernel(2, OTHER, kind="collective", group=7, size=2)]
    start, end = run(ops, {0: 5.0, 1: 2.0, 2: 3.0}, issue={0: 0.0, 1: 0.0, 2: 1.0})
    assert start[1] == 0.0 and start[2] == 1.0  # not held back by the kernel on S1's device
    assert end[1] == 1.0 + 2.0 and end[2] == 1.0 + 3.0  # from the last member's start


@pytest.mark.parametrize("gaps", [[(0.0, 2.0), (5.0, 6.0)]])
def test_timeline_busy_takes_the_earliest_gap(gaps):
    busy = Busy()
    for a, b in gaps:
        assert busy.place(a, b - a) == a
    assert busy.place(0.0, 3.0) == 2.0  # fits between the two
    assert busy.place(0.0, 1.0) == 6.0  # the gap 5.0 - 5.0 is gone: after the last
