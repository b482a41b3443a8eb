"""One Llama-shaped block tuned by auto-round on one device, instrumented: the core steps' unit.

:func:`tune_block` runs ``AutoRound(...).quantize()`` on a one-layer Llama of :class:`BlockShape`
(random weights, bf16) and stops once its block is tuned (``quantize_block`` returned: auto-round's
own serial tune, or dpq's when ``RunSpec.world`` is set). Inside that tune it marks the iterations:
each iteration ends where its optimizer step ends (auto-round's ``_step``, dpq's
``TuneEngine.step``), which both loops reach once per iteration after their host sync, so the
steady iterations' wall times are the differences of those ends. At each end the issuing thread's
own CPU time (``time.thread_time()``: that thread alone, the profiler off) and the process's are
read too (Note [the issuing thread's CPU time]). The last ``profiled`` iterations run under the
torch profiler with the marks ``dpqlab.gpu_check.trace`` reads. The dynamo
compiles of the whole run (the no-grad caching forward and the tuning forward and backward) are
timed with torch's compile callbacks (``dpq.engine.compiles.CompileWatch``).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dpqlab.gpu_check import trace
from dpqlab.timeline.work import is_view


@dataclass(frozen=True)
class BlockShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    seqlen: int
    nsamples: int = 8
    group_size: int = 128
    bits: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def as_calibration(self) -> dict:
        """The calibration schema's ``block``."""
        return {"hidden": self.hidden, "intermediate": self.intermediate, "heads": self.heads,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "seqlen": self.seqlen,
                "group_size": self.group_size, "bits": self.bits, "dtype": "bfloat16"}


LLAMA3_8B = BlockShape(hidden=4096, intermediate=14336, heads=32, kv_heads=8, seqlen=2048)
DRY = BlockShape(hidden=64, intermediate=128, heads=4, kv_heads=2, seqlen=32, group_size=32)


@dataclass(frozen=True)
class RunSpec:
    """One tune: the path (torch.compile on or off), the batch per iteration, serial auto-round
    (``world`` None) or dpq with ``world`` lanes on ``devices``, and its iterations: ``warmup``
    (compiles, first allocations), ``timed`` (wall time, no profiler), ``profiled``."""

    compile: bool
    batch: int
    world: int | None = None
    devices: tuple[str, ...] = ()
    debug_identical: bool = False
    warmup: int = 2
    timed: int = 3
    profiled: int = 0

    @property
    def iters(self) -> int:
        return self.warmup + self.timed + self.profiled

    @property
    def label(self) -> str:
        who = "serial" if self.world is None else f"dpq{self.world}"
        return f"{who}_{'compile' if self.compile else 'eager'}_b{self.batch}"


@dataclass
class TuneResult:
    spec: dict
    iteration_ms: list[float] = field(default_factory=list)  # the timed iterations
    # the timed iterations' CPU ms (Note [the issuing thread's CPU time]): the issuing thread's outside the
    # readback wait and the backward call, its own inside those two, and every thread's of the process
    thread_cpu_ms: list[float] = field(default_factory=list)
    thread_cpu_aside_ms: list[float] = field(default_factory=list)
    process_cpu_ms: list[float] = field(default_factory=list)
    first_iteration_ms: float | None = None
    compile_s: float = 0.0
    profile: dict = field(default_factory=dict)  # trace.summarize of the profiled iterations
    identical: dict | None = None  # debug runs: {"steps", "checked", "mismatch"}
    records: list[dict] = field(default_factory=list)  # dpq's block records (world, compile_s per lane, ...)
    peak_bytes: int | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.iteration_ms) if self.iteration_ms else None

    def cpu_medians(self) -> dict[str, float | None]:
        """The medians of the timed iterations' CPU ms (None where none was timed)."""
        return {name: round(statistics.median(v), 3) if v else None for name, v in (
            ("thread_cpu_ms", self.thread_cpu_ms), ("thread_cpu_aside_ms", self.thread_cpu_aside_ms),
            ("process_cpu_ms", self.process_cpu_ms))}

    def as_dict(self) -> dict:
        return {**asdict(self), "median_ms": self.median_ms, "cpu_median": self.cpu_medians()}


