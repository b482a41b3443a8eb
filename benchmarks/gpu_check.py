"""dpq's one-GPU validation, one step per call (``benchmarks/gpu_check.sh`` runs them, each under its own timeout).

UNTESTED ON A GPU: written against the torch, CuPy and NCCL APIs without a GPU to run it on;
only ``--dry-run`` (CPU) has run. Steps (each writes ``STATE/<step>.json``; ``summarize`` folds
them into ``OUT/summary.json``):

  versions  torch, CUDA, NCCL (torch.cuda.nccl.version()), CuPy and the NCCL it loaded, auto-round
  nccl      both NCCL communicators, one rank on cuda:0, every collective x fp32/bf16/uint8, world-1
            shortcut bypassed; with NCCL >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1 set by the .sh) two
            CuPy ranks on cuda:0 through every collective and both exchanges, bitwise across ranks
  race      world 2 on cuda:0,cuda:0 with the identical-state check under TORCH_CUDA_SANITIZER=1
            (subprocess); the same with torch.cuda._sleep queued on the default stream before the
            block and on lane streams before each step (must equal the run without sleeps, bitwise);
            world 1 on GPU bitwise equal to serial auto-round on GPU; the one-op sign step bitwise
            each lane's SignSGD.step (worlds 1 and 2); overlap=True (the exchange on a second stream
            per lane) bitwise the plain world 2, with and without the sleeps; local, p2p and host
            bitwise equal
  suite     pytest without the CLI subprocess tests (dry run: --collect-only)
  timing    a bf16 Llama-shaped block built locally (hidden 4096, seq 2048, batch 8): serial auto-round
            vs dpq world 1, 2 and 4 lanes on the one GPU (block tune seconds), the mirror price vs the
            measured peak, and one profiler trace of a world-2 block with the lanes' kernel overlap
            (dry run: a tiny block, serial and the profiled world 2 on CPU lanes)

``--dry-run`` runs on CPU: CUDA-only steps record "skipped: no CUDA (dry run)".
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DRY = "skipped: no CUDA (dry run)"


class CheckFailed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


# -- a) versions ---------------------------------------------------------------------------


def step_versions(args) -> dict:
    import platform

    import torch

    out: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import torch.cuda.nccl as tnccl

        out["torch_nccl"] = ".".join(map(str, tnccl.version()))
    except Exception as e:  # CPU builds carry no NCCL
        out["torch_nccl"] = f"unavailable ({type(e).__name__})"
    try:
        import cupy

        out["cupy"] = cupy.__version__
        from dpq.nccl_comm import cupy_nccl_version

        v = cupy_nccl_version()
        out["cupy_nccl"] = ".".join(map(str, v)) if v else "unavailable"
    except Exception as e:
        out["cupy"] = f"unavailable ({type(e).__name__})"
    try:
        import auto_round

        out["auto_round"] = auto_round.__version__
    except Exception as e:
        out["auto_round"] = f"unavailable ({type(e).__name__}: {e})"
    if not args.dry_run:
        check(torch.cuda.is_available(), "torch sees no CUDA device")
    return out


# -- b) NCCL smoke -------------------------------------------------------------------------

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


def _bitwise(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


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
                    check(_bitwise(o, _expected(op, xs, k)), f"rank {k} result differs from the expected")
                if op != "reduce":
                    check(all(_bitwise(o, outs[0]) for o in outs), "ranks differ")
                results[key] = "ok"
            except Exception as e:
                results[key] = f"FAILED {type(e).__name__}: {e}"


def _exchanges(comm, label: str, results: dict) -> None:
    import torch

    from dpq.exchange import FullSumExchange, GradBuckets, SignExchange

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
                total = grads[0][i] + grads[1][i] if comm.world == 2 else grads[0][i]
                want = torch.sign(total) if cls is SignExchange else total
                for k in range(comm.world):
                    check(_bitwise(params[k][i].grad, want), f"param {i} rank {k} differs")
            results[key] = "ok"
        except Exception as e:
            results[key] = f"FAILED {type(e).__name__}: {e}"


def step_nccl(args) -> dict:
    if args.dry_run:
        return {"status": SKIP_DRY}
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
    for name, cls, available in (("cupy-nccl", CupyNcclCommunicator, cupy_nccl_available),
                                 ("torch-nccl", TorchNcclCommunicator, torch_nccl_available)):
        if not available():
            results[name] = "FAILED: unavailable"
            continue
        comm = cls(make_lanes(["cuda:0"]))
        comm.shortcut_world_one = False  # push the one-rank collectives through NCCL itself
        _collectives(comm, f"{name}/1rank", results)
        comm.close()
    version = cupy_nccl_version() if cupy_nccl_available() else None
    if version is None or version < (2, 30, 0):
        results["cupy-nccl/2ranks"] = f"skipped: CuPy's NCCL is {version}; two ranks on one GPU need >= 2.30"
    elif not multi_rank_gpu_enabled(version):
        results["cupy-nccl/2ranks"] = "FAILED: NCCL_MULTI_RANK_GPU_ENABLE=1 is not set (gpu_check.sh sets it)"
    else:
        comm = CupyNcclCommunicator(make_lanes(["cuda:0", "cuda:0"]))
        _collectives(comm, "cupy-nccl/2ranks", results)
        _exchanges(comm, "cupy-nccl/2ranks", results)
        comm.close()
    failed = {k: v for k, v in results.items() if str(v).startswith("FAILED")}
    check(not failed, f"{len(failed)} NCCL checks failed: {failed}")
    return {"checks": results}


# -- c) race hunt --------------------------------------------------------------------------


def record_blocks(device: str, iters: int = 4, nsamples: int = 16, seqlen: int = 64):
    """Record auto-round's ``quantize_block`` calls of the tiny Llama on ``device`` (tests.conftest's
    recorder, with the device as a parameter)."""
    import copy
    import random

    import torch
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from tests.conftest import RecordedBlock

    recorded = []
    orig = SignRoundQuantizer.quantize_block

    def recording(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids=None, **kw):
        recorded.append(RecordedBlock(
            quantizer=self, block=copy.deepcopy(block), fp_inputs=list(fp_inputs),
            input_others={k: (list(v) if isinstance(v, list) else v) for k, v in input_others.items()},
            fp_outputs=list(fp_outputs), q_inputs=list(q_inputs) if q_inputs is not None else None,
            block_ctx=block_ctx, input_ids=list(input_ids) if input_ids is not None else None,
            py_state=random.getstate(), torch_state=torch.get_rng_state()))
        return orig(self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids, **kw)

    SignRoundQuantizer.quantize_block = recording
    try:
        AutoRound(build_tiny_llama(TinyLlamaConfig()), tokenizer=build_tokenizer(),
                  dataset=calibration_samples(nsamples, seqlen), device_map=device, enable_torch_compile=False,
                  iters=iters, nsamples=nsamples, seqlen=seqlen, batch_size=8, seed=42).quantize()
    finally:
        SignRoundQuantizer.quantize_block = orig
    return recorded


def _params_equal(a: dict, b: dict) -> str | None:
    import torch

    if a.keys() != b.keys():
        return f"layers differ: {sorted(a)} vs {sorted(b)}"
    for layer in a:
        for key in a[layer]:
            x, y = a[layer][key], b[layer][key]
            same = x.shape == y.shape and x.dtype == y.dtype and torch.equal(
                x.detach().cpu().reshape(-1).view(torch.uint8), y.detach().cpu().reshape(-1).view(torch.uint8))
            if not same:
                return f"{layer}.{key} differs"
    return None


def race_tune(args) -> dict:
    """Subprocess of step_race (TORCH_CUDA_SANITIZER=1): world 2 with the identical-state check."""
    import torch

    import dpq

    saved = torch.load(args.blob, weights_only=False)
    res = dpq.parallel_tune(saved["block"], saved["inputs"], world=len(args.devices.split(",")),
                            devices=args.devices.split(","), debug_identical=True, seed=None, **saved["kw"])
    torch.cuda.synchronize()
    return {"world": res.world, "best_loss": res.best_loss}


def step_race(args) -> dict:
    if args.dry_run:
        return {"status": SKIP_DRY}
    import tempfile

    import torch
    from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD

    from dpq import sign_step
    from dpq.autoround import tune
    from dpq.fallback_p2p import select_communicator
    from dpq.streams import make_lanes

    out: dict = {}
    recs = record_blocks("cuda:0")
    rec = recs[0]
    q = rec.quantizer
    q.iters = 6

    # world 1 on GPU == serial auto-round on GPU, bitwise
    rec.restore_rng()
    serial = rec.serial_quantize_block(rec.fresh_block())
    rec.restore_rng()
    one = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0"])
    out["world1_vs_serial"] = _params_equal(serial, one.best_params) or "bitwise equal"

    # world 2 on one GPU, identical-state check, then again with sleeps where a missing wait would show
    rec.restore_rng()
    base = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True)
    cycles = 50_000_000  # ~25 ms at H200 clocks
    orig_step, orig_apply = SignSGD.step, sign_step._apply

    def sleepy_step(self, *a, **kw):
        torch.cuda._sleep(cycles)  # on the lane's stream: the engine steps under lane.issue()
        return orig_step(self, *a, **kw)

    def sleepy_apply(*a, **kw):  # the one-op step (dpq.sign_step) runs this under each lane's issue()
        torch.cuda._sleep(cycles)
        return orig_apply(*a, **kw)

    SignSGD.step, sign_step._apply = sleepy_step, sleepy_apply
    try:
        rec.restore_rng()
        torch.cuda._sleep(cycles * 4)  # the default stream is busy when the block starts...
        block = rec.fresh_block()  # ...and the block's copy is queued behind the sleep
        slept = rec.dpq_parallel_tune(block, ["cuda:0", "cuda:0"], debug_identical=True)
    finally:
        SignSGD.step, sign_step._apply = orig_step, orig_apply
    out["world2_sleeps_vs_plain"] = _params_equal(base.best_params, slept.best_params) or "bitwise equal"
    out["world2_losses_equal"] = base.losses == slept.losses

    # the one-op sign step (dpq.sign_step, used above) vs each lane's SignSGD.step: bitwise, on CUDA
    orig_choice = tune.one_op_sign_step
    tune.one_op_sign_step = lambda *a: False
    try:
        rec.restore_rng()
        per_lane = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True)
        rec.restore_rng()
        per_lane1 = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0"])
    finally:
        tune.one_op_sign_step = orig_choice
    out["one_op_step_used"] = orig_choice(SignSGD, None)

    # --parallel_overlap: the exchange during the backward on a second stream per lane (dpq.comm_streams),
    # bitwise the plain world 2, also with a sleep queued before each step on the lanes' streams
    rec.restore_rng()
    overlapped = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True, overlap=True)
    SignSGD.step, sign_step._apply = sleepy_step, sleepy_apply
    try:
        rec.restore_rng()
        torch.cuda._sleep(cycles * 4)
        block = rec.fresh_block()
        overlapped_slept = rec.dpq_parallel_tune(block, ["cuda:0", "cuda:0"], debug_identical=True, overlap=True)
    finally:
        SignSGD.step, sign_step._apply = orig_step, orig_apply
    out["overlap_comm_streams"] = {
        "communicator": overlapped.communicator,
        "vs_plain": _params_equal(base.best_params, overlapped.best_params) or "bitwise equal",
        "sleeps_vs_plain": _params_equal(base.best_params, overlapped_slept.best_params) or "bitwise equal",
        "losses_equal": base.losses == overlapped.losses == overlapped_slept.losses}
    out["one_op_vs_per_lane_step"] = (_params_equal(base.best_params, per_lane.best_params)
                                      or _params_equal(one.best_params, per_lane1.best_params) or "bitwise equal")

    # the same world-2 tune under the CUDA sanitizer, in a subprocess (it must be on from the start)
    with tempfile.TemporaryDirectory() as tmp:
        blob = os.path.join(tmp, "rec.pt")
        inputs = rec.q_inputs if (rec.q_inputs is not None and q.enable_quanted_input) else rec.fp_inputs
        kw = dict(outputs=list(rec.fp_outputs), input_others=dict(rec.input_others), iters=q.iters,
                  batch_size=q.calibration_context.batch_size, lr=q.lr, minmax_lr=q.minmax_lr,
                  amp=q.model_context.amp, amp_dtype=q.model_context.amp_dtype,
                  valid_token_mask=rec.valid_token_mask)
        torch.save({"block": rec.fresh_block(), "inputs": list(inputs), "kw": kw}, blob)
        env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
        cmd = [sys.executable, __file__, "race-tune", "--blob", blob, "--devices", "cuda:0,cuda:0",
               "--state", tmp, "--out", tmp]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.sanitizer_timeout)
            text = proc.stdout + proc.stderr
            races = text.count("CSAN detected a possible data race")
            out["sanitizer"] = {"rc": proc.returncode, "races": races, "tail": text[-1500:]}
        except subprocess.TimeoutExpired:
            out["sanitizer"] = {"rc": None, "races": None, "tail": f"timed out after {args.sanitizer_timeout}s"}

    # local, p2p and host communicators: bitwise the same sums
    lanes = make_lanes(["cuda:0", "cuda:0"])
    xs = [_data(torch.float32, 4099, seed=k) for k in range(2)]
    by_name = {}
    for name in ("local", "p2p", "host"):
        comm, _ = select_communicator(lanes, prefer=name)
        by_name[name] = [_run_op(comm, op, xs, 4099) for op in ("all_reduce", "reduce_scatter", "all_gather")]
    out["communicators_equal"] = all(
        _bitwise(a, b) for name in ("p2p", "host") for ra, rb in zip(by_name["local"], by_name[name], strict=True)
        for a, b in zip(ra, rb, strict=True))

    check(out["world1_vs_serial"] == "bitwise equal", f"world 1 vs serial: {out['world1_vs_serial']}")
    check(out["world2_sleeps_vs_plain"] == "bitwise equal" and out["world2_losses_equal"],
          f"sleeps changed the world-2 result: {out['world2_sleeps_vs_plain']} (a missing stream wait)")
    check(out["one_op_step_used"] and out["one_op_vs_per_lane_step"] == "bitwise equal",
          f"one-op sign step: used {out['one_op_step_used']}, vs per-lane {out['one_op_vs_per_lane_step']}")
    ov = out["overlap_comm_streams"]
    check(ov["vs_plain"] == ov["sleeps_vs_plain"] == "bitwise equal" and ov["losses_equal"]
          and ov["communicator"].endswith("+comm-streams"), f"overlap on comm streams: {ov}")
    check(out["sanitizer"]["rc"] == 0 and out["sanitizer"]["races"] == 0, f"sanitizer: {out['sanitizer']}")
    check(out["communicators_equal"], "local / p2p / host results differ")
    return out


# -- d) the suite --------------------------------------------------------------------------


def step_suite(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider",  # -q comes from pyproject
           "-k", "not cli and not gpu_check"]
    if args.dry_run:
        cmd.append("--collect-only")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    out = {"command": " ".join(cmd[1:]), "rc": proc.returncode, "summary": lines[-1] if lines else ""}
    check(proc.returncode == 0, f"pytest exited {proc.returncode}: {out['summary']}")
    return out


# -- e) timing -----------------------------------------------------------------------------


def _llama_run(size: dict, device: str, world: int | None, profile_to: Path | None = None) -> dict:
    """One AutoRound run of a one-layer Llama-shaped bf16 model; ``world`` None = dpq off (serial).
    Returns the seconds of each quantize_block call (the block's tuning), and peak memory on CUDA."""
    import torch
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    from dpq.autoround import disable, enable
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from dpq.plan import price_mirror

    cfg = TinyLlamaConfig(hidden_size=size["hidden"], intermediate_size=size["inter"], num_hidden_layers=1,
                          num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
                          max_position_embeddings=size["seq"])
    model = build_tiny_llama(cfg).to(torch.bfloat16)
    cuda = device.startswith("cuda")
    if world is not None:
        enable(world, devices=[device] * world)
    method = SignRoundQuantizer.quantize_block  # dpq's delegation when enabled
    seconds, peaks, prices = [], [], []

    def timed(self, *a, **kw):
        if not prices:  # the block arrives unwrapped, with its cached inputs
            prices.append(price_mirror(a[0], a[1], size["batch"], world=2))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        prof = None
        if profile_to is not None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            prof = profile(activities=acts)
            prof.__enter__()
        t0 = time.perf_counter()
        try:
            return method(self, *a, **kw)
        finally:
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
            if prof is not None:
                prof.__exit__(None, None, None)
                prof.export_chrome_trace(str(profile_to))
            if cuda:
                peaks.append(torch.cuda.max_memory_allocated() - before)

    SignRoundQuantizer.quantize_block = timed
    try:
        AutoRound(model, tokenizer=build_tokenizer(), dataset=calibration_samples(size["nsamples"], size["seq"]),
                  device_map=device, enable_torch_compile=False, iters=size["iters"], nsamples=size["nsamples"],
                  seqlen=size["seq"], batch_size=size["batch"], seed=42).quantize()
    finally:
        SignRoundQuantizer.quantize_block = method
        if world is not None:
            disable()
    return {"block_seconds": seconds, "peak_bytes_over_start": peaks, "price_mirror_world2": prices[:1]}


def lane_overlap(trace_path: Path) -> dict:
    """From a chrome trace: GPU kernel busy time per stream, their union, and the overlap between streams."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    per_stream: dict[str, list[tuple[float, float]]] = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") == "kernel":
            stream = str(ev.get("args", {}).get("stream", ev.get("tid")))
            per_stream.setdefault(stream, []).append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0))))
    if not per_stream:
        return {"streams": 0, "note": "no GPU kernels in the trace (CPU run)"}

    def union(iv):
        total, end = 0.0, float("-inf")
        for a, b in sorted(iv):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    busy = {s: union(iv) for s, iv in per_stream.items()}
    all_union = union([x for iv in per_stream.values() for x in iv])
    overlap = sum(busy.values()) - all_union
    return {"streams": len(busy), "busy_us_per_stream": busy, "union_us": all_union, "overlap_us": overlap,
            "lanes_overlap": overlap > 0.05 * all_union}


def step_timing(args) -> dict:
    import torch

    if args.dry_run:
        size = {"hidden": 64, "inter": 128, "heads": 4, "seq": 32, "nsamples": 4, "batch": 4, "iters": 2}
        device, worlds = "cpu", []  # < 60 s on 2 cores: serial and the profiled world-2 run only
    else:
        check(torch.cuda.is_available(), "no CUDA")
        size = {"hidden": 4096, "inter": 11008, "heads": 32, "seq": 2048, "nsamples": 8, "batch": 8,
                "iters": args.iters}
        device, worlds = "cuda:0", [1, 2, 4]
    out: dict = {"size": size, "device": device, "runs": {}}
    out["runs"]["serial"] = _llama_run(size, device, None)
    for w in worlds:
        out["runs"][f"world{w}"] = _llama_run(size, device, w)
    trace = Path(args.out) / "trace_world2.json"
    profiled = "world2_profiled" if worlds else "world2"
    out["runs"][profiled] = _llama_run(dict(size, iters=min(2, size["iters"])), device, 2, profile_to=trace)
    out["overlap"] = lane_overlap(trace)
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    out["trace"] = trace.name + ".gz"
    serial = sum(out["runs"]["serial"]["block_seconds"])
    out["speedup_vs_serial"] = {k: serial / sum(v["block_seconds"]) for k, v in out["runs"].items()
                                if k.startswith("world") and k != "world2_profiled" and sum(v["block_seconds"])}
    # the mirror price of this block (one extra lane at world 2) next to what the world-2 run took
    out["price_mirror_world2_bytes"] = out["runs"]["world2"]["price_mirror_world2"]
    out["measured_world2_peak_over_start_bytes"] = out["runs"]["world2"]["peak_bytes_over_start"]
    return out


# -- the summary ---------------------------------------------------------------------------

STEPS = {"versions": step_versions, "nccl": step_nccl, "race": step_race, "suite": step_suite,
         "timing": step_timing}


def summarize(args) -> int:
    state = Path(args.state)
    steps = {}
    for name in STEPS:
        entry = {}
        f = state / f"{name}.json"
        if f.exists():
            entry = json.loads(f.read_text())
        rc_file = state / f"{name}.rc"
        if rc_file.exists():
            rc, limit, secs = rc_file.read_text().split()
            entry.update(rc=int(rc), limit_s=int(limit), seconds=float(secs), timed_out=int(rc) in (124, 137))
            if not f.exists():
                entry["status"] = "timed out" if entry["timed_out"] else "failed (no result written)"
        else:
            entry.setdefault("status", "not run")
        steps[name] = entry
    ok = all(e.get("status") in ("passed", SKIP_DRY) for e in steps.values())
    summary = {"dry_run": args.dry_run, "passed": ok, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "steps": steps}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({k: v.get("status") for k, v in steps.items()}, indent=2))
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=[*STEPS, "summarize", "race-tune"])
    p.add_argument("--state", required=True, help="folder for each step's result")
    p.add_argument("--out", required=True, help="folder for the summary, logs and trace")
    p.add_argument("--dry-run", action="store_true", help="CPU only: CUDA steps are skipped")
    p.add_argument("--iters", type=int, default=10, help="tuning iterations of the timing runs")
    p.add_argument("--sanitizer-timeout", type=int, default=60)
    p.add_argument("--blob", help=argparse.SUPPRESS)
    p.add_argument("--devices", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step == "summarize":
        return summarize(args)
    if args.step == "race-tune":
        print(json.dumps(race_tune(args)))
        return 0
    t0 = time.perf_counter()
    try:
        result = STEPS[args.step](args)
        status = result.pop("status", "passed") if isinstance(result, dict) else "passed"
    except Exception as e:
        traceback.print_exc()
        result, status = {"error": f"{type(e).__name__}: {e}"[:4000]}, "failed"
    entry = {"status": status, "result": result, "step_seconds": round(time.perf_counter() - t0, 2)}
    Path(args.state, f"{args.step}.json").write_text(json.dumps(entry, indent=2, default=str))
    print(f"{args.step}: {status}")
    return 0 if status in ("passed", SKIP_DRY) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
