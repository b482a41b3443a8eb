"""dpq's settings: their names, defaults and help (:data:`FLAGS`, the one source the CLI's argument
group, the Python API's keywords and the README's flag table come from), and :class:`ParallelSpec`,
the settings of one run, validated once where they enter (the command line, ``enable()``, the plan
screen) and passed down.

Every check here needs no model: the world's syntax, the lane device list's syntax, the world
against the number of lane devices given, flags that would have no effect, the timeout's range
(:func:`problems`); and, against this machine and torch build (:class:`dpq.planning.machine.Machine`),
lanes that cannot exist here (:func:`machine_problems`). What needs the model (memory per lane,
the block's placement, samples per iteration) is the plan's, before the first block's work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dpq import refusals
from dpq.planning.lane_devices import parse_device_spec, validate_world
from dpq.planning.machine import Machine
from dpq.streams import backend

__all__ = ["FLAGS", "OVERLAP_SETTINGS", "TIMEOUT_RANGE_S", "Flag", "ParallelSpec", "SpecError", "SpecSettings",
           "invalid", "machine_problems", "order_setting", "overlap_setting", "problems"]

TIMEOUT_RANGE_S = (10.0, 604800.0)  # the process group's start waits that long for every rank; a week


@dataclass(frozen=True)
class Flag:
    """One of dpq's settings: ``name`` is the Python keyword, ``--name`` the flag."""

    name: str
    default: object
    help: str
    metavar: str | None = None  # None: a switch (present or not)
    choices: tuple[str, ...] = ()  # the values it takes (a bare flag means ``const``)
    const: object = None

    @property
    def option(self) -> str:
        return f"--{self.name}"

    @property
    def usage(self) -> str:
        """The flag as the README's table shows it."""
        return self.option + (f" {self.metavar}" if self.metavar else "")


FLAGS: tuple[Flag, ...] = (
    Flag("parallel_quantization", "off",
         "off (default): plain auto-round. N: tune every block on N lanes, or stop before the block with every "
         "reason it cannot. auto: of the lanes that fit, as many as the cost model predicts to be fastest per "
         "block; falls back to serial per block and says why", "{off,auto,N}"),
    Flag("parallel_devices", None,
         "lane devices: 0,1,2,3, cuda:0,cuda:1, cpu,cpu; the first is the block's own device. Default: the devices "
         "of --device_map when it lists several, else every visible device of the home device's type", "LIST"),
    Flag("parallel_debug", False, "after every step, check that all lanes hold bitwise-identical tuned values"),
    Flag("parallel_overlap", "auto",
         "GPU lanes: exchange gradient buckets during the backward, on a second stream per lane, the lanes' block "
         "forward uncompiled so that gradients appear while the backward runs. auto (default): on where some pair "
         "of lane GPUs has no peer access (the exchange then goes through host memory and dominates; modeled, "
         "docs/PERFORMANCE.md), off elsewhere; on (or the bare flag); off. CPU lanes overlap anyway, so 'on' is "
         "refused there as having no effect", "{auto,on,off}", ("auto", "on", "off"), "on"),
    Flag("parallel_order", "canonical",
         "the order the lanes' gradients are summed in. canonical (default): dpq's own fold in global lane order, "
         "so the bits depend on the world alone (torchrun 2x1 == 1x2 bitwise), at the price of NCCL send/recv "
         "and a fold kernel per lane (docs/PERFORMANCE.md); native: NCCL's own reduce-scatter (in-process NCCL "
         "only): every lane still gets the same bits, but they depend on NCCL's algorithm and the lane layout",
         "{canonical,native}", ("canonical", "native")),
    Flag("parallel_report", None,
         "write the run's report as JSON at every end of the run (success, failure, cancel): the schema, "
         "versions, devices, command line, start and end time, exit status, a structured error, and per block "
         "the world, seconds, exchange bytes, loss curve, every reason a lane was dropped and auto's predictions",
         "PATH"),
    Flag("parallel_timeout", 600.0,
         "how long one iteration may take (the host's wait for the lanes' work, and a watchdog thread for the "
         "issuing thread itself) before the block is stopped as hung, and under torchrun how long a collective "
         "waits for a lost or hung rank (10 to 604800, default 600)", "SECONDS"),
    Flag("parallel_plan", False,
         "print what this machine would get, then exit without quantizing: per world the lanes, each lane's "
         "memory price against its free memory, the predicted seconds per iteration and per block, and the world "
         "auto would choose and why (from the model's config alone where it suffices)"),
)
DEFAULTS = {f.name: f.default for f in FLAGS}


