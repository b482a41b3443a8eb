"""The iteration engine: one data-parallel SignRound iteration per call.

The loop that drives it (sampler, lr schedule, best-iteration snapshot, early stop) belongs
to the tuner's adapter (``dpq/autoround/``); this module knows nothing of auto-round.

One iteration (``TuneEngine.backward`` then ``TuneEngine.step``)::

    split      the serial run's global indices into W contiguous slices (sizes differ by <= 1)
    micro-step each lane cuts its slice into chunks of ``micro_batch`` (gradient accumulation
               inside the lane); for micro-step m:
      forward  lane 0 .. W-1, issued by this one thread, each under its own stream
      backward ONE torch.autograd.backward over every lane's weighted loss: autograd's
               per-device threads run the lanes' backwards concurrently
    exchange   grads -> identical reduced grads on every lane
    readback   one host sync for the iteration's micro-step losses
    step       (separate call, so the caller can snapshot best params first) every lane
               applies the same update; the mirrors stay bitwise identical

Loss weighting, so that the *sum* of lane gradients is the serial gradient:
``reduction="mean"``: a lane's loss is the mean over its chunk, weighted by the chunk's share
of the elements of the serial micro-batch it replaces; ``reduction="sum"``: weight 1. At
world 1 every weight is exactly 1 and no multiplication is inserted, so the autograd graph,
the gradients and the losses are bitwise the serial ones.

No Python worker threads; no host sync inside an iteration except the one readback.

Stream order (rules R0-R6 in ``dpq.streams``): lane 0 is the current stream; each lane's
optimizer state is built under the lane's stream (it is read and written there only); each
lane's loss is handed to the current stream at an event recorded right after it (R2 for that
point only, R3 for its memory), summed there, and copied to the host before backward and the
exchange are queued, so the readback waits for the losses only. The exchange's communicators
join the lanes they touch (R4). The caller's teardown joins everything (``ReplicaSet.close``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from dpq.exchange import GradBuckets
from dpq.mirror import ReplicaSet
from dpq.streams import HostCopy, Lane

__all__ = ["LaneLoss", "OptimizerFactory", "TuneEngine", "contiguous_slices"]


class LaneLoss(Protocol):
    """Forward one chunk on one lane and return its loss (a 0-d tensor on the lane's device),
    reduced the way the serial loss is (mean or sum over the chunk)."""

    def __call__(self, lane: Lane, module: torch.nn.Module, indices: list[int]) -> torch.Tensor: ...


# Builds a lane's optimizer and lr schedule from that lane's module, exactly as the serial
# tuner builds them from the home module (same param groups, same order).
OptimizerFactory = Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, object | None]]


class Exchange(Protocol):
    def exchange(self, buckets: GradBuckets) -> None: ...


def contiguous_slices(indices: Sequence[int], world: int) -> list[list[int]]:
    """Split ``indices`` into ``world`` contiguous slices whose sizes differ by at most one
    (the first ``len % world`` slices get the extra sample)."""
    n = len(indices)
    base, extra = divmod(n, world)
    out, start = [], 0
    for k in range(world):
        size = base + (1 if k < extra else 0)
        out.append(list(indices[start : start + size]))
        start += size
    return out


def _chunks(indices: list[int], size: int | None) -> list[list[int]]:
    if not indices:
        return []
    if size is None or size >= len(indices):
        return [indices]
    return [indices[i : i + size] for i in range(0, len(indices), size)]


@dataclass
class IterationStats:
    """What one iteration did: for benchmarks and the run report."""

    slices: list[list[int]] = field(default_factory=list)
    micro_steps: int = 0
    wire_bytes: int = 0


class TuneEngine:
    """Runs the per-iteration work of a data-parallel tune over a :class:`ReplicaSet`."""

    def __init__(
        self,
        replicas: ReplicaSet,
        lane_loss: LaneLoss,
        make_optimizer: OptimizerFactory,
        exchange: Exchange,
        *,
        reduction: Literal["mean", "sum"] = "mean",
        micro_batch: int | None = None,
        loss_scale: float = 1.0,
        sample_numel: Callable[[int], int] | None = None,
        debug_identical: bool = False,
    ) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"dpq: reduction must be 'mean' or 'sum', got {reduction!r}")
        if reduction == "mean" and micro_batch is not None:
            # A mean over a serial micro-batch cannot be re-split across lanes and micro-steps
            # without changing the gradient; serial auto-round accumulates with sum reduction.
            raise ValueError("dpq: gradient accumulation (micro_batch) needs reduction='sum', as in auto-round")
        self.replicas = replicas
        self.lane_loss = lane_loss
        self.exchange = exchange
        self.reduction = reduction
        self.micro_batch = micro_batch
        self.loss_scale = loss_scale
        self.sample_numel = sample_numel or (lambda i: 1)
        self.debug_identical = debug_identical
        self.optimizers, self.schedulers = [], []
        for lane, module in zip(replicas.lanes, replicas.modules, strict=True):
            # Built on the lane's stream (lr tensors, scheduler state): every later use is a
            # step queued there, so no crossing is created.
            with lane.issue():
                opt, sched = make_optimizer(module)
            self.optimizers.append(opt)
            self.schedulers.append(sched)
        self.buckets = GradBuckets([replicas.tuned_params(k) for k in range(replicas.world)], lanes=replicas.lanes)
        self.last = IterationStats()

    @property
    def lanes(self) -> list[Lane]:
        return self.replicas.lanes

    def _weight(self, chunk: list[int], serial_chunk_numel: int) -> float:
        if self.reduction == "sum":
            return 1.0
        return sum(self.sample_numel(i) for i in chunk) / serial_chunk_numel

    def backward(self, indices: Sequence[int]) -> list[float]:
        """Forward, backward and exchange for one iteration of the serial run's ``indices``.

        Returns the loss of each serial micro-batch (what serial would read with ``.item()``,
        summed over lanes), from a single host readback.
        """
        world = self.replicas.world
        slices = contiguous_slices(list(indices), world)
        per_lane = [_chunks(s, self.micro_batch) for s in slices]
        steps = max(len(c) for c in per_lane)
        self.buckets.attach()
        step_losses: list[torch.Tensor] = []
        readback = None
        for m in range(steps):
            # Mean reduction: a lane's chunk weighs its share of the elements of the serial
            # micro-batch (the whole iteration batch; see __init__).
            ref_numel = sum(self.sample_numel(i) for i in indices)
            roots, lane_losses = [], []
            for k, lane in enumerate(self.lanes):
                if m >= len(per_lane[k]):
                    continue
                chunk = per_lane[k][m]
                with lane.issue():
                    loss = self.lane_loss(lane, self.replicas.modules[k], chunk)
                    w = self._weight(chunk, ref_numel) if world > 1 else 1.0
                    if w != 1.0:
                        loss = loss * w
                    roots.append(loss * self.loss_scale)
                    done = lane.mark()  # the loss is final here; backward and the exchange come later
                lane_losses.append((lane, loss.detach(), done))
            step_losses.append(self._sum_on_home(lane_losses))
            if m == steps - 1:
                # R6: queued now, before backward and the exchange, so the readback waits for the
                # losses only. (Earlier micro-steps' backwards precede it on lane 0's stream.)
                readback = HostCopy(torch.stack(step_losses))
            torch.autograd.backward(roots)
        before = self._wire_bytes()
        if world > 1:  # one lane already holds the full gradient; nothing to exchange
            self.exchange.exchange(self.buckets)
        self.last = IterationStats(slices=slices, micro_steps=steps, wire_bytes=self._wire_bytes() - before)
        return readback.tolist()  # the one host sync of the iteration

    def _sum_on_home(self, lane_losses: list[tuple[Lane, torch.Tensor, object]]) -> torch.Tensor:
        """The micro-step's loss on the current stream: each lane's loss handed over at its
        event (R2 for that point, R3 for its memory; across devices, copied on the lane)."""
        home = self.lanes[0].device
        losses = [lane.hand_home(loss, home, mark=done) for lane, loss, done in lane_losses]
        if len(losses) == 1:
            return losses[0]
        return torch.stack(losses).sum()

    def _wire_bytes(self) -> int:
        comm = getattr(self.exchange, "comm", None)
        return int(getattr(comm, "wire_bytes", 0))

    def step(self) -> None:
        """Every lane applies the same update (optimizer step, zero grads, lr schedule)."""
        for lane, opt, sched in zip(self.lanes, self.optimizers, self.schedulers, strict=True):
            with lane.issue():
                opt.step()
                opt.zero_grad()
                if sched is not None:
                    sched.step()
        if self.debug_identical:
            self.replicas.check_identical()
