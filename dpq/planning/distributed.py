"""Several processes (``torch.distributed``, launched by ``torchrun``) composed with in-process lanes.

DESIGN.md contract 7: P processes x L local lanes = global world W; global lane
``g = rank * L + k`` (process rank major, local lane minor); every rank draws the serial
indices and runs the same plan. This module holds what the session needs for that and knows
nothing of the tuner:

* :class:`ProcessSet`: the group a run spans, given to the session explicitly
  (``SessionConfig.processes``; :meth:`ProcessSet.detect` reads an initialised group).
* :class:`Topology`: P processes x L local lanes (rank, world, lane offset); in one process P = 1.
* :func:`agree_job`: every rank's whole job (model and data by content, every setting) compared
  before any work; a mismatch stops every rank, naming each differing setting and rank.
* :func:`agree`: every rank's plan exchanged; a refusal anywhere stops every rank before any
  work, with every rank's reasons; every rank runs the same local lane count.
* :meth:`ProcessSet.stop`: the failure policy across processes. Any failure is fatal on every
  rank (ranks could not agree on a serial rerun). Each rank reports to the store whether it
  raised, lost contact (a collective failed: gloo says "connection closed by peer" as soon
  as a peer process is gone, or the group's timeout passes) or was cancelled (:mod:`dpq.cancel`
  reports that from its watcher thread, also while the main thread is blocked), then every rank
  that lost contact names the rank the failure started on: one that raised or was cancelled,
  else one that sent no report within ``grace_s`` (killed, or hung).
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["JobMismatch", "ProcessSet", "RankFailure", "Topology", "agree", "agree_job", "in_collective", "peer_lost"]


HEARTBEAT_S = 1.0  # rank 0's heartbeat period during a step the others wait for (ProcessSet.beat)


class RankFailure(RuntimeError):
    """A multi-process run stopped on every rank; the message names the rank it started on.
    ``exit_status``: what a command exits with: 1, or 128 + the signal when the run was cancelled
    (on this rank, or the failure started with a rank's cancel: :mod:`dpq.cancel`). ``raised_here``:
    this rank's own error when the failure started here (its traceback is this rank's to show).
    ``kind``: how it started: "raised" (a rank's error), "cancelled" (a rank's cancel), "silent" (a
    rank stopped answering: killed, or hung) or "lost" (contact lost, the rank unknown)."""

    def __init__(self, message: str, exit_status: int = 1, raised_here: BaseException | None = None,
                 kind: str = "raised") -> None:
        super().__init__(message)
        self.exit_status, self.raised_here, self.kind = exit_status, raised_here, kind


@dataclass(frozen=True)
class Topology:
    """P processes x L local lanes, and where this process's lanes sit in global lane order.

    ``world``: the global lanes (every process's); ``lanes``: this process's. In one process
    (:meth:`alone`) P = 1, rank 0, and the world is this process's lanes."""

    processes: int
    rank: int
    lanes: int

    @classmethod
    def alone(cls, lanes: int) -> Topology:
        """This process's ``lanes``, no other process (P = 1)."""
        return cls(1, 0, lanes)

    @property
    def several(self) -> bool:
        """The lanes span several processes."""
        return self.processes > 1

    @property
    def world(self) -> int:
        """The global lanes: the processes times each one's lanes."""
        return self.processes * self.lanes

    @property
    def lane_offset(self) -> int:
        """Global index of this process's lane 0 (rank major, local lane minor)."""
        return self.rank * self.lanes

    def describe(self) -> str:
        p, lanes = self.processes, self.lanes
        return f"world {self.world} = {p} process{'es' if p != 1 else ''} x {lanes} lane{'s' if lanes != 1 else ''}"


@dataclass
class ProcessSet:
    """The processes of one ``torch.distributed`` group a run spans.

    ``rank``/``size``: in the group; ``group``: the process group (None: the default group);
    ``store``: the group's store, which failures are reported through; ``grace_s``: how long a
    rank that lost contact waits for the others' reports before naming the silent ones;
    ``global_ranks``: each group rank's global rank (messages name those; None: the same);
    ``job``: a token rank 0 draws at the first agreement, naming this job's keys in the store
    (a store can outlive a job: torchrun's agent keeps it across restarts). Any failure is
    fatal, so each rank writes its report once per job. Make one per job."""

    rank: int
    size: int
    store: object
    group: object = None
    grace_s: float = 5.0
    global_ranks: list[int] | None = None
    job: str | None = field(default=None, compare=False)
    reported: bool = field(default=False, compare=False)  # this rank's report is in the store
    # how long another rank waits for rank 0's heartbeat (await_rank0) before it counts as lost:
    # the group's timeout (auto-round-dp sets --parallel_timeout; torch's default otherwise)
    timeout_s: float = 1800.0
    _beating: threading.Event | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def detect(cls, group: object = None, *, grace_s: float = 5.0) -> ProcessSet | None:
        """The initialised group (None: torch.distributed is not initialised)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not (dist.is_available() and dist.is_initialized()):
            return None
        # The store the group rendezvoused through (torchrun's, or the one given to
        # init_process_group); torch has no public accessor for it.
        store = c10d._get_default_store() if group is None else c10d._get_process_group_store(group)
        ranks = None if group is None else dist.get_process_group_ranks(group)
        return cls(dist.get_rank(group), dist.get_world_size(group), store, group, grace_s, ranks)

    def name(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what messages say)."""
        return rank if self.global_ranks is None else self.global_ranks[rank]

    def all_gather_object(self, value: object) -> list:
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _key(self, rank: int) -> str:
        return f"dpq/{self.job or 'before-agreement'}/failed/{rank}"

    def _report(self, status: str, text: str) -> tuple[str, bool]:
        """This rank's report (once per job: the first one stays), and whether the store took it."""
        mine = f"{time.time():.6f} {status} {text}".splitlines()[0][:500]
        if self.reported:
            return mine, True
        self.reported = _try(lambda: self.store.set(self._key(self.rank), mine))
        return mine, self.reported

    def _job_key(self, name: str) -> str:
        return f"dpq/{self.job or 'before-agreement'}/{name}"

    def beat(self, name: str) -> None:
        """Rank 0 starts a long step of its own (its save) that the others wait for: until
        :meth:`publish` (or a failure), a heartbeat under ``name`` tells them it is alive, so that
        their wait (:meth:`await_rank0`) needs no deadline but its silence."""
        self._end_beat()
        beating, key = threading.Event(), self._job_key(f"{name}/alive")

        def run() -> None:
            for count in itertools.count():
                if beating.is_set() or not _try(lambda n=count: self.store.set(key, str(n))):
                    return
                beating.wait(HEARTBEAT_S)

        self._beating = beating
        threading.Thread(target=run, name=f"dpq-{name}-heartbeat", daemon=True).start()

    def _end_beat(self) -> None:
        if self._beating is not None:
            self._beating.set()
            self._beating = None

    def publish(self, name: str, value: object) -> None:
        """Rank 0's result of the step ``name`` (JSON-serialisable) for the others; its heartbeat ends."""
        self._end_beat()
        self.store.set(self._job_key(f"{name}/done"), json.dumps(value))

    def await_rank0(self, name: str, poll_s: float = 0.1) -> object:
        """Another rank's wait for rank 0's step ``name`` (:meth:`beat`, :meth:`publish`): as long as
        it takes, with no collective deadline (a slow save does not time the job out). Raises a
        ``DistError`` (a lost peer, for :meth:`stop`) when rank 0 reported a failure, or its
        heartbeat stood still for ``timeout_s`` (its process is gone)."""
        import torch.distributed as dist

        done, alive, failed = self._job_key(f"{name}/done"), self._job_key(f"{name}/alive"), self._key(0)
        seen, since = None, time.monotonic()
        while True:
            if self.store.check([done]):
                return json.loads(self.store.get(done))
            if self.store.check([failed]):
                raise dist.DistError(f"rank {self.name(0)} failed in its {name}")
            beat = self.store.get(alive) if self.store.check([alive]) else None
            if beat != seen:
                seen, since = beat, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                raise dist.DistError(f"rank {self.name(0)} stopped answering in its {name} (no heartbeat for "
                                     f"{self.timeout_s:g} s)")
            time.sleep(poll_s)

    def report_cancel(self, what: str) -> None:
        """:class:`dpq.cancel.Peers`: this rank was cancelled (``what``: the signal); peers that lose
        contact with it name the cancel."""
        self._report("cancelled", what)

    def report_failure(self, text: str) -> None:
        """This rank failed where it cannot go through :meth:`stop` (its main thread is stuck: the
        iteration watchdog, :mod:`dpq.engine.watchdog`, ends the process): the others name it and ``text``."""
        self._report("raised", text)

    def cancelled_everywhere(self) -> bool:
        """:class:`dpq.cancel.Peers`: every rank has reported a cancel (the whole job was cancelled)."""
        keys = [self._key(r) for r in range(self.size)]
        if not self.store.check(keys):
            return False
        return all(self.store.get(k).decode(errors="replace").split(" ", 2)[1] == "cancelled" for k in keys)

    def stop(self, err: BaseException, lost: bool) -> RankFailure:
        """This rank's part of a failure (module docstring); returns the error to raise.

        ``lost``: ``err`` came out of a collective (see :func:`peer_lost`), so another rank
        started it. The report goes to the store first (it outlives the group); then the group
        is destroyed: after a failure the ranks are out of step in it, so no later collective may
        run on it. (That does not wake peers blocked in a collective with this rank: torch keeps
        other references to the group once torch._dynamo is loaded. They fail when this process
        exits and its connections close, or at the group's timeout.) A rank that lost contact then
        reads the others' reports for up to ``grace_s`` to name the rank it started on. A rank
        that was cancelled (:mod:`dpq.cancel`) reports the cancel; a failure that started with a
        rank's cancel exits as cancelled (``RankFailure.exit_status``).
        """
        import torch.distributed as dist

        from dpq import cancel

        cancel.note_failing()  # a cancel arriving now (torchrun stops the others) lets this finish
        self._end_beat()
        signum = cancel.cancelled()
        if signum is not None:
            mine, store_ok = self._report("cancelled", cancel.what(signum))
        else:
            mine, store_ok = self._report("lost" if lost else "raised", f"{type(err).__name__}: {err}")
        if dist.is_available() and dist.is_initialized():
            _try(lambda: dist.destroy_process_group(self.group))
        reports = {self.rank: mine}
        deadline = time.monotonic() + self.grace_s
        while lost and store_ok and len(reports) < self.size and time.monotonic() < deadline:
            for r in range(self.size):
                if r not in reports and _try(lambda r=r: self.store.check([self._key(r)])):
                    try:
                        reports[r] = self.store.get(self._key(r)).decode(errors="replace")
                    except Exception:  # the store went away meanwhile: name what is known
                        store_ok = False
            if any(v.split(" ", 2)[1] in ("raised", "cancelled") for v in reports.values() if v is not mine):
                break
            time.sleep(0.05)
        message, cause, kind = _failure_message(self.rank, self.size, reports, self.grace_s, store_ok, self.name,
                                                lost)
        if not lost and signum is not None:
            cause, kind = signum, "cancelled"  # this rank's own cancel stopped the run
        return RankFailure(message, cancel.exit_status(cause) if cause is not None else 1,
                           None if lost or signum is not None else err, kind)


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` came out of a collective (a peer closed its connection, or the group timed
    out) rather than from this rank's own work: a ``torch.distributed.DistError``, or raised where
    collectives are called (``torch.distributed`` or ``dpq.comm.process_group``: a gloo/NCCL wait
    raises a plain RuntimeError). Call it before the traceback is released."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _calls_collectives(tb.tb_frame)


def in_collective(thread_id: int) -> bool:
    """Whether the thread ``thread_id`` is inside a collective now (its innermost Python frame is where
    collectives are called, as for :func:`peer_lost`): waiting for the other ranks, not in work of
    its own (the iteration watchdog, :mod:`dpq.engine.watchdog`, leaves such a wait to the group's timeout)."""
    frame = sys._current_frames().get(thread_id)  # documented in sys: the threads' current frames
    return frame is not None and _calls_collectives(frame)


def _calls_collectives(frame) -> bool:
    where = frame.f_code.co_filename.replace("\\", "/")
    return "torch/distributed/" in where or where.endswith("dpq/comm/process_group.py")


def _try(call) -> bool:
    try:
        return call() is not False
    except Exception:
        return False


def _failure_message(me: int, size: int, reports: dict[int, str], grace_s: float, store_ok: bool, name,
                     lost: bool = True) -> tuple[str, int | None, str]:
    """(the message, the signal when the failure started with a rank's cancel, how it started:
    :attr:`RankFailure.kind`). Names ranks by ``name(group rank)``: their global ranks. ``lost``:
    this rank lost contact, so the failure started elsewhere (its own report, even a cancel that
    reached it meanwhile, is not the cause). Texts: :mod:`dpq.refusals`."""
    from dpq import cancel, refusals

    parsed = {name(r): v.split(" ", 2) for r, v in reports.items()}  # time, raised|lost|cancelled, the error
    first_hand = [r for r in sorted(parsed) if parsed[r][1] in ("raised", "cancelled") and not (lost and r == name(me))]
    silent = [name(r) for r in range(size) if r not in reports]
    cause, kind = None, "lost"
    if first_hand:
        first = min(first_hand, key=lambda r: float(parsed[r][0]))
        kind = parsed[first][1]
        if kind == "cancelled":
            head, cause = refusals.rank_cancelled(first, parsed[first][2]), cancel.cause_of(parsed[first][2])
        else:
            head = refusals.rank_raised(first, parsed[first][2])
    elif not store_ok:
        head = refusals.rank_store_unreachable(name(me))
    elif silent:
        head, kind = refusals.ranks_silent(silent, grace_s), "silent"
    else:
        first = min(parsed, key=lambda r: float(parsed[r][0]))
        head = refusals.rank_reported_first(first, parsed[first][2])
    each = [f"rank {r} {parsed[r][1]}: {parsed[r][2]}" for r in sorted(parsed)]
    return refusals.rank_failure(head, name(me), each, kind), cause, kind


class JobMismatch(ValueError):
    """The ranks were given different jobs (:func:`agree_job`). ``reasons``: each differing setting,
    with every rank's value."""

    def __init__(self, reasons: Sequence[str]) -> None:
        from dpq import refusals

        self.reasons = list(reasons)
        super().__init__(refusals.jobs_differ(self.reasons))


def agree_job(procs: ProcessSet, mine: dict[str, tuple[str, str]] | None) -> None:
    """Every rank's job, compared before any work; the same answer on every rank.

    ``mine``: this rank's settings, name -> (what is compared, what is shown), e.g. a local model
    compared by its content digest and shown with its path (:func:`dpq.autoround.job.settings`);
    None: this rank cannot say (its arguments are rejected where it parses them; it stops there
    itself). Raises :class:`JobMismatch` on every rank, naming every setting whose compared value
    differs and each rank's value. Rank 0 also draws the job's token here (see :func:`agree`)."""
    from dpq import refusals

    token = uuid.uuid4().hex if procs.job is None and procs.rank == 0 else ""
    gathered = procs.all_gather_object((token, mine))
    procs.job = procs.job or gathered[0][0] or None
    jobs = [job for _, job in gathered]
    if any(job is None for job in jobs):
        return
    missing = ("(not set)", "(not set)")
    problems = []
    for name in sorted(set().union(*jobs), key=lambda n: (n != "--model", n != "--dataset", n)):
        values = [job.get(name, missing) for job in jobs]
        if len({compared for compared, _ in values}) < 2:
            continue
        groups: dict[str, list[int]] = {}
        for r, (compared, _) in enumerate(values):
            groups.setdefault(compared, []).append(procs.name(r))
        shown = {compared: next(s for c, s in values if c == compared) for compared in groups}
        each = "; ".join(f"rank {', '.join(map(str, ranks))}: {shown[c]}" for c, ranks in groups.items())
        problems.append(refusals.setting_differs(name, each))
    if problems:
        raise JobMismatch(problems)


@dataclass
class RankPlan:
    """What one rank sends to the agreement."""

    requested: object  # the world the config asked for
    lanes: int  # the local lanes its plan kept (0 when refused)
    reasons: list[str]  # the refusal's reasons, or why 'auto' kept fewer
    refused: bool = False
    serial: bool = False  # the tuner cannot be split here (its own serial run on every rank)
    job: str = ""  # rank 0, at the job's first agreement: the token of the job's store keys
    host: str = ""  # where its lanes are (socket.gethostname())
    devices: list[str] = field(default_factory=list)  # its accelerator lanes' devices (one process each)


def _reasons_by_rank(procs: ProcessSet, plans: Sequence[RankPlan]) -> list[str]:
    """The refusing ranks' reasons, each once: as given where every rank gave it, else after the ranks
    that gave it ("rank 0, 2: ...")."""
    ranks: dict[str, list[int]] = {}
    for r, plan in enumerate(plans):
        for reason in plan.reasons if plan.refused else ():
            ranks.setdefault(reason, []).append(procs.name(r))
    return [reason if len(who) == len(plans) else f"rank {', '.join(map(str, who))}: {reason}"
            for reason, who in ranks.items()]


def agree(procs: ProcessSet, mine: RankPlan, samples_per_iter: int, pool_samples: int = 0,
          asked_samples: int = 0) -> tuple[Topology, list[str]]:
    """Every rank's plan, exchanged; the same answer on every rank.

    Returns (topology, notes): the agreed topology (``procs.size`` processes x the same local lane
    count), or, when the block runs serially on every rank, each rank alone on one lane, its home
    (:meth:`Topology.alone`: one process, ``several`` False), whatever lanes its own plan had. Raises
    :class:`dpq.planning.plan.PlanRefused` (``every_rank``) on every rank, listing every rank's reasons (a
    reason every rank gave once, as one process says it; others prefixed with their ranks), when any
    rank refused, the ranks asked for different worlds, or the lanes outnumber the samples of an
    iteration (``pool_samples``: the calibration samples there are, ``asked_samples`` those asked for, 0
    unknown: the fix names what limits it, as in one process). Every rank runs the same local lane count:
    under 'auto' the fewest any rank has (noted); an explicit world refuses wherever it is short.
    """
    from dpq import refusals
    from dpq.planning.plan import PlanRefused

    if procs.job is None and procs.rank == 0:
        mine.job = uuid.uuid4().hex
    plans: Sequence[RankPlan] = procs.all_gather_object(mine)
    procs.job = procs.job or plans[0].job
    problems = _reasons_by_rank(procs, plans)
    asked = {repr(p.requested) for p in plans}
    if len(asked) > 1:
        each = ", ".join(f"rank {procs.name(r)}: {q.requested!r}" for r, q in enumerate(plans))
        problems.append(refusals.worlds_differ(each))
    users: dict[tuple[str, str], list[int]] = {}
    for r, q in enumerate(plans):
        for dev in dict.fromkeys(q.devices):
            users.setdefault((q.host, dev), []).append(procs.name(r))
    for (host, dev), ranks in users.items():
        if len(ranks) > 1:
            problems.append(refusals.accelerator_shared(ranks, dev, host))
    p, explicit = procs.size, isinstance(mine.requested, int)
    lanes = min((q.lanes for q in plans if not q.refused), default=0)
    if p > samples_per_iter or (explicit and p * lanes > samples_per_iter):
        problems.append(refusals.too_few_samples(p * (lanes if explicit else 1), samples_per_iter, pool_samples,
                                                 processes=p, asked=asked_samples))
    if problems:
        raise PlanRefused(problems, every_rank=True)
    if any(q.serial for q in plans):
        serial = [r for r, q in enumerate(plans) if q.serial]
        why = plans[serial[0]].reasons[0] if plans[serial[0]].reasons else "its plan is serial"
        return Topology.alone(1), [refusals.serial_every_rank([procs.name(r) for r in serial], why)]
    notes = []
    if lanes != max(q.lanes for q in plans):
        fewest = [procs.name(r) for r, q in enumerate(plans) if q.lanes == lanes]
        notes.append(refusals.auto_fewest_lanes(lanes, fewest))
    if p * lanes > samples_per_iter:
        lanes = samples_per_iter // p
        notes.append(refusals.auto_lanes_for_samples(lanes, samples_per_iter))
    topology = Topology(p, procs.rank, lanes)
    notes.append(topology.describe())
    return topology, notes
