"""auto-round's no-grad phases, sharded over lanes with :mod:`dpq.shard`.

``install(state)`` patches ten auto-round 0.16 functions; ``uninstall()`` puts them back.
``state`` is any object with ``world`` ('off' | 'auto' | int) and ``devices`` (lane devices
or None), such as ``dpq.autoround.integration._state``; it is read at every call, and with
``world == 'off'`` every patched function passes straight through to auto-round's own.

1. Collection forwards: ``AlgorithmComposer.compress_block``. For the duration of the call the
   composer's ``block_forward`` (the :class:`BlockForwardRunner` it uses for every collection
   pass) is replaced by :class:`ShardedRunner`. Those passes are: the preprocessor calibration
   pass (AWQ activation statistics, step 1), the fp reference-output pass with the quantizer's
   fp hooks (act-max when the input is not chained, imatrix; step 3), the act-max pass on the
   quantized-input chain (``enable_quanted_input`` with act-max hooks) and the quantized-input
   chain forward that feeds the next block (step 6). Each runs shard by shard: lane k forwards
   the k-th contiguous range of whole batches (boundaries on the runner's batch size, so every
   batch is one the serial pass forms and outputs are bitwise serial's) on a short-lived
   mirror; outputs return in sample order to the runner's cache device; hook statistics are
   merged into the home block's layers. The quantizer's own forwards (tuning) hold their own
   reference to the runner and are not touched. The call also times the block quantizer's
   ``quantize_block`` (phase "tune", or "search" for RTN at ``iters=0``).
2. ``iters=0`` searches: ``RTNQuantizer.quantize_block`` (plain RTN) and
   ``OptimizedRTNQuantizer._quantize_targets`` (optimized RTN, auto-round's default at iters
   0). Each layer's weight search runs once on one lane (a private copy of the layer on that
   lane; lane 0 is home and works in place) through auto-round's own
   ``_quantize_layer_via_rtn``; the result is copied into the home layer and installed where
   serial installs it. Bitwise serial: the same computation on the same inputs. Stacked
   expert-batch searches (MoE) stay on home.
3. SignRoundV2 wrap-time init-scale searches: before a SignRoundV2 block is wrapped, every
   layer's ``search_optimized_init_scale`` runs once on one lane with the inputs the wrapper
   would give it; ``SignRoundOptimizedWrapperLinear._prepare_init_scale_weight`` and the
   module's ``search_optimized_init_scale`` are patched so the wrapper takes the precomputed
   result (checked against shape, dtype, data type, bits, threshold and the weight's version
   counter; anything else searches on home as before). Bitwise serial.
4. AWQ smoothing grid search, shard and reduce: ``AWQTransform._grid_search_scales`` runs
   auto-round's own loop on home (candidate scales, QDQ of the balance weights, the ``<``
   comparison that picks the point); only the replays of the cached parent calls move to lanes
   (``_run_parent_samples`` for the reference outputs, ``_compute_parent_loss`` per grid point).
   Lane k holds a mirror of the parent (balance weights private, the rest shared on a shared
   device), replays the k-th contiguous range of cached calls and returns one squared-error SUM
   per (micro) call; home adds the terms in serial's call order into a zero fp32 accumulator and
   divides by the total element count. auto-round's loss is a mean over all elements, the same
   count for every grid point, computed as exactly that fold and division, so the loss of every
   point is bitwise serial's and the same point (same scales) is chosen. Per-lane partial sums
   would reassociate the fp32 sum (about 1 ulp off), which could flip a near-tie between two
   points: that is why terms are per call, not per lane. Mappings without cached parent calls
   (weight-only loss), parents with hooks, accelerate hooks, weights on several devices, or a
   balance layer outside the parent search on home. AWQ clip search, map:
   ``AWQTransform._clip_block``: every balance layer's ``_compute_best_clip`` (read-only on the
   layer's weight and the mapping's features) runs once on one lane before auto-round's loop,
   which then takes the result via the patched ``_compute_best_clip`` (checked against the
   weight's storage and version and the features' identity; anything else searches on home).
   A layer that would be clipped twice is searched on home. Bitwise serial.

Hooks and how their statistics merge (anything else makes the pass run on home alone):

==============================================================  =======================================
hook (auto-round 0.16.1)                                        merge
==============================================================  =======================================
``AlgorithmComposer._register_act_max_hooks`` collect_act_max   ``act_max``: max (bitwise)
``OptimizedRTNQuantizer._register_imatrix_hooks``               ``imatrix``: sum, ``imatrix_cnt``: count
``SignRoundV2Quantizer._register_imatrix_hooks``                ``imatrix``: sum
``AWQTransform._register_awq_hooks`` (activation, parent args)  ordered sink (see below)
==============================================================  =======================================

Not merged, run on home alone: any other forward / pre-forward / backward hook found on the
block, for example the online rotation hooks of layer-wise Hadamard / SpinQuant (they
transform activations and may hold state dpq cannot prove is per-module) and SVDQuant's
smoothing statistics (kept in the preprocessor, keyed by module, no merge rule written); blocks
whose pool is a dict (diffusion), whose weights span several devices, that carry accelerate
hooks or a forward replaced by a foreign bound method; passes with ``indices`` or with grad
enabled. AWQ's hooks write into containers owned by the AWQ preprocessor (a running channel
sum, the list of parent-call arguments, a concatenation of clip features): these cannot be
split into per-lane partials, but they need not be: lanes run in sample order from one thread
and the hooks copy to the host as they go, so the containers receive exactly the serial
sequence of updates (bitwise). On a lane failure they are restored from a snapshot, like the
module statistics.

Not sharded: the QDQ of each AWQ grid point's candidate weights (on home, once per point;
its result is copied into each lane's mirror).
"""


