"""The iteration engine (one data-parallel SignRound iteration per call) and the loop around it.

:func:`run_loop` is serial SignRound's loop (sampler, loss normalisation, lr schedule step,
best-iteration snapshot, early stop) around the engine; the tuner's specifics (its sampler,
its best-parameter snapshot, its optimizer and loss) come in a :class:`TuneSpec` that the
adapter (``dpq/autoround/``) fills. This module knows nothing of auto-round.

One iteration: the engine's phases (``dpq.engine.phases``), which :func:`run_loop` calls in order::

    split      the serial run's global indices into W contiguous slices (sizes differ by <= 1),
               each cut into chunks of ``micro_batch`` (gradient accumulation inside the lane)
    for each micro-step m:
      forward  lane 0 .. W-1, issued by this one thread, each under its own stream
      (readback queue: before the last backward, each lane's losses copied to the host on its stream)
      backward ONE torch.autograd.backward over every lane's weighted loss: autograd's
               per-device threads run the lanes' backwards concurrently (the last one exchanging
               buckets as they fill, where the exchange overlaps)
    exchange   grads -> identical reduced grads on every lane (what the backward did not exchange)
    readback   one host sync for the iteration's micro-step losses (folded on the host in global
               lane order)
    step       (after the loop's best-iteration snapshot) every lane applies the same update; the
               mirrors stay bitwise identical

Loss weighting, so that the *sum* of lane gradients is the serial gradient:
``reduction="mean"``: a lane's loss is the mean over its chunk, weighted by the chunk's share
of the elements of the serial micro-batch it replaces; ``reduction="sum"``: weight 1. At
world 1 every weight is exactly 1 and no multiplication is inserted, so the autograd graph,
the gradients and the losses are bitwise the serial ones.

Several processes (DESIGN.md contract 7): W is the *global* world (the exchange's
communicator spans P processes x L lanes) and local lane k is global lane ``lane_offset + k``.
Every decision (slices, micro-steps, weights, which lanes reach the last backward) comes from
the global split, so every rank agrees; a micro-step's loss is every global lane's loss folded
in global lane order, the lanes of other processes fetched by one exact all-gather per
iteration, so the loss read back (best iteration, early stop) is the same bits on every rank
and for every layout of W. In one process there is nothing to fetch: the same fold, no gather.

No Python worker threads; no host sync inside an iteration except the one readback.

The watchdog (R8 of ``dpq.streams``): the readback polls its copies' events against ``timeout_s``
(``--parallel_timeout``), checking the communicator's asynchronous error state meanwhile. On
expiry or an error the communicator is aborted (NCCL's abort ends the work queued on the lanes)
and :class:`LanesHung` names the block, the communicator and the lanes whose work had not
finished; the session's failure policy then applies (contract 6), unless the abort could not end
that work (``LanesHung.stuck``): then nothing more is queued on those devices. The issuing thread
itself, stuck where no check of its own runs, is watched by another thread that holds each
iteration's deadline (:class:`dpq.engine.watchdog.IterationWatchdog`: it aborts the communicators, and
ends the process when the thread does not come back and the process is the command's); the
engine notes where the thread is (``doing``) for its text, and raises :class:`LanesHung` at the next
iteration (or the loop's end) when a deadline passed while the thread was away.

Stream order (rules R0-R7 in ``dpq.streams``): lane 0 is the current stream; each lane's
optimizer state is built under the lane's stream (it is read and written there only); each
lane's data reaches it through ``Lane.bring`` (R7, in the adapter's lane loss); each lane's
losses are copied to pinned host memory on the lane's own stream right after they are
computed, before backward and the exchange are queued, so the readback waits for the losses
only and no lane's stream waits for another's (R6); the host folds them. The exchange's
communicators join the lanes they touch (R4). The caller's teardown joins everything
(``ReplicaSet.close``).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from dpq import refusals
from dpq.comm.comm_base import Communicator
from dpq.engine.exchange import ExchangePlan, GradBuckets
from dpq.engine.phases import Watched, phase
from dpq.engine.sign_step import foreach_sign_step, step_choice
from dpq.engine.split import chunks, contiguous_ranges
from dpq.engine.watchdog import IterationWatchdog
from dpq.mirror import ReplicaSet
from dpq.streams import HostCopy, Lane, WaitExpired, wait_events

__all__ = ["Iteration", "LaneLoss", "LanesHung", "LoopOutcome", "OptimizerFactory", "TuneEngine", "TuneSpec",
           "iteration", "run_loop"]


class LaneLoss(Protocol):
    """Forward one chunk on one lane and return its loss (a 0-d tensor on the lane's device),
    reduced the way the serial loss is (mean or sum over the chunk)."""

    def __call__(self, lane: Lane, module: torch.nn.Module, indices: list[int]) -> torch.Tensor: ...


# Builds a lane's optimizer and lr schedule from that lane's module, exactly as the serial
# tuner builds them from the home module (same param groups, same order).
OptimizerFactory = Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, object | None]]


class LanesHung(RuntimeError):
    """The readback's deadline passed, or the communicator reported an asynchronous error (module
    docstring: the watchdog). ``stuck``: aborting did not end the lanes' queued work, so nothing may
    wait on those devices again (no restore, no rerun); ``peer_lost``: across processes, the
    missing work is most likely another rank's."""

    def __init__(self, message: str, *, stuck: bool, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.stuck, self.peer_lost = stuck, peer_lost


class DuringBackward(Protocol):
    """The last backward's exchange (``dpq.engine.exchange.BackwardExchange``): entered around the backward;
    its own roots and seeds go into the same backward call (the issuer's node on accelerators)."""

    roots: list[torch.Tensor]
    seeds: list[torch.Tensor]

    def __enter__(self) -> DuringBackward: ...

    def __exit__(self, *exc) -> None: ...


class Exchange(Protocol):
    """Everything the engine asks of an exchange policy (``dpq.engine.exchange``)."""

    comm: Communicator  # over this process's lanes; its world spans every process (dpq.comm.process_group)
    exact_signs: bool  # after exchange(): the grads hold exact signs (dpq.engine.sign_step)
    plan: ExchangePlan  # what it runs: the gradient buckets' layout (plan.buckets), overlap (plan.overlap)
    overlap: bool  # buckets are exchanged as the last backward fills them (during_backward), else after it

    def exchange(self, buckets: GradBuckets) -> None: ...

    def during_backward(self, buckets: GradBuckets, lanes: Sequence[int] | None = None) -> DuringBackward: ...

    def keep_signs_apart(self) -> bool: ...

    def signs_apart(self, buckets: GradBuckets) -> list[dict[int, torch.Tensor]] | None: ...


@dataclass
class Iteration:
    """One iteration's work as :meth:`TuneEngine.split` decided it (from the global split, so the same on
    every rank), and what each phase leaves for the next."""

    indices: list[int]
    slices: list[list[int]]  # per global lane
    per_lane: list[list[list[int]]]  # per global lane, its micro-steps' chunks
    steps: int  # micro-steps: the longest lane's
    ref_numel: int  # elements of the serial micro-batch (mean reduction's weights)
    step_losses: list[dict[int, torch.Tensor]] = field(default_factory=list)  # per micro-step: global lane -> loss
    roots: list[torch.Tensor] = field(default_factory=list)  # the micro-step's weighted losses ...
    seeds: list[torch.Tensor] = field(default_factory=list)  # ... and their gradients, for its backward
    during: DuringBackward | None = None  # the exchange the last backward runs, where it overlaps
    readback: list[HostCopy] = field(default_factory=list)
    wire_before: int = 0  # the communicator's wire bytes before the last backward


@dataclass
class IterationStats:
    """What one iteration did: for benchmarks and the run report."""

    slices: list[list[int]] = field(default_factory=list)
    micro_steps: int = 0
    wire_bytes: int = 0


class TuneEngine(Watched):
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
        one_op_sign_step: bool = False,
        timeout_s: float | None = None,
        name: str = "the block",
        on_stuck: Callable[[str], None] | None = None,
        in_collective: Callable[[], bool] | None = None,
    ) -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"dpq: reduction must be 'mean' or 'sum', got {reduction!r}")
        if reduction == "mean" and micro_batch is not None:
            # A mean over a serial micro-batch cannot be re-split across lanes and micro-steps
            # without changing the gradient; serial auto-round accumulates with sum reduction.
            raise ValueError("dpq: gradient accumulation (micro_batch) needs reduction='sum', as in auto-round")
        self.replicas = replicas
        self.lane_loss = lane_loss
        self.policy = exchange  # the exchange policy (dpq.engine.exchange)
        self.reduction = reduction
        self.micro_batch = micro_batch
        self.loss_scale = loss_scale
        self.sample_numel = sample_numel or (lambda i: 1)
        self.debug_identical = debug_identical
        self.timeout_s = timeout_s  # the readback's deadline (module docstring: the watchdog); None: none
        self.name = name  # what is tuned, for the watchdog's error
        self.optimizers, self.schedulers = _optimizers(replicas, make_optimizer)
        self.last = IterationStats()
        # The world is the global lanes: the exchange's communicator spans every process
        # (dpq.comm.process_group), so its world is P x L and this process's L lanes (``replicas.local_lanes``)
        # start at global lane `lane_offset`.
        self.world = exchange.comm.world
        self.lane_offset = exchange.comm.lane_offset
        if not 0 <= self.lane_offset <= self.world - replicas.local_lanes:
            last = self.lane_offset + replicas.local_lanes - 1
            raise ValueError(f"dpq: local lanes {self.lane_offset}..{last} are not lanes of world {self.world}")
        # World 1 exchanges nothing, so it keeps serial's gradients: dropped before each backward
        # and taken from it by autograd as they are (no flat buffer to zero and add into, no second
        # copy of the tuned values' gradients in memory: the world-1 overhead).
        self.buckets = GradBuckets([replicas.tuned_params(k) for k in range(replicas.local_lanes)],
                                   bucket_cap_elems=exchange.plan.buckets,
                                   lanes=replicas.lanes) if self.world > 1 else None
        self._loss_dtype = torch.float32  # a rank without a chunk in any micro-step yet (gathered losses)
        # The step: the optimizers' own (one per lane), or, when the caller vouches that they are
        # pure SignSGD (one_op_sign_step), dpq.engine.sign_step's one foreach op per device and lr. That
        # adds the grads as exact signs: the sign exchange leaves them so; otherwise (world 1: no
        # exchange runs) they are signed first, in place (torch._foreach_sign_, serial's sign op).
        self.one_op_sign_step, self.step_note = step_choice(one_op_sign_step, self.optimizers,
                                                            self.buckets.params if self.buckets else None)
        self._sign_first = self.world == 1 or not exchange.exact_signs
        # the one-op step adds the exchange's int8 signs where it keeps them apart (no fp32 copy of them)
        if self.one_op_sign_step and self.world > 1:
            exchange.keep_signs_apart()
        # The issuing thread's host time in backward() and step(), less the backward calls and the
        # readback (waits): on accelerator lanes, the issue cost dpq.planning.cost_model prices.
        self.issue_s = 0.0
        # Where the issuing thread is (what it does, the global lane or None) and in which iteration: the
        # iteration watchdog's text. It holds each iteration's deadline from another thread (timeout_s
        # set): ``on_stuck`` ends a run whose issuing thread does not come back (None: not this run's to
        # end), ``in_collective`` says it waits for other ranks (dpq.engine.watchdog).
        self.doing: tuple[str, int | None] = ("loop", None)
        self.iteration = -1
        self.watch = IterationWatchdog(timeout_s, self._expired, on_stuck, in_collective=in_collective or (
            lambda: False), name=f"dpq-watchdog {name}") if timeout_s is not None else None

    @property
    def lanes(self) -> list[Lane]:
        return self.replicas.lanes

    def begin_iteration(self, i: int) -> None:
        """Iteration ``i`` starts: its deadline armed (dpq.engine.watchdog). Raises :class:`LanesHung` when
        the previous one's passed (the thread came back late; the communicators are aborted)."""
        self.iteration, self.doing = i, ("loop", None)
        if self.watch is not None:
            self._raise_if_expired()
            self.watch.arm()

    @contextlib.contextmanager
    def deadlines(self) -> Iterator[None]:
        """Around the loop: a deadline that passed in its last iteration raises at its end; the
        deadline is dropped however the loop ends."""
        try:
            yield
            if self.watch is not None:
                self._raise_if_expired()
        finally:
            if self.watch is not None:
                self.watch.disarm()

    def _raise_if_expired(self) -> None:
        if self.watch.expired is not None:
            raise LanesHung(self.watch.expired, stuck=False, peer_lost=self.world > len(self.lanes))

    def _expired(self, waited_s: float) -> str:
        """The iteration watchdog's expiry, in its thread: the communicator aborted, and what hung where."""
        comm = self.policy.comm
        name = comm.name
        reason = f"the watchdog (the issuing thread passed --parallel_timeout {self.timeout_s:g} s)"
        ended = bool(comm.abort(reason))
        what, lane = self.doing
        doing = f"lane {lane}'s {what}" if lane is not None else _DOING.get(what, what)
        return "dpq: " + refusals.issuing_thread_hung(self.name, self.world, doing, self.iteration + 1, waited_s,
                                                      self.timeout_s, name, ended)

    def _weight(self, chunk: list[int], serial_chunk_numel: int) -> float:
        if self.reduction == "sum":
            return 1.0
        return sum(self.sample_numel(i) for i in chunk) / serial_chunk_numel

    # -- the phases (dpq.engine.phases), in the order run_loop calls them -------------------------

    def split(self, indices: Sequence[int]) -> Iteration:
        """The serial run's ``indices`` split over the *global* lanes (``self.world``) and cut into
        micro-steps, so every rank agrees on the work (local lane k is global lane ``lane_offset + k``);
        the gradient buffers made ready for the iteration's first backward."""
        with phase("split", self), self._issuing():
            indices = list(indices)
            slices = [indices[a:b] for a, b in contiguous_ranges(len(indices), self.world)]
            per_lane = [chunks(s, self.micro_batch) for s in slices]  # global lanes
            # Mean reduction: a lane's chunk weighs its share of the elements of the serial
            # micro-batch (the whole iteration batch; see __init__).
            ref_numel = sum(self.sample_numel(i) for i in indices) if self.world > 1 else 0
            self._fresh_grads()
            return Iteration(indices, slices, per_lane, max(len(c) for c in per_lane), ref_numel)

    def forward(self, it: Iteration, m: int) -> None:
        """Micro-step ``m``'s forwards, each local lane's under its own stream, each loss weighted so
        that the lanes' gradients sum to the serial one (module docstring). Before the last micro-step's
        forwards, the exchange that runs during its backward, where it overlaps (on accelerator lanes
        its issuer node must come first: dpq.engine.exchange)."""
        with phase("forward", self), self._issuing():
            world, offset = self.world, self.lane_offset
            it.roots, it.seeds, losses = [], [], {}
            reached = [g for g in range(world) if m < len(it.per_lane[g])]
            if m == it.steps - 1 and self._overlaps(reached):
                local = [g - offset for g in reached if 0 <= g - offset < len(self.lanes)]
                it.during = self.policy.during_backward(self.buckets, local)
            for k, lane in enumerate(self.lanes):
                if m >= len(it.per_lane[offset + k]):
                    continue
                chunk = it.per_lane[offset + k][m]
                with lane.issue(), phase("forward", self, lane=offset + k):
                    loss = self.lane_loss(lane, self.replicas.modules[k], chunk)
                    w = self._weight(chunk, it.ref_numel) if world > 1 else 1.0
                    if w != 1.0:
                        loss = loss * w
                    it.roots.append(loss * self.loss_scale)
                    # the root's gradient made on the lane's stream: autograd would make it on the
                    # device's current stream at backward(), reading a lane tensor there (R2)
                    it.seeds.append(torch.ones_like(it.roots[-1]))
                losses[offset + k] = loss.detach()
            it.step_losses.append(losses)

    def queue_readback(self, it: Iteration) -> None:
        """R6: every lane's micro-step losses copied to the host on the lane's own stream, queued
        before the last backward and the exchange, so the readback waits for the losses only (earlier
        micro-steps' backwards precede it on each lane's stream). No crossing between lanes: a copy
        into lane 0's device would join lane 0 and the lane. Across processes, one copy of the
        gathered table instead (its last column: each global lane's checksum of the indices)."""
        with phase("readback queue", self), self._issuing():
            if self.world > len(self.lanes):
                it.readback = [self._gather_losses(it.step_losses, it.indices)]
                return
            it.readback = []
            for k, lane in enumerate(self.lanes):
                g = self.lane_offset + k
                mine = [s[g] for s in it.step_losses if g in s]
                with lane.issue():
                    it.readback.append(HostCopy(torch.stack(mine)))

    def backward(self, it: Iteration) -> None:
        """One backward over every local lane's loss of the micro-step just forwarded (autograd's
        device threads run the lanes' backwards concurrently on accelerators). The last micro-step's
        exchanges buckets as they fill, where it overlaps (exchange.py: overlap); lanes with fewer
        micro-steps have final gradients already."""
        with phase("backward", self), self._issuing():
            roots, seeds = it.roots, it.seeds
            if len(it.step_losses) == it.steps:
                it.wire_before = self._wire_bytes()
            if it.during is not None:
                with it.during:  # its extra roots: the issuer's node on accelerator lanes (dpq.engine.exchange)
                    self._autograd_backward(roots + list(it.during.roots), seeds + list(it.during.seeds))
            else:
                self._autograd_backward(roots, seeds)

    def exchange(self, it: Iteration) -> None:
        """The reduced gradient on every lane, where the last backward did not already exchange it
        (world 1: one lane already holds the full gradient)."""
        with phase("exchange", self), self._issuing():
            if it.during is None and self.world > 1:
                self.policy.exchange(self.buckets)
            self.last = IterationStats(slices=it.slices, micro_steps=it.steps,
                                       wire_bytes=self._wire_bytes() - it.wire_before)

    def readback(self, it: Iteration) -> list[float]:
        """The loss of each serial micro-batch (what serial would read with ``.item()``, the sum over
        every global lane), from the iteration's one host sync; the same bits on every rank."""
        with phase("readback", self):
            return self._read_losses(it.readback, it.per_lane)

    @contextlib.contextmanager
    def _issuing(self) -> Iterator[None]:
        """The issuing thread's host time in the phase, added to ``issue_s`` (less the backward calls)."""
        t_start = time.perf_counter()
        try:
            yield
        finally:
            self.issue_s += time.perf_counter() - t_start

    def _overlaps(self, reached: list[int]) -> bool:
        """The last backward exchanges buckets as they fill. Across processes only when every rank's
        lanes all run this backward (the same graphs on every rank: the buckets complete alike); else
        the exchange follows it, in buffer order."""
        return self.world > 1 and (self.world == len(self.lanes) or len(reached) == self.world)

    def _read_losses(self, readback: list[HostCopy], per_lane: list[list[list[int]]]) -> list[float]:
        """Each micro-step's loss: the sum of the global lanes' losses in global lane order, folded
        on the host the same way for every layout (so the same bits on every rank and for 1 x W,
        P x L and W x 1). The waits follow each other with nothing issued between them: one sync."""
        self._wait(readback)
        steps = max(len(c) for c in per_lane)
        # As Python values first (exact), then host tensors of the losses' dtype: nothing below
        # reads memory that a device stream wrote.
        if self.world > len(self.lanes):
            table = readback[0].host.tolist()  # [global lane][micro-step | checksum], float64
            self._check_drawn([row[steps] for row in table])
            rows = {g: row[:steps] for g, row in enumerate(table)}
            dtype = self._loss_dtype
        else:
            rows = {self.lane_offset + k: c.host.tolist() for k, c in enumerate(readback)}
            dtype = readback[0].host.dtype
        by_lane = {g: torch.tensor(row, dtype=dtype) for g, row in rows.items()}
        out = []
        for m in range(steps):
            terms = [by_lane[g][m] for g in range(self.world) if m < len(per_lane[g])]
            total = terms[0]
            for t in terms[1:]:
                total = total + t  # in the losses' dtype, in global lane order
            out.append(total)
        return torch.stack(out).tolist()  # host memory: no further wait

    def _wait(self, readback: list[HostCopy]) -> None:
        """The watchdog (module docstring): the readback's copies, polled against ``timeout_s`` (the
        iteration watchdog suspended meanwhile: this wait checks its own deadline)."""
        comm = self.policy.comm
        events = [copy.event for copy in readback]
        try:
            with self.watch.waiting() if self.watch is not None else contextlib.nullcontext():
                wait_events(events, self.timeout_s, comm.check_async_error)
        except Exception as err:
            pending = err.pending if isinstance(err, WaitExpired) else [k for k, e in enumerate(events)
                                                                       if e is not None and not e.query()]
            raise self._hung(comm, pending, err) from err

    def _hung(self, comm, pending: list[int], err: Exception) -> LanesHung:
        """Abort the communicator and say what hung (module docstring: the watchdog)."""
        gathered = self.world > len(self.lanes)  # one copy: lane 0's table of every process's losses
        if gathered:
            lanes = "0 (its gathered losses of every process)" if pending else "none (an error was reported)"
        else:
            lanes = ", ".join(str(self.lane_offset + k) for k in pending) or "none (an error was reported)"
        waited = err.waited_s if isinstance(err, WaitExpired) else 0.0
        cause = f"--parallel_timeout {self.timeout_s:g} s passed" if isinstance(err, WaitExpired) else \
            f"{type(err).__name__}: {err}"
        name = comm.name
        ended = comm.abort(f"the watchdog ({cause})")
        text = refusals.lanes_hung(self.name, self.world, name, lanes, waited, cause.splitlines()[0][:300], ended)
        return LanesHung(f"dpq: {text}", stuck=bool(pending) and not ended, peer_lost=gathered)

    def _check_drawn(self, checksums: list[float]) -> None:
        """Across processes: every global lane's checksum of the iteration's indices agrees."""
        others = sorted({g // len(self.lanes) for g, c in enumerate(checksums) if c != checksums[0]})
        if others:
            raise RuntimeError(f"dpq: {refusals.ranks_drew_other_indices(others)}")

    def _gather_losses(self, step_losses: list[dict[int, torch.Tensor]], indices: list[int]) -> HostCopy:
        """Every global lane's micro-step losses as exact copies, in one host copy of a table on
        lane 0: each local lane sends its micro-steps' losses from its own stream as float64 bytes
        (exact for every float dtype up to 64 bits; zero where it has no chunk) and a checksum of
        the iteration's indices (every rank must draw the serial run's indices: same sampler, same
        seed; a rank that drew others stops the run). The checksum is written by a fill on the
        lane's stream (no host-to-device copy). The communicator orders the lanes' streams around
        the collective (R4)."""
        dtype = next((loss.dtype for s in step_losses for loss in s.values()), None) or self._loss_dtype
        self._loss_dtype = dtype
        drawn = float(zlib.crc32(repr(indices).encode()))  # < 2**32: exact in float64
        send, recv = [], []
        for k, lane in enumerate(self.lanes):
            g = self.lane_offset + k
            with lane.issue():
                zero = torch.zeros((), dtype=torch.float64, device=lane.device)
                mine = [s[g].reshape(()).to(torch.float64) if g in s else zero for s in step_losses]
                check = torch.full((1,), drawn, dtype=torch.float64, device=lane.device)
                send.append(torch.cat([torch.stack(mine), check]).view(torch.uint8))
                recv.append(torch.empty(self.world * send[-1].numel(), dtype=torch.uint8, device=lane.device))
        comm = self.policy.comm
        with phase("loss gather", self):
            comm.begin_bucket()  # communication streams (dpq.comm.comm_streams): C1 ...
            comm.all_gather(send, recv)
            comm.join()  # ... and C2: the lanes' streams wait for the gather
        steps = len(step_losses)  # the same on every rank: counted from the global split
        return HostCopy(recv[0].view(torch.float64).view(self.world, steps + 1))

    def _wire_bytes(self) -> int:
        return int(self.policy.comm.wire_bytes)

    def _fresh_grads(self) -> None:
        """Before an iteration's first backward: the grads dropped, each parameter's first gradient
        then copied into its slot of the flat buffers (:meth:`GradBuckets.attach_by_copy`), or at world 1
        dropped as serial's ``zero_grad()`` does."""
        if self.buckets is None:
            self.release_grads()
        else:  # hooks only where buckets are exchanged as the backward fills them (Note [one copy per lane])
            self.buckets.attach_by_copy(hooks=self.policy.overlap)

    def close(self) -> None:
        """Let go of what the run allocated beside the replicas, in place (a failed run's frames may
        still reference this engine): the optimizers and lr schedules (they hold every lane's tuned
        values), the flat gradient buffers, their views and the exchange's scratch; the grads go back
        to None. The session calls it before ``ReplicaSet.close`` empties the allocator's cache."""
        self.release_grads()
        if self.buckets is not None:
            self.buckets.release()
            self.buckets = None
        self.optimizers.clear()
        self.schedulers.clear()
        if self.watch is not None:
            self.watch.close()

    def release_grads(self) -> None:
        """Every tuned ``.grad`` back to None (the run is over; or world 1's next backward)."""
        for p in (p for k in range(self.replicas.local_lanes) for p in self.replicas.tuned_params(k)):
            p.grad = None

    def step(self) -> None:
        """Every lane applies the same update (optimizer step, lr schedule); the grads are zeroed
        (or dropped) before the next backward, not here."""
        with phase("step", self):
            with self._issuing():
                if self.one_op_sign_step:
                    signs = self.policy.signs_apart(self.buckets) if self.buckets is not None else None
                    foreach_sign_step(self.optimizers, self.lanes, sign_first=self._sign_first, signs=signs)
                for lane, opt, sched in zip(self.lanes, self.optimizers, self.schedulers, strict=True):
                    with lane.issue():
                        if not self.one_op_sign_step:
                            opt.step()
                        if sched is not None:
                            sched.step()
            if self.debug_identical:
                with phase("identical check", self.replicas):
                    self.replicas.check_identical()

    def _autograd_backward(self, roots: list[torch.Tensor], seeds: list[torch.Tensor]) -> None:
        if roots:  # across processes, a rank's lanes may all have fewer micro-steps than the longest lane
            t_start = time.perf_counter()
            torch.autograd.backward(roots, seeds)  # on accelerators autograd's device threads run it
            self.issue_s -= time.perf_counter() - t_start


def _optimizers(replicas: ReplicaSet, make_optimizer: OptimizerFactory) -> tuple[list, list]:
    """Every lane's optimizer and lr schedule, each built on the lane's stream (lr tensors, scheduler
    state): every later use is a step queued there, so no crossing is created."""
    optimizers, schedulers = [], []
    for lane, module in zip(replicas.lanes, replicas.modules, strict=True):
        with lane.issue():
            opt, sched = make_optimizer(module)
        optimizers.append(opt)
        schedulers.append(sched)
    return optimizers, schedulers


# what the issuing thread does, in the watchdog's words (a lane's forward is "lane N's forward")
_DOING = {"loop": "the loop's own work (the sampler, the best-value snapshot)", "backward": "the backward",
          "split": "the batch's split", "forward": "the forwards", "readback": "the loss readback",
          "readback queue": "the losses' copies to the host",
          "exchange": "the gradient exchange", "loss gather": "the gather of the lanes' losses",
          "step": "the optimizer step"}


# -- the loop ---------------------------------------------------------------------------------


class Sampler(Protocol):
    def next_batch(self) -> Sequence[int]: ...


@dataclass
class TuneSpec:
    """One block's tune as the adapter describes it, once the block is ready (wrapped).

    ``tuned``: names (in ``named_parameters(remove_duplicate=False)``) of the tuned parameters,
    in the optimizer's order; ``make_optimizer`` / ``lane_loss``: see :class:`TuneEngine`;
    ``sampler(nsamples, global_batch)``: the serial run's index sampler (same draws);
    ``best_params(home)``: the snapshot of home's tuned values the tuner keeps for its best
    iteration; ``on_iteration(i, modules)``: per-iteration state the tuner sets on every lane
    (e.g. the iteration number); ``sample_numel(i)``: elements of sample ``i`` (loss weights and
    the sum-reduction normaliser); ``token_counts``: valid tokens per sample when the loss is
    masked (the normaliser then counts those); ``one_op_sign_step``: the optimizer is pure SignSGD
    as :mod:`dpq.engine.sign_step` reproduces it (the adapter checks the class and its source)."""

    tuned: list[str]
    make_optimizer: OptimizerFactory
    lane_loss: LaneLoss
    sampler: Callable[[int, int], Sampler]
    best_params: Callable[[torch.nn.Module], dict]
    nsamples: int
    sample_numel: Callable[[int], int]
    iters: int
    batch_size: int
    gradient_accumulate_steps: int = 1
    not_use_best_mse: bool = False
    dynamic_max_gap: int = -1
    loss_scale: float = 1.0
    token_counts: list[int] | None = None
    on_iteration: Callable[[int, Sequence[torch.nn.Module]], None] | None = None
    progress: Callable[[int, float], None] | None = None
    one_op_sign_step: bool = False

    @property
    def reduction(self) -> Literal["mean", "sum"]:
        """Serial accumulates gradients with sum reduction, else takes the mean."""
        return "sum" if self.gradient_accumulate_steps != 1 else "mean"

    @property
    def micro_batch(self) -> int | None:
        return self.batch_size if self.gradient_accumulate_steps != 1 else None


@dataclass
class LoopOutcome:
    best_params: dict
    losses: list[float]
    best_iter: int
    best_loss: float
    init_loss: float | None
    iters_run: int
    wire_bytes: int
    indices: list[list[int]]
    seconds: float = 0.0
    issue_s: float = 0.0  # the issuing thread's host time per lane-iteration (TuneEngine.issue_s)


def iteration(engine: TuneEngine, indices: Sequence[int]) -> list[float]:
    """One iteration's phases but the step, in order (:func:`run_loop` calls it, and tests and benchmarks
    drive the engine with it): each serial micro-batch's loss, read back in the iteration's one host sync."""
    it = engine.split(indices)
    for m in range(it.steps):
        engine.forward(it, m)
        if m == it.steps - 1:
            engine.queue_readback(it)  # R6: before the last backward and the exchange
        engine.backward(it)
    engine.exchange(it)
    return engine.readback(it)


class _Progress:
    """Serial SignRound's bookkeeping across iterations: the losses, the best iteration and its snapshot
    of the tuned values, early stop."""

    def __init__(self, spec: TuneSpec, home: torch.nn.Module) -> None:
        self.spec, self.home = spec, home
        self.best_loss = torch.finfo(torch.float).max
        self.best_params: dict = {}
        self.last_best_iter, self.init_loss, self.total_loss = 0, None, 0
        self.losses: list[float] = []

    def record(self, i: int, total_loss: float) -> bool:
        """Iteration ``i``'s loss; True when the run stops here (early stop), before its step."""
        spec = self.spec
        self.total_loss = total_loss
        self.losses.append(total_loss)
        if i == 0:
            self.init_loss = total_loss
        if spec.progress is not None:
            spec.progress(i, total_loss)
        if total_loss < self.best_loss:
            self.best_loss = total_loss
            # The snapshot reads home (lane 0) on the current stream, which is lane 0's stream
            # (R0): lane 0's step below is queued after it, so it cannot overwrite what is read.
            if not spec.not_use_best_mse:
                self.best_params = spec.best_params(self.home)
                self.last_best_iter = i
        if spec.not_use_best_mse and i == spec.iters - 1:
            self.best_params = spec.best_params(self.home)
        return not spec.not_use_best_mse and 0 < spec.dynamic_max_gap <= i - self.last_best_iter


def run_loop(engine: TuneEngine, spec: TuneSpec) -> LoopOutcome:
    """Serial SignRound's loop around the engine's phases (dpq.engine.phases): the same draws, the same loss
    normalisation (masked and unmasked), best iteration and early stop."""
    t0 = time.perf_counter()
    global_batch_size = min(spec.nsamples, spec.batch_size * spec.gradient_accumulate_steps)
    num_elm = 1
    if spec.gradient_accumulate_steps != 1 and not spec.token_counts:
        num_elm = sum(spec.sample_numel(i) for i in range(global_batch_size))
    index_sampler = spec.sampler(spec.nsamples, global_batch_size)
    progress = _Progress(spec, engine.replicas.home)
    drawn, wire = [], 0
    # each iteration's deadline, held by the iteration watchdog (dpq.engine.watchdog)
    with phase("loop", engine, doing=False), engine.deadlines():
        for i in range(spec.iters):
            engine.begin_iteration(i)
            if spec.on_iteration is not None:
                spec.on_iteration(i, engine.replicas.modules)
            global_indices = index_sampler.next_batch()
            drawn.append(list(global_indices))
            if spec.token_counts:
                num_elm = sum(spec.token_counts[j] for j in global_indices)
            num_elm = 1 if num_elm <= 0 else num_elm
            total_loss = 0
            for step_loss in iteration(engine, global_indices):  # split .. readback: the one host sync
                total_loss += step_loss / num_elm
            wire += engine.last.wire_bytes
            if progress.record(i, total_loss):
                break
            engine.step()
    engine.release_grads()  # the grads (world > 1: views of the buffers) go with the run
    return _outcome(engine, spec, progress, drawn, wire, time.perf_counter() - t0)


def _outcome(engine: TuneEngine, spec: TuneSpec, progress: _Progress, drawn: list[list[int]], wire: int,
             seconds: float) -> LoopOutcome:
    best_iter = spec.iters if spec.not_use_best_mse else progress.last_best_iter
    reported = progress.total_loss if spec.not_use_best_mse else progress.best_loss
    return LoopOutcome(best_params=progress.best_params, losses=progress.losses, best_iter=best_iter,
                       best_loss=float(reported), init_loss=progress.init_loss, iters_run=len(progress.losses),
                       wire_bytes=wire, indices=drawn, seconds=seconds,
                       issue_s=engine.issue_s / max(1, len(progress.losses) * len(engine.lanes)))
