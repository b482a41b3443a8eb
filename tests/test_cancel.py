"""Cancel means stop (dpq.cancel), in small processes of its own (no torch): the main thread unwinds
in one process; several processes leave from the watcher thread, at once when every rank was
cancelled, or after the naming window; a second signal or the backstop ends a process that does
not unwind; a move into place that started finishes first. End to end under torchrun (a worker
blocked in a gloo collective, the launcher killed): tests/test_torchrun_stop.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpq import refusals

REPO = Path(__file__).resolve().parent.parent

# mode: "alone" (one process), "stubborn" (one process whose main thread ignores Cancelled),
# "everywhere" / "peers" (several processes: every rank cancelled / only this one), "moving" (one
# process, the signal arrives during a move into place), "moved" (one process, the signal arrives after
# one), "forks" (one process that first forks a worker and terminates it)
SCRIPT = r"""
import multiprocessing, sys, threading, time
sys.path.insert(0, sys.argv[2])
from dpq import cancel

mode = sys.argv[1]
cancel.BACKSTOP_S, cancel.NAMING_S = 1.0, 1.0


class Peers:
    grace_s = 1.0

    def report_cancel(self, what):
        print("reported", what, flush=True)

    def cancelled_everywhere(self):
        return mode == "everywhere"


cancel.install(peers=Peers() if mode in ("everywhere", "peers") else None)
if mode == "forks":
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    worker.start()
    time.sleep(0.3)
    worker.terminate()
    worker.join()
    time.sleep(0.5)  # the parent's watcher would have read the worker's signal by now
    print("worker", worker.exitcode, cancel.cancelled(), flush=True)
try:
    if mode == "moving":
        with cancel.uninterrupted():
            print("ready", flush=True)
            time.sleep(1.0)
            print("moved", flush=True)
    if mode == "moved":
        with cancel.uninterrupted():
            pass  # the model is in place before any signal comes
    print("ready", flush=True)
    if mode in ("everywhere", "peers"):
        threading.Event().wait()  # blocked: only the watcher can end it
    while True:
        time.sleep(0.01)
except cancel.Cancelled as stopped:
    print("unwound", stopped.signum, flush=True)
    if mode == "stubborn":
        while True:
            time.sleep(0.01)
    print("dpq: " + cancel.said(), file=sys.stderr, flush=True)
    sys.exit(cancel.exit_status(stopped.signum))
"""


def _cancel(mode: str, *signals: int, gap_s: float = 0.0) -> tuple[int, str, str, float]:
    """Run the script in ``mode``, send ``signals`` once it is ready; (rc, stdout, stderr, seconds to exit)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(REPO)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if mode == "forks":
        assert proc.stdout.readline().strip() == "worker -15 None"  # died of the signal; the parent untouched
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(gap_s)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err, time.monotonic() - t0


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_one_process_unwinds_and_exits_as_cancelled(sig, status):
    rc, out, err, seconds = _cancel("alone", sig)
    assert rc == status and f"unwound {int(sig)}" in out and seconds < 1.0, (rc, out, err)
    assert refusals.cancelled(sig.name) in err


def test_a_main_thread_that_does_not_unwind_is_ended():
    rc, out, err, seconds = _cancel("stubborn", signal.SIGTERM)
    assert rc == 143 and "unwound" in out and 0.9 < seconds < 5, (rc, out, err, seconds)
    assert refusals.cancelled("SIGTERM") in err  # said by the watcher
    rc, out, err, seconds = _cancel("stubborn", signal.SIGTERM, signal.SIGTERM, gap_s=0.2)
    assert rc == 143 and seconds < 0.9, (rc, seconds)  # a second signal: at once


def test_several_processes_leave_from_the_watcher():
    """The main thread blocked (as in a collective): every rank cancelled, at once; only this one,
    after the naming window. The cancel is reported to the peers either way."""
    rc, out, err, seconds = _cancel("everywhere", signal.SIGTERM)
    assert rc == 143 and "reported SIGTERM" in out and seconds < 0.9, (rc, out, err, seconds)
    assert refusals.cancelled("SIGTERM") in err
    rc, out, err, seconds = _cancel("peers", signal.SIGTERM)
    assert rc == 143 and "reported SIGTERM" in out and 0.9 < seconds < 5, (rc, out, err, seconds)
    rc, out, err, seconds = _cancel("peers", signal.SIGTERM, signal.SIGTERM, gap_s=0.2)
    assert rc == 143 and seconds < 0.9, (rc, seconds)  # a second signal: at once


def test_a_move_into_place_finishes_before_the_cancel():
    rc, out, err, _ = _cancel("moving", signal.SIGTERM)
    assert rc == 143 and out.split() == ["moved", "unwound", "15"], (rc, out, err)
    assert refusals.cancelled_after_move("SIGTERM") in err


def test_a_cancel_after_the_model_is_in_place_says_so():
    """Issue 42's sweep, M5: a cancel after the finished model was moved into place (the run then waited on its
    report) said "nothing is written after a cancel, so --output_dir is left as it was"; the model is in place."""
    rc, out, err, _ = _cancel("moved", signal.SIGTERM)
    assert rc == 143 and refusals.cancelled_after_save("SIGTERM") in err, (rc, out, err)
    assert "left as it was" not in err


def test_a_forked_worker_neither_inherits_nor_forwards_the_cancel():
    """A worker forked after install (multiprocessing, a data loader) dies of its own SIGTERM
    (``terminate()``) without cancelling the parent; the parent's own cancel still works."""
    rc, out, err, seconds = _cancel("forks", signal.SIGTERM)
    assert rc == 143 and "unwound 15" in out and seconds < 1.0, (rc, out, err)
