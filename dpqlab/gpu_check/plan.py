"""The plan: every step, its time budget (the shell's timeout for it), whether it is core, what it
runs and what it proves. The budgets are what the first H200 lease (2026-12-04) measured, with room:
versions 16-25 s cold, paths 69 s, lanes 71 s, cli 75 s (its six compile-on runs at once), nccl 13 s,
race 58-67 s (one sanitized process; now three), suite 48 s of pytest, price 19 s; lanes has 10 s
of cli's room since it profiles one iteration at worlds 1 and 4 too (their GPU busy time beside the
issuing thread's CPU time; the CPU time itself is read in iterations that ran already). The core fits
360 s, everything 655 s: on a lent H200 (15 minutes, one or two of them to start the machine) run
``--core`` and then at once (the machine stays warm 30 s) ``--rest``, each as one device call; what
is left after that reruns named steps (``--only=...``). A dry run on a CPU gets four times as long
(the shell)."""

from __future__ import annotations

from dataclasses import dataclass

from dpqlab.gpu_check import cli, lanes, nccl, paths, price, race, suite, versions

CORE_LIMIT_S, TOTAL_LIMIT_S = 360, 655


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    core: bool
    what: str
    module: object  # its run(args[, partial]) and PROOFS

    @property
    def proofs(self) -> list[str]:
        return list(self.module.PROOFS)


PLAN = [
    Step("versions", 30, True, "torch, CUDA, the card and driver, NCCL, CuPy, auto-round and what it imports; every "
         "carried wheel's requirements against the image's installed versions; a missing wheel stops the run",
         versions),
    Step("paths", 90, True, "Llama-3-8B-shaped bf16 block (hidden 4096, inter 14336, 32/8 heads, seq 2048) on cuda:0, "
         "one lane, auto-round's own tune: compile on/off x batch 8/1: ms per iteration, GPU ms per phase, host ms "
         "and launches per iteration (profiler), compile seconds; the card's matmul and copy ceilings", paths),
    Step("lanes", 100, True, "the same block, compile on: dpq world 1 vs serial (interleaved rounds); world 2 and 4 on "
         "cuda:0,cuda:0,...: replicas identical after every step, host syncs per iteration on every thread (set-up "
         "excluded), lanes' forwards, ms per iteration at W lanes vs 1 lane at the same total batch (reported); at "
         "worlds 1, 2 and 4 the issuing thread's own CPU time per iteration (time.thread_time, unprofiled) beside "
         "the wall and the GPU's busy time", lanes),
    Step("cli", 140, True, "auto-round-dp on the embedded model, compile on: off twice, world 1 (bitwise off), world 1 "
         "and 2 for seeds 42 and 43 (statistical parity), the six runs at once", cli),
    Step("nccl", 25, False, "both NCCL communicators at one rank, every collective x fp32/bf16/uint8; send/recv to "
         "itself; with NCCL >= 2.30 two CuPy ranks on cuda:0 and the watchdog's abort of a hung send", nccl),
    Step("race", 150, False, "tiny Llama block on cuda:0: world 1 bitwise serial; world 2 with producer-stream sleeps "
         "and with --parallel_overlap bitwise the plain run; the watchdog on a busy lane; the CUDA sanitizer on world "
         "2, confirmed by a planted race; local/p2p/host bitwise equal", race),
    Step("suite", 90, False, "the GPU-relevant tests (watchdog, NCCL lifecycle, memory, communication streams, inputs "
         "on another device type)", suite),
    Step("price", 30, False, "world 2 of the 8B-shaped block, eager: home's and the mirror's price vs the allocated "
         "peak", price),
]
STEPS = {s.name: s for s in PLAN}


PARTS = ("all", "core", "rest")


def chosen(part: str = "all") -> list[Step]:
    """The steps of one part of the plan: "all", "core", "rest" (what a --core run left), or step names
    joined by commas (a rerun of those). Every part but "all" and "core" starts with the versions step:
    it installs nothing, but checks the wheels every later step imports."""
    if part in ("all", "core"):
        return [s for s in PLAN if part == "all" or s.core]
    names = {s.name for s in PLAN if not s.core} if part == "rest" else set(part.split(","))
    unknown = names - set(STEPS)
    if unknown:
        raise ValueError(f"part {part!r}: {sorted(unknown)} are not steps; one of {PARTS}, or names of {sorted(STEPS)}")
    if part == "rest":
        return [s for s in PLAN if s.name in names or s.name == "versions"]
    return [STEPS["versions"], *(STEPS[n] for n in dict.fromkeys(part.split(",")) if n != "versions")]  # as named


def budgets(part: str = "all") -> tuple[int, int]:
    """(core seconds, total seconds) of the chosen part's budgets."""
    steps = chosen(part)
    return sum(s.budget_s for s in steps if s.core), sum(s.budget_s for s in steps)


def plan_text(part: str = "all") -> str:
    core, total = budgets(part)
    lines = [f"gpu_check plan (one H200; each step under its own timeout; core first, <= {CORE_LIMIT_S} s; "
             f"all <= {TOTAL_LIMIT_S} s):"]
    for i, s in enumerate(chosen(part)):
        lines.append(f"  {chr(97 + i)}) {s.name:<9}{s.budget_s:>4} s {'core' if s.core else 'rest'}  {s.what}")
        if s.proofs:
            lines.append(f"     {'':<18}proves: {'; '.join(s.proofs)}")
    lines.append(f"gpu_check_plan core_s={core} total_s={total}")
    return "\n".join(lines)


def names(part: str = "all") -> str:
    """One 'step budget' line per step, for the shell."""
    return "\n".join(f"{s.name} {s.budget_s}" for s in chosen(part))
