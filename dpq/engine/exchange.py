"""Flat gradient buckets and the two exchange policies.

:class:`GradBuckets` gives every lane one flat fp32 buffer and makes each tuned
parameter's ``.grad`` a view of its slot, so backward accumulates straight into memory a
communicator can take whole, with no gather/scatter copies (PyTorch DDP's
``gradient_as_bucket_view``). An exchange policy then turns every lane's buffer into the
identical reduced gradient:

* :class:`FullSumExchange` - all-reduce: every lane's grads become the sum over lanes
  (momentum, Adam, weight decay: anything that needs values).
* :class:`SignExchange` - pure SignSGD needs only ``sign(sum)``: reduce-scatter of the gradients
  cast to bf16 (Note [the summed gradient in bf16 on the wire]; fp32 on request), each lane signs
  its own chunk, an all-gather of 2 bits per element.

Both are the same three steps per bucket, reduce, update-owned and gather (Note [the exchange in
three steps]).

Stream order (rules in ``dpq.streams``): a lane's buffer and every scratch buffer of a lane
(``dpq.engine.sign_bits.SignBuffers``, kept across iterations) are allocated, zeroed, filled and read
under that lane's ``issue()``, so they belong to its stream; the only cross-lane uses are
inside a communicator's collective, which joins the lanes it touches before and after (R4).
Lanes without streams (CPU) share one set of scratch buffers: nothing to order there.

Overlap (:meth:`_Exchange.during_backward`): instead of exchanging every bucket after the
backward, a post-accumulate-grad hook on every tuned parameter of every lane counts, per
bucket, the gradients that are final; once bucket i is complete (its last parameter on the
last lane to get there) its collective is issued for all lanes while autograd goes on with the
rest of the backward. Buckets not complete by then (parameters that got no gradient) are
exchanged when the backward returns, in buffer order. Each bucket is exchanged exactly as
:meth:`_Exchange.exchange` would (the same collectives on the same bytes; buckets are
independent), so the result is bitwise the non-overlapped one, whatever order the buckets
complete in (tested: both policies, W = 2..4, several bucket caps).

Which thread issues what (contract 4: one thread issues; every collective comes from the thread
that called ``backward``):

* Every lane on the CPU (the plan's exchange overlaps there: ``dpq.planning.plan.exchange_plan``).
  Autograd runs CPU backward on the thread that
  called ``backward``, so the hooks run on the issuing thread, and the hook that completes a
  bucket issues it (checked at each hook: a hook on another thread raises; tests and
  ``benchmarks/overlap.py`` exercise it). On CPU the lanes' backwards run one after another
  on that thread (autograd orders ready nodes by sequence number, so the last lane's graph runs
  first and lane 0's last); a bucket completes during lane 0's backward, so only that part of
  the backward can hide the exchange.
* Accelerator lanes (the plan decides: ``--parallel_overlap auto`` turns overlap on where some
  lane GPU pair has no peer access, ``dpq.planning.plan.overlap_choice``; ``on`` everywhere). Autograd runs each
  device's backward on its own worker thread, so the hooks run there, several at once; they
  never issue a collective and queue nothing on any stream but one event. Under one lock a
  hook counts its bucket down; the hook that finishes a lane's part of bucket i records an
  event on the stream the gradient was just accumulated on (autograd's stream for the node:
  the lane's forward stream, one per lane, so it covers the lane's earlier parameters of the
  bucket too; R1: the "mark") and the one that completes the bucket puts i on a queue. The
  collectives are issued by :class:`_Issuer`, an autograd node on the CPU that is one more root
  of the same ``backward`` call: autograd runs CPU nodes on the calling thread, beside the
  device threads, so the issuing thread itself takes the queue's buckets and issues each one,
  its communication streams waiting for that bucket's marks only (``begin_bucket(marks)``, C1
  of :mod:`dpq.comm.comm_streams`: with the exchange on the lanes' own streams a lane's later
  backward kernels would wait for the collective, so the session builds the communicator over
  a second stream per lane). It
  stops when every bucket is issued, or when none completed for :data:`ISSUER_PATIENCE_S` (a
  bucket with a parameter that got no gradient, or a failed backward: autograd then reports
  the error), and the rest go when ``backward`` returns. In one process buckets are issued as
  they complete (every group covers every lane, so order does not matter); across processes in
  buffer order, a prefix of it, so that every rank issues the same sequence. On single-threaded
  autograd (CPU, the timeline model's logical GPUs) the issuer node, made before the lanes'
  forwards, has the lowest sequence number and runs after every lane's backward. CuPy's NCCL
  groups hold the caching allocator's free mutex while they launch (``dpq.nccl_comm``), as
  torch's own do, since the device threads may free memory meanwhile. None of the accelerator
  path has run on hardware.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from dpq.comm.comm_base import Communicator
from dpq.engine import phases
from dpq.engine.sign_bits import (
    PackViews,
    SignBuffers,
    UnpackViews,
    pack_into,
    pack_views,
    sign_groups,
    sign_padded_length,
    take,
    unpack_into,
    unpack_views,
)
from dpq.streams import Lane

__all__ = ["OVERLAP_BUCKETS", "OVERLAP_BUCKET_CAP", "POLICIES", "BackwardExchange", "BucketCap", "Buckets",
           "ExchangePlan", "FullSumExchange", "GradBuckets", "SignExchange", "bucket_cap", "bucket_layout",
           "exchange_for"]

# A bucket's fewest elements when buckets are exchanged as the backward fills them (small enough that
# the first is ready early; DDP's default 25 MB is 6.5M fp32 elements).
OVERLAP_BUCKET_CAP = 2**22
OVERLAP_BUCKETS = 8  # an overlapped exchange's buckets per block (Buckets.SHARE)


class Buckets(Enum):
    """How large the gradient buckets grow, as the plan decides it (:func:`bucket_cap` turns it into
    elements for a block's tensors); a fixed cap is an ``int`` of elements (:data:`BucketCap`)."""

    SHARE = "share"  # the block in about OVERLAP_BUCKETS buckets, none under OVERLAP_BUCKET_CAP (overlapped)
    LARGEST = "largest"  # as large as the largest tensor (Note [buckets as large as the largest tensor])
    BLOCK = "block"  # one bucket for the whole block (Note [one bucket where it fits] in dpq.planning.plan)


BucketCap = Buckets | int  # a bucket policy, or a fixed cap in elements (tests, benchmarks, observers)


def _check_cap(cap: BucketCap) -> BucketCap:
    if isinstance(cap, Buckets):
        return cap
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise TypeError(f"dpq: a bucket cap is a dpq.engine.exchange.Buckets or a number of elements, got {cap!r}")
    if cap < 1:
        raise ValueError(f"dpq: a bucket cap must be positive, got {cap}")
    return cap


# Each policy's wire dtype (the sums on the wire): the sign exchange's in bf16 (Note [the summed gradient
# in bf16 on the wire]) or fp32, the full sums' in fp32.
POLICIES: dict[str, tuple[torch.dtype, ...]] = {"sign": (torch.bfloat16, torch.float32), "full": (torch.float32,)}


@dataclass(frozen=True)
class ExchangePlan:
    """What the exchange runs, decided once (``dpq.planning.plan``: ``Plan.exchange``) and used as given by the
    session, the exchange and the buckets: the ``policy`` ("sign": sign of the summed gradient; "full":
    the sums), the dtype of the sums on the wire (``wire_dtype``; default the policy's first in
    :data:`POLICIES`), whether buckets are exchanged during the backward (``overlap``), whether on a
    second stream per lane where the lanes have streams (``second_stream``: the GPU lanes' overlap,
    ``dpq.comm.comm_streams``; host lanes overlap on the issuing thread) and how large the buckets grow
    (``buckets``). Validated on construction."""

    policy: str = "full"
    overlap: bool = False
    buckets: BucketCap = Buckets.LARGEST
    second_stream: bool = False
    wire_dtype: torch.dtype = None  # type: ignore[assignment]  # set in __post_init__: the policy's default

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"dpq: the exchange policy is one of {sorted(POLICIES)}, got {self.policy!r}")
        for name in ("overlap", "second_stream"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"dpq: ExchangePlan.{name} is a bool, got {getattr(self, name)!r}")
        if self.second_stream and not self.overlap:
            raise ValueError("dpq: an exchange on a second stream is one during the backward (overlap)")
        _check_cap(self.buckets)
        wires = POLICIES[self.policy]
        if self.wire_dtype is None:
            object.__setattr__(self, "wire_dtype", wires[0])
        elif self.wire_dtype not in wires:
            raise ValueError(f"dpq: the {self.policy} exchange's sums travel in {' or '.join(map(str, wires))}, "
                             f"not {self.wire_dtype}")

    @classmethod
    def overlapped(cls, policy: str, overlap: bool, after_backward: Buckets = Buckets.LARGEST, *,
                   second_stream: bool = False) -> ExchangePlan:
        """``policy`` during the backward in buckets of a share of the block (Note [overlap buckets as a
        share of the block]), or after it in ``after_backward``'s."""
        return cls(policy, overlap=overlap, buckets=Buckets.SHARE if overlap else after_backward,
                   second_stream=second_stream)

    @classmethod
    def on_lanes(cls, policy: str, lanes: Sequence[Lane]) -> ExchangePlan:
        """The exchange a caller without a plan gets on ``lanes`` (tests, benchmarks): what the plan
        decides for them with ``--parallel_overlap auto`` and no GPU pair without peer access (during the
        backward on host lanes: Note [host lanes exchange during the backward] in ``dpq.planning.plan``)."""
        return cls.overlapped(policy, not any(lane.accelerator for lane in lanes))