from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from dpq.mirror import ReplicaSet
from dpq.plan import MARGIN, PlanRequest, resolve
from dpq.shard import bring_home, contiguous_ranges, copy_to_lane, map_over_lanes, shard_forward, sharded_collection
from dpq.streams import make_lanes

from .compat import check_auto_round_version

check_auto_round_version()

from auto_round.algorithms.composer import AlgorithmComposer  # noqa: E402
from auto_round.algorithms.quantization.base import BaseQuantizer  # noqa: E402
from auto_round.algorithms.quantization.rtn.quantizer import OptimizedRTNQuantizer, RTNQuantizer  # noqa: E402
from auto_round.algorithms.quantization.sign_roundv2 import quantizer as _v2  # noqa: E402
from auto_round.algorithms.transforms.awq.base import AWQTransform  # noqa: E402
from auto_round.data_type.utils import reshape_imatrix_for_weight  # noqa: E402
from auto_round.logger import logger  # noqa: E402
from auto_round.utils import SUPPORTED_LAYER_TYPES, check_to_quantized, set_module  # noqa: E402
from auto_round.utils.device_manager import device_manager  # noqa: E402
from auto_round.utils.model import move_to_device  # noqa: E402

__all__ = ["PhaseRecord", "ShardedRunner", "install", "installed", "phase_seconds", "records", "reset", "uninstall"]

# hook function (__qualname__) -> {attribute on the hooked module: merge kind}
MODULE_STAT_HOOKS: dict[str, dict[str, str]] = {
    "AlgorithmComposer._register_act_max_hooks.<locals>.collect_act_max": {"act_max": "max"},
    "OptimizedRTNQuantizer._register_imatrix_hooks.<locals>.collect_imatrix": {
        "imatrix": "sum", "imatrix_cnt": "count"},
    "SignRoundV2Quantizer._register_imatrix_hooks.<locals>.collect_imatrix": {"imatrix": "sum"},
}
# hooks that append/accumulate into preprocessor-owned containers in call order
ORDERED_SINK_HOOKS = {
    "AWQTransform._register_awq_hooks.<locals>._make_activation_hook.<locals>.hook_fn": "awq_activation:ordered",
    "AWQTransform._register_awq_hooks.<locals>._make_parent_hook.<locals>.hook_fn": "awq_parent_args:ordered",
}
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


@dataclass
class PhaseRecord:
    """One sharded (or home-alone) phase of one block."""

    block: str
    phase: str  # "collection" | "search" | "tune"
    world: int  # lanes used; 0 for a "tune" record (the tuner's own plan decides, see integration)
    seconds: float
    detail: str = ""  # the hooks merged / the items per lane
    reasons: list[str] = field(default_factory=list)  # why home alone, or why fewer lanes
    fell_back: bool = False
    nested: bool = False  # a detail inside another record's time (not summed by phase_seconds)


@dataclass
class _Seams:
    state: object = None
    originals: dict = field(default_factory=dict)
    records: list[PhaseRecord] = field(default_factory=list)
    fail_lane: int | None = None  # test hook: raise on this lane index in the next sharded pass
    logged: set = field(default_factory=set)
    init_scales: dict = field(default_factory=dict)  # id(home layer) -> (key, init_scale) precomputed on lanes
    current_layer: object = None  # the layer whose SignRoundV2 wrapper is being built
    init_scale_hits: int = 0
    block_name: str = ""  # the block whose quantize_block is running (for nested records)
    awq_grid: object = None  # the _AwqGrid of the AWQ grid search running now (None: serial)
    awq_clips: dict = field(default_factory=dict)  # id(home layer) -> (key, clip range) precomputed on lanes
    awq_clip_hits: int = 0
    awq_fail_lane: int | None = None  # test hook: raise on this lane in the next sharded AWQ grid search


_seams = _Seams()


# -- install / uninstall -------------------------------------------------------------------------

