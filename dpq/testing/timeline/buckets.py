"""The exchange laid out for the target block: dpq's own bucketing of the target's tuned tensors.

The recorded block's tuned tensors fill one gradient bucket; a large block's fill many (every
weight-shaped ``value`` of a 70B-class layer is over the cap by itself), and each bucket is a
sequence of host calls, kernels and collectives of its own. The record marks the ops of every
bucket the exchange issues (``Op.bucket``) and the layout dpq built (``TimelineModel.bucket_layout``:
each tuned tensor's element count, in order, and the cap). Here the target's tuned tensors (the
recorded ones, each mapped to its role in the target block) are bucketed by dpq's own
:func:`dpq.exchange.bucket_layout` with the same cap, and each iteration's run of bucket ops is
replaced by one copy of the first recorded bucket's ops per target bucket, each copy's tensors and
wire bytes scaled to its bucket's size (``Op.fixed_scale``). Every bucket runs the same code
(``dpq.exchange._Exchange.exchange_bucket``), so the copies are what the exchange would issue.
"""

from __future__ import annotations

import dataclasses
import itertools

from dpq.exchange import bucket_layout
from dpq.testing.timeline.record import Op
from dpq.testing.timeline.shapes import RoleMap

__all__ = ["expand", "target_buckets"]


def target_buckets(layout: tuple[list[int], int] | None, roles: RoleMap) -> list[int] | None:
    """Element counts of the target's buckets (None: the record exchanged nothing)."""
    if layout is None:
        return None
    sizes, cap = layout
    mapped = []
    for n in sizes:
        t = roles.target_numel(n, 0)
        if t is None:
            raise ValueError(f"a tuned tensor of {n} elements has no role in {roles.target.name}")
        mapped.append(t)
    return [sum(mapped[i] for i in ids) for ids in bucket_layout(mapped, cap)]


def expand(ops: list[Op], buckets: list[int] | None) -> list[Op]:
    """``ops`` with each run of bucket ops replaced by one scaled copy of its first bucket per target
    bucket, renumbered (a reference to a replaced op now names its copy in the last bucket)."""
    if buckets is None:
        return ops
    out: list[Op] = []
    new_id: dict[int, int] = {}
    groups = itertools.count(10**9)
    i = 0
    while i < len(ops):
        if ops[i].bucket is None:
            out.append(_renumbered(ops[i], len(out), new_id, {}))
            new_id[ops[i].id] = out[-1].id
            i += 1
            continue
        run_end = i
        while run_end < len(ops) and ops[run_end].bucket is not None:
            run_end += 1
        first = [op for op in ops[i:run_end] if op.bucket == ops[i].bucket]
        recorded = first[0].bucket_numel
        for numel in buckets:
            local: dict[int, int] = {}
            group_ids: dict[int, int] = {}
            for op in first:
                copy = _renumbered(op, len(out), new_id, local, scale=numel / recorded)
                if op.group is not None:
                    copy.group = group_ids.setdefault(op.group, next(groups))
                local[op.id] = copy.id
                out.append(copy)
            new_id.update(local)
        for op in ops[i:run_end]:  # the later buckets' ops: references to them go to the last copy
            new_id.setdefault(op.id, new_id[first[-1].id])
        i = run_end
    return out


def _renumbered(op: Op, ident: int, new_id: dict[int, int], local: dict[int, int], scale: float | None = None) -> Op:
    def ref(x: int | None) -> int | None:
        return None if x is None else local.get(x, new_id.get(x, x))

    return dataclasses.replace(op, id=ident, deps=[ref(d) for d in op.deps], host_after=ref(op.host_after),
                               wait_for=ref(op.wait_for), fixed_scale=scale if scale is not None else op.fixed_scale)
