"""The plan: every step, its time budget (the shell's timeout for it), whether it is core, what it
runs and what it proves. The core steps run first and fit 240 s; everything fits 420 s, so that on a
lent H200 (15 minutes of device time, one or two of them to start the machine) the whole check and a
rerun of its core fit. The budgets are estimates for the H200 (not yet run on one); a dry run on a
CPU gets four times as long (the shell)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu_check import cli, lanes, nccl, paths, price, race, suite, versions

CORE_LIMIT_S, TOTAL_LIMIT_S = 240, 420


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
    Step("versions", 10, True, "torch, CUDA, the card and driver, NCCL, CuPy, auto-round and what it imports; every "
         "carried wheel's requirements against the image's installed versions; a missing wheel stops the run",
         versions),
    Step("paths", 105, True, "Llama-3-8B-shaped bf16 block (hidden 4096, inter 14336, 32/8 heads, seq 2048) on cuda:0, "
         "one lane, auto-round's own tune: compile on/off x batch 8/1: ms per iteration, GPU ms per phase, host ms "
         "and launches per iteration (profiler), compile seconds; the card's matmul and copy ceilings", paths),
    Step("lanes", 75, True, "the same block, compile on: dpq world 1 vs serial (interleaved rounds); world 2 and 4 on "
         "cuda:0,cuda:0,...: replicas identical after every step, host syncs per iteration on every thread (set-up "
         "excluded), lanes' forwards, ms per iteration at W lanes vs 1 lane at the same total batch (reported)", lanes),
    Step("cli", 50, True, "auto-round-dp on the embedded model, compile on: off twice, world 1 (bitwise off), world 1 "
         "and 2 for seeds 42 and 43 (statistical parity), the six runs at once", cli),
    Step("nccl", 35, False, "both NCCL communicators at one rank, every collective x fp32/bf16/uint8; send/recv to "
         "itself; with NCCL >= 2.30 two CuPy ranks on cuda:0 and the watchdog's abort of a hung send", nccl),
    Step("race", 80, False, "tiny Llama block on cuda:0: world 1 bitwise serial; world 2 with producer-stream sleeps "
         "and with --parallel_overlap bitwise the plain run; the watchdog on a busy lane; the CUDA sanitizer on world "
         "2, confirmed by a planted race; local/p2p/host bitwise equal", race),
    Step("suite", 40, False, "the GPU-relevant tests (watchdog, NCCL lifecycle, memory, communication streams, inputs "
         "on another device type)", suite),
    Step("price", 25, False, "world 2 of the 8B-shaped block, eager: home's and the mirror's price vs the allocated "
         "peak", price),
]
STEPS = {s.name: s for s in PLAN}


def budgets(core_only: bool = False) -> tuple[int, int]:
    """(core seconds, total seconds) of the plan's budgets."""
    core = sum(s.budget_s for s in PLAN if s.core)
    return core, core if core_only else sum(s.budget_s for s in PLAN)


def plan_text(core_only: bool = False) -> str:
    core, total = budgets(core_only)
    lines = [f"gpu_check plan (one H200; each step under its own timeout; core first, <= {CORE_LIMIT_S} s; "
             f"all <= {TOTAL_LIMIT_S} s):"]
    for i, s in enumerate(p for p in PLAN if p.core or not core_only):
        lines.append(f"  {chr(97 + i)}) {s.name:<9}{s.budget_s:>4} s {'core' if s.core else 'rest'}  {s.what}")
        if s.proofs:
            lines.append(f"     {'':<18}proves: {'; '.join(s.proofs)}")
    lines.append(f"gpu_check_plan core_s={core} total_s={total}")
    return "\n".join(lines)


def names(core_only: bool = False) -> str:
    """One 'step budget' line per step, for the shell."""
    return "\n".join(f"{s.name} {s.budget_s}" for s in PLAN if s.core or not core_only)