def install(state) -> None:
    """Patch auto-round's collection and search seams; they read ``state.world`` / ``state.devices``
    at every call. Idempotent: a second call only swaps the state."""
    if state is not _seams.state:
        _seams.records.clear()
        _seams.logged.clear()
    _seams.state = state
    if _seams.originals:
        return
    _seams.originals = {
        (AlgorithmComposer, "compress_block"): AlgorithmComposer.__dict__["compress_block"],
        (RTNQuantizer, "quantize_block"): RTNQuantizer.__dict__["quantize_block"],
        (OptimizedRTNQuantizer, "_quantize_targets"): OptimizedRTNQuantizer.__dict__["_quantize_targets"],
        (_OPT_WRAPPER, "_prepare_init_scale_weight"): _OPT_WRAPPER.__dict__["_prepare_init_scale_weight"],
        (_v2, "search_optimized_init_scale"): _v2.search_optimized_init_scale,
        (AWQTransform, "_grid_search_scales"): AWQTransform.__dict__["_grid_search_scales"],
        (AWQTransform, "_run_parent_samples"): AWQTransform.__dict__["_run_parent_samples"],
        (AWQTransform, "_compute_parent_loss"): AWQTransform.__dict__["_compute_parent_loss"],
        (AWQTransform, "_clip_block"): AWQTransform.__dict__["_clip_block"],
        (AWQTransform, "_compute_best_clip"): AWQTransform.__dict__["_compute_best_clip"],
    }
    AlgorithmComposer.compress_block = _compress_block
    RTNQuantizer.quantize_block = _rtn_quantize_block
    OptimizedRTNQuantizer._quantize_targets = _opt_rtn_quantize_targets
    _OPT_WRAPPER._prepare_init_scale_weight = _prepare_init_scale_weight
    _v2.search_optimized_init_scale = _search_optimized_init_scale
    AWQTransform._grid_search_scales = _awq_grid_search_scales
    AWQTransform._run_parent_samples = _awq_run_parent_samples
    AWQTransform._compute_parent_loss = _awq_compute_parent_loss
    AWQTransform._clip_block = _awq_clip_block
    AWQTransform._compute_best_clip = _awq_compute_best_clip


def uninstall() -> None:
    """Put auto-round's functions back. Safe to call when not installed."""
    for (cls, name), fn in _seams.originals.items():
        setattr(cls, name, fn)
    _seams.originals = {}
    _seams.state = None
    _seams.init_scales.clear()
    _seams.current_layer = None
    _seams.awq_grid = None
    _seams.awq_clips.clear()


def installed() -> bool:
    return bool(_seams.originals)


def records() -> list[PhaseRecord]:
    return list(_seams.records)


def reset() -> None:
    """Forget the phase records (e.g. between two measured runs)."""
    _seams.records.clear()


def phase_seconds() -> dict[str, float]:
    """Seconds per phase summed over every block recorded since the last reset().

    "tune" is the block quantizer's ``quantize_block`` of a tuning algorithm minus the searches
    timed inside it (SignRoundV2 init-scale searches, counted as "search"); at ``iters=0`` the
    whole ``quantize_block`` is "search"."""
    out = {"collection": 0.0, "search": 0.0, "tune": 0.0}
    tuned_blocks = {r.block for r in _seams.records if r.phase == "tune" and not r.nested}
    for r in _seams.records:
        if not r.nested:
            out[r.phase] = out.get(r.phase, 0.0) + r.seconds
        elif r.phase == "search" and r.block in tuned_blocks:
            out["search"] += r.seconds
            out["tune"] -= r.seconds
    return out


def _log_once(key, message: str) -> None:
    if key not in _seams.logged:
        _seams.logged.add(key)
        logger.info(message)


def _original(cls, name):
    return _seams.originals[(cls, name)]


# -- the per-block lane decision ------------------------------------------------------------------

def _world() -> int | str:
    state = _seams.state
    return getattr(state, "world", "off") if state is not None else "off"


def _lane_devices():
    devices = getattr(_seams.state, "devices", None)
    if devices is not None:
        return devices
    dl = [d for d in (device_manager.device_list or []) if d is not None]
    return [str(d) for d in dl] if len(dl) > 1 else None


def _plan_lanes(units: int, price: int | None, reasons: list[str]):
    """Lanes for a pass of ``units`` indivisible pieces (batches, layers), or None for home alone.

    The same plan the tuner gets (``dpq.plan.resolve``: world, devices, memory), with the world
    capped at ``units`` (a pass cannot use more lanes than it has pieces). An explicit world
    that cannot be served raises :class:`dpq.plan.PlanRefused` here, before the block's work.
    """
    world = _world()
    if world == "off" or world == 1 or units < 2:
        return None
    if reasons:
        return None
    capped = min(world, units) if isinstance(world, int) else world
    home = torch.device(device_manager.device)
    plan = resolve(PlanRequest(world=capped, devices=_lane_devices(), samples_per_iter=units, home=home,
                               mirror_bytes=price))
    reasons.extend(plan.reasons)
    if plan.world < 2:
        return None
    return make_lanes(plan.devices)


def _block_refusals(block, inputs, runner) -> list[str]:
    """Why this block's passes must run on home alone (empty: they can be sharded)."""
    reasons = []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        reasons.append("a torch.distributed group is active")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        reasons.append("the pool is not a flat list of tensors (diffusion-style dict pool)")
    reasons.extend(_mirror_refusals(block, "block"))
    return reasons


def _mirror_refusals(module: torch.nn.Module, label: str) -> list[str]:
    """Why ``module`` cannot be mirrored onto lanes (empty: it can)."""
    reasons = []
    devices = {p.device for p in module.parameters()}
    if len(devices) > 1:
        reasons.append(f"the {label}'s weights span {len(devices)} devices (auto-round's split placement)")
    elif devices and next(iter(devices)).type == "meta":
        reasons.append(f"the {label} is on the meta device (disk streaming)")
    if any(hasattr(m, "_hf_hook") for m in module.modules()):
        reasons.append(f"the {label} carries accelerate dispatch hooks")
    for name, m in module.named_modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and getattr(fwd, "__self__", m) is not m:
            # a mirror would deep-copy whatever the replacement forward is bound to
            reasons.append(f"{name or 'the ' + label} has its forward replaced by {type(fwd).__name__}")
            break
    return reasons


def _hook_name(fn) -> str:
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(fn, "__qualname__", type(fn).__name__)


