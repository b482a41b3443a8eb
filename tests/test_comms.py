"""Communicators: every collective on CPU lanes, the NCCL call sequences (recording fake), the choice."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.distributed as dist

from dpq import nccl_comm
from dpq.comm.comm_base import Communicator, ring_wire_bytes
from dpq.comm.communicators import select_communicator
from dpq.comm.process_group import ProcessGroupCommunicator
from dpq.fallback_p2p import HostStagedCommunicator, LocalCommunicator, PeerCopyCommunicator, XpuCopyCommunicator
from dpq.nccl_comm import CupyNcclCommunicator, TorchNcclCommunicator, cupy_nccl_available
from dpq.refusals import HPU_MULTI_LANE
from dpq.streams import Lane, make_lanes
from dpqlab import fake_cupy_nccl

WORLDS = [1, 2, 3, 4]
SIZES = [1, 37, 1000]
# per-element bound on a W-term sum against float64 in assert_sum: W * EPS * sum|x|; the any-order
# bound is (W - 1) u sum|x| (tests/numerics.py), u = 2**-24 (fp32) or 2**-8 (bf16): EPS >= u covers it
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def gloo_world1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(params=["local", "p2p", "host", "pg"])
def make_comm(request):
    """W -> a communicator over W CPU lanes (pg: a real gloo group of one process)."""
    if request.param == "pg":
        request.getfixturevalue("gloo_world1")

    def make(world: int):
        lanes = make_lanes(["cpu"] * world)
        if request.param == "pg":
            return ProcessGroupCommunicator(lanes, inner=select_communicator(lanes)[0])
        comm, _ = select_communicator(lanes, prefer=request.param)
        return comm

    return make


def lane_data(world: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Random per-lane buffers with exact zeros sprinkled in (one lane all zero when W >= 3)."""
    gen = torch.Generator().manual_seed(seed + 1000 * world + n)
    if dtype == torch.uint8:
        return [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for _ in range(world)]
    out = []
    for k in range(world):
        x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 4, (n,), generator=gen)
        x[torch.rand(n, generator=gen) < 0.2] = 0.0
        if world >= 3 and k == 1:
            x.zero_()
        out.append(x.to(dtype))
    return out


def lane_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = xs[0].clone()
    for x in xs[1:]:
        acc += x
    return acc


def assert_sum(out: list[torch.Tensor], inputs: list[torch.Tensor], exact_order: bool = True) -> None:
    """Identical bits on every lane; within fp tolerance of the float64 sum; exactly the lane-order sum."""
    for t in out[1:]:
        assert torch.equal(t.view(torch.uint8), out[0].view(torch.uint8)), "lanes differ"
    ref64 = sum(x.double() for x in inputs)
    bound = len(inputs) * EPS[inputs[0].dtype] * sum(x.double().abs() for x in inputs) + 1e-30
    assert bool(((out[0].double() - ref64).abs() <= bound).all())
    if exact_order:
        assert torch.equal(out[0], lane_order_sum(inputs))


# -- every collective on CPU lanes --------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce(make_comm, world, dtype):
    comm = make_comm(world)
    assert isinstance(comm, Communicator)
    for n in SIZES:
        inputs = lane_data(world, n, dtype)
        bufs = [x.clone() for x in inputs]
        before = comm.wire_bytes
        comm.all_reduce(bufs)
        assert_sum(bufs, inputs)
        assert comm.wire_bytes - before == 2 * (world - 1) * n * bufs[0].element_size() // world


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter(make_comm, world):
    comm = make_comm(world)
    for n in SIZES:
        send = lane_data(world, world * n, torch.float32)
        originals = [s.clone() for s in send]
        recv = [torch.full((n,), float("nan")) for _ in range(world)]
        before = comm.wire_bytes
        comm.reduce_scatter(send, recv)
        full = lane_order_sum(originals)
        for k in range(world):
            chunk = slice(k * n, (k + 1) * n)
            assert_sum([recv[k]], [x[chunk] for x in originals])
            assert torch.equal(recv[k], full[chunk])
        assert all(torch.equal(s, o) for s, o in zip(send, originals, strict=True)), "send buffers changed"
        assert comm.wire_bytes - before == (world - 1) * world * n * 4 // world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_all_gather(make_comm, world, dtype):
    comm = make_comm(world)
    for n in SIZES:
        send = lane_data(world, n, dtype)
        if dtype == torch.float32:
            send[0][0] = -0.0  # gathers move bits, signed zeros included
        recv = [torch.zeros(world * n, dtype=dtype) for _ in range(world)]
        before = comm.wire_bytes
        comm.all_gather(send, recv)
        expected = torch.cat(send).view(torch.uint8)
        for r in recv:
            assert torch.equal(r.view(torch.uint8), expected)
        nbytes = (world - 1) * world * n * send[0].element_size() // world
        assert comm.wire_bytes - before == nbytes


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_broadcast(make_comm, world, dtype):
    comm = make_comm(world)
    for root in range(world):
        bufs = lane_data(world, 37, dtype, seed=root)
        expected = bufs[root].clone()
        before = comm.wire_bytes
        comm.broadcast(bufs, root=root)
        assert all(torch.equal(b, expected) for b in bufs)
        assert comm.wire_bytes - before == (world - 1) * 37 * bufs[0].element_size() // world


