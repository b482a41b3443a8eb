"""dpq's one-GPU validation, one step per call (``benchmarks/gpu_check.sh`` runs them, each under its own timeout).

UNTESTED ON A GPU: written against the torch, CuPy and NCCL APIs without a GPU to run it on;
only ``--dry-run`` (CPU) has run. :data:`PLAN` is the plan: every step, its time budget (the
shell's timeout for it) and what it proves. Each step writes ``STATE/<step>.json`` with its
``proofs``: for every property it is there to show, "passed", "failed: ..." or "not proven: ..."
(a property that needs what this machine lacks is never reported as passed); ``summarize`` folds
them into ``OUT/summary.json``. Bitwise comparisons run under ``torch.use_deterministic_algorithms``
with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set by the .sh before CUDA starts: cuBLAS's documented
setting for reproducible results, https://docs.nvidia.com/cuda/cublas/#results-reproducibility),
and each result names the nondeterministic ops met, if any.

``--dry-run`` runs on CPU: CUDA-only steps record "skipped: no CUDA (dry run)" and their proofs
"not proven: no CUDA (dry run)".
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DRY = "skipped: no CUDA (dry run)"
NOT_DRY = "not proven: no CUDA (dry run)"
LIMIT_S = 480  # one lent H200: the whole check within 8 minutes

# step, time budget (s), what it runs, the properties it proves (the summary's "proofs")
PLAN = [
    ("versions", 30, "torch, CUDA, NCCL, CuPy and its NCCL, auto-round and what it imports; a missing wheel stops "
     "the run here", ["wheels present"]),
    ("nccl", 45, "both NCCL communicators at one rank, every collective x fp32/bf16/uint8 (world-1 shortcut "
     "bypassed); ncclSend/ncclRecv at one rank (to itself); with NCCL >= 2.30 two CuPy ranks on cuda:0 (two "
     "streams): every collective and both exchanges, bitwise, then a send left without its receive, ended by "
     "the watchdog's abort", ["nccl collectives (one rank)", "nccl send/recv (one rank, to itself)",
                              "nccl send/recv (two ranks)", "nccl abort ends a hung kernel"]),
    ("race", 105, "tiny Llama block on cuda:0: world 1 vs serial auto-round bitwise; world 2 with sleeps "
     "(torch.cuda._sleep) on the producer streams (lane streams before backward, the exchange's streams before "
     "each bucket, the default stream before the readback), debug_identical off, bitwise the plain run; the same "
     "with --parallel_overlap (several buckets, every collective from the calling thread); the readback's "
     "watchdog on a lane kept busy; the CUDA sanitizer on world 2 (debug_identical off), confirmed active by a "
     "planted race; local/p2p/host bitwise equal",
     ["world 1 bitwise serial", "producer sleeps change no bit", "overlap: bitwise, issued by the calling thread",
      "overlap: buckets issued during the backward", "watchdog fires on a busy lane", "sanitizer: no race",
      "sanitizer active", "communicators bitwise equal"]),
    ("compile", 70, "tiny Llama with enable_torch_compile=True, dpq world 2 on cuda:0,cuda:0 with the "
     "identical-state check", ["compile-on world 2"]),
    ("suite", 60, "the GPU-relevant tests (watchdog, NCCL lifecycle, memory, issuer marks, inputs on another "
     "device type; SUITE), timed (measured: 31 s wall, 13 s CPU on the 2-core CPU VM)", ["suite subset"]),
    ("timing", 140, "bf16 Llama-shaped block (hidden 4096, seq 2048, batch 8): serial vs dpq world 1, 2 and 4 on "
     "the one GPU; world 2 with CUDA events around each lane's forward (the lanes' forwards overlap) and "
     "torch.cuda.set_sync_debug_mode (no implicit sync, one readback wait per iteration), its price (home + "
     "mirror + runtime) vs the allocated peak; one profiler trace",
     ["lanes' forwards overlap", "one host sync per iteration", "price covers the allocated peak"]),
]
STEPS_S = sum(limit for _, limit, _, _ in PLAN)
# The suite step: the tests of the GPU paths (the watchdog, NCCL's lifecycle, memory and its price,
# the communication streams) run with the box's CUDA torch and CuPy installed, and the one test that
# needs a second device type; those among them that tune whole blocks on CPU lanes (tens of seconds
# each, nothing GPU-specific in them) are left out.
SUITE = ["tests/test_watchdog.py", "tests/test_nccl_lifecycle.py", "tests/test_memory.py", "tests/test_comm_streams.py",
         "tests/test_api.py::test_inputs_on_another_device"]
SUITE_EXCLUDE = ["mirror_price", "lane_streams", "prices_what_every_lane", "ordered_and_change", "missing_join",
                 "parallel_tune_with_overlap", "comm_lanes_have"]
SUITE_K = " and ".join(f"not {name}" for name in SUITE_EXCLUDE)


class CheckFailed(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


def verdict(ok: bool, detail: object = "") -> str:
    return "passed" if ok else f"failed: {detail}"


def print_plan() -> None:
    print(f"gpu_check plan (one H200; each step under its own timeout; budgets add up to {STEPS_S} s <= {LIMIT_S} s):")
    for i, (name, limit, what, proofs) in enumerate(PLAN):
        print(f"  {chr(97 + i)}) {name:<9}{limit:>4} s  {what}")
        print(f"     {'':<13}proves: {'; '.join(proofs)}")
    print(f"  total {STEPS_S} s")


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms for a bitwise comparison; yields the list of the
    nondeterministic ops met (warn_only: an op without a deterministic kernel is named, not fatal)."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    met: list[str] = []
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield met
        finally:
            met += sorted({str(w.message).split(" does not have")[0] for w in caught
                           if "deterministic" in str(w.message)})
            torch.use_deterministic_algorithms(before)


# -- a) versions ---------------------------------------------------------------------------


def _dry_versions() -> dict:
    """The versions step on CPU (--dry-run): installed versions from the packages' metadata and each
    module found by its import spec, nothing imported (the real run imports each)."""
    import importlib.metadata as md
    import importlib.util
    import platform

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "unavailable (not installed)"

    cupy = next((v for v in (version(d) for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy"))
                 if not v.startswith("unavailable")), "unavailable (not installed)")
    missing = [f"{mod}: not found" for mod in ("torch", "auto_round", "transformers")
               if importlib.util.find_spec(mod) is None]
    if not (ROOT / "dpq" / "autoround" / "__init__.py").is_file():
        missing.append("dpq.autoround: not found")
    return {"python": platform.python_version(), "torch": version("torch"), "cuda": "not read (dry run)",
            "torch_nccl": "not read (dry run)", "cupy": cupy, "auto_round": version("auto-round"),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "missing": missing,
            "proofs": {"wheels present": verdict(not missing, "; ".join(missing))}}


def step_versions(args) -> dict:
    if args.dry_run:
        out = _dry_versions()
        check(not out["missing"], f"missing: {out['missing']}")
        return out
    import platform

    import torch

    out: dict = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                 "cuda_available": torch.cuda.is_available(), "cublas_workspace_config":
                 os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                 "allocator_free_mutex": hasattr(torch._C, "_cuda_lock_mutex")}
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
    missing = []
    for mod in ("auto_round", "transformers", "dpq.autoround"):
        try:
            __import__(mod)
        except Exception as e:  # a wheel the image lacks: name the module that failed to import
            missing.append(f"{mod}: {type(e).__name__}: {getattr(e, 'name', None) or e}")
    try:
        import auto_round
        from auto_round import AutoRound  # noqa: F401  (imports what a run imports)

        out["auto_round"] = auto_round.__version__
    except Exception as e:
        out["auto_round"] = f"unavailable ({type(e).__name__}: {e})"
        missing.append(f"auto_round.AutoRound: {type(e).__name__}: {getattr(e, 'name', None) or e}")
    out["missing"] = missing
    out["proofs"] = {"wheels present": verdict(not missing, "; ".join(missing))}
    check(torch.cuda.is_available(), "torch sees no CUDA device")
    check(os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8",
          "CUBLAS_WORKSPACE_CONFIG is not set (the .sh sets it)")
    check(not missing, f"missing wheels (bring them in .whl/, see gpu_check.sh): {missing}")
    return out


# -- b) NCCL -------------------------------------------------------------------------------

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
        ok = _bitwise(x, y)
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


def step_nccl(args) -> dict:
    if args.dry_run:
        return {"status": SKIP_DRY, "proofs": _not_proven("nccl")}
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
        proc = _subprocess([sys.executable, __file__, "nccl-hang", "--state", args.state, "--out", args.out], 30)
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


def _subprocess(cmd: list[str], timeout: int, env: dict | None = None) -> dict:
    """Run one of this script's hidden steps; its JSON (last stdout line) or what went wrong."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return {"rc": None, "error": f"timed out after {timeout}s", "tail": str(e.stdout or "")[-1500:]}
    text = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else None
    return {"rc": proc.returncode, "result": result, "tail": text[-1500:], "text": text}


