"""Lane device lists and worlds as a user writes them, parsed and checked (below the plan: ``dpq.planning.spec``
and ``dpq.planning.plan`` both read them; it needs no block and no model).

:func:`parse_device_spec` parses every entry of a device list on its own, so every malformed one is
named at once; :func:`entry_problem` says why a parsed entry cannot be a lane here;
:func:`lane_device_errors` says it for a whole list (a launcher's check before it binds a device);
:func:`validate_world` reads the world setting.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dpq import refusals
from dpq.streams import backend, check_device_exists, default_accelerator_type

__all__ = ["MAX_DEVICE_INDEX", "DeviceEntry", "entry_problem", "lane_device_errors", "parse_device_spec",
           "validate_world"]

_DEVICE_RE = re.compile(r"(cuda|xpu|hpu|cpu)(?::([0-9]+))?|([0-9]+)")
MAX_DEVICE_INDEX = 127  # torch.device stores its index in 8 bits: 'cuda:256' becomes cuda:0


@dataclass
class DeviceEntry:
    """One entry of a lane device list as written. ``device`` is None when it is malformed
    (``error`` says why); ``bare_index`` when it was a bare integer (an accelerator index)."""

    raw: str
    device: torch.device | None
    error: str | None = None
    bare_index: bool = False


def parse_device_spec(spec: str | Sequence[str | int | torch.device], caller: str = "cli") -> list[DeviceEntry]:
    """Every entry of ``'0,1' / 'cuda:0,cuda:1' / 'cpu,cpu' / [0, 'cpu', torch.device(...)]``,
    each parsed on its own, so that every malformed one can be named at once. An empty list
    comes back as one malformed entry. ``cpu:0`` is ``cpu``; accelerator entries without an
    index are index 0. Bare integers name an index of the first available accelerator type
    (cuda, xpu, hpu), as auto-round's ``--device_map 0,1`` does; with none, they stay indices
    with ``device`` on the CPU and ``bare_index`` set, so that :func:`resolve` can say so."""
    if isinstance(spec, str):
        items = spec.split(",")
    elif isinstance(spec, (int, torch.device)):  # one lane's device, not in a list
        items = [spec]
    else:
        try:
            items = list(spec)
        except TypeError:  # not a list of devices at all (a float, an object)
            return [DeviceEntry(str(spec), None, refusals.malformed_device_entry(spec, spec, caller))]
    if not items or (isinstance(spec, str) and not spec.strip()):
        return [DeviceEntry("", None, refusals.empty_device_list(caller))]  # no entry to name
    out = []
    for item in items:
        index = item if isinstance(item, int) and not isinstance(item, bool) else None
        if isinstance(item, str) and (m := _DEVICE_RE.fullmatch(item.strip())):
            index = int(m.group(2) or m.group(3) or 0)
        if index is not None and index > MAX_DEVICE_INDEX:
            out.append(DeviceEntry(str(item), None, refusals.device_index_too_large(spec, str(item).strip(), index,
                                                                                    MAX_DEVICE_INDEX, caller)))
            continue
        if isinstance(item, torch.device):
            dev = item
        elif isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            dev = torch.device(default_accelerator_type(), item)
            out.append(DeviceEntry(str(item), dev, bare_index=True))
            continue
        elif isinstance(item, str) and (m := _DEVICE_RE.fullmatch(item.strip())):
            if m.group(3) is not None:
                out.append(DeviceEntry(item.strip(), torch.device(default_accelerator_type(), int(m.group(3))),
                                       bare_index=True))
                continue
            dev = torch.device(m.group(1), int(m.group(2))) if m.group(2) else torch.device(m.group(1))
        else:
            out.append(DeviceEntry(str(item), None, refusals.malformed_device_entry(spec, item, caller)))
            continue
        if dev.type == "cpu" and dev.index == 0:
            dev = torch.device("cpu")
        elif dev.type != "cpu" and dev.index is None:
            dev = torch.device(dev.type, 0)
        out.append(DeviceEntry(str(item), dev))
    return out


def lane_device_errors(spec) -> list[str]:
    """Why entries of a lane device list cannot be used on this machine (malformed, or no such
    device here), in the plan's words; empty: every one exists. Needs no model, so a launcher can
    refuse before it binds a device or starts a process group; that lane 0 is the block's own
    device is the plan's check (it needs the block)."""
    problems: dict = {}
    return list(dict.fromkeys(p for e in parse_device_spec(spec) if (p := entry_problem(0, e, None, problems))))


def entry_problem(k: int, e: DeviceEntry, home: torch.device | None, problems: dict,
                   caller: str = "cli") -> str | None:
    """Why lane ``k`` (entry ``e``) cannot be used, or None (``home`` None: lane 0 is not checked against it)."""
    if e.error:
        return e.error
    dev = e.device
    if e.bare_index and dev.type == "cpu":
        return refusals.no_accelerator_for_index(e.raw)
    if dev.type == "cpu" and dev.index is not None and dev.index >= backend(dev).device_count():
        return refusals.not_a_cpu_index(str(dev))  # (a backend of logical CPU devices counts more than one)
    if dev not in problems:
        problems[dev] = check_device_exists(dev)
    if problems[dev]:
        return refusals.device_missing(problems[dev], caller)
    if k == 0 and home is not None and dev != home:
        return refusals.lane0_not_home(str(dev), str(home), caller)
    return None


def validate_world(world: object, caller: str = "cli") -> int | str:
    """'off' | 'auto' | int >= 1 (ints may come as strings from a CLI). ``caller``: how the error's
    fix names the world (:attr:`PlanRequest.caller`)."""
    if isinstance(world, str):
        w = world.strip().lower()
        if w in ("off", "auto"):
            return w
        if re.fullmatch(r"[0-9]+", w):  # ASCII digits only: '²'.isdigit() is True but int('²') fails
            world = int(w)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"dpq: {refusals.bad_world(world, caller)}")
    return world
