"""The exchange laid out for the target block: dpq's own bucketing of the target's tuned tensors.

The recorded block's tuned tensors are small; a large block's fill many buckets (every
weight-shaped ``value`` of a 70B-class layer is over the cap by itself), and each bucket is a
sequence of host calls, kernels and collectives of its own, waiting for its tensors' gradients. The
record holds one bucket per tuned tensor (``TimelineModel.bucket_layout``: each tensor's element
count, in dpq's order, and the cap dpq asked for), each bucket's ops marked (``Op.bucket``). Here
the target's tuned tensors (the recorded ones, each mapped to its role in the target block) are
bucketed by dpq's own :func:`dpq.engine.exchange.bucket_layout` with that cap; each target bucket joins
consecutive recorded ones, and is replayed as one copy of the ops of its member issued last (whose
collectives waited for the last of its tensors' gradients), every size and wire byte scaled to the
target bucket (``Op.fixed_scale``); its other members' ops go. Every bucket runs the same code
(``dpq.engine.exchange._Exchange.exchange_bucket``), so the copies are what the exchange would issue, and
the time each can start is what the target's bucket would wait for.

The cap is the one the recorded run's plan chose (Note [one bucket where it fits] in ``dpq.planning.plan``):
the recorded block fits anywhere, so an exchange after the backward records the whole block as one
bucket, and the target is laid out the same. That assumes the target's lanes have the memory for it:
the plan's own price of one bucket per lane (``python -m benchmarks.timeline --table`` prints it per
block and world) is what a run on such a card would check, and a card without it runs the largest
tensor's buckets instead.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from dpq.engine.exchange import BucketCap, bucket_cap, bucket_layout
from dpqlab.timeline.record import Op
from dpqlab.timeline.shapes import RoleMap

__all__ = ["TargetBucket", "expand", "target_buckets"]


@dataclass(frozen=True)
class TargetBucket:
    numel: int  # the target's elements in it
    members: tuple[int, ...]  # the recorded buckets (one tuned tensor each) it joins


def target_buckets(layout: tuple[list[int], BucketCap] | None, roles: RoleMap) -> list[TargetBucket] | None:
    """The target's buckets in dpq's buffer order (None: the record exchanged nothing)."""
    if layout is None:
        return None
    sizes, cap = layout
    mapped = []
    for n in sizes:
        t = roles.target_numel(n, 0)
        if t is None:
            raise ValueError(f"a tuned tensor of {n} elements has no role in {roles.target.name}")
        mapped.append(t)
    recorded = {ids[0]: b for b, ids in enumerate(bucket_layout(sizes, 1))}  # tensor -> its recorded bucket
    return [TargetBucket(sum(mapped[i] for i in ids), tuple(recorded[i] for i in ids))
            for ids in bucket_layout(mapped, bucket_cap(mapped, cap))]


def expand(ops: list[Op], buckets: list[TargetBucket] | None) -> list[Op]:
    """``ops`` with each run of bucket ops replaced by the target's buckets (module docstring),
    renumbered (a reference to a dropped op names the copy that stands for its bucket)."""
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
        end = i
        while end < len(ops) and ops[end].bucket is not None:
            end += 1
        by_bucket: dict[int, list[Op]] = {}
        for op in ops[i:end]:
            by_bucket.setdefault(op.bucket, []).append(op)
        stand_ins = []
        for target in buckets:
            present = [b for b in target.members if b in by_bucket]
            if present:  # the member issued last: its collectives wait for the bucket's last gradients
                rep = max(present, key=lambda b: by_bucket[b][0].id)
                stand_ins.append((by_bucket[rep][0].id, rep, target))
        for _, rep, target in sorted(stand_ins, key=lambda x: x[0]):
            local: dict[int, int] = {}
            group_ids: dict[int, int] = {}
            for op in by_bucket[rep]:
                copy = _renumbered(op, len(out), new_id, local, scale=target.numel / op.bucket_numel)
                if op.group is not None:
                    copy.group = group_ids.setdefault(op.group, next(groups))
                local[op.id] = copy.id
                out.append(copy)
            new_id.update(local)
            for member in target.members:  # references to the dropped members' ops: this copy's last op
                for op in by_bucket.get(member, []):
                    new_id.setdefault(op.id, local[by_bucket[rep][-1].id])
        i = end
    return out


def _renumbered(op: Op, ident: int, new_id: dict[int, int], local: dict[int, int], scale: float | None = None) -> Op:
    def ref(x: int | None) -> int | None:
        return None if x is None else local.get(x, new_id.get(x, x))

    return dataclasses.replace(op, id=ident, deps=[ref(d) for d in op.deps], host_after=ref(op.host_after),
                               wait_for=ref(op.wait_for), fixed_scale=scale if scale is not None else op.fixed_scale)