class GradBuckets:
    """One flat fp32 gradient buffer per lane; every tuned parameter's ``.grad`` is a view of its slot.

    ``params_per_lane[k]`` is lane k's list of tuned parameters: same order and shapes on
    every lane, all on one device per lane, all fp32. ``lanes`` (optional) are the lanes
    the buffers belong to: zeroing is then queued on each lane's stream, where backward
    accumulates into the same memory.

    Layout invariant: slots are laid out in the REVERSE order of the parameter list, and
    buckets are contiguous ranges of the buffer taken from its start, so bucket 0 holds the
    last parameters. Backward produces gradients roughly in reverse parameter order, so
    buckets fill front to back and bucket i is complete before bucket i+1 is (for a block
    whose forward uses the parameters in list order): an engine may exchange bucket i
    while backward still fills the rest. Every bucket boundary is a parameter boundary; a
    bucket holds consecutive parameters whose sizes add up to at most ``bucket_cap_elems``,
    except that a larger parameter gets a bucket of its own, or as :class:`Buckets` says
    (:func:`bucket_cap`).
    """

    def __init__(
        self,
        params_per_lane: Sequence[Sequence[torch.nn.Parameter]],
        bucket_cap_elems: BucketCap = OVERLAP_BUCKET_CAP,
        lanes: Sequence[Lane] | None = None,
    ) -> None:
        if len(params_per_lane) == 0:
            raise ValueError("dpq: GradBuckets needs the parameters of at least one lane")
        _check_cap(bucket_cap_elems)
        if lanes is not None and len(lanes) != len(params_per_lane):
            raise ValueError(f"dpq: {len(lanes)} lanes for {len(params_per_lane)} parameter lists")
        self.params: list[list[torch.nn.Parameter]] = [list(ps) for ps in params_per_lane]
        self.lanes = None if lanes is None else list(lanes)
        devices = [_check_lane_params(k, ps, self.params[0]) for k, ps in enumerate(self.params)]
        if self.lanes is not None:
            for k, (lane, dev) in enumerate(zip(self.lanes, devices, strict=True)):
                if dev is not None and (dev.type, dev.index or 0) != (lane.device.type, lane.device.index or 0):
                    raise ValueError(f"dpq: lane {k}'s parameters are on {dev} but the lane is on {lane.device}")
        sizes = [p.numel() for p in self.params[0]]
        self.offsets = _reverse_offsets(sizes)
        self._views: list | None = None  # per lane: (buffer, each parameter's slot view), made once
        self.numel = sum(sizes)
        cap = bucket_cap(sizes, phases.bucket_cap(sizes, bucket_cap_elems))  # an observer may ask for another
        self.bucket_params = bucket_layout(sizes, cap)
        self.bucket_ranges = [_range_of(ids, self.offsets, sizes) for ids in self.bucket_params]
        self.bucket_of = [0] * len(sizes)  # parameter index -> its bucket
        for b, ids in enumerate(self.bucket_params):
            for i in ids:
                self.bucket_of[i] = b
        # Exchange policies' buffers, reused across buckets and iterations (the policy owns the
        # entry under its name; e.g. SignExchange's SignBuffers). Freed with the buckets.
        self.scratch: dict[str, object] = {}
        self._devices = devices
        self.buffers = self.flat_buffers(torch.float32, zero=True)
        self._by_copy = False  # attach_by_copy() was the last attach: finalize() has work
        self._copy_hooks: list = []
        phases.notify.buckets_laid_out(self, cap)

    @property
    def local_lanes(self) -> int:
        """This process's lanes, one flat buffer each (the exchange's world may span more)."""
        return len(self.params)

    def flat_buffers(self, dtype: torch.dtype, *, zero: bool = False) -> list[Tensor]:
        """A flat buffer of ``numel`` elements per lane, on the lane's device, allocated for its stream
        (where all its uses are queued)."""
        out = []
        for k, dev in enumerate(self._devices):
            with self._issue(k):
                make = torch.zeros if zero else torch.empty
                out.append(make(self.numel, dtype=dtype, device=dev or "cpu"))
        return out

    def bucket(self, i: int) -> list[Tensor]:
        """Bucket ``i`` of every lane: 1-D contiguous views of the flat buffers."""
        start, end = self.bucket_ranges[i]
        return [buf[start:end] for buf in self.buffers]

    def _slot_views(self) -> list[tuple[Tensor, list[Tensor]]]:
        views = self._views
        if views is None or any(v[0] is not buf for v, buf in zip(views, self.buffers, strict=True)):
            views = self._views = [(buf, [buf[off : off + p.numel()].view_as(p) for p, off in
                                          zip(params, self.offsets, strict=True)])
                                   for buf, params in zip(self.buffers, self.params, strict=True)]
        return views

    def attach(self) -> None:
        """Zero the buffers and point every ``p.grad`` at its slot.

        Call before every backward: ``zero_grad(set_to_none=True)`` drops the views, and a
        parameter without ``.grad`` would get a fresh tensor outside the buffer. With the
        view in place autograd accumulates into it in place. A parameter that receives no
        gradient keeps an exact zero (not None).
        """
        self._by_copy = False
        with phases.phase("grads", self):
            for k, ((buf, slots), params) in enumerate(zip(self._slot_views(), self.params, strict=True)):
                with self._issue(k):
                    buf.zero_()
                for p, v in zip(params, slots, strict=True):
                    if p.grad is not v:  # dropped (zero_grad) or replaced: the slot's view again
                        p.grad = v

    def attach_by_copy(self, *, hooks: bool = True) -> None:
        """Before every backward, instead of :meth:`attach`: drop the grads; each parameter's
        gradient is copied into its slot, which becomes its ``.grad``. One write per element where
        zeroing the buffer and adding into it wrote twice and read twice. :meth:`finalize` before
        reading the buffers.

        ``hooks``: where buckets are exchanged as the backward fills them, each parameter's first
        gradient of the backward is copied by a hook right after autograd accumulated it, on the stream
        it accumulated on (later gradients of further backwards add into the slot in place). Without
        (``hooks=False``: the exchange runs after the backward), :meth:`finalize` copies each lane's
        gradients, as autograd left them in ``.grad``, in one op.

        Note [first gradient copied]: the same values as zero-then-add (0 + g = g), except that a
        -0.0 gradient stays -0.0 where the add made it +0.0: a sign of -0.0 is 0 either way, and a
        sum of signed zeros is a zero either way, so no update changes. The hooks stay for the run
        (removed by :meth:`release`): one per tuned parameter per lane, Python on autograd's thread.

        Note [one copy per lane]: without overlap nothing reads a slot before the backward ends, so a
        hook per parameter buys nothing and costs the most contended host resource there is: each is
        Python on autograd's thread, under the GIL the issuing thread needs (a 70B- or 8B-class block:
        21 hooks per lane and iteration, the timeline model's biggest single item of autograd's host
        time after the compiled backward's own launches). ``torch._foreach_copy_`` of a lane's
        gradients into its slots is one host op (on CUDA a few multi-tensor launches, one per ~21M
        elements, issued in C++), on the lane's stream, where the backward left them (R0-R2 of
        ``dpq.streams``). Several backwards per iteration (gradient accumulation) add into the
        gradient autograd holds, then the sum is copied: the same one add per micro-step as adding
        into the slot, so the same bits.
        """
        self._by_copy = True
        views = self._slot_views()  # made once, here, not inside finalize's op (Note [views made once])
        if hooks and not self._copy_hooks:
            for params, (_, slots) in zip(self.params, views, strict=True):
                for p, slot in zip(params, slots, strict=True):
                    self._copy_hooks.append(p.register_post_accumulate_grad_hook(_into_slot(slot)))
        for params in self.params:
            for p in params:
                p.grad = None

    def finalize(self) -> None:
        """After :meth:`attach_by_copy`'s backward, before a buffer is read: gradients autograd left
        outside their slots copied in (Note [one copy per lane]); a parameter that got no gradient has
        its slot zeroed (exactly what :meth:`attach` would have left); every ``.grad`` its slot's view.
        Does nothing after :meth:`attach`."""
        if not self._by_copy:
            return
        with phases.phase("grads", self):
            for k, ((_, slots), params) in enumerate(zip(self._slot_views(), self.params, strict=True)):
                held = [(v, p.grad) for p, v in zip(params, slots, strict=True)
                        if p.grad is not None and p.grad is not v]
                with self._issue(k):
                    if held:
                        torch._foreach_copy_([v for v, _ in held], [g for _, g in held])
                    for p, v in zip(params, slots, strict=True):
                        if p.grad is None:
                            v.zero_()
                for p, v in zip(params, slots, strict=True):
                    p.grad = v
        self._by_copy = False

    def slot_views(self, buffers: Sequence[Tensor]) -> list[list[Tensor]]:
        """Per lane, each tuned parameter's slot in ``buffers[k]`` (a flat buffer laid out as the
        gradients are), viewed with the parameter's shape."""
        return [[buf[off: off + p.numel()].view(p.shape) for p, off in zip(params, self.offsets, strict=True)]
                for buf, params in zip(buffers, self.params, strict=True)]

    def detach(self) -> None:
        """Every ``p.grad`` back to None (the run is over: the buffers are not held by the params)."""
        for params in self.params:
            for p in params:
                p.grad = None

    def release(self) -> None:
        """Drop the buffers, their views, the policies' scratch and the parameter lists (the run is
        over; ``detach()`` the grads first). The object is unusable afterwards."""
        for h in self._copy_hooks:
            h.remove()
        self._copy_hooks.clear()
        self.scratch.clear()
        self.buffers.clear()
        self.params.clear()
        self._views = None

    def is_attached(self) -> bool:
        """True when every ``p.grad`` is still the view of its slot."""
        return all(
            p.grad is not None and p.grad.data_ptr() == buf[off:].data_ptr()
            for buf, params in zip(self.buffers, self.params, strict=True)
            for p, off in zip(params, self.offsets, strict=True)
        )

    def _issue(self, k: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.lanes is None else self.lanes[k].issue()


def _into_slot(slot: Tensor):
    """The hook :meth:`GradBuckets.attach_by_copy` puts on a parameter: its first gradient into ``slot``."""

    def hook(p: Tensor) -> None:
        if p.grad is not slot:
            slot.copy_(p.grad)
            p.grad = slot

    return hook


def _check_lane_params(
    k: int, params: Sequence[torch.nn.Parameter], ref: Sequence[torch.nn.Parameter]
) -> torch.device | None:
    """Lane k's parameter list is usable next to lane 0's; returns the lane's device (None if no params)."""
    if len(params) != len(ref):
        raise ValueError(f"dpq: lane {k} has {len(params)} tuned parameters, lane 0 has {len(ref)}")
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"dpq: lane {k} lists a parameter twice; each tuned parameter needs one gradient slot")
    for i, (p, p0) in enumerate(zip(params, ref, strict=True)):
        if p.dtype != torch.float32:
            raise TypeError(
                f"dpq: tuned parameter {i} of lane {k} is {p.dtype}; gradient buckets hold fp32 "
                "(tuned values and scales are kept in fp32)"
            )
        if p.shape != p0.shape:
            raise ValueError(
                f"dpq: tuned parameter {i} has shape {tuple(p.shape)} on lane {k}, {tuple(p0.shape)} on lane 0"
            )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"dpq: lane {k}'s tuned parameters span devices {sorted(map(str, devices))}")
    return devices.pop() if devices else None