class SpecError(ValueError):
    """Settings that cannot run; ``problems`` holds every one, each with its fix."""

    def __init__(self, problems: Sequence[str], head: str = "dpq: bad arguments") -> None:
        self.problems = list(problems)
        super().__init__(f"{head}:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class ParallelSpec:
    """One run's dpq settings, valid by construction: ``world`` 'off', 'auto' or an int >= 1;
    ``devices`` the lane device list as given (None: the plan's default); ``overlap`` None for ``auto``
    (the plan's choice, :func:`dpq.planning.plan.overlap_choice`), True for ``on`` (a second stream per GPU
    lane), False for ``off``; ``timeout`` seconds; ``report`` a path or None. ``caller``: how a
    refusal names the settings (``"cli"`` the flags, ``"enable"`` their names as keywords, ``"api"``
    :func:`dpq.parallel_tune`'s arguments).

    Note [a spec cannot exist invalid]: every way in (the command line, ``enable()``, ``plan_for``,
    ``parallel_tune``, a direct construction) passes :meth:`__post_init__`, which takes the forms the
    settings may come in ('2', 'on', '600'), stores them normalized, and raises :class:`SpecError`
    (a ValueError) with every setting that cannot run: a malformed world or lane list, fewer lanes
    than the world, an overlap that is not a setting, a timeout that is not a positive number of at
    most a week. :meth:`build` adds what an entry point refuses as the user's mistake though the
    engine could run it (a setting with no effect, a timeout under the process group's start floor,
    lanes this machine lacks); the engine's own tests run those (a 0.3 s watchdog, CPU lanes on
    communication streams) through a direct construction."""

    world: int | str = DEFAULTS["parallel_quantization"]
    devices: object = DEFAULTS["parallel_devices"]
    debug: bool = DEFAULTS["parallel_debug"]
    overlap: bool | str | None = None
    timeout: float = DEFAULTS["parallel_timeout"]
    report: str | None = DEFAULTS["parallel_report"]
    order: str = DEFAULTS["parallel_order"]  # --parallel_order: "canonical" or "native" (dpq.planning.plan.ORDERS)
    caller: str = field(default="cli", compare=False, repr=False)

    def __post_init__(self) -> None:
        found = invalid(self.world, self.devices, overlap=self.overlap, timeout=self.timeout, order=self.order,
                        caller=self.caller)
        if found:
            raise SpecError(found)
        object.__setattr__(self, "world", validate_world(self.world, self.caller))
        object.__setattr__(self, "debug", bool(self.debug))
        object.__setattr__(self, "overlap", overlap_setting(self.overlap, self.caller))
        object.__setattr__(self, "timeout", float(self.timeout))
        object.__setattr__(self, "order", order_setting(self.order, self.caller))

    @classmethod
    def build(cls, parallel_quantization: object = DEFAULTS["parallel_quantization"],
              parallel_devices: object = DEFAULTS["parallel_devices"], *,
              parallel_debug: bool = DEFAULTS["parallel_debug"],
              parallel_overlap: bool | str | None = DEFAULTS["parallel_overlap"],
              parallel_timeout: object = DEFAULTS["parallel_timeout"],
              parallel_report: str | None = DEFAULTS["parallel_report"],
              parallel_order: str = DEFAULTS["parallel_order"],
              machine: Machine | None = None, home: str | None = None, caller: str = "cli") -> ParallelSpec:
        """The spec, or :class:`SpecError` with every problem (:func:`problems`; with ``machine``, also
        :func:`machine_problems`, ``home`` the block's device type when known: ``--device_map``'s), each
        naming the settings as ``caller`` writes them."""
        given = caller != "cli" and parallel_timeout != DEFAULTS["parallel_timeout"]  # (the CLI says it itself)
        found = problems(parallel_quantization, parallel_devices, debug=parallel_debug, overlap=parallel_overlap,
                         timeout=parallel_timeout, timeout_given=given, order=parallel_order, caller=caller)
        if machine is not None and not found:
            found = machine_problems(validate_world(parallel_quantization), parallel_devices, machine,
                                     overlap=parallel_overlap, home=home, caller=caller)
        if found:
            raise SpecError(found)
        return cls(parallel_quantization, parallel_devices, parallel_debug, parallel_overlap, parallel_timeout,
                   parallel_report, parallel_order, caller=caller)


class SpecSettings:
    """The settings of an object that holds a validated ``spec`` (:class:`ParallelSpec`), read through
    it, never copied: the adapter's run (``dpq.autoround.run.Run``) and the session's config
    (``dpq.session.SessionConfig``)."""

    __slots__ = ()
    spec: ParallelSpec

    @property
    def world(self) -> int | str:
        return self.spec.world

    @property
    def devices(self) -> object:
        return self.spec.devices

    @property
    def debug_identical(self) -> bool:
        return self.spec.debug

    @property
    def overlap(self) -> bool | None:
        """Exchange buckets during the backward on GPU lanes: None = auto (the plan's choice), True = on
        (a second stream per lane, dpq.comm.comm_streams), False = off. CPU lanes overlap unless off."""
        return self.spec.overlap

    @property
    def order(self) -> str:
        """--parallel_order: the order the sums fold in ("canonical" or "native"; dpq.planning.plan.ORDERS)."""
        return self.spec.order

    @property
    def timeout(self) -> float:
        """--parallel_timeout: how long the host waits for an iteration's work (dpq.tune_loop: the
        watchdog) and, across processes, a collective for the other ranks (the process group's timeout)."""
        return self.spec.timeout


def _timeout_problem(value: object, low: float, caller: str = "cli") -> str | None:
    """``value`` as seconds from ``low`` (0: any positive number) to a week, else the refusal."""
    high = TIMEOUT_RANGE_S[1]
    shown = str(value) if caller == "cli" else value
    if isinstance(value, bool):  # True is 1.0 to float(): not a number of seconds anyone means
        return refusals.timeout_not_a_number(shown, low, high, caller)
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return refusals.timeout_not_a_number(shown, low, high, caller)
    if math.isnan(seconds) or not (low <= seconds <= high) or seconds <= 0:  # inf is out of range
        return refusals.timeout_out_of_range(shown, low, high, caller)
    return None


OVERLAP_SETTINGS = {"auto": None, "on": True, "off": False}


def overlap_setting(value: object, caller: str = "cli") -> bool | None:
    """--parallel_overlap's value as the spec holds it: 'auto'/None -> None, 'on'/True -> True,
    'off'/False -> False; ValueError for anything else (:func:`problems` says it with the fix)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in OVERLAP_SETTINGS:
        return OVERLAP_SETTINGS[value.strip().lower()]
    raise ValueError(f"dpq: {refusals.bad_overlap(value, caller)}")


def order_setting(value: object, caller: str = "cli") -> str:
    """--parallel_order's value: 'canonical' or 'native' (any case); ValueError for anything else."""
    if isinstance(value, str) and value.strip().lower() in ("canonical", "native"):
        return value.strip().lower()
    raise ValueError(f"dpq: {refusals.bad_order(value, caller)}")


def invalid(world: object, devices: object = None, *, overlap: object = None,
            timeout: object = DEFAULTS["parallel_timeout"], order: object = DEFAULTS["parallel_order"],
            caller: str = "cli", timeout_floor: float = 0.0) -> list[str]:
    """What makes settings impossible to run (Note [a spec cannot exist invalid]), each once: the
    world's and the lane list's syntax, fewer lanes than the world, the overlap and order settings, the
    timeout as a number of seconds from ``timeout_floor`` (0: any positive number) up to a week."""
    found = []
    try:
        w = validate_world(world, caller)
    except ValueError as e:
        found.append(str(e).removeprefix("dpq: "))
        w = None
    if devices is not None:
        entries = parse_device_spec(devices, caller)
        found += [e.error for e in entries if e.error]
        named = [e.raw.strip() for e in entries if e.raw.strip()]
        if isinstance(w, int) and named and len(named) < w:
            found.append(refusals.too_few_devices(w, named, True, caller))
    try:
        overlap_setting(overlap, caller)
    except ValueError as e:
        found.append(str(e).removeprefix("dpq: "))
    try:
        order_setting(order, caller)
    except ValueError as e:
        found.append(str(e).removeprefix("dpq: "))
    if (problem := _timeout_problem(timeout, timeout_floor, caller)) is not None:
        found.append(problem)
    return list(dict.fromkeys(found))


def problems(world: object, devices: object = None, *, debug: bool = False, overlap: object = None,
             timeout: object = DEFAULTS["parallel_timeout"], timeout_given: bool = False,
             order: object = DEFAULTS["parallel_order"], caller: str = "cli") -> list[str]:
    """Every problem visible in the settings alone (module docstring), each once, named as ``caller``
    writes them: what makes them invalid (:func:`invalid`), and what an entry point refuses though the
    engine could run it (settings with no effect, a timeout under :data:`TIMEOUT_RANGE_S`'s floor).
    ``timeout_given``: the timeout was asked for (a command line's flag), not left at its default."""
    found = invalid(world, devices, overlap=overlap, timeout=timeout, order=order, caller=caller,
                    timeout_floor=TIMEOUT_RANGE_S[0])
    try:
        w = validate_world(world, caller)
    except ValueError:
        w = None
    if devices is not None and w == "off":
        found.append(refusals.devices_while_off(caller))
    if debug and w == "off":
        found.append(refusals.setting_while_off("debug", caller))
    try:
        overlap = overlap_setting(overlap, caller)
    except ValueError:
        overlap = None  # said above
    if overlap is True and w == "off":
        found.append(refusals.setting_while_off("overlap", caller))
    if overlap is True and w != "off" and devices is not None and _no_accelerator_lane(devices):
        found.append(refusals.overlap_on_cpu(caller))
    if timeout_given and w == "off" and _timeout_problem(timeout, TIMEOUT_RANGE_S[0], caller) is None:
        found.append(refusals.setting_while_off("timeout", caller))
    return list(dict.fromkeys(found))


def _no_accelerator_lane(devices: object) -> bool:
    """Every lane of a well-formed device list is on a device without streams of its own (the CPU, by
    its backend: the timeline model's logical devices are accelerators)."""
    entries = parse_device_spec(devices)
    if not entries or any(e.device is None for e in entries):
        return False  # malformed: said elsewhere
    try:
        return not any(backend(e.device).accelerator for e in entries)
    except ValueError:
        return False  # a device type dpq does not support: said elsewhere


def machine_problems(world: int | str, devices: object, machine: Machine, *, overlap: object = None,
                     home: str | None = None, caller: str = "cli") -> list[str]:
    """What stops well-formed settings on ``machine``: lanes of a type this torch build lacks, or
    that this machine does not have (each type said once, with lanes that exist here as the fix),
    and ``overlap`` where every lane is on the CPU (``devices`` all cpu, or none given and ``home``
    is cpu)."""
    if world == "off":
        return []
    found: dict[str, list[str]] = {}  # sentence kind -> the lanes it names
    lanes = 2 if not isinstance(world, int) else max(2, world)
    example = machine.example_lanes(lanes)
    types = []
    for e in parse_device_spec(devices, caller) if devices is not None else []:
        dev = e.device
        if dev is None:
            continue
        types.append(dev.type)
        if e.bare_index and dev.type == "cpu":
            found.setdefault(refusals.no_accelerator_for_index(e.raw), [])
        elif dev.type != "cpu" and dev.type not in machine.built:
            found.setdefault(f"built:{dev.type}", []).append(str(dev))
        elif dev.type != "cpu" and (dev.index or 0) >= machine.count(dev.type):
            found.setdefault(f"count:{dev.type}", []).append(str(dev))
        elif dev.type == "cpu" and dev.index is not None and dev.index > 0:
            found.setdefault(refusals.not_a_cpu_index(str(dev)), [])
    out = []
    for key, named in found.items():
        kind, _, device_type = key.partition(":")
        if kind == "built":
            out.append(refusals.torch_lacks_type(list(dict.fromkeys(named)), device_type, machine.torch,
                                                 device_type == "cuda" and machine.nvidia_driver, example, caller))
        elif kind == "count":
            out.append(refusals.no_such_device_here(list(dict.fromkeys(named)), device_type,
                                                    machine.count(device_type), example, caller))
        else:
            out.append(key)
    all_cpu = all(t == "cpu" for t in types) if types else (home == "cpu" or machine.accelerator is None)
    try:
        asked = overlap_setting(overlap) is True
    except ValueError:
        asked = False  # malformed: problems() says it
    if asked and all_cpu:
        out.append(refusals.overlap_on_cpu(caller))
    return out
