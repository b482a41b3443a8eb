"""Every proof's pass/fail logic, as a pure function of what a run recorded, so that each is
unit-tested on CPU with the recordings of a good and a bad run (``tests/test_gpu_check.py``).

A verdict is "passed", "failed: <what was seen>" or "not proven: <why this run cannot show it>".
What one GPU cannot show (several GPUs, NCCL between cards) is "not proven", never "passed"; a
correct build must not read "failed" (set-up syncs are outside the iterations counted; a GPU that
keeps up with the host cannot show the host's order), and a broken one must not read "passed".
"""

from __future__ import annotations

import itertools

from dpqlab import parity_stats

# Each proof's name, as summary.json lists it.
ONE_SYNC = "one host sync per iteration (every thread; set-up excluded)"
IDENTICAL = "replicas bitwise identical after every step"
NOT_SERIALIZED = "the host does not serialize lanes (one GPU: lanes' forwards in flight together)"
WORLD1_BITWISE = "CLI world 1 saves the tensors of off, bitwise (compile on)"
WORLD2_PARITY = "CLI world 2 in statistical parity with serial (compile on)"
PRICE = "price covers the allocated peak"
# The GPU finished lane k-1's forward this soon after the host's last launch of it: the GPU kept up
# with the host (launch-bound), so the issue order cannot show whether the host waited.
CAUGHT_UP_US = 50.0


def one_host_sync_per_iteration(iterations: list[dict]) -> str:
    """Each profiled iteration (``trace.Iteration.as_dict``): exactly one readback wait and no
    blocking CUDA call on any thread."""
    if not iterations:
        return "not proven: no iteration was profiled"
    bad = {k: {"readback_waits": it["readback_waits"], "blocking_syncs": it["blocking_syncs"]}
           for k, it in enumerate(iterations) if it["readback_waits"] != 1 or it["blocking_syncs"]}
    return "passed" if not bad else f"failed: iterations with other host syncs than the one readback: {bad}"


def replicas_identical(runs: dict[str, dict]) -> str:
    """Each run ({"steps": steps run, "checked": identical-state checks passed, "mismatch": None or
    what differed}) checked its replicas after every step and found them equal."""
    if not runs:
        return "not proven: no run with several lanes"
    bad = {w: r for w, r in runs.items() if r.get("mismatch") or r["checked"] != r["steps"] or not r["steps"]}
    return "passed" if not bad else f"failed: {bad}"


def host_does_not_serialize_lanes(iterations: list[dict]) -> str:
    """In every iteration, each lane's forward was issued before the previous lane's forward had
    finished on the GPU. On one GPU this shows only that the host does not wait for one lane before
    issuing the next: it says nothing of lanes on several GPUs running side by side."""
    if not iterations:
        return "not proven: no iteration was profiled"
    bad, caught_up = [], []
    for k, it in enumerate(iterations):
        lanes = it["lane_forwards"]
        if len(lanes) < 2:
            return f"not proven: iteration {k} shows {len(lanes)} lane forward(s) with GPU kernels"
        for a, b in itertools.pairwise(lanes):
            if b["first_launch"] >= a["gpu_end"]:
                (caught_up if a["gpu_end"] - a["last_launch"] < CAUGHT_UP_US else bad).append(k)
    if bad:
        return f"failed: the host issued a lane's forward after the previous lane's had ended, iterations {bad}"
    if caught_up:
        return (f"not proven: the GPU kept up with the host (launch-bound) in iterations {caught_up}, so the "
                f"issue order cannot show it")
    return "passed"


def bitwise_saved(off: dict[str, str], world1: dict[str, str], off_again: dict[str, str] | None) -> str:
    """Saved tensors by digest ({name: sha256}): world 1 against off; ``off_again``, a second run of
    off, tells a GPU whose own runs differ (then nothing can be shown bitwise) from a dpq change."""
    if not off:
        return "not proven: off saved no tensors"
    if off_again is not None and off_again != off:
        return "not proven: two runs of auto-round alone saved different tensors on this GPU"
    if world1 == off:
        return "passed"
    differ = sorted(k for k in off.keys() | world1.keys() if off.get(k) != world1.get(k))
    return f"failed: {len(differ)} tensor(s) differ, e.g. {differ[:3]}"


def statistical_parity(diffs: dict[str, list[float]], spreads: dict[str, float], alpha: float) -> str:
    """Paired relative differences of world 2 from serial, held to the bounds of
    ``dpqlab.parity_stats`` (a correct build fails with probability at most ``alpha``)."""
    if not diffs or not all(diffs.values()):
        return "not proven: no pairs"
    k = parity_stats.k_for(len(diffs), alpha)
    result = parity_stats.check(diffs, spreads, k)
    failures = parity_stats.failures(result)
    return "passed" if not failures else f"failed: {failures} (K {k:.2f})"


def price_covers_peak(peak_bytes: int, priced_bytes: int) -> str:
    if peak_bytes <= 0:
        return "not proven: no allocation was measured"
    return "passed" if peak_bytes <= priced_bytes else f"failed: peak {peak_bytes} B > priced {priced_bytes} B"
