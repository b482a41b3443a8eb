"""The one decision per block: how many lanes, on which devices.

``resolve(request)`` returns a :class:`Plan` or raises :class:`PlanRefused` listing every
reason at once (never only the first: a user fixing one reason per run would rerun a long
job many times). ``world='auto'`` never refuses: it keeps the lanes that can be served, falls
back to serial when none beyond home can, and says why. An explicit world refuses before the
block starts. The plan also names the communicator for the chosen lanes
(``dpq.comm.communicators.choose_communicator``) and the exchange policy (the sign path when the task
says its optimizer is pure SignSGD, full sums otherwise), each with its reason; the session
(``dpq.session``) makes them. A plan is frozen: what a block's run did with it (the lanes after
the agreement across processes or 'auto''s choice, the communicator as built) is the session's
:class:`dpq.session.LaneRun`.

Every reason's text (what is wrong and the fix) is in :mod:`dpq.refusals`; this module decides
which ones apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from dpq import refusals
from dpq.comm.communicators import COMMUNICATORS, choose_communicator, pair_without_peer
from dpq.engine.exchange import BucketCap, Buckets, ExchangePlan, bucket_cap
from dpq.engine.sign_bits import SIGN_TABLE_BYTES
from dpq.planning.lane_devices import DeviceEntry, entry_problem, parse_device_spec, validate_world
from dpq.streams import backend, default_accelerator_type

__all__ = ["HOST_LANES_OVERLAP", "ONE_LANE_EXCHANGE", "BlockPrice", "Plan", "PlanRefused", "PlanRequest",
           "default_devices", "exchange_plan", "overlap_choice", "price_home", "price_mirror", "price_runtime",
           "resolve"]

SUPPORTED_HOME_TYPES = ("cuda", "xpu", "hpu", "cpu")
MARGIN = 1.2  # headroom over the priced bytes: allocator fragmentation, autograd temporaries
# Activation bytes per token and element of a linear layer's input + output features (``price_mirror``),
# by the element size of the dtype the block computes in. Measured on tiny Llama blocks (hidden
# 256-512, seqlen 64-2048, CPU; auto-round's block forward + MSE loss + backward, every tensor
# storage an op allocates tracked; peak growth per sample, the seq x seq mask taken out;
# tests/test_nccl_lifecycle.py measures it again): in fp32 4.8-5.8 bytes (what autograd keeps:
# 4.3, the rest the backward's temporaries), priced at 6; under bf16 autocast 2.6-3.3 (linear
# inputs and outputs in bf16; norms, residual stream and loss in fp32), priced at 4. Pricing fp32
# like bf16 (4 bytes: one fp32 copy of each input and output) put the measured total above the price,
# margin included, from seqlen 256 on: a lane the plan passed could run out of memory.
ACTIVATION_BYTES = {4: 6, 2: 4}
ONE_LANE_EXCHANGE = "one lane: nothing to exchange"  # the communicator reason of a single lane


class PlanRefused(ValueError):
    """An explicitly requested world cannot be served. ``reasons`` holds every reason; ``every_rank``:
    several processes agreed on it (:func:`dpq.planning.distributed.agree`), so every rank raises this same
    refusal at the same point and none needs telling (it is a refusal, not a rank's failure)."""

    def __init__(self, reasons: Sequence[str], every_rank: bool = False) -> None:
        self.reasons, self.every_rank = list(reasons), every_rank
        body = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"dpq: the requested parallel quantization cannot run:\n{body}")


@dataclass
class PlanRequest:
    world: int | str = "auto"  # int >= 1, 'auto' or 'off'
    devices: Sequence[str | int | torch.device] | str | None = None
    samples_per_iter: int = 8
    home: torch.device | str | None = None
    extra_reasons: Sequence[str] = ()  # tuner features dpq cannot split (found by the adapter)
    mirror_bytes: int | None = None  # a flat price of one mirror, all included; None = not checked
    pure_sign: bool = False  # the task's update needs only sign(sum of grads) (SignSGD, no momentum/decay)
    # The block's prices by lane role (mirrors, home, the accelerator runtime): when given, every lane
    # is checked with them, home included, and ``mirror_bytes`` is not used.
    price: BlockPrice | None = None
    processes: int = 1  # torchrun: the processes the lanes' exchange spans (home stages their rows)
    # the exchange during the backward on GPU lanes: True (--parallel_overlap on), False (off), None (auto:
    # :func:`overlap_choice`)
    overlap: bool | None = None
    order: str = "canonical"  # --parallel_order: the order the sums fold in (ORDERS)
    pool_samples: int | None = None  # the calibration samples there are (None: not known); caps samples_per_iter
    asked_samples: int | None = None  # the calibration samples asked for (--nsamples; the data may give fewer)
    caller: str = "cli"  # how a refusal's fix names settings: "cli" (auto-round-dp's flags) or "api" (parallel_tune)


