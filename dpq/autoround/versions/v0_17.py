"""auto-round 0.17 (checked on the nightly 0.17.0.dev20261026): what dpq expects of it (the fields:
:mod:`dpq.autoround.versions`). Against 0.16: the optimized-RTN and SignRoundV2 init-scale searches are
auto-round's own (``NOT_PATCHED``), and the runner's batch selection and forward place samples differently
(the same values; their digests differ)."""

from __future__ import annotations

from types import MappingProxyType

from . import v0_16

__all__ = ["CALLED", "LOOP_REPRODUCED", "NOT_PATCHED", "RELEASE", "REPRODUCED", "SIGNATURES"]

RELEASE = "0.17.0.dev20261026"

_RTN = "auto_round.algorithms.quantization.rtn.quantizer"
_V2 = "auto_round.algorithms.quantization.sign_roundv2.quantizer"
_SEARCHES = (f"{_RTN}:OptimizedRTNQuantizer._quantize_targets",
             f"{_V2}:SignRoundOptimizedWrapperLinear._prepare_init_scale_weight",
             f"{_V2}:search_optimized_init_scale")

SIGNATURES: MappingProxyType[str, str] = MappingProxyType(
    {path: params for path, params in v0_16.SIGNATURES.items() if path not in _SEARCHES})

NOT_PATCHED: MappingProxyType[str, str] = MappingProxyType({
    "OptimizedRTNQuantizer._quantize_targets": (
        "auto-round 0.17 removed it: optimized-RTN (iters=0) weight searches run through auto-round's own "
        "search dispatch (batched, spread over idle devices), so dpq leaves them to it"),
    "SignRoundV2 init-scale searches": (
        "auto-round 0.17 stages SignRoundV2's wrap-time init-scale searches into its own batched search "
        "dispatch (resolve_optimized_init_scale_fn), so dpq leaves them to it"),
})

# sha256 (first 16 hex digits) of each source, read on RELEASE. _select_batch and forward differ from
# 0.16's only in where samples go (gathered onto the runner's device first, indices moved to the value's
# device, list-mode outputs placed by the pool), which each lane's staging does itself (R7): the same values
LOOP_REPRODUCED: MappingProxyType[str, str] = MappingProxyType({
    **v0_16.LOOP_REPRODUCED,
    "auto_round.algorithms.block_runner:BlockForwardRunner._select_batch": "f095491358e40550",
    "auto_round.algorithms.block_runner:BlockForwardRunner.forward": "d3d24e0683c83b23",
})

REPRODUCED: MappingProxyType[str, str] = v0_16.REPRODUCED  # the same SignSGD sources

# the RTN expert batching belongs to the optimized-RTN search 0.17 leaves to auto-round
CALLED: tuple[str, ...] = tuple(path for path in v0_16.CALLED if f"{_RTN}:OptimizedRTNQuantizer." not in path)