def _not_proven(step: str) -> dict:
    return {p: NOT_DRY for name, _, _, proofs in PLAN if name == step for p in proofs}


# -- c) races --------------------------------------------------------------------------------


def record_blocks(device: str, iters: int = 4, nsamples: int = 16, seqlen: int = 64):
    """Record auto-round's ``quantize_block`` calls of the tiny Llama on ``device`` (tests.conftest's
    recorder, with the device as a parameter)."""
    import copy
    import random

    import torch
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from dpq.testing.autoround_blocks import RecordedBlock

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


CYCLES = 50_000_000  # torch.cuda._sleep: ~25 ms at H200 clocks


@contextlib.contextmanager
def producer_sleeps(cycles: int = CYCLES):
    """torch.cuda._sleep on the streams that produce what another stream or the host reads next, so a
    missing wait shows as a changed bit: every lane's stream before the backward (the activations and
    losses it reads; the communication streams and the readback read its gradients and losses), the
    exchange's streams before each bucket (the step reads what they write), and the default stream
    before the readback (lane 0's; home's snapshot and the next iteration read it)."""
    import torch

    from dpq import exchange, tune_loop

    real_backward, real_bucket, real_read = (tune_loop.TuneEngine._backward, exchange._Exchange.exchange_bucket,
                                             tune_loop.TuneEngine._read_losses)
    slept = {"backward": 0, "bucket": 0, "readback": 0}

    def on(lanes):
        for lane in lanes:
            with lane.issue():
                torch.cuda._sleep(cycles)

    def backward(engine, roots, seeds):
        on(engine.lanes)
        slept["backward"] += 1
        return real_backward(engine, roots, seeds)

    def bucket(policy, buckets, i, *marks):
        on(policy.comm.lanes)  # the communication streams with --parallel_overlap, else the lanes'
        slept["bucket"] += 1
        return real_bucket(policy, buckets, i, *marks)

    def read(engine, readback, per_lane):
        torch.cuda._sleep(cycles)  # the current stream: the default one, lane 0's
        slept["readback"] += 1
        return real_read(engine, readback, per_lane)

    tune_loop.TuneEngine._backward, exchange._Exchange.exchange_bucket = backward, bucket
    tune_loop.TuneEngine._read_losses = read
    try:
        yield slept
    finally:
        tune_loop.TuneEngine._backward, exchange._Exchange.exchange_bucket = real_backward, real_bucket
        tune_loop.TuneEngine._read_losses = real_read


