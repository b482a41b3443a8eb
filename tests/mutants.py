"""Bugs that every statistical parity check must catch: each test that holds world >= 2 to
statistical parity (instead of bits) shows at least one of these failing its own check.

``apply(setattr, name)`` installs one with ``setattr(obj, attr, value)``: pytest's
``monkeypatch.setattr`` in a test, or plain ``setattr`` in a subprocess (``DPQ_TEST_MUTANT``,
tests/site_hooks/sitecustomize.py, for the CLI's runs).
"""

from __future__ import annotations

MUTANTS = ("lane weight 1", "lane 1 gradient dropped", "lane 1 reads lane 0's slice")


def apply(setattr_, mutant: str) -> None:
    from importlib import import_module

    exchange, tune_loop = import_module("dpq.engine.exchange"), import_module("dpq.tune_loop")  # also mid-import

    if mutant == "lane weight 1":  # each lane's mean loss unweighted instead of its share of the elements
        setattr_(tune_loop.TuneEngine, "_weight", lambda self, chunk, ref: 1.0)
    elif mutant == "lane 1 gradient dropped":  # zeroed just before each bucket's exchange
        # exchange_bucket: what both the plain exchange and the overlapped one (hooks) call
        for cls in (exchange.SignExchange, exchange.FullSumExchange):
            def exchange_bucket(self, buckets, i, _real=cls.exchange_bucket):
                buckets.bucket(i)[1].zero_()
                return _real(self, buckets, i)

            setattr_(cls, "exchange_bucket", exchange_bucket)
    elif mutant == "lane 1 reads lane 0's slice":  # lane 1 gets a slice of lane 0's samples, its own size
        real_ranges = tune_loop.contiguous_ranges

        def ranges(n, world, *a, **k):
            out = real_ranges(n, world, *a, **k)
            out[1] = (out[0][0], out[0][0] + out[1][1] - out[1][0])
            return out

        setattr_(tune_loop, "contiguous_ranges", ranges)
    else:
        raise ValueError(f"unknown mutant {mutant!r}: one of {MUTANTS}")
