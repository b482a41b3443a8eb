"""The texts of :mod:`dpq.refusals` for several processes (:mod:`dpq.distributed`, auto-round-dp
under torchrun), kept apart only for size: import them from :mod:`dpq.refusals`, which holds
every text (its conventions apply here; ``tests/test_refusals.py`` checks both modules)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "OFF_UNDER_TORCHRUN", "PASS_HOOKS_PROCESSES", "TASKS_UNDER_TORCHRUN", "accelerator_shared", "auto_fewest_lanes",
    "auto_lanes_for_samples", "group_start_failed", "jobs_differ", "parallel_timeout_bad",
    "processes_outnumber_samples", "rank_cancelled", "rank_failure", "rank_raised", "rank_reported_first",
    "rank_store_unreachable", "ranks_drew_other_indices", "ranks_silent", "serial_every_rank", "setting_differs",
    "world_size_without_launcher", "worlds_differ",
]

OFF_UNDER_TORCHRUN = ("--parallel_quantization off under torchrun (WORLD_SIZE > 1) would run the whole job once per "
                      "process, every process writing the same --output_dir. Fix: a world per process "
                      "(--parallel_quantization 1 for one lane each, or auto), or run without torchrun")

# A no-grad pass's reason to run on home alone (the format of refusals.home_alone): sample-ordered
# forwards run over the global lanes (dpq.shard_processes); these do not yet.
PASS_HOOKS_PROCESSES = (
    "several processes (torch.distributed) and this pass merges hook statistics (sums, maxima, ordered sinks), which "
    "have no canonical order across processes yet: every rank runs it on its own home device: this pass runs on home "
    "alone (same result, the same on every rank). Fix: none needed; one process with several lanes shards it")

TASKS_UNDER_TORCHRUN = ("--tasks under torchrun (WORLD_SIZE > 1) would run auto-round's evaluation once per process, "
                        "each on the same model. Fix: drop --tasks here and evaluate the saved model afterwards in one "
                        "process (auto-round --eval --model <output_dir> --tasks ...)")


def parallel_timeout_bad(value: str, low: float = 10, high: float = 604800) -> str:
    return (f"--parallel_timeout {value!r} is not a number of seconds from {low:g} to {high:g} (the process group's "
            "start waits that long for every rank, and a collective for a lost one). Fix: e.g. --parallel_timeout 600 "
            "(how long a rank waits in a collective for the others before the run stops)")


def world_size_without_launcher(world_size: str, missing: Sequence[str]) -> str:
    """``WORLD_SIZE`` > 1 is set but the rest of a launcher's environment is not."""
    return (f"WORLD_SIZE={world_size} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: this "
            "process was not started by torchrun (which sets them all), so it has no process group to join. Fix: unset "
            "WORLD_SIZE to run in one process, or launch the command with torchrun --nproc-per-node N -m "
            "dpq.autoround.cli ...")


def group_start_failed(backend: str, err: str) -> str:
    return (f"the {backend} process group did not start: {err}. Fix: start every rank with the same torchrun "
            "command (one rendezvous endpoint), check that the ranks can reach each other, or a longer "
            "--parallel_timeout when ranks start far apart")


def setting_differs(setting: str, each: str) -> str:
    """A line of :func:`jobs_differ`: ``each``, every rank's value, e.g. "rank 0: 4; rank 1: 5"."""
    return f"{setting} differs ({each})"


def jobs_differ(lines: Sequence[str]) -> str:
    """``lines``: :func:`setting_differs` for each setting the ranks were given differently."""
    return ("dpq: the ranks were given different jobs, so every rank stops before any work:\n"
            + "\n".join(f"  - {line}" for line in lines)
            + "\nFix: run every rank with the same command, model and data (only the devices, --output_dir and the "
            "paths to the same files may differ between ranks)")


def worlds_differ(each: str) -> str:
    """``each``: every rank's requested world, e.g. "rank 0: 2, rank 1: 'auto'"."""
    return f"the ranks asked for different worlds ({each}). Fix: the same --parallel_quantization on every rank"


