"""The plan screen (``auto-round-dp --parallel_plan``, :func:`plan_for`): what this machine would
get, before anything is tuned.

For the model's first block, built from the model's config on the meta device (no weight is
read) or taken from a model object, and the lanes (the given devices, else the plan's default),
it says per world W = 1 .. the lanes: the lanes, each lane's memory price against its device's
free memory (the plan's own prices, :class:`dpq.planning.plan.BlockPrice` and :func:`dpq.planning.plan.price_runtime`,
and its verdict, :func:`dpq.planning.plan.resolve`), and the predicted seconds per iteration and per block
by ``auto``'s cost model (:mod:`dpq.planning.cost_model`: compute from the block's FLOPs at its stated
throughput, divided over the distinct devices (lanes sharing one take turns on it: such a row says
"no speedup" and why), the link probed on the lanes as ``auto`` probes it, the issuing thread's cost
unknown before a run), then the world ``auto`` would choose and why (the run's rule: lanes sharing a
device keep every fitting lane, said to buy no speed; otherwise the fastest prediction). The CUDA timeline model's
calibrated figures are named where a calibration exists (``benchmarks/calibration/``); where none
does, the screen says so.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dpq import refusals
from dpq.planning.cost_model import (
    ACHIEVABLE_FLOPS,
    GPU_ISSUE_S_PER_LANE_ITERATION,
    CostInputs,
    choose_world,
    predict,
    probe_link,
)
from dpq.planning.lane_devices import parse_device_spec
from dpq.planning.plan import BlockPrice, PlanRefused, PlanRequest, default_devices, price_runtime, resolve
from dpq.streams import backend, default_accelerator_type

__all__ = ["LanePrice", "PlanScreen", "WorldRow", "plan_for", "show_for_command"]

CALIBRATIONS = Path(__file__).resolve().parents[2] / "benchmarks" / "calibration"  # in a source tree only


@dataclass(frozen=True)
class LanePrice:
    device: str
    need: int  # bytes this lane adds (home: beyond the block and its pool, which it holds anyway)
    free: int  # the device's free bytes now


@dataclass(frozen=True)
class WorldRow:
    world: int
    lanes: list[str]
    prices: list[LanePrice]
    per_iter_s: float
    per_block_s: float
    refused: list[str] = field(default_factory=list)  # why this world cannot run (empty: it can)
    buckets: str = ""  # the plan's gradient buckets at this world, and why (dpq.planning.plan.Plan.buckets_reason)
    overlap: str = ""  # whether the exchange runs during the backward, and why (dpq.planning.plan.Plan.overlap_reason)
    shared: str = ""  # the lanes share a device: no speedup, and why (refusals.shared_lanes); "" one device each


@dataclass(frozen=True)
class PlanScreen:
    """What :func:`plan_for` found; ``str()`` is the screen."""

    model: str
    source: str  # "config" (no weights) or "model"
    block: str
    block_class: str
    blocks: int
    samples_per_iter: int
    iters: int
    seqlen: int
    compute_dtype: str
    device_names: dict[str, str]
    link: str
    rows: list[WorldRow]
    choice: int
    why: str
    calibration: str
    asked: bool = False  # an explicit world (--parallel_quantization N): the run takes it, or stops
    spread: list[str] = field(default_factory=list)  # P processes x 1 lane beside 1 process x W lanes (_spread)

    def lines(self) -> list[str]:
        gib = 2**30
        names = "; ".join(f"{d}: {n}" for d, n in self.device_names.items() if n)
        read = "its config only, no weights read" if self.source == "config" else "the model given"
        out = [f"dpq plan for {self.model} ({read}): {self.blocks} blocks like {self.block} ({self.block_class})",
               f"per block: {self.iters} iterations of {self.samples_per_iter} samples x {self.seqlen} tokens, "
               f"computing in {self.compute_dtype}",
               f"lane devices: {names}", f"link: {self.link}", "",
               f"{'world':>5}  {'lanes':<24} {'memory per lane, need / free (GiB)':<44} {'s/iter':>8} {'s/block':>9}"
               f" {'all blocks':>11}  runs"]
        for r in self.rows:
            memory = ", ".join(f"{p.need / gib:.2f}/{p.free / gib:.1f}" for p in r.prices)
            runs = "no" if r.refused else "yes, no speedup" if r.shared else "yes"
            out.append(f"{r.world:>5}  {','.join(r.lanes):<24} {memory:<44} {r.per_iter_s:>8.3g} {r.per_block_s:>9.3g}"
                       f" {r.per_block_s * self.blocks:>11.3g}  {runs}")
            out += [f"{'':>7}- {reason}" for reason in r.refused]
            if not r.refused:
                out += [f"{'':>7}- {line}" for line in (r.shared, r.buckets, r.overlap) if line]
        chooser = "the run takes" if self.asked else "auto would choose"
        out += ["", f"{chooser} world {self.choice}: {self.why}", *self.spread,
                f"timeline model: {self.calibration}"]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _meta_model(model: str, dtype: str | None):
    """The model built from its config on the meta device: every shape and dtype, no weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    local = Path(model).is_dir()
    config = AutoConfig.from_pretrained(model, local_files_only=local)
    chosen = getattr(torch, dtype) if dtype not in (None, "auto") else getattr(config, "dtype", None)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=chosen if isinstance(chosen, torch.dtype) else None)


