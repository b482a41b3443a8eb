"""Recorded outputs of GPU-check runs, for the verdict tests: Chrome traces in the form torch's
profiler (Kineto) writes them, built event by event for one dpq world-2 run on one GPU, good or with
one thing broken. No GPU has run the check yet: these follow Kineto's format (categories
``cuda_runtime``/``cuda_driver`` on host threads with a ``correlation`` id, ``kernel``/``gpu_memcpy``
on the GPU with that id and their ``stream``, ``user_annotation`` for the marks, ``cpu_op`` with
autograd's ``Sequence number``), not a card's output.

The good run, per iteration (times in microseconds, 10 ms an iteration): the issuing thread (tid 1)
launches lane 0's forward (inside a ``FORWARD`` mark) on stream 7 (matmul, attention, an eager
quantize-dequantize inside the ``QDQ`` mark, elementwise) and then lane 1's on stream 20 while lane
0's kernels still run; the
backward call (``BACKWARD``) hands over to autograd's device thread (tid 2), which launches matmuls
and the backward of the quantize-dequantize (a cpu_op whose sequence number is the forward's); the
readback copies each lane's losses to the host (DtoH) and the issuing thread waits once
(``WAIT``); the optimizer step (``STEP``) ends the iteration. Before the profiled iterations, a
set-up sync (``cudaStreamSynchronize`` on the issuing thread) that no verdict may count.
"""

from __future__ import annotations

import copy

from dpqlab.gpu_check import trace

MAIN, AUTOGRAD = 1, 2
LANE_STREAMS = (7, 20)


class TraceBuilder:
    def __init__(self) -> None:
        self.events: list[dict] = []
        self.corr = 0

    def host(self, name: str, tid: int, ts: float, dur: float = 2.0, cat: str = "cuda_runtime") -> int:
        self.corr += 1
        self.events.append({"ph": "X", "cat": cat, "name": name, "tid": tid, "pid": 0, "ts": ts, "dur": dur,
                            "args": {"correlation": self.corr}})
        return self.corr

    def kernel(self, name: str, tid: int, launch_ts: float, gpu_ts: float, dur: float, stream: int,
               cat: str = "kernel") -> None:
        corr = self.host("cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel", tid, launch_ts)
        self.events.append({"ph": "X", "cat": cat, "name": name, "tid": stream, "pid": 0, "ts": gpu_ts, "dur": dur,
                            "args": {"correlation": corr, "stream": stream, "device": 0}})

    def mark(self, name: str, ts: float, dur: float, tid: int = MAIN) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "tid": tid, "pid": 0, "ts": ts,
                            "dur": dur, "args": {}})

    def op(self, name: str, tid: int, ts: float, dur: float, **args) -> None:
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "pid": 0, "ts": ts, "dur": dur,
                            "args": args})

    def trace(self) -> dict:
        return {"traceEvents": copy.deepcopy(self.events)}


FORWARD = (("sm90_xmma_gemm_bf16bf16_bf16f32", 0.0, 400.0), ("pytorch_flash::flash_fwd_kernel", 10.0, 300.0),
           ("vectorized_elementwise_kernel<round>", 25.0, 120.0), ("vectorized_elementwise_kernel<mul>", 60.0, 80.0))


