"""A sample-ordered forward pass (:func:`dpq.sharded.shard.shard_forward`) over the global lanes of several processes.

DESIGN.md contract 7: P processes x L local lanes, global lane ``g = rank * L + k``. The pass's
``n_samples`` split into ``P * L`` contiguous, batch-aligned ranges in global lane order
(:func:`global_ranges`); this process forwards its own ``L`` of them, then every rank needs
every sample's result (the next block's inputs), so :func:`gather_in_sample_order` exchanges
them (``all_gather_object``: pickled CPU copies, exact bytes) and returns them in sample order.
Every batch is one the serial pass would have formed, so the result is bitwise serial's on
every rank, whatever the topology (same thread count per process).

Only forwards whose result is the per-sample outputs go here. Passes with hook statistics
(sums/maxima merged across lanes) and per-item searches run on each rank's home alone under
several processes: their merges follow lane order inside a process but have no canonical
order across processes yet (``refusals.PASS_HOOKS_PROCESSES``).

Invariant: every rank calls :func:`agree_lanes` and, when it agreed lanes, the gather, for
the same passes in the same order (the decision to shard reads only what every rank holds
alike, then this one exchange); a failure anywhere is fatal on every rank (the caller stops
through :meth:`dpq.planning.distributed.ProcessSet.stop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dpq.engine.split import contiguous_ranges
from dpq.planning.distributed import ProcessSet, Topology
from dpq.sharded.shard import move_tensors

__all__ = ["agree_lanes", "gather_in_sample_order", "global_ranges"]


def agree_lanes(procs: ProcessSet, local: int, reasons: Sequence[str]) -> tuple[int, list[str]]:
    """Every rank's local lane count for this pass exchanged (0: this rank must run it home alone,
    ``reasons`` why). Returns the same on every rank: ``(0, every such rank's reasons)`` when any
    rank has 0, else ``(the fewest lanes any rank has, [])``."""
    plans = procs.all_gather_object((int(local), list(reasons)))
    alone = [f"rank {procs.name(r)}: {why}" for r, (n, whys) in enumerate(plans) if n < 1 for why in whys]
    if any(n < 1 for n, _ in plans):
        return 0, alone
    return min(n for n, _ in plans), []


def global_ranges(n_samples: int, topology: Topology, align: int = 1) -> list[tuple[int, int]]:
    """This process's lanes' ``[start, stop)``: its slice of the ``topology.world`` global ranges."""
    every = contiguous_ranges(n_samples, topology.world, align)
    return every[topology.lane_offset : topology.lane_offset + topology.lanes]


def gather_in_sample_order(procs: ProcessSet, outputs: list[Any], extra: dict[str, list] | None,
                           device: torch.device | str) -> tuple[list[Any], dict[str, list] | None]:
    """Every rank's per-sample ``outputs`` (and per-sample ``extra`` lists, e.g. a runner's other
    outputs), concatenated in rank order: sample order, as each rank forwarded its global lanes'
    consecutive ranges. This rank's own results stay as they are; the others' arrive as exact
    copies on ``device`` (where the serial pass on this rank puts its results), dtypes kept."""
    cpu = torch.device("cpu")
    parts = procs.all_gather_object((move_tensors(outputs, cpu), move_tensors(extra, cpu)))
    dest = torch.device(device)
    out: list[Any] = []
    merged: dict[str, list] | None = None
    for r, (outs, ext) in enumerate(parts):
        mine = r == procs.rank
        out.extend(outputs if mine else move_tensors(outs, dest))
        if (extra if mine else ext) is not None:
            merged = merged if merged is not None else {}
            for k, v in (extra if mine else ext).items():
                merged.setdefault(k, []).extend(v if mine else move_tensors(v, dest))
    return out, merged