def _first_block(model: torch.nn.Module) -> tuple[str, torch.nn.Module, int]:
    from auto_round.utils import get_block_names

    names = get_block_names(model)[0]
    return names[0], model.get_submodule(names[0]), len(names)


def _home_compute_dtype(home: torch.device, block: torch.nn.Module) -> torch.dtype:
    """What auto-round computes a block in: bf16 autocast on accelerators, and on a CPU with
    AVX512-BF16 (its CPUID probe); else the weights' own dtype."""
    if home.type != "cpu":
        return torch.bfloat16
    from auto_round.utils.device import CpuInfo

    return torch.bfloat16 if CpuInfo().bf16 else torch.float32


def _lanes(devices, home: torch.device) -> list[torch.device]:
    if devices is not None:
        return [e.device for e in parse_device_spec(devices) if e.device is not None]
    if home.type == "cpu":
        return [home]
    return [torch.device(home.type, i) for i in range(backend(home).device_count())] or [home]


def _prices(price: BlockPrice, lanes: list[torch.device], home: torch.device) -> list[LanePrice]:
    world, out = len(lanes), []
    for k, dev in enumerate(lanes):
        is_home = k == 0 and dev == home
        need = price.home(world) if is_home else price.mirror(world)
        need += price_runtime(dev, home=is_home, world=world)
        out.append(LanePrice(str(dev), need, backend(dev).mem_get_info(dev)[0]))
    return out


def _link(lanes: list[torch.device]) -> tuple[float, float, str]:
    """(latency, bandwidth, said): the link probed on the lanes as 'auto' probes it."""
    if len(lanes) < 2:
        return 0.0, float("inf"), "one lane: nothing to exchange"
    from dpq.comm.communicators import select_communicator
    from dpq.comm.nccl_lifecycle import close_communicators
    from dpq.streams import make_lanes, release_run_streams

    try:
        comm, reason = select_communicator(make_lanes(lanes))
        latency, bandwidth = probe_link(comm)
        comm.close()
    except Exception as err:  # said, not raised: the screen still prices memory
        return 0.0, float("inf"), f"not probed ({err!r}); exchange time left out"
    finally:
        close_communicators()
        release_run_streams()
    speed = "unbounded" if bandwidth == float("inf") else f"{bandwidth / 1e9:.3g} GB/s"
    return latency, bandwidth, f"{comm.name} ({reason}), probed: latency {latency * 1e3:.3g} ms, {speed}"


def _calibration() -> str:
    found = sorted(CALIBRATIONS.glob("*.json")) if CALIBRATIONS.is_dir() else []
    if not found:
        return ("no calibration exists (none under benchmarks/calibration/; a GPU check, bash benchmarks/gpu_check.sh, "
                "measures one), so no calibrated figures: the times above are the cost model's stated guesses")
    return (f"calibrations {', '.join(p.name for p in found)}: python -m benchmarks.timeline --table "
            f"--calibration {found[-1]} gives the calibrated figures")


