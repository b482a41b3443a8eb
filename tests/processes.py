"""How the tests start worker processes (gloo ranks, spawned checks): :func:`worker_context`.

A fresh ``spawn`` process pays the imports of torch, transformers and auto-round before it runs a
line (about 6 s of CPU each on a 2-core machine, and the suite starts a dozen such workers). The
``forkserver`` start method pays them once: its server process imports :data:`PRELOAD` when the
first worker of the session starts, and every later worker is forked from it.

Invariants that make a forked worker the same as a spawned one for these tests:

* the server runs no torch operation, so no intra-op thread pool exists when it forks (a pool
  does not survive ``fork``); each worker sets its own thread count (``torch.set_num_threads``);
* a worker starts from the server's state, never from another worker's or the test process's:
  the preloaded modules hold no run state (dpq keeps none at module level, auto-round's patch
  table is empty until ``enable()``);
* the server's environment is the test process's when the first worker starts (tests/conftest.py
  sets ``PYTHONPATH`` for the site hooks and applies ``DPQ_TEST_CPU_BF16`` before any test runs),
  and a worker sees that environment, not changes the test process makes later: what differs per
  worker travels as arguments.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

PRELOAD = ["torch", "transformers", "dpq", "dpq.autoround"]


def worker_context() -> BaseContext:
    """The start method every test's worker processes use (see the module's invariants)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: once per session
    return ctx
