"""``auto-round-dp``: the auto-round CLI, every argument unchanged, plus dpq's flags
(:data:`dpq.planning.spec.FLAGS`) as the ``dpq`` group of auto-round's own parser (:mod:`dpq.autoround.args`:
one ``--help``, one usage line, auto-round's error format, under the command's name).

The whole command line is parsed first; then everything the flags and this machine reveal
without the model is checked (:func:`argument_errors`: the world against the lane devices, lanes
this torch build or machine lacks, the timeout, the paths the run writes): any problem stops the
command with exit 2 before the model loads, each reason once, nothing created. ``--parallel_plan``
prints the plan screen (:mod:`dpq.autoround.plan_screen`) and exits. Otherwise dpq's flags are taken
out of argv, ``enable()`` is called with the validated :class:`dpq.planning.spec.ParallelSpec`, and auto-round's
own runner gets the rest. At the end a summary goes through auto-round's logger
(:mod:`dpq.autoround.summary`).

Under ``torchrun`` (``WORLD_SIZE`` > 1) every process runs this CLI with the same arguments: it
initialises the process group itself (:mod:`dpq.autoround.process_setup`: gloo for CPU lanes,
``cpu:gloo,cuda:nccl`` / ``cpu:gloo,xpu:xccl`` for GPUs, each process on its own: ``cuda:LOCAL_RANK * L``
onwards for L lanes unless ``--parallel_devices`` says otherwise; HCCL for Gaudi, one per process;
xpu and hpu not run), ``--parallel_quantization`` is each process's lane
count, every block's tune spans the processes (DESIGN.md contract 7), rank 0 alone writes
``--output_dir`` and the report (:mod:`dpq.autoround.ranks`), and the group is destroyed at the
end. A failure on any rank stops every rank with a non-zero exit and a message naming the rank.

With dpq on, the output is staged beside ``--output_dir`` and moved into place only once saved
whole (:mod:`dpq.autoround.ranks`). As a command it handles SIGTERM and SIGINT itself
(:mod:`dpq.cancel`): a cancel stops every rank within seconds, writes nothing more, and exits 130
(SIGINT), 143 (SIGTERM) or 129 (a torchrun worker's launcher gone). Under torchrun every rank's
whole job (model and data by content, every setting: :mod:`dpq.autoround.job`) is agreed before
the model loads; a rank given another job stops every rank, naming each differing setting.

Recipes: ``auto-round-dp-best``, ``-light``, ``-rtn``, ``-opt-rtn``, ``-mllm`` run auto-round's
``auto-round-best`` etc. (:data:`RECIPES`) with the same flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
from types import MappingProxyType

# recipe -> auto-round's runner for it (auto_round.__main__, the targets of its console scripts)
RECIPES: MappingProxyType[str | None, str] = MappingProxyType({
    None: "run", "best": "run_best", "light": "run_light", "rtn": "run_rtn", "opt-rtn": "run_opt_rtn",
    "mllm": "run_mllm"})


def runner_for(recipe: str | None):
    """auto-round's CLI runner for ``recipe`` (None: plain ``auto-round``)."""
    import auto_round.__main__ as ar_main

    return getattr(ar_main, RECIPES[recipe])