def _reverse_offsets(sizes: Sequence[int]) -> list[int]:
    """Offset of each parameter (in list order) when slots are laid out last parameter first."""
    offsets, off = [0] * len(sizes), 0
    for i in reversed(range(len(sizes))):
        offsets[i] = off
        off += sizes[i]
    return offsets


def bucket_cap(sizes: Sequence[int], cap: BucketCap) -> int:
    """The cap :func:`bucket_layout` uses for tensors of ``sizes``: a fixed ``cap`` as it is;
    ``Buckets.LARGEST`` the largest of ``sizes``, ``Buckets.SHARE`` an :data:`OVERLAP_BUCKETS`-th of their
    sum (each at least :data:`OVERLAP_BUCKET_CAP`), ``Buckets.BLOCK`` their sum (one bucket).

    Note [overlap buckets as a share of the block]
    Overlapped, a bucket goes out once its last gradient is written, so the first must be small enough to
    be ready early; but each bucket costs the one issuing thread its ops and two collectives per lane, and
    its pack and unpack kernels share each GPU with the backward. A fixed cap makes every large weight a
    bucket of its own (a 70B-class block: 11 buckets with the scales), so the issuing thread pays for many
    buckets and the first ones carry little of the exchange; a share of the block keeps the count near
    :data:`OVERLAP_BUCKETS` whatever the block's size, and the cap's floor keeps a small block from being
    cut finer than helps. What either layout hides of the exchange is modeled by ``python -m
    benchmarks.timeline --table`` (docs/PERFORMANCE.md gives its figures, their command and date).

    Note [buckets as large as the largest tensor]
    Without overlap every bucket is exchanged after the backward, so small buckets buy nothing and
    cost host time: each bucket issues its own ops and collectives on the one issuing thread (the
    sign path: about ten ops and two collectives per bucket and lane), which is what limits fast
    GPUs (docs/PERFORMANCE.md). A parameter larger than any cap gets a bucket of its own anyway, and
    every per-bucket buffer (:class:`dpq.engine.sign_bits.SignBuffers`) is sized for the largest bucket,
    as the plan prices it (``dpq.planning.plan``: three fp32 copies of the largest bucket), so buckets up to
    the largest parameter add no memory the plan does not already count: a 70B-class block goes
    from 11 buckets to 5, an 8B-class one from 8 to 5 (the timeline model's layouts). Fewer still,
    one for the whole block (``Buckets.BLOCK``), where the plan found the memory for its
    scratch on every lane (Note [one bucket where it fits] in ``dpq.planning.plan``)."""
    if cap is Buckets.SHARE:
        return max(OVERLAP_BUCKET_CAP, -(-sum(sizes) // OVERLAP_BUCKETS))
    if cap is Buckets.LARGEST:
        return max([OVERLAP_BUCKET_CAP, *sizes])
    if cap is Buckets.BLOCK:
        return max(1, sum(sizes))
    return _check_cap(cap)


def bucket_layout(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Parameter indices per bucket, in buffer order (last parameter first)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes))):
        if current and filled + sizes[i] > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def _range_of(ids: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> tuple[int, int]:
    # ids run from a later to an earlier parameter, so the last one ends the range.
    return offsets[ids[0]], offsets[ids[-1]] + sizes[ids[-1]]


class _Exchange:
    """Runs a policy bucket by bucket and counts the communicator's wire bytes.

    ``plan``: what it runs, as given (the session passes the block plan's, ``dpq.planning.plan.Plan.exchange``):
    ``plan.overlap`` exchanges buckets during the backward (:meth:`during_backward`), ``plan.buckets``
    lays the engine's gradient buckets out. None: :meth:`ExchangePlan.on_lanes` of the communicator's
    lanes (callers without a plan: tests, benchmarks).
    """

    name = "exchange"

    def __init__(self, comm: Communicator, plan: ExchangePlan | None = None) -> None:
        self.comm = comm
        self.plan = plan if plan is not None else ExchangePlan.on_lanes(self.name, comm.lanes)
        if self.plan.policy != self.name:
            raise ValueError(f"dpq: a {self.plan.policy} exchange plan given to the {self.name} exchange")
        self.last_wire_bytes = 0  # bytes of the last exchange() call
        self.total_wire_bytes = 0  # bytes of every bucket ever exchanged

    @property
    def overlap(self) -> bool:
        """Buckets are exchanged as the last backward fills them (the plan's ``overlap``)."""
        return self.plan.overlap

    def exchange(self, buckets: GradBuckets) -> None:
        """Every bucket, in buffer order; afterwards every lane's grads hold the identical result."""
        self._check(buckets)
        buckets.finalize()
        before = self.total_wire_bytes
        for i in range(len(buckets.bucket_ranges)):
            self.exchange_bucket(buckets, i)
        self.last_wire_bytes = self.total_wire_bytes - before
        self.wait()

    def during_backward(self, buckets: GradBuckets, lanes: Sequence[int] | None = None) -> BackwardExchange:
        """A context for the iteration's last ``backward``: buckets are exchanged as they fill
        (when ``overlap`` is on), the rest when the context exits; afterwards every lane's grads
        hold exactly what :meth:`exchange` gives. ``lanes``: the lanes this backward reaches
        (default all); the others' gradients are final already (gradient accumulation: a lane
        with fewer micro-steps)."""
        self._check(buckets)
        return BackwardExchange(self, buckets, lanes)

    def exchange_bucket(self, buckets: GradBuckets, i: int, marks: Sequence | None = None) -> None:
        """Bucket ``i``; ``marks``: per lane, the event after which its gradients are final (else
        everything queued on the lanes so far)."""
        before = self.comm.wire_bytes
        start, end = buckets.bucket_ranges[i]
        watching = phases.observers()
        if watching:
            phases.notify.exchange_begin(self, i, end - start)
        try:
            if watching:  # an observer may ask for the conservative wait (Observer.bucket_waits)
                marks = phases.bucket_waits(self, i, marks)
            self.comm.begin_bucket(marks)  # dpq.comm.comm_streams: C1
            self._exchange(buckets, i)
        except BaseException as err:
            if watching:
                phases.notify.exchange_end(self, i, end - start, err)
            raise
        if watching:
            phases.notify.exchange_end(self, i, end - start, None)
        self.total_wire_bytes += self.comm.wire_bytes - before

    def wait(self) -> None:
        """The lanes' next use of the grads waits for the last collective. Real communicators
        queue their collectives on the lanes' streams, which orders the step after them: nothing
        to do; one that completes later (``dpqlab.simulated_link``) waits here."""
        with phases.phase("exchange wait", self):
            self.comm.wait()

    def _check(self, buckets: GradBuckets) -> None:
        if buckets.local_lanes != len(self.comm.lanes):
            raise ValueError(f"dpq: {buckets.local_lanes} gradient buffers for {len(self.comm.lanes)} lanes")

    exact_signs = False  # after exchange(): every grad element is exactly -1.0, +0.0 or +1.0 (dpq.engine.sign_step)

    def keep_signs_apart(self) -> bool:
        """Asked by a step that adds the signs itself (dpq.engine.sign_step): from now on leave them apart from
        the grads (:meth:`signs_apart`) instead of writing them back as fp32. True if this policy does."""
        return False

    def signs_apart(self, buckets: GradBuckets) -> list[dict[int, Tensor]] | None:
        """Per lane, each tuned parameter's (by ``id``) signs the last exchange kept apart; None: they are
        in the grads."""
        return None

    def _exchange(self, buckets: GradBuckets, i: int) -> None:
        """Bucket ``i`` in three steps.

        Note [the exchange in three steps]
        Every policy is the same three steps over a bucket whose elements are split into one chunk per
        global lane (the chunk a lane *owns*): ``reduce`` (each lane gets the sum over lanes of its owned
        chunk: a reduce-scatter), ``update_owned`` (what the policy makes of its chunk's sum: the sign
        exchange signs and packs it), ``gather`` (every lane gets every chunk's result, the same bytes on
        every lane: an all-gather, then what each lane writes from them). A policy whose update is the
        identity may fuse reduce and gather into one all-reduce (:class:`FullSumExchange`). A sharded
        update is a third ``update_owned``: the optimizer's step on the owned chunk, then the gather of
        the updated values. The steps share the bucket's views (``plan``, made once: Note [views made
        once])."""
        plan = self._plan(buckets, i)
        if phases.observers():
            self._observed_steps(plan, i)
            return
        self.reduce(plan)
        self.update_owned(plan)
        self.gather(plan)

    def _observed_steps(self, plan, i: int) -> None:
        """The three steps, each told to the observers (``Observer.exchange_step_begin``/``_end``)."""
        for name, step in (("reduce", self.reduce), ("update_owned", self.update_owned), ("gather", self.gather)):
            phases.told("exchange_step", (self, i, name), lambda step=step: step(plan))

    def _plan(self, buckets: GradBuckets, i: int):
        raise NotImplementedError

    def reduce(self, plan) -> None:
        """Each lane gets the sum over lanes of its owned chunk of the bucket (Note [the exchange in three steps])."""
        raise NotImplementedError

    def update_owned(self, plan) -> None:
        """What the policy makes of each lane's summed chunk (Note [the exchange in three steps])."""

    def gather(self, plan) -> None:
        """Every lane gets every chunk's result (Note [the exchange in three steps])."""


ISSUER_PATIENCE_S = 2.0  # the issuer's wait for the next bucket to complete before it leaves the rest for later


class BackwardExchange:
    """Buckets exchanged during one backward (module docstring: overlap, and which thread issues).

    ``with policy.during_backward(buckets) as bx: torch.autograd.backward(roots + bx.roots, seeds +
    bx.seeds)``; make it before the lanes' forwards (accelerator lanes: the issuer's node is made
    then). On entry (overlap on) a post-accumulate-grad hook goes on every tuned parameter of every
    lane the backward reaches; each counts its bucket down. CPU lanes: the hook that brings a
    bucket to zero issues it. Accelerator lanes: hooks only mark, the issuer node issues. On a
    clean exit the hooks come off, every bucket not issued is exchanged in buffer order, and the
    lanes wait for the last collective (``policy.wait``). On an exception the hooks come off and
    nothing more is issued (the caller tears the lanes down).
    """

    def __init__(self, policy: _Exchange, buckets: GradBuckets, lanes: Sequence[int] | None = None) -> None:
        self.policy, self.buckets = policy, buckets
        self.active = list(range(buckets.local_lanes)) if lanes is None else sorted(set(lanes))
        n = len(buckets.bucket_params)
        self.remaining = [len(ids) * len(self.active) for ids in buckets.bucket_params]
        self.issued = [False] * n
        self.issued_in_backward = 0  # buckets issued before backward returned (tests, benchmarks)
        self._fired = [[False] * len(buckets.bucket_of) for _ in range(buckets.local_lanes)]  # [lane][param]
        self._handles: list = []
        self._lock = threading.Lock()
        self._thread = threading.get_ident()
        self._before = policy.total_wire_bytes
        self.deferred = policy.overlap and policy.comm.world > 1 and self._on_devices()  # the issuer issues
        # deferred: per bucket, per lane, the params still to come and the mark once they came
        self._lane_left = [[len(ids)] * buckets.local_lanes for ids in buckets.bucket_params]
        self._marks: list[list] = [[None] * buckets.local_lanes for _ in range(n)]
        self._complete: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.roots: list[Tensor] = []
        self.seeds: list[Tensor] = []
        if self.deferred:  # made now, before the lanes' forwards (module docstring: its sequence number)
            token = torch.zeros((), requires_grad=True)
            self.roots.append(_Issuer.apply(token, self))
            self.seeds.append(torch.ones(()))

    def _on_devices(self) -> bool:
        """Accelerator lanes: autograd runs their backward (and these hooks) on its device threads."""
        return any(lane.accelerator for lane in self.policy.comm.lanes)

    def __enter__(self) -> BackwardExchange:
        if self.policy.overlap and self.policy.comm.world > 1:
            lanes = self.policy.comm.lanes
            observed = bool(phases.observers())  # decided once per backward: an unobserved hook stays lean
            for k in self.active:
                for j, p in enumerate(self.buckets.params[k]):
                    ready = self._hook(lanes[k], k, j)
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        self._observed_hook(ready, k, j) if observed else ready))
        return self

    def _observed_hook(self, ready, k: int, j: int):
        """``ready`` told to the observers (``Observer.gradient_hook_begin``/``_end``)."""

        def observed(param: Tensor) -> None:
            phases.told("gradient_hook", (self, k, j), lambda: ready(param))

        return observed

    def _hook(self, lane: Lane, k: int, j: int):
        b = self.buckets.bucket_of[j]
        on_cpu = not lane.accelerator
        deferred = self.deferred
        # R1 (the collective comes after this gradient's accumulation); nothing to order without a stream.
        # Deferred: no stream is touched here but by the mark (the issuer's streams wait for it).
        wait = lane.wait_for_current if lane.stream is not None and not deferred else None
        fired = self._fired[k]
        watching = phases.observers()  # the registered observers (a list: empty when none)

        def ready(_param: Tensor) -> None:
            # CPU: autograd calls this on the thread that called backward (the issuing thread).
            # Accelerators: on autograd's worker thread for the lane's device (module docstring).
            # Kept lean: it runs once per tuned parameter per lane per iteration (the issue cost).
            if on_cpu and threading.get_ident() != self._thread:
                raise RuntimeError("dpq: a CPU lane's gradient hook ran off the issuing thread; overlap assumes "
                                   "autograd runs CPU backward on the calling thread")
            if wait is not None:
                wait()
            with self._lock:  # the counts (and, on CPU, the issue) by one thread at a time
                if fired[j]:
                    raise RuntimeError(f"dpq: tuned parameter {j} of lane {k} accumulated a gradient twice in one "
                                       "backward after its bucket could have been exchanged")
                fired[j] = True
                self.remaining[b] -= 1
                if deferred:
                    self._lane_left[b][k] -= 1
                    if self._lane_left[b][k] == 0:
                        # this lane's part of the bucket is final after the accumulation just queued on
                        # the stream autograd runs the lane's backward on (one stream per lane: its forward's)
                        self._marks[b][k] = mark = lane.mark_current()
                        if watching:
                            phases.notify.bucket_marked(self, b, k, mark)
                    if self.remaining[b] == 0:
                        self._complete.put(b)  # the issuer takes it (never issued from this thread)
                elif self.remaining[b] == 0:
                    self._issue(b)
                    self.issued_in_backward += 1

        return ready

    def _issue(self, b: int, marks: Sequence | None = None) -> None:
        self.issued[b] = True
        if marks is None:
            self.policy.exchange_bucket(self.buckets, b)
        else:
            self.policy.exchange_bucket(self.buckets, b, marks)

    def serve(self) -> None:
        """The issuer (accelerator lanes; :class:`_Issuer` runs it on the thread that called ``backward``):
        issue each bucket once complete (module docstring), until every bucket is issued or none
        completed for :data:`ISSUER_PATIENCE_S`."""
        with phases.phase("issuer", self):
            self._serve()

    def _serve(self) -> None:
        in_order = self.policy.comm.world > len(self.policy.comm.lanes)  # across processes: buffer order
        complete, nxt, n = set(), 0, len(self.issued)
        last = time.monotonic()
        while nxt < n if in_order else len(complete) < n:
            try:
                b = self._complete.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() - last > ISSUER_PATIENCE_S:
                    return  # the rest go when backward returns
                continue
            last = time.monotonic()
            complete.add(b)
            ready = [b] if not in_order else []
            while in_order and nxt in complete:
                ready.append(nxt)
                nxt += 1
            for i in ready:
                lanes = self.policy.comm.lanes
                marks = [self._marks[i][k] if k in self.active else None for k in range(len(lanes))]
                self._issue(i, marks)
                self.issued_in_backward += 1

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._remove_hooks()
        if exc_type is not None:
            return
        with phases.phase("exchange finish", self):
            self.buckets.finalize()
            for b, done in enumerate(self.issued):  # parameters that got no gradient: their buckets now
                if not done:
                    self._issue(b)
            self.policy.last_wire_bytes = self.policy.total_wire_bytes - self._before
            self.policy.wait()


