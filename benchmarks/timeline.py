"""The CUDA timeline model's runs: one iteration of the real tune replayed on logical GPUs (modeled, not measured).

    .venv/bin/python -m benchmarks.timeline --table                    # the modeled speedup table, both paths
    .venv/bin/python -m benchmarks.timeline --world 4                  # one world: syncs, overlap, a PNG
    .venv/bin/python -m benchmarks.timeline --world 8 --preset 8b-h100 --eager
    .venv/bin/python -m benchmarks.timeline --table --calibration benchmarks/calibration/NVIDIA_H200-2026-12-04.json

What it does (``dpqlab/timeline/`` says exactly what is modelled and from what):

1. records a tiny bf16 Llama block as auto-round tunes it (``scenarios.record_block``), with auto-round's
   default torch.compile on (``compile``: each compiled region as the kernels inductor generates
   for it) or off (``--eager``: ``--disable_torch_compile``);
2. runs that block's tune through the auto-round adapter (``dpq.autoround.enable``) on W logical
   GPUs, recording every op, and replays the record with CUDA's semantics, every size scaled to
   the target block by its role (``shapes.RoleMap``), the exchange laid out in dpq's buckets for
   the target's tensors (``buckets``), priced on a GPU class and a server host whose figures are
   sourced (``devices``) or measured by a GPU run (``--calibration``; default: the newest file in
   ``benchmarks/calibration/``, ``--calibration none`` for the stated figures);
3. prints per iteration every host sync with the code that caused it and the lanes' overlap
   ((sum of lane busy - union) / (sum - max)); writes a PNG of one steady iteration and a JSON;
   ``--table`` instead prints the modeled speedups of 8B/32B/70B-class blocks on 4 x RTX 3090
   (PCIe) and 8 x H100 (NVLink) on both paths, each row with where an iteration goes, and ends
   with ``timeline_table path=compile speedup_3090_w4_70b=<x> speedup_h100_w8_70b=<y>
   speedup_h100_w8_8b=<z> calibrated=<no|card-date>``.

The issuing host's cost per op is a stated server-CPU figure (``devices.HOST``); this machine's own
(a 2-core VM that also runs the kernels) is measured and printed beside it as an upper bound.
The last line of a ``--world`` run is ``host_syncs_per_iter=<n> lane_overlap=<x> world=<w>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dpq.engine.exchange import Buckets  # noqa: E402
from dpq.planning.plan import overlap_choice  # noqa: E402
from dpqlab.timeline.calibration import (  # noqa: E402
    Calibration,
    block_shape,
    compiled_host_ms,
    counts_of,
    issuing_scale,
    rebase,
)
from dpqlab.timeline.devices import GPUS, HOST, GpuClass, HostCosts  # noqa: E402
from dpqlab.timeline.record import TimelineModel  # noqa: E402
from dpqlab.timeline.replay import BREAKDOWN, GRAPHS, Pricing, Timeline, simulate  # noqa: E402
from dpqlab.timeline.roofline import roofline  # noqa: E402
from dpqlab.timeline.scenarios import record_block, run_adapter, run_api  # noqa: E402
from dpqlab.timeline.shapes import BLOCKS, RECORDED, BlockShape  # noqa: E402

PRESETS = {"70b-3090": ("70b", "3090"), "8b-h100": ("8b", "h100"), "70b-h100": ("70b", "h100")}
MACHINES = [("4 x RTX 3090 (PCIe)", "3090", 4), ("8 x H100 (NVLink)", "h100", 8)]  # --table
PATHS = ("compile", "eager")
OVERLAPPED = "+overlap"  # a path's records with --parallel_overlap on: f"{path}{OVERLAPPED}"
NATIVE = "+native"  # the compile path's records with --parallel_order native: f"compile{NATIVE}[{OVERLAPPED}]"
NATIVE_WORLDS = (4, 8)  # the machines' lane counts: where the table prices --parallel_order native
ITERS_PER_BLOCK = 200  # auto-round's default iters: what a block's compile is amortised over
PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:green", "exchange": "tab:orange", "step": "tab:purple",
                "grads": "tab:olive", "readback": "tab:red", "pin": "tab:gray", "": "tab:gray"}
CALIBRATIONS = ROOT / "benchmarks" / "calibration"


# -- the host cost this CPU measures (reported as an upper bound) ----------------------------------


def measure_host_per_op(world: int, iters: int = 20) -> tuple[float, dict]:
    """Seconds of the issuing thread per op it queues, on this machine: dpq's issue time per
    lane-iteration on a launch-bound block (hidden 128, 8 x 8 tokens, one intra-op thread), eager,
    divided by the ops it queues there. On this CPU that includes running the kernels themselves."""
    import copy

    import dpq
    from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_tiny_llama(TinyLlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1))
        inputs, others = capture_block_inputs(model, calibration_samples(8, 8))
        block, inputs, others = model.model.layers[0], inputs[0], others[0]
        w = min(world, len(inputs))

        def tune(devices, n):
            return dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, world=w, devices=devices,
                                     iters=n, batch_size=len(inputs), seed=0)

        tune(["cpu"] * w, 3)  # warm-up
        issue_s = min(tune(["cpu"] * w, iters).issue_s for _ in range(3))  # per lane-iteration
        with TimelineModel(w, seqlen=1) as rec:
            rec.place(block, "cpu:1")
            rec.place(inputs, "cpu:1")
            rec.place([t for v in others.values() for t in _tensors(v)], "cpu:1")
            tune([f"cpu:{k + 1}" for k in range(w)], 3)
    finally:
        torch.set_num_threads(threads)
    steady = [op for op in rec.ops if op.iteration >= 1 and op.thread == "main"
              and op.kind not in ("marker", "sync") and op.phase not in ("backward",)]
    per_lane_iter = len(steady) / (max(op.iteration for op in rec.ops) * w)
    return issue_s / per_lane_iter, {"issue_s_per_lane_iteration": issue_s, "ops_per_lane_iteration": per_lane_iter,
                                     "world": w, "block": "tiny Llama layer, hidden 128, 8 x 8 tokens, 1 thread"}


def _tensors(value) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


# -- the host and GPU figures: stated, overridden, calibrated ---------------------------------------


def load_calibration(spec: str) -> Calibration | None:
    """``none``, a file, or ``auto``: the newest file in benchmarks/calibration/ (by name: <card>-<date>)."""
    if spec == "none":
        return None
    if spec == "auto":
        files = sorted(CALIBRATIONS.glob("*.json"), key=lambda p: p.stem.rsplit("-", 3)[-3:])
        return Calibration.load(files[-1]) if files else None
    return Calibration.load(spec)


def host_costs(host_per_op_us: float | None) -> HostCosts:
    """The stated host, or every cost scaled so that an eager op costs ``host_per_op_us``."""
    if host_per_op_us is None:
        return HOST
    k = host_per_op_us * 1e-6 / HOST.eager_op_s
    return HOST.rebased(eager_op_s=HOST.eager_op_s * k, view_op_s=HOST.view_op_s * k,
                        compiled_kernel_s=HOST.compiled_kernel_s * k,
                        compiled_extern_s=HOST.compiled_extern_s * k, region_call_s=HOST.region_call_s * k,
                        wait_s=HOST.wait_s * k)


def calibrated(cal: Calibration | None, gpu_key: str, host: HostCosts, one_lane: dict[str, TimelineModel],
               lanes: dict[tuple[str, int], TimelineModel] | None = None,
               issuing_host: bool = True) -> tuple[GpuClass, HostCosts, list[str]]:
    """The GPU class and host, re-based by ``cal`` (the model's own counts: its 1-lane records of
    each path replayed on the calibration's block). With ``dpq_issuing`` in ``cal`` and a record of
    several lanes on its path in ``lanes``, the host's per-op costs come from dpq's issuing thread
    (the model's replay of that record on the calibration's block, per lane-iteration, against it);
    ``issuing_host`` False: the stated host instead (the side-by-side of :func:`host_sides_lines`)."""
    gpu = GPUS[gpu_key]
    if cal is None:
        return gpu, host, []
    shape = block_shape(cal)
    counts = {path: counts_of(simulate(model, Pricing(RECORDED, shape, gpu, host)))
              for path, model in one_lane.items()}
    issuing = cal.extra.get("dpq_issuing") or {}
    several = sorted(w for p, w in (lanes or {}) if p == issuing.get("path") and w > 1)
    if not several or not issuing_host:
        return rebase(cal, gpu_key, gpu, host, counts, paths_host=not several)
    modeled = simulate(lanes[(issuing["path"], several[0])], Pricing(RECORDED, shape, gpu, host))
    host, notes = issuing_scale(cal, host, modeled.breakdown()["host_per_lane_iteration"] * 1e3,
                                compiled_host_ms(modeled))
    gpu, host, more = rebase(cal, gpu_key, gpu, host, counts, paths_host=False)
    return gpu, host, notes + more


# -- one world ----------------------------------------------------------------------------------


def summary_lines(tl: Timeline, world: int) -> list[str]:
    lines = []
    for it in tl.iterations:
        busy = ", ".join(f"{b * 1e3:.1f}" for b in it.lane_busy_s)
        lines.append(f"iteration {it.index}: {it.seconds * 1e3:.1f} ms, host syncs {len(it.syncs)}, lane overlap "
                     f"{it.overlap:.3f}, lane busy [{busy}] ms, issuing thread {it.issue_s * 1e3:.2f} ms")
        for s in it.syncs:
            lines.append(f"    sync: {s.what} (host stalled {s.stall_s * 1e3:.2f} ms) at {s.site}")
    lines.append(f"lanes one issuing thread keeps busy: {tl.lanes_per_thread():.1f} (a lane's compute per "
                 f"iteration / the issuing thread's host time per lane-iteration, {world} lanes)")
    return lines


def plot(tl: Timeline, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steady = tl.steady()[0].index
    ops = [op for op in tl.ops if op.iteration == steady and op.kind != "marker"]
    rows: dict[str, list[tuple[float, float, str]]] = {}
    threads = sorted({op.thread for op in ops}, key=lambda t: (t != "main", t))
    for th in threads:
        rows[f"host: {th}"] = []
    lane_of = {sid: k for k, streams in enumerate(tl.lane_streams) for sid in streams}
    t0 = min(tl.issue[op.id] for op in ops)
    prev: dict[str, float] = {}
    for op in ops:
        row = f"host: {op.thread}"
        a = prev.get(op.thread, tl.issue[op.id])
        if op.kind == "sync":
            rows[row].append((a - t0, tl.end[op.id] - a, "sync"))
            prev[op.thread] = tl.end[op.id]
            continue
        rows[row].append((a - t0, tl.issue[op.id] - a, op.phase))
        prev[op.thread] = tl.issue[op.id]
        if op.stream is not None and op.id in tl.start and op.kind in ("kernel", "copy", "collective"):
            name = f"lane {lane_of[op.stream.sid]} ({op.stream.name})" if op.stream.sid in lane_of else \
                f"side/other ({op.stream.name})"
            kind = "copy" if op.kind == "copy" else ("exchange" if op.kind == "collective" else op.phase)
            rows.setdefault(name, []).append((tl.start[op.id] - t0, tl.end[op.id] - tl.start[op.id], kind))
    colors = dict(PHASE_COLORS, copy="gold", sync="black")
    names = list(rows)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.45 * len(names)))
    for y, name in enumerate(reversed(names)):
        for kind in colors:
            bars = [(a * 1e3, max(w * 1e3, 1e-3)) for a, w, k in rows[name] if k == kind and w >= 0]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), color=colors[kind], label=kind)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel("ms (modeled)")
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=False))
    ax.legend(unique.values(), unique.keys(), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the table ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    machine: str
    gpu: str
    lanes: int
    block: str
    path: str
    per_iter: dict[int, float]  # world -> seconds per steady iteration
    timelines: dict[int, Timeline]
    compiles: dict[int, int]  # world -> compiles a run pays on the issuing thread (lane devices x slice shapes)
    host: HostCosts
    roof: dict[str, float]
    # at the most lanes recorded, priced with CUDA graphs (Pricing.graphs: "regions", "iteration"); compile only
    graphed: dict[str, Timeline] = dataclasses.field(default_factory=dict)
    overlap: tuple[bool, str] = (False, "")  # what --parallel_overlap auto takes on this machine, and why
    other: Timeline | None = None  # all lanes with the other overlap setting
    native: Timeline | None = None  # all lanes with --parallel_order native (compile path)
    # all lanes spread over P processes of lanes/P lanes each (torchrun; Pricing.processes), P > 1, compile path
    spread: dict[int, Timeline] = dataclasses.field(default_factory=dict)

    def spread_speedup(self, processes: int) -> float:
        """Over 1 lane: the lanes in ``processes`` processes (1: one process, as recorded)."""
        tl = self.timelines[self.lanes] if processes == 1 else self.spread[processes]
        return self.per_iter[1] / tl.seconds_per_iteration()

    def compile_s(self, world: int) -> float:
        n = self.compiles[world]
        return self.host.compile_s + (n - 1) * self.host.recompile_s if n else 0.0

    def speedup(self) -> float:
        return self.per_iter[1] / self.per_iter[self.lanes]

    def best(self) -> int:
        return min(self.per_iter, key=self.per_iter.get)

    def run_s(self, world: int, layers: int) -> float:
        """A whole model's tune: every block's iterations, and every compile once."""
        return layers * ITERS_PER_BLOCK * self.per_iter[world] + self.compile_s(world)


def compiles_per_run(model: TimelineModel) -> int:
    """The block-forward compiles a run pays on GPUs: one per lane device and slice shape (dynamo
    guards on the device and, static, on the shape), once per run: blocks of one shape reuse them."""
    return len({(place, lead) for name, place, lead in model.region_calls if name == "block_forward"}) or 0


def auto_overlap(gpu: GpuClass, lanes: int) -> tuple[bool, str]:
    """What ``--parallel_overlap auto`` takes on ``lanes`` GPUs of this class (dpq.planning.plan.overlap_choice,
    asked about the class's peer access)."""
    return overlap_choice(None, [f"cuda:{i}" for i in range(lanes)], peer=lambda a, b: gpu.peer_access)


def table(records: dict[tuple[str, int], TimelineModel], cal: Calibration | None, host: HostCosts,
          paths: tuple[str, ...]) -> tuple[list[Row], list[str]]:
    """The rows, each running what ``--parallel_overlap auto`` takes on the machine: worlds >= 2 from the
    path's overlapped records (``OVERLAPPED``) where auto turns overlap on; ``Row.other`` holds all lanes
    with the other setting."""
    rows, notes = [], []
    for mname, gpu_key, lanes in MACHINES:
        one_lane = {p: records[(p, 1)] for p in paths}
        gpu, host_k, cal_notes = calibrated(cal, gpu_key, host, one_lane, records)
        notes += [f"{mname}: {n}" for n in cal_notes]
        overlap = auto_overlap(gpu, lanes)
        for path in paths:
            for bkey in ("8b", "32b", "70b"):
                block = BLOCKS[bkey]
                worlds = sorted(w for p, w in records if p == path and w <= lanes)
                on = overlap[0]

                def ran(w: int, overlapped: bool, path=path) -> TimelineModel:
                    key = (path + OVERLAPPED, w) if overlapped and w > 1 else (path, w)
                    if key not in records:
                        raise ValueError(f"no record of {key[0]} at world {w}: record_worlds makes one per path, "
                                         f"world and overlap setting")
                    return records[key]

                tls = {w: _priced(ran(w, on), bkey, gpu_key, gpu, host_k, w) for w in worlds}
                top = worlds[-1]  # all lanes, where recorded
                graphed = ({g: _priced(ran(top, on), bkey, gpu_key, gpu, host_k, top, g) for g in GRAPHS if g}
                           if path == "compile" else {})
                other = _priced(ran(top, not on), bkey, gpu_key, gpu, host_k, top) if top > 1 else None
                nkey = (path + NATIVE + (OVERLAPPED if on else ""), top)
                native = _priced(records[nkey], bkey, gpu_key, gpu, host_k, top) if nkey in records else None
                spread = ({p: _priced(ran(top, on), bkey, gpu_key, gpu, host_k, top, processes=p)
                           for p in range(2, top + 1) if top % p == 0} if path == "compile" and top > 1 else {})
                rows.append(Row(mname, gpu_key, lanes, bkey, path, {w: tl.seconds_per_iteration() for w, tl in
                                                                      tls.items()}, tls,
                                {w: compiles_per_run(records[(path, w)]) if path == "compile" else 0 for w in worlds},
                                host_k, roofline(block, gpu), graphed, overlap, other, native, spread))
    return rows, notes


def _priced(model: TimelineModel, bkey: str, gpu_key: str, gpu, host: HostCosts, world: int,
            graphs: str | None = None, processes: int = 1) -> Timeline:
    """``model`` replayed on a ``bkey`` block on ``gpu`` with the buckets the plan takes there (in
    ``processes`` processes: Note [P processes x 1 lane] in dpqlab/timeline/replay.py)."""
    return simulate(model, Pricing(RECORDED, BLOCKS[bkey], gpu, host, graphs=graphs, processes=processes,
                                   buckets=plan_buckets(bkey, gpu_key, world)))


CARD_GIB = {"3090": 24, "h100": 80, "h200": 141}  # each card's memory, GiB (its spec sheet)


def _meta_block(shape: BlockShape) -> torch.nn.Module:
    """A block of ``shape``'s tensors on the meta device: what the plan's price reads (sizes, dtypes)."""
    block = torch.nn.Module()
    for name, (o, i) in shape.linears.items():
        block.register_parameter(name, torch.nn.Parameter(torch.empty(o, i, device="meta", dtype=torch.bfloat16)))
    for name in ("input_layernorm", "post_attention_layernorm"):
        block.register_parameter(name, torch.nn.Parameter(torch.empty(shape.hidden, device="meta",
                                                                      dtype=torch.bfloat16)))
    return block


def mirror_prices_gib(bkey: str, world: int) -> tuple[float, float]:
    """The plan's price of a mirror lane of a ``bkey`` block at ``world`` (GiB, margin included): with
    buckets as large as the largest tensor, and with one bucket for the whole block."""
    from dpq.planning.plan import price_mirror

    shape = BLOCKS[bkey]
    block = _meta_block(shape)
    inputs = [torch.empty(1, shape.seqlen, shape.hidden, device="meta", dtype=torch.bfloat16)] * shape.batch
    largest, whole = (price_mirror(block, inputs, shape.batch, world, bucket_cap_elems=cap) / 2**30
                      for cap in (2**22, Buckets.BLOCK))
    return largest, whole


def plan_buckets(bkey: str, gpu_key: str, world: int) -> str:
    """What the plan lays out on that card (Note [one bucket where it fits]): "block" where one bucket's
    price fits the card's memory, else "largest" (also where neither fits: the arithmetic goes on)."""
    return "block" if world < 2 or mirror_prices_gib(bkey, world)[1] <= CARD_GIB[gpu_key] else "largest"


def bucket_price_lines() -> list[str]:
    """The plan's price of a mirror lane at each machine's lane count, with buckets as large as the largest
    tensor and with one bucket for the whole block (Note [one bucket where it fits] in ``dpq.planning.plan``), against
    the card's memory: which of the two the table lays out on that card."""
    out = ["", "The plan's price of a mirror lane at all lanes (GiB, margin included; Note [one bucket where it "
           "fits]); the table lays out what the plan takes:", "",
           "| machine | block | buckets as large as the largest tensor | one bucket | card | the plan takes |",
           "|---|---|---:|---:|---:|---|"]
    for mname, gpu_key, lanes in MACHINES:
        for bkey in ("8b", "32b", "70b"):
            largest, whole = mirror_prices_gib(bkey, lanes)
            card = CARD_GIB[gpu_key]
            takes = ("one bucket" if whole <= card else "the largest tensor's buckets" if largest <= card
                     else "neither fits: the plan refuses such a lane (the row is arithmetic, with the largest "
                          "tensor's buckets)")
            out.append(f"| {mname} | {BLOCKS[bkey].name} | {largest:.1f} | {whole:.1f} | {card} | {takes} |")
    return out


def table_lines(rows: list[Row]) -> list[str]:
    out = []
    for path in PATHS:
        sel = [r for r in rows if r.path == path]
        if not sel:
            continue
        label = "torch.compile on (auto-round's default)" if path == "compile" else "eager (--disable_torch_compile)"
        out += ["", f"### {label}", "",
                "| machine | block | ms/iter, 1 lane | ms/iter, all lanes | speedup, all lanes | best W (speedup) | "
                "compile s per run, 1 lane / all | whole run, compiles amortised | lane overlap | lanes per thread | "
                "host syncs/iter |",
                "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in sel:
            tl, layers = r.timelines[r.lanes], BLOCKS[r.block].layers
            whole = r.run_s(1, layers) / r.run_s(r.lanes, layers)
            out.append(f"| {r.machine} | {BLOCKS[r.block].name} | {r.per_iter[1] * 1e3:.1f} | "
                       f"{r.per_iter[r.lanes] * 1e3:.1f} | {r.speedup():.2f}x | {r.best()} "
                       f"({r.per_iter[1] / r.per_iter[r.best()]:.2f}x) | {r.compile_s(1):.0f} / "
                       f"{r.compile_s(r.lanes):.0f} | {whole:.2f}x | {tl.lane_overlap():.2f} | "
                       f"{tl.lanes_per_thread():.1f} | {tl.syncs_per_iteration()} |")
        out += ["", f"Where an iteration goes ({label}; ms per iteration, lane 0's device time by class; wire: its "
                    "collectives; exposed: collectives while no lane computes; host: the issuing thread per "
                    "lane-iteration; roofline: the analytic 1-lane time, dpqlab/timeline/roofline.py):", "",
                "| machine | block | lanes | " + " | ".join(BREAKDOWN) + " | wire | exposed | host/lane-iter | "
                "iteration | roofline |", "|---|---|---:|" + "---:|" * (len(BREAKDOWN) + 5)]
        for r in sel:
            for w in sorted({1, r.lanes}):
                b = r.timelines[w].breakdown()
                roof = f"{r.roof['total'] * 1e3:.1f}" if w == 1 else ""
                out.append(f"| {r.machine} | {r.block} | {w} | " + " | ".join(f"{b[k] * 1e3:.2f}" for k in BREAKDOWN)
                           + f" | {b['exchange_wire'] * 1e3:.2f} | {b['exchange_exposed'] * 1e3:.2f} | "
                             f"{b['host_per_lane_iteration'] * 1e3:.2f} | {b['iteration'] * 1e3:.1f} | {roof} |")
    return out


def graphs_lines(rows: list[Row]) -> list[str]:
    """Lever 5 priced: the compile-on rows at all lanes as built, with the compiled regions replayed
    through CUDA graph trees, and with each lane's steady iteration as one captured graph (Pricing.graphs;
    neither is built: what the model says each would buy)."""
    sel = [r for r in rows if r.path == "compile" and r.graphed]
    if not sel:
        return []
    out = ["", "CUDA graphs per lane, priced, not built (torch.compile on, all lanes; Pricing.graphs in "
               "dpqlab/timeline/replay.py; speedup over 1 lane as built; host: the issuing thread per "
               "lane-iteration, ms):", "",
           "| machine | block | as built: speedup | host | regions as graph trees: speedup | host | "
           "each lane's iteration one graph: speedup | host | exposed exchange, ms | lane 0's device work, ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sel:
        cells = []
        for tl in (r.timelines[max(r.timelines)], r.graphed["regions"], r.graphed["iteration"]):
            b = tl.breakdown()
            cells += [f"{r.per_iter[1] / tl.seconds_per_iteration():.2f}x", f"{b['host_per_lane_iteration'] * 1e3:.2f}"]
        b = r.graphed["iteration"].breakdown()
        out.append(f"| {r.machine} | {BLOCKS[r.block].name} | " + " | ".join(cells)
                   + f" | {b['exchange_exposed'] * 1e3:.2f} | {sum(b[k] for k in BREAKDOWN) * 1e3:.2f} |")
    return out


def overlap_lines(rows: list[Row]) -> list[str]:
    """Lever 1: each row at all lanes with --parallel_overlap off and on (the exchange during the backward;
    on the compile path the lanes' block forward uncompiled so that it can be), and what auto takes."""
    sel = [r for r in rows if r.other is not None]
    if not sel:
        return []
    out = ["", "--parallel_overlap at all lanes (on: the exchange during the backward on a second stream per lane, "
               "with torch.compile the lanes' block forward uncompiled; Note [overlap where the wire is slow] in "
               "dpq/planning/plan.py; speedup over 1 lane):", "",
           "| path | machine | block | off: speedup | exposed, ms | host/lane-iter, ms | on: speedup | exposed, ms | "
           "host/lane-iter, ms | auto takes |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sel:
        on = r.overlap[0]
        built = r.timelines[max(r.timelines)]
        cells = []
        for tl in ((r.other, built) if on else (built, r.other)):
            b = tl.breakdown()
            cells += [f"{r.per_iter[1] / tl.seconds_per_iteration():.2f}x", f"{b['exchange_exposed'] * 1e3:.2f}",
                      f"{b['host_per_lane_iteration'] * 1e3:.2f}"]
        out.append(f"| {r.path} | {r.machine} | {BLOCKS[r.block].name} | " + " | ".join(cells)
                   + f" | {'on' if on else 'off'} |")
    reasons = dict.fromkeys(f"{r.machine}: {r.overlap[1]}" for r in sel)
    return [*out, "", "auto's reasons (dpq.planning.plan.overlap_choice, asked about each card's peer access):",
            *(f"- {why}" for why in reasons)]


def order_lines(rows: list[Row]) -> list[str]:
    """--parallel_order at all lanes (Note [canonical or native order] in dpq/planning/plan.py): the canonical order
    the plan takes by default against NCCL's native reduce-scatter (compile path, overlap as auto takes it)."""
    sel = [r for r in rows if r.native is not None]
    if not sel:
        return []
    out = ["", "--parallel_order at all lanes (torch.compile on, overlap as auto takes it; speedup over 1 lane; "
               "exchange: lane 0's exchange kernels + wire, ms):", "",
           "| machine | block | canonical: speedup | exchange, ms | host/lane-iter, ms | native: speedup | "
           "exchange, ms | host/lane-iter, ms |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sel:
        cells = []
        for tl in (r.timelines[r.lanes], r.native):
            b = tl.breakdown()
            cells += [f"{r.per_iter[1] / tl.seconds_per_iteration():.2f}x",
                      f"{(b['exchange_kernels'] + b['exchange_wire']) * 1e3:.2f}",
                      f"{b['host_per_lane_iteration'] * 1e3:.2f}"]
        out.append(f"| {r.machine} | {BLOCKS[r.block].name} | " + " | ".join(cells) + " |")
    return out


def spread_lines(rows: list[Row]) -> list[str]:
    """P x L priced (Note [P processes x 1 lane] in dpqlab/timeline/replay.py): all lanes in one process
    (as built), in one process per lane (torchrun --nproc-per-node W ... --parallel_quantization 1), and the
    best spread; each process its own issuing thread and GIL."""
    sel = [r for r in rows if r.spread]
    if not sel:
        return []
    out = ["", "P processes x L lanes at all lanes (torch.compile on; each process its own issuing thread and GIL; "
               "the exchange as recorded in one process; speedup over 1 lane):", "",
           "| machine | block | 1 process x W lanes | W processes x 1 lane | best P x L | host/lane-iter, ms: 1 x W | "
           "W x 1 |", "|---|---|---:|---:|---|---:|---:|"]
    for r in sel:
        best = max([1, *r.spread], key=r.spread_speedup)
        hosts = [tl.breakdown()["host_per_lane_iteration"] * 1e3 for tl in (r.timelines[r.lanes], r.spread[r.lanes])]
        out.append(f"| {r.machine} | {BLOCKS[r.block].name} | {r.speedup():.2f}x | {r.spread_speedup(r.lanes):.2f}x | "
                   f"{best} x {r.lanes // best} ({r.spread_speedup(best):.2f}x) | {hosts[0]:.2f} | {hosts[1]:.2f} |")
    return out


def host_sides_lines(rows: list[Row], records: dict[tuple[str, int], TimelineModel], cal: Calibration | None,
                     host: HostCosts) -> list[str]:
    """While the calibration's issuing-thread figure is a bound (``Calibration.host_source`` is not
    ``thread_time``: no lease has measured the thread's CPU time), the compile-on rows at all lanes
    priced with the host at that bound (the table above) and with the stated host (devices.HOST; the
    GPU figures calibrated alike) side by side: the truth lies between (issue 38 item 2)."""
    sel = [r for r in rows if r.path == "compile"]
    if cal is None or cal.host_source == "thread_time" or not sel or ("compile", 1) not in records:
        return []
    from dpqlab.timeline.calibration import HOST_SOURCES

    out = ["", f"The issuing host at the calibration's bound and at the stated host (modeled; {cal.label}'s issuing "
               f"figure is {HOST_SOURCES[cal.host_source]}; the stated host: dpqlab/timeline/devices.py; torch.compile "
               f"on, all lanes, speedup over 1 lane priced alike):", "",
           "| machine | block | bound: eager op, us | speedup | W processes x 1 lane | host/lane-iter, ms | "
           "stated: eager op, us | speedup | W processes x 1 lane | host/lane-iter, ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    stated = {}
    for _, gpu_key, _ in MACHINES:
        if any(r.gpu == gpu_key for r in sel):
            stated[gpu_key] = calibrated(cal, gpu_key, host, {"compile": records[("compile", 1)]}, records,
                                         issuing_host=False)[:2]
    for r in sel:
        top = max(r.timelines)
        gpu, host_s = stated[r.gpu]
        key = ("compile" + OVERLAPPED, top) if r.overlap[0] and top > 1 else ("compile", top)
        one = _priced(records[("compile", 1)], r.block, r.gpu, gpu, host_s, 1).seconds_per_iteration()
        cells = []
        for h, base, all_lanes, spread in (
                (r.host, r.per_iter[1], r.timelines[top], r.spread.get(top)),
                (host_s, one, _priced(records[key], r.block, r.gpu, gpu, host_s, top),
                 _priced(records[key], r.block, r.gpu, gpu, host_s, top, processes=top) if top > 1 else None)):
            torchrun = f"{base / spread.seconds_per_iteration():.2f}x" if spread is not None else "-"
            cells += [f"{h.eager_op_s * 1e6:.1f}", f"{base / all_lanes.seconds_per_iteration():.2f}x", torchrun,
                      f"{all_lanes.breakdown()['host_per_lane_iteration'] * 1e3:.2f}"]
        out.append(f"| {r.machine} | {BLOCKS[r.block].name} | " + " | ".join(cells) + " |")
    return out


def final_line(rows: list[Row], cal: Calibration | None, communicator: str) -> str:
    pick = {(r.gpu, r.lanes, r.block): r for r in rows if r.path == "compile"}
    return (f"timeline_table path=compile speedup_3090_w4_70b={pick[('3090', 4, '70b')].speedup():.2f} "
            f"speedup_h100_w8_70b={pick[('h100', 8, '70b')].speedup():.2f} "
            f"speedup_h100_w8_8b={pick[('h100', 8, '8b')].speedup():.2f} "
            f"torchrun_h100_w8_8b={pick[('h100', 8, '8b')].spread_speedup(8):.2f} "
            f"torchrun_h100_w8_70b={pick[('h100', 8, '70b')].spread_speedup(8):.2f} "
            f"calibrated={cal.label if cal else 'no'} communicator={communicator}")


def communicator_of(records: dict[tuple[str, int], TimelineModel]) -> str:
    """The communicator the records at all lanes ran (the plan's choice for distinct GPUs)."""
    names = {n for (key, w), m in records.items() if w == max(w for _, w in records) and NATIVE not in key
             for n in m.communicators}
    return ",".join(sorted(names)) or "none"


def record_worlds(paths: tuple[str, ...], worlds: tuple[int, ...], iters: int) -> dict[tuple[str, int], TimelineModel]:
    """Each path at each world with --parallel_overlap off, and at worlds >= 2 also with it on (key
    ``path + OVERLAPPED``; on the compile path the lanes' block forward uncompiled)."""
    out = {}
    for path in paths:
        rec = record_block(compile=path == "compile")
        for w in worlds:
            for key, overlap in ((path, False), (path + OVERLAPPED, True)):
                if overlap and w == 1:
                    continue
                t0 = time.perf_counter()
                out[(key, w)] = run_adapter(rec, w, iters=iters, overlap=overlap)
                print(f"recorded {key} world {w} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
                if path == "compile" and w in NATIVE_WORLDS:
                    t0 = time.perf_counter()
                    nkey = path + NATIVE + (OVERLAPPED if overlap else "")
                    out[(nkey, w)] = run_adapter(rec, w, iters=iters, overlap=overlap, order="native")
                    print(f"recorded {nkey} world {w} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--preset", choices=sorted(PRESETS), default="70b-3090")
    p.add_argument("--block", choices=sorted(BLOCKS), help="the target block class (overrides the preset's)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="the GPU class (overrides the preset's)")
    p.add_argument("--eager", action="store_true", help="auto-round with --disable_torch_compile (default: compile on)")
    p.add_argument("--pool", choices=("home", "host", "spread"), default="home",
                   help="where the calibration pool lives (dpqlab/timeline/scenarios.py)")
    p.add_argument("--path", choices=("adapter", "api"), default="adapter",
                   help="the auto-round adapter (enable()) or dpq.parallel_tune")
    p.add_argument("--iters", type=int, default=3, help="iterations recorded (the first also stages per-block data)")
    p.add_argument("--host-per-op-us", type=float, default=None,
                   help="price the issuing host so that an eager op costs this (every host cost scaled alike; "
                        "default: the stated server-CPU figures of dpqlab/timeline/devices.py)")
    p.add_argument("--calibration", default="auto",
                   help="a calibration.json a GPU check wrote, 'auto' (the newest in benchmarks/calibration/) "
                        "or 'none'")
    p.add_argument("--table", action="store_true",
                   help="instead: the modeled speedup table, 4 x RTX 3090 and 8 x H100, 8B/32B/70B-class blocks, "
                        "both paths (worlds 1, 2, 4, 8 recorded once each)")
    p.add_argument("--out", default=os.environ.get("OUT", "out/timeline"))
    args = p.parse_args(argv)
    if not 1 <= args.world <= 16:
        p.error("--world must be 1..16 (the recorded block has 16 samples, 8 per iteration)")
    cal = load_calibration(args.calibration)
    host = host_costs(args.host_per_op_us)
    t0 = time.perf_counter()
    measured, measured_info = measure_host_per_op(min(args.world, 8))
    print(f"modeled, not measured on a GPU. Host: {host.eager_op_s * 1e6:.1f} us per eager op, "
          f"{host.compiled_kernel_s * 1e6:.1f} us per compiled kernel, {host.region_call_s * 1e6:.0f} us per compiled "
          f"graph call ({'stated server-CPU figures' if args.host_per_op_us is None else '--host-per-op-us'}); this "
          f"machine measured {measured * 1e6:.1f} us per eager op (an upper bound: {measured_info}). Calibration: "
          f"{cal.label + ' (' + cal.source + ')' if cal else 'none'}")
    if args.table:
        paths = ("eager",) if args.eager else PATHS
        records = record_worlds(paths, (1, 2, 4, 8), args.iters)
        rows, notes = table(records, cal, host, paths)
        for n in notes:
            print(f"calibrated: {n}")
        print("\n".join(table_lines(rows) + overlap_lines(rows) + order_lines(rows) + spread_lines(rows)
                        + host_sides_lines(rows, records, cal, host) + graphs_lines(rows) + bucket_price_lines()))
        print(f"({time.perf_counter() - t0:.0f} s)")
        print(final_line(rows, cal, communicator_of(records)) if "compile" in paths else "timeline_table path=eager")
        return 0
    block_key, gpu_key = PRESETS[args.preset]
    path = "eager" if args.eager else "compile"
    rec = record_block(compile=not args.eager)
    one = {path: run_adapter(rec, 1, iters=args.iters)} if cal else {}
    block = BLOCKS[args.block or block_key]
    # the adapter's run as --parallel_overlap auto takes it on this GPU class (dpq.parallel_tune: its default)
    overlap, why = auto_overlap(GPUS[args.gpu or gpu_key], args.world) if args.path == "adapter" else (False, "")
    extra = {"overlap": overlap} if args.path == "adapter" else {}
    run = run_adapter if args.path == "adapter" else run_api
    model = run(rec, args.world, pool=args.pool, iters=args.iters, **extra)
    gpu, host, notes = calibrated(cal, args.gpu or gpu_key, host, one, {(path, args.world): model})
    for n in notes:
        print(f"calibrated: {n}")
    tl = simulate(model, Pricing(RECORDED, block, gpu, host,
                                 buckets=plan_buckets(args.block or block_key, args.gpu or gpu_key, args.world)))
    label = (f"{args.path} path, {path}, world {args.world}, pool on {args.pool}"
             f"{', overlap on' if overlap else ''}; {block.name} on "
             f"{gpu.name}")
    if why:
        print(f"--parallel_overlap {why}")
    print(f"timeline model: {label}")
    if model.violations:
        print(f"{len(model.violations)} device-mix violations (CUDA would raise), first: {model.violations[0]}")
    for line in summary_lines(tl, args.world):
        print(line)
    out = Path(args.out)
    stem = f"timeline_w{args.world}_{args.preset}_{path}_{args.pool}"
    plot(tl, out / f"{stem}.png", f"timeline model (modeled, not measured on a GPU): {label}")
    report = {
        "world": args.world, "preset": args.preset, "block": block.name, "gpu": gpu.name, "pool": args.pool,
        "path": args.path, "compile": not args.eager, "host": dataclasses.asdict(host),
        "calibration": cal.label if cal else None, "host_syncs_per_iter": tl.syncs_per_iteration(),
        "lane_overlap": tl.lane_overlap(), "lanes_per_thread": tl.lanes_per_thread(), "breakdown": tl.breakdown(),
        "violations": model.violations,
        "iterations": [{"index": it.index, "seconds": it.seconds, "overlap": it.overlap, "lane_busy_s": it.lane_busy_s,
                        "issue_s": it.issue_s, "syncs": [{"what": s.what, "site": s.site, "stall_s": s.stall_s}
                                                         for s in it.syncs]} for it in tl.iterations],
    }
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / stem}.png and .json ({time.perf_counter() - t0:.0f} s)")
    print(f"host_syncs_per_iter={tl.syncs_per_iteration()} lane_overlap={tl.lane_overlap():.2f} world={args.world}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
