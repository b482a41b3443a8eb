"""auto-round-dp under torchrun (issue 11): P processes x L lanes through the CLI, on the embedded
model, with gloo on this CPU host.

Every run is a subprocess with one intra-op thread (torchrun sets 1 per process; the one-process
runs get OMP_NUM_THREADS=1 too: CPU kernels may round differently with another thread count),
so that saved tensors compare bitwise. The runs are made once per module (:func:`runs`) and
shared by the assertions; two at a time (two cores).

* world 2 as 1x2 (one process, two lanes) and 2x1 (torchrun, one lane each: the issue's
  command), world 4 as 1x4 and 2x2 (4x1 of the same engine: tests/test_distributed.py):
  bitwise-identical saved tensors per world;
* world 1 through torchrun (one process: no group) equals ``off``;
* only rank 0 writes (each rank of the 2x1 run is given its own --output_dir through a shell:
  rank 1's does not exist);
* a killed rank (``DPQ_TEST_FAULT``, applied by tests/site_hooks): the other rank exits
  non-zero within the timeout, naming it, and no rank leaves a complete-looking output folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dpq import refusals
from dpq.autoround import cli
from dpq.autoround.args import split_argv
from dpq.planning.spec import TIMEOUT_RANGE_S
from tests.test_shard import _saved as _state  # every saved tensor under a folder

pytestmark = pytest.mark.torchrun_cli  # its own .ci/run stage (pyproject's markers)

ITERS, NSAMPLES, BATCH, SEQLEN = "4", "8", "4", "32"  # lr 0.02 below: every block keeps a tuned iteration
TIMEOUT_S = "60"  # --parallel_timeout of the multi-process runs


def _args(tmp: Path, out: str, *extra: str) -> list[str]:
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    calib = tmp / "calib.jsonl"
    if not calib.exists():
        calibration_jsonl(calib, 16, int(SEQLEN))
    return ["--model", str(DATA_DIR), "--dataset", str(calib), "--iters", ITERS, "--nsamples", NSAMPLES,
            "--seqlen", SEQLEN, "--batch_size", BATCH, "--device_map", "cpu", "--disable_torch_compile",
            "--lr", "0.02", "--output_dir", out, *extra]


def _one_sample(tmp: Path) -> Path:
    from dpq.demo.embedded import calibration_jsonl

    calib = tmp / "calib1.jsonl"
    if not calib.exists():
        calibration_jsonl(calib, 1, int(SEQLEN))
    return calib


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def _cmd(tmp: Path, name: str, nproc: int | None, *extra: str, per_rank_dir: bool = False) -> list[str]:
    """One run: ``nproc`` None: plain ``python -m dpq.autoround.cli``; else under torchrun.
    ``per_rank_dir``: each rank writes (if it writes at all) to ``<name>/rank<RANK>``."""
    out = str(tmp / name)
    if not per_rank_dir:
        head = [sys.executable, "-m", "dpq.autoround.cli"] if nproc is None else [*_torchrun(nproc), "-m",
                                                                                   "dpq.autoround.cli"]
        return [*head, *_args(tmp, out, *extra)]
    # a shell per rank, so that the output folder can name the rank (the CLI's arguments are the same everywhere)
    line = shlex.join([sys.executable, "-m", "dpq.autoround.cli", *_args(tmp, "OUT", *extra)])
    line = line.replace(" OUT ", f' {shlex.quote(out)}/rank"$RANK" ')
    return [*_torchrun(nproc), "--no-python", "bash", "-c", f"exec {line}"]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)


def _run(cmd: list[str], env: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr, "seconds": time.perf_counter() - t0}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


REPORT = ("--parallel_report",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("torchrun")
    report = lambda name: [*REPORT, str(tmp / f"{name}.json")]  # noqa: E731
    jobs = {
        "off": (_cmd(tmp, "off", None, "--parallel_quantization", "off"), _env()),
        "torchrun1": (_cmd(tmp, "torchrun1", 1, "--parallel_quantization", "1"), _env()),
        "1x2": (_cmd(tmp, "1x2", None, "--parallel_quantization", "2", "--parallel_devices", "cpu,cpu",
                     *report("1x2")), _env()),
        "2x1": (_cmd(tmp, "2x1", 2, "--parallel_quantization", "1", "--parallel_devices", "cpu", "--parallel_timeout",
                     TIMEOUT_S, *report("2x1"), per_rank_dir=True), _env()),
        "1x4": (_cmd(tmp, "1x4", None, "--parallel_quantization", "4", "--parallel_devices", "cpu,cpu,cpu,cpu"),
                _env()),
        "2x2": (_cmd(tmp, "2x2", 2, "--parallel_quantization", "2", "--parallel_devices", "cpu,cpu",
                     "--parallel_timeout", TIMEOUT_S), _env()),
        # issue 42, item 3: a refusal only the processes together see (2 x 1 lanes, a 1-sample dataset)
        "refused": (_cmd(tmp, "refused", 2, "--parallel_quantization", "1", "--parallel_timeout", TIMEOUT_S,
                         *report("refused"), "--dataset", str(_one_sample(tmp))), _env()),
        # rank 1 exits (as if killed) in block 1's second lane-loss call
        "killed": (_cmd(tmp, "killed", 2, "--parallel_quantization", "1", "--parallel_timeout", TIMEOUT_S,
                        *report("killed"), per_rank_dir=True), _env(DPQ_TEST_FAULT="exit:1:1:1")),
    }
    with ThreadPoolExecutor(2) as pool:  # threads only wait on the subprocesses
        futures = {name: pool.submit(_run, cmd, env) for name, (cmd, env) in jobs.items()}
        done = {name: f.result() for name, f in futures.items()}
    for name, r in done.items():
        r["dir"] = tmp / name
        print(f"{name}: rc {r['rc']}, {r['seconds']:.1f} s")
        report_file = tmp / f"{name}.json"
        r["report"] = json.loads(report_file.read_text()) if report_file.exists() else None
    return done


def _ok(r: dict) -> dict:
    assert r["rc"] == 0, (r["err"][-4000:])
    return r


def test_world2_is_bitwise_the_same_as_1x2_and_2x1(runs):
    one, two = _ok(runs["1x2"]), _ok(runs["2x1"])
    a, b = _state(one["dir"]), _state(two["dir"] / "rank0")
    assert same_bits(a, b)
    assert not same_bits(a, _state(_ok(runs["off"])["dir"]))  # split batches round otherwise: a real comparison
    blocks = two["report"]["blocks"]
    assert [blk["world"] for blk in blocks] == [2] * 4 and {blk["communicator"] for blk in blocks} == {"pg-gloo"}
    assert all(blk["best_iter"] > 0 for blk in blocks)  # the tuned values were kept, not the initial ones
    assert [blk["losses"] for blk in blocks] == [blk["losses"] for blk in one["report"]["blocks"]]
    assert "world 2 = 2 processes x 1 lane" in two["err"]


def test_world4_is_bitwise_the_same_as_1x4_and_2x2(runs):
    """World 4 as one process of 4 lanes and as 2 x 2 through the CLI (4 x 1, 2 x 2 and 2 x 1 of the
    same engine: tests/test_distributed.py, one spawn of 4 processes, cheaper than 4 CLI processes)."""
    ref = _state(_ok(runs["1x4"])["dir"])
    assert same_bits(ref, _state(_ok(runs["2x2"])["dir"]))
    assert not same_bits(ref, _state(_ok(runs["1x2"])["dir"]))
    assert "world 4 = 2 processes x 2 lanes" in runs["2x2"]["err"]


def test_world1_through_torchrun_equals_off(runs):
    assert same_bits(_state(_ok(runs["off"])["dir"]), _state(_ok(runs["torchrun1"])["dir"]))


def test_only_rank0_writes(runs):
    r = _ok(runs["2x1"])
    assert sorted(p.name for p in r["dir"].iterdir()) == ["rank0"]
    assert (next(r["dir"].glob("rank0/*")) / "config.json").exists()
    assert "rank 1 writes nothing" in r["err"]
    assert r["err"].count("dpq summary:") + r["out"].count("dpq summary:") == 1


def test_a_killed_rank_stops_the_others_naming_it(runs):
    r = runs["killed"]
    assert r["rc"] != 0
    text = r["out"] + r["err"]
    assert "dpq: rank 1 stopped answering" in text, text[-4000:]
    assert "this is rank 0" in text
    assert r["seconds"] < 60 + float(TIMEOUT_S)
    folder = r["dir"]
    assert not (folder / "rank1").exists()
    assert not list(folder.rglob("config.json")) and not list(folder.rglob("quantization_config.json"))


def test_a_lost_rank_is_reported_as_lost_not_as_a_cancel(runs):
    """Issue 31, item 10: rank 1 killed; torchrun then sends rank 0 SIGTERM, which counted as the
    user's cancel: rank 0 wrote no report. Now its report says a rank was lost, which and where, and
    rank 0 exits as failed (1), not as cancelled (143)."""
    r = runs["killed"]
    error = r["report"]["error"]
    assert error["kind"] == "rank_lost" and error["where"] == "model.layers.1", error
    assert error["message"].startswith("dpq: rank 1 stopped answering")
    assert [b["name"] for b in r["report"]["blocks"]] == ["model.layers.0"]
    text = r["out"] + r["err"]
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 1 " in text, text[-3000:]  # torchrun's summary of rank 0
    assert "the run was cancelled" not in text


def _as_torchrun_rank(monkeypatch, world_size: int = 2) -> None:
    """This process's environment as torchrun sets it for rank 0 (no group is started from it here)."""
    for name, value in (("WORLD_SIZE", str(world_size)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)


def test_a_refusal_under_torchrun_reads_as_one_refusal(runs):
    """Issue 42, item 3: with a 1-sample dataset under ``torchrun --nproc-per-node 2 ... --parallel_quantization 1``
    each rank printed a PlanRefused traceback, the report said ``kind: "rank_failed"`` with ``where`` null, and the
    fix said "a larger --batch_size" where one process rightly says "--nsamples 2 or more". Now every rank stops
    at the same refusal: rank 0 prints it once (as one process would), the other says it stops, no traceback of
    dpq's (torchrun's own agent prints one for any non-zero exit: USAGE says so), the report says "refused"."""
    r = runs["refused"]
    assert r["rc"] != 0, r["err"][-4000:]
    err = r["err"]
    assert err.count("the requested parallel quantization cannot run") == 1, err[-4000:]
    assert ("2 lanes (2 processes x 1) but only 1 sample per iteration (the calibration data gives 1 sample, of the 8 "
            "--nsamples asks)") in err, err[-4000:]
    assert ("Fix: calibration data that gives at least 2 samples (another --dataset; auto-round drops texts shorter "
            "than --seqlen), or fewer lanes: at most 1 process (torchrun --nproc-per-node)") in err, err[-4000:]
    assert "rank 1 stops: the refusal rank 0 prints" in err, err[-4000:]
    assert not re.search(r'File "[^"]*/dpq/', err), err[-4000:]  # no traceback through dpq's code
    error = r["report"]["error"]
    assert error["kind"] == "refused" and error["where"] == "model.layers.0", error
    assert "calibration data that gives at least 2 samples" in error["message"] and "rank" not in error["message"]


def test_every_rank_on_one_host_checks_the_paths(monkeypatch, tmp_path):
    """Issue 42's sweep, M2: a bad --parallel_report under torchrun was refused on rank 0 alone (exit 2); rank 1,
    stopped by torchrun, said it was cancelled. On one host every rank checks the paths (and says it); across
    hosts rank 0 alone does (the others may not see its folders)."""
    data = tmp_path / "calib.jsonl"
    data.write_text("{}\n")
    argv = ["--dataset", str(data), "--parallel_quantization", "1", "--parallel_report", str(data), "--output_dir",
            str(tmp_path / "out")]
    _as_torchrun_rank(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert any("is where this run reads --dataset" in p for p in cli.argument_errors(*split_argv(argv)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two hosts of one process each: rank 1 leaves it to rank 0
    assert not any("--parallel_report" in p for p in cli.argument_errors(*split_argv(argv)))


def test_a_device_map_of_gpus_this_torch_lacks_is_refused_before_loading(monkeypatch):
    """Issue 42's sweep, M8: --device_map cuda --parallel_quantization 2 on a CPU build of torch loaded the model,
    then failed with "Torch not compiled with CUDA enabled"; the lanes are --device_map's devices."""
    from dpq.planning.machine import Machine

    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: Machine("2.13.0+cpu")))
    found = cli.argument_errors(*split_argv(["--device_map", "cuda", "--parallel_quantization", "2"]))
    assert any("is a build without cuda support" in p for p in found), found
    assert cli.argument_errors(*split_argv(["--device_map", "cpu", "--parallel_quantization", "2"])) == []


def test_off_under_torchrun_is_refused_before_loading(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)  # importing auto-round's CLI would fail
    _as_torchrun_rank(monkeypatch)
    assert cli.main(["--model", "does-not-exist", "--parallel_timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert refusals.OFF_UNDER_TORCHRUN in err and "--parallel_timeout 0 is outside 10 to 604800 seconds" in err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.argument_errors(split_argv([])[0]) == []


@pytest.mark.parametrize("value", ["inf", "nan", "0.001", "1e9", "-5"])
def test_a_parallel_timeout_the_group_cannot_take_is_refused(monkeypatch, value):
    """inf overflowed in the group's timedelta and 0.001 let the group's start time out (DistStoreError),
    both after the arguments had passed."""
    _as_torchrun_rank(monkeypatch)
    ours, rest = split_argv(["--parallel_quantization", "1", "--parallel_timeout", value])
    assert cli.argument_errors(ours, rest) == [refusals.timeout_out_of_range(value, *TIMEOUT_RANGE_S)]
    assert cli.argument_errors(*split_argv(["--parallel_quantization", "1", "--parallel_timeout", "10"])) == []


def test_a_stray_world_size_outside_torchrun_is_refused(capsys, monkeypatch):
    """WORLD_SIZE=2 left in the environment, no launcher: a message with the fix, not init_process_group's
    'environment variable RANK expected'."""
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["--model", "m", "--parallel_quantization", "1"]) == 2
    err = capsys.readouterr().err
    assert refusals.world_size_without_launcher("2", ["RANK", "MASTER_ADDR", "MASTER_PORT"]) in err
    assert "Fix: unset WORLD_SIZE" in err and "Traceback" not in err


@pytest.mark.parametrize("lanes", ["cuda:99", "hpu", "cpu,cuda:99"])
def test_a_lane_device_that_does_not_exist_is_refused_before_the_group_starts(capsys, monkeypatch, lanes):
    """Refused with the flags (exit 2), before the group's setup binds the device (cuda's set_device
    raised AttributeError on a CPU build) or imports its backend (habana_frameworks)."""
    from dpq.autoround import process_setup
    from dpq.streams import backend

    if lanes == "hpu" and backend("hpu").is_available():
        pytest.skip("this machine has a Gaudi")
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)
    _as_torchrun_rank(monkeypatch)

    def start_group(*a, **k):
        raise AssertionError("the group must not start")

    monkeypatch.setattr(process_setup, "start_group", start_group)
    assert cli.main(["--model", "m", "--parallel_quantization", "1", "--parallel_devices", lanes]) == 2
    err = capsys.readouterr().err
    assert "is a build without" in err or "does not exist" in err, err
    assert "Fix: lanes that exist here, e.g. --parallel_devices cpu,cpu" in err and "Traceback" not in err


def test_each_process_gets_its_own_gpus():
    from dpq.autoround.process_setup import process_lanes

    rest = ["--model", "m"]
    devices, args, kind = process_lanes(2, None, rest, 3, "cuda")
    assert devices == "cuda:6,cuda:7" and args[-2:] == ["--device_map", "6"] and kind == "cuda"
    assert process_lanes("auto", None, ["--device_map=0"], 1, "cuda")[:2] == ("cuda:1", ["--device_map=1"])
    assert process_lanes(1, None, ["--device", "cpu"], 1, "cuda") == (None, ["--device", "cpu"], "cpu")
    assert process_lanes(2, None, rest, 1, "cpu") == (None, rest, "cpu")
    assert process_lanes(1, "cpu", rest, 1, "cuda") == ("cpu", rest, "cpu")
    assert process_lanes(1, "cuda:0", rest, 1, "cuda")[2] == "cuda"


@pytest.mark.parametrize("flag", [["--tasks", "piqa"], ["--tasks=piqa"], ["--task"], ["--task", "piqa"]])
def test_tasks_under_torchrun_is_refused_before_loading(capsys, monkeypatch, flag):
    """auto-round's evaluation after quantizing would run on every rank: refused under torchrun, with the fix."""
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)  # importing auto-round's CLI would fail
    _as_torchrun_rank(monkeypatch)
    assert cli.main(["--model", "does-not-exist", "--parallel_quantization", "1", *flag]) == 2
    assert refusals.TASKS_UNDER_TORCHRUN in capsys.readouterr().err
    ours, rest = split_argv(["--parallel_quantization", "1", "--target_bits", "4", "--ta", "x"])
    assert cli.argument_errors(ours, rest) == []  # --ta is ambiguous to auto-round (--target_bits): not --tasks
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.argument_errors(*split_argv(["--parallel_quantization", "1", *flag])) == []


def test_a_non_canonical_communicator_says_so_in_the_plan(monkeypatch):
    from dpq.nccl_comm import TorchNcclCommunicator
    from dpq.planning import plan as plan_mod

    monkeypatch.setattr(plan_mod, "choose_communicator", lambda devices: ("torch-nccl", "two GPUs"))
    request = plan_mod.PlanRequest()
    plan = plan_mod._finish(plan_mod.Plan([torch.device("cpu")] * 2), request, plan_mod._Choices(request))
    assert plan.communicator_reason == f"two GPUs; {TorchNcclCommunicator.order_note}"
    monkeypatch.setattr(plan_mod, "choose_communicator", lambda devices: ("local", "same device"))
    assert plan_mod._finish(plan_mod.Plan([torch.device("cpu")] * 2), request,
                            plan_mod._Choices(request)).communicator_reason == "same device"


def test_auto_rounds_own_ddp_lane_is_never_on_dpqs_path(monkeypatch):
    """auto-round's quantize_block enters setup_ddp_if_needed_ whenever a group is initialised: under
    dpq (any world but 'off') every rank tunes a serial block alone instead; 'off' is auto-round's own."""
    from auto_round.algorithms.quantization.sign_round import quantizer

    from dpq.autoround import integration, ranks

    calls = []

    def setup_ddp_if_needed_(ar, block, device_list):
        calls.append(block)
        return block, None

    monkeypatch.setattr(quantizer, "setup_ddp_if_needed_", setup_ddp_if_needed_)
    block = torch.nn.Linear(2, 2)
    with integration.parallel_quantization(1):
        assert quantizer.setup_ddp_if_needed_(None, block, [0]) == (block, ranks._no_sync) and calls == []
    with integration.parallel_quantization("off"):
        assert quantizer.setup_ddp_if_needed_(None, block, [0]) == (block, None) and calls == [block]


def test_more_lanes_over_the_processes_than_samples_is_refused_before_the_blocks_work(recorded_blocks):
    """An explicit world's refusal that only the processes together see (5 processes x 2 lanes, 8
    samples per iteration): at the block's dispatch, before its collection passes ran at another
    world, as in one process; agreed, so every rank stops there with the same reasons."""
    from dpq.autoround import integration
    from dpq.planning.distributed import ProcessSet
    from dpq.planning.plan import PlanRefused

    class EveryRankAlike(ProcessSet):
        def all_gather_object(self, value):  # the agreement's one collective: every rank sent the same
            return [value] * self.size

    rec = recorded_blocks[0]
    assert rec.quantizer.calibration_context.batch_size == 8
    with integration.parallel_quantization(2, "cpu,cpu", processes=EveryRankAlike(0, 5, store=None)):
        with pytest.raises(PlanRefused, match=r"10 lanes \(5 processes x 2\) but only 8 samples per iteration") as no:
            rec.quantizer.dispatch_block(rec.fresh_block(), list(rec.fp_inputs), dict(rec.input_others))
    assert no.value.every_rank  # every rank raises it: a refusal, not one rank's failure
    with integration.parallel_quantization(2, "cpu,cpu", processes=EveryRankAlike(0, 4, store=None)):
        rec.quantizer.dispatch_block(rec.fresh_block(), list(rec.fp_inputs), dict(rec.input_others))  # 8 lanes: fits