@dataclass(frozen=True)
class Plan:
    """The lanes this process's block would run on (``devices``, lane 0 home; ``reasons``: why
    'auto' kept fewer, or why serial), the communicator and the exchange policy, each with its
    reason. As :func:`resolve` made it: never changed afterwards (build another with
    ``dataclasses.replace``); what a run did with it is the session's ``dpq.session.LaneRun``."""

    devices: list[torch.device]
    reasons: list[str] = field(default_factory=list)  # why 'auto' kept fewer lanes, or why serial
    notes: list[str] = field(default_factory=list)  # said, but no reason to refuse (e.g. devices left unused)
    communicator: str = "local"  # a name in dpq.comm.communicators.COMMUNICATORS ("": chosen on the lanes)
    communicator_reason: str = ONE_LANE_EXCHANGE
    # what the exchange runs, used as given (dpq.engine.exchange.ExchangePlan: the policy, "sign" or "full", its wire
    # dtype, overlap, the gradient buckets; :func:`exchange_plan`)
    exchange: ExchangePlan = field(default_factory=ExchangePlan)
    exchange_reason: str = ""
    lane_bytes: list[int] = field(default_factory=list)  # the price each lane was checked with (a prefix when
    # 'auto' stopped at a lane that does not fit); empty when nothing was priced
    buckets_reason: str = ""  # the gradient buckets of an exchange after the backward (:func:`_bucket_choice`)
    overlap_reason: str = ""  # the exchange during the backward on GPU lanes (:func:`overlap_choice`)
    order: str = "canonical"  # the order the communicator sums in (ORDERS; said in communicator_reason)

    @property
    def local_lanes(self) -> int:
        """This process's lanes (across processes the world is the processes times the agreed count)."""
        return len(self.devices)

    @property
    def said(self) -> list[str]:
        """Its reasons, then its notes (what the block's log and record say)."""
        return [*self.reasons, *self.notes]


def _exchange(pure_sign: bool) -> tuple[str, str]:
    if pure_sign:
        return "sign", ("pure SignSGD (no momentum, no weight decay): only the sign of the summed gradient is "
                        "exchanged (the sums in bf16 on the wire)")
    return "full", "the update needs the summed gradient itself (momentum, weight decay or another optimizer)"


