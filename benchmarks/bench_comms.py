"""Throughput of the CPU-runnable communicators and of the exchange policies.

    pytest benchmarks/bench_comms.py --benchmark-only

Not collected by the normal test run (testpaths = tests). Each benchmark reports its bus
bandwidth in ``extra_info["GB/s"]``: the communicator's ring wire bytes per call (the same
formula for every communicator, see ``dpq.comm.comm_base.ring_wire_bytes``) over the mean time.
On CPU lanes this measures the summing and copying machinery, not an interconnect.
"""

from __future__ import annotations

import pytest
import torch

from dpq.comm.communicators import select_communicator
from dpq.engine.exchange import FullSumExchange, GradBuckets, SignExchange
from dpq.streams import make_lanes

NUMEL = 4 * 2**20  # 4M fp32 elements (16 MiB) per lane
ROUNDS = 8


def _report(benchmark, wire_bytes_per_call: int) -> None:
    mean = benchmark.stats.stats.mean
    benchmark.extra_info["wire_bytes_per_call"] = wire_bytes_per_call
    benchmark.extra_info["GB/s"] = round(wire_bytes_per_call / mean / 1e9, 3)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["local", "p2p", "host"])
def test_all_reduce_throughput(benchmark, name, world):
    comm, _ = select_communicator(make_lanes(["cpu"] * world), prefer=name)
    data = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(k)) for k in range(world)]
    bufs = [torch.empty(NUMEL) for _ in range(world)]

    def reset():  # untimed: every round sums the same data (repeated sums would overflow)
        for buf, x in zip(bufs, data, strict=True):
            buf.copy_(x)

    before = comm.wire_bytes
    benchmark.pedantic(comm.all_reduce, args=(bufs,), setup=reset, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(communicator=comm.name, world=world, numel=NUMEL)
    _report(benchmark, (comm.wire_bytes - before) // (ROUNDS + 1))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("policy", [FullSumExchange, SignExchange])
def test_exchange_throughput(benchmark, policy, world):
    comm, _ = select_communicator(make_lanes(["cpu"] * world))
    # A block-like parameter list: 4 "layers" of 1M elements each, default 4M-element buckets.
    params = [[torch.nn.Parameter(torch.zeros(1024, 1024)) for _ in range(4)] for _ in range(world)]
    buckets = GradBuckets(params)
    data = [torch.randn(buckets.numel, generator=torch.Generator().manual_seed(k)) for k in range(world)]
    ex = policy(comm)

    def reset():
        buckets.attach()
        for buf, x in zip(buckets.buffers, data, strict=True):
            buf.copy_(x)

    benchmark.pedantic(ex.exchange, args=(buckets,), setup=reset, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(policy=ex.name, communicator=comm.name, world=world, numel=buckets.numel)
    _report(benchmark, ex.last_wire_bytes)
