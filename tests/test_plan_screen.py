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
    """The plan's overlap choice and its reason per world that runs (auto on CPU lanes: the exchange during
    the backward on the issuing thread, said; world 1 has no exchange to speak of)."""
    from dpq.planning.plan import HOST_LANES_OVERLAP

    auto = dpq.plan_for(str(DATA_DIR), parallel_devices="cpu,cpu", home="cpu", iters=10, batch_size=2,
                        nsamples=2, seqlen=64)
    assert [r.overlap for r in auto.rows] == ["", HOST_LANES_OVERLAP]
    assert f"- {HOST_LANES_OVERLAP}" in str(auto)
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


def fake_h100s(monkeypatch, count: int = 8) -> None:
    """A machine preset of ``count`` H100s (80 GB each, every pair peer-capable) on a fake cuda backend."""
    import dpq.planning.lane_devices as lane_devices
    import dpq.streams as dpq_streams
    from dpq.autoround import plan_screen
    from dpq.planning.machine import Machine

    class Gpus(dpq_streams.Backend):
        type, accelerator, has_streams = "cuda", True, True

        def is_available(self):
            return True

        def device_count(self):
            return count

        def mem_get_info(self, device):
            return 79 * 2**30, 80 * 2**30

        def can_access_peer(self, a, b):
            return True

    monkeypatch.setitem(dpq_streams._BACKENDS, "cuda", Gpus())
    monkeypatch.setattr(lane_devices, "check_device_exists", lambda d: None)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: Machine("2.13.0+cu128", frozenset({"cuda"}),
                                                                           {"cuda": count}, nvidia_driver=True)))
    monkeypatch.setattr(plan_screen, "_link", lambda lanes: (20e-6, 370e9, "NVLink (preset)"))
    monkeypatch.setattr("dpq.planning.machine.device_names",
                        lambda devices: dict.fromkeys(devices, "NVIDIA H100 80GB HBM3"))


def test_the_screen_offers_torchrun_where_one_process_per_lane_is_faster(monkeypatch):
    """Note [P processes x 1 lane on the screen]: on 8 H100s the screen prices 8 processes x 1 lane beside one
    process of 8 lanes and, predicted faster by more than 10% (each process issues only its own lane), gives
    the torchrun command that gets it: the command's own arguments, one lane per process."""
    from dpq.autoround.plan_screen import SPREAD_GAIN, torchrun_command
    from dpq.planning.cost_model import GPU_ISSUE_S_PER_LANE_ITERATION

    fake_h100s(monkeypatch)
    argv = ["--model", str(DATA_DIR), "--parallel_quantization", "auto", "--parallel_plan", "--iters", "10"]
    screen = dpq.plan_for(str(DATA_DIR), parallel_devices=",".join(f"cuda:{i}" for i in range(8)), home="cuda:0",
                          iters=10, batch_size=8, nsamples=8, seqlen=64, argv=argv)
    out = str(screen)
    assert "8 processes x 1 lane (torchrun)" in out and "1 process x 8 lanes" in out, out
    # the tiny block's compute is far below 8 lanes' issuing: one process is issue-bound, 8 are not
    assert f"{GPU_ISSUE_S_PER_LANE_ITERATION * 1e3:.3g} ms per lane-iteration" in out
    command = torchrun_command(8, argv)
    assert command == (f"torchrun --nproc-per-node 8 -m dpq.autoround.cli --model {DATA_DIR} --iters 10 "
                       "--parallel_quantization 1")
    assert f"faster predicted; run it as: {command}" in out
    # where compute hides the issuing (a block 1000 x slower per lane), no command is offered
    import torch

    from dpq.autoround import plan_screen

    costs = plan_screen.CostInputs(compute_s=8 * 1000 * GPU_ISSUE_S_PER_LANE_ITERATION, issue_s=0.0, tuned_elems=1,
                                   bandwidth_Bps=370e9)
    lines = plan_screen.spread_lines(screen.rows, [torch.device("cuda", i) for i in range(8)], 10, costs, argv)
    assert "8 processes x 1 lane" in lines[1] and all("torchrun --nproc" not in x for x in lines)
    assert SPREAD_GAIN == 1.10
