"""The in-process NCCL communicators (CuPy and ``torch.cuda.nccl``) and their lifecycle.

The :class:`Communicator` protocol and the contract every communicator keeps (bitwise
identical results on every lane, ring wire bytes, world-1 shortcuts) are in
:mod:`dpq.comm_base` (:class:`CommunicatorBase`); re-exported here.

NCCL communicators here use one process driving several GPUs: communicators from
``ncclCommInitAll`` and every rank's call inside one ``groupStart/groupEnd``, which is the
only way a single thread can issue a collective to several ranks without deadlocking
(a lone rank's call would wait for its peers, which are never issued).

NCCL lifecycle (kept here):

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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dpq.comm_base import SUPPORTED_DTYPES, Communicator, CommunicatorBase, ring_wire_bytes
from dpq.streams import Lane

__all__ = [
    "SUPPORTED_DTYPES",
    "Communicator",
    "CommunicatorBase",
    "CupyNcclCommunicator",
    "NcclAborted",
    "NcclCollectiveError",
    "NcclCommSet",
    "TorchNcclCommunicator",
    "close_communicators",
    "cupy_nccl_available",
    "cupy_nccl_version",
    "distinct_cuda_ids",
    "multi_rank_gpu_enabled",
    "ring_wire_bytes",
    "shared_comm_set",
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


# -- the lifecycle: one set of NCCL handles per device tuple per run -----------------------


class NcclCollectiveError(RuntimeError):
    """An NCCL call failed; the group was closed and the communicators of its devices aborted."""


class NcclAborted(RuntimeError):
    """A communicator whose NCCL handles were aborted (after an earlier error) was used again."""


class NcclCommSet:
    """The NCCL handles of one device tuple: ``comms[k]`` is rank k's (a CuPy ``NcclCommunicator``;
    empty for torch-nccl, whose communicators torch caches per device list itself).

    States: open -> aborted (an NCCL error: ``abort()`` on every handle) or closed (``destroy()``).
    ``library`` is the module the handles came from: a cached set is reused only with the same one.
    """

    def __init__(self, kind: str, device_ids: Sequence[int], comms: Sequence[object], library: object) -> None:
        self.kind = kind
        self.device_ids = tuple(device_ids)
        self.comms = list(comms)
        self.library = library
        self.state = "open"
        self.failure = ""  # what failed, for the refusal of later use

    def where(self) -> str:
        return f"{self.kind} communicators for cuda devices {list(self.device_ids)}"

    def check_usable(self) -> None:
        if self.state == "aborted":
            raise NcclAborted(
                f"dpq: the {self.where()} were aborted after {self.failure}; they cannot be used again. "
                "select_communicator picks device copies (p2p/host) for these GPUs for the rest of this run; "
                "dpq.fallback_p2p.close_communicators() (called by disable()) forgets them"
            )
        if self.state == "closed":
            raise RuntimeError(f"dpq: the {self.where()} were destroyed by close_communicators()")

    def abort(self, failure: str) -> list[str]:
        """``abort()`` every handle (ends queued work waiting for peers); returns the aborts' own errors."""
        problems = []
        if self.state == "open":
            for rank, comm in enumerate(self.comms):
                try:
                    comm.abort()
                except Exception as e:  # keep aborting the others; the caller reports these
                    problems.append(f"rank {rank}: {type(e).__name__}: {e}")
        self.state, self.failure = "aborted", failure
        return problems

    def destroy(self) -> None:
        if self.state == "open":
            for comm in self.comms:
                comm.destroy()
        self.state = "closed"
        self.comms = []


_SETS: dict[tuple[str, tuple[int, ...]], NcclCommSet] = {}


def shared_comm_set(
    kind: str, device_ids: Sequence[int], library: object, create: Callable[[], Sequence[object]]
) -> NcclCommSet:
    """The cached set for (kind, device_ids), made by ``create()`` on first use.

    An aborted set stays cached (its devices stay off NCCL) until :func:`close_communicators`;
    a set made with another ``library`` object (a test's fake, a reloaded module) is
    forgotten, not destroyed, and a new one is made.
    """
    key = (kind, tuple(device_ids))
    cached = _SETS.get(key)
    if cached is not None and cached.library is library:
        return cached
    made = NcclCommSet(kind, device_ids, create(), library)
    _SETS[key] = made
    return made


def aborted_comm_set(kind: str, device_ids: Sequence[int]) -> NcclCommSet | None:
    """The cached set for (kind, device_ids) when an NCCL error aborted it in this run, else None."""
    cached = _SETS.get((kind, tuple(device_ids)))
    return cached if cached is not None and cached.state == "aborted" else None


def close_communicators() -> int:
    """Destroy every cached NCCL communicator set and forget them all (aborted ones included).

    Returns how many sets were destroyed. dpq's ``disable()`` calls this; the next run makes
    fresh communicators.
    """
    sets = list(_SETS.values())
    _SETS.clear()
    destroyed = 0
    for s in sets:
        if s.state == "open":
            s.destroy()
            destroyed += 1
    return destroyed


def _fail_group(comm_set: NcclCommSet, call: str, error: BaseException) -> None:
    """Abort ``comm_set`` after ``call`` raised ``error``, then raise the clear error (a
    KeyboardInterrupt or other BaseException is re-raised as it is, after the abort)."""
    problems = comm_set.abort(f"{call} failed ({type(error).__name__}: {error})")
    if not isinstance(error, Exception):
        raise error
    extra = f" Aborting also reported: {'; '.join(problems)}." if problems else ""
    raise NcclCollectiveError(
        f"dpq: NCCL {call} over cuda devices {list(comm_set.device_ids)} ({comm_set.kind}) failed: "
        f"{type(error).__name__}: {error}. The NCCL group was closed and these communicators aborted, so "
        "nothing waits on them; this block's parallel tuning stops here (with --parallel_quantization auto "
        "the block reruns serially) and later blocks use device copies (p2p/host) for these GPUs. "
        f"Rerun with NCCL_DEBUG=WARN to see NCCL's own reason.{extra}"
    ) from error


