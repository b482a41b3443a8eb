"""Tune one real block serially (auto-round) and with dpq's engine; print, save and plot the numbers.

    .venv/bin/python -m benchmarks.report                     # CPU lanes: serial, world 1, world 2
    python3 benchmarks/report.py --devices cuda:0,cuda:0       # two lanes on one GPU (separate streams)

One process, one recorded tiny-Llama block, the same iterations for every run. Each
configuration tunes a fresh copy of the block for ``--short-iters`` and for ``--iters``
iterations, ``--rounds`` times each (runs interleaved, medians kept). From the two medians:

- s/iter: the marginal cost of one iteration, (T(iters) - T(short)) / (iters - short)
- fixed: the per-block cost that does not grow with iterations (wrap, mirrors, unwrap, teardown)

Also times every in-process communicator that the lanes allow doing an all_reduce of the
block's tuned fp32 values and of larger buffers. Writes ``OUT/bench_report.json`` and
``OUT/bench_report.png``; prints markdown tables.

On CPU every lane shares the same cores: world 2 on CPU measures the engine's overhead, not a
speedup. Likewise several lanes on one GPU share that GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/report.py` puts benchmarks/ first, not the root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import tune_cases  # noqa: E402

SERIAL = "serial auto-round"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has spent busy since boot (Linux), else None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _command() -> str:
    """How this run was started, as a reader would retype it from the repository root."""
    exe = Path(sys.executable)
    python = os.path.relpath(exe) if exe.is_relative_to(Path.cwd()) else exe.name
    how = "-m benchmarks.report" if __package__ else os.path.relpath(sys.argv[0])
    return " ".join([python, how, *sys.argv[1:]])


def machine_info(devices) -> dict:
    import auto_round

    info = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "auto_round": auto_round.__version__,
        "python": platform.python_version(),
    }
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    if cuda:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in cuda]
    return info


# -- the tune comparison --------------------------------------------------------------------


# (rounds, short iterations, long iterations) tried in order until the timed runs fit the budget:
# the defaults, fewer rounds (medians of 3 at least), then shorter runs (the marginal cost per
# iteration is the same quantity, from a smaller difference)
SIZES = ((5, 10, 40), (3, 10, 40), (3, 10, 30), (3, 5, 20), (3, 4, 12))


def choose_sizes(warm: dict[str, float], warm_iters: int, left_s: float, given: tuple) -> tuple[tuple, float]:
    """(rounds, short, iters) and the planned seconds: the first of SIZES (with the values given on
    the command line kept) whose timed runs fit ``left_s``, priced from each configuration's
    warm-up run of ``warm_iters`` iterations as ``warm x n / warm_iters`` for a run of n
    iterations (an upper bound: the run's fixed part is priced as iterations too)."""
    def planned(rounds, short, iters):
        return sum(rounds * w * (short + iters) / warm_iters for w in warm.values())

    sizes = [tuple(g or d for g, d in zip(given, size, strict=True)) for size in SIZES]
    sizes = [s for s in dict.fromkeys(sizes) if s[1] < s[2]] or [sizes[0]]
    for size in sizes:
        if planned(*size) <= left_s:
            return size, planned(*size)
    return sizes[-1], planned(*sizes[-1])


def tune_comparison(rec, devices, args, deadline: float | None) -> list[dict]:
    """Serial, world 1 .. len(devices): ``args.rounds`` interleaved rounds of a ``args.short_iters``
    and a ``args.iters`` run each. ``deadline`` (``time.perf_counter()`` seconds): the sizes not
    given are chosen after the warm-up so that the runs end by then (:func:`choose_sizes`)."""
    home = devices[0]
    configs = [(SERIAL, None)] + [(f"dpq world {w}", devices[:w]) for w in range(1, len(devices) + 1)]
    extra: dict[str, dict] = {}

    def once(name, lanes, n):
        block = tune_cases.fresh_block(rec, home)
        with tune_cases.iterations(rec, n):
            if lanes is None:
                return tune_cases.timed(lambda: tune_cases.run_serial(rec, block), devices)
            return tune_cases.timed(lambda: tune_cases.run_dpq(rec, block, lanes), devices)

    warm_iters = args.short_iters or SIZES[0][1]
    warm = {name: once(name, lanes, warm_iters)[0] for name, lanes in configs}  # lazy inits, allocator pools
    given = (args.rounds, args.short_iters, args.iters)
    if deadline is None:
        (rounds, short, iters), planned = tuple(g or d for g, d in zip(given, SIZES[0], strict=True)), None
    else:
        (rounds, short, iters), planned = choose_sizes(warm, warm_iters, deadline - time.perf_counter(), given)
    args.rounds, args.short_iters, args.iters = rounds, short, iters
    print(f"warm-up: {', '.join(f'{n} {w:.1f} s' for n, w in warm.items())} at {warm_iters} iterations; "
          f"timing {rounds} rounds of {short} and {iters} iterations"
          + (f" (~{planned:.0f} s planned, sized to --budget-s {args.budget_s:.0f})" if planned is not None else ""),
          file=sys.stderr, flush=True)
    times: dict[str, dict[int, list[float]]] = {name: {short: [], iters: []} for name, _ in configs}
    for r in range(rounds):
        for name, lanes in configs:  # interleaved, so drift on a shared machine hits all alike
            for n in (short, iters):
                seconds, out = once(name, lanes, n)
                times[name][n].append(seconds)
                if lanes is not None and n == iters:
                    extra[name] = {
                        "communicator": out.communicator,
                        "communicator_reason": out.communicator_reason,
                        "wire_bytes_per_iter": out.wire_bytes // iters,
                        "loop_s_per_iter": out.seconds / iters,
                        "best_loss": out.best_loss,
                    }
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    rows = []
    for name, lanes in configs:
        t_short, t_long = (statistics.median(times[name][n]) for n in (short, iters))
        per_iter = (t_long - t_short) / (iters - short)
        rows.append(
            {
                "run": name,
                "lanes": [str(d) for d in lanes] if lanes else [str(home)],
                "world": len(lanes) if lanes else 1,
                "s_per_iter": per_iter,
                "fixed_s_per_block": t_short - short * per_iter,
                "whole_call_s_per_iter": t_long / iters,
                "median_s": {str(short): t_short, str(iters): t_long},
                "all_s": {str(n): times[name][n] for n in (short, iters)},
                **extra.get(name, {"communicator": "-"}),
            }
        )
    serial = rows[0]
    for row in rows:
        row["ratio_vs_serial"] = row["s_per_iter"] / serial["s_per_iter"]
        row["whole_call_ratio_vs_serial"] = row["whole_call_s_per_iter"] / serial["whole_call_s_per_iter"]
        row["round_ratios"] = round_ratios(row["all_s"], serial["all_s"], short, iters)
    return rows


def round_ratios(mine: dict, serial: dict, short: int, iters: int) -> dict:
    """Per interleaved round, this run over serial: marginal ((long - short) over serial's) and
    whole-call (long over serial's long). Their spread is the measurement's noise."""
    s, n = str(short), str(iters)
    marginal = [(ml - ms) / (sl - ss) for ml, ms, sl, ss in zip(mine[n], mine[s], serial[n], serial[s], strict=True)]
    whole = [ml / sl for ml, sl in zip(mine[n], serial[n], strict=True)]
    return {"marginal": marginal, "whole_call": whole}


def ratio_lines(report: dict, goal: float = 1.02) -> list[str]:
    """One line per dpq run: its per-iteration cost over serial auto-round's, marginal and whole-call,
    from the medians, with the range of the per-round ratios; world 1 against the goal (undecided
    when other processes took over 10% of the CPU: a 2% goal is inside that noise)."""
    out = []
    share = report["machine"].get("other_processes_cpu_share")
    for r in report["tune"][1:]:
        rr = r["round_ratios"]
        verdict = ""
        if r["world"] == 1:
            ok = max(r["ratio_vs_serial"], r["whole_call_ratio_vs_serial"]) <= goal
            verdict = f" goal<={goal:.2f}x: {'met' if ok else 'not met'}"
            if share is not None and share > 0.1:
                verdict = f" goal<={goal:.2f}x: undecided (other processes used {share:.0%} of the CPU)"
        out.append(f"ratio world={r['world']} marginal={r['ratio_vs_serial']:.3f}x "
                   f"(rounds {min(rr['marginal']):.3f}-{max(rr['marginal']):.3f}) "
                   f"whole_call={r['whole_call_ratio_vs_serial']:.3f}x "
                   f"(rounds {min(rr['whole_call']):.3f}-{max(rr['whole_call']):.3f}){verdict}")
    return out


def tuned_numel(rec, device) -> int:
    """fp32 elements a full-value exchange sums each iteration: the wrapped block's tuned params."""
    from auto_round.wrapper import wrapper_block

    block = rec.fresh_block().to(device)
    wrapper_block(block, rec.quantizer.enable_minmax_tuning, False, enable_torch_compile=False, device=device)
    return sum(p.numel() for m in block.modules() if hasattr(m, "orig_layer") for p in m.params.values())


# -- communicators ---------------------------------------------------------------------------


def comm_throughput(devices, sizes: list[tuple[str, int]], budget_s: float = 0.3) -> list[dict]:
    from dpq.comm.comm_base import ring_wire_bytes
    from dpq.comm.communicators import COMMUNICATORS
    from dpq.streams import make_lanes

    lanes = make_lanes(devices)
    world = len(lanes)
    rows = []
    for name in ("local", "p2p", "host"):
        try:
            comm = COMMUNICATORS[name](lanes)
        except ValueError as e:
            rows.append({"communicator": name, "skipped": str(e)})
            continue
        for label, numel in sizes:
            bufs = [torch.zeros(numel, device=lane.device) for lane in lanes]  # zeros: repeated sums stay finite

            def sync(lanes=lanes):
                for lane in lanes:
                    lane.synchronize()
                tune_cases.synchronize(devices)

            def batch(reps, comm=comm, bufs=bufs, sync=sync):
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    comm.all_reduce(bufs)
                sync()
                return (time.perf_counter() - t0) / reps

            first = batch(2)  # warm-up and estimate
            reps = max(3, min(200, int(budget_s / max(first, 1e-6))))
            per_call = statistics.median(batch(reps) for _ in range(3))
            nbytes = numel * 4
            rows.append(
                {
                    "communicator": name,
                    "world": world,
                    "size": label,
                    "bytes": nbytes,
                    "s_per_all_reduce": per_call,
                    "algbw_GBps": nbytes / per_call / 1e9,
                    "busbw_GBps": ring_wire_bytes("all_reduce", world, numel, 4) / per_call / 1e9,
                }
            )
            del bufs
        comm.close()
    return rows


# -- output ---------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    s = report["settings"]
    out = [
        f"Tune of one tiny-Llama block ({s['nsamples']} samples x {s['seqlen']} tokens, batch {s['batch_size']}); "
        f"s/iter from {s['short_iters']} vs {s['iters']} iterations, median of {s['rounds']} rounds.",
        "",
        f"| run | lanes | communicator | s/iter | x serial | fixed s/block | s/iter, whole {s['iters']}-iter call "
        "| x serial |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["tune"]:
        out.append(
            f"| {r['run']} | {','.join(r['lanes'])} | {r['communicator']} | {r['s_per_iter']:.4f} "
            f"| {r['ratio_vs_serial']:.2f} | {r['fixed_s_per_block']:.3f} | {r['whole_call_s_per_iter']:.4f} "
            f"| {r['whole_call_ratio_vs_serial']:.2f} |"
        )
    if report.get("comm"):
        out += [
            "",
            "In-process all_reduce (fp32, one buffer per lane; busbw = ring wire bytes / time, as bench_comms.py):",
            "",
            "| communicator | lanes | size | MiB | ms / all_reduce | algbw GB/s | busbw GB/s |",
            "|---|---:|---|---:|---:|---:|---:|",
        ]
        for c in report["comm"]:
            if "skipped" in c:
                out.append(f"| {c['communicator']} | - | - | - | skipped: {c['skipped']} | | |")
                continue
            out.append(
                f"| {c['communicator']} | {c['world']} | {c['size']} | {c['bytes'] / 2**20:.2f} "
                f"| {c['s_per_all_reduce'] * 1e3:.3f} | {c['algbw_GBps']:.2f} | {c['busbw_GBps']:.2f} |"
            )
    return "\n".join(out)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comm = [c for c in report.get("comm", []) if "skipped" not in c]
    fig, axes = plt.subplots(1, 2 if comm else 1, figsize=(13 if comm else 7, 4.8), squeeze=False)
    ax = axes[0][0]
    tune = report["tune"]
    names = [r["run"] for r in tune]
    ms = [r["s_per_iter"] * 1e3 for r in tune]
    bars = ax.bar(names, ms, color=["#777777"] + ["#1f77b4"] * (len(tune) - 1))
    for bar, r in zip(bars, tune, strict=True):
        ax.annotate(
            f"{r['s_per_iter'] * 1e3:.1f} ms\n{r['ratio_vs_serial']:.2f}x serial",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylabel("ms per tune iteration (lower is better)")
    ax.set_ylim(0, max(ms) * 1.25)
    ax.set_title(f"one block, lanes on {report['settings']['devices']}")
    if comm:
        ax = axes[0][1]
        sizes = list(dict.fromkeys(c["size"] for c in comm))
        names = list(dict.fromkeys(c["communicator"] for c in comm))
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            vals = {c["size"]: c["algbw_GBps"] for c in comm if c["communicator"] == name}
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(sizes))]
            ax.bar(xs, [vals.get(s, 0.0) for s in sizes], width, label=name)
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_xlabel("buffer per lane")
        ax.set_ylabel("all_reduce algbw, GB/s (higher is better)")
        ax.set_title(f"in-process all_reduce, {comm[0]['world']} lanes")
        ax.legend()
    m = report["machine"]
    fig.suptitle(f"dpq bench {report['date']} | {m['cpu']}, {m['cpu_count']} cores | torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="cpu,cpu", help="lanes for the largest world, e.g. cpu,cpu or cuda:0,cuda:0")
    p.add_argument("--iters", type=int, default=None, help="long run length (default 40; less to fit --budget-s)")
    p.add_argument("--short-iters", type=int, default=None, help="short run length (default 10; less to fit)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per configuration and length (default 5; 3 to fit --budget-s)")
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="time budget of the run from its start (default 270: within 5 minutes on a 2-core CPU); "
                        "after the warm-up runs the sizes not given are chosen to fit (SIZES); 0: no budget")
    p.add_argument("--nsamples", type=int, default=tune_cases.NSAMPLES)
    p.add_argument("--seqlen", type=int, default=tune_cases.SEQLEN)
    p.add_argument("--batch-size", type=int, default=tune_cases.BATCH_SIZE)
    p.add_argument("--comm-mib", default="1,16,64", help="extra all_reduce sizes in MiB per lane ('' for none)")
    p.add_argument("--no-comm", action="store_true", help="skip the communicator timings")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every run (default: torch's own); 1 keeps a loaded machine's "
                        "OpenMP barriers from dominating both serial and dpq")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out"), help="output folder (default out/)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.iters is not None and args.short_iters is not None and args.iters <= args.short_iters:
        p.error("--iters must be larger than --short-iters")

    from dpq.planning.lane_devices import parse_device_spec

    entries = parse_device_spec(args.devices)
    if errors := [e.error for e in entries if e.error]:
        p.error("--devices: " + "; ".join(errors))
    devices = [e.device for e in entries]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC)
    wall0, mine0, busy0 = time.perf_counter(), time.process_time(), _busy_cpu_seconds()
    machine = machine_info(devices)
    print(f"recording a tiny-Llama block on {devices[0]} ...", file=sys.stderr, flush=True)
    rec = tune_cases.record_block(
        devices[0], iters=args.iters or SIZES[0][2], nsamples=args.nsamples, seqlen=args.seqlen,
        batch_size=args.batch_size
    )
    print("timing serial and dpq runs ...", file=sys.stderr, flush=True)
    # the deadline leaves ~20 s for the communicator timings and the plot
    tune = tune_comparison(rec, devices, args, t0 + args.budget_s - 20 if args.budget_s > 0 else None)
    comm = []
    if not args.no_comm and len(devices) > 1:
        print("timing communicators ...", file=sys.stderr, flush=True)
        numel = tuned_numel(rec, devices[0])
        sizes = [(f"block ({numel * 4 / 2**20:.2f} MiB)", numel)]
        sizes += [(f"{m} MiB", int(m) * 2**20 // 4) for m in args.comm_mib.split(",") if m.strip()]
        comm = comm_throughput(devices, sizes)
    busy1 = _busy_cpu_seconds()
    if busy0 is not None and busy1 is not None:
        # CPU that other processes took while this ran, as a share of all cores: timings on a
        # shared machine are only as good as this is small.
        others = max(0.0, (busy1 - busy0) - (time.process_time() - mine0))
        machine["other_processes_cpu_share"] = others / ((time.perf_counter() - wall0) * (os.cpu_count() or 1))
    report = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": _command(),
        "seconds": (dt.datetime.now(dt.UTC) - started).total_seconds(),
        "machine": machine,
        "settings": {
            "devices": ",".join(map(str, devices)),
            "iters": args.iters,
            "short_iters": args.short_iters,
            "rounds": args.rounds,
            "nsamples": args.nsamples,
            "seqlen": args.seqlen,
            "batch_size": args.batch_size,
        },
        "tune": tune,
        "comm": comm,
    }
    (out / "bench_report.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "bench_report.png")
    print(markdown(report))
    print(f"\nwrote {out / 'bench_report.json'} and {out / 'bench_report.png'} ({report['seconds']:.0f} s)")
    share = machine.get("other_processes_cpu_share")
    if share is not None:
        print(f"other processes used {share:.0%} of the machine's CPU during this run", end="")
        print(": timings are disturbed, rerun on a quiet machine" if share > 0.1 else "")
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n".join(ratio_lines(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
