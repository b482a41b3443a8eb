"""Seam 4, AWQ: the smoothing grid search (shard and reduce) and the clip search (map).

``AWQTransform._grid_search_scales`` runs auto-round's own loop on home (candidate scales, QDQ of
the balance weights, the comparison that picks the point); only the replays of the cached parent
calls move to lanes (``_run_parent_samples`` for the reference outputs, ``_compute_parent_loss``
per grid point). Lane k replays the k-th contiguous range of cached calls on a mirror of the
parent and returns one squared-error SUM per (micro) call; home adds the terms in serial's call
order and divides by the element count: the exact operation sequence of serial's loss, so every
point's loss and the point chosen are bitwise serial's (per-lane partial sums would reassociate
the fp32 sum and could flip a near-tie). ``_clip_block``: every balance layer's
``_compute_best_clip`` runs once on one lane first and the patched ``_compute_best_clip`` hands
the result to auto-round's loop (checked against the weight's storage and version and the
features' identity). Anything else (no cached parent calls, hooks on the parent, weights on
several devices, a layer clipped twice) runs on home. Bitwise serial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from auto_round.algorithms.transforms.awq.base import AWQTransform
from auto_round.utils.model import move_to_device

from dpq import refusals
from dpq.engine.split import contiguous_ranges
from dpq.mirror import ReplicaSet
from dpq.planning.plan import MARGIN
from dpq.sharded.shard import copy_to_lane, map_over_lanes, shard_forward

from . import patches
from .run import Run
from .seams_common import (
    HOOK_DICTS,
    OnLaneFailure,
    PhaseSpec,
    hook_name,
    mirror_refusals,
    or_idle,
    run_phase,
)

__all__ = ["clip_block", "compute_best_clip", "compute_parent_loss", "grid_search_scales", "run_parent_samples"]

@dataclass
class _AwqGrid:
    """One AWQ grid search (one mapping) sharded over lanes: lane k replays the cached parent calls
    ``kwargs_list[ranges[k][0]:ranges[k][1]]`` on ``parents[k]`` (lane 0: the home parent)."""

    parent: torch.nn.Module
    kwargs_list: list
    lanes: list
    replicas: object
    balance: list  # (home balance layer, [its mirror on lane k, k >= 1])
    refs: list | None = None  # per cached call: the reference outputs of its (micro) calls, on its lane
    points: int = 0  # grid points evaluated


def _awq_block_name(pre, mapping) -> str:
    for name, mappings in getattr(pre, "_block_mappings", {}).items():
        if any(m is mapping for m in mappings):
            return name
    return getattr(mapping, "parent_name", "") or ""


def _awq_grid_refusals(mapping, kwargs_list) -> list[str]:
    """Why this mapping's grid search must replay its samples on home alone."""
    parent = mapping.parent
    reasons = []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        reasons.append(refusals.PASS_DIST_ACTIVE)
    if not any(True for _ in parent.parameters()):
        reasons.append(refusals.AWQ_NO_WEIGHTS)
    reasons.extend(mirror_refusals(parent, "parent"))
    hooked = [f"{n or '<parent>'}:{hook_name(fn)}" for n, m in parent.named_modules()
              for d in (*HOOK_DICTS, "_backward_hooks", "_backward_pre_hooks") for fn in getattr(m, d, {}).values()]
    if hooked:  # a replay on a mirror would fire them there, not on home
        reasons.append(refusals.awq_parent_hooks(sorted(set(hooked))))
    inside = {id(m) for m in parent.modules()}
    if any(id(bl) not in inside for bl in mapping.balance_layers):
        reasons.append(refusals.AWQ_BALANCE_OUTSIDE)
    if not all(isinstance(e, tuple) and len(e) == 2 for e in kwargs_list):
        reasons.append(refusals.AWQ_CALLS_NOT_PAIRS)
    return reasons


