"""Under ``torchrun``: which process group auto-round-dp starts, on which devices each process runs.

One table (:data:`SETUPS`), one row per device type of the lanes: the ``init_process_group``
backend string, the module to import first (a backend registered by a plugin), and whether each
process takes its own device indices (``local_rank * L`` onwards, bound with ``set_device``
before the group starts). :func:`process_lanes` picks the row and the devices, :func:`start_group`
runs the row's call sequence. Only the cpu row (gloo) has run, here; none of this has run on a
Gaudi (hpu) or an Intel GPU (xpu), and NCCL only with one rank: ``tests/test_process_backends.py``
checks the call sequence of every row against a recording fake.

* cpu: ``gloo``. Every process's lanes are ``cpu``.
* cuda: ``cpu:gloo,cuda:nccl`` (dpq's object collectives, e.g. the plan agreement, go through
  gloo; the lanes' tensors through NCCL); ``torch.cuda.set_device`` first, since NCCL binds a rank
  to its current device.
* xpu: ``cpu:gloo,xpu:xccl`` (XCCL is built into torch >= 2.8 for Intel GPUs), the same pattern
  as cuda with ``torch.xpu.set_device``.
* hpu: Habana's documented sequence: ``import habana_frameworks.torch.distributed.hccl``, then
  ``init_process_group(backend="hccl")`` (Intel Gaudi docs, PyTorch Scaling Guide, "Distributed
  Backend Initialization": https://docs.habana.ai/en/latest/PyTorch/PyTorch_Scaling_Guide/
  Distributed_Backend_Initialization.html). No device call: the bridge maps each process to the
  Gaudi whose module id is its ``LOCAL_RANK``, read from the launcher's environment ("Gaudi-to-
  process Assignment", same guide: .../Gaudi_Assignment.html), and a process sees that one
  Gaudi as ``hpu`` (one device per process). So every process runs one lane, ``hpu``; several hpu
  lanes in one process stay refused (:data:`dpq.refusals.HPU_MULTI_LANE`).
"""

from __future__ import annotations

import datetime
import importlib
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["SETUPS", "GroupSetup", "device_map", "lane_type", "process_lanes", "start_group"]


@dataclass(frozen=True)
class GroupSetup:
    backend: str  # init_process_group's backend
    register: str | None = None  # imported before init_process_group: it registers the backend
    own_devices: bool = False  # process LOCAL_RANK runs on indices LOCAL_RANK*L.., set_device on the first


SETUPS: MappingProxyType[str, GroupSetup] = MappingProxyType({
    "cpu": GroupSetup("gloo"),
    "cuda": GroupSetup("cpu:gloo,cuda:nccl", own_devices=True),
    "xpu": GroupSetup("cpu:gloo,xpu:xccl", own_devices=True),
    "hpu": GroupSetup("hccl", register="habana_frameworks.torch.distributed.hccl"),
})


def device_map(rest: list[str]) -> tuple[int | None, str | None]:
    """(index in ``rest`` of auto-round's device option's value, the value); (None, None): not given."""
    for i, a in enumerate(rest):
        for flag in ("--device_map", "--device", "--devices"):
            if a == flag and i + 1 < len(rest):
                return i + 1, rest[i + 1]
            if a.startswith(flag + "="):
                return i, a.partition("=")[2]
    return None, None


def lane_type(devices: str | None, rest: list[str], accelerator: str) -> str:
    """The device type of this process's lanes: that of ``--parallel_devices`` (its first
    accelerator entry; bare indices mean ``accelerator``), else cpu when auto-round's device
    option says cpu, else ``accelerator`` (the first available of cuda, xpu, hpu; or cpu)."""
    if devices is not None:
        kinds = [d.strip().split(":")[0].lower() for d in devices.split(",") if d.strip()]
        kinds = [accelerator if k.isdigit() else k for k in kinds]
        return next((k for k in kinds if k != "cpu"), "cpu")
    value = device_map(rest)[1]
    return "cpu" if value is not None and value.strip().lower() == "cpu" else accelerator


def process_lanes(world, devices: str | None, rest: list[str], local_rank: int,
                  accelerator: str) -> tuple[str | None, list[str], str]:
    """Under torchrun: (this process's lane devices, auto-round's arguments, the lanes' device type).

    Each process its own accelerators where the type has indices per process (cuda, xpu): with
    no ``--parallel_devices`` and auto-round's ``--device_map`` a single device or absent, process
    ``local_rank`` runs its L lanes (L = the world, 1 under 'auto') on ``<type>:local_rank*L``
    onwards, its home there too (``--device_map`` rewritten). CPU and hpu lanes: unchanged (cpu is
    every process's; each process sees its own Gaudi as ``hpu``). A device list given is every
    process's (the agreement refuses an accelerator planned by two processes of one host)."""
    kind = lane_type(devices, rest, accelerator)
    at, value = device_map(rest)
    if devices is not None or not SETUPS[kind].own_devices or (value is not None and "," in value):
        return devices, rest, kind
    lanes = world if isinstance(world, int) else 1
    first = local_rank * lanes
    rest = list(rest)
    if at is None:
        rest += ["--device_map", str(first)]
    else:
        rest[at] = rest[at].partition("=")[0] + "=" + str(first) if rest[at].startswith("--") else str(first)
    return ",".join(f"{kind}:{first + k}" for k in range(lanes)), rest, kind


def start_group(kind: str, timeout_s: float, device: str | None) -> None:
    """``init_process_group`` from torchrun's environment for lanes of type ``kind``, with the
    run's timeout (how long a collective waits for a lost rank): the row's module imported
    first, this process's device set first (``device``: its first lane, None: no lane list)."""
    import torch
    import torch.distributed as dist

    setup = SETUPS[kind]
    if setup.register is not None:
        importlib.import_module(setup.register)  # registers the backend; must precede init_process_group
    if setup.own_devices and device is not None and device.startswith(kind):
        getattr(torch, kind).set_device(torch.device(device))  # the rank's collectives bind to its current device
    dist.init_process_group(backend=setup.backend, timeout=datetime.timedelta(seconds=timeout_s))