# -- CuPy --------------------------------------------------------------------------------


def _import_cupy_nccl():
    try:
        from cupy.cuda import nccl
    except Exception as e:  # cupy raises more than ImportError when CUDA libraries are missing
        raise RuntimeError(
            f"dpq: the cupy-nccl communicator needs CuPy with NCCL ({type(e).__name__}: {e}); "
            "install it with `pip install dpq[cuda12]` (or dpq[cuda13]), or use torch-nccl / p2p / host"
        ) from e
    if not getattr(nccl, "available", True):
        raise RuntimeError(
            "dpq: CuPy is installed but cannot load NCCL; install it with `pip install dpq[cuda12]` "
            "(or dpq[cuda13]), or use torch-nccl / p2p / host"
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

    Every collective is one ``groupStart()``, each rank's call on its lane's stream, one
    ``groupEnd()`` in a ``finally``; arguments are built before ``groupStart``. If a call
    (or ``groupEnd``) raises, the group is still closed, every rank's handle is aborted and
    :class:`NcclCollectiveError` names the collective; later use raises :class:`NcclAborted`.

    Two ranks on one GPU are refused before any NCCL call unless NCCL >= 2.30 runs with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (``allow_shared_gpu=None`` checks exactly that).
    """

    name = "cupy-nccl"

    def __init__(self, lanes: Sequence[Lane], *, shared: bool = False, allow_shared_gpu: bool | None = None) -> None:
        super().__init__(lanes)
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

    @property
    def comm_set(self) -> NcclCommSet | None:
        """The NCCL handles this communicator issues on (None after ``close()``)."""
        return self._set

    def close(self) -> None:
        """Owned handles: destroy them. Shared ones: detach (``close_communicators`` destroys)."""
        if self._set is not None and not self.shared:
            self._set.destroy()
        self._set = None

    def _dtype(self, dtype: torch.dtype) -> int:
        name = {torch.float32: "NCCL_FLOAT32", torch.bfloat16: "NCCL_BFLOAT16", torch.uint8: "NCCL_UINT8"}[dtype]
        if not hasattr(self._nccl, name):
            raise TypeError(f"dpq: this CuPy's NCCL binding has no {name}; upgrade cupy for {dtype} collectives")
        return getattr(self._nccl, name)

    def _grouped(self, method: str, args_per_rank: list[tuple]) -> None:
        if self._set is None:
            raise RuntimeError("dpq: cupy-nccl communicator used after close()")
        self._set.check_usable()
        calls = [getattr(comm, method) for comm in self._set.comms]
        try:
            self._nccl.groupStart()
        except BaseException as e:
            _fail_group(self._set, f"groupStart before {method}", e)
        error: BaseException | None = None
        where = method
        try:
            for k, (call, lane, args) in enumerate(zip(calls, self.lanes, args_per_rank, strict=True)):
                where = f"{method} (rank {k} of {self.world})"
                with lane.issue():
                    call(*args)
        except BaseException as e:
            error = e
        finally:
            try:  # always close the group: an open one would swallow this thread's next NCCL call
                self._nccl.groupEnd()
            except BaseException as e:
                if error is None:
                    error, where = e, f"groupEnd after {method}"
        if error is not None:
            _fail_group(self._set, where, error)

    def _stream(self, k: int) -> int:
        return self.lanes[k].stream_handle

    def _all_reduce(self, bufs: Sequence[Tensor]) -> None:
        dt, n, op = self._dtype(bufs[0].dtype), bufs[0].numel(), self._nccl.NCCL_SUM
        ptrs = [b.data_ptr() for b in bufs]
        self._grouped("allReduce", [(ptrs[k], ptrs[k], n, dt, op, self._stream(k)) for k in range(self.world)])

    def _reduce_scatter(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        dt, n, op = self._dtype(recv[0].dtype), recv[0].numel(), self._nccl.NCCL_SUM
        args = [(send[k].data_ptr(), recv[k].data_ptr(), n, dt, op, self._stream(k)) for k in range(self.world)]
        self._grouped("reduceScatter", args)

    def _all_gather(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> None:
        dt, n = self._dtype(send[0].dtype), send[0].numel()
        args = [(send[k].data_ptr(), recv[k].data_ptr(), n, dt, self._stream(k)) for k in range(self.world)]
        self._grouped("allGather", args)

    def _broadcast(self, bufs: Sequence[Tensor], root: int) -> None:
        dt, n = self._dtype(bufs[0].dtype), bufs[0].numel()
        ptrs = [b.data_ptr() for b in bufs]
        self._grouped("broadcast", [(ptrs[k], ptrs[k], n, dt, root, self._stream(k)) for k in range(self.world)])

    def _reduce(self, bufs: Sequence[Tensor], root: int) -> None:
        dt, n, op = self._dtype(bufs[0].dtype), bufs[0].numel(), self._nccl.NCCL_SUM
        ptrs = [b.data_ptr() for b in bufs]
        self._grouped("reduce", [(ptrs[k], ptrs[k], n, dt, op, root, self._stream(k)) for k in range(self.world)])


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

    @property
    def _streams(self) -> list:
        return [lane.stream for lane in self.lanes]

    def _call(self, op: str, *args, **kwargs) -> None:
        self._set.check_usable()
        try:
            getattr(self._nccl, op)(*args, streams=self._streams, **kwargs)
        except BaseException as e:
            _fail_group(self._set, f"torch.cuda.nccl.{op}", e)

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