def _awq_grid_price(mapping, kwargs_list) -> int:
    weights = sum(p.numel() * p.element_size() for p in mapping.parent.parameters())
    act = 0
    for entry in kwargs_list[:1]:
        act = sum(t.numel() * 4 for t in entry[0] if isinstance(t, torch.Tensor))
    return int((weights + 3 * act * max(1, len(kwargs_list))) * MARGIN)


def grid_search_scales(run: Run | None, self, mapping, x_mean):
    """AWQ's grid search with its sample replays sharded: auto-round's own loop (candidate scales,
    QDQ of the balance weights, comparison, choice) runs on home unchanged; only the replays of the
    cached parent calls (the reference pass and each grid point's loss) run lane by lane."""
    run = or_idle(run)
    original = patches.original(AWQTransform, "_grid_search_scales")
    kwargs_list = self._parent_args_cache.get(mapping.parent, [])
    if run.world in ("off", 1) or run.seams.awq_grid is not None or len(kwargs_list) < 2:
        return original(self, mapping, x_mean)
    block = _awq_block_name(self, mapping)
    reasons = _awq_grid_refusals(mapping, kwargs_list)
    label = f"AWQ grid search of {mapping.smooth_name}"
    points = [0]  # grid points evaluated by the sharded run

    def sharded(lanes):
        names = {id(m): n for n, m in mapping.parent.named_modules()}
        tuned = [f"{names[id(bl)]}.weight".lstrip(".") for bl in mapping.balance_layers]
        saved = [bl.weight.data for bl in mapping.balance_layers]  # the loop swaps .data; put these back on failure
        ctx = None
        try:
            replicas = ReplicaSet(mapping.parent, lanes, tuned=tuned, share_frozen=True)
            ctx = _AwqGrid(mapping.parent, kwargs_list, lanes, replicas,
                           [(bl, [m.get_submodule(names[id(bl)]) for m in replicas.modules[1:]])
                            for bl in mapping.balance_layers])
            run.seams.awq_grid = ctx
            out = original(self, mapping, x_mean)
            points[0] = ctx.points
            return out
        except BaseException:
            for bl, data in zip(mapping.balance_layers, saved, strict=True):
                bl.weight.data = data
            raise
        finally:
            run.seams.awq_grid = None
            if ctx is not None:
                ctx.replicas.close(collect=not all(lane.device.type == "cpu" for lane in lanes))  # R5

    def detail(world: int) -> str:
        per_lane = ", ".join(f"lane {k}: {b - a}" for k, (a, b) in enumerate(contiguous_ranges(len(kwargs_list),
                                                                                                world)))
        return f"{label}: {points[0]} grid points, cached calls per lane ({per_lane})"

    phase = PhaseSpec("search", serial=lambda: original(self, mapping, x_mean), sharded=sharded,
                      units=len(kwargs_list), price=None if reasons else _awq_grid_price(mapping, kwargs_list),
                      detail=detail, home=f"{label} on home",
                      log=lambda w, _d, _r: (("awq_grid", w), f"dpq: AWQ grid-search replays of {block} sharded over "
                                                             f"{w} lanes"),
                      failure=OnLaneFailure(f"the {label}", "weights",
                                            lambda n, err: refusals.awq_lane_failed(label, block, n, err)))
    return run_phase(run, block, phase, reasons=reasons)


def _awq_ctx_for(run: Run, parent, kwargs_list):
    ctx = run.seams.awq_grid
    if ctx is None or parent is not ctx.parent or kwargs_list is not ctx.kwargs_list:
        return None
    return ctx


