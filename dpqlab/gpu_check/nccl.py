"""The NCCL step (not core): both NCCL communicators at one rank through every collective x
fp32/bf16/uint8 (the world-1 shortcut bypassed); ncclSend/ncclRecv at one rank, to itself; with NCCL
>= 2.30 two CuPy ranks on cuda:0 (two streams): every collective and both exchanges, bitwise, then a
send left without its receive, ended by the watchdog's abort. NCCL between two cards cannot be shown
on one GPU: those proofs read "not proven" there, never "passed"."""

from __future__ import annotations

import time

from dpqlab.gpu_check.common import NOT_DRY, SKIP_DRY, bitwise, check, deterministic, hidden_step, verdict

PROOFS = ["nccl collectives (one rank)", "nccl send/recv (one rank, to itself)", "nccl send/recv (two ranks)",
          "nccl abort ends a hung kernel"]

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


def _data(dtype, n: int, seed: int, device="cuda:0"):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    if dtype == torch.uint8:
        x = torch.randint(0, 100, (n,), generator=g, dtype=torch.uint8)
    else:
        x = torch.randn(n, generator=g).to(dtype)
    return x.to(device)


def _run_op(comm, op: str, xs: list, n: int) -> list:
    """Issue ``op`` on per-rank inputs ``xs`` (n elements each); returns each rank's result."""
    import torch

    lanes, w = comm.lanes, comm.world
    for lane in lanes:
        lane.wait_for_current()  # inputs were made on the current stream
    if op in ("all_reduce", "broadcast", "reduce"):
        bufs = [x.clone() for x in xs]
        for lane in lanes:
            lane.wait_for_current()
        if op == "all_reduce":
            comm.all_reduce(bufs)
        elif op == "broadcast":
            comm.broadcast(bufs, root=w - 1)
        else:
            comm.reduce(bufs, root=0)
        out = bufs
    elif op == "reduce_scatter":
        send = [torch.cat([x] * w) for x in xs]  # W*n: chunk k of every rank is x
        out = [torch.empty(n, dtype=xs[0].dtype, device=x.device) for x in xs]
        for lane in lanes:
            lane.wait_for_current()
        comm.reduce_scatter(send, out)
    else:
        out = [torch.empty(w * n, dtype=xs[0].dtype, device=x.device) for x in xs]
        for lane in lanes:
            lane.wait_for_current()
        comm.all_gather(xs, out)
    for lane in lanes:
        lane.current_waits_for_me()
    torch.cuda.synchronize()
    return out


def _expected(op: str, xs: list, rank: int):
    import torch

    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return {"all_reduce": total, "reduce_scatter": total, "all_gather": torch.cat(xs),
            "broadcast": xs[-1], "reduce": total if rank == 0 else xs[rank]}[op]


def _collectives(comm, label: str, results: dict) -> None:
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for op in OPS:
            key = f"{label}/{op}/{str(dtype).removeprefix('torch.')}"
            try:
                n = 1031
                xs = [_data(dtype, n, seed=17 + k) for k in range(comm.world)]
                outs = _run_op(comm, op, xs, n)
                for k, o in enumerate(outs):
                    check(bitwise(o, _expected(op, xs, k)), f"rank {k} result differs from the expected")
                if op != "reduce":
                    check(all(bitwise(o, outs[0]) for o in outs), "ranks differ")
                results[key] = "ok"
            except Exception as e:
                results[key] = f"FAILED {type(e).__name__}: {e}"


