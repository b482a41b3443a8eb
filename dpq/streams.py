"""Device backends and lanes.

A :class:`Lane` is one replica's device plus the stream its work is issued on.
Everything above this module asks the lane (or :func:`backend`) for streams, events,
synchronisation, free memory and peer access; nothing above it branches on the device
type. On CPU streams are no-ops, so every code path in dpq runs on a laptop, and several
lanes may share the CPU device (or one GPU: each lane then has its own stream).

Backends: cuda, xpu (torch.xpu), hpu (habana_frameworks, imported only when asked for),
cpu. Invariant kept here: a lane's stream belongs to the lane's device, and work issued
under :meth:`Lane.issue` runs on that stream, in issue order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Backend", "Lane", "backend", "make_lanes", "parse_devices"]


class Backend:
    """Stream, event and memory queries for one device type (the cpu variant: no-ops)."""

    type = "cpu"
    has_streams = False

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def new_stream(self, device: torch.device):
        return None

    def stream_context(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self, device: torch.device):
        return None

    def synchronize(self, device: torch.device) -> None:
        return None

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes. CPU: available and total system memory."""
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
        except (OSError, KeyError, ValueError):
            return 2**40, 2**40

    def can_access_peer(self, a: torch.device, b: torch.device) -> bool:
        return a == b


class _TorchAcceleratorBackend(Backend):
    """cuda and xpu share torch's stream API under ``torch.<type>``."""

    has_streams = True

    def __init__(self, type_: str) -> None:
        self.type = type_

    @property
    def mod(self):
        return getattr(torch, self.type)

    def is_available(self) -> bool:
        mod = getattr(torch, self.type, None)
        return bool(mod is not None and mod.is_available())

    def device_count(self) -> int:
        return self.mod.device_count() if self.is_available() else 0

    def new_stream(self, device: torch.device):
        return self.mod.Stream(device=device)

    def stream_context(self, stream) -> contextlib.AbstractContextManager:
        return self.mod.stream(stream)

    def current_stream(self, device: torch.device):
        return self.mod.current_stream(device)

    def synchronize(self, device: torch.device) -> None:
        self.mod.synchronize(device)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return self.mod.mem_get_info(device)

    def can_access_peer(self, a: torch.device, b: torch.device) -> bool:
        if a == b:
            return True
        if self.type == "cuda":
            return bool(torch.cuda.can_device_access_peer(a.index, b.index))
        return False  # xpu: no peer query in torch; copies go through the runtime


class _HpuBackend(_TorchAcceleratorBackend):
    """Gaudi. Imported lazily: habana_frameworks is absent everywhere but Gaudi hosts."""

    def __init__(self) -> None:
        super().__init__("hpu")

    @property
    def mod(self):
        from habana_frameworks.torch import hpu

        return hpu

    def is_available(self) -> bool:
        try:
            return bool(self.mod.is_available())
        except ImportError:
            return False

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        stats = self.mod.memory_stats(device)
        total = int(stats.get("Limit", 0))
        return total - int(stats.get("InUse", 0)), total


_BACKENDS: dict[str, Backend] = {
    "cpu": Backend(),
    "cuda": _TorchAcceleratorBackend("cuda"),
    "xpu": _TorchAcceleratorBackend("xpu"),
    "hpu": _HpuBackend(),
}


def backend(device: torch.device | str) -> Backend:
    """The backend of ``device``'s type; unknown types are refused by name."""
    type_ = torch.device(device).type
    if type_ not in _BACKENDS:
        raise ValueError(f"dpq: device type {type_!r} is not supported (supported: {', '.join(_BACKENDS)})")
    return _BACKENDS[type_]


@dataclass(eq=False)
class Lane:
    """One replica's device and stream. Lane 0 is home (the caller's module, no copy)."""

    index: int
    device: torch.device
    stream: object | None = field(default=None, repr=False)

    @property
    def backend(self) -> Backend:
        return backend(self.device)

    @property
    def stream_handle(self) -> int:
        """The raw stream pointer as an int (what NCCL takes); 0 = the default stream."""
        return int(getattr(self.stream, "cuda_stream", 0) or 0)

    def issue(self) -> contextlib.AbstractContextManager:
        """Context under which work is queued on this lane's stream."""
        return self.backend.stream_context(self.stream)

    def wait_for_current(self) -> None:
        """Make this lane's stream wait for work already queued on the device's current stream.

        Needed before a lane reads data produced outside it (staged inputs, the home block's
        initial state); a no-op on CPU.
        """
        if self.stream is not None:
            self.stream.wait_stream(self.backend.current_stream(self.device))

    def current_waits_for_me(self) -> None:
        """Make the device's current stream wait for this lane (before handing results back)."""
        if self.stream is not None:
            self.backend.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def free_memory(self) -> int:
        return self.backend.mem_get_info(self.device)[0]


def parse_devices(spec: str | Sequence[str | int | torch.device]) -> list[torch.device]:
    """'0,1,2' / 'cuda:0,cuda:1' / 'cpu,cpu' / [0, 1] -> torch.devices.

    Bare integers mean the first accelerator type that is available (cuda, xpu, hpu),
    as auto-round's ``--device_map 0,1`` does.
    """
    items = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else list(spec)
    if not items:
        raise ValueError("dpq: empty device list; give devices like '0,1' or 'cuda:0,cuda:1' or 'cpu,cpu'")
    out = []
    for item in items:
        if isinstance(item, int) or (isinstance(item, str) and item.isdigit()):
            out.append(torch.device(default_accelerator_type(), int(item)))
        else:
            out.append(torch.device(item))
    return out


def default_accelerator_type() -> str:
    for type_ in ("cuda", "xpu", "hpu"):
        if _BACKENDS[type_].is_available():
            return type_
    return "cpu"


def check_device_exists(device: torch.device) -> str | None:
    """None if ``device`` can be used, else a sentence saying why not."""
    be = _BACKENDS.get(device.type)
    if be is None:
        return f"device {device} has an unsupported type {device.type!r} (use cuda, xpu, hpu or cpu)"
    if device.type == "cpu":
        return None
    if not be.is_available():
        return f"device {device} does not exist: no {device.type} runtime is available on this machine"
    count = be.device_count()
    if device.index is not None and device.index >= count:
        return f"device {device} does not exist: this machine has {count} {device.type} device(s) (0..{count - 1})"
    return None


def make_lanes(devices: Sequence[torch.device | str]) -> list[Lane]:
    """One lane per entry; accelerator lanes get a fresh stream each (also when they share a device)."""
    lanes = []
    for i, dev in enumerate(devices):
        dev = torch.device(dev)
        if dev.type != "cpu" and dev.index is None:
            dev = torch.device(dev.type, 0)
        lanes.append(Lane(index=i, device=dev, stream=backend(dev).new_stream(dev)))
    return lanes

