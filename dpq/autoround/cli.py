"""``auto-round-dp``: the auto-round CLI, every argument unchanged, plus

  --parallel_quantization {off,auto,N}   tune each block data-parallel (default off)
  --parallel_devices LIST                lane devices, e.g. 0,1,2,3 or cpu,cpu
  --parallel_timeout SECONDS             how long a wait for the lanes' work (and, under torchrun, a
                                         collective) may take (default 600)

Our flags are taken out of argv, ``enable()`` is called, and auto-round's own runner gets the
rest. At the end a per-block summary is printed (world, seconds, exchange bytes).

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
import gc
import os
import sys
from types import MappingProxyType

OUR_HELP = """
dpq (data-parallel tuning) options:
  --parallel_quantization {off,auto,N}
                        tune each block on N lanes (auto: every device that fits; off: plain auto-round).
                        Default: off
  --parallel_devices LIST
                        lane devices, e.g. 0,1,2,3 or cuda:0,cuda:1 or cpu,cpu. Default: the devices of
                        --device_map when it lists several, else every visible device of that type
  --parallel_debug      check after every step that all lanes hold bitwise-identical tuned values
  --parallel_overlap    on GPUs: exchange gradient buckets during the backward, on a second stream per
                        lane (on for CPU lanes anyway; not yet run on a GPU)
  --parallel_report PATH
                        write the per-block records (world, seconds, exchange bytes, per-iteration
                        losses) as JSON
  --parallel_timeout SECONDS
                        how long the host waits for an iteration's work on the lanes before the block
                        is stopped as hung (its NCCL communicators aborted, the block put back; under
                        auto it reruns serially), and under torchrun how long a rank waits in a
                        collective for the others (a hung or lost rank), 10 to 604800; the others
                        wait for rank 0's save as long as it takes (on its heartbeat). Default: 600
"""


# recipe -> auto-round's runner for it (auto_round.__main__, the targets of its console scripts)
RECIPES: MappingProxyType[str | None, str] = MappingProxyType({
    None: "run", "best": "run_best", "light": "run_light", "rtn": "run_rtn", "opt-rtn": "run_opt_rtn",
    "mllm": "run_mllm"})


def runner_for(recipe: str | None):
    """auto-round's CLI runner for ``recipe`` (None: plain ``auto-round``)."""
    import auto_round.__main__ as ar_main

    return getattr(ar_main, RECIPES[recipe])


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--parallel_quantization", default="off")
    p.add_argument("--parallel_devices", default=None)
    p.add_argument("--parallel_debug", action="store_true")
    p.add_argument("--parallel_overlap", action="store_true")
    p.add_argument("--parallel_report", default=None)
    p.add_argument("--parallel_timeout", default="600")
    return p.parse_known_args(argv)


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


TIMEOUT_RANGE_S = (10.0, 604800.0)  # --parallel_timeout: the group's start waits that long for every rank; a week


def format_summary(records) -> str:
    if not records:
        return ""
    lines = ["dpq summary:", f"{'block':<28} {'world':>5} {'seconds':>8} {'exchange MB':>12}  note"]
    for r in records:
        note = "fell back to serial" if r.fell_back else (r.communicator or (r.reasons[0] if r.reasons else ""))
        lines.append(f"{r.name:<28} {r.world:>5} {r.seconds:>8.2f} {r.wire_bytes / 1e6:>12.2f}  {note}")
    total = sum(r.seconds for r in records)
    lines.append(f"{'total':<28} {'':>5} {total:>8.2f} {sum(r.wire_bytes for r in records) / 1e6:>12.2f}")
    return "\n".join(lines)


def asks_for_evaluation(rest: list[str]) -> bool:
    """Whether auto-round's arguments ask it to evaluate after quantizing: ``--tasks``/``--task``
    (with or without a value), or an abbreviation argparse accepts (``--tas``; ``--ta`` is ambiguous)."""
    return any(len(name) >= 5 and "--tasks".startswith(name) for name in (a.partition("=")[0] for a in rest))


