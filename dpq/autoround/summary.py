"""The end of an auto-round-dp run, said through auto-round's logger (above any live progress bar):
the wall time and the time per phase, the blocks per world, the per-block table, every fallback with
its reason, the peak memory per lane device, and ``auto``'s predicted against its achieved time per
iteration. Rank 0 says it, once per run (:func:`log_summary`)."""

from __future__ import annotations

import resource
from collections import Counter

import torch

__all__ = ["log_summary", "peak_memory", "summary_lines"]


def _table(records) -> list[str]:
    lines = [f"{'block':<28} {'world':>5} {'seconds':>8} {'exchange MB':>12}  note"]
    for r in records:
        note = "fell back to serial" if r.fell_back else (r.communicator or (r.reasons[0] if r.reasons else ""))
        lines.append(f"{r.name:<28} {r.world:>5} {r.seconds:>8.2f} {r.wire_bytes / 1e6:>12.2f}  {note}")
    total = sum(r.seconds for r in records)
    lines.append(f"{'total':<28} {'':>5} {total:>8.2f} {sum(r.wire_bytes for r in records) / 1e6:>12.2f}")
    return lines


def peak_memory(devices) -> dict[str, str]:
    """Peak memory per lane device, said with what it measures: an accelerator's peak allocated by
    torch in this process; the CPU's is the process's peak resident memory, which CPU lanes share."""
    out = {}
    for name in dict.fromkeys(map(str, devices)):
        device = torch.device(name)
        if device.type == "cpu":
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            out[name] = f"{rss / 2**30:.2f} GiB (the process's peak resident memory, shared by its CPU lanes)"
        else:
            mod = getattr(torch, device.type, None)
            peak = getattr(mod, "max_memory_allocated", None)
            out[name] = f"{peak(device) / 2**30:.2f} GiB allocated at peak" if peak is not None else "not measured"
    return out


def _per_iteration(records) -> list[str]:
    lines = []
    for r in records:
        iters = len(r.losses)
        if r.predicted_s and r.measured_s is not None and iters:
            predicted = r.predicted_s.get(r.world, r.predicted_s.get(str(r.world)))
            if predicted is not None:
                lines.append(f"  {r.name} (world {r.world}): predicted {predicted / iters * 1e3:.1f} ms, achieved "
                             f"{r.measured_s / iters * 1e3:.1f} ms")
    return lines


def summary_lines(records, phases: dict[str, float], wall_s: float, failure: BaseException | None = None) -> list[str]:
    """The summary's lines for the run's block ``records`` and ``phases`` (seconds per phase)."""
    ended = "finished" if failure is None else f"stopped ({type(failure).__name__})"
    lines = [f"dpq summary: the run {ended} after {wall_s:.1f} s"
             + (" (phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()) + ")" if any(phases.values())
                else "")]
    if records:
        worlds = Counter(r.world for r in records)
        lines.append("blocks per world: " + ", ".join(f"world {w}: {n}" for w, n in sorted(worlds.items())))
        lines += _table(records)
    fallbacks = [r for r in records if r.fell_back]
    lines.append(f"fallbacks to serial: {len(fallbacks)}" + "".join(f"\n  {r.name}: {'; '.join(r.reasons)}"
                                                                     for r in fallbacks))
    devices = [d for r in records for d in r.devices]
    if devices:
        lines.append("peak memory per lane device: " + "; ".join(f"{d} {m}" for d, m in peak_memory(devices).items()))
    timed = _per_iteration(records)
    lines.append("time per iteration, auto's cost model predicted vs achieved:" + ("\n" + "\n".join(timed) if timed
                 else " none (no block's world was chosen by the cost model)"))
    return lines


def log_summary(wall_s: float, failure: BaseException | None = None) -> None:
    """Say the summary of the run that just ended through auto-round's logger."""
    from auto_round.logger import logger

    from . import integration, seams_common

    logger.info("\n".join(summary_lines(integration.run_summary(), seams_common.phase_seconds(), wall_s, failure)))
