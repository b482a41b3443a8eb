"""What this machine and this torch build offer lanes, read without a model and without starting
an accelerator (no CUDA context is made: device counts only).

:class:`Machine` is a frozen snapshot: the torch version, the accelerator types the build was
compiled for, the visible devices of each type, and whether an NVIDIA driver is present whatever
torch sees (a CPU-only torch on a GPU machine is then a wrong install, not a wrong device list).
The flag checks (:mod:`dpq.planning.spec`) read it to refuse lanes that cannot exist here and to suggest
lanes that do.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dpq.streams import backend

__all__ = ["ACCELERATORS", "Machine", "device_name", "device_names"]

EXAMPLE_LANES = 8  # the most lanes an example lane list in a message names
ACCELERATORS = ("cuda", "xpu", "hpu")  # in the order a bare index picks them (dpq.streams.default_accelerator_type)


def _built_types() -> frozenset[str]:
    """The accelerator types this torch build supports (not whether a device is present)."""
    built = set()
    if torch.backends.cuda.is_built():
        built.add("cuda")  # CUDA or ROCm (HIP builds answer as cuda)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "_is_compiled", lambda: False)():
        built.add("xpu")
    if importlib.util.find_spec("habana_frameworks") is not None:  # Gaudi's bridge provides hpu
        built.add("hpu")
    return frozenset(built)


def _nvidia_driver() -> bool:
    return os.path.isdir("/proc/driver/nvidia/gpus") or shutil.which("nvidia-smi") is not None


@dataclass(frozen=True)
class Machine:
    torch: str  # torch.__version__, e.g. 2.13.0+cpu
    built: frozenset[str] = frozenset()  # accelerator types the build supports
    counts: Mapping[str, int] = field(default_factory=dict)  # visible devices per accelerator type
    nvidia_driver: bool = False  # an NVIDIA driver is installed, whatever torch sees

    @classmethod
    def detect(cls) -> Machine:
        built = _built_types()
        counts = {t: backend(t).device_count() if backend(t).is_available() else 0 for t in built}
        return cls(torch.__version__, built, counts, _nvidia_driver())

    def count(self, device_type: str) -> int:
        """Visible devices of ``device_type`` (the CPU is one device)."""
        return 1 if device_type == "cpu" else self.counts.get(device_type, 0)

    @property
    def accelerator(self) -> str | None:
        """The first accelerator type with a visible device (what a bare index names), None: none."""
        return next((t for t in ACCELERATORS if self.count(t) > 0), None)

    def example_lanes(self, lanes: int) -> str:
        """A lane device list of up to ``lanes`` devices (at least 2, at most :data:`EXAMPLE_LANES`:
        an example is never sized by the request) that exist here: the visible accelerators, else
        CPU lanes."""
        lanes = max(2, min(lanes, EXAMPLE_LANES))
        kind = self.accelerator
        if kind is None:
            return ",".join(["cpu"] * lanes)
        return ",".join(f"{kind}:{i}" for i in range(min(lanes, self.count(kind))))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    """A device's product name (an accelerator's, as its runtime says; the CPU's model); "" when the
    device is not there."""
    if device.type == "cpu":
        return _cpu_name()
    be = backend(device)
    if not be.is_available() or (device.index or 0) >= be.device_count():
        return ""
    get = getattr(be.mod, "get_device_name", None)
    return str(get(device)) if get is not None else device.type


def device_names(devices: object) -> dict[str, str]:
    """The names of the lane devices ``devices`` (a lane device list as given; None: the CPU and every
    visible accelerator), by device."""
    from dpq.planning.lane_devices import parse_device_spec

    if devices is None:
        kind = Machine.detect().accelerator
        listed = [torch.device("cpu")] + ([torch.device(kind, i) for i in range(backend(kind).device_count())]
                                         if kind else [])
    else:
        listed = [e.device for e in parse_device_spec(devices) if e.device is not None]
    return {str(d): device_name(d) for d in dict.fromkeys(listed)}
