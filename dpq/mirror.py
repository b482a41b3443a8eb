"""Replicas of one module on a set of lanes.

``ReplicaSet(module, lanes, tuned)`` keeps the caller's module as lane 0 (home, no copy) and
builds one mirror per extra lane. Invariants kept here:

* **Aliasing.** A mirror is made by one ``copy.deepcopy`` whose memo is pre-seeded with the
  lane-side copy of every tensor reachable from the module's ``__dict__``s (parameters,
  buffers, plain tensor attributes, and tensors inside dict/list/tuple attributes such as
  auto-round's ``WrapperLinear.params``). deepcopy resolves every reference to a tensor
  through that memo, so a tensor that appears under two names at home is one tensor in
  the mirror too: the optimizer's params, the registered parameters and a wrapper's
  ``params`` dict stay the same objects. A broken alias would silently stop gradients.
  Containers are walked at any depth: a tensor deepcopy met without a memo entry would be
  cloned on home's device.
* **No home-device spike.** Tensors are copied straight to the lane's device; nothing
  is duplicated on home first.
* **Frozen tensors are shared, tuned ones never.** On a lane that shares home's device,
  tensors that are not tuned (frozen weights, buffers) are the same storage as home's:
  they are read-only during tuning. Tuned parameters are always fresh copies.
* **Identical state.** After the exchange and the step, every lane's tuned parameters are
  bitwise equal (``check_identical`` verifies it; the engine calls it in debug mode).
* **Teardown.** ``close()`` drops every mirror and the references this object holds, so
  the memory returns to the pre-block baseline; the home module is never modified here.
* **Lane-local data** (R7 in ``dpq.streams``). :class:`LaneData` is each lane's view of the
  block's pool: every sample a lane reads reaches it through :meth:`Lane.bring
  <dpq.streams.Lane.bring>` (from the lane's own device: as it is; from another device: on the
  lane's side stream there; from host memory: pinned once per block, copied ``non_blocking``),
  and per-block constants (masks, shared positional inputs) are brought to each lane once.
* **Stream order** (rules in ``dpq.streams``). A lane's stream waits for the current stream
  before its mirror is copied from home, and the current stream waits for the copies before
  home may write what they read (R1); the identical-state check and ``close()`` make
  the current stream wait for every lane first (R2), and ``close()`` also makes every lane
  wait for the current stream (R5), so the failure path (``close()`` in a ``finally``) is
  ordered like the normal one.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator, Sequence

import torch

from dpq.streams import Lane, backend, map_tensors

__all__ = ["LaneData", "ReplicaMismatchError", "ReplicaSet", "module_tensors", "release_cached_memory", "tensors_in"]


class ReplicaMismatchError(RuntimeError):
    """Lanes disagree on a tuned parameter: the exchange or the step is broken."""


def tensors_in(value, levels: int | None = None, _seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """The tensors in ``value``: itself, or inside dicts/lists/tuples nested up to ``levels`` deep
    (None: at any depth; a container met twice, or inside itself, is walked once)."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if not isinstance(value, (dict, list, tuple)) or levels == 0:
        return
    seen = set() if _seen is None else _seen
    if id(value) in seen:
        return
    seen.add(id(value))
    deeper = None if levels is None else levels - 1
    for v in value.values() if isinstance(value, dict) else value:
        yield from tensors_in(v, deeper, seen)


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor held by the module tree (each module's params, buffers and attributes, inside
    dicts/lists/tuples at any depth: the mirror copies each to the lane, none is left on home)."""
    for m in module.modules():
        yield from tensors_in(m.__dict__)


def _lane_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = t.detach().to(device, copy=True)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(data, requires_grad=t.requires_grad)
    return data.requires_grad_(t.requires_grad) if t.is_leaf else data


def _mirror(module: torch.nn.Module, device: torch.device, tuned_ids: set[int], share_frozen: bool):
    memo: dict[int, object] = {}
    for t in module_tensors(module):
        if id(t) in memo:
            continue
        if share_frozen and id(t) not in tuned_ids and t.device == device:
            memo[id(t)] = t
        else:
            memo[id(t)] = _lane_copy(t, device)
    mirror = copy.deepcopy(module, memo)
    for m in mirror.modules():
        # Wrappers remember "their" device as a plain attribute (auto-round's WrapperLinear
        # keeps .device / .output_device); point them at the lane, in the attribute's own form
        # (a str stays a str) and untouched where it already names the lane's device: a compiled
        # forward guards on it (``x.to(self.device)``), and a mirror whose 'cpu' had become
        # torch.device('cpu') recompiled the block on every lane that shares home's device.
        for attr in ("device", "output_device"):
            value = m.__dict__.get(attr)
            if isinstance(value, (str, torch.device)) and not _names(value, device):
                m.__dict__[attr] = str(device) if isinstance(value, str) else device
    return mirror


def _names(value: str | torch.device, device: torch.device) -> bool:
    """``value`` (a device or its name) is ``device``."""
    try:
        return torch.device(value) == device
    except (RuntimeError, TypeError):
        return False


class ReplicaSet:
    """The home module plus one mirror per extra lane; see the module docstring."""

    def __init__(
        self,
        module: torch.nn.Module,
        lanes: Sequence[Lane],
        tuned: Sequence[str],
        *,
        share_frozen: bool = True,
    ) -> None:
        if not lanes:
            raise ValueError("dpq: ReplicaSet needs at least one lane")
        named = dict(module.named_parameters(remove_duplicate=False))
        missing = [n for n in tuned if n not in named]
        if missing:
            raise ValueError(f"dpq: tuned parameter names not found in the module: {missing[:5]}")
        self.lanes = list(lanes)
        self.tuned_names = list(tuned)
        tuned_ids = {id(named[n]) for n in tuned}
        self.modules: list[torch.nn.Module] = [module]
        for lane in self.lanes[1:]:
            # R1 before the copy is queued: home's tensors may still be in production on the
            # current stream (auto-round's caching forward, wrapper_block). Frozen tensors
            # shared with a same-device mirror are read by the lane from here on, which is
            # why close() makes the current stream wait before home may free them.
            lane.wait_for_current()
            with lane.issue():
                self.modules.append(_mirror(module, lane.device, tuned_ids, share_frozen))
        for lane in self.lanes[1:]:
            # R1, write-after-read: home writes its tuned tensors in place from its first
            # forward on (auto-round's wrappers clamp the min/max scales in the forward), so
            # the current stream waits until the copies have read them (found by the checker).
            lane.current_waits_for_me()
        self._tuned = [self._lookup(m) for m in self.modules]

    def _lookup(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        named = dict(module.named_parameters(remove_duplicate=False))
        return [named[n] for n in self.tuned_names]

    @property
    def local_lanes(self) -> int:
        """This process's lanes (the exchange's world may span more: ``TuneEngine.world``)."""
        return len(self.lanes)

    @property
    def home(self) -> torch.nn.Module:
        return self.modules[0]

    def tuned_params(self, lane: int) -> list[torch.nn.Parameter]:
        """Lane ``lane``'s tuned parameters, in the caller's order (same order on every lane)."""
        return self._tuned[lane]

    def check_identical(self) -> None:
        """Raise ReplicaMismatchError unless every lane's tuned parameters equal home's bit for bit."""
        for lane in self.lanes[1:]:
            lane.current_waits_for_me()  # R2: the lanes' steps may still be queued
        for k in range(1, self.local_lanes):
            for name, ref, p in zip(self.tuned_names, self._tuned[0], self._tuned[k], strict=True):
                other = p.detach().to(ref.device)
                if ref.dtype.is_floating_point and ref.element_size() in (2, 4, 8):
                    int_t = {2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
                    same = torch.equal(ref.detach().view(int_t), other.view(int_t))
                else:
                    same = torch.equal(ref.detach(), other)
                if not same:
                    raise ReplicaMismatchError(f"dpq: lane {k} diverged from home on tuned parameter {name!r}")

    def join_lanes(self) -> None:
        """R5: the current stream and every lane wait for each other (no host sync).

        Afterwards home may read, free, snapshot or pack anything a lane touched, and what
        home read of a lane's tensors is done before that lane's allocator reuses them.
        """
        for lane in self.lanes[1:]:
            lane.current_waits_for_me()
        for lane in self.lanes[1:]:
            lane.wait_for_current()

    def close(self, *, collect: bool = True, release_cache: bool = True) -> None:
        """Join the lanes with the current stream (R5), then drop the mirrors; home is untouched.

        Safe to call twice. ``collect=False`` skips the cycle collection (CPU passes that
        have no device allocator to hand memory back to). ``release_cache=False`` keeps the
        allocator's cached blocks (freeing device memory waits for the device: skipped when the
        lanes' work can never end, ``dpq.tune_loop.LanesHung.stuck``). Whoever else holds lane
        memory (the engine's optimizers and gradient buffers) lets go of it before this call.
        """
        self.join_lanes()
        for lane in self.lanes:
            lane.join_sides()  # R5 for what the lanes brought from other devices (R7)
        had_mirrors = len(self.modules) > 1
        del self.modules[1:]
        del self._tuned[1:]
        if had_mirrors and collect:
            # Wrapped modules hold reference cycles (bound methods kept as attributes), so a
            # mirror is only freed by the cycle collector; collect now so the memory is back
            # before the next block. Skipped at world 1: a full collection costs ~0.2 s.
            gc.collect()
        if release_cache:
            release_cached_memory([lane.device for lane in self.lanes[1:]])


def release_cached_memory(devices: Sequence[torch.device]) -> None:
    """Hand the caching allocator's free blocks on ``devices`` back to the device (each backend's
    ``empty_cache``, once per device type), so the next block's free-memory plan sees them."""
    for type_ in dict.fromkeys(torch.device(d).type for d in devices):
        backend(torch.device(type_)).empty_cache()


