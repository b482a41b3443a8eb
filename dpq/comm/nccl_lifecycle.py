"""The lifecycle of dpq's in-process NCCL handles (split out of :mod:`dpq.nccl_comm`, which
re-exports everything here; the rules are in that module's docstring): one handle set per device
tuple per run, an NCCL error aborts the set, and :func:`close_communicators` destroys them all.

Invariant kept here: once NCCL failed for some GPUs in this run (an abort after an error or a hang,
or a failed ``ncclCommInitAll``), the failed set stays cached and :func:`failed_comm_sets` names it
for every device tuple that shares one of its GPUs, whatever the NCCL kind: the choice of
communicator (``dpq.comm.communicators.choose_communicator``) then takes device copies for them, so no
block retries an init that costs seconds, and no torch.cuda.nccl communicator (which cannot be
aborted) runs where CuPy's was aborted. :func:`close_communicators` (``disable()``) forgets them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = [
    "NcclAborted",
    "NcclCollectiveError",
    "NcclCommSet",
    "NcclInitFailed",
    "close_communicators",
    "fail_group",
    "failed_comm_sets",
    "shared_comm_set",
]


class NcclCollectiveError(RuntimeError):
    """An NCCL call failed; the group was closed and the communicators of its devices aborted."""


class NcclAborted(RuntimeError):
    """A communicator whose NCCL handles were aborted (after an earlier error) was used again."""


class NcclInitFailed(NcclAborted):
    """``ncclCommInitAll`` failed for these devices (now, or earlier in this run: it is not retried)."""


class NcclCommSet:
    """The NCCL handles of one device tuple: ``comms[k]`` is rank k's (a CuPy ``NcclCommunicator``;
    empty for torch-nccl, whose communicators torch caches per device list itself).

    States: open -> aborted (an NCCL error: ``abort()`` on every handle) or closed (``destroy()``);
    failed: the init itself failed (no handles).
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
        if self.state == "failed":
            raise NcclInitFailed(
                f"dpq: creating the {self.where()} failed earlier in this run ({self.failure}); it is not retried. "
                "select_communicator picks device copies (p2p/host) for these GPUs for the rest of this run"
            )
        if self.state == "aborted":
            raise NcclAborted(
                f"dpq: the {self.where()} were aborted after {self.failure}; they cannot be used again. "
                "select_communicator picks device copies (p2p/host) for these GPUs for the rest of this run; "
                "dpq.comm.nccl_lifecycle.close_communicators() (called by disable()) forgets them"
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
    try:
        comms = create()
    except Exception as e:  # remembered: every later use of these devices is refused at once
        failed = _SETS[key] = NcclCommSet(kind, device_ids, [], library)
        failed.state, failed.failure = "failed", f"{type(e).__name__}: {e}"
        raise NcclInitFailed(f"dpq: creating the {failed.where()} failed ({failed.failure})") from e
    made = NcclCommSet(kind, device_ids, comms, library)
    _SETS[key] = made
    return made


def failed_comm_sets(device_ids: Sequence[int]) -> list[NcclCommSet]:
    """Every cached set, of any NCCL kind, that was aborted or failed to initialise in this run and
    shares a GPU with ``device_ids`` (module docstring: no NCCL for those GPUs again)."""
    ids = set(device_ids)
    return [s for s in _SETS.values() if s.state in ("aborted", "failed") and ids & set(s.device_ids)]


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


def fail_group(comm_set: NcclCommSet, call: str, error: BaseException) -> None:
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
