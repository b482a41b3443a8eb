"""Issue 29: ``auto-round-dp --parallel_plan`` and ``dpq.plan_for``: what this machine would get,
per world, from the model's config alone, without tuning anything."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import dpq
from dpq.demo.embedded import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]


def test_the_plan_command_prints_every_world_from_the_config_alone(tmp_path):
    """The issue's command, in its own process: the per-world table, auto's choice, the timeline
    model's state, exit 0, well under 20 s on 2 cores; a weight read would raise, nothing is written."""
    prelude = ("import safetensors, safetensors.torch\n"
               "def read(*a, **k): raise SystemExit('a model weight was read')\n"
               "safetensors.safe_open = safetensors.torch.load_file = read\n")
    code = prelude + "from dpq.autoround.cli import main; raise SystemExit(main())"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, "--parallel_plan", "--model", str(DATA_DIR), "--device_map",
                           "cpu", "--parallel_devices", "cpu,cpu"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "its config only, no weights read" in out and "4 blocks like model.layers.0 (LlamaDecoderLayer)" in out
    rows = [(line.split()[:2], line.rsplit("  ", 1)[-1]) for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [(*r, runs) for r, runs in rows] == [("1", "cpu", "yes"), ("2", "cpu,cpu", "yes, no speedup")], out
    # issue 42, item 6: the table itself says lanes sharing the CPU give no speedup (its row priced so), and
    # auto's choice says it too
    assert "       - no speedup: these lanes share one CPU" in out
    assert "auto would choose world 2: auto: every fitting lane runs (2), no speedup: these lanes share one CPU" in out
    stored = sorted((ROOT / "benchmarks" / "calibration").glob("*.json"))
    if stored:  # a GPU check's calibration is named, the newest given to the model's command
        assert f"timeline model: calibrations {', '.join(p.name for p in stored)}: python -m benchmarks.timeline " \
               f"--table --calibration {stored[-1]}" in out, out
    else:
        assert "timeline model: no calibration exists" in out
    assert list(tmp_path.iterdir()) == []
    assert seconds < 20, seconds


def test_plan_for_prices_each_lane_and_says_what_does_not_fit():
    screen = dpq.plan_for(str(DATA_DIR), parallel_devices="cpu,cpu,cpu", home="cpu", iters=10, batch_size=2,
                          nsamples=2, seqlen=64)
    assert [r.world for r in screen.rows] == [1, 2, 3] and [len(r.prices) for r in screen.rows] == [1, 2, 3]
    assert not screen.rows[1].refused and any("3 lanes but only 2 samples" in x for x in screen.rows[2].refused)
    assert all(p.need > 0 and p.free > 0 for r in screen.rows for p in r.prices)
    assert screen.rows[1].per_block_s == screen.rows[1].per_iter_s * 10 and screen.choice == 2
    assert "3 lanes but only 2 samples" in str(screen)
    # Note [one bucket where it fits]: the screen says the plan's bucket layout for each world that runs
    assert screen.rows[0].buckets == "" and "whole block" in screen.rows[1].buckets
    assert f"- {screen.rows[1].buckets}" in str(screen)
    # issue 42, item 6: lanes sharing one CPU were priced at 1/W of one lane's compute (world 2 at half world
    # 1's seconds), while they take turns on its cores (README: measured slower than serial)
    assert all(r.per_iter_s >= screen.rows[0].per_iter_s for r in screen.rows[1:]), [r.per_iter_s for r in screen.rows]
    assert "no speedup: these lanes share one CPU" in screen.rows[1].shared and screen.rows[0].shared == ""
    asked = dpq.plan_for(str(DATA_DIR), parallel_quantization=3, parallel_devices="cpu,cpu,cpu", home="cpu",
                         iters=10, batch_size=2, nsamples=2, seqlen=64)
    assert asked.choice == 3 and "refused" in asked.why


def test_the_screen_says_the_overlap_choice():
    """The plan's overlap choice and its reason per world that runs (auto says nothing on CPU lanes, which
    exchange during the backward anyway)."""
    auto = dpq.plan_for(str(DATA_DIR), parallel_devices="cpu,cpu", home="cpu", iters=10, batch_size=2,
                        nsamples=2, seqlen=64)
    assert [r.overlap for r in auto.rows] == ["", ""]
    off = dpq.plan_for(str(DATA_DIR), parallel_devices="cpu,cpu", home="cpu", iters=10, batch_size=2, nsamples=2,
                       seqlen=64, parallel_overlap="off")
    assert off.rows[1].overlap == "--parallel_overlap off" and "- --parallel_overlap off" in str(off)


def test_the_screen_shows_the_runs_own_lanes_and_stays_small():
    """Issue 42's sweep, M1 and M9: for an explicit world on the CPU without --parallel_devices the screen
    showed one lane and "auto would choose world 2: asked for, but refused (above)" with nothing above,
    while the run took world 2; and 300 listed lanes took 31 s (20 000: out of memory), a row per world.
    The screen now shows the run's own default lanes, says the run takes the world asked, and prices the
    worlds up to the samples per iteration (one refused row past them)."""
    import time

    screen = dpq.plan_for(str(DATA_DIR), parallel_quantization=2, home="cpu", iters=10, batch_size=2, nsamples=2,
                          seqlen=64)
    assert [(r.world, r.refused) for r in screen.rows] == [(1, []), (2, [])], screen.rows
    assert screen.choice == 2 and "the run takes world 2: asked for (--parallel_quantization); it fits" in str(screen)
    t0 = time.perf_counter()
    many = dpq.plan_for(str(DATA_DIR), parallel_devices=",".join(["cpu"] * 2000), home="cpu", iters=10, batch_size=2,
                        nsamples=2, seqlen=64)
    assert [r.world for r in many.rows] == [1, 2, 3] and "2 samples" in many.rows[2].refused[0]
    assert time.perf_counter() - t0 < 30 and len(str(many)) < 10_000