class LaneData:
    """Each lane's view of one block's pool (module docstring: lane-local data).

    Call its methods inside the lane's ``issue()`` (the lane loss runs there): the copies land in
    memory of the lane's stream. Host memory is pinned once per tensor (kept for the block, so the
    source of every asynchronous copy outlives it); per-block constants are brought once per lane.
    """

    def __init__(self) -> None:
        self._once: dict[tuple[int, str], object] = {}
        self._pinned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def ready(self, lane: Lane, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as :meth:`Lane.bring` wants it: pinned when it is in host memory and the lane
        is an accelerator (a copy once per tensor, kept), else itself."""
        if not lane.accelerator or not backend(tensor.device).host_memory(tensor.device):
            return tensor
        key = id(tensor)
        if key not in self._pinned:
            self._pinned[key] = (tensor, lane.backend.pin(tensor))  # the source kept: its id stays unique
        return self._pinned[key][1]

    def bring(self, lane: Lane, tensor: torch.Tensor) -> torch.Tensor:
        """One tensor on ``lane`` (R7)."""
        return lane.bring(self.ready(lane, tensor))

    def once(self, lane: Lane, key: str, value):
        """``value`` (a tensor, or lists/tuples/dicts of them) on ``lane``, brought the first time
        ``key`` is asked for on that lane: per-block constants (loss masks, shared positional inputs)."""
        slot = (lane.index, key)
        if slot not in self._once:
            self._once[slot] = map_tensors(value, lambda t: self.bring(lane, t))
        return self._once[slot]

    def gather(self, lane: Lane, samples, indices, dim: int = 0) -> torch.Tensor:
        """``samples[i] for i in indices`` concatenated along ``dim`` on ``lane``: each sample
        brought from where it lives (R7), the concatenation queued on the lane's stream.

        Note [one sample, no concatenation]: a lane with one sample per iteration (8 lanes of a
        batch of 8) gets the copy ``bring`` just made, not a concatenation of it: the same values
        in a tensor of its own, one op fewer on the issuing thread per lane-iteration. A sample that
        already lives on the lane (``bring`` returns the pool's own tensor) is still copied by the
        concatenation, so nothing the lane does can write into the pool."""
        if len(indices) == 1:
            brought = self.bring(lane, samples[indices[0]])
            if brought is not samples[indices[0]] and brought.is_contiguous():
                return brought
            return torch.cat([brought], dim=dim)
        return torch.cat([self.bring(lane, samples[i]) for i in indices], dim=dim)