def argument_errors(ours: argparse.Namespace, rest: list[str] = ()) -> list[str]:
    """Every problem with our flags (and, under torchrun, auto-round's that dpq cannot serve
    there: ``rest``), found before anything loads."""
    from dpq import refusals
    from dpq.plan import check_arguments

    from .outputs import output_dir_of, path_errors

    problems = [p.removeprefix("dpq: ") for p in check_arguments(ours.parallel_quantization, ours.parallel_devices)]
    off = str(ours.parallel_quantization).strip().lower() == "off"
    if ours.parallel_debug and off:
        problems.append(refusals.DEBUG_WHILE_OFF)
    if ours.parallel_overlap and off:
        problems.append(refusals.OVERLAP_WHILE_OFF)
    if off and torchrun_processes() > 1:
        problems.append(refusals.OFF_UNDER_TORCHRUN)
    if torchrun_processes() > 1 and asks_for_evaluation(list(rest)):
        problems.append(refusals.TASKS_UNDER_TORCHRUN)  # every rank would evaluate the same model
    if torchrun_processes() > 1 and (missing := launcher_missing()):
        problems.append(refusals.world_size_without_launcher(os.environ["WORLD_SIZE"], missing))
    try:
        low, high = TIMEOUT_RANGE_S
        ok = low <= float(ours.parallel_timeout) <= high  # false for nan; inf is out of range
    except ValueError:
        ok = False
    if not ok:
        problems.append(refusals.parallel_timeout_bad(str(ours.parallel_timeout), *TIMEOUT_RANGE_S))
    # only rank 0 writes the output and the report (the others create nothing)
    return problems + (path_errors(ours.parallel_report, output_dir_of(list(rest))) if _rank() == 0 else [])