@contextlib.contextmanager
def issuing_threads():
    """Which threads issue the exchange's collectives, and how many buckets the overlap's issuer sent
    during the backward (with small buckets, so that a block has several)."""
    from dpq import comm_base, exchange

    seen = {"threads": set(), "issued_in_backward": []}
    cls = comm_base.CommunicatorBase
    real = {m: getattr(cls, m) for m in ("all_reduce", "reduce_scatter", "all_gather")}
    real_serve, real_cap = exchange.BackwardExchange.serve, exchange.GradBuckets.__init__.__defaults__

    def wrap(m):
        def call(self, *a, **kw):
            seen["threads"].add("main" if threading.current_thread() is threading.main_thread()
                                else threading.current_thread().name)
            return real[m](self, *a, **kw)
        return call

    def serve(bx):
        real_serve(bx)
        seen["issued_in_backward"].append(bx.issued_in_backward)

    for m in real:
        setattr(cls, m, wrap(m))
    exchange.BackwardExchange.serve = serve
    exchange.GradBuckets.__init__.__defaults__ = (2**14, None)  # bucket_cap_elems: several buckets per block
    try:
        yield seen
    finally:
        for m, f in real.items():
            setattr(cls, m, f)
        exchange.BackwardExchange.serve = real_serve
        exchange.GradBuckets.__init__.__defaults__ = real_cap