def run_parent_samples(run: Run | None, self, parent, kwargs_list, offload_to_cpu=False):
    """The reference replay, sharded: lane k runs auto-round's own replay on its mirror for its
    cached calls; the outputs stay on the lane (the losses are computed there)."""
    original = patches.original(AWQTransform, "_run_parent_samples")
    ctx = _awq_ctx_for(or_idle(run), parent, kwargs_list)
    if ctx is None or ctx.refs is not None:
        return original(self, parent, kwargs_list, offload_to_cpu)

    def fwd(module, lane, start, stop):
        return [original(self, module, kwargs_list[j:j + 1], offload_to_cpu) for j in range(start, stop)]

    ctx.refs = shard_forward(ctx.replicas.modules, ctx.lanes, len(kwargs_list), fwd)
    return [t for per_call in ctx.refs for t in per_call]


def _awq_lane_sums(self, module, kwargs_list, refs, start, stop):
    """Per cached call, per (micro) call: (sum of squared errors as a 0-d fp32 tensor, element count),
    computed exactly as ``AWQTransform._compute_parent_loss`` computes each term; None on a count
    mismatch (serial returns inf then)."""
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    out = []
    for j in range(start, stop):
        stored_args, stored_kwargs = kwargs_list[j]
        terms = []
        for i, (micro_args, micro_kwargs) in enumerate(self._iter_parent_calls(stored_args, stored_kwargs)):
            if i >= len(refs[j]):
                return None
            call_args = tuple(move_to_device(a, device) for a in micro_args)
            call_kwargs = {k: move_to_device(v, device) for k, v in micro_kwargs.items()}
            o = self._normalize_parent_output(module(*call_args, **call_kwargs))
            ref = refs[j][i].to(device, non_blocking=False)
            terms.append((torch.nn.functional.mse_loss(ref.float(), o.float(), reduction="sum"), ref.numel()))
        if len(terms) != len(refs[j]):
            return None
        out.append(terms)
    return out


