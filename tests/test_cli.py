"""auto-round-dp: our flags checked before anything loads; refusals and lane failures printed as
messages with a non-zero exit, never as tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpq.autoround import cli

NO_SUCH_GPU = "cuda:99"  # cannot exist here, nor on a lent GPU machine


def run_main(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


def test_every_bad_flag_is_named_at_once_before_the_model_loads(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)  # importing auto-round's CLI would fail
    rc, err = run_main(capsys, "--model", "does-not-exist", "--parallel_quantization", "\u00b2",
                       "--parallel_devices", "gpu,,cuda:x", "--parallel_report", str(tmp_path))
    assert rc == 2, err
    for needle in ("world must be 'off', 'auto' or an integer", "'gpu' is not a device", "an empty entry",
                   "'cuda:x' is not a device", "is a directory"):
        assert needle in err, (needle, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,needle", [
    (["--parallel_quantization", "auto", "--parallel_devices", ""], "the lane device list is empty"),
    (["--parallel_quantization", "auto", "--parallel_devices", "gpu"], "'gpu' is not a device"),
    (["--parallel_devices", "cpu,cpu"], "parallel quantization is off"),
    (["--parallel_debug"], "--parallel_debug has no effect"),
    (["--parallel_overlap"], "--parallel_overlap has no effect"),
])
def test_flag_problems_exit_2(capsys, monkeypatch, argv, needle):
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)
    rc, err = run_main(capsys, *argv)
    assert rc == 2 and needle in err, err


def test_unwritable_report_path_is_refused_first(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc, err = run_main(capsys, "--parallel_quantization", "auto", "--parallel_report", str(blocker / "r.json"))
    assert rc == 2 and "cannot be written" in err, err
    assert cli.report_path_errors(str(tmp_path / "new" / "r.json")) == []
    assert not (tmp_path / "new" / "r.json").exists()  # the check leaves no file behind


# -- the real CLI in a subprocess, on the embedded model, stopped early --

def _cli(tmp: Path, *extra: str, prelude: str = "") -> subprocess.CompletedProcess:
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    calib = tmp / "calib.jsonl"
    if not calib.exists():
        calibration_jsonl(calib, 16, 64)
    args = ["--model", str(DATA_DIR), "--dataset", str(calib), "--nsamples", "8", "--seqlen", "64",
            "--device_map", "cpu", "--disable_torch_compile", "--output_dir", str(tmp / "out"), *extra]
    code = prelude + "from dpq.autoround.cli import main; raise SystemExit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)


def test_cli_refusal_lists_every_reason_as_a_message(tmp_path):
    """The issue's example: four reasons (device, device count, samples, LFQ), printed, rc 1."""
    report = tmp_path / "report.json"
    proc = _cli(tmp_path, "--iters", "2", "--batch_size", "1", "--enable_lfq", "--parallel_quantization", "4",
                "--parallel_devices", f"cpu,{NO_SUCH_GPU}", "--parallel_report", str(report))
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    for needle in (f"{NO_SUCH_GPU} does not exist", "world 4 needs 4 lane devices", "4 lanes but only 1 samples",
                   "LFQ loss"):
        assert needle in err, (needle, err[-3000:])
    assert "the requested parallel quantization cannot run" in json.loads(report.read_text())["error"]


def earlier_model(out: Path) -> dict[str, bytes]:
    """A model saved in ``out`` before (where this module's runs save theirs, auto-round's export folder
    ``<model>-w4g128``: the embedded model's files stand in for it); returns :func:`tree_bytes` of ``out``."""
    import shutil

    from dpq.demo.embedded import DATA_DIR

    folder = out / f"{Path(DATA_DIR).name}-w4g128"
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(Path(DATA_DIR) / name, folder / name)
    (folder / "quantization_config.json").write_text('{"bits": 4}')
    return tree_bytes(out)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cli_lane_failure_says_what_was_kept(tmp_path):
    """A lane fails in block 1 under an explicit world: rc 1, a message (no traceback) naming the block
    that was restored and the block finished before it, and no claim that nothing was lost. Small
    shards (auto-round writes them during quantization): a model saved in --output_dir before is
    left bitwise as it was, without a stray shard beside it, and no partial folder stays behind."""
    prelude = "from dpq.testing.faults import inject_fault; inject_fault(block=1, after=1); "
    report = tmp_path / "report.json"
    before = earlier_model(tmp_path / "out")
    proc = _cli(tmp_path, "--iters", "3", "--batch_size", "4", "--parallel_quantization", "2",
                "--parallel_devices", "cpu,cpu", "--parallel_report", str(report), "--max_shard_size", "100KB",
                prelude=prelude)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "a lane failed while tuning model.layers.1" in err, err[-3000:]
    assert "model.layers.1 is back as it was before its work started" in err
    assert "finished before it (model.layers.0) stay quantized in place" in err
    assert "--output_dir is left as it was" in err
    assert "nothing already quantized was lost" not in err
    assert tree_bytes(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "out", "report.json"]
    body = json.loads(report.read_text())
    assert [b["name"] for b in body["blocks"]] == ["model.layers.0"] and "model.layers.1" in body["error"]