@pytest.mark.parametrize("name", ["local", "p2p", "host"])
@pytest.mark.parametrize("world", WORLDS)
def test_reduce_in_process(name, world):
    comm, _ = select_communicator(make_lanes(["cpu"] * world), prefer=name)
    for root in range(world):
        inputs = lane_data(world, 37, torch.float32, seed=root)
        bufs = [x.clone() for x in inputs]
        comm.reduce(bufs, root=root)
        assert torch.equal(bufs[root], lane_order_sum(inputs))
        assert all(torch.equal(bufs[k], inputs[k]) for k in range(world) if k != root)


def test_world_one_shortcuts():
    comm = LocalCommunicator(make_lanes(["cpu"]))
    buf = torch.randn(5)
    keep = buf.clone()
    comm.all_reduce([buf])
    comm.broadcast([buf])
    assert torch.equal(buf, keep)
    recv = [torch.empty(5)]
    comm.reduce_scatter([buf], recv)
    assert torch.equal(recv[0], buf) and recv[0].data_ptr() != buf.data_ptr()
    recv = [torch.empty(5)]
    comm.all_gather([buf], recv)
    assert torch.equal(recv[0], buf)
    assert comm.wire_bytes == 0


def test_wire_bytes_formula():
    assert ring_wire_bytes("all_reduce", 4, 1000, 4) == 6000
    assert ring_wire_bytes("reduce_scatter", 4, 1000, 4) == 3000
    assert ring_wire_bytes("all_gather", 3, 10, 1) == 6
    assert ring_wire_bytes("broadcast", 3, 1, 4) == 2  # floor of 8/3
    assert ring_wire_bytes("all_reduce", 1, 1000, 4) == 0


def test_rejects_bad_buffers():
    comm = PeerCopyCommunicator(make_lanes(["cpu"] * 2))
    with pytest.raises(ValueError, match="1 buffers for 2 lanes"):
        comm.all_reduce([torch.zeros(3)])
    with pytest.raises(ValueError, match=r"bufs\[1\] has 4 elements, expected 3"):
        comm.all_reduce([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="1-D and contiguous"):
        comm.all_reduce([torch.zeros(3, 2), torch.zeros(3, 2)])
    with pytest.raises(TypeError, match="float32, bfloat16, uint8"):
        comm.all_reduce([torch.zeros(3, dtype=torch.float64)] * 2)
    with pytest.raises(ValueError, match=r"send\[0\] has 3 elements, expected 6"):
        comm.reduce_scatter([torch.zeros(3)] * 2, [torch.zeros(3)] * 2)
    with pytest.raises(ValueError, match="root 2 is not a rank"):
        comm.broadcast([torch.zeros(3)] * 2, root=2)
    with pytest.raises(ValueError, match="lanes on one device"):
        LocalCommunicator([Lane(0, torch.device("cpu")), Lane(1, torch.device("cuda", 0))])


# -- the process-group communicator (layouts across real processes: tests/test_process_group.py) ---


def test_process_group_needs_init():
    with pytest.raises(RuntimeError, match=r"torch\.distributed initialised"):
        ProcessGroupCommunicator(lanes := make_lanes(["cpu"]), inner=LocalCommunicator(lanes))


# -- select_communicator ------------------------------------------------------------------


def lanes_on(*devices: str) -> list[Lane]:
    return [Lane(k, torch.device(d)) for k, d in enumerate(devices)]


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setattr(nccl_comm, "cupy_nccl_available", lambda: False)


def peer_access(monkeypatch, allowed: bool) -> None:
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: allowed)


