"""Seam 1, collection forwards: ``AlgorithmComposer.compress_block``.

For the duration of the call the composer's ``block_forward`` (the ``BlockForwardRunner`` of every
collection pass: the preprocessor calibration pass, the fp reference pass with the quantizer's fp
hooks, the act-max pass on the quantized-input chain and the quantized-input forward feeding the
next block) is replaced by :class:`ShardedRunner`: lane k forwards the k-th contiguous range of
whole batches on a short-lived mirror (batch boundaries as serial's, so outputs are bitwise
serial's); outputs return in sample order; hook statistics merge into the home block's layers
(see :mod:`dpq.autoround.seams_common`). Under several processes (torchrun) a pass without hooks
runs over the global lanes, every rank receiving every sample's output
(:mod:`dpq.sharded.shard_processes`); a pass with hook statistics runs on each rank's home alone
(``refusals.PASS_HOOKS_PROCESSES``: those merges are not canonical across processes yet). The
quantizer's own forwards (tuning) are not touched. The call also times the block quantizer's
``quantize_block`` (phase "tune", or "search" for RTN).
"""

from __future__ import annotations

import copy
import math
import time
from types import MappingProxyType

import torch
from auto_round.algorithms.composer import AlgorithmComposer
from auto_round.algorithms.quantization.rtn.quantizer import RTNQuantizer

from dpq import refusals
from dpq.planning.plan import MARGIN
from dpq.sharded.shard import sharded_collection
from dpq.sharded.shard_processes import gather_in_sample_order, global_ranges

from . import patches
from .run import Run
from .seams_common import (
    HOOK_DICTS,
    OnLaneFailure,
    PhaseSpec,
    hook_name,
    mirror_refusals,
    or_idle,
    pool_device_refusals,
    run_phase,
)
from .seams_init_scale import precompute_init_scales

__all__ = ["MODULE_STAT_HOOKS", "ORDERED_SINK_HOOKS", "ShardedRunner", "compress_block"]

# hook function (__qualname__) -> {attribute on the hooked module: merge kind}
MODULE_STAT_HOOKS: MappingProxyType[str, MappingProxyType[str, str]] = MappingProxyType({
    "AlgorithmComposer._register_act_max_hooks.<locals>.collect_act_max": MappingProxyType({"act_max": "max"}),
    "OptimizedRTNQuantizer._register_imatrix_hooks.<locals>.collect_imatrix": MappingProxyType({
        "imatrix": "sum", "imatrix_cnt": "count"}),
    "SignRoundV2Quantizer._register_imatrix_hooks.<locals>.collect_imatrix": MappingProxyType({"imatrix": "sum"}),
})
# hooks that append/accumulate into preprocessor-owned containers in call order
ORDERED_SINK_HOOKS: MappingProxyType[str, str] = MappingProxyType({
    "AWQTransform._register_awq_hooks.<locals>._make_activation_hook.<locals>.hook_fn": "awq_activation:ordered",
    "AWQTransform._register_awq_hooks.<locals>._make_parent_hook.<locals>.hook_fn": "awq_parent_args:ordered",
})



def _block_refusals(run: Run, block, inputs) -> list[str]:
    """Why this block's passes must run on home alone (empty: they can be sharded)."""
    reasons = []
    # several processes in the run: the pass runs over global lanes (run_phase's processes)
    if (run.processes is None and torch.distributed.is_available()
            and torch.distributed.is_initialized()):
        reasons.append(refusals.PASS_DIST_ACTIVE)
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        reasons.append(refusals.PASS_DICT_POOL)
    reasons.extend(mirror_refusals(block, "block"))
    reasons.extend(pool_device_refusals(inputs, text=refusals.pool_spread_devices))
    return reasons



