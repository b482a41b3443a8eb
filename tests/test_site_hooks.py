"""The suite's site hooks (tests/site_hooks): the switch for auto-round's CPU bf16 detection reaches
auto-round in this process and in subprocesses, in both directions; a mutant or a fault set for a
subprocess reaches dpq there."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import SITE_HOOKS, cpu_bf16_expected

BF16 = "from auto_round.utils.device_manager import get_ar_device; print(get_ar_device('cpu').supports_bf16())"
WEIGHT = "import dpq.tune_loop as t; print(t.TuneEngine._weight.__qualname__)"
ENGINE = ("import dpq.session, dpq.engine.phases as p; "
          "print(any(type(o).__name__ == '_LaneForwardFaults' for o in p.observers()))")


def test_this_process_sees_the_sessions_setting():
    from auto_round.utils.device_manager import get_ar_device

    assert get_ar_device("cpu").supports_bf16() is cpu_bf16_expected()


def _probe(code: str, **env: str) -> str:
    """``code``'s last line of output in a fresh interpreter (PYTHONPATH: conftest's, as every
    subprocess the tests start), with ``env`` added."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_subprocesses_see_a_forced_value_both_ways_and_a_mutant():
    """A fresh interpreter, as the CLI and torchrun workers start: the forced value is what
    auto-round's device manager reports; ``DPQ_TEST_MUTANT`` replaces the lane weight there;
    ``DPQ_TEST_FAULT`` for this process's rank (0 outside torchrun) registers the fault scaffolding's
    observer of the lanes' forwards, for another rank it leaves the runs alone."""
    jobs = [(BF16, {SITE_HOOKS.ENV: "on"}), (BF16, {SITE_HOOKS.ENV: "off"}),
            (WEIGHT, {SITE_HOOKS.MUTANT_ENV: "lane weight 1"}), (WEIGHT, {SITE_HOOKS.MUTANT_ENV: ""}),
            (ENGINE, {SITE_HOOKS.FAULT_ENV: "raise:0:1:0"}), (ENGINE, {SITE_HOOKS.FAULT_ENV: "raise:1:1:0"})]
    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(lambda job: _probe(job[0], **job[1]), jobs))
    assert out == ["True", "False", "apply.<locals>.<lambda>", "TuneEngine._weight", "True", "False"]