def accelerator_shared(ranks: Sequence[int], device: str, host: str) -> str:
    return (f"ranks {', '.join(map(str, ranks))} all plan lanes on {device} of {host}: an accelerator belongs to one "
            "process. Fix: give each process its own devices (under torchrun: --parallel_devices cuda:$LOCAL_RANK, "
            "or one device list per process)")


def processes_outnumber_samples(processes: int, lanes: int, samples: int) -> str:
    return (f"{processes} processes x {lanes} lane(s) but only {samples} samples per iteration: every lane needs at "
            "least one sample. Fix: fewer processes or lanes, or a larger --batch_size")


def serial_every_rank(ranks: Sequence[int], why: str) -> str:
    """A note (the agreement's): the block runs serially on every rank."""
    return (f"serial on every rank: rank {', '.join(map(str, ranks))} cannot split this block ({why}). Fix: that "
            "rank's reason names its own fix")


def auto_fewest_lanes(lanes: int, ranks: Sequence[int]) -> str:
    """A note: under 'auto' every process runs the fewest lanes any rank has."""
    return (f"auto: every process runs {lanes} lane{'s' if lanes != 1 else ''}, the fewest any rank has "
            f"(rank {', '.join(map(str, ranks))}). Fix: the same fitting devices on every process, or an explicit "
            "--parallel_quantization N")


def auto_lanes_for_samples(lanes: int, samples: int) -> str:
    """A note: under 'auto' fewer lanes per process so that every lane gets a sample."""
    return (f"auto: {lanes} lane(s) per process so that every lane gets a sample ({samples} per iteration). Fix: a "
            "larger --batch_size for more lanes")


def rank_cancelled(rank: int, cause: str) -> str:
    return f"rank {rank} was cancelled ({cause})"


def rank_raised(rank: int, err: str) -> str:
    return f"the run failed on rank {rank}: {err}"


def rank_store_unreachable(rank: int) -> str:
    return (f"rank {rank} lost contact with another rank and could not reach the store to learn which (the rank "
            "hosting it may be gone)")


def ranks_drew_other_indices(ranks: Sequence[int]) -> str:
    return (f"process rank {', '.join(map(str, ranks))} drew other sample indices than rank 0 this iteration. Fix: "
            "every rank must draw the serial run's indices: the same sampler and seed on every rank, and no "
            "rank-dependent use of the random generators before the tune")


def ranks_silent(ranks: Sequence[int], grace_s: float) -> str:
    return f"rank {', '.join(map(str, ranks))} stopped answering (killed, or hung): no report within {grace_s:g} s"


def rank_reported_first(rank: int, err: str) -> str:
    return f"the run failed; rank {rank} reported first: {err}"


_RANK_FAILURE_FIX = {
    "raised": "the rank that raised printed its error with its traceback (in its own output, above); fix the cause "
              "and rerun the whole job",
    "silent": "find why the named rank stopped (its own output; a process killed for memory, a host gone), then rerun "
              "the whole job",
    "cancelled": "rerun the whole job when it should run",
    "lost": "each rank's own output says what it saw; fix the cause and rerun the whole job",
}


def rank_failure(head: str, rank: int, reports: Sequence[str], kind: str = "raised") -> str:
    """A multi-process run stopped (dpq.distributed.RankFailure). ``head``: one of the texts above
    (:func:`rank_raised` ...), ``rank``: this rank, ``reports``: each rank's report, "rank N raised|lost|cancelled:
    ...", ``kind``: how it started (a key of ``_RANK_FAILURE_FIX``)."""
    return "\n".join([f"dpq: {head}",
                      f"every rank stops (no serial rerun across processes); this is rank {rank}, its home block "
                      "restored, and --output_dir is left as it was (a model is moved into place only once wholly "
                      f"saved). Fix: {_RANK_FAILURE_FIX[kind]}",
                      *(f"  {r}" for r in reports)])