def test_select_single_lane_and_shared_device():
    comm, reason = select_communicator(make_lanes(["cpu"]))
    assert comm.name == "local" and "one lane" in reason
    comm, reason = select_communicator(make_lanes(["cpu"] * 3))
    assert comm.name == "local" and "share cpu" in reason
    comm, reason = select_communicator(lanes_on("cuda:1", "cuda:1"))
    assert isinstance(comm, LocalCommunicator) and "share cuda:1" in reason


def test_select_cupy_when_available(monkeypatch):
    fake = fake_cupy_nccl.install(monkeypatch)
    assert cupy_nccl_available()
    comm, reason = select_communicator(lanes_on("cuda:0", "cuda:1"))
    assert isinstance(comm, CupyNcclCommunicator) and "CuPy" in reason
    assert fake.calls == [("initAll", [0, 1])]


def test_select_torch_nccl_without_cupy(monkeypatch, no_cupy):
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: True)
    comm, reason = select_communicator(lanes_on("cuda:0", "cuda:1", "cuda:2"))
    assert isinstance(comm, TorchNcclCommunicator) and "pip install auto-round-dp[cuda12]" in reason


def test_the_registry_orders_the_nccl_kinds(monkeypatch, no_cupy):
    """The plan takes, for lanes on distinct GPUs, the NCCL kind of lowest priority that is available here,
    with its own reason (no kind named in the choice): a kind registered ahead of the others is taken
    where it is available and passed by where it is not."""
    from dpq.comm import communicators
    from dpq.comm.comm_base import CommunicatorBase

    class Planted(CommunicatorBase):
        name, nccl, priority, up = "planted-nccl", True, -1, True

        @classmethod
        def available(cls) -> bool:
            return cls.up

    monkeypatch.setitem(communicators.COMMUNICATORS, "planted-nccl", Planted)
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: True)
    assert communicators.choose_communicator(["cuda:0", "cuda:1"]) == ("planted-nccl", "2 distinct GPUs: planted-nccl")
    Planted.up = False
    name, reason = communicators.choose_communicator(["cuda:0", "cuda:1"])
    assert name == "torch-nccl" and "CuPy absent" in reason


@pytest.mark.parametrize(("peer", "name"), [(True, "p2p"), (False, "host")])
def test_select_without_nccl(monkeypatch, no_cupy, peer, name):
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: False)
    peer_access(monkeypatch, peer)
    comm, reason = select_communicator(lanes_on("cuda:0", "cuda:1"))
    assert comm.name == name and "no NCCL" in reason and ("peer access" in reason)


@pytest.mark.parametrize(("peer", "cls"), [(True, PeerCopyCommunicator), (False, HostStagedCommunicator)])
def test_select_shared_gpus_avoid_nccl(monkeypatch, peer, cls):
    fake = fake_cupy_nccl.install(monkeypatch)  # NCCL would be available: still not chosen
    peer_access(monkeypatch, peer)
    comm, reason = select_communicator(lanes_on("cuda:0", "cuda:0", "cuda:1"))
    assert type(comm) is cls and "some shared (NCCL takes one GPU per rank)" in reason
    assert fake.calls == []


def test_select_xpu_mixed_hpu():
    comm, reason = select_communicator(lanes_on("xpu:0", "xpu:1"))
    assert isinstance(comm, XpuCopyCommunicator) and comm.name == "xpu-copy" and "oneCCL" in reason
    comm, reason = select_communicator(lanes_on("cuda:0", "cpu"))
    assert comm.name == "host" and "mix device types" in reason
    with pytest.raises(ValueError) as err:
        select_communicator(lanes_on("hpu:0", "hpu:1"))
    assert HPU_MULTI_LANE in str(err.value)
    with pytest.raises(ValueError, match="Gaudi"):
        select_communicator(lanes_on("hpu:0", "hpu:1"), prefer="host")
    assert select_communicator(lanes_on("hpu:0"))[0].name == "local"


