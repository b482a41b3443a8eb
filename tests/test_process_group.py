"""Layout independence of the collectives (issue 11, contract 3): for a global world W the bits of
reduce_scatter / all_reduce / all_gather / broadcast are the same whether the W lanes run in one
process (1 x W: the in-process communicators) or spread over processes (P x L, gloo on CPU).

One spawn of 4 processes (spawning costs seconds) runs every layout through subgroups:
4x1 (all four), 2x2 (ranks 2, 3: a subgroup, so group-local ranks differ from global ones),
3x1 (ranks 1-3) and 2x1 (ranks 0, 1); rank 0 also runs 1x4, 1x3 and 1x2 with the local, p2p and
host communicators. Every process runs one intra-op thread (bitwise comparisons only between
processes on this machine with the same thread count). The inputs cancel (+-1e6 terms on top of
small values), so another summation order gives other bits: the test shows it does
(a pairwise and a reversed order differ from the canonical one), so it can fail.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpq.comm.comm_base import ring_wire_bytes
from dpq.comm.communicators import select_communicator
from dpq.comm.process_group import ProcessGroupCommunicator
from dpq.streams import make_lanes
from tests.processes import worker_context

N_RS = 5  # reduce_scatter chunk per lane
N_AR = 37  # all_reduce length: divisible by none of 2, 3, 4
N_AG = 7
# layout name -> (group ranks, lanes per process)
LAYOUTS = {"4x1": ([0, 1, 2, 3], 1), "2x2": ([2, 3], 2), "3x1": ([1, 2, 3], 1), "2x1": ([0, 1], 1)}


def cancelling(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Per global lane: small values of mixed magnitude, on top of which each element carries
    -1, 0 or +1 times a shared ~1e6 (per lane at random), so big terms cancel between lanes."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(numel, generator=gen) * 1e6
    out = []
    for _ in range(world):
        x = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-4, 3, (numel,), generator=gen).float()
        out.append(x + torch.randint(-1, 2, (numel,), generator=gen).float() * big)
    return out


def inputs(world: int) -> dict[str, list[torch.Tensor]]:
    """Every collective's per-global-lane input, the same in every process."""
    ag = cancelling(world, N_AG, 5)
    for g, x in enumerate(ag):  # exact copies: -0.0 and a NaN payload must survive
        x[0], x[1] = -0.0, torch.tensor(0x7FC0_1234, dtype=torch.int32).view(torch.float32)
        x[2] = float(g)
    return {
        "rs": cancelling(world, world * N_RS, 1),
        "rs16": [x.bfloat16() for x in cancelling(world, world * N_RS, 2)],
        "ar": cancelling(world, N_AR, 3),
        "ar16": [x.bfloat16() for x in cancelling(world, N_AR, 4)],
        "ar8": [torch.arange(N_AR, dtype=torch.uint8) * (g + 7) for g in range(world)],
        "ag": ag,
        "ag8": [torch.full((N_AG,), g + 1, dtype=torch.uint8) for g in range(world)],
        "bc": cancelling(world, 9, 6),
    }


def run_collectives(comm, offset: int) -> dict[str, list[torch.Tensor]]:
    """Every collective on this process's lanes (global lanes offset .. offset + L - 1); the
    outputs per local lane."""
    world, lanes = comm.world, range(len(comm.lanes))
    data = inputs(world)
    mine = {key: [xs[offset + k].clone() for k in lanes] for key, xs in data.items()}
    out = {}
    for key in ("rs", "rs16"):
        out[key] = [torch.empty(N_RS, dtype=mine[key][0].dtype) for _ in lanes]
        comm.reduce_scatter(mine[key], out[key])
    for key in ("ar", "ar16", "ar8"):
        comm.all_reduce(mine[key])
        out[key] = mine[key]
    for key in ("ag", "ag8"):
        out[key] = [torch.empty(world * N_AG, dtype=mine[key][0].dtype) for _ in lanes]
        comm.all_gather(mine[key], out[key])
    for root in (world - 1, 1):
        bufs = [x.clone() for x in mine["bc"]]
        comm.broadcast(bufs, root=root)
        out[f"bc{root}"] = bufs
    return out


