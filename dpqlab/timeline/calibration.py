"""What a GPU run measured, in the form the timeline model reads (``--calibration FILE``).

``benchmarks/gpu_check.sh`` writes ``$OUT/calibration.json``; ``python -m benchmarks.gpu_report OUT``
stores it as ``benchmarks/calibration/<card>-<date>.json``. The file holds raw measurements of one
block on one GPU; the model derives its rates from them with its *own* counts for that block (the
FLOPs of its matmuls and attention, the bytes of its weight-sized kernels, its ops per
lane-iteration), so a rate means the same thing in the model as on the card. What the file does
not measure (a key absent or null) leaves the model's stated figure in place: a calibration changes
the figures it names and only those (``tests/test_timeline_calibration.py``).

Schema ``dpq-calibration/1`` (JSON; times in the units their names say)::

    {
      "schema": "dpq-calibration/1",
      "card": "NVIDIA H200",             # torch.cuda.get_device_name()
      "gpu_class": "h200",               # the model's GPU class whose device rates it re-bases ("" = host only)
      "date": "2026-12-04",              # UTC date of the run
      "driver": "580.159.04", "torch": "2.11.0+cu130", "auto_round": "0.16.1",
      "command": "bash benchmarks/gpu_check.sh",
      "block": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128,
                "seqlen": 2048, "group_size": 128, "bits": 4, "dtype": "bfloat16"},
      "paths": {                         # one lane (auto-round's own tune of the block on cuda:0)
        "compile": {                     # auto-round's default: torch.compile on
          "8": {                         # samples per iteration: serial's batch ...
            "iteration_ms": 61.0,        # wall time per steady iteration
            "phases_ms": {               # GPU time per iteration by kernel class (the profiler)
              "matmul": 30.1, "attention": 9.2, "qdq_forward": 1.1, "qdq_backward": 1.9,
              "elementwise": 6.0, "optimizer_step": 0.4, "readback": 0.01},
            "host_ms_per_iteration": 4.1,    # the issuing thread's time per iteration outside blocking calls (profiled)
            "launches_per_iteration": 190,   # kernel launches per iteration (the profiler)
            "thread_cpu_ms_per_iteration": 3.2},  # its CPU time, unprofiled, outside the backward (issue 38)
          "1": {...}},                   # ... and a lane's slice at 8 lanes
        "eager": {"8": {...}, "1": {...}}},   # --disable_torch_compile
      "compile_s": {"block": 41.0,       # first compile of the block's forward + backward (host seconds)
                    "second_device": null},   # a second lane device's recompile (null: one GPU)
      "dpq_world1_vs_serial": 1.01,      # dpq world 1 / auto-round serial, per iteration, compile on
      "dpq_issuing": {"world": 2, "path": "compile", "batch": 8,   # dpq on lanes of one GPU (profiled):
                      "own_ms_per_iteration": 42.1,                 # its issuing thread outside blocking calls,
                      "own_ms_per_lane_iteration": 21.1,            # the readback wait and the backward call
                      "wall_ms_per_iteration": {"2": 46.0, "4": 48.9},  # unprofiled, lanes of one GPU
                      "ops_per_lane_iteration": {"views": 328, "other": 204.5},  # its outermost aten ops
                      # unprofiled, per world of lanes on one GPU (absent in files before issue 38):
                      "thread_cpu_ms_per_iteration": {"1": 9.0, "2": 17.0, "4": 33.0},  # time.thread_time
                      "thread_cpu_aside_ms_per_iteration": {...},  # of it, inside the wait and backward
                      "process_cpu_ms_per_iteration": {...},       # every thread of the process
                      "gpu_busy_ms_per_iteration": {...}},         # union of the GPU's kernels (profiled)
      "gemm_8192_tflops": 780.0,         # a plain 8192^3 bf16 torch.matmul
      "copy_GBps": 4300.0                # a device-to-device copy, bytes read + written per second
    }

``attention_in_matmul`` (optional, true): the run's ``matmul`` phase also holds its attention
kernels (the first H200 lease classified cuDNN's attention kernels, whose names hold ``wgmma``, as
matmul); the model then re-bases both rates by one factor so that their sum is the measured time.

Every number is optional except ``schema``, ``card``, ``date`` and ``gpu_class``; the phases are the
profiler's kernels classified by name and by the autograd phase they ran in (``dpqlab/gpu_check/trace.py``
says how). The model re-bases: the GPU class's matmul and attention rates (its FLOPs / the measured
phase), its memory bandwidth (its weight-sized quantize-dequantize bytes / the measured qdq phases),
the host's cost per op on each path (measured host time per iteration / the model's ops per
lane-iteration; with ``dpq_issuing``, instead every per-op cost by the one factor that makes the
model's issuing thread per lane-iteration what dpq's measured, the eager kind's only: :func:`issuing_scale`,
Note [host scales by kind]) and the compile
seconds; ``launches_per_iteration`` and ``iteration_ms`` are reported
beside the model's own counts and times, not used to re-base.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HOST_KINDS", "HOST_SOURCES", "PHASES", "SCHEMA", "Calibration", "CalibrationError", "ModelCounts",
           "PathMeasurement", "block_shape", "compiled_host_ms", "counts_of", "host_source", "issuing_bound",
           "issuing_scale", "rebase"]

SCHEMA = "dpq-calibration/1"
PHASES = ("matmul", "attention", "qdq_forward", "qdq_backward", "elementwise", "optimizer_step", "readback")
PATHS = ("compile", "eager")


class CalibrationError(ValueError):
    """A calibration file that does not follow the schema (the message names the key and the fix)."""


@dataclass(frozen=True)
class PathMeasurement:
    """One path (compile or eager) at one batch on one lane."""

    iteration_ms: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)
    host_ms_per_iteration: float | None = None
    launches_per_iteration: float | None = None


@dataclass(frozen=True)
class Calibration:
    card: str
    gpu_class: str
    date: str
    block: dict
    paths: dict[str, dict[int, PathMeasurement]]  # path -> batch -> measurement
    compile_s: dict[str, float | None]
    source: str  # the file it was read from, or "fixture"
    extra: dict = field(default_factory=dict)  # driver, torch, auto_round, command, dpq_world1_vs_serial, ...

    @property
    def host_source(self) -> str:
        """Whence its issuing thread's figure: :func:`host_source`."""
        return host_source(self.extra.get("dpq_issuing") or {})

    @property
    def label(self) -> str:
        """``<card>-<date>``: what every calibrated table names."""
        return f"{self.card.replace(' ', '_')}-{self.date}"

    def measurement(self, path: str, batch: int) -> PathMeasurement | None:
        return self.paths.get(path, {}).get(batch)

    @classmethod
    def from_dict(cls, data: dict, source: str = "fixture") -> Calibration:
        if data.get("schema") != SCHEMA:
            raise CalibrationError(f"{source}: schema is {data.get('schema')!r}, not {SCHEMA!r}. Fix: a file written "
                                   f"by benchmarks/gpu_check.sh of this version")
        for key in ("card", "date", "gpu_class"):
            if not isinstance(data.get(key), str):
                raise CalibrationError(f"{source}: {key!r} is missing or not a string. Fix: set it (the schema is in "
                                       f"dpqlab/timeline/calibration.py)")
        paths: dict[str, dict[int, PathMeasurement]] = {}
        for path, per_batch in (data.get("paths") or {}).items():
            if path not in PATHS:
                raise CalibrationError(f"{source}: unknown path {path!r}. Fix: one of {', '.join(PATHS)}")
            paths[path] = {}
            for batch, m in per_batch.items():
                phases = dict(m.get("phases_ms") or {})
                unknown = sorted(set(phases) - set(PHASES))
                if unknown:
                    raise CalibrationError(f"{source}: paths.{path}.{batch}: unknown phases {unknown}. Fix: the "
                                           f"phases are {', '.join(PHASES)}")
                paths[path][int(batch)] = PathMeasurement(
                    iteration_ms=m.get("iteration_ms"), phases_ms=phases,
                    host_ms_per_iteration=m.get("host_ms_per_iteration"),
                    launches_per_iteration=m.get("launches_per_iteration"))
        known = {"schema", "card", "date", "gpu_class", "block", "paths", "compile_s"}
        return cls(card=data["card"], gpu_class=data["gpu_class"], date=data["date"],
                   block=dict(data.get("block") or {}), paths=paths, compile_s=dict(data.get("compile_s") or {}),
                   source=source,
                   extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CalibrationError(f"{path}: cannot be read as JSON ({e}). Fix: the calibration.json a GPU check "
                                   f"wrote, or a file under benchmarks/calibration/") from e
        return cls.from_dict(data, source=str(path))


@dataclass(frozen=True)
class ModelCounts:
    """What the model itself counts for one lane of the calibration's block, per steady iteration
    (its 1-lane replay on that block: :func:`counts_of`)."""

    matmul_flops: float
    attention_flops: float
    qdq_bytes: float  # the weight quantize-dequantize kernels, forward and backward
    eager_ops: float  # eager kernels, copies and collectives, every host thread
    compiled_kernels: float  # generated kernels of compiled graphs
    compiled_externs: float  # extern calls (matmul, attention) of compiled graphs
    region_calls: float  # compiled graph calls
    launches: float  # every kernel launched


def counts_of(timeline) -> ModelCounts:
    """:class:`ModelCounts` of a 1-lane replay (a :class:`dpqlab.timeline.replay.Timeline`)."""
    from dpqlab.timeline.replay import op_class

    steady = {it.index for it in timeline.steady()}
    n = len(steady)
    pricing = timeline.pricing
    c = {"matmul": 0.0, "attention": 0.0, "qdq": 0.0, "eager": 0, "kernels": 0, "externs": 0, "calls": 0,
         "launches": 0}
    for op in timeline.ops:
        if op.iteration not in steady:
            continue
        cls = op_class(op)
        if cls in ("matmul", "attention"):
            c[cls] += pricing.flops(op)
        elif cls in ("qdq_forward", "qdq_backward"):
            c["qdq"] += pricing.scaled_bytes(op)
        if op.kind == "call":
            c["calls"] += 1
        elif op.kind == "kernel" and op.region:
            c["externs" if op.work != "elementwise" else "kernels"] += 1
        elif op.kind in ("kernel", "copy", "collective"):
            c["eager"] += 1
        c["launches"] += op.kind == "kernel"
    return ModelCounts(c["matmul"] / n, c["attention"] / n, c["qdq"] / n, c["eager"] / n, c["kernels"] / n,
                       c["externs"] / n, c["calls"] / n, c["launches"] / n)


def compiled_host_ms(timeline) -> float:
    """The issuing thread's host ms per lane-iteration in compiled regions, as ``timeline`` prices them:
    each region's call and the kernels and extern calls its graph launches, on the main thread of the
    steady iterations (Note [the compiled forward counted once])."""
    steady = {it.index for it in timeline.steady()}
    world = max(1, len(timeline.lane_streams))
    s = sum(timeline.pricing.host_s(op) for op in timeline.ops
            if op.iteration in steady and op.thread == "main" and (op.kind == "call" or (op.kind == "kernel"
                                                                                          and op.region)))
    return s / len(steady) / world * 1e3


def block_shape(cal: Calibration):
    """The calibration's block as a :class:`dpqlab.timeline.shapes.BlockShape`, at batch 8."""
    from dpqlab.timeline.shapes import BlockShape

    b = cal.block
    return BlockShape(f"the calibration's block ({cal.label})", hidden=int(b["hidden"]),
                      intermediate=int(b["intermediate"]), heads=int(b["heads"]), kv_heads=int(b["kv_heads"]),
                      head_dim=int(b["head_dim"]), seqlen=int(b.get("seqlen", 2048)),
                      group_size=int(b.get("group_size", 128)))


HOST_OP_COSTS = ("eager_op_s", "view_op_s", "compiled_kernel_s", "compiled_extern_s", "region_call_s",
                 "graph_launch_s", "graph_tree_s", "wait_s")


# Note [host scales by kind]
# The host's per-op costs fall in four kinds, each priced on its own scale (each op counted once:
# Note [the compiled forward counted once]):
#   eager            a Python-issued eager op (the dispatcher, autograd, a launch, and the Python of
#                    dpq and auto-round around it), a view, an event record or wait
#   region_call      a compiled region's call (dynamo's guards, AOT autograd's wrappers, the graph
#                    call) and CUDA graph trees' checks per replay
#   inductor_launch  a kernel or extern call launched by an Inductor graph (its wrapper line, Triton's
#                    launcher or aten's op without autograd)
#   graph_launch     a captured CUDA graph's cudaGraphLaunch
# ``dpq_issuing`` measures one figure: dpq's issuing thread per lane-iteration, whose counted ops
# (outermost aten ops, views and others) are all eager. It re-bases the eager kind only: its scale is
# (measured - the compiled regions at their stated costs) / the counted ops at the stated costs. No
# run measures the other three apart, so they keep their stated figures (scale 1): region_call_s
# 40 us, graph_tree_s 128 us, compiled_kernel_s 8 us, compiled_extern_s 6.5 us, graph_launch_s 41 us
# (dpqlab/timeline/devices.py: tritonbench's compiled-graph call 33-44 us and Inductor launch
# 6.8-9.1 us, pytorch#150488's graph trees and cudaGraphLaunch, each measured end to end on its path).
# Why not the eager scale for them: the eager figure is a sum of published per-layer costs of one op,
# and the H200 lease's x7.37 over it is mostly the Python between the counted ops (auto-round's and
# dpq's lines, charged to the ops they issue); a compiled region's launches run in Inductor's wrapper
# and C launchers with no such Python between them, and a graph launch is one C call, so scaling them
# alike (the model before issue 38) charged the compiled forward ~7x what its measurements say. Where
# a GPU check measures a kind (``paths`` host times: :func:`rebase`), that figure takes its place.
HOST_KINDS = {"eager": ("eager_op_s", "view_op_s", "wait_s"),
              "region_call": ("region_call_s", "graph_tree_s"),
              "inductor_launch": ("compiled_kernel_s", "compiled_extern_s"),
              "graph_launch": ("graph_launch_s",)}


# Whence the issuing thread's ms per lane-iteration (issuing_bound): measured, or an upper bound only.
HOST_SOURCES = {"thread_time": "measured: the issuing thread's own CPU time, unprofiled",
                "wall_bound": "an upper bound: an unprofiled iteration's wall / W",
                "profiled": "an upper bound: a profiled iteration's own time (the profiler's events cost host time)",
                "": "not measured: the stated host"}


def _thread_time(got: dict) -> tuple[int, float] | None:
    """(world, the issuing thread's CPU ms per iteration) of ``dpq_issuing``: the profiled world's
    (its ops are counted there), else the smallest world of several lanes, else world 1."""
    thread = {int(w): ms for w, ms in (got.get("thread_cpu_ms_per_iteration") or {}).items() if ms}
    if not thread:
        return None
    w = got.get("world") if got.get("world") in thread else min(thread, key=lambda w: (w == 1, w))
    return w, thread[w]


def host_source(got: dict) -> str:
    """Which figure :func:`issuing_bound` gives for ``dpq_issuing`` (a key of :data:`HOST_SOURCES`):
    ``"thread_time"`` (measured: the value), ``"wall_bound"`` or ``"profiled"`` (upper bounds:
    files without the CPU time, e.g. the first H200 lease's), ``""`` (no figure)."""
    ms, whence = issuing_bound(got)
    if ms is None:
        return ""
    return "thread_time" if whence.startswith("measured") else "profiled" if whence == "profiled" else "wall_bound"


def issuing_bound(got: dict) -> tuple[float | None, str]:
    """The issuing thread's own ms per lane-iteration that ``dpq_issuing`` supports, and whence.

    Note [the profiler's bound]
    ``own_ms_per_lane_iteration`` comes from a profiled world (the profiler's per-op events cost host
    time: the H200 lease's auto-round alone took 12.2 ms of host per profiled iteration against a
    10.4 ms unprofiled iteration). ``wall_ms_per_iteration`` holds the same step's *unprofiled*
    iterations per world of lanes on one GPU: the one issuing thread does all of an iteration's
    host work inside its wall time, so its own time per lane-iteration is at most the wall / W.
    The smaller of the two is an upper bound of the unprofiled figure, and the one used where the
    file has nothing better. ``thread_cpu_ms_per_iteration`` (issue 38) is that figure itself: the
    thread's own CPU time in unprofiled iterations (Note [the issuing thread's CPU time],
    dpqlab/gpu_check/block.py); it is used where present, its world's wall / W only as a bound."""
    thread = _thread_time(got)
    profiled = got.get("own_ms_per_lane_iteration")
    walls = {int(w): ms for w, ms in (got.get("wall_ms_per_iteration") or {}).items() if int(w) > 1 and ms}
    if thread is not None:
        w, ms = thread
        wall = (got.get("wall_ms_per_iteration") or {}).get(str(w))
        whence = f"measured: world {w}'s issuing thread CPU {ms:.2f} ms per unprofiled iteration / {w}"
        if wall and ms > wall:  # one thread's CPU time within a wall time cannot exceed it
            return wall / w, f"{whence}, above its wall {wall:.2f} ms: the wall's bound used"
        return ms / w, whence + (f" (wall bound {wall / w:.2f})" if wall else "")
    if not walls:
        return profiled, "profiled"
    w, ms = min(walls.items(), key=lambda kv: kv[1] / kv[0])
    if profiled and profiled <= ms / w:
        return profiled, "profiled"
    return ms / w, f"bounded by world {w}'s unprofiled {ms:.1f} ms per iteration / {w} (profiled: {profiled})"


def issuing_scale(cal: Calibration, host, model_ms_per_lane_iteration: float,
                  compiled_ms_per_lane_iteration: float = 0.0):
    """``host`` with the eager kind's per-op costs scaled by one factor (Note [host scales by kind]),
    so that the issuing thread per lane-iteration of the code the run measured costs what dpq's issuing
    thread measured
    (``dpq_issuing``: its own time, outside blocking calls, the readback wait and the backward call;
    at most the unprofiled bound, :func:`issuing_bound`). Returns (host, notes); ``host`` unchanged
    where the file has no such figure.

    Note [the measured code's ops]
    The run measured the code of its day; the model replays today's. Where the file counts the ops
    the issuing thread issued per lane-iteration (``ops_per_lane_iteration``: its outermost aten
    ops, views and others, from its trace), the scale prices *those* at the stated costs
    (``eager_op_s``, ``view_op_s``) and compares them with the measured time: the per-op cost is the
    measured code's, and today's code is priced by its own ops, so a change that issues fewer ops
    (7816b19's views made once, the five-op pack) shows in the table instead of being absorbed
    into the scale. Without counts, ``model_ms_per_lane_iteration`` (the model's replay of the
    calibration's block at the measured world and path with ``host``) stands in for them.

    Note [the compiled forward counted once]
    The run's counts are its issuing thread's *outermost aten ops* (dpqlab/gpu_check/trace.py): a
    compiled region's call is a ``Torch-Compiled Region`` event, not an aten op, and the kernels and
    extern calls its graph launches are inside it, so none of them is counted; yet the measured time
    holds them. Priced from the counts alone, the compiled forward's host time would be absorbed into
    the eager ops' scale and the replay would charge it again on top (~1.9 ms per lane-iteration at
    the H200 lease's x7.37). ``compiled_ms_per_lane_iteration`` (the model's compiled regions on the
    issuing thread at the measured world and path, :func:`compiled_host_ms`) is the part of the
    measured time those counts leave out; it joins the counted ops at the stated costs, so each op is
    counted once. (``model_ms_per_lane_iteration`` holds it already.)"""
    got = cal.extra.get("dpq_issuing") or {}
    measured, whence = issuing_bound(got)
    ops = got.get("ops_per_lane_iteration") or {}
    compiled = compiled_ms_per_lane_iteration
    if ops:
        then_ms = (ops.get("other", 0.0) * host.eager_op_s + ops.get("views", 0.0) * host.view_op_s) * 1e3
        then = (f"the run's own {ops.get('other', 0.0):.0f} ops and {ops.get('views', 0.0):.0f} views per "
                f"lane-iteration at the stated costs: {then_ms:.2f}")
    else:
        then_ms = model_ms_per_lane_iteration - compiled
        then = f"the model gave {model_ms_per_lane_iteration:.2f}, of it eager {then_ms:.2f}"
    if not measured or then_ms <= 0:
        return host, []
    if measured <= compiled:
        return host, [f"host: dpq's issuing thread {measured:.2f} ms per lane-iteration ({cal.label}, {whence}) is "
                      f"not above the compiled regions' stated {compiled:.2f}: the stated figures kept"]
    k = (measured - compiled) / then_ms  # Note [host scales by kind]: the eager kind's; the others stated
    figures = {name: getattr(host, name) * k for name in HOST_KINDS["eager"]}
    source = f"calibrated: {cal.label} (dpq's issuing thread)"
    host = host.rebased(**figures, calibrated=cal.label, sources={**host.sources, **dict.fromkeys(figures, source)})
    return host, [f"host: Python-issued eager ops x{k:.2f}, eager op {host.eager_op_s * 1e6:.1f} us ({cal.label}: "
                  f"dpq's issuing thread {measured:.2f} ms per lane-iteration at world {got.get('world')}, "
                  f"{got.get('path')}, {whence}; less the compiled regions at their stated costs, {compiled:.2f}; "
                  f"{then}); compiled-region calls, Inductor's launches and graph launches at their stated costs "
                  f"(Note [host scales by kind])"]


def rebase(cal: Calibration, gpu_key: str, gpu, host, counts: dict[str, ModelCounts], *, paths_host: bool = True):
    """``gpu`` and ``host`` with the figures ``cal`` measured put in their place (module docstring);
    ``counts``: the model's own :class:`ModelCounts` per path at batch 8. ``paths_host`` False: the
    host's per-op costs are left alone (:func:`issuing_scale` sets them from dpq's own issuing
    thread; the paths' host times are an upper bound: they include the thread's wait for the
    backward and auto-round's own loop). Returns (gpu, host, notes)."""
    notes: list[str] = []
    gpu_figures: dict[str, float] = {}
    host_figures: dict[str, float] = {}
    label = cal.label

    def seconds(path: str, phase: str) -> float | None:
        m = cal.measurement(path, 8)
        v = m.phases_ms.get(phase) if m is not None else None
        return v / 1e3 if v else None

    if cal.gpu_class == gpu_key:
        path = "compile" if cal.measurement("compile", 8) is not None else "eager"
        mm_work = counts[path].matmul_flops if path in counts else 0
        at_work = counts[path].attention_flops if path in counts else 0
        s = seconds(path, "matmul")
        if cal.extra.get("attention_in_matmul") and s and mm_work and at_work:
            # one measured time for both: both rates scale by one factor, the model's ratio kept
            f = (mm_work / gpu.matmul_flops + at_work / gpu.attention_flops) / s
            gpu_figures.update(matmul_flops=gpu.matmul_flops * f, attention_flops=gpu.attention_flops * f)
            notes.append(f"matmul_flops {gpu.matmul_flops * f / 1e12:.0f}, attention_flops "
                         f"{gpu.attention_flops * f / 1e12:.0f} TFLOP/s ({label}: matmul and attention together "
                         f"{s * 1e3:.2f} ms)")
        else:
            for figure, phase, work in (("matmul_flops", "matmul", mm_work), ("attention_flops", "attention", at_work)):
                s = seconds(path, phase)
                if s and work:
                    gpu_figures[figure] = work / s
                    notes.append(f"{figure} {work / s / 1e12:.0f} TFLOP/s ({label}: {phase} {s * 1e3:.2f} ms)")
        qdq = [seconds(path, p) for p in ("qdq_forward", "qdq_backward")]
        if all(qdq) and path in counts and counts[path].qdq_bytes:
            gpu_figures["mem_bw"] = counts[path].qdq_bytes / sum(qdq)
            notes.append(f"mem_bw {gpu_figures['mem_bw'] / 1e9:.0f} GB/s ({label}: quantize-dequantize "
                         f"{sum(qdq) * 1e3:.2f} ms)")
    eager_m, compile_m = cal.measurement("eager", 8), cal.measurement("compile", 8)
    eager_op = host.eager_op_s
    if not paths_host:
        eager_m = compile_m = None
    if eager_m is not None and eager_m.host_ms_per_iteration and "eager" in counts and counts["eager"].eager_ops:
        eager_op = eager_m.host_ms_per_iteration / 1e3 / counts["eager"].eager_ops
        host_figures.update(eager_op_s=eager_op, compiled_extern_s=eager_op,
                            view_op_s=eager_op * host.view_op_s / host.eager_op_s)  # the stated ratio kept
        notes.append(f"eager_op_s {eager_op * 1e6:.2f} us ({label}: eager host {eager_m.host_ms_per_iteration:.2f} "
                     f"ms per iteration / {counts['eager'].eager_ops:.0f} ops)")
    if compile_m is not None and compile_m.host_ms_per_iteration and "compile" in counts:
        c = counts["compile"]
        rest = compile_m.host_ms_per_iteration / 1e3 - c.eager_ops * eager_op - c.compiled_externs * eager_op
        stated = c.compiled_kernels * host.compiled_kernel_s + c.region_calls * host.region_call_s
        if stated > 0 and rest > 0:
            scale = rest / stated
            host_figures.update(compiled_kernel_s=host.compiled_kernel_s * scale,
                                region_call_s=host.region_call_s * scale)
            notes.append(f"compiled launch and graph-call costs x{scale:.2f} ({label}: compiled host "
                         f"{compile_m.host_ms_per_iteration:.2f} ms per iteration)")
    for key, figure in (("block", "compile_s"), ("second_device", "recompile_s")):
        if cal.compile_s.get(key):
            host_figures[figure] = float(cal.compile_s[key])
            notes.append(f"{figure} {host_figures[figure]:.1f} s ({label})")
    if gpu_figures:
        gpu = gpu.rebased(**gpu_figures, calibrated=label,
                          sources={**gpu.sources, **{k: f"calibrated: {label}" for k in gpu_figures}})
    if host_figures:
        host = host.rebased(**host_figures, calibrated=label,
                            sources={**host.sources, **{k: f"calibrated: {label}" for k in host_figures}})
    return gpu, host, notes