def test_select_prefer(monkeypatch):
    comm, reason = select_communicator(make_lanes(["cpu"] * 2), prefer="host")
    assert isinstance(comm, HostStagedCommunicator) and "forced" in reason
    with pytest.raises(ValueError, match="unknown communicator 'mpi'"):
        select_communicator(make_lanes(["cpu"] * 2), prefer="mpi")
    with pytest.raises(ValueError, match="one device"):
        select_communicator(lanes_on("cuda:0", "cuda:1"), prefer="local")
    with pytest.raises(ValueError, match="xpu lanes"):
        select_communicator(make_lanes(["cpu"] * 2), prefer="xpu-copy")
    with pytest.raises(ValueError, match="NCCL needs CUDA lanes"):
        select_communicator(make_lanes(["cpu"] * 2), prefer="torch-nccl")
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy absent, whatever is installed
    with pytest.raises(RuntimeError, match=r"pip install auto-round-dp\[cuda12\]"):
        select_communicator(lanes_on("cuda:0", "cuda:1"), prefer="cupy-nccl")
    assert not cupy_nccl_available()


# -- NCCL communicators: refusals and the recorded call sequence ---------------------------


@pytest.mark.parametrize("cls", [CupyNcclCommunicator, TorchNcclCommunicator])
def test_nccl_refuses_shared_gpu_before_any_nccl_call(monkeypatch, cls):
    fake = fake_cupy_nccl.install(monkeypatch)
    with pytest.raises(ValueError, match=r"share a GPU: NCCL takes one GPU per rank"):
        cls(lanes_on("cuda:0", "cuda:1", "cuda:0"))
    assert fake.calls == []


def fake_cuda_lanes(world: int):
    return [
        types.SimpleNamespace(
            index=k, device=torch.device("cuda", k), stream=None, stream_handle=1000 + k, issue=contextlib.nullcontext
        )
        for k in range(world)
    ]


@pytest.fixture
def fake_cupy_comm(monkeypatch):
    """W -> (CupyNcclCommunicator over fake cuda lanes, the recording fake). CPU tensors stand in for GPU buffers."""
    fake = fake_cupy_nccl.install(monkeypatch)
    monkeypatch.setattr(CupyNcclCommunicator, "_check_device", lambda self, t, lane: None)

    def make(world):
        comm = CupyNcclCommunicator(fake_cuda_lanes(world))
        assert fake.calls == [("initAll", list(range(world)))]
        fake.calls.clear()
        return comm, fake

    return make


def expect_group(fake, op, per_rank):
    """One groupStart, the W rank calls in rank order, one groupEnd, nothing else."""
    calls = [fake_cupy_nccl.Call(op, k, *args) for k, args in enumerate(per_rank)]
    assert fake.calls == [("groupStart",), *calls, ("groupEnd",)]
    fake.calls.clear()


NCCL_DTYPES = [
    (torch.float32, fake_cupy_nccl.NCCL_FLOAT32),
    (torch.bfloat16, fake_cupy_nccl.NCCL_BFLOAT16),
    (torch.uint8, fake_cupy_nccl.NCCL_UINT8),
]


def sendrecv(k, dt, stream, sends, recvs):
    """Rank k's expected calls: sends ``(ptr, count, peer)``, then recvs ``(ptr, count, peer)``
    (ptr None: a staging buffer, address not known to the test); empty messages are not issued."""
    out = [fake_cupy_nccl.Call("send", k, p, None, c, dt, None, stream, j) for p, c, j in sends if c]
    return out + [fake_cupy_nccl.Call("recv", k, None, p, c, dt, None, stream, j) for p, c, j in recvs if c]


def expect_sendrecv_group(fake, per_rank):
    """One groupStart, rank 0's calls, rank 1's, ..., one groupEnd; staging addresses wildcarded."""
    calls = [c for rank in per_rank for c in rank]
    got = fake.calls[: len(calls) + 2]
    got = [c._replace(recvptr=None) if isinstance(c, fake_cupy_nccl.Call) and e.recvptr is None else c
           for c, e in zip(got, [None, *calls, None], strict=True) if c is not None]
    assert got == [("groupStart",), *calls, ("groupEnd",)]
    del fake.calls[: len(calls) + 2]


def bounds_of(numel, world):
    size, extra = divmod(numel, world)
    return [c * size + min(c, extra) for c in range(world + 1)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("dtype", "code"), NCCL_DTYPES)