class _Issuer(torch.autograd.Function):
    """A CPU node, one more root of the lanes' ``backward``: autograd runs it on the calling thread
    while the device threads run the lanes, and it issues their buckets (:meth:`BackwardExchange.serve`)."""

    @staticmethod
    def forward(ctx, token: Tensor, bx: BackwardExchange) -> Tensor:
        ctx.bx = bx
        return token.detach().clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.bx.serve()
        return None, None


class FullSumExchange(_Exchange):
    """All-reduce every bucket: each lane's grads become the sum over lanes.

    Wire bytes: per bucket of n elements ``2*(W-1)*n*4 // W`` (the ring all-reduce of fp32),
    summed over buckets, so (W-1)/W x 8 bytes per element up to one byte of flooring per bucket.
    """

    name = "full"

    def _plan(self, buckets: GradBuckets, i: int) -> list[Tensor]:
        return buckets.bucket(i)

    def reduce(self, plan: list[Tensor]) -> None:
        """The update is the identity, so reduce and gather are one all-reduce: every lane gets the whole
        sum (Note [the exchange in three steps])."""
        self.comm.all_reduce(plan)


@dataclass
class _GroupPlan:
    """One group's views for one bucket (:meth:`SignExchange._plan`)."""

    # (send row's first n, the lane's grads) when the bucket pads or its sums travel in another dtype
    pad_copies: list[tuple[Tensor, Tensor]]
    pad_tail: Tensor | None  # the padding, zeroed before each reduce-scatter (the buffer serves every bucket)
    pack: PackViews
    unpack: UnpackViews
    signs: Tensor  # the unpacked signs, the bucket's n elements
    dests: list[Tensor]  # per lane of the group: where its signs go (kept apart, or its grads)