def race_tune(args) -> dict:
    """Subprocess of step_race (TORCH_CUDA_SANITIZER=1): world 2 with debug_identical off (a host sync
    every step would hide a race across iterations), plain and with --parallel_overlap; then a planted
    race after the marker line, which the sanitizer must report (it is on and reporting)."""
    import torch
    import torch.cuda._sanitizer as csan

    import dpq

    print(f"CSAN enabled: {csan.cuda_sanitizer.enabled}", flush=True)
    saved = torch.load(args.blob, weights_only=False)
    out = {"sanitizer_enabled": bool(csan.cuda_sanitizer.enabled)}
    for overlap in (None, True):
        res = dpq.parallel_tune(saved["block"] if overlap is None else saved["block2"], saved["inputs"],
                                world=2, devices=["cuda:0", "cuda:0"], debug_identical=False, seed=None,
                                overlap=overlap, **saved["kw"])
        torch.cuda.synchronize()
        out[f"overlap={overlap}"] = {"world": res.world, "best_loss": res.best_loss}
    print("CONTROL: a planted race follows", flush=True)
    a = torch.rand(1 << 12, device="cuda:0")
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.mul(a, 5, out=a)  # written on another stream without a wait: the sanitizer's own example
        torch.cuda.synchronize()
    except Exception as e:  # the sanitizer raises its report
        print(e, flush=True)
    return out


def step_race(args) -> dict:
    if args.dry_run:
        return {"status": SKIP_DRY, "proofs": _not_proven("race")}
    import tempfile

    import torch
    from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD

    from dpq.autoround import tune
    from dpq.communicators import select_communicator
    from dpq.streams import make_lanes
    from dpq.tune_loop import LanesHung

    out: dict = {}
    proofs: dict = {}
    recs = record_blocks("cuda:0")
    rec = recs[0]
    q = rec.quantizer
    q.iters = 6
    with deterministic() as nondeterministic:
        # world 1 on GPU == serial auto-round on GPU, bitwise
        rec.restore_rng()
        serial = rec.serial_quantize_block(rec.fresh_block())
        rec.restore_rng()
        one = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0"])
        out["world1_vs_serial"] = _params_equal(serial, one.best_params) or "bitwise equal"
        proofs["world 1 bitwise serial"] = verdict(out["world1_vs_serial"] == "bitwise equal", out["world1_vs_serial"])

        # world 2 on one GPU with the identical-state check: the reference
        rec.restore_rng()
        base = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True)
        # the same with sleeps on the producer streams, no per-step check: only the stream order keeps it
        with producer_sleeps() as slept:
            rec.restore_rng()
            torch.cuda._sleep(CYCLES * 4)  # the default stream is busy when the block starts...
            block = rec.fresh_block()  # ...and the block's copy is queued behind the sleep
            slow = rec.dpq_parallel_tune(block, ["cuda:0", "cuda:0"], debug_identical=False)
        out["sleeps"] = {"slept": slept, "losses_equal": base.losses == slow.losses,
                         "vs_plain": _params_equal(base.best_params, slow.best_params) or "bitwise equal"}
        proofs["producer sleeps change no bit"] = verdict(
            out["sleeps"]["vs_plain"] == "bitwise equal" and out["sleeps"]["losses_equal"] and all(slept.values()),
            out["sleeps"])

        # --parallel_overlap (communication streams, the issuer): the same bits, the calling thread issues
        with producer_sleeps(), issuing_threads() as seen:
            rec.restore_rng()
            ov = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=False, overlap=True)
        out["overlap"] = {"communicator": ov.communicator, "threads": sorted(seen["threads"]),
                          "issued_in_backward": seen["issued_in_backward"],
                          "vs_plain": _params_equal(base.best_params, ov.best_params) or "bitwise equal",
                          "losses_equal": base.losses == ov.losses}
        proofs["overlap: bitwise, issued by the calling thread"] = verdict(
            out["overlap"]["vs_plain"] == "bitwise equal" and out["overlap"]["losses_equal"]
            and out["overlap"]["threads"] == ["main"] and ov.communicator.endswith("+comm-streams"), out["overlap"])
        issued = seen["issued_in_backward"]
        proofs["overlap: buckets issued during the backward"] = (
            "passed" if issued and all(n > 0 for n in issued) else
            f"not proven: the issuer sent {issued} buckets before backward returned (the rest after it)")

        # the one-op sign step (dpq.sign_step, used above) vs each lane's SignSGD.step: bitwise, on CUDA
        orig_choice = tune.one_op_sign_step
        tune.one_op_sign_step = lambda *a: False
        try:
            rec.restore_rng()
            per_lane = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True)
        finally:
            tune.one_op_sign_step = orig_choice
        out["one_op_vs_per_lane_step"] = _params_equal(base.best_params, per_lane.best_params) or "bitwise equal"
        out["one_op_step_used"] = orig_choice(SignSGD, None)

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
        proofs["communicators bitwise equal"] = verdict(out["communicators_equal"], "local / p2p / host differ")
    out["nondeterministic_ops"] = nondeterministic

    # the readback's watchdog (R8) on a real GPU: lane 1's stream kept busy (3 s) past a 1 s timeout
    real_loss, calls = tune.make_lane_loss, []

    def make(*a, **kw):
        inner = real_loss(*a, **kw)

        def lane_loss(lane, module, indices):
            calls.append(lane.index)
            if lane.index == 1 and calls.count(1) == 3:
                torch.cuda._sleep(CYCLES * 120)  # on lane 1's stream (the loss runs under its issue())
            return inner(lane, module, indices)
        return lane_loss

    tune.make_lane_loss = make
    t0 = time.monotonic()
    try:
        rec.restore_rng()
        rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], timeout=1.0)
        out["watchdog"] = {"raised": None}
    except LanesHung as e:
        out["watchdog"] = {"raised": str(e)[:600], "stuck": e.stuck, "after_s": round(time.monotonic() - t0, 2)}
    finally:
        tune.make_lane_loss = real_loss
        torch.cuda.synchronize()  # the sleep ends on its own
    wd = out["watchdog"]
    proofs["watchdog fires on a busy lane"] = verdict(wd["raised"] is not None and "lane(s) 1 had not finished"
                                                      in wd["raised"], wd)

    # the world-2 tunes under the CUDA sanitizer, in a subprocess (it must be on from the start)
    with tempfile.TemporaryDirectory() as tmp:
        blob = os.path.join(tmp, "rec.pt")
        inputs = rec.q_inputs if (rec.q_inputs is not None and q.enable_quanted_input) else rec.fp_inputs
        kw = dict(outputs=list(rec.fp_outputs), input_others=dict(rec.input_others), iters=q.iters,
                  batch_size=q.calibration_context.batch_size, lr=q.lr, minmax_lr=q.minmax_lr,
                  amp=q.model_context.amp, amp_dtype=q.model_context.amp_dtype,
                  valid_token_mask=rec.valid_token_mask)
        torch.save({"block": rec.fresh_block(), "block2": rec.fresh_block(), "inputs": list(inputs), "kw": kw}, blob)
        env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
        proc = _subprocess([sys.executable, __file__, "race-tune", "--blob", blob, "--state", tmp, "--out", tmp],
                           args.sanitizer_timeout, env)
    text = proc.pop("text", "")
    tune_part, _, control = text.partition("CONTROL: a planted race follows")
    marker = "CSAN detected a possible data race"
    out["sanitizer"] = dict(proc, races=tune_part.count(marker), control_races=control.count(marker),
                            enabled="CSAN enabled: True" in tune_part)
    san = out["sanitizer"]
    print(f"sanitizer active: {san['enabled']} (planted race reported: {san['control_races'] > 0})")
    proofs["sanitizer active"] = verdict(san["enabled"] and san["control_races"] > 0, san)
    proofs["sanitizer: no race"] = verdict(san["enabled"] and san["races"] == 0 and san["result"] is not None, san)
    out["proofs"] = proofs
    check(out["one_op_step_used"] and out["one_op_vs_per_lane_step"] == "bitwise equal",
          f"one-op sign step: used {out['one_op_step_used']}, vs per-lane {out['one_op_vs_per_lane_step']}")
    check(not any(v.startswith("failed") for v in proofs.values()), f"race proofs failed: {proofs}")
    return out