def _classify_hooks(block) -> tuple[dict[str, dict[str, str]], set[str], list[str]]:
    """(stat spec, ordered-sink labels, unmergeable hook names) of the hooks on ``block``."""
    spec: dict[str, dict[str, str]] = {}
    sinks: set[str] = set()
    unknown: list[str] = []
    for name, module in block.named_modules():
        for d in _HOOK_DICTS:
            for fn in getattr(module, d, {}).values():
                q = _hook_name(fn)
                if q in MODULE_STAT_HOOKS:
                    spec.setdefault(name, {}).update(MODULE_STAT_HOOKS[q])
                elif q in ORDERED_SINK_HOOKS:
                    sinks.add(ORDERED_SINK_HOOKS[q])
                else:
                    unknown.append(f"{name or '<block>'}:{q}")
        for d in ("_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, d, None):
                unknown.extend(f"{name or '<block>'}:{_hook_name(fn)}" for fn in getattr(module, d).values())
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


# -- seam 1: collection forwards ---------------------------------------------------------------------

class ShardedRunner:
    """Stands in for the composer's :class:`BlockForwardRunner` during one ``compress_block``.

    A call with the whole pool (no ``indices``, grad off) runs sharded when the plan gives
    lanes and every hook on the block is mergeable; anything else goes to the real runner.
    Attribute reads fall through to the real runner. Lanes forward through the runner's own
    ``forward`` with absolute sample ``indices``, so batch selection (per-sample lists, shared
    cache keys, tensors indexed on the batch dim) is auto-round's own.
    """

    def __init__(self, runner, composer, block_name: str) -> None:
        self._runner = runner
        self._composer = composer
        self._block_name = block_name
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
        if indices is not None or torch.is_grad_enabled() or _world() == "off":
            return self._home(block, inputs, input_others, indices, cache_device)
        t0 = time.perf_counter()
        if _world() == 1:
            out = self._home(block, inputs, input_others, indices, cache_device)
            self._record(1, t0, "", ["world 1"])
            return out
        runner = self._runner
        reasons = _block_refusals(block, inputs, runner)
        spec, sinks, unknown = _classify_hooks(block)
        if unknown:
            reasons.append(f"hooks without a merge rule run on home alone: {sorted(set(unknown))}")
        bs = max(1, int(runner.batch_size))
        n = len(inputs) if isinstance(inputs, list) else 0
        lanes = None if reasons else _plan_lanes(
            math.ceil(n / bs), _collection_price(block, inputs, bs), reasons)
        detail = ", ".join(sorted({f"{a}:{k}" for d in spec.values() for a, k in d.items()} | sinks)) or "no hooks"
        if lanes is None:
            out = self._home(block, inputs, input_others, indices, cache_device)
            self._record(1, t0, detail, reasons)
            return out
        try:
            out = self._sharded(block, inputs, input_others, cache_device, lanes, spec, bs)
        except Exception as err:
            if _world() != "auto":
                from .integration import ParallelLaneError

                raise ParallelLaneError(
                    f"dpq: a lane failed in a collection pass of {self._block_name} at world {len(lanes)}: "
                    f"{err!r}. The home block's statistics were restored; nothing already quantized was lost. "
                    "Fix: rerun with --parallel_quantization auto (falls back to serial per pass) or off"
                ) from err
            logger.warning(f"dpq: a lane failed in a collection pass of {self._block_name} ({err!r}); "
                           "statistics restored, rerunning the pass on home")
            out = self._home(block, inputs, input_others, indices, cache_device)
            self._record(1, t0, detail, [f"lane failure: {err!r}"], fell_back=True)
            return out
        self._record(len(lanes), t0, detail, reasons)
        return out

    def _sharded(self, block, inputs, input_others, cache_device, lanes, spec, bs):
        runner = self._runner
        out_device = cache_device if cache_device is not None else runner.cache_device
        low_mem = bool(getattr(getattr(self._composer.block_quantizer, "compress_context", None),
                               "low_gpu_mem_usage", False))
        lane_dicts: list[dict | None] = []
        fail_lane = _seams.fail_lane
        _seams.fail_lane = None

        def forward_fn(module, lane, start, stop):
            if fail_lane is not None and lane.index == fail_lane:
                raise RuntimeError("injected collection lane failure (dpq test hook)")
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
                                         out_device=out_device)
        except BaseException:
            _sink_restore(sinks)
            raise
        self.last_output_dict = None
        if any(d is not None for _, d in lane_dicts):
            merged: dict[str, list] = {}
            for lane, d in lane_dicts:
                for k, v in (d or {}).items():
                    merged.setdefault(k, []).extend(lane.hand_home(v, out_device))  # R2 + R3
            merged["hidden_states"] = outputs
            self.last_output_dict = merged
        return outputs

    def _record(self, world, t0, detail, reasons, fell_back=False):
        _seams.records.append(PhaseRecord(self._block_name, "collection", world, time.perf_counter() - t0,
                                          detail, list(reasons), fell_back))
        _log_once(("collection", world, detail, tuple(reasons)),
                  f"dpq: collection pass of {self._block_name} ({detail}) on {world} lane(s)"
                  + "".join(f"\n  - {r}" for r in reasons))