def test_cupy_nccl_call_sequence(fake_cupy_comm, world, dtype, code):
    """The canonical send/recv groups, and what they compute (the fake moves the bytes): the
    lane-order sums, bitwise, the local communicator's."""
    comm, fake = fake_cupy_comm(world)
    n, isz = 6, torch.tensor([], dtype=dtype).element_size()
    stream = [1000 + k for k in range(world)]
    local, _ = select_communicator(make_lanes(["cpu"] * world), prefer="local")

    def rank(k, sends, recvs):
        return sendrecv(k, code, stream[k], sends, recvs)

    inputs = lane_data(world, n, dtype)
    bufs = [x.clone() for x in inputs]
    ptr = [b.data_ptr() for b in bufs]
    b, peers = bounds_of(n, world), [[j for j in range(world) if j != k] for k in range(world)]
    comm.all_reduce(bufs)
    size = [b[c + 1] - b[c] for c in range(world)]  # world 4: 2, 2, 1, 1 (6 is not a multiple of 4)
    expect_sendrecv_group(fake, [rank(k, [(ptr[k] + b[j] * isz, size[j], j) for j in peers[k]],
                                      [(None, size[k], j) for j in peers[k]]) for k in range(world)])
    expect_sendrecv_group(fake, [rank(k, [(ptr[k] + b[k] * isz, size[k], j) for j in peers[k]],
                                      [(ptr[k] + b[j] * isz, size[j], j) for j in peers[k]]) for k in range(world)])
    assert fake.calls == []
    expected = [x.clone() for x in inputs]
    local.all_reduce(expected)
    assert all(torch.equal(t, expected[0]) for t in bufs) and torch.equal(bufs[0], lane_order_sum(inputs))

    send = lane_data(world, world * n, dtype, seed=1)
    recv = [torch.zeros(n, dtype=dtype) for _ in range(world)]
    comm.reduce_scatter(send, recv)
    expect_sendrecv_group(fake, [rank(k, [(send[k].data_ptr() + j * n * isz, n, j) for j in peers[k]],
                                      [(None, n, j) for j in peers[k]]) for k in range(world)])
    full = lane_order_sum(send)
    assert all(torch.equal(recv[k], full[k * n : (k + 1) * n]) for k in range(world))

    recv = [torch.zeros(world * n, dtype=dtype) for _ in range(world)]
    comm.all_gather(bufs, recv)
    args = [(ptr[k], recv[k].data_ptr(), n, code, None, stream[k]) for k in range(world)]
    expect_group(fake, "allGather", args)  # count = sendcount = n
    assert all(torch.equal(r, torch.cat(bufs)) for r in recv)

    bufs = lane_data(world, n, dtype, seed=2)
    ptr, keep = [x.data_ptr() for x in bufs], [x.clone() for x in bufs]
    comm.broadcast(bufs, root=1)
    expect_group(fake, "broadcast", [(ptr[k], ptr[k], n, code, 1, stream[k]) for k in range(world)])
    assert all(torch.equal(x, keep[1]) for x in bufs)

    bufs, root = [x.clone() for x in keep], world - 1
    comm.reduce(bufs, root=root)
    expect_sendrecv_group(fake, [rank(k, [(bufs[k].data_ptr(), n if j == root else 0, j) for j in peers[k]],
                                      [(None, n if k == root else 0, j) for j in peers[k]]) for k in range(world)])
    assert torch.equal(bufs[root], lane_order_sum(keep))
    assert all(torch.equal(bufs[k], keep[k]) for k in range(world) if k != root)

    assert comm.wire_bytes == local.wire_bytes + sum(
        ring_wire_bytes(op, world, numel, isz)
        for op, numel in [("reduce_scatter", world * n), ("all_gather", world * n), ("broadcast", n), ("reduce", n)]
    )
    comm.close()
    assert fake.calls == [("destroy", k) for k in range(world)]
    with pytest.raises(RuntimeError, match="after close"):
        comm.all_reduce(bufs)


def sent_bytes(fake, world):
    """Bytes each rank's send calls carried since the last call (fp32), then forgets the calls."""
    sent = [0] * world
    for c in fake.calls:
        if isinstance(c, fake_cupy_nccl.Call) and c.op == "send":
            sent[c.rank] += 4 * c.count
    fake.calls.clear()
    return sent


