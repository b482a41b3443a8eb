"""The watchdog (R8 of dpq.streams, dpq.tune_loop): no wait on the lanes' work blocks forever.

CPU lanes get logical streams whose events complete or not as the test says (:class:`Device`): a
communicator whose collective "launches a kernel that never completes" (every event recorded
after it stays incomplete until the communicator is aborted), one that also reports an
asynchronous error (as CuPy's ``check_async_error`` raises ``NcclError``), and one whose work no
abort can end (torch.cuda.nccl, a stuck copy). The session's failure policy is then checked as
for any lane failure: home restored bit for bit, the error names the block, the communicator and
the lanes, ``auto`` reruns the block serially; work that cannot be ended leaves everything alone.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

import dpq.streams as dpq_streams
from dpq.comm import communicators
from dpq.fallback_p2p import LocalCommunicator
from dpq.planning.spec import ParallelSpec
from dpq.session import PG_WATCHDOG_LEAD, SessionConfig, run
from dpq.streams import WaitExpired, wait_events
from dpq.tune_loop import LanesHung
from tests.test_distributed import TUNED, Block, make_task


class Device:
    """Event completion for the logical streams: after ``hang()``, every event recorded later stays
    incomplete until ``release()`` (what ``ncclCommAbort`` does to the kernels it ends)."""

    def __init__(self) -> None:
        self.seq = itertools.count()
        self.hung_from: int | None = None
        self.empty_cache_calls = 0

    def hang(self) -> None:
        if self.hung_from is None:
            self.hung_from = next(self.seq)

    def release(self) -> None:
        self.hung_from = None


class Event:
    def __init__(self, device: Device) -> None:
        self.device, self.seq = device, next(device.seq)

    def query(self) -> bool:
        return self.device.hung_from is None or self.seq < self.device.hung_from

    def synchronize(self) -> None:
        raise AssertionError("the watchdog polls; it never blocks in event.synchronize()")


class Stream:
    def __init__(self, device: Device) -> None:
        self.device = device

    def record_event(self, event=None) -> Event:
        return Event(self.device)

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        raise AssertionError("no stream synchronize in the tune loop")


class Backend(dpq_streams.Backend):
    """dpq's cpu backend with :class:`Stream` s (host memory, so nothing is pinned or copied)."""

    has_streams = True

    def __init__(self, device: Device) -> None:
        self.device = device
        self.default = Stream(device)

    def new_stream(self, device):
        return Stream(self.device)

    def current_stream(self, device):
        return self.default

    def empty_cache(self) -> None:
        self.device.empty_cache_calls += 1


class Hanging(LocalCommunicator):
    """The local communicator whose second collective's kernel never completes; ``error``: it also
    reports an asynchronous error from then on; ``abortable``: ``abort()`` ends the kernel."""

    device: Device
    error = False
    abortable = True
    aborts: list

    def all_reduce(self, bufs) -> None:
        self._hang_after(super().all_reduce, bufs)

    def reduce_scatter(self, send, recv) -> None:
        self._hang_after(super().reduce_scatter, send, recv)

    def _hang_after(self, call, *args) -> None:
        call(*args)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            self.device.hang()

    def check_async_error(self) -> None:
        if self.error and self.device.hung_from is not None:
            raise RuntimeError("NCCL_ERROR 6: remote process exited or there was a network error")

    def abort(self, reason: str) -> bool:
        self.aborts.append(reason)
        if self.abortable:
            self.device.release()
        return self.abortable


@pytest.fixture
def device(monkeypatch):
    dev = Device()
    monkeypatch.setitem(dpq_streams._BACKENDS, "cpu", Backend(dev))
    monkeypatch.setitem(communicators.COMMUNICATORS, "local", Hanging)
    monkeypatch.setattr(Hanging, "device", dev, raising=False)
    monkeypatch.setattr(Hanging, "aborts", [], raising=False)
    return dev


def values(block: Block) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in block.named_parameters()}


def tune(world, *, timeout: float, serial=None):
    block = Block()
    task = make_task("sign", block)
    task.serial = serial
    before = values(block)
    t0 = time.perf_counter()
    try:
        return run(SessionConfig(ParallelSpec(world, ["cpu", "cpu"], timeout=timeout)), task), block, before, \
            time.perf_counter() - t0
    except LanesHung as err:
        return err, block, before, time.perf_counter() - t0


