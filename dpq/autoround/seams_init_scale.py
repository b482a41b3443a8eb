"""Seam 3, SignRoundV2's wrap-time init-scale searches (auto-round 0.16; 0.17 batches them in its
own search dispatch and this seam is not installed). Before a SignRoundV2 block is wrapped, every
layer's ``search_optimized_init_scale`` runs once on one lane with the inputs the wrapper would
give it; ``SignRoundOptimizedWrapperLinear._prepare_init_scale_weight`` and the module's
``search_optimized_init_scale`` are patched so the wrapper takes the precomputed result (checked
against shape, dtype, data type, bits, threshold and the weight's version counter; anything else
searches on home as before). Bitwise serial.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from auto_round.algorithms.quantization.sign_roundv2 import quantizer as _v2
from auto_round.data_type.utils import reshape_imatrix_for_weight
from auto_round.utils import SUPPORTED_LAYER_TYPES, check_to_quantized

from dpq.sharded.shard import copy_to_lane, map_over_lanes

from . import patches
from .run import Run
from .seams_common import PhaseSpec, or_idle, run_phase

__all__ = ["precompute_init_scales", "prepare_init_scale_weight", "search_optimized_init_scale"]

_OPT_WRAPPER = _v2.SignRoundOptimizedWrapperLinear


def _init_scale_key(layer, weight_reshape, imatrix, q_scale_thresh):
    return (tuple(weight_reshape.shape), weight_reshape.dtype, str(layer.data_type), int(layer.bits),
            float(q_scale_thresh), None if not isinstance(imatrix, torch.Tensor) else tuple(imatrix.shape),
            layer.weight._version)


def _init_scale_inputs(layer):
    """What SignRoundOptimizedWrapperLinear feeds search_optimized_init_scale for ``layer``."""
    weight_reshape = patches.original(_OPT_WRAPPER, "_prepare_init_scale_weight")(SimpleNamespace(orig_layer=layer))
    imatrix = reshape_imatrix_for_weight(getattr(layer, "imatrix", None), weight_reshape, layer.group_size)
    q_scale_thresh = 1e-8 if getattr(layer, "scale_dtype", None) == torch.float32 else 1e-5
    return weight_reshape, imatrix, q_scale_thresh


def precompute_init_scales(run: Run, q, block, block_name: str) -> None:
    """Before a SignRoundV2 block is wrapped: run every layer's init-scale search once on one lane
    and keep the results home; the wrapper then takes them instead of searching (same inputs,
    same function: bitwise). On home alone nothing runs here (the wrapper searches as serial does)."""
    wrapper = getattr(q, "wrapper_block", None)
    if not isinstance(q, _v2.SignRoundV2Quantizer) or getattr(wrapper, "keywords", {}).get("wrapper_cls") \
            is not _OPT_WRAPPER or run.world in ("off", 1) or not _installed():
        return
    targets = [m for _, m in block.named_modules() if type(m) in SUPPORTED_LAYER_TYPES and check_to_quantized(m)]
    if len(targets) < 2 or any(p.device.type == "meta" for m in targets for p in m.parameters()):
        return
    price = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in targets) * 4
    search = patches.original(_v2, "search_optimized_init_scale")

    def sharded(lanes):
        def search_on(layer, lane):
            src = layer if lane.index == 0 else copy_to_lane(layer, lanes[0], lane)
            weight_reshape, imatrix, thresh = _init_scale_inputs(src)
            return search(weight_reshape, src.data_type, src.bits, imatrix, thresh)

        def collect(layer, result, lane):
            weight_reshape, imatrix, thresh = _init_scale_inputs(layer)
            if isinstance(result, torch.Tensor):
                result = result.to(weight_reshape.device)
            run.seams.init_scales[id(layer)] = (_init_scale_key(layer, weight_reshape, imatrix, thresh), result)

        map_over_lanes(targets, lanes, search_on, cost=lambda m: float(m.weight.numel()), collect=collect)

    phase = PhaseSpec("search", serial=lambda: None, sharded=sharded, units=len(targets), price=price,
                      detail=f"{len(targets)} SignRoundV2 init-scale searches", nested=True,
                      log=lambda w, _d, _r: (("init_scale", w), f"dpq: SignRoundV2 init-scale searches of {block_name} "
                                                               f"mapped over {w} lanes"))
    run_phase(run, block_name, phase, reasons=[])


def prepare_init_scale_weight(run: Run | None, self):
    or_idle(run).seams.current_layer = self.orig_layer
    return patches.original(_OPT_WRAPPER, "_prepare_init_scale_weight")(self)


def search_optimized_init_scale(run: Run | None, weight_reshape, data_type, bits, imatrix=None, q_scale_thresh=1e-5):
    run = or_idle(run)
    layer, run.seams.current_layer = run.seams.current_layer, None
    entry = run.seams.init_scales.pop(id(layer), None) if layer is not None else None
    if entry is not None and layer.data_type == data_type and layer.bits == bits \
            and entry[0] == _init_scale_key(layer, weight_reshape, imatrix, q_scale_thresh):
        run.seams.init_scale_hits += 1
        result = entry[1]
        return result.to(weight_reshape.device) if isinstance(result, torch.Tensor) else result
    t0 = time.perf_counter()
    search = patches.original(_v2, "search_optimized_init_scale")
    result = search(weight_reshape, data_type, bits, imatrix, q_scale_thresh)
    if layer is not None and run.seams.block_name:
        run.record_phase(run.seams.block_name, "search", 1, time.perf_counter() - t0,
                         "SignRoundV2 init-scale search on home", nested=True)
    return result


def _installed() -> bool:
    """Whether this series' table patches the init-scale search (0.16: yes; 0.17: its own dispatch)."""
    return any(p.name == "search_optimized_init_scale" for p in patches.patches_for())
