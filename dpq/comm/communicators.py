"""Which communicator a run's lanes use, and building it: the one place that picks one.

:func:`choose_communicator` is the plan's choice from the lane devices alone (a name and a
one-line reason; ``dpq.planning.plan.Plan.communicator``); :func:`make_communicator` builds a named one
over the lanes; :func:`select_communicator` does both (or takes a forced name). The registry
:data:`COMMUNICATORS` maps each name to its class: the copy communicators of
:mod:`dpq.fallback_p2p` and the NCCL ones of :mod:`dpq.nccl_comm`. The process-group
communicator (:mod:`dpq.comm.process_group`) wraps one of these for the lanes inside a process and is
built by the session, which has the process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dpq import refusals
from dpq.comm import nccl_lifecycle
from dpq.comm.comm_base import Communicator, CommunicatorBase
from dpq.fallback_p2p import HostStagedCommunicator, LocalCommunicator, PeerCopyCommunicator, XpuCopyCommunicator
from dpq.nccl_comm import CupyNcclCommunicator, TorchNcclCommunicator
from dpq.streams import Lane, backend, device_key

__all__ = ["COMMUNICATORS", "build_planned", "choose_communicator", "make_communicator", "pair_without_peer",
           "register_communicator", "select_communicator"]

COMMUNICATORS: dict[str, type[CommunicatorBase]] = {
    "local": LocalCommunicator,
    "p2p": PeerCopyCommunicator,
    "host": HostStagedCommunicator,
    "xpu-copy": XpuCopyCommunicator,
    "cupy-nccl": CupyNcclCommunicator,
    "torch-nccl": TorchNcclCommunicator,
}


def register_communicator(name: str, kind: type[CommunicatorBase] | None) -> type[CommunicatorBase] | None:
    """``kind`` is the communicator ``name`` from now on (None: ``name`` is gone); returns what it
    replaces. The declared seam for a simulated communicator (the timeline model's NCCL)."""
    before = COMMUNICATORS.pop(name, None)
    if kind is not None:
        COMMUNICATORS[name] = kind
    return before


def pair_without_peer(devices: Sequence[torch.device],
                      peer: Callable[[torch.device, torch.device], bool] | None = None
                      ) -> tuple[torch.device, torch.device] | None:
    """The first pair of distinct devices in ``devices`` of which the first cannot reach the second
    directly (``peer(a, b)``; default: the backend's answer), or None when every pair can."""
    devices = list({device_key(d): d for d in devices}.values())
    peer = peer or (lambda a, b: backend(a).can_access_peer(a, b))
    return next(((a, b) for a in devices for b in devices if a != b and not peer(a, b)), None)


def choose_communicator(devices: Sequence[torch.device]) -> tuple[str, str]:
    """(communicator name, one-line reason) for lanes on ``devices`` (in lane order); the plan's
    choice (``dpq.planning.plan.Plan.communicator``). Raises ValueError for lanes no communicator joins."""
    devices = [torch.device(d) for d in devices]
    world = len(devices)
    if world == 1:
        return "local", "one lane: nothing to exchange"
    if len({d.type for d in devices}) == 1:
        named = backend(devices[0]).communicator_for(devices)  # a simulated backend's own (dpq.streams)
        if named is not None:
            return named
    keys = {device_key(d) for d in devices}
    if len(keys) == 1:
        return "local", f"all {world} lanes share {devices[0]}: sums stay on that device"
    types = {d.type for d in devices}
    if "hpu" in types:
        raise ValueError(f"dpq: {refusals.HPU_MULTI_LANE}")
    if len(types) > 1:
        return "host", f"lanes mix device types ({', '.join(sorted(types))}): sums go through host memory"
    if types == {"xpu"}:
        return "xpu-copy", f"{world} xpu lanes: oneCCL has no in-process multi-device API, so device-to-device copies"
    if types == {"cuda"}:
        if len(keys) == world:
            ids = [index for _, index in (device_key(d) for d in devices)]
            # dpq.comm.nccl_lifecycle: once NCCL failed for any of these GPUs (an abort, a failed init), no
            # NCCL kind runs on them again in this run: copies, which need no init and cannot hang in NCCL
            failed = nccl_lifecycle.failed_comm_sets(ids)
            if failed:
                why = (f"{world} distinct GPUs, but NCCL over cuda devices {list(failed[0].device_ids)} failed earlier "
                       f"in this run ({failed[0].failure}), so no NCCL kind is used for them again in this process")
            else:
                kinds = sorted((c for c in COMMUNICATORS.values() if c.nccl), key=lambda c: c.priority)
                kind = next((c for c in kinds if c.available()), None)
                if kind is not None:
                    return kind.name, kind.chosen_because.format(world=world, name=kind.name)
                why = f"{world} distinct GPUs but no NCCL ({', '.join(c.name for c in kinds)}: none available here)"
        else:
            why = f"{world} lanes on {len(keys)} GPUs, some shared (NCCL takes one GPU per rank)"
        if pair_without_peer(devices) is None:
            return "p2p", f"{why}; every GPU pair has peer access: device-to-device copies"
        return "host", f"{why}; not every GPU pair has peer access: sums go through pinned host memory"
    return "host", f"lanes on {len(keys)} distinct {types.pop()} devices: sums go through host memory"


def make_communicator(name: str, lanes: Sequence[Lane], order: str = "canonical") -> Communicator:
    """The communicator ``name`` (the plan's choice) over ``lanes``, summing in ``order`` where the kind
    has it (``orders``; Note [canonical or native order] in dpq.planning.plan)."""
    lanes = list(lanes)
    kind = COMMUNICATORS[name]
    kw = {"order": order} if order != "canonical" and order in kind.orders else {}
    if kind.shares_handles:
        # the run's handles for these devices, made once (e.g. NCCL's: close_communicators destroys them)
        return kind(lanes, shared=True, **kw)
    return kind(lanes, **kw)


def build_planned(name: str, reason: str, lanes: Sequence[Lane], order: str = "canonical") -> tuple[Communicator, str]:
    """The planned communicator ``name`` over ``lanes`` and its reason; where that kind's set-up fails
    in the way it declares (``setup_failure``: e.g. an NCCL init, remembered for the run by
    :mod:`dpq.comm.nccl_lifecycle`), the one chosen on the lanes now, with its own reason."""
    try:
        return make_communicator(name, lanes, order), reason
    except COMMUNICATORS[name].setup_failure:
        return select_communicator(lanes)


def select_communicator(lanes: Sequence[Lane], prefer: str | None = None) -> tuple[Communicator, str]:
    """The communicator for ``lanes`` and a one-line reason.

    Cheap to call once per block: the NCCL communicators (``ncclCommInitAll``) are made once
    per device tuple per run and shared by every call's wrapper, which reads each call's
    streams from the lanes it was given. :func:`close_communicators` destroys them (dpq's
    ``disable()`` calls it). ``prefer`` forces one by name (benchmarks, tests); a forced
    choice the lanes cannot take fails in that communicator's constructor with its own reason.
    """
    lanes = list(lanes)
    if not lanes:
        raise ValueError("dpq: select_communicator needs at least one lane")
    if prefer is None:
        name, reason = choose_communicator([lane.device for lane in lanes])
        return make_communicator(name, lanes), reason
    if prefer not in COMMUNICATORS:
        raise ValueError(f"dpq: unknown communicator {prefer!r}; choose from {', '.join(COMMUNICATORS)}")
    hpus = {device_key(lane.device) for lane in lanes if lane.device.type == "hpu"}
    if hpus and len({device_key(lane.device) for lane in lanes}) > 1:
        raise ValueError(f"dpq: {refusals.HPU_MULTI_LANE}")
    return make_communicator(prefer, lanes), f"{prefer}: forced by prefer={prefer!r}"