def _exchanges(comm, label: str, results: dict) -> None:
    import torch

    from dpq.engine.exchange import FullSumExchange, GradBuckets, SignExchange

    sizes = (3000, 1500, 777)
    for cls in (SignExchange, FullSumExchange):
        key = f"{label}/{cls.__name__}"
        try:
            params = [[torch.nn.Parameter(torch.zeros(s, device=lane.device)) for s in sizes] for lane in comm.lanes]
            buckets = GradBuckets(params, bucket_cap_elems=2048, lanes=comm.lanes)
            buckets.attach()
            grads = [[_data(torch.float32, s, seed=100 * k + i) for i, s in enumerate(sizes)]
                     for k in range(comm.world)]
            for g in grads:
                g[0][::7] = 0.0  # exact zeros: the sign path keeps them 0
            for lane in comm.lanes:
                lane.wait_for_current()
            for k, lane in enumerate(comm.lanes):
                with lane.issue():
                    for p, g in zip(params[k], grads[k], strict=True):
                        p.grad.copy_(g)
            cls(comm).exchange(buckets)
            for lane in comm.lanes:
                lane.current_waits_for_me()
            torch.cuda.synchronize()
            for i in range(len(sizes)):
                if cls is SignExchange:  # the sums in bf16 (Note [the summed gradient in bf16 on the wire])
                    parts = [g[i].bfloat16() for g in grads]
                    want = torch.sign(parts[0] + parts[1] if comm.world == 2 else parts[0]).float()
                else:
                    want = grads[0][i] + grads[1][i] if comm.world == 2 else grads[0][i]
                for k in range(comm.world):
                    check(bitwise(params[k][i].grad, want), f"param {i} rank {k} differs")
            results[key] = "ok"
        except Exception as e:
            results[key] = f"FAILED {type(e).__name__}: {e}"


def _send_recv_self(results: dict) -> str:
    """ncclSend/ncclRecv through CuPy at one rank, rank 0 to itself (NCCL copies locally: the API runs,
    no transport between ranks does), in one group as dpq issues them."""
    import torch

    from dpq.nccl_comm import CupyNcclCommunicator
    from dpq.streams import make_lanes

    try:
        comm = CupyNcclCommunicator(make_lanes(["cuda:0"]))
        x = _data(torch.float32, 4099, seed=7)
        y = torch.zeros_like(x)
        comm.lanes[0].wait_for_current()
        dt, stream = comm._dtype(torch.float32), comm.lanes[0].stream_handle
        comm._grouped("send/recv to self", [[("send", (x.data_ptr(), x.numel(), dt, 0, stream)),
                                              ("recv", (y.data_ptr(), y.numel(), dt, 0, stream))]])
        comm.lanes[0].current_waits_for_me()
        torch.cuda.synchronize()
        comm.close()
        ok = bitwise(x, y)
        results["cupy-nccl/1rank/send_recv_self"] = "ok" if ok else "FAILED: the received values differ"
        return verdict(ok, "the received values differ")
    except Exception as e:
        results["cupy-nccl/1rank/send_recv_self"] = f"FAILED {type(e).__name__}: {e}"
        return f"failed: {type(e).__name__}: {e}"