def build_model(shape: BlockShape):
    """A one-layer bf16 Llama of ``shape`` with seeded random weights, on the CPU."""
    import torch

    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama

    cfg = TinyLlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=1,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                          max_position_embeddings=shape.seqlen)
    return build_tiny_llama(cfg).to(torch.bfloat16)


class _Tuned(Exception):
    """Stops AutoRound once the block is tuned (its packing and the rest are not measured)."""


class _Marks:
    """The iteration marks and the profiler window of one tune (see the module docstring).

    Note [the issuing thread's CPU time]
    One thread issues every lane's work; the timeline model's host figure is that thread's own time
    per lane-iteration. Its wall time between two step ends is only a bound of it (on lanes of one
    GPU it also holds the thread's waits for the device), and a profiled iteration's is inflated by
    the profiler's per-op events. ``time.thread_time()`` (CLOCK_THREAD_CPUTIME_ID: the calling
    thread's CPU alone, nanoseconds) read at each step end, on the issuing thread, the profiler off,
    is the figure itself. What the thread spends inside the readback wait (polling events between
    sleeps) and the backward call (autograd's device threads run it; the caller waits) is set
    apart, as the profiled ``own_ms`` sets those calls' wall time apart (``trace.Iteration``). The
    process's CPU time (every thread: autograd's, the allocator's) is read beside it."""

    def __init__(self, spec: RunSpec, trace_to: Path | None, cuda: bool) -> None:
        self.spec, self.trace_to, self.cuda = spec, trace_to, cuda
        self.start: float | None = None
        self.step_ends: list[float] = []
        self.cpu_ends: list[tuple[float, float, float]] = []  # (thread, thread set apart, process) at each end
        self.aside = 0.0  # the issuing thread's CPU seconds so far inside the readback wait and the backward
        self.prof = None

    def record(self, name: str):
        import torch

        return torch.profiler.record_function(name)

    def aside_cpu(self, name: str, real):
        """``real`` inside the mark ``name``, its CPU time on the calling thread set apart."""
        def call(*a, **k):
            t0 = time.thread_time()
            try:
                with self.record(name):
                    return real(*a, **k)
            finally:
                self.set_aside(t0)
        return call

    def set_aside(self, since: float) -> None:
        """The calling thread's CPU time from ``since`` (a ``time.thread_time()``) to now, set apart."""
        self.aside += time.thread_time() - since

    def step(self, call):
        with self.record(trace.STEP):
            out = call()
        self.stepped()
        return out

    def stepped(self) -> None:
        """A step ended: its time kept; the profiler started and stopped at the iterations the spec says."""
        self.step_ends.append(time.perf_counter())
        self.cpu_ends.append((time.thread_time(), self.aside, time.process_time()))
        n = len(self.step_ends)
        if self.trace_to is not None and self.spec.profiled:
            if n == self.spec.warmup + self.spec.timed:
                self._start_profiler()
            elif n == self.spec.iters and self.prof is not None:
                self._stop_profiler()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts)
        self.prof.start()
        with self.record(trace.START):
            pass

    def _stop_profiler(self) -> None:
        prof, self.prof = self.prof, None
        prof.stop()
        prof.export_chrome_trace(str(self.trace_to))

    def _timed(self) -> range:
        """The timed iterations' indices into the step ends (each from the end before it)."""
        w = self.spec.warmup
        return range(max(1, w), min(len(self.step_ends), w + self.spec.timed))

    def timed_ms(self) -> list[float]:
        ends = self.step_ends
        return [round((ends[i] - ends[i - 1]) * 1e3, 3) for i in self._timed()]

    def timed_cpu_ms(self) -> tuple[list[float], list[float], list[float]]:
        """The timed iterations' (issuing thread outside the wait and the backward, the thread inside
        them, the process) CPU ms: Note [the issuing thread's CPU time]."""
        c = self.cpu_ends
        delta = [[(c[i][k] - c[i - 1][k]) * 1e3 for i in self._timed()] for k in range(3)]
        own = [round(t - a, 3) for t, a in zip(delta[0], delta[1], strict=True)]
        return own, [round(a, 3) for a in delta[1]], [round(p, 3) for p in delta[2]]