def _compress_block(self, block, fp_inputs, input_others, block_ctx, q_inputs=None, input_ids=None,
                    reference_output=None, **kwargs):
    original = _original(AlgorithmComposer, "compress_block")
    if _world() == "off":
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
        _seams.block_name = name
        try:
            _precompute_init_scales(q, block, name)
            return bound(*a, **k)
        finally:
            _seams.init_scales.clear()
            _seams.block_name = ""
            _seams.records.append(PhaseRecord(name, phase, 0, time.perf_counter() - t0, type(q).__name__))

    self.block_forward = ShardedRunner(real, self, name)
    if not shadowed:
        q.quantize_block = timed_quantize_block
    try:
        return original(self, block, fp_inputs, input_others, block_ctx, q_inputs, input_ids, reference_output,
                        **kwargs)
    finally:
        self.block_forward = real
        if not shadowed:
            del q.__dict__["quantize_block"]


# -- seam 2: iters=0 per-layer weight searches ------------------------------------------------------

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


def _search_lanes(q, targets: Sequence[torch.nn.Module], reasons: list[str]):
    if type(q)._quantize_layer_via_rtn is not BaseQuantizer._quantize_layer_via_rtn:
        reasons.append(f"{type(q).__name__} overrides _quantize_layer_via_rtn")
    if type(q).quantize_layer_outside_block is not BaseQuantizer.quantize_layer_outside_block:
        reasons.append(f"{type(q).__name__} overrides quantize_layer_outside_block")
    if any(not getattr(m, "global_name", None) for m in targets):
        reasons.append("a target layer has no global_name")
    if any(p.device.type == "meta" for m in targets for p in m.parameters()):
        reasons.append("a target layer is on the meta device (disk streaming)")
    price = max((sum(p.numel() * p.element_size() for p in m.parameters()) for m in targets), default=0) * 4
    return _plan_lanes(len(targets), price or None, reasons)


def _map_rtn(q, targets: list, disable_opt_rtn, block_name: str) -> bool:
    """Run each target's RTN / optimized-RTN search on one lane; False when it must run serially."""
    t0 = time.perf_counter()
    reasons: list[str] = []
    lanes = _search_lanes(q, targets, reasons) if len(targets) > 1 else None
    if lanes is None:
        if reasons:
            _seams.records.append(PhaseRecord(block_name, "search", 1, 0.0, "home alone", reasons, nested=True))
        return False
    home_device = torch.device(device_manager.device)
    via_rtn = BaseQuantizer._quantize_layer_via_rtn

    def run(layer, lane):
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

    owners_seen: dict[int, int] = {}

    def counting_run(layer, lane):
        owners_seen[lane.index] = owners_seen.get(lane.index, 0) + 1
        return run(layer, lane)

    map_over_lanes(targets, lanes, counting_run, cost=cost, collect=collect)
    per_lane = ", ".join(f"lane {k}: {owners_seen.get(k, 0)}" for k in range(len(lanes)))
    _log_once(("search", len(lanes)), f"dpq: per-layer weight searches of {block_name} mapped over "
              f"{len(lanes)} lanes ({per_lane})")
    _seams.records.append(PhaseRecord(block_name, "search", len(lanes), time.perf_counter() - t0,
                                      f"{len(targets)} layers ({per_lane})", reasons, nested=True))
    return True


def _block_name_of(targets) -> str:
    names = [getattr(m, "global_name", "") for m in targets]
    return names[0].rsplit(".", 2)[0] if names and names[0] else ""


@torch.no_grad()
def _rtn_quantize_block(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids=None,
                        **kwargs):
    original = _original(RTNQuantizer, "quantize_block")
    if _world() in ("off", 1):
        return original(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)
    targets = [m for _, m in block.named_modules() if check_to_quantized(m)]
    name = getattr(block_ctx, "block_name", "") or _block_name_of(targets)
    if not _map_rtn(self, targets, True, name):
        return original(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kwargs)
    return {}


def _opt_rtn_quantize_targets(self, targets: list) -> None:
    original = _original(OptimizedRTNQuantizer, "_quantize_targets")
    if _world() in ("off", 1) or not targets:
        return original(self, targets)
    singles = list(targets)
    if self._expert_search_active():
        batches, singles = self._split_expert_batches(targets)
        if batches:  # stacked expert searches: one call per group, on home
            original(self, [m for b in batches for m in b])
    if singles and not _map_rtn(self, singles, None, _block_name_of(singles)):
        original(self, singles)
    return None


# -- seam 3: SignRoundV2's wrap-time init-scale searches ----------------------------------------------

_OPT_WRAPPER = _v2.SignRoundOptimizedWrapperLinear


def _init_scale_key(layer, weight_reshape, imatrix, q_scale_thresh):
    return (tuple(weight_reshape.shape), weight_reshape.dtype, str(layer.data_type), int(layer.bits),
            float(q_scale_thresh), None if not isinstance(imatrix, torch.Tensor) else tuple(imatrix.shape),
            layer.weight._version)


def _init_scale_inputs(layer):
    """What SignRoundOptimizedWrapperLinear feeds search_optimized_init_scale for ``layer``."""
    weight_reshape = _original(_OPT_WRAPPER, "_prepare_init_scale_weight")(SimpleNamespace(orig_layer=layer))
    imatrix = reshape_imatrix_for_weight(getattr(layer, "imatrix", None), weight_reshape, layer.group_size)
    q_scale_thresh = 1e-8 if getattr(layer, "scale_dtype", None) == torch.float32 else 1e-5
    return weight_reshape, imatrix, q_scale_thresh


