"""Sharded no-grad passes over lanes: collection forwards, hook statistics, per-item maps.

Three building blocks, none of them tied to a particular tuner (this module does not import
auto-round; ``dpq.autoround.shard_seams`` plugs them into auto-round's calibration passes):

* :func:`shard_forward` runs a pass over ``n_samples`` calibration samples, each lane
  forwarding one contiguous range (:func:`contiguous_ranges`) on its own module, and returns
  the per-sample results **in sample order**. With ``align`` set to the tuner's forward batch
  size the range boundaries fall on batch boundaries, so every batch a lane forwards is
  exactly a batch the serial pass would have formed: same composition, same kernels, bitwise
  the same outputs (under bf16 autocast too).
* Hook statistics. A *stat spec* names, per submodule, the attributes a forward hook keeps
  and how partial values combine: ``"sum"`` (partial sums add), ``"max"`` (maxima fold by
  max), ``"count"`` (counts add). :func:`sharded_collection` builds short-lived mirrors
  (:class:`dpq.mirror.ReplicaSet`; the hooks registered on home are copied with the modules),
  clears the spec's attributes on the mirrors so each lane accumulates only its own range,
  runs :func:`shard_forward`, then folds every lane's partials into the home module in lane
  order (:func:`merge_module_stats`). Maxima and counts come out bitwise equal to serial;
  sums come out equal up to fp32 reassociation, except when every lane holds one batch,
  where the fold is the serial order exactly.
* :func:`map_over_lanes` runs a per-item job (a layer's weight search) once on one lane
  each, items assigned by :func:`assign_items`, results collected in item order.
  :func:`copy_to_lane` and :func:`bring_home` move a module to a lane and its result back.

Invariants: one thread issues everything, lane by lane in sample order (contract 4), so a
hook that appends into a shared container sees the serial order; stream order follows the
rules in ``dpq.streams``: every lane waits for the current stream before it reads home's
state (R1: mirrors, copies, forwards, per-item jobs), everything a lane produced is handed
home through :meth:`Lane.hand_home <dpq.streams.Lane.hand_home>` (R2 + R3: outputs, merged
statistics, per-item results) and the mirrors are dropped through ``ReplicaSet.close`` (R5); nothing here modifies the
home module except the merge of statistics and what a map's ``collect`` writes; on an
exception inside a sharded collection the home statistics are restored to what they were
before the pass, so the caller can rerun it serially without double counting.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from dpq.engine.split import contiguous_ranges
from dpq.mirror import ReplicaSet, module_tensors
from dpq.streams import Lane

__all__ = [
    "MERGERS", "StatSpec", "assign_items", "bring_home", "clear_module_stats", "copy_to_lane", "map_over_lanes",
    "merge_count", "merge_max", "merge_module_stats", "merge_stats", "merge_sum", "move_tensors", "read_module_stats",
    "restore_module_stats", "shard_forward", "sharded_collection", "snapshot_module_stats",
]

# module name (as in named_modules(); "" = the module itself) -> attribute -> "sum" | "max" | "count"
StatSpec = Mapping[str, Mapping[str, str]]


# -- ranges and sharded forwards -------------------------------------------------------------

def move_tensors(value: Any, device: torch.device | None) -> Any:
    """``value`` with every tensor in it (lists, tuples, dicts, nested) moved to ``device`` (None: as is)."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(move_tensors(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_tensors(v, device) for k, v in value.items()}
    return value