def compute_parent_loss(run: Run | None, self, parent, kwargs_list, fp16_outputs):
    """One grid point's loss, shard and reduce. Each lane copies home's candidate balance weights into
    its mirror and returns the squared-error SUM of every (micro) call of its slice, one fp32 term
    per call; home folds the terms in serial's call order into a zero fp32 accumulator and divides
    by the total element count, which is the exact operation sequence of auto-round's serial loss
    (``loss += sum_c; ...; loss / n``). Each term is the same kernel on the same inputs, so the
    loss, and with it the comparison that picks the grid point, is bitwise serial's. (Adding
    per-lane partial sums instead would reassociate the fp32 sum: equal to ~1 ulp, which can flip
    a near-tie between two grid points.)"""
    original = patches.original(AWQTransform, "_compute_parent_loss")
    ctx = _awq_ctx_for(or_idle(run), parent, kwargs_list)
    if ctx is None or ctx.refs is None:
        return original(self, parent, kwargs_list, fp16_outputs)
    ctx.points += 1

    def fwd(module, lane, start, stop):
        if lane.index != 0:
            for home_bl, mirrors in ctx.balance:
                mirrors[lane.index - 1].weight.data.copy_(home_bl.weight.data)
        return [_awq_lane_sums(self, module, kwargs_list, ctx.refs, start, stop)]

    # one result per lane (each lane's list of per-call terms); shard_forward's ranges are per call
    parts = _shard_per_lane(ctx, fwd)
    param = next(parent.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    loss = torch.tensor(0.0, device=device)
    num_elements = torch.tensor(0, device=device, dtype=torch.long)
    for part in parts:
        if part is None:
            return float("inf")
        for terms in part:
            for term, n in terms:
                loss += term.to(device)
                num_elements += n
    if num_elements == 0:
        return float("inf")
    return (loss / num_elements).item()


def _shard_per_lane(ctx, fwd) -> list:
    """Run ``fwd(module, lane, start, stop)`` (one result per lane) over the cached-call ranges."""
    ranges = contiguous_ranges(len(ctx.kwargs_list), len(ctx.lanes))
    results = []
    for module, lane, (start, stop) in zip(ctx.replicas.modules, ctx.lanes, ranges, strict=True):
        if start == stop:
            continue
        lane.wait_for_current()
        with lane.issue():
            results.append((lane, fwd(module, lane, start, stop)[0]))
    return [lane.hand_home(r) for lane, r in results]  # R2 + R3: home folds the terms, then drops them


_NO_CLIP = object()


def _awq_clip_key(layer, feat):
    w = layer.weight
    return (w.data_ptr(), w._version, tuple(w.shape), w.dtype, id(feat), feat.data_ptr(), feat._version)


def clip_block(run: Run | None, self, block_prefix, block_mappings):
    """AWQ's clip searches mapped over lanes: before auto-round's ``_clip_block`` runs, every balance
    layer it will search gets its ``_compute_best_clip`` run once on one lane (read-only: the layer's
    weight and the mapping's features, as serial would pass them); the result is kept home and
    ``_clip_block`` takes it instead of searching (same function, same inputs: bitwise)."""
    run = or_idle(run)
    original = patches.original(AWQTransform, "_clip_block")
    if run.world in ("off", 1):
        return original(self, block_prefix, block_mappings)
    items = []
    for mapping in block_mappings:
        feat = self._clip_input_feat.get(mapping.smooth_name)
        if feat is None:
            continue
        items.extend((bl, feat) for bl, name in zip(mapping.balance_layers, mapping.balance_names, strict=False)
                     if not self._should_skip_clip(name))
    counts: dict[int, int] = {}
    for bl, _ in items:
        counts[id(bl)] = counts.get(id(bl), 0) + 1
    items = [it for it in items if counts[id(it[0])] == 1]  # a layer clipped twice sees its first clip
    reasons: list[str] = []
    if any(bl.weight.device.type == "meta" for bl, _ in items):
        reasons.append(refusals.AWQ_BALANCE_ON_META)
    price = max((bl.weight.numel() * 4 for bl, _ in items), default=0) * 4
    search = patches.original(AWQTransform, "_compute_best_clip")
    owners_seen: dict[int, int] = {}

    def sharded(lanes):
        def search_on(item, lane):
            bl, feat = item
            owners_seen[lane.index] = owners_seen.get(lane.index, 0) + 1
            layer = bl if lane.device == bl.weight.device else copy_to_lane(bl, lanes[0], lane)
            return search(self, layer, feat)

        def collect(item, result, lane):
            bl, feat = item
            if result is not None:
                result = tuple(t.to(bl.weight.device) for t in result)
            run.seams.awq_clips[id(bl)] = (_awq_clip_key(bl, feat), result)

        try:
            map_over_lanes(items, lanes, search_on, cost=lambda it: float(it[0].weight.numel()), collect=collect)
            return original(self, block_prefix, block_mappings)
        finally:
            run.seams.awq_clips.clear()

    def per_lane(world: int) -> str:
        return ", ".join(f"lane {k}: {owners_seen.get(k, 0)}" for k in range(world))

    phase = PhaseSpec("search", serial=lambda: original(self, block_prefix, block_mappings), sharded=sharded,
                      units=len(items), price=price or None,
                      detail=lambda w: f"{len(items)} AWQ clip searches ({per_lane(w)})",
                      home="AWQ clip searches on home", time_home=False,
                      log=lambda w, _d, _r: (("awq_clip", w), f"dpq: AWQ clip searches of {block_prefix} mapped over "
                                                             f"{w} lanes ({per_lane(w)})"))
    return run_phase(run, block_prefix, phase, reasons=reasons)


def compute_best_clip(run: Run | None, self, layer, input_feat):
    run = or_idle(run)
    entry = run.seams.awq_clips.pop(id(layer), _NO_CLIP)
    if entry is not _NO_CLIP and entry[0] == _awq_clip_key(layer, input_feat):
        run.seams.awq_clip_hits += 1
        return entry[1]
    return patches.original(AWQTransform, "_compute_best_clip")(self, layer, input_feat)