def _precompute_init_scales(q, block, block_name: str) -> None:
    """Before a SignRoundV2 block is wrapped: run every layer's init-scale search once on one lane
    and keep the results home; the wrapper then takes them instead of searching (same inputs,
    same function: bitwise)."""
    wrapper = getattr(q, "wrapper_block", None)
    if not isinstance(q, _v2.SignRoundV2Quantizer) or getattr(wrapper, "keywords", {}).get("wrapper_cls") \
            is not _OPT_WRAPPER or _world() in ("off", 1):
        return
    targets = [m for _, m in block.named_modules() if type(m) in SUPPORTED_LAYER_TYPES and check_to_quantized(m)]
    if len(targets) < 2 or any(p.device.type == "meta" for m in targets for p in m.parameters()):
        return
    t0 = time.perf_counter()
    reasons: list[str] = []
    price = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in targets) * 4
    lanes = _plan_lanes(len(targets), price, reasons)
    if lanes is None:
        return
    search = _original(_v2, "search_optimized_init_scale")

    def run(layer, lane):
        src = layer if lane.index == 0 else copy_to_lane(layer, lanes[0], lane)
        weight_reshape, imatrix, thresh = _init_scale_inputs(src)
        return search(weight_reshape, src.data_type, src.bits, imatrix, thresh)

    def collect(layer, result, lane):
        weight_reshape, imatrix, thresh = _init_scale_inputs(layer)
        if isinstance(result, torch.Tensor):
            result = result.to(weight_reshape.device)
        _seams.init_scales[id(layer)] = (_init_scale_key(layer, weight_reshape, imatrix, thresh), result)

    map_over_lanes(targets, lanes, run, cost=lambda m: float(m.weight.numel()), collect=collect)
    _seams.records.append(PhaseRecord(block_name, "search", len(lanes), time.perf_counter() - t0,
                                      f"{len(targets)} SignRoundV2 init-scale searches", reasons, nested=True))
    _log_once(("init_scale", len(lanes)), f"dpq: SignRoundV2 init-scale searches of {block_name} mapped over "
              f"{len(lanes)} lanes")


def _prepare_init_scale_weight(self):
    _seams.current_layer = self.orig_layer
    return _original(_OPT_WRAPPER, "_prepare_init_scale_weight")(self)


def _search_optimized_init_scale(weight_reshape, data_type, bits, imatrix=None, q_scale_thresh=1e-5):
    layer, _seams.current_layer = _seams.current_layer, None
    entry = _seams.init_scales.pop(id(layer), None) if layer is not None else None
    if entry is not None and layer.data_type == data_type and layer.bits == bits \
            and entry[0] == _init_scale_key(layer, weight_reshape, imatrix, q_scale_thresh):
        _seams.init_scale_hits += 1
        result = entry[1]
        return result.to(weight_reshape.device) if isinstance(result, torch.Tensor) else result
    t0 = time.perf_counter()
    result = _original(_v2, "search_optimized_init_scale")(weight_reshape, data_type, bits, imatrix, q_scale_thresh)
    if layer is not None and _seams.block_name:
        _seams.records.append(PhaseRecord(_seams.block_name, "search", 1, time.perf_counter() - t0,
                                          "SignRoundV2 init-scale search on home", nested=True))
    return result


# -- seam 4: AWQ's smoothing grid search (shard and reduce) and clip search (map) -------------------

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
    fail_lane: int | None = None  # test hook: the reference replay raises on this lane


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
        reasons.append("a torch.distributed group is active")
    if not any(True for _ in parent.parameters()):
        reasons.append("the parent has no weights")
    reasons.extend(_mirror_refusals(parent, "parent"))
    hooked = [f"{n or '<parent>'}:{_hook_name(fn)}" for n, m in parent.named_modules()
              for d in (*_HOOK_DICTS, "_backward_hooks", "_backward_pre_hooks") for fn in getattr(m, d, {}).values()]
    if hooked:  # a replay on a mirror would fire them there, not on home
        reasons.append(f"hooks on the parent: {sorted(set(hooked))}")
    inside = {id(m) for m in parent.modules()}
    if any(id(bl) not in inside for bl in mapping.balance_layers):
        reasons.append("a balance layer is outside the replayed parent")
    if not all(isinstance(e, tuple) and len(e) == 2 for e in kwargs_list):
        reasons.append("the cached parent calls are not (args, kwargs) pairs")
    return reasons


def _awq_grid_price(mapping, kwargs_list) -> int:
    weights = sum(p.numel() * p.element_size() for p in mapping.parent.parameters())
    act = 0
    for entry in kwargs_list[:1]:
        act = sum(t.numel() * 4 for t in entry[0] if isinstance(t, torch.Tensor))
    return int((weights + 3 * act * max(1, len(kwargs_list))) * MARGIN)


