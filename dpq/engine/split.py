"""The one split of a batch (or a pool) over lanes, and of a lane's slice into micro-steps.

Every part of dpq that divides samples between lanes (the tune loop's iteration batch, the
sharded no-grad passes' pools, across processes the global lanes) uses :func:`contiguous_ranges`,
so every rank and every pass agrees on which lane holds which sample.
"""

from __future__ import annotations

__all__ = ["chunks", "contiguous_ranges"]


def contiguous_ranges(n: int, world: int, align: int = 1) -> list[tuple[int, int]]:
    """``world`` contiguous ``[start, stop)`` ranges covering ``range(n)`` in order: the one
    split of a batch (or a pool) over lanes.

    Boundaries fall on multiples of ``align`` (the last range ends at ``n``); counted in units
    of ``align`` the ranges differ by at most one, earlier lanes taking the extra unit. Lanes
    beyond the number of units get empty ranges ``(n, n)``.
    """
    if world < 1 or align < 1 or n < 0:
        raise ValueError(f"dpq: contiguous_ranges needs n >= 0, world >= 1, align >= 1 (got {n}, {world}, {align})")
    units = -(-n // align)
    base, extra = divmod(units, world)
    out, start = [], 0
    for k in range(world):
        count = base + (1 if k < extra else 0)
        out.append((min(start * align, n), min((start + count) * align, n)))
        start += count
    return out


def chunks(indices: list[int], size: int | None) -> list[list[int]]:
    """``indices`` cut into consecutive pieces of ``size`` (None: one piece): a lane's micro-steps."""
    if not indices:
        return []
    if size is None or size >= len(indices):
        return [indices]
    return [indices[i : i + size] for i in range(0, len(indices), size)]