@pytest.mark.parametrize("world", [3, 4])
def test_cupy_nccl_sums_in_the_canonical_order(fake_cupy_comm, world):
    """Cancelling inputs, where another order gives other bits (shown): reduce_scatter and
    all_reduce give the local communicator's bits exactly, in place too."""
    comm, fake = fake_cupy_comm(world)
    local, _ = select_communicator(make_lanes(["cpu"] * world), prefer="local")
    gen = torch.Generator().manual_seed(world)
    big = torch.randn(world * 40, generator=gen) * 1e6
    inputs = [torch.randn(world * 40, generator=gen) + torch.randint(-1, 2, big.shape, generator=gen) * big
              for _ in range(world)]
    backwards = inputs[-1].clone()
    for x in reversed(inputs[:-1]):
        backwards += x
    assert not torch.equal(backwards, lane_order_sum(inputs)), "the data cannot tell orders apart"
    got, want = [x.clone() for x in inputs], [x.clone() for x in inputs]
    comm.all_reduce(got)
    local.all_reduce(want)
    assert all(torch.equal(g, want[0]) for g in got)
    # what the send calls really put on the wire: every rank exactly the ring all-reduce's bytes
    assert sent_bytes(fake, world) == [ring_wire_bytes("all_reduce", world, world * 40, 4)] * world
    got, want = [torch.empty(40) for _ in range(world)], [torch.empty(40) for _ in range(world)]
    comm.reduce_scatter(inputs, got)
    local.reduce_scatter(inputs, want)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert sent_bytes(fake, world) == [ring_wire_bytes("reduce_scatter", world, world * 40, 4)] * world
    # in place: each lane's receive buffer is its own chunk of the send buffer (the fold must not
    # overwrite its own part before reading it)
    send = [x.clone() for x in inputs]
    comm.reduce_scatter(send, [s[k * 40 : (k + 1) * 40] for k, s in enumerate(send)])
    assert all(torch.equal(s[k * 40 : (k + 1) * 40], want[k]) for k, s in enumerate(send))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cupy_nccl_native_order(fake_cupy_comm, monkeypatch, world):
    """--parallel_order native: one NCCL reduction per collective (no send/recv, no staging, no fold), every
    lane the same bits, which are NCCL's algorithm's (the fake's ring): the canonical order's at 2 lanes (one
    add commutes), not at 3+ on inputs where the order shows."""
    fake = fake_cupy_nccl.install(monkeypatch)
    monkeypatch.setattr(CupyNcclCommunicator, "_check_device", lambda self, t, lane: None)
    comm = CupyNcclCommunicator(fake_cuda_lanes(world), order="native")
    assert not comm.canonical_order and "native" in comm.order_note
    fake.calls.clear()
    local, _ = select_communicator(make_lanes(["cpu"] * world), prefer="local")
    gen = torch.Generator().manual_seed(world)
    big = torch.randn(world * 40, generator=gen) * 1e6
    inputs = [torch.randn(world * 40, generator=gen) + torch.randint(-1, 2, big.shape, generator=gen) * big
              for _ in range(world)]
    got, want = [torch.empty(40) for _ in range(world)], [torch.empty(40) for _ in range(world)]
    comm.reduce_scatter(inputs, got)
    local.reduce_scatter(inputs, want)
    ops = [c.op for c in fake.calls if isinstance(c, fake_cupy_nccl.Call)]
    assert ops == ["reduceScatter"] * world
    for k in range(world):  # the ring's fold of chunk k, starting after its owner
        order = fake_cupy_nccl.ring_order(k, world)
        ring = inputs[order[0]][k * 40:(k + 1) * 40].clone()
        for r in order[1:]:
            ring += inputs[r][k * 40:(k + 1) * 40]
        assert torch.equal(got[k], ring)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) == (world == 2)
    fake.calls.clear()
    bufs = [x.clone() for x in inputs]
    comm.all_reduce(bufs)
    assert [c.op for c in fake.calls if isinstance(c, fake_cupy_nccl.Call)] == ["allReduce"] * world
    assert all(torch.equal(b, bufs[0]) for b in bufs)  # replicas identical
    # any order's sum is within (W-1) roundings of partial sums no larger than W x the largest input
    bound = (world - 1) * torch.finfo(torch.float32).eps * world * max(float(x.abs().max()) for x in inputs)
    assert float((bufs[0] - lane_order_sum(inputs)).abs().max()) <= bound
    with pytest.raises(ValueError, match="order 'fast'"):
        CupyNcclCommunicator(fake_cuda_lanes(world), order="fast")


