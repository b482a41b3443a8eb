"""NCCL lifecycle (issue 8, items 9-12) with the recording fake of ``cupy.cuda.nccl``, and the mirror price.

9.  One communicator set per device tuple per run, reused by every block's communicator,
    destroyed once by ``close_communicators()`` (what ``disable()`` calls).
10. An NCCL error mid-group: ``groupEnd`` still runs, every rank's handle is aborted, the
    error names the collective, later use is refused clearly, and the next block picks
    device copies for those GPUs.
11. Two ranks on one GPU: refused before any NCCL call with NCCL's own words
    (ncclInvalidUsage), unless NCCL >= 2.30 runs with NCCL_MULTI_RANK_GPU_ENABLE=1.
12. The mirror price: the lane's own share of activations plus the communicator's buffers,
    checked against what a lane's pass allocates (fp32 and bf16 autocast) and against
    auto-round's estimate_tuning_block_mem.

Each test here failed before the change it tests (no cache, no try/finally, no abort, the
old "NCCL hangs" message, a price for the whole batch without communicator buffers).
"""

from __future__ import annotations

import contextlib
import copy
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dpq import nccl_comm
from dpq.comm.communicators import select_communicator
from dpq.comm.nccl_lifecycle import NcclAborted, NcclCollectiveError, NcclInitFailed, close_communicators
from dpq.nccl_comm import CupyNcclCommunicator, TorchNcclCommunicator, cupy_nccl_version, multi_rank_gpu_enabled
from dpqlab import fake_cupy_nccl
from dpqlab.fake_cupy_nccl import Call
from tests.conftest import cast_floating


@pytest.fixture(autouse=True)
def fresh_registry():
    close_communicators()
    yield
    close_communicators()


def cuda_lanes(*ids: int, block: int = 0):
    """Lanes on fake CUDA devices; ``block`` changes the stream handles, as a new block's lanes do."""

    def lane(k, i):
        return types.SimpleNamespace(
            index=k, device=torch.device("cuda", i), stream=None, stream_handle=1000 * (block + 1) + k,
            issue=contextlib.nullcontext,
        )

    return [lane(k, i) for k, i in enumerate(ids)]


@pytest.fixture
def fake(monkeypatch):
    nccl = fake_cupy_nccl.install(monkeypatch)
    for cls in (CupyNcclCommunicator, TorchNcclCommunicator):
        monkeypatch.setattr(cls, "_check_device", lambda self, t, lane: None)  # CPU tensors stand in
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    return nccl


def bufs(world: int, n: int = 4):
    return [torch.zeros(n) for _ in range(world)]


# -- 9: one communicator set per device tuple per run ------------------------------------


def test_blocks_reuse_one_comm_set_per_device_tuple(fake):
    for block in range(3):
        comm, reason = select_communicator(cuda_lanes(0, 1, block=block))
        assert isinstance(comm, CupyNcclCommunicator) and "CuPy" in reason
        b = bufs(2)
        comm.broadcast(b)
        # the shared handles, this block's streams
        streams = [c.stream for c in fake.calls if isinstance(c, Call)]
        assert streams == [1000 * (block + 1), 1000 * (block + 1) + 1]
        assert fake.calls[0] == ("initAll", [0, 1]) if block == 0 else ("groupStart",)
        fake.calls.clear()
    select_communicator(cuda_lanes(0, 1, 2))  # another device tuple: its own set
    select_communicator(cuda_lanes(0, 1, 2), prefer="cupy-nccl")  # forced: the same cached set
    assert fake.calls == [("initAll", [0, 1, 2])]
    fake.calls.clear()

    assert close_communicators() == 2
    assert sorted(fake.calls) == sorted([("destroy", 0), ("destroy", 1), ("destroy", 0), ("destroy", 1),
                                         ("destroy", 2)])
    fake.calls.clear()
    assert close_communicators() == 0 and fake.calls == []
    select_communicator(cuda_lanes(0, 1))  # a new run makes fresh communicators
    assert fake.calls == [("initAll", [0, 1])]


