"""The one decision per block: how many lanes, on which devices.

``resolve(request)`` returns a :class:`Plan` or raises :class:`PlanRefused` listing every
reason at once (never only the first: a user fixing one reason per run would rerun a long
job many times). ``world='auto'`` never refuses: it keeps the lanes that can be served, falls
back to serial when none beyond home can, and says why. An explicit world refuses before the
block starts. The communicator for the chosen lanes is picked by
``dpq.fallback_p2p.select_communicator``; the exchange policy by the tuner (sign path for pure
SignSGD, full sums otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dpq.streams import backend, check_device_exists, default_accelerator_type, parse_devices

__all__ = ["Plan", "PlanRefused", "PlanRequest", "price_mirror", "resolve", "validate_world"]

SUPPORTED_HOME_TYPES = ("cuda", "xpu", "hpu", "cpu")
MARGIN = 1.2  # headroom over the priced bytes: allocator fragmentation, autograd temporaries


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
    extra_reasons: Sequence[str] = ()  # tuner features dpq cannot split (found by the adapter)
    mirror_bytes: int | None = None  # price of one mirror (see price_mirror); None = not checked


@dataclass
class Plan:
    world: int
    devices: list[torch.device]
    reasons: list[str] = field(default_factory=list)  # why 'auto' kept fewer lanes, or why serial


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
            "Fix: pass e.g. --parallel_quantization 2 (or auto, or off)."
        )
    return world


def price_mirror(block: torch.nn.Module, inputs: Sequence[torch.Tensor], samples_per_iter: int) -> int:
    """Bytes one more lane needs: block weights + fp32 tuning values (rounding value per weight,
    two scales per group: bounded by 2x the weight count in fp32) + activations for its slice
    (a decoder block keeps roughly 16 hidden-sized tensors per token alive for backward)."""
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    tunable = sum(p.numel() for p in block.parameters() if p.dim() == 2) * 4 * 2
    act = 0
    if inputs:
        act = inputs[0].numel() * 4 * 16 * max(1, samples_per_iter)
    return int((weights + tunable + act) * MARGIN)


def _home(request: PlanRequest) -> torch.device:
    home = torch.device(request.home) if request.home is not None else torch.device(default_accelerator_type())
    if home.type != "cpu" and home.index is None:
        home = torch.device(home.type, 0)
    return home


def _candidate_devices(world: int | str, home: torch.device, given) -> list[torch.device]:
    if given is not None:
        return parse_devices(given)
    if home.type == "cpu":
        return [home] * (1 if world == "auto" else int(world))
    be = backend(home)
    devices = [torch.device(home.type, i) for i in range(be.device_count())] or [home]
    devices.sort(key=lambda d: d != home)  # lane 0 is home: the block itself
    return devices if world == "auto" else devices[: int(world)]


def _memory_refusals(devices: list[torch.device], price: int | None, home: torch.device) -> list[tuple[int, str]]:
    """(lane, reason) for each lane whose mirror does not fit; lanes sharing a device add up."""
    if price is None:
        return []
    out, used = [], {}
    for k, dev in enumerate(devices):
        if k == 0 and dev == home:
            continue  # home already holds the block
        used[dev] = used.get(dev, 0) + price
        free = backend(dev).mem_get_info(dev)[0]
        if used[dev] > free:
            out.append((k, f"lane {k} on {dev}: a mirror needs ~{price / 2**30:.2f} GiB (weights + fp32 tuning "
                           f"values + activations + {MARGIN - 1:.0%} margin) but only {free / 2**30:.2f} GiB is free "
                           "for it. Fix: fewer lanes, a smaller --batch_size, or --low_gpu_mem_usage"))
    return out


def resolve(request: PlanRequest) -> Plan:
    world = validate_world(request.world)
    home = _home(request)
    if world == "off":
        return Plan(1, [home], ["parallel quantization is off"])
    reasons = list(request.extra_reasons)
    if home.type not in SUPPORTED_HOME_TYPES:
        reasons.append(f"home device type {home.type!r} is not supported (cuda, xpu, hpu, cpu)")
    devices = _candidate_devices(world, home, request.devices)
    problems = {d: check_device_exists(d) for d in set(devices)}
    missing = [msg for d in devices if (msg := problems[d])]
    reasons += missing
    devices = [d for d in devices if problems[d] is None]
    if world != "auto" and not missing and len(devices) < world:
        reasons.append(f"world {world} needs {world} devices but {len(devices)} were given or found "
                       f"({', '.join(map(str, devices))}). Fix: --parallel_devices with one device per lane "
                       "(e.g. cpu,cpu or 0,1)")
    n = len(devices) if world == "auto" else min(int(world), len(devices))
    if n > request.samples_per_iter:
        reasons.append(f"{n} lanes but only {request.samples_per_iter} samples per iteration (batch_size x "
                       "gradient_accumulate_steps): every lane needs at least one sample. Fix: a smaller world "
                       "or a larger --batch_size")
        n = request.samples_per_iter
    if home.type == "hpu" and n > 1:
        reasons.append("Gaudi's bridge allows one device per process; multi-lane hpu needs a torch.distributed "
                       "process group (HCCL), which dpq does not run yet. Fix: --parallel_quantization off")
        n = 1
    mem = _memory_refusals(devices[:n], request.mirror_bytes, home)
    reasons += [r for _, r in mem]
    if world != "auto":
        if reasons:
            raise PlanRefused(reasons)
        return Plan(n, devices[:n])
    # auto: keep the lanes before the first one that does not fit; serial when a feature forbids it
    if mem:
        n = min(n, mem[0][0])
    if request.extra_reasons or home.type not in SUPPORTED_HOME_TYPES or n <= 1:
        return Plan(1, [home], reasons or ["only one lane available"])
    return Plan(n, devices[:n], reasons)