def _awq_grid_search_scales(self, mapping, x_mean):
    """AWQ's grid search with its sample replays sharded: auto-round's own loop (candidate scales,
    QDQ of the balance weights, comparison, choice) runs on home unchanged; only the replays of the
    cached parent calls (the reference pass and each grid point's loss) run lane by lane."""
    original = _original(AWQTransform, "_grid_search_scales")
    kwargs_list = self._parent_args_cache.get(mapping.parent, [])
    if _world() in ("off", 1) or _seams.awq_grid is not None or len(kwargs_list) < 2:
        return original(self, mapping, x_mean)
    t0 = time.perf_counter()
    block = _awq_block_name(self, mapping)
    reasons = _awq_grid_refusals(mapping, kwargs_list)
    lanes = None if reasons else _plan_lanes(len(kwargs_list), _awq_grid_price(mapping, kwargs_list), reasons)
    label = f"AWQ grid search of {mapping.smooth_name}"
    if lanes is None:
        out = original(self, mapping, x_mean)
        if reasons:
            _seams.records.append(PhaseRecord(block, "search", 1, time.perf_counter() - t0,
                                              f"{label} on home", list(reasons)))
        return out
    names = {id(m): n for n, m in mapping.parent.named_modules()}
    tuned = [f"{names[id(bl)]}.weight".lstrip(".") for bl in mapping.balance_layers]
    saved = [bl.weight.data for bl in mapping.balance_layers]  # the loop swaps .data; put these back on failure
    fail_lane = _seams.awq_fail_lane
    _seams.awq_fail_lane = None
    ctx = None
    try:
        replicas = ReplicaSet(mapping.parent, lanes, tuned=tuned, share_frozen=True)
        ctx = _AwqGrid(mapping.parent, kwargs_list, lanes, replicas,
                       [(bl, [m.get_submodule(names[id(bl)]) for m in replicas.modules[1:]])
                        for bl in mapping.balance_layers], fail_lane=fail_lane)
        _seams.awq_grid = ctx
        out = original(self, mapping, x_mean)
    except Exception as err:
        for bl, data in zip(mapping.balance_layers, saved, strict=True):
            bl.weight.data = data
        if _world() != "auto":
            from .integration import ParallelLaneError

            raise ParallelLaneError(
                f"dpq: a lane failed in the {label} of {block} at world {len(lanes)}: {err!r}. The balance "
                "weights were restored. Fix: rerun with --parallel_quantization auto (falls back to serial) or off"
            ) from err
        logger.warning(f"dpq: a lane failed in the {label} ({err!r}); weights restored, rerunning it on home")
        _seams.awq_grid = None
        out = original(self, mapping, x_mean)
        _seams.records.append(PhaseRecord(block, "search", 1, time.perf_counter() - t0, f"{label} on home",
                                          [f"lane failure: {err!r}"], fell_back=True))
        return out
    finally:
        _seams.awq_grid = None
        if ctx is not None:
            ctx.replicas.close(collect=not all(lane.device.type == "cpu" for lane in lanes))  # R5
    per_lane = ", ".join(f"lane {k}: {b - a}" for k, (a, b) in enumerate(contiguous_ranges(len(kwargs_list),
                                                                                            len(lanes))))
    _seams.records.append(PhaseRecord(block, "search", len(lanes), time.perf_counter() - t0,
                                      f"{label}: {ctx.points} grid points, cached calls per lane ({per_lane})",
                                      reasons))
    _log_once(("awq_grid", len(lanes)), f"dpq: AWQ grid-search replays of {block} sharded over {len(lanes)} lanes")
    return out


def _awq_ctx_for(parent, kwargs_list):
    ctx = _seams.awq_grid
    if ctx is None or parent is not ctx.parent or kwargs_list is not ctx.kwargs_list:
        return None
    return ctx


def _awq_run_parent_samples(self, parent, kwargs_list, offload_to_cpu=False):
    """The reference replay, sharded: lane k runs auto-round's own replay on its mirror for its
    cached calls; the outputs stay on the lane (the losses are computed there)."""
    original = _original(AWQTransform, "_run_parent_samples")
    ctx = _awq_ctx_for(parent, kwargs_list)
    if ctx is None or ctx.refs is not None:
        return original(self, parent, kwargs_list, offload_to_cpu)

    def fwd(module, lane, start, stop):
        if ctx.fail_lane == lane.index:
            raise RuntimeError("injected AWQ grid lane failure (dpq test hook)")
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


def _awq_compute_parent_loss(self, parent, kwargs_list, fp16_outputs):
    """One grid point's loss, shard and reduce. Each lane copies home's candidate balance weights into
    its mirror and returns the squared-error SUM of every (micro) call of its slice, one fp32 term
    per call; home folds the terms in serial's call order into a zero fp32 accumulator and divides
    by the total element count, which is the exact operation sequence of auto-round's serial loss
    (``loss += sum_c; ...; loss / n``). Each term is the same kernel on the same inputs, so the
    loss, and with it the comparison that picks the grid point, is bitwise serial's. (Adding
    per-lane partial sums instead would reassociate the fp32 sum: equal to ~1 ulp, which can flip
    a near-tie between two grid points.)"""
    original = _original(AWQTransform, "_compute_parent_loss")
    ctx = _awq_ctx_for(parent, kwargs_list)
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