def test_requires_python_is_auto_rounds():
    """pyproject said >= 3.10, but auto-round (a dependency) requires >= 3.11."""
    import tomllib
    from importlib.metadata import metadata

    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    ours, theirs = project["project"]["requires-python"], metadata("auto-round")["Requires-Python"]
    for minor in range(8, 16):
        v = f"3.{minor}"
        assert (v in SpecifierSet(ours)) <= (v in SpecifierSet(theirs)), (v, ours, theirs)
    assert project["tool"]["ruff"]["target-version"] == "py" + ours.removeprefix(">=").replace(".", "")


def test_parallel_overlap_reaches_enable(capsys, monkeypatch):
    """--parallel_overlap asks enable() for the overlapped exchange (True); without it, the default (None)."""
    from dpq.autoround import cli, integration

    seen = []
    monkeypatch.setattr(cli, "runner_for", lambda recipe: lambda: None)  # auto-round itself does not run
    monkeypatch.setattr(integration, "enable", lambda *a, **k: seen.append(k["overlap"]))
    for flag, want in ((["--parallel_overlap"], True), ([], None)):
        rc, err = run_main(capsys, "--model", "m", "--parallel_quantization", "2", "--parallel_devices", "cpu,cpu",
                           *flag)
        assert rc == 0, err
        assert seen.pop() is want


# Spies on each hop from the command line to the engine, installed in the CLI's process before main():
# each records the value it was handed as an argument (nothing reads a module global), and the list is
# printed as one JSON line when the process exits.
_HOP_SPIES = """
import atexit, json, sys
from dpq import session
from dpq.autoround import integration
hops = []
atexit.register(lambda: print('HOPS ' + json.dumps(hops), file=sys.stderr))
real_enable, real_run, real_engine = integration.enable, session.run, session.TuneEngine
def enable(parallel_quantization='auto', devices=None, **kw):
    hops.append(['enable', parallel_quantization, devices])
    return real_enable(parallel_quantization, devices, **kw)
def run(config, task, *, plan=None):
    hops.append(['session.run', config.world, task.name, None if plan is None else plan.local_lanes])
    return real_run(config, task, plan=plan)
def engine(replicas, *a, **k):
    hops.append(['TuneEngine', k['name'], len(replicas.lanes)])
    return real_engine(replicas, *a, **k)
integration.enable, session.run, session.TuneEngine = enable, run, engine
"""


def test_cli_world_reaches_the_engine_through_arguments(tmp_path):
    """``--parallel_quantization 2`` from the command line to the engine, hop by hop, each hop seeing
    it in its arguments: enable() gets 2, each block's session run gets a config of world 2 and a plan
    of 2 lanes, and each block's engine is built on a replica set of 2 lanes."""
    proc = _cli(tmp_path, "--iters", "2", "--batch_size", "4", "--parallel_quantization", "2",
                "--parallel_devices", "cpu,cpu", prelude=_HOP_SPIES.lstrip())
    assert proc.returncode == 0, proc.stderr[-3000:]
    hops = json.loads(next(line for line in proc.stderr.splitlines() if line.startswith("HOPS "))[5:])
    from dpq.demo.embedded import DATA_DIR

    layers = json.loads((Path(DATA_DIR) / "config.json").read_text())["num_hidden_layers"]
    blocks = [f"model.layers.{i}" for i in range(layers)]
    assert hops == [["enable", 2, "cpu,cpu"]] + [h for b in blocks for h in (["session.run", 2, b, 2],
                                                                             ["TuneEngine", b, 2])], hops