def _classify_hooks(block) -> tuple[dict[str, dict[str, str]], set[str], list[str]]:
    """(stat spec, ordered-sink labels, unmergeable hook names) of the hooks on ``block``."""
    spec: dict[str, dict[str, str]] = {}
    sinks: set[str] = set()
    unknown: list[str] = []
    for name, module in block.named_modules():
        for d in HOOK_DICTS:
            for fn in getattr(module, d, {}).values():
                q = hook_name(fn)
                if q in MODULE_STAT_HOOKS:
                    spec.setdefault(name, {}).update(MODULE_STAT_HOOKS[q])
                elif q in ORDERED_SINK_HOOKS:
                    sinks.add(ORDERED_SINK_HOOKS[q])
                else:
                    unknown.append(f"{name or '<block>'}:{q}")
        for d in ("_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, d, None):
                unknown.extend(f"{name or '<block>'}:{hook_name(fn)}" for fn in getattr(module, d).values())
    return spec, sinks, unknown


def _collection_price(block, inputs, batch_size: int) -> int:
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    act = inputs[0].numel() * inputs[0].element_size() * 8 * max(1, batch_size) if inputs else 0
    return int((weights + act) * MARGIN)


# -- AWQ's preprocessor-owned containers: snapshot / restore around a sharded pass -------------

def _sink_snapshot(composer) -> list:
    snaps = []
    for pre in getattr(composer, "preprocessors", []):
        if type(pre).__name__ != "AWQTransform":
            continue
        snaps.append((pre, {
            "_activation_stats": {k: [v[0].clone(), v[1]] for k, v in pre._activation_stats.items()},
            "_parent_args_cache": {k: list(v) for k, v in pre._parent_args_cache.items()},
            "_clip_input_feat": dict(pre._clip_input_feat),
        }))
    return snaps


def _sink_restore(snaps) -> None:
    for pre, saved in snaps:
        for attr, value in saved.items():
            container = getattr(pre, attr)
            container.clear()
            container.update(value)


# -- the seam ---------------------------------------------------------------------

class ShardedRunner:
    """Stands in for the composer's :class:`BlockForwardRunner` during one ``compress_block``.

    A call with the whole pool (no ``indices``, grad off) runs sharded when the plan gives
    lanes and every hook on the block is mergeable; anything else goes to the real runner.
    Attribute reads fall through to the real runner. Lanes forward through the runner's own
    ``forward`` with absolute sample ``indices``, so batch selection (per-sample lists, shared
    cache keys, tensors indexed on the batch dim) is auto-round's own.
    """

    def __init__(self, runner, composer, block_name: str, run: Run) -> None:
        self._runner = runner
        self._composer = composer
        self._block_name = block_name
        self._run = run
        self.last_output_dict = None

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _home(self, block, inputs, input_others, indices, cache_device):
        out = self._runner.forward(block, inputs, input_others, indices, cache_device)
        self.last_output_dict = self._runner.last_output_dict
        return out

    def forward(self, block, inputs, input_others, indices=None, cache_device=None):
        run = self._run
        if indices is not None or torch.is_grad_enabled() or run.world == "off":
            return self._home(block, inputs, input_others, indices, cache_device)
        name = self._block_name

        def serial():
            return self._home(block, inputs, input_others, None, cache_device)

        def log(world, detail, reasons):
            return (("collection", world, detail, tuple(reasons)),
                    f"dpq: collection pass of {name} ({detail}) on {world} lane(s)"
                    + "".join(f"\n  - {r}" for r in reasons))

        procs = run.processes
        if procs is None and run.world == 1:
            return run_phase(run, name, PhaseSpec("collection", serial=serial, sharded=serial, home="", every_run=True,
                                                  log=log), reasons=["world 1"])
        reasons = _block_refusals(run, block, inputs)
        spec, sinks, unknown = _classify_hooks(block)
        if procs is not None and (spec or sinks or unknown):
            # several processes: a pass with hooks runs on every rank's home alone (the module docstring)
            reasons.append(refusals.PASS_HOOKS_PROCESSES)
        elif unknown:
            reasons.append(refusals.unmergeable_hooks(sorted(set(unknown))))
        detail = ", ".join(sorted({f"{a}:{k}" for d in spec.values() for a, k in d.items()} | sinks)) or "no hooks"
        bs = max(1, int(self._runner.batch_size))
        units = math.ceil(len(inputs) / bs) if isinstance(inputs, list) else 0
        price = None if reasons else _collection_price(block, inputs, bs)
        if procs is not None:
            def sharded(lanes, topology):
                return self._sharded(block, inputs, input_others, cache_device, lanes, {}, bs, topology=topology,
                                     procs=procs)
        else:
            def sharded(lanes):
                return self._sharded(block, inputs, input_others, cache_device, lanes, spec, bs)
        phase = PhaseSpec("collection", serial=serial, sharded=sharded, units=units, price=price, detail=detail,
                          home=detail, every_run=True, log=log,
                          failure=OnLaneFailure(f"a collection pass of {name}", "statistics",
                                                lambda n, err: refusals.collection_lane_failed(name, n, err)))
        return run_phase(run, name, phase, reasons=reasons, processes=procs)

    def _sharded(self, block, inputs, input_others, cache_device, lanes, spec, bs, *, topology=None, procs=None):
        """``topology``/``procs`` (several processes): this process's lanes forward its slice of the
        global ranges, and every rank's outputs are gathered in sample order."""
        runner = self._runner
        out_device = cache_device if cache_device is not None else runner.cache_device
        low_mem = bool(getattr(getattr(self._composer.block_quantizer, "compress_context", None),
                               "low_gpu_mem_usage", False))
        lane_dicts: list[dict | None] = []
        ranges = None if topology is None else global_ranges(len(inputs), topology, bs)

        def forward_fn(module, lane, start, stop):
            r = copy.copy(runner)
            if lane.index != 0:
                r.device = lane.device
            r.last_output_dict = None
            # accelerator lanes keep their outputs until every lane is issued (no per-batch host sync)
            keep = lane.device.type != "cpu" and not low_mem
            idx = torch.arange(start, stop, dtype=torch.long)
            out = r.forward(module, inputs, input_others, idx, lane.device if keep else out_device)
            lane_dicts.append((lane, {k: r.split_outputs(v) for k, v in r.last_output_dict.items()}
                                     if r.last_output_dict else None))
            return r.split_outputs(out)

        sinks = _sink_snapshot(self._composer)
        try:
            outputs = sharded_collection(block, lanes, len(inputs), forward_fn, spec, align=bs,
                                         out_device=out_device, ranges=ranges)
        except BaseException:
            _sink_restore(sinks)
            raise
        merged: dict[str, list] | None = None
        if any(d is not None for _, d in lane_dicts):
            merged = {}
            for lane, d in lane_dicts:
                for k, v in (d or {}).items():
                    merged.setdefault(k, []).extend(lane.hand_home(v, out_device))  # R2 + R3
        if procs is not None:  # where the serial pass puts its outputs: out_device, else the block's home
            outputs, merged = gather_in_sample_order(procs, outputs, merged,
                                                     out_device if out_device is not None else lanes[0].device)
        if merged is not None:
            merged["hidden_states"] = outputs
        self.last_output_dict = merged
        return outputs


def compress_block(run: Run | None, self, block, fp_inputs, input_others, block_ctx, q_inputs=None, input_ids=None,
                    reference_output=None, **kwargs):
    run = or_idle(run)
    original = patches.original(AlgorithmComposer, "compress_block")
    if run.world == "off":
        return original(self, block, fp_inputs, input_others, block_ctx, q_inputs, input_ids, reference_output,
                        **kwargs)
    real = self.block_forward
    name = getattr(block_ctx, "block_name", "") or getattr(block, "global_name", "")
    q = self.block_quantizer
    phase = "search" if isinstance(q, RTNQuantizer) else "tune"
    bound = q.quantize_block
    shadowed = "quantize_block" in q.__dict__

    def timed_quantize_block(*a, **k):
        t0 = time.perf_counter()
        run.seams.block_name = name
        try:
            precompute_init_scales(run, q, block, name)
            return bound(*a, **k)
        finally:
            run.seams.init_scales.clear()
            run.seams.block_name = ""
            run.record_phase(name, phase, 0, time.perf_counter() - t0, type(q).__name__)

    self.block_forward = ShardedRunner(real, self, name, run)
    if not shadowed:
        q.quantize_block = timed_quantize_block
    try:
        return original(self, block, fp_inputs, input_others, block_ctx, q_inputs, input_ids, reference_output,
                        **kwargs)
    finally:
        self.block_forward = real
        if not shadowed:
            del q.__dict__["quantize_block"]