def _awq_clip_block(self, block_prefix, block_mappings):
    """AWQ's clip searches mapped over lanes: before auto-round's ``_clip_block`` runs, every balance
    layer it will search gets its ``_compute_best_clip`` run once on one lane (read-only: the layer's
    weight and the mapping's features, as serial would pass them); the result is kept home and
    ``_clip_block`` takes it instead of searching (same function, same inputs: bitwise)."""
    original = _original(AWQTransform, "_clip_block")
    if _world() in ("off", 1):
        return original(self, block_prefix, block_mappings)
    t0 = time.perf_counter()
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
        reasons.append("a balance layer is on the meta device (disk streaming)")
    price = max((bl.weight.numel() * 4 for bl, _ in items), default=0) * 4
    lanes = _plan_lanes(len(items), price or None, reasons) if len(items) > 1 else None
    if lanes is None:
        if reasons:
            _seams.records.append(PhaseRecord(block_prefix, "search", 1, 0.0, "AWQ clip searches on home", reasons))
        return original(self, block_prefix, block_mappings)
    search = _original(AWQTransform, "_compute_best_clip")
    owners_seen: dict[int, int] = {}

    def run(item, lane):
        bl, feat = item
        owners_seen[lane.index] = owners_seen.get(lane.index, 0) + 1
        layer = bl if lane.device == bl.weight.device else copy_to_lane(bl, lanes[0], lane)
        return search(self, layer, feat)

    def collect(item, result, lane):
        bl, feat = item
        if result is not None:
            result = tuple(t.to(bl.weight.device) for t in result)
        _seams.awq_clips[id(bl)] = (_awq_clip_key(bl, feat), result)

    try:
        map_over_lanes(items, lanes, run, cost=lambda it: float(it[0].weight.numel()), collect=collect)
        return original(self, block_prefix, block_mappings)
    finally:
        _seams.awq_clips.clear()
        per_lane = ", ".join(f"lane {k}: {owners_seen.get(k, 0)}" for k in range(len(lanes)))
        _seams.records.append(PhaseRecord(block_prefix, "search", len(lanes), time.perf_counter() - t0,
                                          f"{len(items)} AWQ clip searches ({per_lane})", reasons))
        _log_once(("awq_clip", len(lanes)), f"dpq: AWQ clip searches of {block_prefix} mapped over "
                  f"{len(lanes)} lanes ({per_lane})")


def _awq_compute_best_clip(self, layer, input_feat):
    entry = _seams.awq_clips.pop(id(layer), _NO_CLIP)
    if entry is not _NO_CLIP and entry[0] == _awq_clip_key(layer, input_feat):
        _seams.awq_clip_hits += 1
        return entry[1]
    return _original(AWQTransform, "_compute_best_clip")(self, layer, input_feat)


# -- measurement helper -----------------------------------------------------------------------------

def measure_phases(world, devices=None, *, iters: int = 0, nsamples: int = 16, seqlen: int = 64,
                   batch_size: int = 8, tune_parallel: bool = True, **ar_kwargs) -> dict:
    """Quantize the embedded tiny Llama once and return the seconds per phase (collection / search /
    tune), the block records and the wall time. ``world='off'`` measures serial auto-round."""
    from auto_round import AutoRound

    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples

    from . import integration

    model = build_tiny_llama(TinyLlamaConfig())
    state = integration._State(world=world, devices=devices)
    if tune_parallel:
        integration.enable(world, devices)
        state = integration._state
    install(state)
    reset()
    t0 = time.perf_counter()
    try:
        AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(nsamples, seqlen),
                  device_map="cpu", enable_torch_compile=False, iters=iters, nsamples=nsamples, seqlen=seqlen,
                  batch_size=batch_size, seed=42, **ar_kwargs).quantize()
    finally:
        wall = time.perf_counter() - t0
        uninstall()
        tune_records = integration.run_summary() if tune_parallel else []
        if tune_parallel:
            integration.disable()
    return {"world": world, "wall": wall, "phases": phase_seconds(), "records": records(),
            "tune_records": tune_records, "state": {k: v.clone() for k, v in model.state_dict().items()}}



def main(argv: list[str] | None = None) -> int:
    """``python -m dpq.autoround.shard_seams``: per-phase seconds, serial vs world N, in one process."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=0)
    p.add_argument("--nsamples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--alg_ext", action="store_true", help="SignRoundV2 (enable_alg_ext)")
    p.add_argument("--no_gc_collect", action="store_true",
                   help="make gc.collect a no-op (auto-round calls it ~7x a block, ~0.2 s each on CPU)")
    args = p.parse_args(argv)
    if args.no_gc_collect:
        import gc

        gc.collect = lambda *a, **k: 0
    kw = dict(iters=args.iters, nsamples=args.nsamples, seqlen=args.seqlen, batch_size=args.batch_size)
    if args.alg_ext:
        kw["enable_alg_ext"] = True
    devices = ",".join(["cpu"] * args.world) if device_manager.device in (None, "cpu") else None
    measure_phases(1, None, tune_parallel=False, **kw)  # warm-up: first-call costs land here, not in a row
    runs = [("serial", measure_phases(1, None, tune_parallel=False, **kw)),
            (f"world {args.world}", measure_phases(args.world, devices, **kw))]
    print(f"threads {torch.get_num_threads()}, {kw}")
    print("| run | collection s | search s | tune s | quantize() wall s |")
    print("|---|---|---|---|---|")
    for label, r in runs:
        ph = r["phases"]
        print(f"| {label} | {ph['collection']:.2f} | {ph['search']:.2f} | {ph['tune']:.2f} | {r['wall']:.2f} |")
    same = all(torch.equal(runs[0][1]["state"][k], runs[1][1]["state"][k]) for k in runs[0][1]["state"])
    print(f"model state bitwise equal to serial: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