def test_a_kernel_that_never_completes_is_aborted_and_home_restored(device):
    err, block, before, seconds = tune(2, timeout=0.3)
    assert isinstance(err, LanesHung) and not err.stuck, err
    text = str(err)
    assert "block-sign at world 2" in text and "lane(s) 0, 1 had not finished" in text
    assert "--parallel_timeout 0.3 s passed" in text and "local communicators were aborted" in text
    assert "Fix: " in text
    assert Hanging.aborts and "watchdog" in Hanging.aborts[0]
    assert all(torch.equal(before[n], v) for n, v in values(block).items())  # home exactly as before
    assert 0.3 <= seconds < 30
    assert device.empty_cache_calls >= 1  # the abort ended the work: the teardown may wait on the devices


def test_auto_reruns_a_hung_block_serially(device):
    ran = []

    def serial():
        ran.append(True)
        return "serial result"

    done, block, before, _ = tune("auto", timeout=0.3, serial=serial)
    assert ran and done.fell_back and done.serial and done.result == "serial result"
    assert "had not finished" in done.failure
    assert all(torch.equal(before[n], v) for n, v in values(block).items())


def test_an_asynchronous_error_stops_the_wait_before_the_deadline(device, monkeypatch):
    monkeypatch.setattr(Hanging, "error", True)
    err, block, before, seconds = tune(2, timeout=60)
    assert isinstance(err, LanesHung) and not err.stuck
    assert "RuntimeError: NCCL_ERROR 6: remote process exited" in str(err)
    assert seconds < 30, "the error was seen only at the deadline"
    assert all(torch.equal(before[n], v) for n, v in values(block).items())


def test_work_no_abort_can_end_leaves_the_devices_alone(device, monkeypatch):
    """torch.cuda.nccl (no abort) or a stuck copy: restoring home or a serial rerun would wait on the
    hung devices too, so neither runs, the cache is not emptied, and the error says to restart."""
    monkeypatch.setattr(Hanging, "abortable", False)
    ran = []
    err, block, before, _ = tune("auto", timeout=0.3, serial=lambda: ran.append(True))
    assert isinstance(err, LanesHung) and err.stuck and not ran
    assert "cannot end work already queued" in str(err) and "Fix: restart the run" in str(err)
    assert device.empty_cache_calls == 0
    assert not torch.equal(before[TUNED[0]], values(block)[TUNED[0]])  # left as the failed run left it


def test_wait_events_polls_checks_and_expires():
    done = type("E", (), {"query": lambda self: True})()
    never = type("E", (), {"query": lambda self: False})()
    wait_events([None, done])  # nothing pending: returns at once, no check
    now = [0.0]
    checks = []
    with pytest.raises(WaitExpired) as exc:
        wait_events([done, never, never], 1.0, lambda: checks.append(now[0]), clock=lambda: now[0],
                    sleep=lambda s: now.__setitem__(0, now[0] + 0.01))
    assert exc.value.pending == [1, 2] and exc.value.waited_s >= 1.0
    assert 15 <= len(checks) <= 25  # the check every CHECK_EVERY_S (0.05 s), not every poll
    with pytest.raises(KeyError):
        wait_events([never], None, lambda: (_ for _ in ()).throw(KeyError("async")))


def test_the_watchdog_fires_before_the_process_groups_own():
    procs = type("P", (), {"size": 2})()
    assert SessionConfig(ParallelSpec(timeout=100)).watchdog_s() == 100
    lead = SessionConfig(ParallelSpec(timeout=100), processes=procs).watchdog_s()
    assert lead == pytest.approx(100 * PG_WATCHDOG_LEAD) and lead < 100


def test_process_group_abort_ends_the_nccl_backend_only():
    from dpq.comm.process_group import ProcessGroupCommunicator

    calls = []

    class PgBackend:
        def abort(self):
            calls.append("nccl abort")

    group = type("G", (), {"_get_backend": lambda self, device: PgBackend()})()
    comm = ProcessGroupCommunicator.__new__(ProcessGroupCommunicator)
    comm.lanes = [type("L", (), {"device": torch.device("cuda", 0)})()]
    comm.group, comm.inner = group, type("I", (), {"abort": lambda self, reason: calls.append("inner") or False})()
    assert comm.abort("watchdog") is True and calls == ["nccl abort", "inner"]
    comm.lanes = [type("L", (), {"device": torch.device("cpu")})()]
    calls.clear()
    assert comm.abort("watchdog") is False and calls == ["inner"]  # gloo: nothing to end


