"""dpq: data-parallel AutoRound block tuning across every accelerator of one machine.

The runtime (streams, comms, mirror, tune_loop, exchange, plan) never imports auto-round;
``dpq.parallel_tune`` and ``dpq.autoround`` do, lazily, on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["parallel_tune", "plan_for"]


def __getattr__(name: str):
    if name in ("parallel_tune", "ParallelTuneResult"):
        from dpq.autoround import api

        return getattr(api, name)
    if name == "plan_for":  # what this machine would get per world (auto-round-dp --parallel_plan)
        from dpq.autoround import plan_screen

        return plan_screen.plan_for
    raise AttributeError(f"module 'dpq' has no attribute {name!r}")