@contextlib.contextmanager
def _patched(obj, name: str, make) -> Iterator[None]:
    real = getattr(obj, name)
    setattr(obj, name, make(real))
    try:
        yield
    finally:
        setattr(obj, name, real)


@contextlib.contextmanager
def _instrument(quantizer, spec: RunSpec, marks: _Marks, identical: dict) -> Iterator[None]:
    """The marks on the loop that runs: auto-round's (serial: its quantizer's methods wrapped) or dpq's
    (the engine's phases, seen by an observer: Note [observers, not patches] in ``dpq.engine.phases``)."""
    from auto_round.wrapper import WrapperLinear

    from dpq.engine import phases

    with contextlib.ExitStack() as stack:
        if spec.world is None:
            stack.enter_context(_patched(quantizer, "_step", lambda real: lambda *a, **k: marks.step(
                lambda: real(*a, **k))))
            stack.enter_context(_patched(quantizer, "_scale_loss_and_backward", lambda real: marks.aside_cpu(
                trace.BACKWARD, real)))
        else:
            stack.enter_context(phases.observing(_engine_marks(marks, identical)))
        if not spec.compile:  # eager only: a mark inside a compiled region would break its graph
            stack.enter_context(_patched(WrapperLinear, "_qdq_weight", lambda real: _marked(marks, trace.QDQ, real)))
        yield


def _marked(marks: _Marks, name: str, real):
    def call(*a, **k):
        with marks.record(name):
            return real(*a, **k)
    return call


def _engine_marks_class():
    from dpq.engine.phases import Observer

    class EngineMarks(Observer):
        """dpq's phases as the trace's marks: each lane's forward (``FORWARD``), the backward calls
        (``BACKWARD``), the readback's wait (``WAIT``) and the step (``STEP``, which also counts the
        iterations and starts and stops the profiler); ``--parallel_debug``'s checks counted."""

        def __init__(self, marks: _Marks, identical: dict) -> None:
            self.marks, self.identical, self.open = marks, identical, []
            self.names = {"backward": trace.BACKWARD, "readback": trace.WAIT}

        def phase_begin(self, name, owner, lane):
            mark = trace.FORWARD if name == "forward" and lane is not None else \
                trace.STEP if name == "step" else self.names.get(name)
            if mark is not None:
                rec = self.marks.record(mark)
                rec.__enter__()  # the backward's and the readback's CPU on this thread set apart (Note above)
                self.open.append((name, lane, rec, time.thread_time() if name in self.names else None))

        def phase_end(self, name, owner, lane, error):
            if name == "identical check":
                if error is not None:
                    self.identical["mismatch"] = f"{type(error).__name__}: {error}"[:400]
                else:
                    self.identical["checked"] += 1
            if self.open and self.open[-1][:2] == (name, lane):
                _, _, rec, cpu0 = self.open.pop()
                rec.__exit__(None, None, None)
                if cpu0 is not None:
                    self.marks.set_aside(cpu0)
                if name == "step" and error is None:
                    self.marks.stepped()

    return EngineMarks


def _engine_marks(marks: _Marks, identical: dict):
    """The observer (its class made on first use: this module imports torch and dpq late)."""
    return _engine_marks_class()(marks, identical)