@dataclass
class _BucketPlan:
    """Every group's views for one bucket, and what the collectives take (in lane order)."""

    lanes: list[Lane]
    groups: list[_GroupPlan]
    send: list[Tensor]
    recv: list[Tensor]
    packed: list[Tensor]
    gathered: list[Tensor]


class SignExchange(_Exchange):
    """Pure SignSGD: every lane's grads become exactly ``sign(sum of lane grads)`` in {-1.0, 0.0, +1.0},
    the sum taken in ``wire`` (default bf16: Note [the summed gradient in bf16 on the wire]).

    Per bucket of n elements: pad with zeros to m = :func:`sign_padded_length` (n, W), cast to
    ``wire``; reduce-scatter, so lane k holds the sum of chunk k (m/W elements); the lane packs the
    sign of its chunk; an all-gather of the packed bytes; every lane unpacks all chunks.

    Note [the summed gradient in bf16 on the wire]
    SignSGD needs only the sign of the summed gradient, and on a slow link the reduce-scatter's bytes
    are most of an iteration (4 of the 4.25 bytes per element; the timeline model's RTX 3090 rows). So
    each lane's gradient is cast to bf16 (fp32's exponent range: nothing overflows that did not, a
    NaN stays NaN) and the sums are taken in bf16, in the communicator's order (dpq's own in global
    lane order, so one process and several agree bitwise; NCCL's its own): 2 + 0.25 bytes per element.
    A sign can differ from fp32's only where the lanes' gradients nearly cancel (the sum within a few
    bf16 roundings, 2^-8 relative, of zero), where the fp32 sign is rounding noise too: world >= 2 is
    held to statistical parity (contract 1), and world 1 exchanges nothing (bitwise auto-round).
    ``wire=torch.float32`` keeps the fp32 sums (4.25 bytes).

    Why two bit planes: sign is three-valued, and exact zeros are common (auto-round clamps
    rounded values, which gives exactly-zero gradients on every lane). A single sign bit
    would turn 0 into +-1 and move parameters serial SignSGD leaves alone. So each element
    gets a "negative" bit and a "nonzero" bit, each plane packed 8 elements to a byte; a
    lane's packed chunk holds, per octet of elements, its negative byte then its nonzero byte
    (one uint16 per octet, which the unpack looks up whole). The gather moves 2 bits per
    element, so wire bytes per element per lane are (W-1)/W x (2 + 0.25) = (W-1)/W x 2.25 in bf16,
    counted on the padded length m (exactly ``9*(W-1)*m // (4*W)`` per bucket; fp32: 4.25 and
    ``17*(W-1)*m // (4*W)``; docs/DESIGN.md, contract 3).

    The planes reproduce ``torch.sign`` exactly, NaN included: torch.sign(NaN) is 0, so serial
    SignSGD leaves an element with a NaN gradient alone, and so does this path (a NaN sum gets
    neither bit). This is real, not theoretical: auto-round's min/max-scale gradients
    overflow to NaN under sum-reduced losses with gradient accumulation, and mapping NaN to
    +1 moved parameters serial leaves alone and broke parity. World 1: ``grad = sign(grad)`` in place, no wire bytes.
    """

    name = "sign"
    exact_signs = True
    _apart = False  # keep_signs_apart() was asked: the signs stay int8 beside the grads

    def __init__(self, comm: Communicator, plan: ExchangePlan | None = None) -> None:
        super().__init__(comm, plan)
        self.wire = self.plan.wire_dtype

    def keep_signs_apart(self) -> bool:
        """The signs stay int8 in a buffer of their own per lane group (one byte per element, written by
        the unpack's copy), so no fp32 copy of them is written into the grads and read back by the step."""
        self._apart = True
        return True

    def signs_apart(self, buckets: GradBuckets) -> list[dict[int, Tensor]] | None:
        if not self._apart or self.comm.world == 1:
            return None
        cached = buckets.scratch.get("sign_apart_views")
        if cached is None:
            flat = self._apart_buffers(buckets)
            cached = buckets.scratch["sign_apart_views"] = [
                {id(p): v for p, v in zip(params, views, strict=True)}
                for params, views in zip(buckets.params, buckets.slot_views(flat), strict=True)]
        return cached

    def _apart_buffers(self, buckets: GradBuckets) -> list[Tensor]:
        """Per lane, the int8 flat buffer its signs are kept in, laid out as its gradients: made like
        them, for the lane's stream (the step reads it there; the unpack writes it between the
        communicator's joins, as it wrote the grads). On first use."""
        cached = buckets.scratch.get("sign_apart")
        if cached is None:
            cached = buckets.scratch["sign_apart"] = buckets.flat_buffers(torch.int8)
        return cached

    def _exchange(self, buckets: GradBuckets, i: int) -> None:
        if self.comm.world == 1:
            with self.comm.lanes[0].issue():
                buckets.bucket(i)[0].sign_()
            return
        super()._exchange(buckets, i)

    def reduce(self, plan: _BucketPlan) -> None:
        """Each lane's gradients (zero-padded to the padded length, cast to the wire dtype) reduce-scattered:
        lane k holds the sum of chunk k."""
        for group, lane in zip(plan.groups, plan.lanes, strict=True):
            if group.pad_copies:
                with lane.issue():
                    for dst, src in group.pad_copies:  # zero-padded (cast) copies; reduce_scatter only reads send
                        dst.copy_(src)
                    if group.pad_tail is not None:
                        group.pad_tail.zero_()
        self.comm.reduce_scatter(plan.send, plan.recv)

    def update_owned(self, plan: _BucketPlan) -> None:
        """The sign of each lane's summed chunk, packed in two bit planes."""
        for group, lane in zip(plan.groups, plan.lanes, strict=True):
            with lane.issue():
                pack_into(group.pack)

    def gather(self, plan: _BucketPlan) -> None:
        """The packed chunks all-gathered; every lane unpacks them into its grads (or the signs kept apart)."""
        self.comm.all_gather(plan.packed, plan.gathered)
        for group, lane in zip(plan.groups, plan.lanes, strict=True):
            with lane.issue():
                # Every lane gathered the same bytes: a group of lanes without streams unpacks once.
                unpack_into(group.unpack)
                for dst in group.dests:
                    dst.copy_(group.signs)  # int8 into the signs kept apart, or int8 -> fp32 grads: -1.0, 0.0, +1.0

    def _plan(self, buckets: GradBuckets, i: int) -> _BucketPlan:
        """Bucket ``i``'s views, made on its first exchange and kept with the groups.

        Note [views made once]: every tensor an exchange touches is a slice of a buffer that lives
        as long as the buckets (the flat gradients, the signs kept apart, :class:`SignBuffers`), and
        which slice depends only on the bucket, the world and the groups: so the slices are made
        once, and each iteration issues only the ops that compute or move data. On an accelerator
        every op, a view too, is host time on the one issuing thread, and that thread is what the
        H200 run found limiting (docs/PERFORMANCE.md). A plan is dropped with its groups when the
        lanes change, and keyed by whether the signs are kept apart (that changes where they go).
        The ops, their operands and their order are those of the per-iteration slicing they replace,
        so every result is bitwise the same (tests/test_exchange.py)."""
        _, groups, plans = self._entry(buckets)
        key = (i, self._apart)
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = self._make_plan(buckets, i, groups)
        return plan

    def _make_plan(self, buckets: GradBuckets, i: int, groups) -> _BucketPlan:
        grads = buckets.bucket(i)
        world = self.comm.world
        n = grads[0].numel()
        m = sign_padded_length(n, world)
        c = m // world  # world counts every rank (a process group spans more ranks than these lanes)
        apart = self._apart_buffers(buckets) if self._apart else None
        start, end = buckets.bucket_ranges[i]
        plan = _BucketPlan([], [], [], [], [], [])
        for ks, buf, lane in groups:  # one group per lane, or one for all lanes (SignBuffers)
            rows = len(ks)
            with lane.issue():
                if m != n or self.wire != grads[0].dtype:
                    pad = take(buf.pad, rows, m)
                    pad_copies = [(pad[row, :n], grads[k]) for row, k in enumerate(ks)]
                    pad_tail = pad[:, n:] if m != n else None
                    plan.send += list(pad)
                else:
                    pad_copies, pad_tail = [], None
                    plan.send += [grads[k] for k in ks]
                plan.recv += list(take(buf.recv, rows, c))
                plan.packed += list(take(buf.packed, rows, c // 4))
                plan.gathered += list(take(buf.gathered, rows, m // 4))
                pack = pack_views(take(buf.recv, rows, c), take(buf.planes, rows, c // 8, 2, 8), buf.weights,
                                  take(buf.weighted, rows * 2 * c), take(buf.packed, rows, c // 4))
                dests = [apart[k][start:end] if apart is not None else grads[k] for k in ks]
                unpack = unpack_views(plan.gathered[ks[0]], world, buf.table, buf.idx, buf.signs)
            plan.lanes.append(lane)
            plan.groups.append(_GroupPlan(pad_copies, pad_tail, pack, unpack, unpack.signs[:n], dests))
        return plan

    def _entry(self, buckets: GradBuckets) -> tuple[list[Lane], list[tuple[list[int], SignBuffers, Lane]], dict]:
        """(lanes, their buffer groups (:func:`dpq.engine.sign_bits.sign_groups`), the buckets' plans over
        those groups): made on first use per buckets and lanes, and again, plans emptied, when the
        communicator's lanes are other objects."""
        lanes = self.comm.lanes
        cached = buckets.scratch.get(self.name)
        if cached is None or [id(a) for a in cached[0]] != [id(b) for b in lanes]:
            lengths = [e - s for s, e in buckets.bucket_ranges]
            cached = buckets.scratch[self.name] = (list(lanes), sign_groups(lanes, self.comm.world, lengths,
                                                                            self.wire), {})
        return cached  # keyed by the lanes held in the entry (identity)


def exchange_for(comm: Communicator, plan: ExchangePlan) -> _Exchange:
    """The exchange ``plan`` names (its ``policy``), over ``comm``."""
    return {"sign": SignExchange, "full": FullSumExchange}[plan.policy](comm, plan)