# -- d) compile ------------------------------------------------------------------------------


def step_compile(args) -> dict:
    """auto-round with enable_torch_compile=True under dpq world 2 on cuda:0,cuda:0, lanes checked identical
    after every step (a mismatch raises); the block's world and seconds as dpq records them."""
    if args.dry_run:
        return {"status": SKIP_DRY, "proofs": _not_proven("compile")}
    from auto_round import AutoRound

    from dpq.autoround import parallel_quantization
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples

    t0 = time.perf_counter()
    with parallel_quantization(2, "cuda:0,cuda:0", debug_identical=True) as records:
        AutoRound(build_tiny_llama(TinyLlamaConfig(num_hidden_layers=1)), tokenizer=build_tokenizer(),
                  dataset=calibration_samples(8, 64), device_map="cuda:0", enable_torch_compile=True, iters=4,
                  nsamples=8, seqlen=64, batch_size=4, seed=42).quantize()
    blocks = [{"name": r.name, "world": r.world, "seconds": round(r.seconds, 2), "fell_back": r.fell_back,
               "communicator": r.communicator} for r in records]
    ok = bool(blocks) and all(b["world"] == 2 and not b["fell_back"] for b in blocks)
    return {"blocks": blocks, "seconds": round(time.perf_counter() - t0, 1),
            "proofs": {"compile-on world 2": verdict(ok, blocks)}}


