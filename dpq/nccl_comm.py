"""The in-process NCCL communicators (CuPy and ``torch.cuda.nccl``) and their lifecycle.

The :class:`Communicator` protocol and the contract every communicator keeps (bitwise
identical results on every lane, ring wire bytes, world-1 shortcuts) are in
:mod:`dpq.comm.comm_base` (:class:`CommunicatorBase`); re-exported here.

NCCL communicators here use one process driving several GPUs: communicators from
``ncclCommInitAll`` and every rank's calls inside one ``groupStart/groupEnd``, which is the
only way a single thread can issue a collective to several ranks without deadlocking
(a lone rank's call would wait for its peers, which are never issued). One group per
collective, except CuPy's canonical all_reduce: two groups (send/recv to the chunks'
owners, then back), the owners' ordered sums queued between them on their streams.

Canonical order (contract 3): the CuPy communicator sums with send/recv to each chunk's
owner and a fold in rank order, so its bits are the local communicator's;
``torch.cuda.nccl`` has no send/recv, so :class:`TorchNcclCommunicator` keeps NCCL's own
order and says so (``canonical_order = False``, ``order_note``).

NCCL lifecycle (kept in :mod:`dpq.comm.nccl_lifecycle`, re-exported here):

* **One communicator set per device tuple per run.** ``ncclCommInitAll`` costs seconds on
  8 GPUs, so the NCCL handles are an :class:`NcclCommSet` cached by (kind, device ids)
  (:func:`shared_comm_set`) and reused by every block. The :class:`Communicator` objects
  over them are cheap wrappers built per block around that block's lanes: the handles
  depend only on the devices, the streams are read from the lanes at every call.
  :func:`close_communicators` destroys every cached set (``dpq`` calls it at ``disable()``).
* **The group always closes.** ``groupEnd()`` runs in a ``finally``: a group left open
  would swallow the next NCCL call of this thread (torch's too) and hang it.
* **An NCCL error aborts.** Ranks already issued wait on the GPU for peers that never
  come; ``ncclCommAbort`` (``comm.abort()`` in CuPy) ends them. The set is then marked
  aborted: any later use raises :class:`NcclAborted` naming the failed collective, and
  ``select_communicator`` picks device copies for those GPUs for the rest of the run.
* **No wait blocks forever.** The iteration's readback polls its events against
  ``--parallel_timeout`` (R8 of ``dpq.streams``), calling :meth:`CupyNcclCommunicator.check_async_error`
  meanwhile; on expiry or an asynchronous error the engine aborts the set
  (:meth:`CupyNcclCommunicator.abort` ends the queued kernels; torch.cuda.nccl's cannot be ended,
  :meth:`TorchNcclCommunicator.abort` says so).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from dpq.comm.comm_base import CommunicatorBase, chunk_bounds, ordered_sum
from dpq.comm.nccl_lifecycle import (
    NcclCommSet,
    NcclInitFailed,
    fail_group,
    shared_comm_set,
)
from dpq.streams import Lane

__all__ = [
    "CupyNcclCommunicator",
    "TorchNcclCommunicator",
    "cupy_nccl_available",
    "cupy_nccl_version",
    "distinct_cuda_ids",
    "multi_rank_gpu_enabled",
    "torch_nccl_available",
]

_DUPLICATE_GPU = (
    "NCCL takes one GPU per rank: ncclCommInitAll with two ranks on one GPU fails with ncclInvalidUsage "
    "('Duplicate GPU detected'; older releases report ncclInternalError), and NCCL >= 2.30 allows it only "
    "with NCCL_MULTI_RANK_GPU_ENABLE=1 (meant for testing: the ranks time-share the GPU). "
    "Use the local communicator for lanes that share a device"
)
MULTI_RANK_GPU_MIN_VERSION = (2, 30, 0)


def distinct_cuda_ids(lanes: Sequence[Lane], allow_shared: bool = False) -> list[int]:
    """The CUDA device index of every lane; refuses non-CUDA lanes, and shared GPUs unless
    ``allow_shared`` (NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``), before any NCCL call."""
    ids = []
    for lane in lanes:
        if lane.device.type != "cuda":
            raise ValueError(f"dpq: NCCL needs CUDA lanes; lane {lane.index} is on {lane.device}")
        ids.append(0 if lane.device.index is None else lane.device.index)
    if len(set(ids)) != len(ids) and not allow_shared:
        raise ValueError(f"dpq: lanes on cuda devices {ids} share a GPU: {_DUPLICATE_GPU}")
    return ids


def multi_rank_gpu_enabled(version: Sequence[int] | None) -> bool:
    """True when NCCL at ``version`` lets several ranks of one communicator share a GPU:
    NCCL >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` in the environment (read by NCCL at init)."""
    return (
        version is not None
        and tuple(version) >= MULTI_RANK_GPU_MIN_VERSION
        and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0").strip() == "1"
    )


# -- CuPy --------------------------------------------------------------------------------

NATIVE_ORDER_NOTE = (
    "--parallel_order native: NCCL's own reduce-scatter sums (ring or tree, by topology and lane count), so "
    "every lane gets the same bits but they can differ in the last bits from the canonical order's (torchrun "
    "2x1 == 1x2 no longer holds bitwise at 3+ lanes)"
)


@contextlib.contextmanager
def allocator_free_mutex() -> Iterator[None]:
    """The CUDA caching allocator's free mutex, held across one NCCL group launch.

    torch's allocator holds it around every ``cudaFree`` ("lock around calls to cudaFree (to
    prevent deadlocks with NCCL)", c10's CUDACachingAllocator / ``c10::cuda::getFreeMutex``) and
    torch's own NCCL groups take it (``torch::cuda::nccl::AutoNcclGroup``): a ``cudaFree`` on
    another thread (an out-of-memory retry of autograd's device threads during an overlapped
    backward, ``empty_cache``) synchronizes the device while a group's kernels are half launched,
    NCCL's documented deadlock ("Using multiple NCCL communicators concurrently",
    https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/communicators.html). torch
    exposes it as ``torch._C._cuda_lock_mutex`` / ``_cuda_unlock_mutex`` (CUDA builds; the lock
    waits with the GIL released); without them (CPU builds, the fakes) there is nothing to hold."""
    lock, unlock = getattr(torch._C, "_cuda_lock_mutex", None), getattr(torch._C, "_cuda_unlock_mutex", None)
    if lock is None or unlock is None:
        yield
        return
    lock()
    try:
        yield
    finally:
        unlock()



def _sizes(bounds: Sequence[int]) -> list[int]:
    return [hi - lo for lo, hi in itertools.pairwise(bounds)]


def _import_cupy_nccl():
    try:
        from cupy.cuda import nccl
    except Exception as e:  # cupy raises more than ImportError when CUDA libraries are missing
        raise RuntimeError(
            f"dpq: the cupy-nccl communicator needs CuPy with NCCL ({type(e).__name__}: {e}); "
            "install it with `pip install auto-round-dp[cuda12]` (or auto-round-dp[cuda13]), or use torch-nccl / "
            "p2p / host"
        ) from e
    if not getattr(nccl, "available", True):
        raise RuntimeError(
            "dpq: CuPy is installed but cannot load NCCL; install it with `pip install auto-round-dp[cuda12]` "
            "(or auto-round-dp[cuda13]), or use torch-nccl / p2p / host"
        )
    return nccl


def cupy_nccl_available() -> bool:
    """True when ``cupy.cuda.nccl`` imports and has found the NCCL library."""
    try:
        _import_cupy_nccl()
    except RuntimeError:
        return False
    return True


def cupy_nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version CuPy loaded, (major, minor, patch); None if unknown or CuPy is absent.

    ``cupy.cuda.nccl.get_version()`` returns NCCL's version code: major*10000 + minor*100 +
    patch since NCCL 2.9 (major*1000 + minor*100 + patch before)."""
    try:
        code = int(_import_cupy_nccl().get_version())
    except Exception:
        return None
    if code <= 0:
        return None
    if code < 20900:  # the old encoding (2.8.4 -> 2804)
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


def _cupy_comm_set(device_ids: list[int], nccl) -> NcclCommSet:
    return shared_comm_set("cupy-nccl", device_ids, nccl, lambda: nccl.NcclCommunicator.initAll(list(device_ids)))


class CupyNcclCommunicator(CommunicatorBase):
    """NCCL through CuPy: ``NcclCommunicator.initAll(device_ids)``, one comm per lane (rank = lane index).

    ``shared=True`` (what ``select_communicator`` uses) takes the run's cached handles for
    these devices (:func:`shared_comm_set`): ``initAll`` runs once per device tuple per run,
    ``close()`` only detaches, and :func:`close_communicators` destroys. ``shared=False``
    (the default) owns a fresh set: ``close()`` destroys it.

    Every NCCL exchange is one ``groupStart()``, each rank's calls on its lane's stream, one
    ``groupEnd()`` in a ``finally``; arguments are built before ``groupStart``. If a call
    (or ``groupEnd``) raises, the group is still closed, every rank's handle is aborted and
    :class:`NcclCollectiveError` names the collective; later use raises :class:`NcclAborted`.

    Canonical order (contract 3), so the bits equal the CPU-tested local communicator's:
    sums do not use NCCL's reductions (ring or tree: their order depends on the topology).
    reduce_scatter and reduce are one group of ``send``/``recv`` to each chunk's owner, then
    the owner's fold in rank order on its own stream (:meth:`_to_owners`); all_reduce is
    that over W chunks differing by at most one element, then a second group of
    ``send``/``recv`` from each owner to every rank (an all-gather: no padding needed). Wire
    bytes are a ring reduce-scatter's and all-gather's: each rank sends every chunk but its
    own once. all_gather (``allGather``) and broadcast move exact copies. Staging: (W-1)
    received parts of the own chunk per rank, allocated for the lane's stream.
    **Not run on hardware**: the send/recv sequence and the sums are tested on CPU through a
    recording fake of ``cupy.cuda.nccl`` that performs the transfers
    (``dpqlab/fake_cupy_nccl.py``); no multi-GPU machine was available.

    Two ranks on one GPU are refused before any NCCL call unless NCCL >= 2.30 runs with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (``allow_shared_gpu=None`` checks exactly that).
    """

    name = "cupy-nccl"
    nccl, sends_to_peers, shares_handles = True, True, True  # its canonical order sends to every other lane
    orders = ("canonical", "native")
    setup_failure = (NcclInitFailed,)
    priority = 0  # the plan's first choice for distinct GPUs where CuPy's NCCL imports
    chosen_because = "{world} distinct GPUs: NCCL through CuPy (one group call per collective)"

    @classmethod
    def available(cls) -> bool:
        return cupy_nccl_available()

    def __init__(self, lanes: Sequence[Lane], *, shared: bool = False, allow_shared_gpu: bool | None = None,
                 order: str = "canonical") -> None:
        super().__init__(lanes)
        self._set_order(order)
        if allow_shared_gpu is None:
            cuda = [lane.device.index or 0 for lane in self.lanes if lane.device.type == "cuda"]
            allow_shared_gpu = len(set(cuda)) < len(cuda) and multi_rank_gpu_enabled(cupy_nccl_version())
        device_ids = distinct_cuda_ids(self.lanes, allow_shared=allow_shared_gpu)  # before any NCCL call
        self._nccl = _import_cupy_nccl()
        self.shared = shared
        if shared:
            self._set: NcclCommSet | None = _cupy_comm_set(device_ids, self._nccl)
            self._set.check_usable()
        else:
            comms = self._nccl.NcclCommunicator.initAll(list(device_ids))
            self._set = NcclCommSet(self.name, device_ids, comms, self._nccl)

    def _set_order(self, order: str) -> None:
        """Note [native order]: ``order="native"`` hands the sums to NCCL's own reduceScatter / allReduce /
        reduce (one NCCL kernel per rank, no staging, no fold kernels): every rank still gets the same bits
        (replicas stay identical), but which bits depends on NCCL's algorithm (ring or tree), its channels
        and the lane count, not on the world alone (contract 3 is given up: ``canonical_order`` False)."""
        if order not in self.orders:
            raise ValueError(f"dpq: order {order!r} is not one of {', '.join(self.orders)}")
        self.order = order
        self.canonical_order = order == "canonical"
        if order == "native":
            self.order_note = NATIVE_ORDER_NOTE

    @property
    def comm_set(self) -> NcclCommSet | None:
        """The NCCL handles this communicator issues on (None after ``close()``)."""
        return self._set

    def close(self) -> None:
        """Owned handles: destroy them. Shared ones: detach (``close_communicators`` destroys)."""
        if self._set is not None and not self.shared:
            self._set.destroy()
        self._set = None

    def check_async_error(self) -> None:
        """Each rank's ``check_async_error()`` (``ncclCommGetAsyncError``; CuPy raises ``NcclError``
        for a failed state): on an error every handle is aborted and :class:`NcclCollectiveError` raised."""
        if self._set is None or self._set.state != "open":
            return
        for rank, comm in enumerate(self._set.comms):
            try:
                comm.check_async_error()
            except Exception as e:
                fail_group(self._set, f"queued work (asynchronous error reported by rank {rank})", e)

    def abort(self, reason: str) -> bool:
        """``ncclCommAbort`` on every rank (ends their queued kernels); the devices stay off NCCL for the run."""
        if self._set is None:
            return False
        self._set.abort(reason)
        return True

    def _dtype(self, dtype: torch.dtype) -> int:
        name = {torch.float32: "NCCL_FLOAT32", torch.bfloat16: "NCCL_BFLOAT16", torch.uint8: "NCCL_UINT8"}[dtype]
        if not hasattr(self._nccl, name):
            raise TypeError(f"dpq: this CuPy's NCCL binding has no {name}; upgrade cupy for {dtype} collectives")
        return getattr(self._nccl, name)

    def _grouped(self, what: str, calls_per_rank: Sequence[Sequence[tuple[str, tuple]]]) -> None:
        """One NCCL group: rank k's calls ``(method, args)``, in order, on lane k's stream, rank by rank."""
        if self._set is None:
            raise RuntimeError("dpq: cupy-nccl communicator used after close()")
        self._set.check_usable()
        bound = [[(getattr(comm, m), m, args) for m, args in calls]
                 for comm, calls in zip(self._set.comms, calls_per_rank, strict=True)]
        error: BaseException | None = None
        where = what
        # Nothing between groupStart and groupEnd allocates (staging is made before): the allocator
        # would wait for the free mutex this thread holds.
        with allocator_free_mutex():
            try:
                self._nccl.groupStart()
            except BaseException as e:
                error, where = e, f"groupStart before {what}"
            else:
                try:
                    for k, (calls, lane) in enumerate(zip(bound, self.lanes, strict=True)):
                        with lane.issue():
                            for call, method, args in calls:
                                where = f"{'' if method == what else what + ': '}{method} (rank {k} of {self.world})"
                                call(*args)
                except BaseException as e:
                    error = e
                finally:
                    try:  # always close the group: an open one would swallow this thread's next NCCL call
                        self._nccl.groupEnd()
                    except BaseException as e:
                        if error is None:
                            error, where = e, f"groupEnd after {what}"
        if error is not None:
            fail_group(self._set, where, error)

    def _collective(self, method: str, args_per_rank: Sequence[tuple]) -> None:
        self._grouped(method, [[(method, args)] for args in args_per_rank])

    def _stream(self, k: int) -> int:
        return self.lanes[k].stream_handle

    def _sendrecv(self, k: int, dt: int, sends: list[tuple], recvs: list[tuple]) -> list[tuple[str, tuple]]:
        """Rank k's calls for messages ``(ptr, count, peer)``; empty ones are skipped (by both ends:
        the counts come from the same bounds)."""
        stream = self._stream(k)
        return [(m, (ptr, count, dt, peer, stream))
                for m, msgs in (("send", sends), ("recv", recvs)) for ptr, count, peer in msgs if count]

    def _to_owners(self, what: str, bufs: Sequence[Tensor], bounds: Sequence[int], outs: Sequence[Tensor]) -> None:
        """Canonical reduce-scatter over the chunks ``[bounds[c], bounds[c + 1])`` (rank c owns chunk c).

        One group: rank k sends chunk j of ``bufs[k]`` to rank j and receives every other rank's
        part of chunk k into a staging buffer (allocated for lane k's stream, where NCCL writes it
        and the sum reads it). Then, on lane k's stream, ``outs[k]`` = the fold over ranks in rank
        order (:func:`dpq.comm.comm_base.ordered_sum`), its own part read in place.
        """
        dtype, world, isz, size = bufs[0].dtype, self.world, bufs[0].element_size(), _sizes(bounds)
        staging, calls = [], []
        for k, lane in enumerate(self.lanes):
            with lane.issue():
                staging.append(torch.empty(world - 1, size[k], dtype=dtype, device=bufs[k].device))
            peers = [j for j in range(world) if j != k]
            sends = [(bufs[k].data_ptr() + bounds[j] * isz, size[j], j) for j in peers]
            recvs = [(row.data_ptr(), size[k], j) for row, j in zip(staging[k], peers, strict=True)]
            calls.append(self._sendrecv(k, self._dtype(dtype), sends, recvs))
        self._grouped(what, calls)
        for k, lane in enumerate(self.lanes):
            parts = [*staging[k][:k], bufs[k][bounds[k] : bounds[k + 1]], *staging[k][k:]]  # rank order
            with lane.issue():
                ordered_sum(parts, outs[k])

    def _native(self, method: str, send: Sequence[Tensor], recv: Sequence[Tensor], count: int, *extra) -> None:
        """NCCL's own reduction (Note [native order]): ``method(send, recv, count, dtype, SUM, *extra, stream)``."""
        dt = self._dtype(send[0].dtype)
        self._collective(method, [(send[k].data_ptr(), recv[k].data_ptr(), count, dt, self._nccl.NCCL_SUM, *extra,
                                   self._stream(k)) for k in range(self.world)])

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        if self.order == "native":
            return self._native("allReduce", bufs, bufs, bufs[0].numel())
        self._canonical_all_reduce(bufs)

    def _canonical_all_reduce(self, bufs: Sequence[Tensor]) -> None:
        """Canonical: the owners' sums (:meth:`_to_owners`), then each owner's chunk to every rank
        (a second group of send/recv: an all-gather of chunks that differ by one element, so no padding)."""
        b, world, isz = chunk_bounds(bufs[0].numel(), self.world), self.world, bufs[0].element_size()
        self._to_owners("all_reduce (to owners)", bufs, b, [x[b[k] : b[k + 1]] for k, x in enumerate(bufs)])
        dt, size, calls = self._dtype(bufs[0].dtype), _sizes(b), []
        for k in range(world):
            ptr, peers = bufs[k].data_ptr(), [j for j in range(world) if j != k]
            calls.append(self._sendrecv(k, dt, [(ptr + b[k] * isz, size[k], j) for j in peers],
                                        [(ptr + b[j] * isz, size[j], j) for j in peers]))
        self._grouped("all_reduce (from owners)", calls)

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        n = recv[0].numel()
        if self.order == "native":
            return self._native("reduceScatter", send, recv, n)
        self._to_owners("reduce_scatter", send, [c * n for c in range(self.world + 1)], recv)

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        dt, n = self._dtype(send[0].dtype), send[0].numel()
        args = [(send[k].data_ptr(), recv[k].data_ptr(), n, dt, self._stream(k)) for k in range(self.world)]
        self._collective("allGather", args)

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        dt, n = self._dtype(bufs[0].dtype), bufs[0].numel()
        ptrs = [b.data_ptr() for b in bufs]
        self._collective("broadcast", [(ptrs[k], ptrs[k], n, dt, root, self._stream(k)) for k in range(self.world)])

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        if self.order == "native":
            return self._native("reduce", bufs, bufs, bufs[0].numel(), root)
        # the root owns the whole buffer, every other rank an empty chunk
        n, world = bufs[0].numel(), self.world
        b = [0] * (root + 1) + [n] * (world - root)
        self._to_owners("reduce (to root)", bufs, b, [x[b[k] : b[k + 1]] for k, x in enumerate(bufs)])


# -- torch.cuda.nccl ---------------------------------------------------------------------


def torch_nccl_available() -> bool:
    """True when this torch build carries NCCL (``torch.cuda.nccl``) and CUDA is usable.

    ``torch.cuda.nccl.is_available(tensors)`` also checks that the tensors are dense,
    contiguous and on distinct GPUs; the communicator's own checks and
    :func:`distinct_cuda_ids` already guarantee that, so the build check is what is left.
    """
    if not torch.cuda.is_available():
        return False
    import torch.cuda.nccl as tnccl

    return bool(tnccl.is_available([]))


class TorchNcclCommunicator(CommunicatorBase):
    """NCCL through ``torch.cuda.nccl`` (used where CuPy is absent).

    torch issues every rank's call inside one NCCL group itself (its C++ ``AutoNcclGroup``
    closes the group on error too) and keeps its own communicators per device list, made
    once and kept until the process exits: one per device tuple per run already, and
    nothing for dpq to create or destroy. torch has no Python API to abort them, so after
    an NCCL error dpq marks its :class:`NcclCommSet` for these devices aborted (later use
    raises :class:`NcclAborted`, and ``select_communicator`` picks device copies instead).
    ``shared=True`` (what ``select_communicator`` uses) shares that state with every
    communicator over these devices in this run; ``shared=False`` keeps it to this object.
    torch refuses two ranks on one GPU itself, whatever NCCL allows.
    """

    name = "torch-nccl"
    priority = 1  # after CuPy's (the plan's choice: dpq.comm.communicators.choose_communicator)
    chosen_because = "{world} distinct GPUs, CuPy absent (pip install auto-round-dp[cuda12]): torch.cuda.nccl"

    @classmethod
    def available(cls) -> bool:
        return torch_nccl_available()
    nccl, shares_handles = True, True  # no send/recv: no peer buffers
    setup_failure = (NcclInitFailed,)
    canonical_order = False
    order_note = (
        "torch.cuda.nccl has no send/recv, so its sums use NCCL's own reduction order (ring or tree, by "
        "topology): results are identical on every lane but can differ in the last bits from the local, "
        "host, p2p, cupy-nccl and process-group communicators at 3+ lanes (2 lanes agree: one add "
        "commutes); install CuPy (pip install auto-round-dp[cuda12]) for the canonical order"
    )

    def __init__(self, lanes: Sequence[Lane], *, shared: bool = False) -> None:
        super().__init__(lanes)
        device_ids = distinct_cuda_ids(self.lanes)  # before any NCCL call
        if not torch_nccl_available():
            raise RuntimeError("dpq: torch-nccl needs a torch build with CUDA and NCCL; use p2p or host")
        import torch.cuda.nccl as tnccl

        self._nccl = tnccl
        self.shared = shared
        self._set = (
            shared_comm_set(self.name, device_ids, tnccl, list)
            if shared
            else NcclCommSet(self.name, device_ids, [], tnccl)
        )
        self._set.check_usable()

    @property
    def comm_set(self) -> NcclCommSet:
        return self._set

    def abort(self, reason: str) -> bool:
        """torch.cuda.nccl has no abort: the devices are only marked off NCCL; queued kernels stay (False)."""
        self._set.abort(reason)
        return False

    @property
    def _streams(self) -> list:
        return [lane.stream for lane in self.lanes]

    def _call(self, op: str, *args, **kwargs) -> None:
        self._set.check_usable()
        try:
            getattr(self._nccl, op)(*args, streams=self._streams, **kwargs)
        except BaseException as e:
            fail_group(self._set, f"torch.cuda.nccl.{op}", e)

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        self._call("all_reduce", list(bufs))

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self._call("reduce_scatter", list(send), list(recv))

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        self._call("all_gather", list(send), list(recv))

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        self._call("broadcast", list(bufs), root=root)

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        self._call("reduce", list(bufs), output=bufs[root], root=root)