def nccl_hang(args) -> dict:
    """Subprocess of step_nccl (two CuPy ranks on cuda:0): rank 0's send left without rank 1's receive
    (its kernel waits for a peer that never comes, the hang dpq's watchdog is for); the readback's
    polled wait expires, ``abort()`` (ncclCommAbort) must end the kernel."""
    import torch

    from dpq.nccl_comm import CupyNcclCommunicator
    from dpq.streams import WaitExpired, make_lanes, wait_events

    comm = CupyNcclCommunicator(make_lanes(["cuda:0", "cuda:0"]))
    n = 1 << 16
    x = [torch.ones(n, device="cuda:0") for _ in range(2)]
    comm.all_reduce(x)  # connects the rings ...
    comm.reduce_scatter(x, [torch.empty(n // 2, device="cuda:0") for _ in range(2)])  # ... and send/recv
    torch.cuda.synchronize()  # (NCCL connects peers at their first use: a lone send must not wait for that)
    dt, lane = comm._dtype(torch.float32), comm.lanes[0]
    comm._grouped("a send without its receive", [[("send", (x[0].data_ptr(), n, dt, 1, lane.stream_handle))], []])
    event = lane.stream.record_event()
    out: dict = {}
    try:
        wait_events([event], 3.0, comm.check_async_error)
        out["hung"] = False
    except WaitExpired:
        out["hung"] = True
    t0 = time.monotonic()
    out["abort_ended_work"] = comm.abort("gpu_check: a send without its receive")
    try:
        wait_events([event], 15.0)
        out["ended_after_s"] = round(time.monotonic() - t0, 2)
    except WaitExpired:
        out["ended_after_s"] = None
    return out


def run(args, partial: dict) -> dict:
    if args.dry_run:
        return {"status": SKIP_DRY, "proofs": dict.fromkeys(PROOFS, NOT_DRY)}
    from dpq.nccl_comm import (
        CupyNcclCommunicator,
        TorchNcclCommunicator,
        cupy_nccl_available,
        cupy_nccl_version,
        multi_rank_gpu_enabled,
        torch_nccl_available,
    )
    from dpq.streams import make_lanes

    results: dict = {}
    proofs: dict = {}
    with deterministic() as nondeterministic:
        for name, cls, available in (("cupy-nccl", CupyNcclCommunicator, cupy_nccl_available),
                                     ("torch-nccl", TorchNcclCommunicator, torch_nccl_available)):
            if not available():
                results[name] = "FAILED: unavailable"
                continue
            comm = cls(make_lanes(["cuda:0"]))
            comm.shortcut_world_one = False  # push the one-rank collectives through NCCL itself
            _collectives(comm, f"{name}/1rank", results)
            comm.close()
        proofs["nccl send/recv (one rank, to itself)"] = (
            _send_recv_self(results) if cupy_nccl_available() else "not proven: CuPy's NCCL is unavailable")
        version = cupy_nccl_version() if cupy_nccl_available() else None
        two = version is not None and multi_rank_gpu_enabled(version)
        if two:
            comm = CupyNcclCommunicator(make_lanes(["cuda:0", "cuda:0"]))
            _collectives(comm, "cupy-nccl/2ranks", results)
            _exchanges(comm, "cupy-nccl/2ranks", results)
            comm.close()
    why = (f"CuPy's NCCL is {version}; two ranks on one GPU need NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1"
           if not two else "")
    failed = {k: v for k, v in results.items() if str(v).startswith("FAILED")}
    one = {k: v for k, v in results.items() if "/1rank/" in k and "send_recv" not in k}
    proofs["nccl collectives (one rank)"] = verdict(one and all(v == "ok" for v in one.values()), one)
    if two:
        pair = {k: v for k, v in results.items() if "/2ranks/" in k}
        proofs["nccl send/recv (two ranks)"] = verdict(all(v == "ok" for v in pair.values()), pair)
        proc = hidden_step("nccl-hang", 30)
        hang = proc.get("result") or {}
        if proc.get("rc") is None:  # the host itself blocked (in groupEnd): no queued kernel for the abort
            proofs["nccl abort ends a hung kernel"] = f"not proven: the subprocess blocked on the host ({proc})"
        elif hang.get("hung") is False:
            proofs["nccl abort ends a hung kernel"] = "not proven: the send without its receive did not hang"
        else:
            proofs["nccl abort ends a hung kernel"] = verdict(hang.get("hung") and hang.get("ended_after_s")
                                                              is not None, proc)
        proc.pop("text", None)
        results["hang"] = proc
    else:
        proofs["nccl send/recv (two ranks)"] = f"not proven: {why}"
        proofs["nccl abort ends a hung kernel"] = f"not proven: {why}"
    out = {"checks": results, "nondeterministic_ops": nondeterministic, "proofs": proofs}
    check(not failed, f"{len(failed)} NCCL checks failed: {failed}")
    check(not any(v.startswith("failed") for v in proofs.values()), f"NCCL proofs failed: {proofs}")
    return out