class _Choices:
    """One :func:`resolve`'s communicator and overlap decisions, each made once per lane list: the memory
    check prices the lanes with them and the plan then says them, so both read the same decision (a
    lane list 'auto' shortened is a new one)."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self._made: dict[tuple, tuple[object, Exception | None]] = {}

    def _once(self, what: str, devices: Sequence[torch.device], decide: Callable[[], object]):
        key = (what, tuple(str(d) for d in devices))
        if key not in self._made:
            try:
                self._made[key] = (decide(), None)
            except Exception as err:  # raised again, to each asker, as the first call raised it
                self._made[key] = (None, err)
        value, err = self._made[key]
        if err is not None:
            raise err
        return value

    def communicator(self, devices: Sequence[torch.device]) -> tuple[str, str]:
        return self._once("communicator", devices, lambda: choose_communicator(devices))

    def overlap(self, devices: Sequence[torch.device]) -> tuple[bool, str]:
        request = self.request
        return self._once("overlap", devices, lambda: overlap_choice(request.overlap, devices, request.processes))


# Note [canonical or native order]: what --parallel_order promises and costs. The communicators sum in
# dpq's canonical order by default (contract 3 of dpq.comm.comm_base): the bits depend on the world alone, so
# torchrun 2x1 == 1x2 == one process of 2 lanes, bitwise. On distinct GPUs CuPy's NCCL pays for it: per
# lane and bucket 2(W-1) send/recv calls, a staging buffer of (W-1)/W of the bucket and W-1 fold kernels
# (dpq.nccl_comm._to_owners). "native" hands the sums to NCCL's own reduce-scatter: one kernel per lane,
# every lane the same bits (replicas stay identical), but the bits depend on NCCL's algorithm and layout.
ORDERS = {
    "canonical": ("canonical order (--parallel_order canonical): the bits depend on the world alone; with "
                  "{kind} it costs per lane and bucket {calls} NCCL send/recv calls, a staging buffer and {folds} "
                  "fold kernels (--parallel_order native: NCCL's own reduce-scatter instead)"),
    "native": "native order: NCCL's own reduce-scatter (every lane the same bits, which depend on NCCL's algorithm)",
}


def _order(communicator: str, order: str, world: int) -> tuple[str, str]:
    """(the order the communicator sums in, the sentence the plan adds to its reason)."""
    kind = COMMUNICATORS.get(communicator)
    if kind is None or world < 2:
        return "canonical", ""
    if order not in kind.orders:
        return "canonical", f"--parallel_order {order}: {communicator} has only the canonical order"
    if "native" not in kind.orders:  # nothing to choose: the kind's own order note says what it does
        return order, ""
    if order == "native":
        return order, ORDERS["native"]
    return order, ORDERS["canonical"].format(kind=communicator, calls=2 * (world - 1), folds=world - 1)


def _finish(plan: Plan, request: PlanRequest, choices: _Choices) -> Plan:
    """``plan`` with the communicator and the exchange policy for its lanes."""
    try:
        communicator, reason = choices.communicator(plan.devices)
    except ValueError as err:  # lanes no communicator can join (e.g. hpu with other devices)
        raise PlanRefused([str(err).removeprefix("dpq: ")]) from None
    except Exception as err:  # a device query failed: the session chooses on the lanes it makes
        communicator, reason = "", f"chosen on the lanes (the device query failed: {err!r})"
    kind = COMMUNICATORS.get(communicator)
    if kind is not None and not kind.canonical_order:  # contract 3: the plan says when the bits depend on it
        reason += f"; {kind.order_note}"
    order, said = _order(communicator, request.order, len(plan.devices))
    reason += f"; {said}" if said else ""
    policy, exchange_reason = _exchange(request.pure_sign)
    buckets, buckets_reason = _bucket_choice(plan.devices, request, choices)
    exchange, overlap_reason = exchange_plan(policy, plan.devices, request.overlap, choices.overlap(plan.devices),
                                             buckets)
    return replace(plan, communicator=communicator, communicator_reason=reason, exchange=exchange,
                   exchange_reason=exchange_reason, buckets_reason=buckets_reason, overlap_reason=overlap_reason,
                   order=order)


# Note [host lanes exchange during the backward] (below): what the plan says of it, as overlap_choice says a GPU choice
HOST_LANES_OVERLAP = ("auto: CPU lanes exchange during the backward, each bucket on the issuing thread as its "
                      "gradients complete (no second stream, the block forward as auto-round compiles it); "
                      "--parallel_overlap off exchanges after it")


def exchange_plan(policy: str, devices: Sequence[torch.device], setting: bool | None,
                  gpu_overlap: tuple[bool, str], after_backward: Buckets) -> tuple[ExchangePlan, str]:
    """What the exchange over ``devices`` runs, and why it runs during the backward or not: ``policy``,
    during the backward where ``gpu_overlap`` (:func:`overlap_choice` for ``setting``: on, why; then on a
    second stream per lane where the lanes have streams) says so, or on host lanes unless ``setting`` is
    False (Note [host lanes exchange during the backward]; why: :data:`HOST_LANES_OVERLAP` where there is
    an exchange); then in buckets of a share of the block, else in ``after_backward``'s (:func:`_bucket_choice`).

    Note [host lanes exchange during the backward]
    On lanes without an accelerator (the backend's answer, as ``dpq.streams.Lane.accelerator`` gives it:
    a tool's logical accelerators on the CPU are accelerators) autograd runs every lane's backward on the
    issuing thread, so a bucket's hook can issue its collective there with no second stream and no
    uncompiled forward (``dpq.engine.exchange``, the module docstring): ``auto`` and ``on`` exchange during the
    backward, ``off`` after it. A second stream per lane (``second_stream``) follows :func:`overlap_choice`
    alone: the session gives one to lanes that have streams."""
    on_gpus, why = gpu_overlap
    on_host = not on_gpus and setting is None and _host_lanes(devices)
    exchange = ExchangePlan.overlapped(policy, on_gpus or on_host, after_backward, second_stream=on_gpus)
    return exchange, (HOST_LANES_OVERLAP if on_host and len(devices) > 1 else why)


def _host_lanes(devices: Sequence[torch.device]) -> bool:
    """No lane on an accelerator (a device type without a backend counts as one: not a host lane)."""
    try:
        return not any(backend(d).accelerator for d in devices)
    except ValueError:
        return False


def overlap_choice(setting: bool | None, devices: Sequence[torch.device], processes: int = 1,
                   peer: Callable[[torch.device, torch.device], bool] | None = None) -> tuple[bool, str]:
    """(on, why): whether the exchange runs during the backward on a second stream per GPU lane,
    with the lanes' block forward uncompiled (Note [overlap needs gradients during the backward] in
    ``dpq.autoround.block_task``). ``setting``: True (``--parallel_overlap on``), False (``off``) or None
    (``auto``); ``peer(a, b)``: whether GPU a reaches GPU b directly (default: the backend's answer).

    Note [overlap where the wire is slow]
    Overlap hides the exchange under the backward, and pays for it in host work: the block's
    elementwise ops run eager and small buckets each cost the one issuing thread its ops and
    collectives. The model prices both (docs/PERFORMANCE.md, modeled): where the GPUs reach each
    other only through host memory (no peer access, e.g. GeForce cards on PCIe: 10 GB/s) the exchange is
    the iteration's largest part and overlap wins; over NVLink the exchange is short and the host is
    already the limit, so overlap loses. ``auto`` takes that line: on for distinct CUDA lanes of which some
    pair has no peer access, off elsewhere. Across processes ``auto`` stays off: every rank must lay
    its buckets out alike, and the ranks do not compare their links here. CPU lanes exchange during
    the backward anyway (``dpq.engine.exchange``), so the setting concerns GPU lanes only."""
    if setting is not None:
        return bool(setting), ("asked for (--parallel_overlap on)" if setting else "--parallel_overlap off")
    devices = [torch.device(d) for d in devices]
    if len({str(d) for d in devices}) < 2 or any(d.type != "cuda" for d in devices):
        return False, ""
    if processes > 1:
        return False, ("auto: off across processes (every rank must lay its gradient buckets out alike); "
                       "--parallel_overlap on asks for it")
    try:
        slow = pair_without_peer(devices, peer)
    except Exception as err:  # a device query failed (as in _finish): the safe default, said
        return False, f"auto: off, the GPUs' peer access could not be queried ({err!r})"
    if slow is None:
        return False, ("auto: off, every GPU pair has peer access (the exchange is short beside the iteration, "
                       "and overlap would cost the issuing thread more than it hides)")
    return True, (f"auto: on, {slow[0]} has no peer access to {slow[1]} (the exchange goes through host memory and "
                  f"is the iteration's largest part): the exchange runs during the backward, the lanes' block "
                  f"forward uncompiled")


def _bucket_choice(devices: list[torch.device], request: PlanRequest, choices: _Choices) -> tuple[Buckets, str]:
    """(``Buckets.BLOCK`` | ``Buckets.LARGEST``, why): how large the gradient buckets of an exchange that runs after the
    backward are (``dpq.engine.exchange.bucket_cap``; an overlapping exchange keeps its small cap).

    Note [one bucket where it fits]
    After the backward a bucket buys nothing by being small, and each one costs the one issuing thread
    its ops and two collectives per lane (the sign path: eight ops per bucket and lane), which is what
    limits fast GPUs (docs/PERFORMANCE.md). One bucket for the whole block is the fewest, but its
    exchange scratch is sized for it: the plan prices that (three fp32 copies of the bucket) on every
    lane, and takes the whole block where every lane's device has the memory, else buckets as large as
    the largest tensor (no scratch beyond what the plan already prices for that tensor). Across
    processes every rank must lay its buckets out alike, and the ranks do not compare their free memory
    here: the largest tensor, on every rank. Decided from the block and the devices alone, so every lane
    of the process agrees."""
    if len(devices) < 2 or request.price is None:
        return Buckets.LARGEST, ""
    if request.processes > 1:
        return Buckets.LARGEST, ("an exchange after the backward runs buckets as large as the largest tensor: across "
                           "processes the ranks lay their buckets out alike without comparing their free memory")
    whole = replace(request, price=replace(request.price, bucket_cap_elems=Buckets.BLOCK))
    explicit = validate_world(request.world, request.caller) != "auto"
    refused = _memory_refusals(devices, whole, _home(request), explicit, choices, [])
    short = list(dict.fromkeys(str(devices[k]) for k, _ in refused))
    if short:
        return Buckets.LARGEST, (f"an exchange after the backward runs buckets as large as the largest tensor: one "
                           f"bucket for the whole block does not fit {', '.join(short)}")
    return Buckets.BLOCK, ("an exchange after the backward runs one gradient bucket for the whole block (its scratch "
                           "fits every lane)")


def _block_terms(block: torch.nn.Module, inputs: Sequence[torch.Tensor], samples_per_iter: int, world: int,
                 bucket_cap_elems: BucketCap, compute_dtype: torch.dtype | None) -> dict:
    """Every block-dependent term a lane may hold (``price_mirror`` and ``price_home`` take theirs)."""
    two_d = [p for p in block.parameters() if p.dim() == 2]
    n = sum(p.numel() for p in two_d)
    tuned = n + n // 8
    share = -(-max(1, samples_per_iter) // world)
    cap = bucket_cap([tuned], bucket_cap_elems)  # Buckets.SHARE: an eighth of the tuned values (dpq.engine.exchange)
    bucket = min(tuned, max(cap, max((p.numel() for p in two_d), default=0)))
    parts = {
        "weights": sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers())),
        "tuned_values": tuned * 4,
        "qdq_saved": 4 * n * 4,
        "grad_buffer": tuned * 4,
        "exchange": 3 * bucket * 4 + SIGN_TABLE_BYTES + tuned,  # + the signs kept apart, int8
        "activations": 0,
        "staging": 0,
    }
    if inputs:
        x = inputs[0]
        if compute_dtype is None:
            compute_dtype = two_d[0].dtype if two_d else x.dtype
        size = torch.empty((), dtype=compute_dtype).element_size()
        tokens = x.shape[:-1].numel() if x.dim() >= 2 else 1
        rows, seq = (x.shape[:-2].numel(), x.shape[-2]) if x.dim() >= 3 else (1, tokens)
        elems = sum(p.shape[0] + p.shape[1] for p in two_d) or 16 * x.shape[-1]
        per_token = ACTIVATION_BYTES.get(size, 1.5 * size) * elems
        parts["activations"] = int(share * (tokens * per_token + rows * seq * seq * size))
        parts["staging"] = share * 2 * x.numel() * x.element_size()
    return {"parts": parts, "share": share, "world": world, "bucket": bucket, "tuned": tuned}


def price_mirror(
    block: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    samples_per_iter: int,
    world: int | None = None,
    *,
    bucket_cap_elems: BucketCap = 2**22,
    compute_dtype: torch.dtype | None = None,
    detail: dict | None = None,
) -> int:
    """Bytes one more lane (a mirror) needs, times MARGIN. Each term, for n = the elements of the
    block's 2-D (linear) weights:

    * ``weights``: the mirror's copy of the block's parameters and buffers, in their dtypes;
    * ``tuned_values``: fp32 rounding values (n) and min/max scales (bounded by n/8: group >= 16);
    * ``qdq_saved``: what autograd keeps of the quantize-dequantize of every weight for backward,
      priced at 4 fp32 weight-sized tensors (2.9 measured on a tiny Llama block);
    * ``grad_buffer``: the communicator's flat fp32 gradient buffer, one slot per tuned value;
    * ``exchange``: the exchange temporaries of the largest bucket, held for the whole run (sign
      path: padded send copy, receive chunk, packed and unpacked planes; bounded by 3 fp32 copies
      of a bucket). A bucket exceeds the cap only by holding one parameter larger than it
      (``dpq.engine.exchange``), so the largest is at most max(cap, the largest weight); the cap
      ``dpq.engine.exchange.Buckets.SHARE`` (an overlapped exchange) is an eighth of the tuned values;
    * ``activations``: what one forward + loss + backward of the lane's own share of each
      iteration's samples, ceil(samples_per_iter / world), allocates at its peak beyond the
      weight-sized terms above: per token, :data:`ACTIVATION_BYTES` per element of every linear
      layer's input and output features, by the element size of ``compute_dtype``; plus, per
      sample, a sequence x sequence attention mask in ``compute_dtype``;
    * ``staging``: the share's inputs and reference outputs staged onto the lane.

    ``compute_dtype``: the dtype the block computes in (auto-round: its ``amp_dtype``, float32
    when amp is off); default the dtype of the block's 2-D weights (auto-round casts the model
    to it). ``world=None`` prices the largest share a mirror ever gets: mirrors exist only at
    world >= 2, so world 2. Pass the planned world for a tighter price. ``detail``, if given,
    receives each term (bytes, before the margin). Optimizer state beyond SignSGD (momentum,
    Adam) and per-sample extra inputs other than the mask are not priced; what the accelerator
    runtime allocates beside the tensors is :func:`price_runtime`'s.
    """
    world = 2 if world is None else max(1, int(world))
    terms = _block_terms(block, inputs, samples_per_iter, world, bucket_cap_elems, compute_dtype)
    parts = terms["parts"]
    if detail is not None:
        detail.update(parts, share=terms["share"], world=world)
    return int(sum(parts.values()) * MARGIN)


def price_home(
    block: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    samples_per_iter: int,
    world: int | None = None,
    *,
    processes: int = 1,
    lanes_elsewhere: int = 0,
    bucket_cap_elems: BucketCap = 2**22,
    compute_dtype: torch.dtype | None = None,
    detail: dict | None = None,
) -> int:
    """Bytes lane 0 (home) needs beyond what it holds when the plan is made (the block and its
    pool), times MARGIN: the terms of :func:`price_mirror` but the weights (home's are the block
    itself), and

    * ``best``: the tuner's snapshot of the best iteration's tuned values, twice (the new snapshot
      is taken while the previous one is still held; auto-round keeps it on its cache device:
      home unless ``--low_gpu_mem_usage``, priced as home either way);
    * ``process_group`` (``processes`` P > 1, torchrun): what
      :class:`dpq.comm.process_group.ProcessGroupCommunicator` stages on lane 0 for the largest bucket B
      (fp32, padded to whole sign bytes) over W = P x L global lanes, L = ``world`` (this process's
      lanes): a copy of B for each of ``lanes_elsewhere`` lanes on another device than home's, the
      (P-1) x L rows of L x B / W elements each that the other processes send (the staging buffer)
      and the ordered sum of this process's L chunks (L x B / W).

    ``world``: this process's lanes (default 2: the largest share a lane gets with a mirror).
    """
    world = 2 if world is None else max(1, int(world))
    terms = _block_terms(block, inputs, samples_per_iter, world * max(1, processes), bucket_cap_elems,
                         compute_dtype)
    parts = {k: v for k, v in terms["parts"].items() if k != "weights"}
    parts["best"] = 2 * terms["tuned"] * 4
    if processes > 1:
        lanes, total = world, world * processes
        padded = -(-terms["bucket"] // (8 * total)) * 8 * total
        chunk = lanes * padded // total
        parts["process_group"] = 4 * (lanes_elsewhere * padded + (processes - 1) * lanes * chunk + chunk)
    if detail is not None:
        detail.update(parts, share=terms["share"], world=world, processes=processes)
    return int(sum(parts.values()) * MARGIN)


# -- what the accelerator runtime allocates beside the tensors ------------------------------------
# None of this can be measured on a CPU (there is no CUDA runtime there): stated figures, each with
# its source, priced on cuda lanes only (:func:`price_runtime`).
#
# torch's cuBLAS workspace per (cuBLAS handle, stream), kept for the process's life: 32 MiB on
# Hopper (sm90), 8 MiB + 128 KiB before (aten/src/ATen/cuda/CublasHandlePool.cpp,
# parseChosenWorkspaceSize: ':4096:8' / ':4096:2:16:8'; cuBLASLt shares it unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=0). Handles are per thread, so a lane stream holds two: the
# forward's (the issuing thread) and the backward's (autograd's thread for the device). Priced at
# Hopper's figure on every GPU.
CUBLAS_WORKSPACE = 32 * 2**20
# The caching allocator keeps each stream's blocks apart (a block freed on one stream is not
# reused by another): a stream that allocates holds up to one partly used small segment (2 MiB)
# and one large one (20 MiB) of its own (c10/cuda/CUDACachingAllocator.cpp: kSmallBuffer,
# kLargeBuffer).
STREAM_POOL = (2 + 20) * 2**20
# NCCL's buffers per rank of a communicator: rings and trees, 688 MB per GPU in a group of more
# than 2 GPUs (544 MB for 2) on 4 x A100 over NVLink, after one all-reduce
# (https://github.com/NVIDIA/nccl/issues/964); the channels, and so this figure, scale with the
# bandwidth NCCL aims for (https://github.com/NVIDIA/nccl/issues/986). Per send/recv peer: 8 x H100
# went from 1.06 GB to 4.34 GB per GPU with the first all-to-all (32 channels per pair, PyTorch's
# memory excluded; https://github.com/NVIDIA/nccl/issues/1685): 470 MB for each of its 7 peers.
# NVLS (NVLink SHARP, on by default on NVSwitch boxes): that box's 1.06 GB before any send/recv less
# the rings' 688 MB, taken as NVLS's (an estimate: no figure of its own was found), priced on every
# NCCL group of two or more GPUs unless NCCL_NVLS_ENABLE=0. NCCL_BUFFSIZE and the channel settings
# change all three; they are not read.
NCCL_COMM = 688 * 10**6
NCCL_PEER = 470 * 10**6
NCCL_NVLS = 1060 * 10**6 - NCCL_COMM


def price_runtime(device: torch.device, *, home: bool, communicator: str = "", world: int = 1, processes: int = 1,
                  overlap: bool = False, detail: dict | None = None) -> int:
    """Bytes the accelerator runtime allocates on ``device`` for one lane beside its tensors (the
    constants above; 0 on every device type but cuda), times MARGIN:

    * ``cublas``: :data:`CUBLAS_WORKSPACE` per (handle, stream) the lane adds: a mirror's lane stream
      two (forward and backward threads), home one (its backward's: the forward's handle on the
      current stream exists from the tuner's own work);
    * ``stream_pools``: :data:`STREAM_POOL` per stream of its own that allocates: a mirror's lane
      stream, and with ``overlap`` the lane's communication stream;
    * ``nccl``: ``communicator`` (the plan's, over ``world`` lanes) an NCCL kind: :data:`NCCL_COMM`
      (+ :data:`NCCL_NVLS`) on every lane, and with CuPy's (whose canonical order sends to every
      other lane) :data:`NCCL_PEER` for each of the world - 1 peers (``torch.cuda.nccl`` has no
      send/recv); across ``processes`` (torchrun, ProcessGroupNCCL on lane 0's GPU), one more
      communicator on home with processes - 1 peers.
    """
    parts = {"cublas": 0, "stream_pools": 0, "nccl": 0}
    if torch.device(device).type == "cuda":
        nvls = 0 if os.environ.get("NCCL_NVLS_ENABLE", "").strip() == "0" else NCCL_NVLS
        parts["cublas"] = CUBLAS_WORKSPACE * (1 if home else 2)
        parts["stream_pools"] = STREAM_POOL * ((0 if home else 1) + (1 if overlap else 0))
        kind = COMMUNICATORS.get(communicator)
        if kind is not None and kind.nccl and world > 1:
            peers = world - 1 if kind.sends_to_peers else 0
            parts["nccl"] += NCCL_COMM + nvls + peers * NCCL_PEER
        if processes > 1 and home:
            parts["nccl"] += NCCL_COMM + nvls + (processes - 1) * NCCL_PEER
    if detail is not None:
        detail.update(parts)
    return int(sum(parts.values()) * MARGIN)


@dataclass(eq=False)
class BlockPrice:
    """One block's lane prices for the plan, which evaluates them for the world it decides: a mirror's
    (:func:`price_mirror`), home's (:func:`price_home`) and, on accelerator lanes, the runtime's
    (:func:`price_runtime`). The tuning adapters give one; callers with a flat price per mirror give
    ``PlanRequest.mirror_bytes`` instead (home is then not checked)."""

    block: torch.nn.Module
    inputs: Sequence[torch.Tensor]
    samples_per_iter: int
    compute_dtype: torch.dtype | None = None
    bucket_cap_elems: BucketCap = 2**22

    def mirror(self, world: int | None = None, detail: dict | None = None) -> int:
        return price_mirror(self.block, self.inputs, self.samples_per_iter, world,
                            bucket_cap_elems=self.bucket_cap_elems, compute_dtype=self.compute_dtype, detail=detail)

    def home(self, world: int | None = None, *, processes: int = 1, lanes_elsewhere: int = 0,
             detail: dict | None = None) -> int:
        return price_home(self.block, self.inputs, self.samples_per_iter, world, processes=processes,
                          lanes_elsewhere=lanes_elsewhere, bucket_cap_elems=self.bucket_cap_elems,
                          compute_dtype=self.compute_dtype, detail=detail)


def _home(request: PlanRequest) -> torch.device:
    home = torch.device(request.home) if request.home is not None else torch.device(default_accelerator_type())
    if home.type != "cpu" and home.index is None:
        home = torch.device(home.type, 0)
    if home.type == "cpu" and home.index == 0:
        home = torch.device("cpu")
    return home


def default_devices(world: int | str, home: torch.device, samples_per_iter: int) -> list[torch.device]:
    """The lanes when none were given: every visible device of home's type (home first); on the CPU,
    as many lanes sharing it as asked, but never more than get a sample (an absurd world is refused
    for its samples, not by building its list)."""
    if home.type == "cpu" or home.type not in SUPPORTED_HOME_TYPES:
        return [home] * (1 if world == "auto" else min(int(world), max(1, samples_per_iter)))
    be = backend(home)
    devices = [torch.device(home.type, i) for i in range(be.device_count())] or [home]
    devices.sort(key=lambda d: d != home)  # lane 0 is home: the block itself
    return devices if world == "auto" else devices[: int(world)]


def _lane_prices(devices: list[torch.device], request: PlanRequest, home: torch.device, explicit: bool,
                 choices: _Choices):
    """The bytes each lane needs (None: not checked), lazily, lane by lane: with ``request.price`` home's
    and each mirror's at the planned world (``explicit``; under 'auto' at world 2, the largest share a
    kept mirror gets) plus the runtime's on accelerator lanes; else ``mirror_bytes`` per mirror."""
    price, n = request.price, len(devices)
    if price is None:
        for k, dev in enumerate(devices):
            yield None if k == 0 and dev == home else request.mirror_bytes
        return
    world = n if explicit else 2
    try:
        communicator = choices.communicator(devices)[0] if n > 1 else "local"
    except Exception:  # (the plan's own choice reports it)
        communicator = ""
    elsewhere = sum(d != home for d in devices[1:])
    overlap = choices.overlap(devices)[0] if n > 1 else False
    if overlap:  # the overlapped exchange's buckets (dpq.engine.exchange.bucket_cap): scratch for the largest
        price = replace(price, bucket_cap_elems=Buckets.SHARE)
    for k, dev in enumerate(devices):
        is_home = k == 0 and dev == home
        block = (price.home(world, processes=request.processes, lanes_elsewhere=elsewhere) if is_home
                 else price.mirror(world))
        yield block + price_runtime(dev, home=is_home, communicator=communicator, world=n,
                                    processes=request.processes, overlap=overlap)


def _memory_refusals(devices: list[torch.device], request: PlanRequest, home: torch.device,
                     explicit: bool, choices: _Choices, lane_bytes: list[int]) -> list[tuple[int, str]]:
    """(lane, reason) for each lane whose price does not fit (:func:`_lane_prices`; appended to
    ``lane_bytes``); lanes sharing a device add up.

    Under 'auto' (not ``explicit``: the lanes from the first that does not fit on are dropped) stop
    there, so that no device the run will not use is queried (a free-memory query makes a CUDA
    context, several hundred MB, on a device that had none)."""
    out, used = [], {}
    for k, (dev, need) in enumerate(zip(devices, _lane_prices(devices, request, home, explicit, choices), strict=True)):
        if need is None:
            continue  # home with a flat mirror price: it already holds the block
        lane_bytes.append(need)
        used[dev] = used.get(dev, 0) + need
        free = backend(dev).mem_get_info(dev)[0]
        if used[dev] > free:
            out.append((k, refusals.lane_does_not_fit(k, str(dev), need, MARGIN, free, home=k == 0)))
            if not explicit:
                break
    return out


def resolve(request: PlanRequest) -> Plan:
    """The plan for one block. An explicit world raises :class:`PlanRefused` with every reason
    found: nothing found stops the search for the next (a missing device does not hide the
    device count, the device count does not hide the samples per iteration). ``auto`` keeps the
    lanes that can be served and puts every reason a lane was dropped for in ``Plan.reasons``."""
    world = validate_world(request.world, request.caller)
    home = _home(request)
    choices = _Choices(request)
    if world == "off":
        return _finish(Plan([home], [refusals.PARALLEL_OFF]), request, choices)
    reasons = list(request.extra_reasons)
    notes: list[str] = []
    if home.type not in SUPPORTED_HOME_TYPES:
        reasons.append(refusals.unsupported_home(home.type))
    given = request.devices is not None
    entries = parse_device_spec(request.devices, request.caller) if given else \
        [DeviceEntry(str(d), d) for d in default_devices(world, home, request.samples_per_iter)]
    if world != "auto" and len(entries) > world and given:
        unused = [e.raw for e in entries[world:]]
        notes.append(refusals.unused_devices(world, len(entries), unused, request.caller))
    listed = entries if world == "auto" else entries[:world]
    problems: dict = {}
    lane_problems = [(k, p) for k, e in enumerate(listed) if (p := entry_problem(k, e, home, problems,
                                                                                   request.caller))]
    reasons += [p for _, p in lane_problems]
    reasons += [e.error for e in entries[len(listed):] if e.error]  # malformed anywhere is said too
    bad = {k for k, _ in lane_problems}
    devices = [e.device for k, e in enumerate(listed) if k not in bad]
    named = [e.raw.strip() for e in entries if e.raw.strip()]
    cpu_default = not given and (home.type == "cpu" or home.type not in SUPPORTED_HOME_TYPES)
    if world != "auto" and len(named) < world and not cpu_default:  # (default CPU lanes: as many as get a sample)
        reasons.append(refusals.too_few_devices(world, named, given, request.caller))
    n = world if world != "auto" else len(devices)
    if n > request.samples_per_iter:
        reasons.append(refusals.too_few_samples(n, request.samples_per_iter, request.pool_samples or 0,
                                                request.caller, asked=request.asked_samples or 0))
    n = min(n, len(devices), max(1, request.samples_per_iter))
    if home.type == "hpu" and n > 1:
        reasons.append(refusals.HPU_MULTI_LANE)
        n = 1
    lane0_ok = bool(devices) and devices[0] == home
    lane_bytes: list[int] = []
    mem = _memory_refusals(devices[:n], request, home, world != "auto", choices, lane_bytes)
    reasons += [r for _, r in mem]
    reasons = list(dict.fromkeys(reasons))  # the same sentence once (e.g. '0,0' on a machine without GPUs)
    if world != "auto":
        if reasons:
            raise PlanRefused(reasons)
        return _finish(Plan(devices[:n], notes=notes, lane_bytes=lane_bytes), request, choices)
    # auto: keep the lanes before the first one that does not fit; serial when a feature forbids it
    if mem:
        n = min(n, mem[0][0])
    if request.extra_reasons or home.type not in SUPPORTED_HOME_TYPES or n <= 1 or not lane0_ok:
        return _finish(Plan([home], reasons or [refusals.ONE_LANE], notes), request, choices)
    return _finish(Plan(devices[:n], reasons, notes, lane_bytes=lane_bytes[:n]), request, choices)
