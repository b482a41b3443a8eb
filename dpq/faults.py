"""Test-only fault injection: the one entry point (``inject_fault``) and the points that fire it.

Tests make a lane fail where they want (a lane's loss, a named point of a no-grad pass, or the
whole process, as a killed rank) to check that a failure mid-run loses nothing already done.
:mod:`dpq.session` re-exports the entry points; nothing here runs unless a test asked for it.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

from dpq.streams import Lane

__all__ = ["fault_point", "faulty", "inject_fault"]


@dataclass(eq=False)
class _Fault:
    kind: str
    block: int | str | None
    lane: int | None
    after: int
    calls: int = 0
    registry: list = field(default_factory=list, repr=False)

    def __enter__(self) -> _Fault:
        return self

    __exit__ = lambda self, *exc: self.remove()  # noqa: E731

    def remove(self) -> None:
        if self in self.registry:
            self.registry.remove(self)


_FAULTS: list[_Fault] = []


def inject_fault(*, kind: str = "tune", block: int | str | None = None, lane: int | None = None,
                 after: int = 0) -> _Fault:
    """Tests only: make a lane fail. Active from this call until ``remove()`` (or the end of a ``with``
    block). ``kind="tune"``: the lane loss of block ``block`` (its index or name; None: any) on lane
    ``lane`` (None: any) raises from its call ``after + 1`` on, counted over the lanes it matches
    (``"exit"``: the process exits there instead, as if killed; ``"hang"``: it never returns, as
    a hung process). Other kinds name a point a pass
    reports through :func:`fault_point` (e.g. "collection", "awq_grid"); those fire once."""
    fault = _Fault(kind, block, lane, after, registry=_FAULTS)
    _FAULTS.append(fault)
    return fault


def fault_point(kind: str, lane: int, block: int | str | None = None) -> None:
    """A pass's fault point: raises when an injected fault of ``kind`` matches (then it is gone)."""
    for fault in list(_FAULTS):
        if fault.kind == kind and fault.lane in (None, lane) and fault.block in (None, block):
            fault.calls += 1
            if fault.calls > fault.after:
                fault.remove()
                raise RuntimeError(f"injected {kind} lane failure (dpq test hook)")


def faulty(lane_loss, task):
    """``lane_loss`` made to fail as the faults injected for ``task`` (its index or name) say."""
    # a command's processes (torchrun's workers), which a test cannot reach into (read once):
    # DPQ_TEST_FAULT=<exit|raise|hang>:<RANK (0 outside torchrun)>:<block>:<after>
    spec = os.environ.pop("DPQ_TEST_FAULT", "").split(":")
    if spec[0] in ("exit", "raise", "hang") and os.environ.get("RANK", "0") == spec[1]:
        inject_fault(kind="tune" if spec[0] == "raise" else spec[0], block=int(spec[2]), after=int(spec[3]))
    faults = [f for f in _FAULTS if f.kind in ("tune", "exit", "hang") and f.block in (None, task.index, task.name)]
    if not faults:
        return lane_loss

    def failing(lane: Lane, module: torch.nn.Module, indices: list[int]) -> torch.Tensor:
        for fault in faults:
            if fault.lane in (None, lane.index):
                fault.calls += 1
                if fault.calls > fault.after:
                    if fault.kind == "exit":  # the process dies there, as a killed rank does
                        os._exit(9)
                    if fault.kind == "hang":  # it never returns, as a hung rank does (its peers wait in a collective)
                        print(f"dpq test hook: rank {os.environ.get('RANK', '0')} hangs in block {task.index}",
                              file=sys.stderr, flush=True)
                        while True:
                            time.sleep(60)
                    raise RuntimeError("injected lane failure (dpq test hook)")
        return lane_loss(lane, module, indices)

    return failing