def plan_for(model, *, parallel_quantization: int | str = "auto", parallel_devices=None, home: str | None = None,
             iters: int = 200, batch_size: int = 8, gradient_accumulate_steps: int = 1, nsamples: int = 128,
             seqlen: int = 2048, model_dtype: str | None = None, parallel_overlap: object = "auto",
             parallel_order: str = "canonical", argv: Sequence[str] | None = None,
             caller: str = "enable") -> PlanScreen:
    """The plan screen (module docstring) for ``model``: a model folder or hub id (its config alone
    is read), or a model object. The settings are auto-round's and auto-round-dp's, with their
    defaults; ``home``: the block's device (default: the first lane's, else the CPU). An explicit
    ``parallel_quantization`` N marks the rows above N as not asked for. Bad arguments raise one
    :class:`dpq.planning.spec.SpecError` (a ValueError) listing every problem in these keywords' names (``caller``
    "cli": the command's flags, whose lanes it checked against this machine itself)."""
    from dpq.planning.machine import Machine
    from dpq.planning.spec import ParallelSpec, SpecError

    off = str(parallel_quantization).strip().lower() == "off"
    screen_world = "auto" if off else parallel_quantization  # every world, as the command's --parallel_plan
    found = _plan_argument_problems(model, home, iters=iters, batch_size=batch_size,
                                    gradient_accumulate_steps=gradient_accumulate_steps, nsamples=nsamples,
                                    seqlen=seqlen)
    try:
        spec = ParallelSpec.build(screen_world, parallel_devices, parallel_overlap=parallel_overlap,
                                  parallel_order=parallel_order,
                                  machine=Machine.detect() if caller != "cli" else None, caller=caller)
    except SpecError as err:
        found = err.problems + found
    if found:
        raise SpecError(found, head="dpq.plan_for: bad arguments")
    source = "model" if isinstance(model, torch.nn.Module) else "config"
    built = model if source == "model" else _meta_model(str(model), model_dtype)
    try:
        name, block, blocks = _first_block(built)
    except (IndexError, AttributeError, TypeError) as err:
        raise SpecError([refusals.plan_no_blocks(type(built).__name__)], head="dpq.plan_for: bad arguments") from err
    given = _lanes(spec.devices, torch.device("cpu")) if spec.devices is not None else []
    home_dev = torch.device(home) if home is not None else given[0] if given else \
        torch.device(default_accelerator_type())
    samples = max(1, min(nsamples, batch_size * gradient_accumulate_steps))
    # the run's own default lanes where none were given: on the CPU, as many sharing it as asked (at most
    # one per sample), else every visible device of home's type
    lanes = given or (default_devices(spec.world, home_dev, samples) if home_dev.type == "cpu" else
                      _lanes(None, home_dev))
    compute = _home_compute_dtype(home_dev, block)
    hidden = next(p.shape[-1] for p in block.parameters() if p.dim() == 2)
    inputs = [torch.empty(1, seqlen, hidden, dtype=compute, device="meta")]
    price = BlockPrice(block, inputs, samples, compute_dtype=compute)
    weights = [p for p in block.parameters() if p.dim() == 2]
    n = sum(p.numel() for p in weights)
    flops = 6.0 * samples * seqlen * n
    worlds = _worlds(len(lanes), samples, spec.world)
    latency, bandwidth, link = _link(lanes[:max(worlds)])  # the lanes the rows price, not every one listed
    costs = CostInputs(compute_s=flops / ACHIEVABLE_FLOPS.get(home_dev.type, ACHIEVABLE_FLOPS["cpu"]), issue_s=0.0,
                       tuned_elems=n + n // 8, bandwidth_Bps=bandwidth, latency_s=latency)
    rows = []
    for w in worlds:
        refused: list[str] = []
        buckets = overlap = ""
        try:
            plan = resolve(PlanRequest(world=w, devices=[str(d) for d in lanes[:w]], samples_per_iter=samples,
                                       home=home_dev, price=price, pool_samples=nsamples, overlap=spec.overlap,
                                       order=spec.order))
            buckets, overlap = plan.buckets_reason, plan.overlap_reason
        except PlanRefused as err:
            refused = err.reasons
        devices = sorted({str(d) for d in lanes[:w]})
        p = predict(w, iters, costs, devices=len(devices))  # lanes sharing a device: compute not divided
        shared = refusals.shared_lanes(devices) if len(devices) < w else ""
        rows.append(WorldRow(w, [str(d) for d in lanes[:w]], _prices(price, lanes[:w], home_dev), p.per_iter_s,
                             p.seconds, refused, buckets, overlap, shared))
    choice, why = _auto_choice(rows, lanes, iters, costs, spec.world)
    from dpq.planning.machine import device_names

    return PlanScreen(str(getattr(model, "name_or_path", model) if source == "model" else model), source, name,
                      type(block).__name__, blocks, samples, iters, seqlen, str(compute).removeprefix("torch."),
                      device_names([str(d) for d in dict.fromkeys(lanes)]), link, rows, choice, why, _calibration(),
                      asked=isinstance(spec.world, int), spread=spread_lines(rows, lanes, iters, costs, argv))


def _plan_argument_problems(model, home, **counts) -> list[str]:
    """:func:`plan_for`'s own arguments, each problem with its fix (the lane settings are
    :meth:`dpq.planning.spec.ParallelSpec.build`'s): a model of a type that names none, a local path with nothing
    there, a home that is not a device here, and counts that are not integers (>= 1; iters >= 0)."""
    import os

    found = []
    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        found.append(refusals.plan_model_type(type(model).__name__))
    elif not isinstance(model, torch.nn.Module):
        text = os.fspath(model)
        if text.startswith(("/", ".", "~")) and not Path(text).expanduser().exists():
            found.append(refusals.plan_model_missing(text))
    if home is not None:
        entries = parse_device_spec(str(home)) if isinstance(home, (str, torch.device)) else []
        dev = entries[0].device if len(entries) == 1 else None
        if dev is None:
            found.append(refusals.plan_bad_home(str(home)))
        elif dev.type != "cpu" and (entries[0].bare_index or (dev.index or 0) >= backend(dev).device_count()):
            found.append(refusals.plan_bad_home(str(home), "is not a device of this machine"))
    for name, value in counts.items():
        least = 0 if name == "iters" else 1
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            found.append(refusals.setting_type(name, repr(value), "count" if least else "int", "dpq.plan_for"))
    return found


MAX_ROWS = 16  # worlds the screen prices: every lane count up to the samples per iteration, at most this many


def _worlds(lanes: int, samples: int, asked: int | str) -> list[int]:
    """The worlds the screen prices: 1 .. the lanes, as far as a world gives every lane a sample (beyond,
    every world is refused for the same reason: one row says it) and :data:`MAX_ROWS`; an asked world
    too, whatever its size (its row says why it cannot run, when it cannot)."""
    shown = list(range(1, min(lanes, samples + 1, MAX_ROWS) + 1))
    if isinstance(asked, int) and asked not in shown:
        shown.append(asked)
    return shown


def _auto_choice(rows: list[WorldRow], lanes: list[torch.device], iters: int, costs: CostInputs,
                 world: int | str) -> tuple[int, str]:
    """The world the run would take and why: an explicit world as asked (or refused); under 'auto'
    the fitting lanes (the most that run), all of them when they share a device, else the fastest
    prediction among them."""
    if isinstance(world, int):
        row = next((r for r in rows if r.world == world), None)
        if row is None or row.refused:
            return world, "asked for, but refused (above): the run stops before the first block's work"
        return world, "asked for (--parallel_quantization); it fits"
    fitting = max((r.world for r in rows if not r.refused), default=1)
    if fitting < 2:
        return 1, "no second lane fits: the run is serial (auto-round's own loop)"
    kept = lanes[:fitting]
    if len(set(kept)) < len(kept):
        return fitting, refusals.auto_shared_device(fitting, sorted({str(d) for d in kept}))
    choice = choose_world(range(1, fitting + 1), iters, costs, label="the first block")
    return choice.world, choice.reason


SPREAD_GAIN = 1.10  # P x 1 predicted faster than 1 x W by more than this: the screen gives the torchrun command


def spread_lines(rows: list[WorldRow], lanes: list[torch.device], iters: int, costs: CostInputs,
                 argv: Sequence[str] | None = None) -> list[str]:
    """Note [P processes x 1 lane on the screen]: the most lanes that run, one GPU each, in one process
    (as ``auto`` runs them: it cannot re-launch itself) beside one process per lane under torchrun, each
    with its own issuing thread and GIL, by the cost model with the issuing thread at
    :data:`dpq.planning.cost_model.GPU_ISSUE_S_PER_LANE_ITERATION` (an upper bound); where torchrun is predicted
    faster by more than 10%, the command that gets it (``argv``: the command's own arguments)."""
    runs = [r for r in rows if not r.refused and not r.shared and r.world > 1]
    if not runs or lanes[0].type == "cpu":
        return []
    w = max(r.world for r in runs)
    c = dataclasses.replace(costs, issue_s=GPU_ISSUE_S_PER_LANE_ITERATION)
    one, spread = predict(w, iters, c), predict(w, iters, c, processes=w)
    line = (f"{w} processes x 1 lane (torchrun): {spread.per_iter_s:.3g} s/iter predicted, against 1 process x "
            f"{w} lanes {one.per_iter_s:.3g} s/iter (cost model; the issuing thread at "
            f"{GPU_ISSUE_S_PER_LANE_ITERATION * 1e3:.3g} ms per lane-iteration, an upper bound measured on one H200; "
            f"each process issues its own lane)")
    if one.per_iter_s <= SPREAD_GAIN * spread.per_iter_s:
        return ["", line]
    return ["", line, f"  {one.per_iter_s / spread.per_iter_s:.2f}x faster predicted; run it as: "
                      f"{torchrun_command(w, argv)}"]


def torchrun_command(processes: int, argv: Sequence[str] | None) -> str:
    """The command line under torchrun with one lane per process: ``argv`` without the plan screen and
    the lane list, ``--parallel_quantization 1``."""
    args, skip = [], False
    for a in list(argv or ["..."]):
        name = a.split("=", 1)[0]
        if skip:
            skip = False
            continue
        if name in ("--parallel_plan",):
            continue
        if name in ("--parallel_quantization", "--parallel_devices"):
            skip = "=" not in a
            continue
        args.append(shlex.quote(a))
    return f"torchrun --nproc-per-node {processes} -m dpq.autoround.cli {' '.join(args)} --parallel_quantization 1"


def show_for_command(parsed, spec, argv: Sequence[str] | None = None) -> int:
    """``auto-round-dp --parallel_plan``: the screen for the command's model and settings, printed; 0."""
    from auto_round.cli.main import RECIPES

    recipe = RECIPES["default"]  # auto-round's values for what the command line leaves unset
    devices = spec.devices
    if devices is None and "," in str(parsed.device_map):
        devices = parsed.device_map  # the plan's default: --device_map's devices when it lists several
    home = "cpu" if str(parsed.device_map).strip().lower() == "cpu" else None
    screen = plan_for(parsed.model or parsed.model_name, parallel_quantization=spec.world, parallel_devices=devices,
                      home=home, iters=recipe["iters"] if getattr(parsed, "iters", None) is None else parsed.iters,
                      batch_size=parsed.batch_size or recipe["batch_size"],
                      gradient_accumulate_steps=getattr(parsed, "gradient_accumulate_steps", None) or 1,
                      nsamples=parsed.nsamples or recipe["nsamples"], seqlen=parsed.seqlen or recipe["seqlen"],
                      model_dtype=parsed.model_dtype, parallel_overlap=spec.overlap, parallel_order=spec.order,
                      argv=argv, caller="cli")
    print(screen, flush=True)
    return 0