def test_closing_a_shared_wrapper_only_detaches(fake):
    first, _ = select_communicator(cuda_lanes(0, 1))
    first.close()
    with pytest.raises(RuntimeError, match="after close"):
        first.all_reduce(bufs(2))
    second, _ = select_communicator(cuda_lanes(0, 1, block=1))
    second.broadcast(bufs(2))
    assert [c for c in fake.calls if not isinstance(c, Call)] == [("initAll", [0, 1]), ("groupStart",),
                                                                  ("groupEnd",)]
    # an owned communicator (constructed directly) still destroys its own handles
    own = CupyNcclCommunicator(cuda_lanes(2, 3))
    fake.calls.clear()
    own.close()
    assert fake.calls == [("destroy", 0), ("destroy", 1)]


def test_torch_nccl_shares_state_per_device_tuple(fake, monkeypatch):
    monkeypatch.setattr(nccl_comm, "cupy_nccl_available", lambda: False)
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: True)
    a, _ = select_communicator(cuda_lanes(0, 1))
    b, _ = select_communicator(cuda_lanes(0, 1, block=1))
    assert isinstance(a, TorchNcclCommunicator) and a.comm_set is b.comm_set


# -- 10: the group always closes; an error aborts; later use is refused ---------------------


def test_error_mid_group_closes_group_aborts_and_refuses_later_use(fake):
    comm, _ = select_communicator(cuda_lanes(0, 1, 2))
    fake.calls.clear()
    fake.fail[("send", 1)] = fake_cupy_nccl.NCCL_INVALID_USAGE
    b = bufs(3)
    with pytest.raises(NcclCollectiveError) as err:
        comm.all_reduce(b)
    msg = str(err.value)
    assert "all_reduce (to owners): send (rank 1 of 3)" in msg and "cuda devices [0, 1, 2]" in msg
    assert "aborted" in msg and "NCCL_DEBUG=WARN" in msg and "serially" in msg
    assert isinstance(err.value.__cause__, fake_cupy_nccl.NcclError)
    ops = [c if not isinstance(c, Call) else (c.op, c.rank) for c in fake.calls]
    # rank 0's sends and receives, rank 1's first send (fails), the group closed, every handle aborted
    assert ops == [("groupStart",), ("send", 0), ("send", 0), ("recv", 0), ("recv", 0), ("send", 1), ("groupEnd",),
                   ("abort", 0), ("abort", 1), ("abort", 2)]
    fake.calls.clear()

    with pytest.raises(NcclAborted, match=r"aborted after all_reduce \(to owners\): send \(rank 1 of 3\) failed"):
        comm.broadcast(b)
    assert fake.calls == []  # refused before any NCCL call: nothing can wait on the aborted handles
    # the next block over these GPUs: device copies, said why; forcing NCCL is refused clearly
    nxt, reason = select_communicator(cuda_lanes(0, 1, 2, block=1))
    assert nxt.name == "p2p" and "failed earlier in this run" in reason and "no NCCL kind" in reason
    with pytest.raises(NcclAborted):
        select_communicator(cuda_lanes(0, 1, 2, block=1), prefer="cupy-nccl")
    assert fake.calls == []
    # disable() forgets the aborted set (already released: nothing to destroy); a new run may use NCCL
    assert close_communicators() == 0 and fake.calls == []
    assert select_communicator(cuda_lanes(0, 1, 2))[0].name == "cupy-nccl"


def test_failing_group_end_aborts(fake):
    comm, _ = select_communicator(cuda_lanes(0, 1))
    fake.calls.clear()
    fake.fail[("groupEnd", None)] = 3
    with pytest.raises(NcclCollectiveError, match="groupEnd after reduce_scatter"):
        comm.reduce_scatter(bufs(2, 8), bufs(2, 4))
    assert fake.calls[-3:] == [("groupEnd",), ("abort", 0), ("abort", 1)]