def other_orders(world: int) -> dict[str, torch.Tensor]:
    """all_reduce input "ar" summed in non-canonical orders: reversed and (W = 4) pairwise, the
    order the process-group communicator used before at 2 x 2."""
    xs = inputs(world)["ar"]
    reversed_sum = xs[-1].clone()
    for x in reversed(xs[:-1]):
        reversed_sum += x
    orders = {"reversed": reversed_sum}
    if world == 4:
        orders["pairwise"] = (xs[0] + xs[1]) + (xs[2] + xs[3])
    return orders


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4, timeout=timeout)
    groups = {name: dist.new_group(ranks) for name, (ranks, _) in LAYOUTS.items()}  # every rank, same order
    saved: dict = {}
    for name, (ranks, per_process) in LAYOUTS.items():
        if rank not in ranks:
            continue
        group = None if name == "4x1" else groups[name]
        lanes = make_lanes(["cpu"] * per_process)
        comm = ProcessGroupCommunicator(lanes, inner=select_communicator(lanes)[0], group=group)
        assert comm.lane_offset == ranks.index(rank) * per_process and comm.world == len(ranks) * per_process
        saved[name] = {"offset": comm.lane_offset, "out": run_collectives(comm, comm.lane_offset),
                       "wire_bytes": comm.wire_bytes, "p2p_bytes_sent": comm.p2p_bytes_sent}
        dist.barrier(group)
    if rank == 0:
        for world in (2, 3, 4):
            for prefer in ("local", "p2p", "host"):
                comm, _ = select_communicator(make_lanes(["cpu"] * world), prefer=prefer)
                saved[f"1x{world}-{prefer}"] = {"offset": 0, "out": run_collectives(comm, 0),
                                                "wire_bytes": comm.wire_bytes}
            saved[f"orders{world}"] = other_orders(world)
    torch.save(saved, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def per_global_lane(results: list[dict], name: str) -> dict:
    """layout ``name`` -> {key: [output of global lane 0, 1, ...]}, and its wire bytes per process."""
    parts = sorted((r[name] for r in results if name in r), key=lambda s: s["offset"])
    keys = parts[0]["out"].keys()
    return {"out": {key: [t for p in parts for t in p["out"][key]] for key in keys},
            "wire_bytes": [p["wire_bytes"] for p in parts],
            "p2p_bytes_sent": [p.get("p2p_bytes_sent") for p in parts]}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def expected_wire_bytes(world: int) -> int:
    """The ring bytes of run_collectives' calls: reduce-scatter and all-gather counts, as 1 x W."""
    return (
        ring_wire_bytes("reduce_scatter", world, world * N_RS, 4)
        + ring_wire_bytes("reduce_scatter", world, world * N_RS, 2)
        + sum(ring_wire_bytes("all_reduce", world, N_AR, s) for s in (4, 2, 1))
        + ring_wire_bytes("all_gather", world, world * N_AG, 4)
        + ring_wire_bytes("all_gather", world, world * N_AG, 1)
        + 2 * ring_wire_bytes("broadcast", world, 9, 4)
    )


def expected_p2p_bytes(processes: int, lanes: int, rank: int) -> int:
    """Bytes one process hands to point-to-point sends in run_collectives: every chunk another
    process owns, from each of its lanes, then (all_reduce) its own chunks' sums, (all_gather)
    its lanes' parts, once to every other process."""
    world, others = processes * lanes, processes - 1
    scatter = lanes * others * lanes * N_RS * (4 + 2)
    bounds = [c * (N_AR // world) + min(c, N_AR % world) for c in range(world + 1)]
    mine = bounds[(rank + 1) * lanes] - bounds[rank * lanes]
    reduce = (lanes * (N_AR - mine) + others * mine) * (4 + 2 + 1)
    gather = others * lanes * N_AG * (4 + 1)
    return scatter + reduce + gather


def test_layouts_give_the_same_bits(tmp_path):
    worker_context()  # the server preloads what the workers import
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=4, join=True,
                       start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    layouts = {"4x1": 4, "2x2": 4, "3x1": 3, "2x1": 2}
    for world in (2, 3, 4):
        ref = per_global_lane(results, f"1x{world}-local")
        data = inputs(world)
        # the reference is the canonical fold, and another order would give other bits
        canonical = data["ar"][0] + data["ar"][1]
        for x in data["ar"][2:]:
            canonical += x
        assert all(same_bits(t, canonical) for t in ref["out"]["ar"])
        if world >= 3:
            for order, other in results[0][f"orders{world}"].items():
                assert not torch.equal(other, canonical), f"{order} order gives the canonical bits at W={world}"
        names = [f"1x{world}-p2p", f"1x{world}-host"] + [n for n, w in layouts.items() if w == world]
        for name in names:
            got = per_global_lane(results, name)
            for key, outs in ref["out"].items():
                assert len(got["out"][key]) == world
                for g, (a, b) in enumerate(zip(got["out"][key], outs, strict=True)):
                    assert same_bits(a, b), f"{name} differs from 1x{world} in {key} on global lane {g}"
            assert got["wire_bytes"] == [expected_wire_bytes(world)] * len(got["wire_bytes"]) == \
                [ref["wire_bytes"][0]] * len(got["wire_bytes"]), name
            if "x" in name and not name.startswith("1x"):
                processes, lanes = map(int, name.split("x"))
                assert got["p2p_bytes_sent"] == [expected_p2p_bytes(processes, lanes, r) for r in range(processes)]
    # the values themselves: all_gather copies exactly, broadcast copies the root's buffer
    data4 = inputs(4)
    ref4 = per_global_lane(results, "4x1")["out"]
    assert all(same_bits(t, torch.cat(data4["ag"])) for t in ref4["ag"])
    assert all(same_bits(t, data4["bc"][3]) for t in ref4["bc3"])
    assert all(same_bits(t, data4["bc"][1]) for t in ref4["bc1"])


def test_stream_order_in_one_process():
    """Contract 4 for the process-group communicator's in-process legs (the lanes' parts read at
    lane 0, the results copied out): 3 lanes of one gloo process under the stream-order checker,
    each lane writing its inputs on its stream and reading its outputs there, home reading them."""
    from dpqlab.stream_checker import StreamOrderChecker

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with StreamOrderChecker() as chk:
            lanes = make_lanes(["cpu"] * 3)
            comm = ProcessGroupCommunicator(lanes, inner=select_communicator(lanes)[0])

            def on_lanes(make):
                out = []
                for k, lane in enumerate(lanes):
                    with lane.issue():
                        out.append(make(k))
                return out

            send = on_lanes(lambda k: torch.full((12,), float(k + 1)))
            recv = on_lanes(lambda k: torch.empty(4))
            comm.reduce_scatter(send, recv)
            bufs = on_lanes(lambda k: torch.full((10,), float(k)))
            comm.all_reduce(bufs)
            gathered = on_lanes(lambda k: torch.empty(12))
            comm.all_gather(recv, gathered)
            comm.broadcast(bufs, root=2)
            results = on_lanes(lambda k: torch.cat([recv[k], bufs[k], gathered[k]]).sum())
            home = [lane.hand_home(r) for lane, r in zip(lanes, results, strict=True)]
            assert [float(h) for h in home] == [4 * 6 + 10 * 3 + 12 * 6] * 3
        assert chk.violations == []
        with pytest.raises(TypeError, match="across processes use all_reduce"):
            comm.reduce(bufs)
    finally:
        dist.destroy_process_group()
