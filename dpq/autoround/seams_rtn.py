"""Seam 2, ``iters=0`` per-layer weight searches: ``RTNQuantizer.quantize_block`` (plain RTN) and,
on auto-round 0.16, ``OptimizedRTNQuantizer._quantize_targets`` (optimized RTN, the default at
iters 0; 0.17 runs those through its own search dispatch). Each layer's search runs once on one
lane (a private copy of the layer there; lane 0 is home and works in place) through auto-round's
own ``_quantize_layer_via_rtn``; the result is copied home and installed where serial installs it.
Bitwise serial. Stacked expert-batch searches (MoE) stay on home.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from auto_round.algorithms.quantization.base import BaseQuantizer
from auto_round.algorithms.quantization.rtn.quantizer import OptimizedRTNQuantizer, RTNQuantizer
from auto_round.utils import check_to_quantized, set_module
from auto_round.utils.device_manager import device_manager

from dpq import refusals
from dpq.sharded.shard import bring_home, copy_to_lane, map_over_lanes

from . import patches
from .run import Run
from .seams_common import PhaseSpec, or_idle, run_phase

__all__ = ["opt_rtn_quantize_targets", "rtn_quantize_block"]

class _LaneView:
    """``self`` for auto-round's ``_quantize_layer_via_rtn`` on a lane: the quantizer, except that
    ``model`` is a scratch tree holding the lane's copy (so the result is installed there)."""

    def __init__(self, quantizer, root) -> None:
        object.__setattr__(self, "_q", quantizer)
        object.__setattr__(self, "model", root)

    def __getattr__(self, name):
        return getattr(self._q, name)


def _scratch_root(name: str, module: torch.nn.Module) -> torch.nn.Module:
    root = parent = torch.nn.Module()
    *path, leaf = name.split(".")
    for part in path:
        child = torch.nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, module)
    return root


def _search_refusals(q, targets: Sequence[torch.nn.Module]) -> list[str]:
    reasons = []
    if type(q)._quantize_layer_via_rtn is not BaseQuantizer._quantize_layer_via_rtn:
        reasons.append(refusals.rtn_override(type(q).__name__, "_quantize_layer_via_rtn"))
    if type(q).quantize_layer_outside_block is not BaseQuantizer.quantize_layer_outside_block:
        reasons.append(refusals.rtn_override(type(q).__name__, "quantize_layer_outside_block"))
    if any(not getattr(m, "global_name", None) for m in targets):
        reasons.append(refusals.RTN_NO_GLOBAL_NAME)
    if any(p.device.type == "meta" for m in targets for p in m.parameters()):
        reasons.append(refusals.RTN_ON_META)
    return reasons


def _map_rtn(q, targets: list, disable_opt_rtn, lanes, owners_seen: dict[int, int]) -> None:
    """Run each target's RTN / optimized-RTN search on one lane (``owners_seen``: items per lane index)."""
    home_device = torch.device(device_manager.device)
    via_rtn = BaseQuantizer._quantize_layer_via_rtn

    def run(layer, lane):
        owners_seen[lane.index] = owners_seen.get(lane.index, 0) + 1
        if lane.index == 0:  # home: in place, exactly the serial call
            via_rtn(q, layer, disable_opt_rtn=disable_opt_rtn)
            return None
        name = layer.global_name
        lane_copy = copy_to_lane(layer, lanes[0], lane)
        lane_copy.tuning_device = lane.device
        root = _scratch_root(name, lane_copy)
        via_rtn(_LaneView(q, root), lane_copy, disable_opt_rtn=disable_opt_rtn)
        return lane_copy, root.get_submodule(name)

    def collect(layer, result, lane):
        if result is None:
            return None
        lane_copy, produced = result
        had, before = "tuning_device" in layer.__dict__, layer.__dict__.get("tuning_device")
        new = bring_home(produced, lane_copy, layer, lane_device=lane.device, home_device=home_device)
        for m in {id(x): x for x in (layer, new)}.values():
            if had:
                m.tuning_device = before
            elif "tuning_device" in m.__dict__:
                del m.__dict__["tuning_device"]
        set_module(q.model, layer.global_name, new)
        return None

    def cost(layer):
        return float(sum(p.numel() for p in layer.parameters()))

    map_over_lanes(targets, lanes, run, cost=cost, collect=collect)


def _rtn_phase(run: Run, q, targets: list, disable_opt_rtn, block_name: str, serial: Callable, done):
    """The targets' searches as one phase: mapped over lanes (returning ``done``, the serial call's
    result once every target is installed), else ``serial()`` on home. A lane failure propagates:
    home's lane works in place, so a rerun would not start from serial's state."""
    reasons = _search_refusals(q, targets) if len(targets) > 1 else []
    price = max((sum(p.numel() * p.element_size() for p in m.parameters()) for m in targets), default=0) * 4
    owners_seen: dict[int, int] = {}

    def sharded(lanes):
        _map_rtn(q, targets, disable_opt_rtn, lanes, owners_seen)
        return done

    def per_lane(world: int) -> str:
        return ", ".join(f"lane {k}: {owners_seen.get(k, 0)}" for k in range(world))

    phase = PhaseSpec("search", serial=serial, sharded=sharded, units=len(targets), price=price or None,
                      detail=lambda w: f"{len(targets)} layers ({per_lane(w)})", home="home alone", time_home=False,
                      nested=True,
                      log=lambda w, _d, _r: (("search", w), f"dpq: per-layer weight searches of {block_name} mapped "
                                                           f"over {w} lanes ({per_lane(w)})"))
    return run_phase(run, block_name, phase, reasons=reasons)


def _block_name_of(targets) -> str:
    names = [getattr(m, "global_name", "") for m in targets]
    return names[0].rsplit(".", 2)[0] if names and names[0] else ""


@torch.no_grad()
def rtn_quantize_block(run: Run | None, self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx,
                       input_ids=None, **kwargs):
    run = or_idle(run)
    original = patches.original(RTNQuantizer, "quantize_block")

    def serial():
        return original(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)

    if run.world in ("off", 1):
        return serial()
    targets = [m for _, m in block.named_modules() if check_to_quantized(m)]
    name = getattr(block_ctx, "block_name", "") or _block_name_of(targets)
    return _rtn_phase(run, self, targets, True, name, serial, {})


def opt_rtn_quantize_targets(run: Run | None, self, targets: list) -> None:
    run = or_idle(run)
    original = patches.original(OptimizedRTNQuantizer, "_quantize_targets")
    if run.world in ("off", 1) or not targets:
        return original(self, targets)
    singles = list(targets)
    if self._expert_search_active():
        batches, singles = self._split_expert_batches(targets)
        if batches:  # stacked expert searches: one call per group, on home
            original(self, [m for b in batches for m in b])
    if singles:
        _rtn_phase(run, self, singles, None, _block_name_of(singles), lambda: original(self, singles), None)
    return None