def test_interrupt_mid_group_still_closes_and_aborts(fake):
    lanes = cuda_lanes(0, 1)

    @contextlib.contextmanager
    def interrupted():
        raise KeyboardInterrupt
        yield

    lanes[1].issue = interrupted
    comm, _ = select_communicator(lanes)
    fake.calls.clear()
    with pytest.raises(KeyboardInterrupt):
        comm.all_gather(bufs(2, 2), bufs(2, 4))
    ops = [c if not isinstance(c, Call) else (c.op, c.rank) for c in fake.calls]
    assert ops == [("groupStart",), ("allGather", 0), ("groupEnd",), ("abort", 0), ("abort", 1)]


def test_torch_nccl_error_is_clear_and_marks_devices_off_nccl(fake, monkeypatch):
    monkeypatch.setattr(nccl_comm, "cupy_nccl_available", lambda: False)
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: True)
    import torch.cuda.nccl as tnccl

    def boom(*a, **kw):
        raise RuntimeError("NCCL Error 5: invalid usage")

    monkeypatch.setattr(tnccl, "all_reduce", boom)
    comm, _ = select_communicator(cuda_lanes(0, 1))
    with pytest.raises(NcclCollectiveError, match=r"torch\.cuda\.nccl\.all_reduce .*invalid usage"):
        comm.all_reduce(bufs(2))
    with pytest.raises(NcclAborted):
        comm.all_reduce(bufs(2))
    nxt, reason = select_communicator(cuda_lanes(0, 1, block=1))
    assert nxt.name == "p2p" and "failed earlier" in reason


# -- 11: two ranks on one GPU -------------------------------------------------------------


def test_shared_gpu_message_names_current_nccl(fake):
    with pytest.raises(ValueError) as err:
        CupyNcclCommunicator(cuda_lanes(0, 0))
    msg = str(err.value)
    assert "ncclInvalidUsage" in msg and "Duplicate GPU detected" in msg
    assert "NCCL >= 2.30" in msg and "NCCL_MULTI_RANK_GPU_ENABLE=1" in msg and "local communicator" in msg
    assert "hangs" not in msg
    assert fake.calls == []
    _, reason = select_communicator(cuda_lanes(0, 0, 1))
    assert "one GPU per rank" in reason and fake.calls == []


@pytest.mark.parametrize(("code", "env", "allowed"), [(23000, "1", True), (23000, "0", False), (22703, "1", False)])
def test_multi_rank_gpu_needs_nccl_230_and_the_variable(monkeypatch, code, env, allowed):
    fake = fake_cupy_nccl.install(monkeypatch, version_code=code)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", env)
    assert multi_rank_gpu_enabled(cupy_nccl_version()) is allowed
    if allowed:
        comm = CupyNcclCommunicator(cuda_lanes(0, 0))
        assert fake.calls == [("initAll", [0, 0])] and comm.world == 2
    else:
        with pytest.raises(ValueError, match="ncclInvalidUsage"):
            CupyNcclCommunicator(cuda_lanes(0, 0))
        assert fake.calls == []


def test_cupy_nccl_version_decodes_both_encodings(monkeypatch):
    fake_cupy_nccl.install(monkeypatch, version_code=22703)
    assert cupy_nccl_version() == (2, 27, 3)
    fake_cupy_nccl.install(monkeypatch, version_code=2804)
    assert cupy_nccl_version() == (2, 8, 4)


def test_world_one_shortcut_can_be_bypassed(fake):
    comm = CupyNcclCommunicator(cuda_lanes(0))
    fake.calls.clear()
    comm.all_reduce(bufs(1))
    assert fake.calls == []
    comm.shortcut_world_one = False
    comm.all_reduce(bufs(1))
    comm.broadcast(bufs(1))
    send, recv = [torch.arange(4.0)], bufs(1)
    comm.reduce_scatter(send, recv)
    # one rank has no peer to send to: the canonical sums issue empty groups (the all_reduce two);
    # broadcast still runs through NCCL; the reduce-scatter copies the one part
    assert [c if not isinstance(c, Call) else c.op for c in fake.calls] == [
        ("groupStart",), ("groupEnd",), ("groupStart",), ("groupEnd",),
        ("groupStart",), "broadcast", ("groupEnd",), ("groupStart",), ("groupEnd",)]
    assert torch.equal(recv[0], send[0])


# -- 12: the mirror price ----------------------------------------------------------------


