"""What auto-round-dp writes besides the model: where it may write (checked before any work) and
its report (written at every end of a run, schema :data:`SCHEMA`).

:func:`path_errors` checks ``--output_dir`` and ``--parallel_report`` when the arguments are
parsed, on the rank that writes them, and creates, changes and deletes nothing: a path with a
file where a folder must be, a place this user cannot write, an ``--output_dir`` that is an
existing file, a report where the save writes (in the model's folder inside ``--output_dir``, or
under a model file's name in it: the save would overwrite it, or it one of the model's files, e.g.
``config.json``). Symlinks are followed: a report path that is a symlink (even
to a file not there yet) is written at its target, the link left as it is.

:class:`RunReport` writes the report once, whatever ended the run: success, a failure (its
``error``: kind, where, block, lane, message; :func:`error_of`), a lost rank, the user's cancel, a
hung issuing thread. Besides the run's records it says what ran and how it ended: ``schema``, the
versions of dpq, auto-round, torch and Python, the devices and their names, the command line, the
start and end time (UTC, ISO 8601) and the exit status (:func:`exit_status_of`). The main thread
writes it as the run unwinds; a thread that ends the process instead (the cancel watcher, the
iteration watchdog: :func:`dpq.cancel.end_process`) writes it through :meth:`RunReport.at_exit`,
registered with :func:`dpq.cancel.on_exit`. A regular file is replaced whole (written beside, then
``os.replace``), so a report is never half-written; a device (``/dev/null``, ``/dev/full``) is written
in place; a pipe is refused before the run (writing it would wait for a reader).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from dpq import cancel, refusals
from dpq.staging import WEIGHT_SUFFIXES

__all__ = ["DEFAULT_OUTPUT_DIR", "SCHEMA", "RunInput", "RunReport", "error_of", "exit_status_of", "path_errors",
           "report_header", "run_inputs", "run_records", "versions", "write_whole"]

DEFAULT_OUTPUT_DIR = "./tmp_autoround"  # auto-round's --output_dir default (tests/test_cli.py checks it)
SCHEMA = "dpq-report/1"  # the report's keys (RunReport.write); bumped when a key changes meaning or goes


# files a save may write straight into --output_dir (a diffusion pipeline, a gguf file); the weights by suffix
_MODEL_FILES = frozenset({"config.json", "quantization_config.json", "generation_config.json", "model_index.json",
                          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})


def _where_the_model_goes(report: Path, output: Path) -> bool:
    """Whether the report at ``report`` (a real path) would be where the save writes: ``output`` itself,
    inside one of its folders (auto-round's model folder, ``<model>-w4g128``), or directly in it under
    a model file's name. A report of another name directly in ``output`` is the user's choice: a
    rerun keeps it (dpq.staging merges)."""
    if report == output or output in report.parent.parents:
        return True
    return report.parent == output and (report.name in _MODEL_FILES or report.name.endswith(WEIGHT_SUFFIXES))


def _can_create_in(folder: Path) -> bool:
    """Whether this process can create a file in ``folder``, by creating one and removing it at once.
    ``os.access`` is not enough: as root it says yes for places where creating fails (``/proc``, a
    read-only mount)."""
    try:
        times = os.stat(folder)
        fd, probe = tempfile.mkstemp(prefix=".dpq-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    with contextlib.suppress(OSError):  # the folder's times as they were: the check changes nothing
        os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))
    return True


def _place_error(flag: str, path: str) -> str | None:
    """Why nothing can be made at ``path`` (its folder need not exist): a file on its way where a
    folder must be, or the nearest existing folder where this process cannot create a file. None:
    it can."""
    parent = Path(os.path.realpath(path)).parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return refusals.not_a_folder(flag, path, str(parent))
    if not _can_create_in(parent):
        return refusals.place_unwritable(flag, path, str(parent))
    return None


def _report_errors(path: str, output_dir: str, inputs: Sequence[RunInput]) -> list[str]:
    if not path.strip():
        return [refusals.REPORT_PATH_EMPTY]
    if path.endswith(os.sep):  # a folder's path: the report would become a file of the folder's name
        return [refusals.report_is_dir(path, str(Path(path) / "dpq_report.json"))]
    real = Path(os.path.realpath(path))
    if real.is_dir():
        return [refusals.report_is_dir(path, str(Path(path) / "dpq_report.json"))]
    if _where_the_model_goes(real, Path(os.path.realpath(output_dir))):
        return [refusals.report_in_output(path, output_dir)]
    if (read := _input_at(real, inputs)) is not None:
        return [refusals.report_is_input(path, read.flag, read.value, output_dir)]
    if real.is_fifo() or real.is_socket():  # writing it would wait, after the model is saved, for a reader
        return [refusals.report_is_pipe(path)]
    if real.exists() and not real.is_file():  # a device (/dev/null): written in place (write_whole)
        return [] if os.access(real, os.W_OK) else [refusals.place_unwritable("--parallel_report", path, str(real))]
    if real.is_file() and not _replaceable(real):
        return [refusals.report_would_replace(path, output_dir)]
    problem = _place_error("--parallel_report", path)  # a regular file is replaced by one made beside it
    return [problem] if problem else []


_REPORT_SIZE_MAX = 1 << 26  # no report of a run comes near 64 MiB: a larger file is something else


def _replaceable(real: Path) -> bool:
    """An existing file the report may replace: an empty one (a user's ``touch``) or an earlier dpq report
    (a JSON object whose ``schema`` is dpq's); anything else is somebody's file, and a typo in the path
    must not cost it."""
    try:
        size = real.stat().st_size
        if size == 0:
            return True
        if size > _REPORT_SIZE_MAX:
            return False
        data = json.loads(real.read_bytes())
    except (OSError, ValueError):  # unreadable, or not JSON: not a report
        return False
    return isinstance(data, dict) and str(data.get("schema", "")).startswith(SCHEMA.split("/")[0] + "/")


def _output_errors(output_dir: str) -> list[str]:
    if not output_dir.strip():  # auto-round would save into the working directory, staged in its parent
        return [refusals.OUTPUT_DIR_EMPTY]
    real = Path(os.path.realpath(output_dir))
    if real.exists() and not real.is_dir():
        return [refusals.output_is_file(output_dir)]
    if real.is_dir():  # the save's commit moves what it wrote into this folder
        return [] if _can_create_in(real) else [refusals.place_unwritable("--output_dir", output_dir, str(real))]
    problem = _place_error("--output_dir", output_dir)
    return [problem] if problem else []


def path_errors(report: str | None, output_dir: str, inputs: Sequence[RunInput] = ()) -> list[str]:
    """Every problem with the paths the run will write (module docstring), ``inputs`` the local paths
    it reads (:func:`run_inputs`); nothing is left changed (a place is probed by creating a file in it
    and removing it at once)."""
    return _output_errors(output_dir) + (_report_errors(report, output_dir, inputs) if report is not None else [])


@dataclass(frozen=True)
class RunInput:
    """A local path the run reads: ``flag`` and ``value`` as given (what a refusal names), ``real``
    its real path (symlinks resolved), ``files`` the real path of every file under it when it is a
    folder (a model folder's files may be symlinks elsewhere: the Hugging Face cache's blobs)."""

    flag: str
    value: str
    real: Path
    files: frozenset[Path] = frozenset()


# auto-round's options whose value is a path the run reads, besides --model and --dataset (their dests)
_INPUT_DESTS = ("extra_data_dir", "prompt_file", "template")
_OUTPUT_DESTS = frozenset({"output_dir", "image_save_dir"})


def run_inputs(args: argparse.Namespace | None) -> list[RunInput]:
    """The local paths a run of auto-round's arguments ``args`` reads: the model (a local folder, or a
    hub id's folder in the Hugging Face cache), every local ``--dataset`` entry (auto-round's
    ``name:options,name2`` form), the options that name files (:data:`_INPUT_DESTS`) and any other
    option whose value is an existing path with a folder in it."""
    if args is None:
        return []
    from .job import dataset_entries

    found: list[tuple[str, str]] = []
    model = getattr(args, "model", None) or getattr(args, "model_name", None)
    if model:
        found.append(("--model", model))
        found += [("--model", str(cached)) for cached in _hub_cache_folders(model, "models")]
    for entry in dataset_entries(getattr(args, "dataset", None)):
        found.append(("--dataset", entry))
        found += [("--dataset", str(cached)) for cached in _hub_cache_folders(entry, "datasets")]
    for dest, value in sorted(vars(args).items()):
        if dest in ("model", "model_name", "dataset") or dest in _OUTPUT_DESTS or not isinstance(value, str):
            continue
        if dest in _INPUT_DESTS or os.sep in value:
            found.append((f"--{dest}", value))
    return [_input(flag, value) for flag, value in dict.fromkeys(found) if value and os.path.exists(value)]


def missing_inputs(args: argparse.Namespace | None) -> list[str]:
    """``--model`` and ``--dataset`` entries written as local paths (absolute, or starting with ``.`` or
    ``~``: a hub id never does) where nothing is: auto-round would take them for hub ids and fail with
    a traceback about repository names, or load the model first and then say the dataset is unknown."""
    if args is None:
        return []
    from dpq import refusals

    from .job import dataset_entries

    model = getattr(args, "model", None) or getattr(args, "model_name", None)
    named = [("--model", model)] if isinstance(model, str) else []
    named += [("--dataset", entry) for entry in dataset_entries(getattr(args, "dataset", None))]
    return [refusals.input_missing(flag, value) for flag, value in named
            if value.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(value))]


def _hub_cache_folders(name: str, kind: str) -> list[Path]:
    """The Hugging Face cache's folder of a hub id (``org/name``), where one exists: the files a
    hub model or dataset is read from (``snapshots/`` links into ``blobs/``). Read off the cache's
    layout, no network."""
    if os.path.exists(name) or name.count("/") != 1:
        return []
    try:
        from huggingface_hub import constants
    except ImportError:
        return []
    folder = Path(constants.HF_HUB_CACHE) / f"{kind}--{name.replace('/', '--')}"
    return [folder] if folder.is_dir() else []


def _input(flag: str, value: str) -> RunInput:
    real = Path(os.path.realpath(value))
    files = frozenset(Path(os.path.realpath(p)) for p in real.rglob("*") if p.is_file()) if real.is_dir() else \
        frozenset()
    return RunInput(flag, value, real, files)


def _input_at(real: Path, inputs: Sequence[RunInput]) -> RunInput | None:
    """The input that a file written at ``real`` (a real path) would replace or land inside, if any."""
    for read in inputs:
        if real == read.real or read.real in real.parents or real in read.files:
            return read
    return None


def error_of(failure: BaseException | None, at: str = "") -> dict | None:
    """The report's ``error`` for what ended the run (None: it finished): ``kind`` (refused,
    lane_failed, save_failed, rank_failed, rank_lost, cancelled, error), ``where`` (the block, "save",
    or None when not known), ``block`` (the block it stopped in, None outside one), ``lane`` (the lane
    that failed when one is known, else None) and ``message``."""
    from dpq.planning.distributed import RankFailure
    from dpq.planning.plan import PlanRefused

    from .ranks import SaveFailed
    from .seams_common import ParallelLaneError

    if failure is None:
        return None
    where = at or None
    signum = cancel.cancelled() or getattr(failure, "signum", None)
    if isinstance(failure, KeyboardInterrupt) and signum is not None:  # the user's cancel (dpq.cancel)
        kind, message = "cancelled", refusals.cancelled(cancel.what(signum))
    elif isinstance(failure, PlanRefused):
        kind, message = "refused", str(failure)
    elif isinstance(failure, ParallelLaneError):
        kind, message, where = "lane_failed", str(failure), failure.block or where
    elif isinstance(failure, SaveFailed):
        kind, message, where = "save_failed", str(failure), "save"
    elif isinstance(failure, RankFailure):
        kind = {"raised": "rank_failed", "cancelled": "cancelled"}.get(failure.kind, "rank_lost")
        message = str(failure)
    else:
        kind, message = "error", f"{type(failure).__name__}: {failure}"
    return structured(kind, message, where, getattr(failure, "lane", None))


def structured(kind: str, message: str, where: str | None = None, lane: int | None = None) -> dict:
    """One ``error`` entry; ``block`` is ``where`` unless that is the save (or unknown)."""
    return {"kind": kind, "where": where, "block": where if where not in (None, "save") else None, "lane": lane,
            "message": message}


def exit_status_of(failure: BaseException | None) -> int:
    """The exit status auto-round-dp ends with after ``failure`` (None: 0): a cancel 128 + its signal,
    a failed rank its own status, anything else 1."""
    from dpq.planning.distributed import RankFailure

    if failure is None:
        return 0
    signum = cancel.cancelled() or getattr(failure, "signum", None)
    if isinstance(failure, KeyboardInterrupt | cancel.Cancelled) and signum is not None:
        return cancel.exit_status(signum)
    return failure.exit_status if isinstance(failure, RankFailure) else 1


def run_records() -> tuple[list, dict, list]:
    """The current (or last) run's block records, phase seconds and ``auto``'s report, as they stand."""
    from . import integration, seams_common

    return integration.run_summary(), seams_common.phase_seconds(), integration.auto_world_report()


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """The software that ran: dpq (this distribution, or the source tree's version), auto-round (either
    of its distributions), torch and Python."""
    import dpq

    return {"dpq": _version("auto-round-dp") or dpq.__version__,
            "auto_round": _version("auto-round", "auto-round-nightly"),
            "torch": _version("torch"), "python": sys.version.split()[0]}


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def report_header(command: list[str], started: float, ended: float, exit_status: int, devices: object) -> dict:
    """The keys every dpq report starts with (the run's and the demo's): ``schema``, ``versions``,
    ``devices`` (as given) and ``device_names``, ``command``, ``started``/``ended`` (UTC) with
    ``wall_s``, ``exit_status``. ``started``/``ended``: :func:`time.time` values."""
    from dpq.planning.machine import device_names

    return {"schema": SCHEMA, "versions": versions(), "devices": devices, "device_names": device_names(devices),
            "command": list(command), "started": _utc(started), "ended": _utc(ended),
            "wall_s": round(ended - started, 3), "exit_status": exit_status}


class RunReport:
    """``--parallel_report``: written once per run (module docstring). ``world``/``devices``: as
    given; ``command``: the command line; ``records``: a callable returning (block records, phase
    seconds, auto's report) as they stand when the report is written (:func:`run_records`)."""

    def __init__(self, path: str, world, devices, command: list[str] = (), records=run_records) -> None:
        self.path, self.world, self.devices, self.records = path, world, devices, records
        self.command, self.started = list(command), time.time()
        self._lock = threading.Lock()
        self.written = False

    def write(self, error: dict | None, exit_status: int = 0) -> OSError | None:
        """Write the report with ``error`` (None: the run finished) and the ``exit_status`` the command
        ends with, unless it was written already; returns the error that stopped the write (None: written)."""
        with self._lock:
            if self.written:
                return None
            self.written = True
            blocks, phases, auto_world = self.records()
            body = report_header(self.command, self.started, time.time(), exit_status, self.devices)
            body.update({"world": self.world, "phase_seconds": phases, "blocks": [asdict(r) for r in blocks],
                         "auto_world": auto_world, "error": error})
            try:
                write_whole(self.path, json.dumps(body, indent=1))
            except OSError as err:
                return err
            return None

    def at_exit(self, at=lambda: "") -> None:
        """A thread ends the process (:func:`dpq.cancel.end_process`): the report says why
        (:func:`dpq.cancel.ending`). ``at``: where the run was (a callable: read at that moment)."""
        kind, message = cancel.ending() or ("cancelled", "")
        signum = cancel.cancelled()
        status = cancel.exit_status(signum) if kind == "cancelled" and signum is not None else 1
        self.write(structured(kind, message.removeprefix("dpq: "), at() or None), status)


def write_whole(path: str, text: str) -> None:
    """``text`` into the file at ``path`` (its symlinks followed): a regular file replaced whole, in
    one rename; anything else (a device, a pipe) written in place. Missing folders are made."""
    real = Path(os.path.realpath(path))
    if real.exists() and not real.is_file():  # never waits: a pipe with no reader is an error (ENXIO), said
        fd = os.open(real, os.O_WRONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        return
    real.parent.mkdir(parents=True, exist_ok=True)
    partial = real.with_name(f".{real.name}.dpq-{uuid.uuid4().hex[:8]}")
    try:
        partial.write_text(text)
        os.replace(partial, real)
    finally:
        partial.unlink(missing_ok=True)