# -- the iteration watchdog (dpq.engine.watchdog): a thread that holds each iteration's deadline ------


def _stuck_issuer(watch, release: threading.Event, iterations: int = 1) -> threading.Thread:
    """An issuing thread that arms ``iterations`` deadlines, then blocks until ``release`` (as in C code)."""
    def issue():
        for _ in range(iterations):
            watch.arm()
        release.wait(30)
        watch.disarm()

    thread = threading.Thread(target=issue, daemon=True)
    thread.start()
    return thread


def test_the_iteration_watchdog_ends_what_stays_stuck_and_spares_what_comes_back():
    """Past the deadline the communicators are aborted (``expire``); a thread that stays stuck past the grace
    is ended (``end``), one that comes back is not (its expiry is kept for the engine to raise)."""
    from dpq.engine.watchdog import IterationWatchdog

    expired, ended = [], []
    done = threading.Event()
    watch = IterationWatchdog(0.2, lambda waited: expired.append(waited) or "hung text",
                              lambda text: (ended.append(text), done.set()), grace_s=0.3)
    release = threading.Event()
    t0 = time.monotonic()
    _stuck_issuer(watch, release)
    assert done.wait(10) and ended == ["hung text"] and len(expired) == 1 and expired[0] >= 0.2
    assert 0.5 <= time.monotonic() - t0 < 5 and watch.expired == "hung text"
    release.set()
    watch.close()

    ended.clear()
    back = threading.Event()
    watch = IterationWatchdog(0.2, lambda waited: "slow", lambda text: ended.append(text), grace_s=5.0)
    issuer = _stuck_issuer(watch, back)
    time.sleep(0.5)  # past the deadline, within the grace
    back.set()
    issuer.join(5)
    time.sleep(0.2)
    assert watch.expired == "slow" and ended == []
    watch.close()


def test_the_watchdog_leaves_a_wait_for_other_ranks_to_the_groups_timeout():
    """Under several processes a thread blocked in a collective waits for a lost or hung rank: the
    group's own timeout names that rank, so this rank is not ended while it waits there."""
    from dpq.engine.watchdog import IterationWatchdog

    ended, in_collective = [], [True]
    watch = IterationWatchdog(0.1, lambda waited: "hung", lambda text: ended.append(text), grace_s=0.1,
                              in_collective=lambda: in_collective[0])
    release = threading.Event()
    _stuck_issuer(watch, release)
    time.sleep(1.0)
    assert ended == [] and watch.expired == "hung"
    in_collective[0] = False  # now stuck in work of its own
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended == ["hung"]
    release.set()
    watch.close()


def test_a_hung_issuing_thread_ends_the_command_and_reports_the_block(tmp_path):
    """Issue 31, item 14: with the issuing thread itself stuck (DPQ_TEST_FAULT=hang: the lane loss of
    block 1 never returns, as a thread blocked inside a CUDA call), one process, --parallel_timeout 10:
    the run sat until killed. Now the watchdog ends it with exit 1 about 10 s + its grace after the hang,
    the output left as it was (a model saved there before untouched, no partial folder) and the report
    naming the block, the lane and the block finished before it."""
    from tests.test_cli import earlier_model, tree_bytes
    from tests.test_torchrun import _args, _env

    before = earlier_model(tmp_path / "out")
    report = tmp_path / "report.json"
    args = _args(tmp_path, str(tmp_path / "out"), "--parallel_quantization", "1", "--parallel_timeout", "10",
                 "--parallel_report", str(report), "--max_shard_size", "100KB")
    args[args.index("--iters") + 1] = "1"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dpq.autoround.cli", *args], capture_output=True, text=True,
                          timeout=60, env=_env(DPQ_TEST_FAULT="hang:0:1:0"))
    seconds = time.monotonic() - t0
    assert "dpq test hook: rank 0 hangs in block 1" in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1 and seconds < 50, (proc.returncode, seconds, proc.stderr[-3000:])
    said = "model.layers.1 at world 1: the issuing thread has been in lane 0's forward (iteration 1) for 10"
    assert said in proc.stderr and "so this process ends (exit status 1)" in proc.stderr, proc.stderr[-3000:]
    assert tree_bytes(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "out", "report.json"]
    body = json.loads(report.read_text())
    assert body["error"]["kind"] == "hung" and body["error"]["where"] == "model.layers.1", body["error"]
    assert said in body["error"]["message"] and [b["name"] for b in body["blocks"]] == ["model.layers.0"]