class _AllocatedBytes(TorchDispatchMode):
    """The bytes of the tensor storages that ops run under it allocated and that are still alive
    (``now``), and their maximum (``peak``): what a lane's pass allocates, on any platform."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.now -= nbytes
        self._live.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = id(storage), storage.nbytes()
                if key not in self._live and nbytes:
                    self._live.add(key)
                    self.now += nbytes
                    weakref.finalize(storage, self._freed, key, nbytes)
        self.peak = max(self.peak, self.now)
        return out


def _lane_pass(block, runner, pool, share: int) -> tuple[int, int]:
    """One lane's forward + loss + backward on ``share`` samples with auto-round's block forward:
    (bytes autograd keeps for backward, peak bytes the pass allocates). Parameters are left out of
    the first (priced as weights / tuned values); the second counts what ops allocate."""
    inputs, others, outputs = pool
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    for p in block.parameters():
        p.grad = None
    allocated = _AllocatedBytes()
    with allocated, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pred = runner.forward(block, inputs, others, list(range(share)), None)
        ref = torch.cat(outputs[:share])
        with torch.autocast("cpu", dtype=runner.amp_dtype, enabled=runner.amp):
            torch.nn.functional.mse_loss(pred, ref).backward()
        del pred, ref
    return sum(kept.values()), allocated.peak


@pytest.mark.parametrize("compute", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.explicit_bf16)],
                         ids=["fp32", "bf16_autocast"])
def test_mirror_price_against_what_a_lane_allocates_and_auto_round_estimate(recorded_blocks, compute):
    """Both of auto-round's CPU branches, each built explicitly whatever this CPU made auto-round
    choose: the block in fp32 without autocast (a CPU without AVX512-BF16), and in bf16 under bf16
    autocast (auto-round casts the model to its amp dtype). Relations on a real tiny-Llama block
    (64 tokens, 8 samples per iteration):

    * the activation term is the lane's own share: ceil(8 / W) samples;
    * per sample, the activation term covers the peak that one lane's forward + loss + backward
      allocates (measured: every storage an op allocates, tracked), which covers what autograd keeps,
      and is at most 2x that peak (measured fp32 1.20 MiB, bf16 0.66 MiB per sample, priced 1.52 /
      1.01). Priced like bf16 (4 bytes per element, the price before the fp32 fix), fp32 fails here:
      1.0 MiB priced per sample;
    * the whole price (before the margin) covers the mirror's weights, its fp32 tuned values and
      flat gradient buffer, the staged share and that peak, and is at most 3x that;
    * against auto-round's ``estimate_tuning_block_mem`` (serial, whole batch on one device):
      per sample the activation figures agree within 2x (auto-round: every quantized layer's
      output, twice, in the input dtype; dpq: every linear's input and output); the weight-
      proportional part is larger in dpq's (auto-round prices the rounding value in the weight dtype
      and leaves out the fp32 quantize-dequantize intermediates autograd keeps, which the
      measurement shows ``qdq_saved`` covers, and the communicator's buffers); the staged pool
      share equals auto-round's cached input/output
      figure times share / nsamples; auto-round's flat 1 GiB for "other ops" is not a per-mirror
      cost, so its total is far above.
    """
    from auto_round.utils.device import estimate_tuning_block_mem
    from auto_round.wrapper import wrapper_block

    from dpq.planning.plan import MARGIN, price_mirror

    rec = recorded_blocks[0]
    per_iter = rec.quantizer.calibration_context.batch_size  # 8
    block = rec.fresh_block().to(compute)
    pool = tuple(cast_floating(x, compute) for x in (rec.fp_inputs, rec.input_others, rec.fp_outputs))
    runner = copy.copy(rec.quantizer.block_forward)  # auto-round's block forward, in this branch
    runner.amp, runner.amp_dtype = compute != torch.float32, compute
    parts = {w: {} for w in (1, 2, 3, 4)}
    price = {w: price_mirror(block, pool[0], per_iter, world=w, detail=parts[w]) for w in parts}
    assert price_mirror(block, pool[0], per_iter) == price[2]  # default: the largest share of a mirror
    assert price_mirror(block, pool[0], per_iter, 2) == price[2]  # positional, as callers may pass
    assert price_mirror(block, pool[0], per_iter, 2, compute_dtype=compute) == price[2]  # default: the weights'
    for w in parts:
        assert parts[w]["share"] == -(-per_iter // w)
        assert parts[w]["activations"] * per_iter == parts[1]["activations"] * parts[w]["share"]
        assert parts[w]["grad_buffer"] >= 4 * sum(p.numel() for p in block.parameters() if p.dim() == 2)
        assert parts[w]["exchange"] > 0
    assert price[1] > price[2] > price[4]

    # 0.16 returns these four; 0.17 appends per-device breakdowns (not used here)
    layers, layer_act, pool_io, additional = estimate_tuning_block_mem(block, pool[0], per_iter)[:4]
    gib = 2**30
    ar_params = sum(v["param_memory"] for v in layers.values()) * gib
    ar_act_per_sample = 2 * layer_act * gib / per_iter  # counted in layer_act and again in additional
    ours_act_per_sample = parts[1]["activations"] / per_iter
    assert 0.5 <= ours_act_per_sample / ar_act_per_sample <= 2
    weight_part = sum(parts[1][k] for k in ("weights", "tuned_values", "qdq_saved", "grad_buffer"))
    assert weight_part > ar_params
    nsamples = len(rec.fp_inputs)
    assert parts[1]["staging"] == pytest.approx(pool_io * gib * per_iter / nsamples)
    assert price[1] < (ar_params + layer_act * gib + pool_io * gib + additional * gib)

    wrapper_block(block, True, False, enable_torch_compile=False, device="cpu")
    tuned = sum(p.numel() for p in block.parameters() if p.requires_grad)
    (kept_1, peak_1), (kept_n, peak_n) = (_lane_pass(block, runner, pool, s) for s in (1, per_iter))
    kept, peak = ((n - one) / (per_iter - 1) for n, one in ((kept_n, kept_1), (peak_n, peak_1)))
    print(f"{compute}: per sample kept {kept / 2**20:.3f} MiB, peak {peak / 2**20:.3f} MiB, "
          f"priced {ours_act_per_sample / 2**20:.3f} MiB")
    assert 0 < kept <= peak <= ours_act_per_sample <= 2 * peak
    assert kept_1 - kept <= parts[1]["qdq_saved"]  # what is kept beyond the samples': the qdq intermediates
    real = parts[1]["weights"] + 2 * 4 * tuned + parts[1]["staging"] + peak_n  # + values + flat grads
    unpriced = price[1] / MARGIN
    assert real <= unpriced <= 3 * real


def test_disable_destroys_the_runs_communicators(fake):
    """The outermost ``disable()`` ends the run: the cached NCCL handles are destroyed once."""
    from dpq.autoround import disable, enable

    enable(2, "cpu,cpu")
    comm, _ = select_communicator(cuda_lanes(0, 1))
    comm.all_reduce(bufs(2))
    enable(2, "cpu,cpu")  # nested: the inner disable keeps the run (and its communicators) alive
    disable()
    assert ("destroy", 0) not in fake.calls
    disable()
    assert sorted(c for c in fake.calls if c[0] == "destroy") == [("destroy", 0), ("destroy", 1)]


# -- issue 19, item 2: after NCCL failed for some GPUs, no NCCL kind runs on them again ---------------


def test_after_a_cupy_abort_no_nccl_kind_runs_on_those_gpus(fake, monkeypatch):
    """torch.cuda.nccl cannot be aborted: after CuPy's communicators for GPUs 0-2 were aborted, no
    block gets it for them (nor for a tuple sharing one of them); other GPUs keep NCCL."""
    monkeypatch.setattr(nccl_comm, "torch_nccl_available", lambda: True)
    comm, _ = select_communicator(cuda_lanes(0, 1, 2))
    fake.fail[("send", 0)] = fake_cupy_nccl.NCCL_INVALID_USAGE
    with pytest.raises(NcclCollectiveError, match="later blocks use device copies"):
        comm.all_reduce(bufs(3))
    for ids in ((0, 1, 2), (2, 3)):
        nxt, reason = select_communicator(cuda_lanes(*ids, block=1))
        assert nxt.name == "p2p" and "no NCCL kind is used for them again" in reason, (ids, reason)
    assert select_communicator(cuda_lanes(4, 5))[0].name == "cupy-nccl"


def test_an_init_failure_is_remembered_for_the_run(fake):
    """ncclCommInitAll costs seconds: a failed one is not retried by every block. The session's block
    goes on with device copies at once."""
    from dpq.planning.plan import Plan
    from dpq.session import LaneRun, SessionConfig, _communicator

    fake.fail[("initAll", None)] = 2  # ncclSystemError
    with pytest.raises(NcclInitFailed, match="NCCL_ERROR 2"):
        select_communicator(cuda_lanes(0, 1))
    for block in (1, 2):
        nxt, reason = select_communicator(cuda_lanes(0, 1, block=block))
        assert nxt.name == "p2p" and "failed earlier in this run" in reason
    with pytest.raises(NcclInitFailed, match="not retried"):
        select_communicator(cuda_lanes(0, 1), prefer="cupy-nccl")
    plan = Plan([torch.device("cuda", 0), torch.device("cuda", 1)], communicator="cupy-nccl")
    # the plan's choice, made earlier
    comm, ran = _communicator(SessionConfig(), LaneRun.planned(plan), cuda_lanes(0, 1, block=3))
    assert comm.name == ran.communicator == "p2p" and "failed earlier" in ran.communicator_reason
    assert plan.communicator == "cupy-nccl"  # the plan stays as resolved; the run says what it built
    assert [c for c in fake.calls if c[0] == "initAll"] == [("initAll", [0, 1])]  # tried once
    close_communicators()  # a new run tries again
    fake.fail.clear()
    assert select_communicator(cuda_lanes(0, 1))[0].name == "cupy-nccl"


def test_an_asynchronous_error_aborts_every_rank(fake):
    comm, _ = select_communicator(cuda_lanes(0, 1, 2))
    comm.check_async_error()  # healthy: each rank asked once
    assert fake.calls[-3:] == [("check_async_error", 0), ("check_async_error", 1), ("check_async_error", 2)]
    fake.calls.clear()
    fake.async_error[1] = 6  # ncclRemoteError
    with pytest.raises(NcclCollectiveError, match=r"asynchronous error reported by rank 1.*NCCL_ERROR 6"):
        comm.check_async_error()
    assert fake.calls == [("check_async_error", 0), ("check_async_error", 1), ("abort", 0), ("abort", 1),
                          ("abort", 2)]
    fake.calls.clear()
    comm.check_async_error()  # aborted: nothing to ask
    with pytest.raises(NcclAborted):
        comm.all_reduce(bufs(3))
    assert fake.calls == [] and comm.abort("again") is True  # abort twice: the handles are released once
    assert fake.calls == []


def test_every_group_launch_holds_the_allocators_free_mutex(fake, monkeypatch):
    """As torch's AutoNcclGroup does: no cudaFree of another thread between groupStart and groupEnd
    (NCCL's deadlock with a half-launched group); released before an abort, also after an error."""
    monkeypatch.setattr(torch._C, "_cuda_lock_mutex", lambda: fake.calls.append(("lock",)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_unlock_mutex", lambda: fake.calls.append(("unlock",)), raising=False)
    comm, _ = select_communicator(cuda_lanes(0, 1))
    fake.calls.clear()
    comm.all_reduce(bufs(2))  # two groups: to the owners, back from them
    ops = [c[0] if not isinstance(c, Call) else "call" for c in fake.calls]
    assert ops == ["lock", "groupStart", *["call"] * 4, "groupEnd", "unlock"] * 2
    fake.calls.clear()
    fake.fail[("send", 1)] = fake_cupy_nccl.NCCL_INVALID_USAGE
    with pytest.raises(NcclCollectiveError):
        comm.all_reduce(bufs(2))
    ops = [c[0] if not isinstance(c, Call) else "call" for c in fake.calls]
    assert ops[0] == "lock" and ops[-4:] == ["groupEnd", "unlock", "abort", "abort"]
