"""The one decision per block: how many lanes, on which devices, talking through what.

``resolve(request)`` returns a :class:`Plan` or raises :class:`PlanRefused` listing every
reason at once (never the first one only: a user fixing one reason per run would rerun a long
job many times). ``world='auto'`` never refuses: it keeps what can be served and says why the
rest was dropped; an explicit world refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dpq.streams import check_device_exists, default_accelerator_type, parse_devices

__all__ = ["Plan", "PlanRefused", "PlanRequest", "resolve", "validate_world"]


class PlanRefused(ValueError):
    """An explicitly requested world cannot be served. ``reasons`` holds every reason."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = list(reasons)
        body = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"dpq: the requested parallel quantization cannot run:\n{body}")


@dataclass
class PlanRequest:
    world: int | str = "auto"  # int >= 1, 'auto' or 'off'
    devices: Sequence[str | int | torch.device] | str | None = None
    samples_per_iter: int = 8
    home: torch.device | str | None = None
    extra_reasons: Sequence[str] = ()  # refusals found by the caller (tuner features dpq cannot split)


@dataclass
class Plan:
    world: int
    devices: list[torch.device]
    reasons: list[str] = field(default_factory=list)  # why 'auto' kept fewer lanes, or why serial

    @property
    def parallel(self) -> bool:
        return self.world > 1


def validate_world(world: object) -> int | str:
    """'off' | 'auto' | int >= 1 (ints may come as strings from a CLI)."""
    if isinstance(world, str):
        w = world.strip().lower()
        if w in ("off", "auto"):
            return w
        if w.isdigit():
            world = int(w)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(
            f"dpq: world must be 'off', 'auto' or an integer >= 1, got {world!r}. "
            "Fix: pass e.g. --parallel_quantization 2 (or auto)."
        )
    return world


def _default_devices(world: int | str, home: torch.device) -> list[torch.device]:
    if home.type == "cpu":
        n = 1 if world == "auto" else int(world)
        return [torch.device("cpu")] * n
    from dpq.streams import backend

    count = backend(home).device_count()
    devices = [torch.device(home.type, i) for i in range(count)]
    # home first: lane 0 is the block itself
    devices.sort(key=lambda d: d != home)
    return devices if world == "auto" else devices[: int(world)]


def resolve(request: PlanRequest) -> Plan:
    world = validate_world(request.world)
    home = torch.device(request.home) if request.home is not None else torch.device(default_accelerator_type())
    if home.type != "cpu" and home.index is None:
        home = torch.device(home.type, 0)
    if world == "off":
        return Plan(1, [home], ["parallel quantization is off"])
    reasons = list(request.extra_reasons)
    if request.devices is not None:
        devices = parse_devices(request.devices)
    else:
        devices = _default_devices(world, home)
    bad = [msg for d in devices if (msg := check_device_exists(d))]
    reasons += bad
    devices = [d for d in devices if check_device_exists(d) is None]
    if world != "auto" and len(devices) < world and not bad:
        reasons.append(
            f"world {world} needs {world} devices but only {len(devices)} were given/found ({devices}); "
            "Fix: pass --parallel_devices with one device per lane (e.g. cpu,cpu or 0,1)"
        )
    n = len(devices) if world == "auto" else min(int(world), len(devices))
    if n > request.samples_per_iter:
        msg = (
            f"{n} lanes but only {request.samples_per_iter} samples per iteration (batch_size x "
            "gradient_accumulate_steps): every lane needs at least one sample. Fix: lower the world "
            "or raise --batch_size"
        )
        if world == "auto":
            n = request.samples_per_iter
            reasons.append(msg)
        else:
            reasons.append(msg)
    if home.type == "hpu" and n > 1:
        reasons.append(
            "Gaudi's bridge allows one device per process; multi-lane hpu needs a torch.distributed process "
            "group (HCCL), which dpq does not run in-process yet. Fix: run with --parallel_quantization off"
        )
    refusals = [r for r in reasons if r not in bad or world != "auto"]
    if world != "auto" and refusals:
        raise PlanRefused(refusals)
    if world == "auto" and request.extra_reasons:
        return Plan(1, [home], reasons)
    if world == "auto" and home.type == "hpu":
        n = 1
    return Plan(max(1, n), devices[: max(1, n)] or [home], reasons)