def test_fake_nccl_fails_on_an_unmatched_send(fake_cupy_comm):
    """The fake is strict: a send nobody receives (NCCL would hang) fails the group."""
    comm, fake = fake_cupy_comm(2)
    buf = torch.zeros(4)
    fake.groupStart()
    comm.comm_set.comms[0].send(buf.data_ptr(), 4, fake_cupy_nccl.NCCL_FLOAT32, 1, 1000)
    with pytest.raises(AssertionError, match="NCCL would hang"):
        fake.groupEnd()


def test_cupy_nccl_world_one_issues_nothing(fake_cupy_comm):
    comm, fake = fake_cupy_comm(1)
    buf = torch.zeros(4)
    comm.all_reduce([buf])
    comm.broadcast([buf])
    assert fake.calls == []


def test_torch_nccl_passes_lane_streams(monkeypatch):
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: True)
    monkeypatch.setattr(TorchNcclCommunicator, "_check_device", lambda self, t, lane: None)
    import torch.cuda.nccl as tnccl

    calls = []
    for fn in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        monkeypatch.setattr(tnccl, fn, lambda *a, _fn=fn, **kw: calls.append((_fn, a, kw)))
    lanes = fake_cuda_lanes(2)
    for lane in lanes:
        lane.stream = object()
    comm = TorchNcclCommunicator(lanes)
    bufs = [torch.zeros(3), torch.zeros(3)]
    comm.all_reduce(bufs)
    comm.broadcast(bufs, root=1)
    comm.reduce_scatter([torch.zeros(6)] * 2, bufs)
    comm.all_gather(bufs, [torch.zeros(6)] * 2)
    comm.reduce(bufs, root=1)
    assert [c[0] for c in calls] == ["all_reduce", "broadcast", "reduce_scatter", "all_gather", "reduce"]
    streams = [lane.stream for lane in lanes]
    assert all(c[2]["streams"] == streams for c in calls)
    assert calls[1][2]["root"] == 1 and calls[4][2]["root"] == 1 and calls[4][2]["output"] is bufs[1]


# -- stream ordering, with recording streams on CPU lanes ----------------------------------


class RecordingStream:
    """Stands in for a device stream: records waits and host syncs (CPU copies run at once)."""

    def __init__(self, log: list, k: int) -> None:
        self.log, self.k = log, k

    def wait_stream(self, other: RecordingStream) -> None:
        self.log.append(("wait", self.k, other.k))

    def synchronize(self) -> None:
        self.log.append(("sync", self.k))


@pytest.mark.parametrize("name", ["local", "p2p", "host"])
def test_stream_ordering(name):
    log: list = []
    lanes = [Lane(k, torch.device("cpu"), RecordingStream(log, k)) for k in range(3)]
    comm, _ = select_communicator(lanes, prefer=name)
    inputs = lane_data(3, 37, torch.float32)
    bufs = [x.clone() for x in inputs]
    comm.all_reduce(bufs)
    assert_sum(bufs, inputs)
    if name == "host":
        # no stream joins: each lane's copies stay on its own stream; the host waits before summing
        assert log == [("sync", 0), ("sync", 1), ("sync", 2)]
    else:
        join = [("wait", 0, 1), ("wait", 0, 2), ("wait", 1, 0), ("wait", 2, 0)]
        assert log[:4] == join, "lane 0 must wait for every lane before it reads their buffers"
        assert log[-4:] == join, "every lane must wait for lane 0 before it touches its buffers again"


@pytest.mark.parametrize("where", ["fresh", "in place on parts[0]", "overlaps parts[0] and parts[1]",
                                   "beside the parts in one buffer", "strided view of the buffer"])
def test_ordered_sum_whatever_out_shares_with_the_parts(where):
    """The canonical fold gives the same bits wherever ``out`` lives: in place on the first part,
    partly over later parts (which must still be read after the first add), or beside them."""
    from dpq.comm.comm_base import ordered_sum

    buf = torch.randn(20, generator=torch.Generator().manual_seed(3)) * 1e4
    parts = [buf[0:4], buf[4:8], buf[8:12]]
    want = (parts[0].clone() + parts[1].clone()) + parts[2].clone()
    out = {"fresh": torch.empty(4), "in place on parts[0]": parts[0], "overlaps parts[0] and parts[1]": buf[2:6],
           "beside the parts in one buffer": buf[12:16], "strided view of the buffer": buf[12:20:2]}[where]
    assert ordered_sum(parts, out) is out
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