def world2_run(iterations: int = 2, *, sync_in_iteration: int | None = None, serialized: bool = False,
               launch_bound: bool = False) -> dict:
    """A profiled dpq world-2 run (see the module docstring); ``sync_in_iteration``: a
    ``cudaStreamSynchronize`` on autograd's thread in that iteration; ``serialized``: the host
    issues lane 1's forward only after lane 0's has finished on the GPU; ``launch_bound``: every
    kernel takes a hundredth as long, so the GPU finishes each soon after its launch."""
    scale = 0.01 if launch_bound else 1.0
    b = TraceBuilder()
    b.host("cudaStreamSynchronize", MAIN, 10.0, dur=300.0)  # set-up (e.g. count_nonzero(mask).item())
    b.mark(trace.START, 1000.0, 1.0)
    t = 1001.0
    free = dict.fromkeys(LANE_STREAMS, 0.0)  # when each stream's last kernel ends on the GPU
    for it in range(iterations):
        launch = t + 10.0
        for lane, stream in enumerate(LANE_STREAMS):
            b.mark(trace.FORWARD, launch - 1, 70.0)
            for name, dt, dur in FORWARD:
                if "round" in name:  # the eager quantize-dequantize, inside its mark
                    b.mark(trace.QDQ, launch + dt - 5, 30.0)
                    b.op("aten::round", MAIN, launch + dt - 4, 5.0, **{"Sequence number": 100 + 10 * it + lane})
                start = max(free[stream], launch + dt + 1.0)
                b.kernel(name, MAIN, launch + dt, start, dur * scale, stream)
                free[stream] = start + dur * scale
            launch = free[stream] + 20.0 if serialized else launch + 100.0
        back = launch + 200.0
        b.mark(trace.BACKWARD, back, 3000.0)
        b.op("autograd::engine::evaluate_function: RoundBackward0", AUTOGRAD, back + 10, 50.0,
             **{"Sequence number": 100 + 10 * it, "Fwd thread id": MAIN})
        b.kernel("triton_poi_fused_clamp_mul_where_0", AUTOGRAD, back + 20, back + 1500, 150.0 * scale, LANE_STREAMS[0])
        b.kernel("sm90_xmma_gemm_bf16bf16_bf16f32", AUTOGRAD, back + 100, back + 1700, 800.0 * scale, LANE_STREAMS[0])
        b.kernel("sm90_xmma_gemm_bf16bf16_bf16f32", AUTOGRAD, back + 110, back + 1800, 800.0 * scale, LANE_STREAMS[1])
        if sync_in_iteration == it:
            b.host("cudaStreamSynchronize", AUTOGRAD, back + 200, dur=900.0)
        for lane, stream in enumerate(LANE_STREAMS):
            b.kernel("Memcpy DtoH (Device -> Pinned)", MAIN, back - 50 + lane, back + 2700, 3.0, stream,
                     cat="gpu_memcpy")
        b.mark(trace.WAIT, back + 3010, 2500.0)
        b.host("cudaEventQuery", MAIN, back + 3020, dur=1.0)
        step = back + 5600
        b.mark(trace.STEP, step, 300.0)
        b.kernel("multi_tensor_apply_kernel<sign_step>", MAIN, step + 10, step + 400, 60.0 * scale, LANE_STREAMS[0])
        t = step + 300.0
        free = dict.fromkeys(LANE_STREAMS, t)
    return b.trace()


# The lanes step's result (as summary.json holds it) of a run on one H200 at batch 8, compile on: the walls
# are the first lease's (2026-12-04: world 2 46.013 ms, world 4 48.863 ms per unprofiled iteration, its
# profiled world 2's own 42.134 ms); that run did not yet read the issuing thread's CPU time, so the CPU and
# busy figures of ``with_thread_time`` are made up for the tests (each below its wall, as one thread's CPU
# time within a wall time must be).
H200_WALLS = {"1": 41.04, "2": 46.013, "4": 48.863}
MADE_UP_THREAD_CPU = {"1": 9.5, "2": 17.2, "4": 33.6}


def lanes_result(*, with_thread_time: bool, thread_cpu: dict[str, float] | None = None) -> dict:
    """The lanes step's result: worlds 2 and 4 timed (world 2 profiled), and with ``with_thread_time``
    the ``issuing`` entries of worlds 1, 2 and 4 (``thread_cpu`` replaces the made-up CPU figures)."""
    worlds = {w: {"timed": {"median_ms": H200_WALLS[w]}} for w in ("2", "4")}
    worlds["2"]["timed"]["profile"] = {"issuing_own_ms_per_iteration": 42.134,
                                       "issuing_ops_per_iteration": {"views": 656.0, "other": 409.0}}
    result = {"dpq_world1_vs_serial": 0.96, "worlds": worlds}
    if with_thread_time:
        cpu = thread_cpu or MADE_UP_THREAD_CPU
        result["issuing"] = {w: {"wall_ms": H200_WALLS[w], "thread_cpu_ms": cpu[w], "thread_cpu_aside_ms": 0.4,
                                 "process_cpu_ms": cpu[w] + 6.0, "gpu_busy_ms": H200_WALLS[w] - 1.0, "iterations": 3}
                             for w in ("1", "2", "4")}
    return result