def torchrun_processes() -> int:
    """How many processes torchrun launched this job with (1: not under torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def launcher_missing() -> list[str]:
    """The variables of torchrun's environment (besides ``WORLD_SIZE``) that are not set: with
    ``WORLD_SIZE`` > 1 and any of them missing, no launcher started this process."""
    return [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]


def argument_errors(ours: argparse.Namespace, rest: list[str] = (), recipe: str | None = None) -> list[str]:
    """Every problem the flags and this machine reveal without the model (dpq's flags ``ours``; under
    torchrun also auto-round's that dpq cannot serve there, in ``rest``; ``recipe`` the command's, for
    auto-round's defaults), each once."""
    from dpq import refusals
    from dpq.planning.machine import Machine
    from dpq.planning.spec import machine_problems, problems

    from .args import autoround_args
    from .outputs import DEFAULT_OUTPUT_DIR, missing_inputs, path_errors, run_inputs

    theirs = autoround_args(list(rest))  # None: auto-round refuses them itself, with its usage
    world = _screen_world(ours) if ours.parallel_plan else ours.parallel_quantization
    found = problems(world, ours.parallel_devices, debug=ours.parallel_debug, overlap=ours.parallel_overlap,
                     timeout=ours.parallel_timeout, timeout_given=isinstance(ours.parallel_timeout, str))
    try:
        from dpq.planning.lane_devices import validate_world

        machine, valid = Machine.detect(), validate_world(world)
        home = "cpu" if theirs is not None and str(theirs.device_map).strip().lower() == "cpu" else None
        found += machine_problems(valid, ours.parallel_devices, machine, overlap=ours.parallel_overlap, home=home)
        found += _lane_count_problems(valid, ours.parallel_devices, theirs, recipe, machine)
        found += _device_map_problems(valid, ours.parallel_devices, theirs, machine)
    except ValueError:
        pass  # a malformed world: said above
    if _rank() == 0 or _one_host():  # rank 0 writes; on one host every rank sees its paths, and says what it sees
        output_dir = theirs.output_dir if theirs is not None else DEFAULT_OUTPUT_DIR
        found += path_errors(ours.parallel_report, output_dir, run_inputs(theirs))
    if str(world).strip().lower() != "off":  # (with dpq off, auto-round's own run says it, as it always has)
        found += missing_inputs(theirs)
    if ours.parallel_plan:  # the screen runs nothing: what the run itself would refuse is said above
        return list(dict.fromkeys(found))
    off = str(world).strip().lower() == "off"
    if off and torchrun_processes() > 1:
        found.append(refusals.OFF_UNDER_TORCHRUN)
    if torchrun_processes() > 1 and theirs is not None and theirs.tasks is not None:
        found.append(refusals.TASKS_UNDER_TORCHRUN)  # every rank would evaluate the same model
    if torchrun_processes() > 1 and (missing := launcher_missing()):
        found.append(refusals.world_size_without_launcher(os.environ["WORLD_SIZE"], missing))
    return list(dict.fromkeys(found))


def _one_host() -> bool:
    """Every process of this torchrun job is on this host (torchrun's LOCAL_WORLD_SIZE is its WORLD_SIZE)."""
    return os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1")


def _recipe_defaults(recipe: str | None) -> dict:
    """auto-round's values for what the command line leaves unset, for ``recipe`` (its RECIPES)."""
    from auto_round.cli.main import RECIPES

    return RECIPES.get((recipe or "default").replace("-", "_"), RECIPES["default"])


def _device_map_problems(world: int | str, devices: object, theirs: argparse.Namespace | None, machine) -> list[str]:
    """Without --parallel_devices the lanes are --device_map's devices: an accelerator type it names that
    this torch build or machine lacks stops the command here, as the same lanes given to
    --parallel_devices would (bare indices are auto-round's own: on a machine without accelerators it runs
    them on the CPU)."""
    if world == "off" or devices is not None or theirs is None:
        return []
    from dpq.planning.lane_devices import parse_device_spec
    from dpq.planning.spec import machine_problems

    typed = [e.raw.strip() for e in parse_device_spec(str(theirs.device_map))
             if e.device is not None and not e.bare_index and e.device.type != "cpu"]
    return machine_problems(world, ",".join(typed), machine) if typed else []


def _lane_count_problems(world: int | str, devices: object, theirs: argparse.Namespace | None,
                         recipe: str | None, machine) -> list[str]:
    """Counts under 1 (--nsamples, --batch_size, --gradient_accumulate_steps: no sample per iteration), and
    an explicit world against what the command line already fixes: every lane (P processes x the
    world, under torchrun) needs a sample of each iteration (the smaller of --nsamples and
    --batch_size, auto-round's defaults filled in; a tune only: with 0 iterations nothing is split by
    samples), and, with no --parallel_devices on one process, the world needs as many devices of
    the home accelerator as it names (on the CPU, default lanes share it: no count). Nothing here
    is sized by the request."""
    if world == "off" or theirs is None:
        return []
    from dpq import refusals

    defaults = _recipe_defaults(recipe)
    found = [refusals.count_below_one(f"--{name}", value) for name in ("nsamples", "batch_size",
                                                                        "gradient_accumulate_steps")
             if (value := getattr(theirs, name, None)) is not None and value < 1]
    if found or not isinstance(world, int):  # (--gradient_accumulate_steps 0 was read as 1 here, refused late)
        return found
    given = getattr(theirs, "iters", None)  # an algorithm's option: absent from the namespace unless given
    iters = 0 if getattr(theirs, "model_free", False) else given if given is not None else defaults["iters"]
    processes = max(1, torchrun_processes())
    if iters and iters > 0:
        pool = getattr(theirs, "nsamples", None) or defaults["nsamples"]
        per_iter = ((getattr(theirs, "batch_size", None) or defaults["batch_size"])
                    * (getattr(theirs, "gradient_accumulate_steps", None) or 1))
        samples = max(1, min(pool, per_iter))
        if world * processes > samples:
            found.append(refusals.too_few_samples(world * processes, samples, pool, processes=processes))
    if devices is None and processes == 1:
        listed = [d.strip() for d in str(theirs.device_map).split(",") if d.strip()]
        kind = None if str(theirs.device_map).strip().lower() == "cpu" else machine.accelerator
        named = listed if len(listed) > 1 else [f"{kind}:{i}" for i in range(machine.count(kind))] if kind else []
        if kind is not None and world > len(named):
            found.append(refusals.too_few_devices(world, named, False))
    return found


def _screen_world(ours: argparse.Namespace) -> object:
    """The world the plan screen is asked about: every world up to the lanes (``auto``) unless one is given."""
    world = ours.parallel_quantization
    return "auto" if str(world).strip().lower() == "off" else world


def _listed(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems, all listed:\n" + "\n".join(f"  - {p}" for p in problems)


def spec_of(ours: argparse.Namespace):
    """The validated :class:`dpq.planning.spec.ParallelSpec` of dpq's flags (:func:`argument_errors` passed them)."""
    from dpq.planning.spec import ParallelSpec

    return ParallelSpec.build(_screen_world(ours) if ours.parallel_plan else ours.parallel_quantization,
                              ours.parallel_devices, parallel_debug=ours.parallel_debug,
                              parallel_overlap=ours.parallel_overlap,
                              parallel_timeout=ours.parallel_timeout, parallel_report=ours.parallel_report,
                              parallel_order=ours.parallel_order)


def hands_over(argv: list[str], recipe: str | None) -> bool:
    """Whether ``argv`` is one of auto-round's other commands (``list``, ``eval``, ``help``, or an
    algorithm's own ``--help``), which auto-round's runner serves as it is, without dpq."""
    if recipe is None and argv and (argv[0] in ("list", "eval", "help") or {"--list", "--eval"} & set(argv)):
        return True
    return bool({"-h", "--help"} & set(argv)) and any(a.startswith("--alg") for a in argv)  # its aliases


def main(argv: list[str] | None = None, recipe: str | None = None) -> int:
    """Returns the exit status: 0 when the run finished (the model is complete and in place, even
    if the report could not be written: that is said) or the plan screen was shown, 2 for arguments
    auto-round's parser or dpq's checks refuse (usage and ``auto-round-dp: error: ...``; nothing was
    loaded, nothing created), 1 when the plan refused, a lane failed,
    a block's issuing thread hung or (torchrun) a rank failed or was lost (the message is printed,
    no traceback; under torchrun the rank whose own error started it prints that error's traceback),
    128 + the signal when the run was cancelled (130 SIGINT, 143 SIGTERM, 129 the launcher gone:
    :mod:`dpq.cancel`). Any other failure propagates (with its traceback; non-zero exit). The
    report (``--parallel_report``, :class:`dpq.autoround.outputs.RunReport`) is written at every
    one of these ends but exit 2 and the plan screen, saying how the run ended. Run as the command
    (``argv`` None: the console scripts, ``python -m``), it handles SIGTERM and SIGINT itself
    (:func:`dpq.cancel.install`); called with ``argv`` it leaves the caller's signal handling alone."""
    as_command = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    from .args import build_parser, parse, program, split_argv

    if hands_over(argv, recipe):
        sys.argv = [program(recipe), *argv]
        runner_for(recipe)()
        return 0
    command = argv[1:] if argv[:1] == ["quantize"] else argv
    parser = build_parser(recipe)
    try:
        parsed = parse(parser, command)  # --help prints the one help and exits 0
        ours, rest = split_argv(command)
        problems = argument_errors(ours, rest, recipe)
        if problems:
            parser.error(_listed(problems))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 2
    spec = spec_of(ours)
    if ours.parallel_plan:
        from dpq.planning.spec import SpecError

        from .plan_screen import show_for_command

        try:
            return show_for_command(parsed, spec, command)
        except SpecError as err:  # a count the screen cannot price (--batch_size -3): as a flag's refusal
            try:
                parser.error(_listed(err.problems))
            except SystemExit as stop:
                return stop.code
    return _start(spec, ours, recipe, rest, [program(recipe), *argv], as_command)


def _start(spec, ours: argparse.Namespace, recipe: str | None, rest: list[str], command: list[str],
           as_command: bool) -> int:
    """The run itself (arguments checked): the report set up, cancel handling, one process or several."""
    from dpq import cancel

    from .outputs import RunReport, error_of, exit_status_of

    # rank 0 alone writes the report; a thread that ends the process (a cancel, a hung block) writes it too
    report = RunReport(spec.report, spec.world, spec.devices, command) if spec.report and _rank() == 0 else None
    unregister = cancel.on_exit(lambda: report.at_exit(_where)) if report is not None else lambda: None
    if as_command:
        cancel.install(watch_parent=torchrun_processes() > 1)  # a worker does not outlive its launcher
    try:
        if torchrun_processes() == 1:
            return _run(spec, recipe, rest, report=report)
        return _run_processes(spec, ours, recipe, rest, report)
    except cancel.Cancelled as stopped:
        if report is not None:
            report.write(error_of(stopped, _where()), exit_status_of(stopped))  # (a no-op when the run wrote it)
        print(f"auto-round-dp: dpq: {cancel.said()}", file=sys.stderr, flush=True)
        return cancel.exit_status(stopped.signum)
    finally:
        unregister()


def _where() -> str:
    """What the run worked on when it ended (:attr:`dpq.autoround.run.Run.at`; "" before it started)."""
    if "dpq.autoround.run" not in sys.modules:
        return ""
    from dpq.autoround import patches

    run = patches.reported()
    return run.at if run is not None else ""


def _stopped_before_run(report, message: str, failure: BaseException) -> None:
    """The run could not start (torchrun's set-up, the job agreement, the patch table): ``message``
    said and, on rank 0, reported with ``failure``."""
    from .outputs import error_of, exit_status_of

    print(f"auto-round-dp: {message}", file=sys.stderr)
    if report is not None:
        report.write(error_of(failure), exit_status_of(failure))


def _run_processes(spec, ours: argparse.Namespace, recipe: str | None, rest: list[str], report=None) -> int:
    """Under torchrun: this process's lanes, the group, the job agreed by every rank
    (:mod:`dpq.autoround.job`), the run over the group, the group destroyed."""
    from dpq import cancel, refusals
    from dpq.autoround.job import settings
    from dpq.autoround.process_setup import SETUPS, process_lanes, start_group
    from dpq.planning.distributed import JobMismatch, ProcessSet, agree_job, peer_lost
    from dpq.planning.lane_devices import lane_device_errors
    from dpq.planning.plan import PlanRefused
    from dpq.streams import default_accelerator_type

    devices, rest, kind = process_lanes(spec.world, spec.devices, rest, int(os.environ.get("LOCAL_RANK", "0")),
                                        default_accelerator_type())
    spec = dataclasses.replace(spec, devices=devices)
    if report is not None:
        report.devices = devices
    # before the group's setup binds a device or imports a vendor's backend for it: the plan's refusal
    missing = lane_device_errors(devices) if devices is not None else []
    if missing:
        _stopped_before_run(report, str(PlanRefused(missing)), PlanRefused(missing))
        return 1
    try:
        start_group(kind, spec.timeout, (devices or "").split(",")[0] or None)
    except Exception as err:  # a rank that never came, a store it cannot reach: said, not a traceback
        _stopped_before_run(report, f"dpq: {refusals.group_start_failed(SETUPS[kind].backend, repr(err))}", err)
        return 1
    import torch.distributed as dist

    procs = ProcessSet.detect()  # the job's one set: its reports, its cancel (peers) and every block's run
    procs.timeout_s = spec.timeout  # also how long the others wait for rank 0's silence in its save
    if cancel.installed():
        cancel.install(peers=procs)
    try:
        try:  # every rank runs the same job, or none starts: before the model loads
            agree_job(procs, settings(ours, rest, recipe))
        except JobMismatch as err:
            _stopped_before_run(report, str(err), err)
            return 1
        except Exception as err:  # a rank lost while agreeing
            failure = procs.stop(err, peer_lost(err))
            _stopped_before_run(report, str(failure), failure)
            return failure.exit_status
        return _run(spec, recipe, rest, procs, report)
    finally:
        if dist.is_initialized():  # a failure destroyed it already (dpq.planning.distributed.ProcessSet.stop)
            dist.destroy_process_group()


def _freeze_imported_heap() -> None:
    """auto-round's ``clear_memory`` runs ``gc.collect()`` several times per block, and with
    auto-round and transformers imported each full collection walks ~400k objects (~0.2 s on a
    2-core CPU): seconds per block of host time, which lanes do not shrink. What is
    imported by now lives as long as the process, so it is frozen (``gc.freeze``: later
    collections skip it); garbage made later is collected as before. Only as the command: a
    library caller's heap is theirs."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def tqdm_safe_logging():
    """auto-round's and dpq's log lines during the run go above tqdm's live bars (``tqdm.write``), not
    into the middle of one."""
    from auto_round.logger import logger
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logger]):
        yield


def _run(spec, recipe: str | None, rest: list[str], procs=None, report=None) -> int:
    import traceback

    from dpq import cancel, refusals
    from dpq.autoround import integration
    from dpq.autoround.patches import PatchMismatch
    from dpq.autoround.seams_common import ParallelLaneError
    from dpq.planning.distributed import RankFailure, peer_lost
    from dpq.planning.plan import PlanRefused

    from .args import program
    from .outputs import error_of, exit_status_of
    from .ranks import SaveFailed, is_write_failure
    from .summary import log_summary

    quantize, rank = runner_for(recipe), _rank()  # auto-round's command for the recipe
    run = None  # the run dpq's replacements are handed (dpq.autoround.run.Run)
    if spec.world != "off":
        try:
            run = integration.enable_spec(spec, processes=procs)
        except PatchMismatch as e:
            _stopped_before_run(report, str(e), e)
            return 1
    sys.argv = [program(recipe), *rest]
    if cancel.installed():  # run as the command (main installed cancel handling): the process is ours
        _freeze_imported_heap()
    failure: BaseException | None = None
    started = time.perf_counter()
    try:
        with tqdm_safe_logging():
            quantize()
    except (PlanRefused, ParallelLaneError, RankFailure, SaveFailed) as e:
        failure = e
    except Exception as e:  # outside a block's run: under several processes the others learn which rank
        if run is None and is_write_failure(e):  # off: auto-round's own save ran out of room; said, as with dpq on
            failure = SaveFailed(_output_dir(rest), e, staged=False)
            failure.__cause__ = e
        elif run is None or run.processes is None:
            failure = e  # reported, then raised with its traceback (the output is as it was)
            raise
        else:
            failure = run.processes.stop(e, peer_lost(e))
            failure.__cause__ = e
    except BaseException as e:  # an interrupt, the user's cancel: reported, then raised
        failure = e
        raise
    finally:
        integration.disable()
        if spec.world != "off" and rank == 0:
            log_summary(time.perf_counter() - started, failure)
        status = exit_status_of(failure)
        unwritten = report.write(error_of(failure, _where()), status) if report is not None else None
        if unwritten is not None:  # said once; the exit status still says whether the model is complete
            why = unwritten.strerror or str(unwritten)
            print(f"auto-round-dp: dpq: {refusals.report_not_written(report.path, why, failure is None)}",
                  file=sys.stderr)
    if isinstance(failure, RankFailure) and failure.exit_status != 1 and cancel.cancelled() is not None:
        print(f"auto-round-dp: dpq: {cancel.said()}", file=sys.stderr)  # cancelled here too: the job was cancelled
        return failure.exit_status
    if failure is not None:
        if isinstance(failure, RankFailure) and failure.raised_here is not None:  # the cause, where it happened
            print(f"auto-round-dp: dpq: rank {rank} raised:\n" + "".join(traceback.format_exception(
                failure.raised_here)).rstrip(), file=sys.stderr)
        if isinstance(failure, PlanRefused) and failure.every_rank and rank != 0:  # rank 0 says it, once
            print(f"auto-round-dp: dpq: rank {rank} stops: the refusal rank 0 prints (every rank agreed on it)",
                  file=sys.stderr)
        else:
            print(f"auto-round-dp: {failure}", file=sys.stderr)
        if isinstance(failure, ParallelLaneError):
            print(f"auto-round-dp: {refusals.RUN_STOPPED}", file=sys.stderr)
        return failure.exit_status if isinstance(failure, RankFailure) else 1
    return 0


def _output_dir(rest: list[str]) -> str:
    """auto-round's --output_dir in its arguments ``rest`` (its default where absent or unreadable)."""
    from .args import autoround_args
    from .outputs import DEFAULT_OUTPUT_DIR

    parsed = autoround_args(list(rest))
    return parsed.output_dir if parsed is not None else DEFAULT_OUTPUT_DIR


def main_best() -> int:
    return main(recipe="best")


def main_light() -> int:
    return main(recipe="light")


def main_rtn() -> int:
    return main(recipe="rtn")


def main_opt_rtn() -> int:
    return main(recipe="opt-rtn")


def main_mllm() -> int:
    return main(recipe="mllm")


if __name__ == "__main__":
    raise SystemExit(main())