def shard_forward(
    modules_per_lane: Sequence[torch.nn.Module],
    lanes: Sequence[Lane],
    n_samples: int,
    forward_fn: Callable[[torch.nn.Module, Lane, int, int], Sequence[Any]],
    *,
    align: int = 1,
    out_device: torch.device | str | None = None,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> list[Any]:
    """Forward ``n_samples`` samples, lane ``k`` taking the k-th contiguous range on ``modules_per_lane[k]``.

    ``forward_fn(module, lane, start, stop)`` returns one result per sample of ``[start, stop)``
    (it runs under the lane's stream). Lanes are issued in order from this one thread; results
    come back as one list in sample order, moved to ``out_device`` when given (else left where
    ``forward_fn`` put them). Lanes with an empty range are not called. ``ranges``: the lanes' own
    ``[start, stop)`` (several processes: this process's slice of the global lanes' ranges,
    :func:`dpq.sharded.shard_processes.global_ranges`); the results are then those ranges' samples, in order.
    """
    if len(modules_per_lane) != len(lanes):
        raise ValueError(f"dpq: {len(modules_per_lane)} modules for {len(lanes)} lanes")
    dest = torch.device(out_device) if out_device is not None else None
    parts: list[list[Any]] = []
    if ranges is None:
        ranges = contiguous_ranges(n_samples, len(lanes), align)
    for module, lane, (start, stop) in zip(modules_per_lane, lanes, ranges, strict=True):
        if start == stop:
            parts.append([])
            continue
        lane.wait_for_current()  # inputs and home state were produced on the current stream
        with lane.issue():
            result = list(forward_fn(module, lane, start, stop))
        if len(result) != stop - start:
            raise RuntimeError(f"dpq: lane {lane.index} returned {len(result)} results for samples "
                               f"[{start}, {stop}) ({stop - start} expected)")
        parts.append(result)
    out: list[Any] = []
    for lane, part in zip(lanes, parts, strict=True):
        # R2 + R3: the results are read (and later freed) by home; across devices they are
        # copied on the lane's stream, on the same device recorded on the current stream.
        out.extend(lane.hand_home(part, dest))
    return out


# -- statistics --------------------------------------------------------------------------------

def _to_like(lane_value: Any, home_value: Any) -> Any:
    if isinstance(lane_value, torch.Tensor) and isinstance(home_value, torch.Tensor):
        return lane_value.to(home_value.device)
    return lane_value


def merge_sum(home: Any, lane: Any) -> Any:
    """Partial sums add (tensors: in the home value's device and dtype)."""
    if isinstance(home, torch.Tensor):
        return home + _to_like(lane, home).to(home.dtype)
    return home + lane


def merge_max(home: Any, lane: Any) -> Any:
    """Maxima fold by elementwise max (exact: bitwise equal to a serial running max)."""
    if isinstance(home, torch.Tensor):
        return torch.maximum(home, _to_like(lane, home).to(home.dtype))
    return max(home, lane)


def merge_count(home: Any, lane: Any) -> Any:
    """Counts add (ints, or integer tensors)."""
    if isinstance(home, torch.Tensor):
        return home + _to_like(lane, home)
    return int(home) + int(lane)


MERGERS: dict[str, Callable[[Any, Any], Any]] = {"sum": merge_sum, "max": merge_max, "count": merge_count}


def merge_stats(
    home: Mapping[str, Any],
    lanes: Sequence[Mapping[str, Any]],
    kinds: Mapping[str, str],
    *,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Fold per-lane statistics into the home ones, lane by lane in order; returns the merged dict.

    ``kinds[key]`` says how ``key`` combines (``"sum"``, ``"max"``, ``"count"``). A key missing
    at home (home saw no sample for it) is taken from the first lane that has it, moved to
    ``device`` when given. Keys absent from ``kinds`` are refused: an unknown statistic has no
    safe merge.
    """
    unknown = {k for d in (home, *lanes) for k in d} - set(kinds)
    if unknown:
        raise ValueError(f"dpq: no merge rule for statistics {sorted(unknown)}; known kinds: {dict(kinds)}")
    bad = {k: v for k, v in kinds.items() if v not in MERGERS}
    if bad:
        raise ValueError(f"dpq: unknown merge kinds {bad}; use one of {sorted(MERGERS)}")
    out = dict(home)
    for stats in lanes:
        for key, value in stats.items():
            if key not in out:
                out[key] = move_tensors(value, torch.device(device)) if device is not None else value
            else:
                out[key] = MERGERS[kinds[key]](out[key], value)
    return out


def read_module_stats(module: torch.nn.Module, spec: StatSpec) -> dict[str, dict[str, Any]]:
    """{submodule name: {attribute: value}} for the spec's attributes that are set."""
    out = {}
    for name, attrs in spec.items():
        sub = module.get_submodule(name)
        out[name] = {a: getattr(sub, a) for a in attrs if hasattr(sub, a)}
    return out


def clear_module_stats(module: torch.nn.Module, spec: StatSpec) -> None:
    """Delete the spec's attributes from ``module`` (a mirror starts its range from nothing)."""
    for name, attrs in spec.items():
        sub = module.get_submodule(name)
        for a in attrs:
            if a in sub.__dict__:
                delattr(sub, a)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.copy(value)


def snapshot_module_stats(module: torch.nn.Module, spec: StatSpec) -> dict[str, dict[str, Any]]:
    """A copy of the spec's attributes (tensors cloned: hooks may accumulate in place)."""
    return {n: {a: _clone(v) for a, v in d.items()} for n, d in read_module_stats(module, spec).items()}


def restore_module_stats(module: torch.nn.Module, spec: StatSpec, snapshot: Mapping[str, Mapping[str, Any]]) -> None:
    """Put the spec's attributes back exactly as in ``snapshot`` (absent ones deleted)."""
    clear_module_stats(module, spec)
    for name, values in snapshot.items():
        sub = module.get_submodule(name)
        for a, v in values.items():
            setattr(sub, a, v)


def merge_module_stats(
    home: torch.nn.Module, others: Sequence[torch.nn.Module], spec: StatSpec, lanes: Sequence[Lane] | None = None
) -> None:
    """Fold each mirror's statistics into the home module's attributes, mirrors in lane order.

    ``lanes[k]`` is the lane of ``others[k]``: its statistics are handed home first (R2 + R3), as
    a mirror's tensor can become home's own (a statistic home did not have yet).
    """
    home_stats = read_module_stats(home, spec)
    lane_stats = [read_module_stats(m, spec) for m in others]
    if lanes is not None:
        lane_stats = [lane.hand_home(s) for lane, s in zip(lanes, lane_stats, strict=True)]
    for name, kinds in spec.items():
        sub = home.get_submodule(name)
        device = next((p.device for p in sub.parameters()), None)
        merged = merge_stats(home_stats[name], [s[name] for s in lane_stats], kinds, device=device)
        for a, v in merged.items():
            setattr(sub, a, v)


def sharded_collection(
    module: torch.nn.Module,
    lanes: Sequence[Lane],
    n_samples: int,
    forward_fn: Callable[[torch.nn.Module, Lane, int, int], Sequence[Any]],
    spec: StatSpec,
    *,
    align: int = 1,
    out_device: torch.device | str | None = None,
    share_frozen: bool = True,
    ranges: Sequence[tuple[int, int]] | None = None,
) -> list[Any]:
    """One collection pass over lanes with hook statistics merged into ``module`` (home).

    Builds short-lived mirrors (hooks registered on home come along with the modules), clears
    the spec's statistics on them, runs :func:`shard_forward` (home forwards the first range
    itself; ``ranges`` as there), folds the mirrors' statistics into home in lane order and drops the mirrors.
    ``share_frozen``: mirrors on home's device reuse home's tensors (nothing is tuned here);
    statistics stay separate because the mirrors' attributes are cleared first. On any
    exception home's statistics are restored to their state before the pass, then it re-raises.
    """
    before = snapshot_module_stats(module, spec)
    replicas = None
    try:
        replicas = ReplicaSet(module, lanes, tuned=(), share_frozen=share_frozen)
        for mirror in replicas.modules[1:]:
            clear_module_stats(mirror, spec)
        outputs = shard_forward(replicas.modules, lanes, n_samples, forward_fn, align=align, out_device=out_device,
                                ranges=ranges)
        merge_module_stats(module, replicas.modules[1:], spec, lanes=list(lanes[1:]))
        return outputs
    except BaseException:
        restore_module_stats(module, spec, before)
        raise
    finally:
        if replicas is not None:
            # R5 either way. CPU lanes have nothing to hand back to a device allocator: no
            # full gc.collect() (~0.2 s a pass with torch loaded).
            replicas.close(collect=not all(lane.device.type == "cpu" for lane in lanes))


# -- per-item maps -------------------------------------------------------------------------------

def assign_items(n_items: int, world: int, costs: Sequence[float] | None = None) -> list[int]:
    """The lane of each item. Without costs: round robin. With costs: greedy longest-first onto
    the least-loaded lane (ties: lower item index first, lower lane first). Deterministic."""
    if world < 1:
        raise ValueError("dpq: assign_items needs world >= 1")
    if costs is None:
        return [i % world for i in range(n_items)]
    if len(costs) != n_items:
        raise ValueError(f"dpq: {len(costs)} costs for {n_items} items")
    load = [0.0] * world
    owner = [0] * n_items
    for i in sorted(range(n_items), key=lambda i: (-costs[i], i)):
        lane = min(range(world), key=lambda k: (load[k], k))
        owner[i] = lane
        load[lane] += costs[i]
    return owner


def map_over_lanes(
    items: Sequence[Any],
    lanes: Sequence[Lane],
    fn: Callable[[Any, Lane], Any],
    *,
    cost: Callable[[Any], float] | None = None,
    collect: Callable[[Any, Any, Lane], Any] | None = None,
    owners: Sequence[int] | None = None,
) -> list[Any]:
    """Run ``fn(item, lane)`` once per item, each on one lane; results in item order.

    Items are issued in item order from this thread, each under its lane's stream (after the
    lane waits for the current stream, R1); after all are issued, each result is handed home
    (R2 + R3: tensors, and the tensors of modules, recorded on the current stream, so home
    may keep or drop them) and ``collect(item, result, lane)`` (when given) brings each
    result home, again in item order; its return values are the results. Finally every lane
    waits for the current stream, so what home did with a lane's tensors precedes that
    lane's later work. ``owners`` overrides :func:`assign_items`.
    """
    if owners is None:
        owners = assign_items(len(items), len(lanes), [cost(i) for i in items] if cost else None)
    if len(owners) != len(items) or any(not 0 <= o < len(lanes) for o in owners):
        raise ValueError("dpq: map_over_lanes owners must give one lane index per item")
    results = []
    for item, o in zip(items, owners, strict=True):
        lane = lanes[o]
        lane.wait_for_current()
        with lane.issue():
            results.append(fn(item, lane))
    results = [_hand_home_deep(lanes[o], r) for r, o in zip(results, owners, strict=True)]
    if collect is not None:
        results = [collect(item, r, lanes[o]) for item, r, o in zip(items, results, owners, strict=True)]
    for lane in lanes:
        lane.wait_for_current()  # R5 for the lanes' copies that die with the results
    return results


def _hand_home_deep(lane: Lane, result: Any) -> Any:
    """:meth:`Lane.hand_home` on the lane's device, reaching into modules too (a search's lane copy)."""
    lane.hand_home([t for m in _modules_in(result) for t in module_tensors(m)])
    return lane.hand_home(result)


def _modules_in(value: Any, depth: int = 0) -> Iterator[torch.nn.Module]:
    if isinstance(value, torch.nn.Module):
        yield value
    elif depth < 2 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _modules_in(v, depth + 1)


def copy_to_lane(module: torch.nn.Module, home_lane: Lane, lane: Lane) -> torch.nn.Module:
    """A private copy of ``module`` on ``lane``'s device that shares no storage with home
    (a search may write the weight in place); aliasing inside the module is kept. The copy is
    queued on the lane's stream after it waits for the current stream (R1, in ``ReplicaSet``)."""
    return ReplicaSet(module, [home_lane, lane], tuned=(), share_frozen=False).modules[1]


_TORCH_INTERNALS = {"training"}


def _adopt_tensor(value: Any, lane_device: torch.device, home_device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device == lane_device and lane_device != home_device:
        return value.to(home_device)
    return value


def _adopt_state(home: torch.nn.Module, lane_copy: torch.nn.Module, lane_device, home_device) -> None:
    for store in ("_parameters", "_buffers"):
        home_store, lane_store = getattr(home, store), getattr(lane_copy, store)
        for name, t in lane_store.items():
            h = home_store.get(name)
            if t is None or h is None or h.shape != t.shape or h.dtype != t.dtype:
                if t is None:
                    home_store[name] = None
                elif isinstance(t, torch.nn.Parameter):
                    home_store[name] = torch.nn.Parameter(t.detach().to(home_device), requires_grad=t.requires_grad)
                else:
                    home_store[name] = t.detach().to(home_device)
                continue
            with torch.no_grad():
                h.data.copy_(t.data)  # in place, as a serial search writes the home weight
        for name in [n for n in home_store if n not in lane_store]:
            del home_store[name]
    home_attrs = {k for k in home.__dict__ if not k.startswith("_") and k not in _TORCH_INTERNALS
                  and not isinstance(home.__dict__[k], torch.nn.Module)}
    lane_attrs = {k for k in lane_copy.__dict__ if not k.startswith("_") and k not in _TORCH_INTERNALS}
    for k in home_attrs - lane_attrs:
        delattr(home, k)
    for k in lane_attrs:
        v = lane_copy.__dict__[k]
        if isinstance(v, torch.nn.Module):
            continue  # plain module references are not state of this module
        home.__dict__[k] = _adopt_tensor(v, lane_device, home_device)


def bring_home(
    result: torch.nn.Module,
    lane_copy: torch.nn.Module,
    home: torch.nn.Module,
    *,
    lane_device: torch.device | str,
    home_device: torch.device | str,
) -> torch.nn.Module:
    """The home-side equivalent of ``result``, a module produced on a lane from ``lane_copy``
    (the lane's copy of ``home``).

    ``home`` takes ``lane_copy``'s final state in place (parameters and buffers copied into
    home's own storage where shape and dtype allow; plain attributes set or deleted to match;
    tensors left on the lane device moved to ``home_device``, others, such as CPU-resident
    scales, kept). When ``result`` is ``lane_copy`` that is ``home`` itself; when ``result``
    wraps ``lane_copy`` (or is a new module) it is copied with ``lane_copy`` replaced by
    ``home`` and its own lane tensors moved home.
    """
    lane_device, home_device = torch.device(lane_device), torch.device(home_device)
    home_subs = dict(home.named_modules())
    pairs = [(home_subs[n], sub) for n, sub in lane_copy.named_modules() if n in home_subs]
    for h, sub in reversed(pairs):  # children first, the module itself last
        _adopt_state(h, sub, lane_device, home_device)
    if result is lane_copy:
        return home
    # lane objects -> their home counterparts, so the copy of ``result`` points at home's state
    memo: dict[int, Any] = {}
    for h, sub in pairs:
        memo[id(sub)] = h
        for store in ("_parameters", "_buffers"):
            for name, t in getattr(sub, store).items():
                if t is not None and getattr(h, store).get(name) is not None:
                    memo[id(t)] = getattr(h, store)[name]
        for k, v in sub.__dict__.items():
            if isinstance(v, torch.Tensor) and k in h.__dict__:
                memo[id(v)] = h.__dict__[k]
    for t in module_tensors(result):
        if id(t) not in memo:
            memo[id(t)] = _adopt_tensor(t, lane_device, home_device)
    out = copy.deepcopy(result, memo)
    if lane_device != home_device:
        for m in out.modules():  # wrappers remember "their" device (as dpq.mirror rewrites it lane-wards)
            for attr in ("device", "output_device"):
                v = m.__dict__.get(attr)
                if isinstance(v, (str, torch.device)) and torch.device(v) == lane_device:
                    m.__dict__[attr] = home_device if isinstance(v, torch.device) else str(home_device)
    return out