def main(argv: list[str] | None = None, recipe: str | None = None) -> int:
    """Returns the exit status: 0 when the run finished (the model is complete and in place, even
    if the report could not be written: that is said), 2 for bad dpq arguments or paths the run
    could not write (nothing was loaded, nothing created), 1 when the plan refused, a lane failed,
    a block's issuing thread hung or (torchrun) a rank failed or was lost (the message is printed,
    no traceback; under torchrun the rank whose own error started it prints that error's traceback),
    128 + the signal when the run was cancelled (130 SIGINT, 143 SIGTERM, 129 the launcher gone:
    :mod:`dpq.cancel`). Any other failure propagates (with its traceback; non-zero exit). The
    report (``--parallel_report``, :class:`dpq.autoround.outputs.RunReport`) is written at every
    one of these ends but exit 2, saying how the run ended. Run as the command (``argv`` None:
    the console scripts, ``python -m``), it handles SIGTERM and SIGINT itself
    (:func:`dpq.cancel.install`); called with ``argv`` it leaves the caller's signal handling alone."""
    as_command = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = split_argv(argv)
    problems = argument_errors(ours, rest)
    if problems:
        print("auto-round-dp: error:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    from dpq import cancel
    from dpq.plan import validate_world

    from .outputs import RunReport, error_of

    world = validate_world(ours.parallel_quantization)
    if any(a in ("-h", "--help") for a in rest):
        print(OUR_HELP)
    devices = ours.parallel_devices
    # rank 0 alone writes the report; a thread that ends the process (a cancel, a hung block) writes it too
    report = RunReport(ours.parallel_report, world, devices) if ours.parallel_report and _rank() == 0 else None
    unregister = cancel.on_exit(lambda: report.at_exit(_where)) if report is not None else lambda: None
    if as_command:
        cancel.install(watch_parent=torchrun_processes() > 1)  # a worker does not outlive its launcher
    try:
        if torchrun_processes() == 1:
            return _run(ours, world, devices, recipe, rest, report=report)
        return _run_processes(ours, world, devices, recipe, rest, report)
    except cancel.Cancelled as stopped:
        if report is not None:
            report.write(error_of(stopped, _where()))  # (a no-op when the run wrote it)
        print(f"auto-round-dp: dpq: {cancel.said()}", file=sys.stderr, flush=True)
        return cancel.exit_status(stopped.signum)
    finally:
        unregister()


def _where() -> str:
    """What the run worked on when it ended (:attr:`dpq.autoround.run.Run.at`; "" before it started)."""
    if "dpq.autoround.run" not in sys.modules:
        return ""
    from dpq.autoround.run import reported_run

    run = reported_run()
    return run.at if run is not None else ""


def _stopped_before_run(report, message: str, failure: BaseException) -> None:
    """The run could not start (torchrun's set-up, the job agreement, the patch table): ``message``
    said and, on rank 0, reported with ``failure``."""
    from .outputs import error_of

    print(f"auto-round-dp: {message}", file=sys.stderr)
    if report is not None:
        report.write(error_of(failure))


def _run_processes(ours: argparse.Namespace, world, devices: str | None, recipe: str | None, rest: list[str],
                   report=None) -> int:
    """Under torchrun: this process's lanes, the group, the job agreed by every rank
    (:mod:`dpq.autoround.job`), the run over the group, the group destroyed."""
    from dpq import cancel, refusals
    from dpq.autoround.job import settings
    from dpq.autoround.process_setup import SETUPS, process_lanes, start_group
    from dpq.distributed import JobMismatch, ProcessSet, agree_job, peer_lost
    from dpq.plan import PlanRefused, lane_device_errors
    from dpq.streams import default_accelerator_type

    devices, rest, kind = process_lanes(world, devices, rest, int(os.environ.get("LOCAL_RANK", "0")),
                                        default_accelerator_type())
    if report is not None:
        report.devices = devices
    # before the group's setup binds a device or imports a vendor's backend for it: the plan's refusal
    missing = lane_device_errors(devices) if devices is not None else []
    if missing:
        _stopped_before_run(report, str(PlanRefused(missing)), PlanRefused(missing))
        return 1
    try:
        start_group(kind, float(ours.parallel_timeout), (devices or "").split(",")[0] or None)
    except Exception as err:  # a rank that never came, a store it cannot reach: said, not a traceback
        _stopped_before_run(report, f"dpq: {refusals.group_start_failed(SETUPS[kind].backend, repr(err))}", err)
        return 1
    import torch.distributed as dist

    procs = ProcessSet.detect()  # the job's one set: its reports, its cancel (peers) and every block's run
    procs.timeout_s = float(ours.parallel_timeout)  # also how long the others wait for rank 0's silence in its save
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
        return _run(ours, world, devices, recipe, rest, procs, report)
    finally:
        if dist.is_initialized():  # a failure destroyed it already (dpq.distributed.ProcessSet.stop)
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


def _run(ours: argparse.Namespace, world, devices: str | None, recipe: str | None, rest: list[str],
         procs=None, report=None) -> int:
    import traceback

    from dpq import cancel, refusals
    from dpq.autoround import integration
    from dpq.autoround.patches import PatchMismatch
    from dpq.autoround.run import current_run
    from dpq.autoround.seams_common import ParallelLaneError
    from dpq.distributed import RankFailure, peer_lost
    from dpq.plan import PlanRefused

    from .outputs import error_of

    run, rank = runner_for(recipe), _rank()
    if world != "off":
        try:
            integration.enable(world, devices, debug_identical=ours.parallel_debug,
                               overlap=True if ours.parallel_overlap else None, processes=procs,
                               timeout=float(ours.parallel_timeout))
        except PatchMismatch as e:
            _stopped_before_run(report, str(e), e)
            return 1
    sys.argv = ["auto-round-dp" + (f"-{recipe}" if recipe else ""), *rest]
    if cancel.installed():  # run as the command (main installed cancel handling): the process is ours
        _freeze_imported_heap()
    failure: BaseException | None = None
    try:
        run()
    except (PlanRefused, ParallelLaneError, RankFailure) as e:
        failure = e
    except Exception as e:  # outside a block's run: under several processes the others learn which rank
        cfg = current_run()
        if cfg is None or cfg.processes is None:
            failure = e  # reported, then raised with its traceback (a failed save too: the output is as it was)
            raise
        failure = cfg.processes.stop(e, peer_lost(e))
        failure.__cause__ = e
    except BaseException as e:  # an interrupt, the user's cancel: reported, then raised
        failure = e
        raise
    finally:
        integration.disable()
        _print_summary(world, rank)
        unwritten = report.write(error_of(failure, _where())) if report is not None else None
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
        print(f"auto-round-dp: {failure}", file=sys.stderr)
        if isinstance(failure, ParallelLaneError):
            print(f"auto-round-dp: {refusals.RUN_STOPPED}", file=sys.stderr)
        return failure.exit_status if isinstance(failure, RankFailure) else 1
    return 0


def _print_summary(world, rank: int) -> None:
    """Rank 0: the per-block table and the phase seconds of the run that just ended."""
    from dpq.autoround import integration, seams_common

    records = integration.run_summary() if world != "off" else []
    phases = seams_common.phase_seconds()
    if world != "off" and records and rank == 0:
        print(format_summary(records), flush=True)
    if world != "off" and any(phases.values()) and rank == 0:
        print("dpq phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)


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
