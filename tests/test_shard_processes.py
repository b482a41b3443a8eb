"""A sample-ordered forward (dpq.sharded.shard.shard_forward) over the global lanes of several processes
(dpq.sharded.shard_processes): every rank gets every sample's output, bitwise the serial pass's.

One spawn of 2 gloo processes (one intra-op thread each). In each process, for uneven sample
counts and batch sizes (including a rank whose lanes get no sample): the serial pass, the
same forward as 1x2 (two lanes of this process) and as 2x1 and 2x2 (both processes, one or two
lanes each), and the agreement on the lane count. Bitwise comparisons are made inside one
process, and between the two ranks (same machine, same thread count)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from dpq.planning.distributed import ProcessSet, Topology
from dpq.sharded.shard import shard_forward
from dpq.sharded.shard_processes import agree_lanes, gather_in_sample_order, global_ranges
from dpq.streams import make_lanes
from tests.processes import worker_context

CASES = [(11, 3, torch.float32), (7, 2, torch.bfloat16), (5, 4, torch.float32)]  # (samples, batch, dtype)
TIMEOUT_S = 60  # whole spawn (a bound, not the expected time)


def _module(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)).to(dtype)


def _inputs(n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(5, 16, generator=g).to(dtype) for _ in range(n)]


def _forward_fn(inputs: list[torch.Tensor], bs: int, extra: list):
    """Whole batches of ``bs`` from ``start`` (aligned), as the serial pass forms them; also a
    per-sample second output (a runner's other outputs), kept in ``extra``."""

    def fn(module, lane, start, stop):
        out = []
        with torch.no_grad():
            for b in range(start, stop, bs):
                y = module(torch.stack(inputs[b : min(b + bs, stop)]))
                out.extend(y.unbind(0))
        extra.extend(o.sum(-1) for o in out)
        return out

    return fn


def _processes(procs: ProcessSet, module, inputs, bs, local_lanes: int):
    n = len(inputs)
    topology = Topology(procs.size, procs.rank, local_lanes)
    lanes = make_lanes(["cpu"] * local_lanes)
    modules = [module] + [_module(next(module.parameters()).dtype) for _ in range(local_lanes - 1)]
    extra: list = []
    local = shard_forward(modules, lanes, n, _forward_fn(inputs, bs, extra), align=bs,
                          ranges=global_ranges(n, topology, bs))
    return gather_in_sample_order(procs, local, {"sums": extra} if extra else None, "cpu")


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    procs = ProcessSet.detect()
    result: dict = {}
    for n, bs, dtype in CASES:
        module, inputs = _module(dtype), _inputs(n, dtype)
        serial = _forward_fn(inputs, bs, [])(module, None, 0, n)
        one_by_two = shard_forward([module, _module(dtype)], make_lanes(["cpu", "cpu"]), n,
                                   _forward_fn(inputs, bs, []), align=bs)
        result[n] = {"serial": serial, "1x2": one_by_two, "2x1": _processes(procs, module, inputs, bs, 1),
                     "2x2": _processes(procs, module, inputs, bs, 2),
                     "ranges": [global_ranges(n, Topology(2, rank, k), bs) for k in (1, 2)]}
    result["agree"] = [agree_lanes(procs, 2 + rank, []), agree_lanes(procs, 0 if rank else 3, ["no room"])]
    dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard_processes")
    ctx = worker_context()
    ps = [ctx.Process(target=_worker, args=(r, str(tmp / "store"), str(tmp))) for r in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    for p in ps:
        p.start()
    for p in ps:  # a hung rank is killed at the deadline (its exit code then fails the assertion)
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in ps] == [0, 0]
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"n{n}-bs{bs}-{str(d)[6:]}" for n, bs, d in CASES])
def test_global_lanes_give_the_serial_outputs_on_every_rank(spawned, case):
    n = case[0]
    for rank, result in enumerate(spawned):
        r = result[n]
        assert len(r["serial"]) == n
        assert _same(r["1x2"], r["serial"]), rank
        for layout in ("2x1", "2x2"):
            outputs, extra = r[layout]
            assert _same(outputs, r["serial"]), (rank, layout)
            assert _same(extra["sums"], [o.sum(-1) for o in r["serial"]]), (rank, layout)
    assert _same(spawned[0][n]["2x2"][0], spawned[1][n]["2x2"][0])  # the same bits on both ranks


def test_ranges_are_each_ranks_slice_of_the_global_ones(spawned):
    # 5 samples in batches of 4 over 2x2: rank 1's lanes get nothing (it still takes part in the gather)
    assert spawned[0][5]["ranges"] == [[(0, 4)], [(0, 4), (4, 5)]]
    assert spawned[1][5]["ranges"] == [[(4, 5)], [(5, 5), (5, 5)]]
    assert spawned[1][11]["ranges"] == [[(6, 11)], [(6, 9), (9, 11)]]


def test_agreement_is_the_same_on_every_rank(spawned):
    for result in spawned:
        assert result["agree"][0] == (2, [])  # the fewest lanes any rank has
        assert result["agree"][1] == (0, ["rank 1: no room"])  # one rank alone: every rank alone, its reason