def tune_block(model_template, shape: BlockShape, spec: RunSpec, device: str,
               trace_to: Path | None = None, on_block=None) -> TuneResult:
    """One tune of the block (see the module docstring); a failed tune raises, with what was
    measured until then in the exception's ``result`` attribute. ``on_block(quantizer, block,
    fp_inputs, input_others)``: called as the block arrives, before it is tuned."""
    import torch
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    from dpq.autoround import integration
    from dpq.demo.model import build_tokenizer, calibration_samples
    from dpq.engine.compiles import CompileWatch

    cuda = device.startswith("cuda")
    if spec.compile:
        import torch._dynamo  # CompileWatch counts compiles only once dynamo is imported
    result = TuneResult(spec=asdict(spec))
    marks = _Marks(spec, trace_to, cuda)
    identical = {"steps": 0, "checked": 0, "mismatch": None}
    if spec.world is not None:
        integration.enable(spec.world, list(spec.devices), parallel_debug=spec.debug_identical)
    tune = SignRoundQuantizer.quantize_block  # dpq's delegation when enabled

    def once(self, *a, **kw):
        if on_block is not None:
            on_block(self, *a[:3])
        with _instrument(self, spec, marks, identical):
            marks.start = time.perf_counter()
            tune(self, *a, **kw)
        raise _Tuned

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    SignRoundQuantizer.quantize_block = once
    try:
        with CompileWatch(1) as watch, watch.lane(0):
            AutoRound(copy.deepcopy(model_template), tokenizer=build_tokenizer(),
                      dataset=calibration_samples(shape.nsamples, shape.seqlen), device_map=device,
                      enable_torch_compile=spec.compile, iters=spec.iters, nsamples=shape.nsamples,
                      seqlen=shape.seqlen, batch_size=spec.batch, group_size=shape.group_size, bits=shape.bits,
                      seed=42).quantize()
    except _Tuned:
        pass
    except Exception as e:
        e.result = result
        raise
    finally:
        SignRoundQuantizer.quantize_block = tune
        if marks.prof is not None:
            marks.prof.stop()
        if spec.world is not None:
            result.records = [_record(r) for r in integration.run_summary()]
            integration.disable()
        _finish(result, marks, watch if "watch" in locals() else None, identical, spec)
        if cuda:
            result.peak_bytes = torch.cuda.max_memory_allocated() - before
    return result


def _finish(result: TuneResult, marks: _Marks, watch, identical: dict, spec: RunSpec) -> None:
    result.iteration_ms = marks.timed_ms()
    result.thread_cpu_ms, result.thread_cpu_aside_ms, result.process_cpu_ms = marks.timed_cpu_ms()
    if marks.step_ends and marks.start is not None:
        result.first_iteration_ms = round((marks.step_ends[0] - marks.start) * 1e3, 3)
    if watch is not None:
        result.compile_s = round(sum(watch.compile_s()), 3)
    if spec.debug_identical:
        result.identical = dict(identical, steps=len(marks.step_ends))
    if marks.trace_to is not None and marks.trace_to.is_file():
        result.profile = trace.summarize(trace.analyze(trace.load(marks.trace_to), is_view))


def _record(r) -> dict:
    keep = ("name", "world", "seconds", "fell_back", "communicator", "compiles", "recompiles", "compile_s", "issue_s")
    return {k: getattr(r, k) for k in keep if hasattr(r, k)}


def ceilings(device: str) -> dict:
    """The card's two ceilings (H200.md: measure them in the first call): an 8192^3 bf16 matmul on
    random data (TFLOP/s) and a device-to-device copy (GB/s, bytes read + written), each the median
    of 10 timed runs after 3 warm-ups, timed with CUDA events."""
    import torch

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm_s = timed(lambda: torch.matmul(a, b))
    src = torch.randn(1 << 30, device=device)  # 4 GiB of float32: many times the L2
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    nbytes = src.numel() * src.element_size()
    return {"gemm_8192_tflops": round(2 * n**3 / mm_s / 1e12, 1), "copy_GBps": round(2 * nbytes / copy_s / 1e9, 1)}