# -- e) the suite ------------------------------------------------------------------------------


def suite_selection() -> dict:
    """The suite step's tests, read from the files (nothing imported): every node named in
    :data:`SUITE` exists, every name in :data:`SUITE_EXCLUDE` leaves out at least one test (a stale
    exclusion would let a slow test in unnoticed), and what is left."""
    import ast

    selected, problems, excluded = [], [], {name: 0 for name in SUITE_EXCLUDE}
    for node in SUITE:
        path, _, only = node.partition("::")
        file = ROOT / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
            continue
        tests = [f.name for f in ast.parse(file.read_text()).body
                 if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name.startswith("test")]
        if only and only not in tests:
            problems.append(f"{node}: no such test")
        for name in [only] if only else tests:
            hits = [x for x in SUITE_EXCLUDE if x in name]
            for x in hits:
                excluded[x] += 1
            if not hits:
                selected.append(f"{path}::{name}")
    problems += [f"-k 'not {x}' leaves out no test" for x, n in excluded.items() if n == 0]
    return {"selected": selected, "problems": problems}


def step_suite(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", *SUITE, "-k", SUITE_K, "-p", "no:cacheprovider"]  # -q from pyproject
    sel = suite_selection()
    out = {"command": " ".join(cmd[1:]), "tests": len(sel["selected"]), "problems": sel["problems"]}
    check(not sel["problems"] and sel["selected"], f"the suite subset is stale: {sel['problems']}")
    if args.dry_run:  # the selection is checked above; pytest runs on the GPU box only
        out["proofs"] = {"suite subset": "not proven: selection checked, not run (dry run)"}
        return out
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    out.update(rc=proc.returncode, summary=lines[-1] if lines else "")
    out["proofs"] = {"suite subset": verdict(proc.returncode == 0, out["summary"])}
    check(proc.returncode == 0, f"pytest exited {proc.returncode}: {out['summary']}")
    return out


# -- f) timing ---------------------------------------------------------------------------------


def _llama_run(size: dict, device: str, world: int | None, profile_to: Path | None = None,
               instrument: bool = False) -> dict:
    """One AutoRound run of a one-layer Llama-shaped bf16 model; ``world`` None = dpq off (serial).
    Returns the seconds of each quantize_block call (the block's tuning), and peak memory on CUDA."""
    import torch
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    from dpq.autoround import disable, enable
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, build_tokenizer, calibration_samples
    from dpq.plan import BlockPrice, price_runtime

    cfg = TinyLlamaConfig(hidden_size=size["hidden"], intermediate_size=size["inter"], num_hidden_layers=1,
                          num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
                          max_position_embeddings=size["seq"])
    model = build_tiny_llama(cfg).to(torch.bfloat16)
    cuda = device.startswith("cuda")
    if world is not None:
        enable(world, devices=[device] * world)
    method = SignRoundQuantizer.quantize_block  # dpq's delegation when enabled
    seconds, peaks, prices, timelines = [], [], [], []

    def timed(self, *a, **kw):
        if not prices:  # the block arrives unwrapped, with its cached inputs; world 2 on one device
            price = BlockPrice(a[0], a[1], size["batch"], compute_dtype=self.model_context.amp_dtype)
            dev = torch.device(device)
            prices.append({"home": price.home(2), "mirror": price.mirror(2),
                           "runtime": sum(price_runtime(dev, home=k == 0, communicator="local", world=2)
                                          for k in range(2))})
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
        watch = lane_timeline() if instrument else contextlib.nullcontext()
        try:
            with watch as timeline:
                return method(self, *a, **kw)
        finally:
            if timeline is not None:
                timelines.append(timeline)
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
    out = {"block_seconds": seconds, "peak_bytes_over_start": peaks, "price_world2": prices[:1]}
    if timelines:
        out["lanes"] = timelines[0].summary()
    return out


class _LaneTimeline:
    """What :func:`lane_timeline` recorded: per iteration, CUDA events around each lane's forward, the
    readback's waits, and the synchronizing CUDA calls torch's sync debug mode reported."""

    def __init__(self, ref) -> None:
        self.ref, self.iteration = ref, -1
        self.forwards: list[tuple[int, int, object, object]] = []  # (iteration, lane, start, end)
        self.waits: dict[int, int] = {}
        self.syncs: dict[int, list[str]] = {}

    def summary(self) -> dict:
        import torch

        torch.cuda.synchronize()
        per_iter: dict[int, dict[int, list[tuple[float, float]]]] = {}
        for it, lane, start, end in self.forwards:
            per_iter.setdefault(it, {}).setdefault(lane, []).append((self.ref.elapsed_time(start),
                                                                     self.ref.elapsed_time(end)))
        overlaps = {it: _overlap(lanes) for it, lanes in sorted(per_iter.items()) if len(lanes) > 1}
        iters = sorted(set(self.waits) | set(self.syncs) | set(per_iter))
        return {"forward_overlap": overlaps,
                "readback_waits": [self.waits.get(i, 0) for i in iters],
                "implicit_syncs": {i: self.syncs[i] for i in iters if self.syncs.get(i)}}


def _overlap(lanes: dict[int, list[tuple[float, float]]]) -> float:
    """(sum of the lanes' busy time - their union) / (sum - the longest): 1 = side by side, 0 = one after another."""
    def union(iv):
        total, end = 0.0, float("-inf")
        for a, b in sorted(iv):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    busy = [union(iv) for iv in lanes.values()]
    spread = sum(busy) - max(busy)
    return (sum(busy) - union([x for iv in lanes.values() for x in iv])) / spread if spread > 0 else 1.0


@contextlib.contextmanager
def lane_timeline():
    """Around one quantize_block on CUDA lanes: CUDA events (timing) on each lane's stream around its
    forward and loss (TuneEngine's lane loss runs under the lane's issue()), the readback's polled waits
    per iteration (TuneEngine._wait: R6's one host sync), and torch.cuda.set_sync_debug_mode("warn"):
    every synchronizing CUDA call torch reports (an implicit sync: .item(), a pageable copy, ...)."""
    import torch

    from dpq import tune_loop

    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    rec = _LaneTimeline(ref)
    engine_cls = tune_loop.TuneEngine
    real_init, real_backward, real_wait = engine_cls.__init__, engine_cls.backward, engine_cls._wait

    def init(engine, replicas, lane_loss, *a, **kw):
        def timed(lane, module, indices):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = lane_loss(lane, module, indices)
            end.record()
            rec.forwards.append((rec.iteration, lane.index, start, end))
            return loss
        real_init(engine, replicas, timed, *a, **kw)

    def backward(engine, indices):
        rec.iteration += 1
        return real_backward(engine, indices)

    def wait(engine, readback):
        rec.waits[rec.iteration] = rec.waits.get(rec.iteration, 0) + 1
        return real_wait(engine, readback)

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            rec.syncs.setdefault(rec.iteration, []).append(f"{filename}:{lineno}")

    engine_cls.__init__, engine_cls.backward, engine_cls._wait = init, backward, wait
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield rec
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            engine_cls.__init__, engine_cls.backward, engine_cls._wait = real_init, real_backward, real_wait


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
    return {"streams": len(per_stream), "overlap": _overlap(per_stream)}


FORWARD_OVERLAP = 0.5  # the lanes' forwards on one GPU: each runs beside the other for at least half its time


def _freeze_imports() -> None:
    """Import what the runs use, then move every object alive now (modules, classes: never garbage) to
    the collector's permanent generation: auto-round and dpq call ``gc.collect()`` a dozen times per
    block, and each call would otherwise walk torch's and transformers' objects again (seconds of CPU
    on a tiny block). Objects made by the runs are collected as before."""
    import gc

    import torch  # noqa: F401
    from auto_round import AutoRound  # noqa: F401

    import dpq.autoround  # noqa: F401

    gc.collect()
    gc.freeze()


def step_timing(args) -> dict:
    if args.dry_run:  # the code path on CPU, as small as it runs: one world-2 run, profiled
        size = {"hidden": 64, "inter": 128, "heads": 4, "seq": 16, "nsamples": 2, "batch": 2, "iters": 1}
        device, worlds = "cpu", []
    else:
        import torch

        check(torch.cuda.is_available(), "no CUDA")
        size = {"hidden": 4096, "inter": 11008, "heads": 32, "seq": 2048, "nsamples": 8, "batch": 8,
                "iters": args.iters}
        device, worlds = "cuda:0", [1, 2, 4]
    _freeze_imports()
    out: dict = {"size": size, "device": device, "runs": {}}
    if worlds:
        out["runs"]["serial"] = _llama_run(size, device, None)
    for w in worlds:
        out["runs"][f"world{w}"] = _llama_run(size, device, w, instrument=w == 2)
    trace = Path(args.out) / "trace_world2.json"
    profiled = "world2_profiled" if worlds else "world2"
    out["runs"][profiled] = _llama_run(dict(size, iters=min(2, size["iters"])), device, 2, profile_to=trace)
    out["kernel_overlap"] = lane_overlap(trace)
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    out["trace"] = trace.name + ".gz"
    # world 2 on one device: home's and the mirror's price (dpq.plan) next to what the run allocated
    out["price_world2"] = out["runs"]["world2"]["price_world2"]
    out["measured_world2_peak_over_start_bytes"] = out["runs"]["world2"]["peak_bytes_over_start"]
    if not worlds:
        out["proofs"] = _not_proven("timing")
        return out
    serial = sum(out["runs"]["serial"]["block_seconds"])
    out["speedup_vs_serial"] = {k: serial / sum(v["block_seconds"]) for k, v in out["runs"].items()
                                if k.startswith("world") and k != "world2_profiled" and sum(v["block_seconds"])}
    lanes = out["runs"]["world2"]["lanes"]
    overlaps = lanes["forward_overlap"]
    steady = [v for it, v in overlaps.items() if int(it) >= 1] or list(overlaps.values())
    mean = sum(steady) / len(steady) if steady else 0.0
    priced = sum(out["price_world2"][0].values()) if out["price_world2"] else 0
    peak = max(out["measured_world2_peak_over_start_bytes"] or [0])
    out["proofs"] = {
        "lanes' forwards overlap": verdict(mean >= FORWARD_OVERLAP, f"mean {mean:.2f} < {FORWARD_OVERLAP}: {lanes}"),
        "one host sync per iteration": verdict(set(lanes["readback_waits"]) == {1} and not lanes["implicit_syncs"],
                                               lanes),
        "price covers the allocated peak": verdict(0 < peak <= priced, f"peak {peak} B, priced {priced} B"),
    }
    check(not any(v.startswith("failed") for v in out["proofs"].values()), f"timing proofs failed: {out['proofs']}")
    return out


# -- the summary ---------------------------------------------------------------------------

STEPS = {"versions": step_versions, "nccl": step_nccl, "race": step_race, "compile": step_compile,
         "suite": step_suite, "timing": step_timing}
HIDDEN = {"race-tune": race_tune, "nccl-hang": nccl_hang}  # subprocesses of race and nccl


def summarize(args) -> int:
    state = Path(args.state)
    steps, proofs = {}, {}
    for name, _limit, _, names in PLAN:
        entry = {}
        f = state / f"{name}.json"
        if f.exists():
            entry = json.loads(f.read_text())
        rc_file = state / f"{name}.rc"
        if rc_file.exists():
            rc, budget, secs = rc_file.read_text().split()
            entry.update(rc=int(rc) if rc.lstrip("-").isdigit() else rc, limit_s=int(budget), seconds=float(secs),
                         timed_out=rc in ("124", "137"))
            if not f.exists():
                entry["status"] = "timed out" if entry["timed_out"] else (
                    "skipped: versions failed" if rc == "skipped" else "failed (no result written)")
        else:
            entry.setdefault("status", "not run")
        got = (entry.get("result") or {}).get("proofs") or {}
        for p in names:
            proofs[p] = got.get(p) or f"not proven: the {name} step {entry.get('status', 'did not run')}"
        steps[name] = entry
    ok = all(e.get("status") in ("passed", SKIP_DRY) for e in steps.values())
    summary = {"dry_run": args.dry_run, "passed": ok, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "budget_s": STEPS_S, "proofs": proofs, "steps": steps}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({k: v.get("status") for k, v in steps.items()}, indent=2))
    print("proofs:")
    for p, v in proofs.items():
        print(f"  {p}: {v.splitlines()[0][:200]}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=[*STEPS, "summarize", "plan", *HIDDEN])
    p.add_argument("--state", help="folder for each step's result")
    p.add_argument("--out", help="folder for the summary, logs and trace")
    p.add_argument("--dry-run", action="store_true", help="CPU only: CUDA steps are skipped")
    p.add_argument("--names", action="store_true", help="plan: one 'step budget' line per step (for the .sh)")
    p.add_argument("--iters", type=int, default=10, help="tuning iterations of the timing runs")
    p.add_argument("--sanitizer-timeout", type=int, default=60)
    p.add_argument("--blob", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step == "plan":
        if args.names:
            print("\n".join(f"{name} {limit}" for name, limit, _, _ in PLAN))
        else:
            print_plan()
        return 0
    if args.step == "summarize":
        return summarize(args)
    if args.step in HIDDEN:
        print(json.dumps(HIDDEN[args.step](args), default=str))
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
