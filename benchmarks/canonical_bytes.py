"""Bytes on the wire of the canonical reduction order, counted by the communicators themselves.

    .venv/bin/python -m benchmarks.canonical_bytes

Two counts for 2^20 fp32 values (4 MiB), next to the ring's bytes (NCCL's bus bytes,
``dpq.comm.comm_base.ring_wire_bytes``):

* CuPy NCCL (the recording fake of ``cupy.cuda.nccl`` in tests/, which really moves the bytes):
  the bytes of every ``send`` call per rank, W = 2, 4, 8;
* the process-group communicator on gloo, 4 processes on this host, as 4x1 and 2x2:
  ``p2p_bytes_sent`` per process (what this process hands to torch.distributed).

Bytes only: on a 2-core VM the wall time of gloo collectives is noise.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from dpq.comm.comm_base import ring_wire_bytes  # noqa: E402

N = 1 << 20
OPS = ("reduce_scatter", "all_reduce", "all_gather")


def _args(op: str, lanes: int, world: int) -> tuple:
    if op == "reduce_scatter":
        return [torch.randn(N) for _ in range(lanes)], [torch.empty(N // world) for _ in range(lanes)]
    if op == "all_reduce":
        return ([torch.randn(N) for _ in range(lanes)],)
    return [torch.randn(N // world) for _ in range(lanes)], [torch.empty(N) for _ in range(lanes)]


def nccl_send_bytes() -> list[tuple[int, str, int, int]]:
    """(W, op, most bytes any rank sent, ring bytes) through the fake CuPy NCCL."""
    from dpq.nccl_comm import CupyNcclCommunicator
    from dpqlab import fake_cupy_nccl

    class _Setter:  # what fake_cupy_nccl.install needs of pytest's monkeypatch
        def setitem(self, d, k, v):
            d[k] = v

    class OnCpu(CupyNcclCommunicator):
        def _check_device(self, t, lane) -> None:  # CPU tensors stand in for GPUs
            return None

    rows = []
    for world in (2, 4, 8):
        fake = fake_cupy_nccl.install(_Setter())
        lanes = [types.SimpleNamespace(index=k, device=torch.device("cuda", k), stream=None, stream_handle=k,
                                       issue=contextlib.nullcontext) for k in range(world)]
        comm = OnCpu(lanes)
        for op in OPS[:2]:
            fake.calls.clear()
            getattr(comm, op)(*_args(op, world, world))
            sent = [0] * world
            for c in fake.calls:
                if isinstance(c, fake_cupy_nccl.Call) and c.op == "send":
                    sent[c.rank] += c.count * 4
            rows.append((world, op, max(sent), ring_wire_bytes(op, world, N, 4)))
    return rows


def _worker(rank: int, store: str, out: str) -> None:
    from dpq.comm.process_group import ProcessGroupCommunicator
    from dpq.fallback_p2p import LocalCommunicator
    from dpq.streams import make_lanes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=120))
    pair = dist.new_group([0, 1])
    result = {}
    for layout, group, lanes, members in (("4x1", None, 1, (0, 1, 2, 3)), ("2x2", pair, 2, (0, 1))):
        if rank in members:
            local = make_lanes(["cpu"] * lanes)
            comm = ProcessGroupCommunicator(local, inner=LocalCommunicator(local), group=group)
            for op in OPS:
                before = comm.p2p_bytes_sent
                getattr(comm, op)(*_args(op, lanes, comm.world))
                result[layout, op] = comm.p2p_bytes_sent - before
        dist.barrier()
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def main() -> int:
    print(f"{N} fp32 values ({N * 4 // 2**20} MiB); bytes")
    print("CuPy NCCL (fake): W, op, most bytes any rank sent, ring bytes per lane")
    for world, op, sent, ring in nccl_send_bytes():
        print(f"  W={world} {op:<15} {sent:>10,} {ring:>10,}{'' if sent == ring else '  <- differs'}")
    out = tempfile.mkdtemp()
    mp.spawn(_worker, args=(f"{out}/store", out), nprocs=4, join=True)
    got = torch.load(f"{out}/rank0.pt")
    print("gloo, process group communicator: layout, op, bytes this process sent, ring bytes per lane x lanes")
    for (layout, op), sent in got.items():
        lanes = 1 if layout == "4x1" else 2
        print(f"  {layout} {op:<15} {sent:>10,} {lanes * ring_wire_bytes(op, 4, N, 4):>10,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
