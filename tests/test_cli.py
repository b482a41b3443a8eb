"""auto-round-dp: our flags checked before anything loads; refusals and lane failures printed as
messages with a non-zero exit, never as tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpq import refusals
from dpq.autoround import cli

NO_SUCH_GPU = "cuda:99"  # cannot exist here, nor on a lent GPU machine


def run_main(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, what was said on stderr; of an argument error, the error itself, past the usage)."""
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    usage, said, error = err.partition("auto-round-dp: error:")
    assert not said or usage.startswith("usage: auto-round-dp "), err  # argparse's format: usage, then the error
    return rc, said + error if said else err


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
    # issue 42: --parallel_timeout alone was silently ignored (devices, debug and overlap were refused)
    (["--parallel_timeout", "30"], "--parallel_timeout has no effect"),
])
def test_flag_problems_exit_2(capsys, monkeypatch, argv, needle):
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)
    rc, err = run_main(capsys, *argv)
    assert rc == 2 and needle in err, err


def _refused_paths(capsys, monkeypatch, tmp_path, *argv: str) -> str:
    """``argv`` refused with exit 2 before anything loads; nothing under ``tmp_path`` created, changed or
    deleted (symlinks compared as links). Returns what was said."""
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)  # importing auto-round's CLI would fail
    before = _listing(tmp_path)
    rc, err = run_main(capsys, *argv)
    assert rc == 2 and "Traceback" not in err, err
    assert _listing(tmp_path) == before
    return err


def _listing(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (not following symlinks): a link's target, a file's bytes, or 'dir'."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = f"-> {p.readlink()}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def test_a_report_path_through_a_file_says_the_file_is_not_a_folder(capsys, tmp_path, monkeypatch):
    """Issue 31, item 7: ``--parallel_report afile/r.json`` with ``afile`` a file said "cannot be written
    (File exists)"; the problem is that ``afile`` is not a folder."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "auto", "--parallel_report",
                         str(blocker / "sub" / "r.json"), "--output_dir", str(tmp_path / "out"))
    assert f"{blocker} is a file, not a folder" in err and "Fix: --parallel_report with a file path" in err, err


def test_a_refused_run_leaves_a_report_symlink_alone(capsys, tmp_path, monkeypatch):
    """Issue 31, item 1: a report path that is a symlink to a missing file, with a refused world: the
    link was deleted and an empty target file created. Nothing is touched now, and the path itself is
    fine (the report would be written at the link's target)."""
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "0", "--parallel_report",
                         str(link), "--output_dir", str(tmp_path / "out"))
    assert "world must be 'off', 'auto' or an integer" in err and "parallel_report" not in err, err
    assert link.is_symlink() and not (tmp_path / "target.json").exists()


def test_a_refused_run_makes_no_folder_for_its_report(capsys, tmp_path, monkeypatch):
    """Issue 31, item 6: a refused run created the report's parent folders (``newdir/sub/``)."""
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "0", "--parallel_report",
                         str(tmp_path / "newdir" / "sub" / "r.json"), "--output_dir", str(tmp_path / "out"))
    assert "world must be" in err and not (tmp_path / "newdir").exists()


def test_a_report_inside_the_output_is_refused(capsys, tmp_path, monkeypatch):
    """Issue 31, item 5: ``--parallel_report <output>/data-w4g128/config.json`` overwrote the saved model's
    config.json with the report (exit 0). Refused before the run: in a folder inside the output (where
    auto-round puts the model), through a symlink to it too, or under a model file's name in the output
    itself; a report of its own name beside the model's folder is fine (a rerun keeps it)."""
    out = tmp_path / "out"
    (out / "data-w4g128").mkdir(parents=True)
    (out / "data-w4g128" / "config.json").write_text("{}")
    (tmp_path / "alias").symlink_to(out)
    for report in (out / "data-w4g128" / "config.json", out / "new" / "r.json", tmp_path / "alias" / "m" / "r.json",
                   out / "config.json", out / "model.safetensors"):
        err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "1", "--parallel_report",
                             str(report), "--output_dir", str(out))
        assert f"--parallel_report {report} is where auto-round saves the model in --output_dir {out}" in err, err
        assert f"Fix: a path outside the model's folder, e.g. --parallel_report {out}/dpq_report.json" in err
    from dpq.autoround.outputs import path_errors

    for fine in (tmp_path / "r.json", tmp_path / "new" / "r.json", out / "dpq_report.json"):  # beside the model
        assert path_errors(str(fine), str(out)) == []
    assert not (tmp_path / "new").exists() and not (tmp_path / "r.json").exists()  # the check creates nothing


def test_a_report_on_someone_elses_file_is_refused(capsys, tmp_path, monkeypatch):
    """Issue 42, third sweep: ``--parallel_report`` at an existing file that is not one of the run's inputs
    (a source file, a note: a typo in the path) was replaced whole by the report, exit 0. Refused before the
    model loads, the file untouched; an empty file and an earlier dpq report are still replaced."""
    out = tmp_path / "out"
    notes = tmp_path / "train.py"
    notes.write_text("print('my script')\n")
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "1", "--parallel_report",
                         str(notes), "--output_dir", str(out))
    assert f"--parallel_report {notes} is an existing file that is not a dpq report" in err, err
    assert f"e.g. --parallel_report {out}/dpq_report.json" in err
    from dpq.autoround.outputs import SCHEMA, path_errors

    not_ours = tmp_path / "other.json"
    not_ours.write_text(json.dumps({"schema": "somebody-else/1"}))
    assert path_errors(str(not_ours), str(out)) != []
    empty, earlier = tmp_path / "empty.json", tmp_path / "earlier.json"
    empty.write_text("")
    earlier.write_text(json.dumps({"schema": SCHEMA, "exit_status": 0}))
    assert path_errors(str(empty), str(out)) == [] and path_errors(str(earlier), str(out)) == []


def test_a_report_on_the_runs_inputs_is_refused(capsys, tmp_path, monkeypatch):
    """Issue 42, item 1 (HIGH): ``--parallel_report`` equal to the ``--dataset`` file, a file inside the local
    ``--model`` folder (its config.json), or a symlink to either, was replaced by the JSON report, exit 0: the
    next run on the same model or data crashed. Refused before the model loads, nothing touched; symlinks
    resolved both ways (a model folder whose files link elsewhere, as the Hugging Face cache's do)."""
    model, blobs = tmp_path / "model", tmp_path / "blobs"
    model.mkdir(), blobs.mkdir()
    (blobs / "abc").write_text('{"model_type": "llama"}')
    (model / "config.json").symlink_to(blobs / "abc")  # as a hub snapshot holds its files
    (model / "tokenizer.json").write_text("{}")
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "x"}\n')
    (tmp_path / "data_link.json").symlink_to(data)
    out = tmp_path / "out"
    cases = {data: "--dataset", tmp_path / "data_link.json": "--dataset", model / "config.json": "--model",
             blobs / "abc": "--model", model / "tokenizer.json": "--model", model / "new_report.json": "--model",
             model: None}
    for report, flag in cases.items():
        err = _refused_paths(capsys, monkeypatch, tmp_path, "--model", str(model), "--dataset", f"{data}:num=8",
                             "--parallel_quantization", "1", "--parallel_report", str(report), "--output_dir",
                             str(out))
        if flag is None:  # the folder itself: a directory, said so before
            assert "is a directory" in err, err
            continue
        value = str(model) if flag == "--model" else str(data)
        assert f"--parallel_report {report} is where this run reads {flag} {value}" in err, (report, err)
        assert f"Fix: a path outside the run's inputs, e.g. --parallel_report {out}/dpq_report.json" in err
    from dpq.autoround.args import autoround_args
    from dpq.autoround.outputs import path_errors, run_inputs

    inputs = run_inputs(autoround_args(["--model", str(model), "--dataset", f"{data},NeelNanda/pile-10k"]))
    assert [(i.flag, i.value) for i in inputs] == [("--model", str(model)), ("--dataset", str(data))]
    assert path_errors(str(tmp_path / "r.json"), str(out), inputs) == []  # beside the inputs: fine


def test_a_report_where_nothing_can_be_created_is_refused(capsys, tmp_path, monkeypatch):
    """Issue 42 (low): a report path under /proc passed the write check (as root ``access()`` says yes) and the
    run ended with no report, exit 0. The check now creates a file in the nearest existing folder, and removes it."""
    if not Path("/proc/self").exists():
        pytest.skip("needs /proc")
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "1", "--parallel_report",
                         "/proc/dpq_report.json", "--output_dir", str(tmp_path / "out"))
    assert "--parallel_report /proc/dpq_report.json cannot be written: /proc takes no writes" in err, err


def test_a_report_that_is_a_pipe_is_refused_and_never_waited_for(capsys, tmp_path, monkeypatch):
    """Issue 42's sweep, H3: a --parallel_report that is a FIFO with no reader passed the check, and the run,
    its model saved, blocked forever opening it. Refused before the run; and a pipe met at the end is not
    waited for (an error, said as a report not written)."""
    import os

    from dpq.autoround.outputs import write_whole

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "1", "--parallel_report",
                         str(fifo), "--output_dir", str(tmp_path / "out"))
    assert f"--parallel_report {fifo} is a pipe (or a socket)" in err, err
    t0 = time.perf_counter()
    with pytest.raises(OSError):
        write_whole(str(fifo), "{}")
    assert time.perf_counter() - t0 < 5


def test_the_plan_screen_checks_the_paths_the_run_would_write(capsys, tmp_path, monkeypatch):
    """Issue 42 (low): ``--parallel_plan`` skipped the report and output path checks, so a plan looked fine for a
    command that would stop at once."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_plan", "--parallel_report", str(tmp_path),
                         "--output_dir", str(afile))
    assert "is a directory" in err and f"--output_dir {afile} is an existing file" in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--parallel_quantization", "99999999999999999999", "--parallel_devices", "cpu"], "world 99999999999999999999 "
     "needs 99999999999999999999 lane devices but 1 was given (cpu)"),
    (["--parallel_quantization", "1000000000", "--parallel_devices", "cpu"], "1000000000 lanes but only 8 samples"),
    (["--parallel_quantization", "1000000000", "--device_map", "cpu"], "1000000000 lanes but only 8 samples per "
     "iteration (batch_size x gradient_accumulate_steps): every lane needs at least one sample. Fix: a smaller "
     "--parallel_quantization (at most 8)"),
    (["--parallel_quantization", "4", "--device_map", "cpu", "--nsamples", "2"], "4 lanes but only 2 samples per "
     "iteration (the calibration data has 2 samples): every lane needs at least one sample. Fix: --nsamples 4 or "
     "more"),
])
def test_absurd_worlds_stop_at_once(capsys, monkeypatch, argv, needle):
    """Issue 42, item 2: ``--parallel_quantization 99999999999999999999 --parallel_devices cpu`` ended in an
    OverflowError traceback (an example lane list sized by the request); ``1000000000`` with devices was refused
    after ~40 s (that list: gigabytes); without devices the model loaded and block 0 sat for minutes. The world
    is checked against the samples of an iteration (auto-round's defaults: batch 8) at flag time, exit 2 in
    seconds, and no message is sized by the request."""
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)  # the model is never loaded
    t0 = time.perf_counter()
    rc, err = run_main(capsys, *argv)
    assert rc == 2 and needle in err and "Traceback" not in err, err
    assert len(err) < 2000 and time.perf_counter() - t0 < 10, (len(err), time.perf_counter() - t0)


@pytest.mark.parametrize("argv,needle", [
    (["--parallel_quantization", "2", "--parallel_devices", "cpu,cpu", "--gradient_accumulate_steps", "0"],
     "--gradient_accumulate_steps 0: an iteration would have no sample to tune on"),
    (["--parallel_quantization", "2", "--parallel_devices", "cpu,cpu", "--nsamples", "0"],
     "--nsamples 0: an iteration would have no sample"),
    (["--parallel_quantization", "auto", "--batch_size", "-3"], "--batch_size -3: an iteration would have no sample"),
    (["--parallel_plan", "--batch_size", "-3"], "--batch_size -3: an iteration would have no sample"),
])
def test_a_count_under_one_stops_at_once(capsys, monkeypatch, argv, needle):
    """Issue 42's third sweep, M13: ``--gradient_accumulate_steps 0`` at world 2 was read as 1 at flag time,
    so the model loaded and block 0 was refused with "only 0 samples per iteration ... (at most 0)";
    ``--nsamples 0`` ended in a DataLoader traceback. Exit 2 before the model loads now."""
    monkeypatch.setitem(sys.modules, "auto_round.__main__", None)  # the model is never loaded
    rc, err = run_main(capsys, "--device_map", "cpu", *argv)
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_a_model_or_dataset_path_with_nothing_there_stops_at_once(capsys, tmp_path, monkeypatch):
    """Issue 42's third sweep, M14: ``--model /no/such/folder`` ended in transformers' "Repo id must be in the
    form 'repo_name' or 'namespace/repo_name'" traceback, and ``--dataset ./missing.jsonl`` loaded the model
    first and then raised auto-round's "Dataset ... is not found" traceback. With dpq on, both are said at
    flag time (exit 2); a hub id (``org/name``) is never taken for a path."""
    from dpq.demo.embedded import DATA_DIR

    err = _refused_paths(capsys, monkeypatch, tmp_path, "--model", str(tmp_path / "nomodel"), "--dataset",
                         str(tmp_path / "nodata.jsonl") + ":num=8", "--parallel_quantization", "1",
                         "--output_dir", str(tmp_path / "out"))
    assert f"--model {tmp_path / 'nomodel'} is a path, but nothing is there" in err, err
    assert f"--dataset {tmp_path / 'nodata.jsonl'} is a path, but nothing is there" in err, err
    assert "Fix: the path of a calibration file, or a hub id such as NeelNanda/pile-10k" in err
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--model", str(DATA_DIR), "--dataset", "NeelNanda/pile-10k",
                         "--parallel_quantization", "1", "--batch_size", "0")  # refused for its batch alone
    assert "is a path" not in err and "--batch_size 0" in err, err


def test_an_output_dir_that_is_a_file_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """Issue 31, item 12: ``--output_dir`` an existing file failed only after the whole quantization,
    with a NotADirectoryError traceback from the staging's commit."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "1", "--output_dir", str(afile))
    assert f"--output_dir {afile} is an existing file, not a folder" in err and "Fix: another --output_dir" in err
    err = _refused_paths(capsys, monkeypatch, tmp_path, "--parallel_quantization", "1", f"--output_dir={afile}/o")
    assert f"--output_dir {afile}/o: {afile} is a file, not a folder" in err, err


def test_the_output_dir_default_is_auto_rounds():
    from auto_round.cli.parser import build_quantize_parser

    from dpq.autoround.args import autoround_args
    from dpq.autoround.outputs import DEFAULT_OUTPUT_DIR

    assert build_quantize_parser(prog="x").parse_args(["--model", "m"]).output_dir == DEFAULT_OUTPUT_DIR
    assert autoround_args(["--model", "m"]).output_dir == DEFAULT_OUTPUT_DIR
    assert autoround_args(["--output_dir", "a", "--iters", "2"]).output_dir == "a"
    assert autoround_args(["--output=a"]).output_dir == "a"


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
    """What needs the model and its data (the samples the dataset holds, LFQ) is refused before the first
    block's work, every reason at once, printed, rc 1 (what the flags alone reveal, --batch_size 1 for 4
    lanes among them, stops earlier, exit 2: test_absurd_worlds_stop_at_once)."""
    from dpq.demo.embedded import calibration_jsonl

    report, two = tmp_path / "report.json", tmp_path / "two.jsonl"
    calibration_jsonl(two, 2, 64)
    proc = _cli(tmp_path, "--iters", "2", "--batch_size", "4", "--enable_lfq", "--parallel_quantization", "4",
                "--parallel_devices", "cpu,cpu,cpu,cpu", "--parallel_report", str(report), "--dataset", str(two))
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    for needle in ("4 lanes but only 2 samples per iteration (the calibration data gives 2 samples, of the 8 "
                   "--nsamples asks)", "Fix: calibration data that gives at least 4 samples", "LFQ loss"):
        assert needle in err, (needle, err[-3000:])
    error = json.loads(report.read_text())["error"]
    assert error["kind"] == "refused" and "the requested parallel quantization cannot run" in error["message"]
    assert set(error) == {"kind", "where", "block", "lane", "message"}


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
    from dpq.demo.embedded import DATA_DIR

    prelude = "from dpqlab.faults import inject_fault; inject_fault(block=1, after=1); "
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
    assert [b["name"] for b in body["blocks"]] == ["model.layers.0"]
    assert body["error"]["kind"] == "lane_failed" and body["error"]["where"] == "model.layers.1"
    assert body["error"]["block"] == "model.layers.1" and body["exit_status"] == 1  # issue 29: how the run ended
    assert body["schema"] == "dpq-report/1" and body["command"][:3] == ["auto-round-dp", "--model", str(DATA_DIR)]
    assert body["devices"] == "cpu,cpu" and body["started"] <= body["ended"] and body["versions"]["auto_round"]
    assert "a lane failed while tuning model.layers.1" in body["error"]["message"]


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
    """--parallel_overlap (bare or 'on') asks enable() for the overlapped exchange (True), 'off' for none
    (False); without it or with 'auto', the plan's choice (None)."""
    from dpq.autoround import cli, integration
    from dpq.planning.machine import Machine

    seen = []
    monkeypatch.setattr(cli, "runner_for", lambda recipe: lambda: None)  # auto-round itself does not run
    monkeypatch.setattr(integration, "enable_spec", lambda spec, **k: seen.append(spec.overlap))
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: cls("2.13.0+cu128", frozenset({"cuda"}),
                                                                       {"cuda": 2}, True)))  # two GPUs
    for flag, want in ((["--parallel_overlap"], True), ([], None), (["--parallel_overlap", "on"], True),
                       (["--parallel_overlap=off"], False), (["--parallel_overlap", "auto"], None)):
        rc, err = run_main(capsys, "--model", "m", "--parallel_quantization", "2", "--parallel_devices",
                           "cuda:0,cuda:1", *flag)
        assert rc == 0, err
        assert seen.pop() is want


def test_parallel_order_reaches_enable(capsys, monkeypatch):
    """--parallel_order native reaches enable()'s spec; without it, canonical."""
    from dpq.autoround import cli, integration
    from dpq.planning.machine import Machine

    seen = []
    monkeypatch.setattr(cli, "runner_for", lambda recipe: lambda: None)  # auto-round itself does not run
    monkeypatch.setattr(integration, "enable_spec", lambda spec, **k: seen.append(spec.order))
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: cls("2.13.0+cu128", frozenset({"cuda"}),
                                                                       {"cuda": 2}, True)))  # two GPUs
    for flag, want in ((["--parallel_order", "native"], "native"), ([], "canonical")):
        rc, err = run_main(capsys, "--model", "m", "--parallel_quantization", "2", "--parallel_devices",
                           "cuda:0,cuda:1", *flag)
        assert rc == 0, err
        assert seen.pop() == want


# Spies on each hop from the command line to the engine, installed in the CLI's process before main():
# each records the value it was handed as an argument (nothing reads a module global), and the list is
# printed as one JSON line when the process exits.
_HOP_SPIES = """
import atexit, json, sys
from dpq import session
from dpq.autoround import integration
hops = []
atexit.register(lambda: print('HOPS ' + json.dumps(hops), file=sys.stderr))
real_enable, real_run, real_engine = integration.enable_spec, session.run, session.TuneEngine
def enable(spec, **kw):
    hops.append(['enable', spec.world, spec.devices])
    return real_enable(spec, **kw)
def run(config, task, *, plan=None):
    hops.append(['session.run', config.world, task.name, None if plan is None else plan.local_lanes])
    return real_run(config, task, plan=plan)
def engine(replicas, *a, **k):
    hops.append(['TuneEngine', k['name'], len(replicas.lanes)])
    return real_engine(replicas, *a, **k)
integration.enable_spec, session.run, session.TuneEngine = enable, run, engine
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


# -- issue 31: nothing of the user's is touched, and every end of a run is reported --

@pytest.fixture(scope="module")
def rerun(tmp_path_factory) -> dict:
    """One successful run into an output that holds an earlier model with the user's own file in its
    folder, beside two staging folders of killed runs (one with a partial shard, one empty), its
    report sent to /dev/full (the write fails at the end, ENOSPC)."""
    tmp = tmp_path_factory.mktemp("rerun")
    before = earlier_model(tmp / "out")
    model_dir = next((tmp / "out").iterdir())
    (model_dir / "inner_notes.txt").write_text("the user's")
    for name, files in ((".out.dpq-partial-dead0001", ("x.safetensors",)), (".out.dpq-partial-dead0002", ())):
        (tmp / name).mkdir()
        for f in (".dpq-owner", *files):  # dpq.staging.OWNER (tests/test_staging.py holds it to this name)
            (tmp / name / f).write_bytes(b"")
    proc = _cli(tmp, "--iters", "1", "--batch_size", "4", "--parallel_quantization", "1", "--parallel_report",
                "/dev/full")
    return {"proc": proc, "tmp": tmp, "before": before, "model_dir": model_dir}


def test_a_rerun_keeps_the_users_file_in_the_model_folder(rerun):
    """Issue 31, item 2 (through the CLI; tests/test_staging.py has the merge): the staged folder
    replaced the whole model folder, deleting the user's note beside the model."""
    proc, model_dir = rerun["proc"], rerun["model_dir"]
    assert (model_dir / "inner_notes.txt").read_text() == "the user's", proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = f"{model_dir.name}/model.safetensors"
    assert (model_dir / "model.safetensors").read_bytes() != rerun["before"][rel]  # the model itself was replaced


def test_a_later_run_names_or_removes_killed_runs_staging_folders(rerun):
    """Issue 31, item 9: staging folders of killed runs stayed beside the output, unmentioned."""
    proc, tmp = rerun["proc"], rerun["tmp"]
    assert f"left part of their output in {tmp / '.out.dpq-partial-dead0001'} " in proc.stderr, proc.stderr[-3000:]
    assert refusals.staging_leftovers([str(tmp / ".out.dpq-partial-dead0001")]) in proc.stderr
    assert "removed the empty staging folders of killed runs: " + str(tmp / ".out.dpq-partial-dead0002") in proc.stderr
    assert sorted(p.name for p in tmp.iterdir()) == [".out.dpq-partial-dead0001", "calib.jsonl", "out"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_report_that_cannot_be_written_leaves_a_complete_model_a_success(rerun):
    """Issue 31, item 13: ``--parallel_report /dev/full``: the model was complete and in place, yet exit 1
    and the same error printed twice. Exit 0 now (the model is complete), said once."""
    proc = rerun["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = refusals.report_not_written("/dev/full", "No space left on device", True)
    assert proc.stderr.count("/dev/full") == 1 and said in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_a_failed_save_is_reported_as_a_failure(tmp_path):
    """Issue 31, item 4: a save that fails (a full disk: every safetensors write raises ENOSPC) left the
    output untouched but the report read like a success (world, devices, every block, no error)."""
    prelude = ("import errno, safetensors.torch as st\n"
               "def full(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device')\n"
               "st.save_file = full\n")
    report = tmp_path / "report.json"
    before = earlier_model(tmp_path / "out")
    proc = _cli(tmp_path, "--iters", "1", "--batch_size", "4", "--parallel_quantization", "1", "--parallel_report",
                str(report), prelude=prelude)
    assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr[-3000:]
    assert tree_bytes(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl", "out", "report.json"]
    # issue 42, item 4: a raw traceback, no line saying the output folder is as it was, and "where": null (the
    # shards are written by auto-round's immediate saving after the last block, before its save); said now
    said = refusals.save_failed(str(tmp_path / "out"), "OSError: [Errno 28] No space left on device")
    assert f"auto-round-dp: dpq: {said}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = json.loads(report.read_text())["error"]
    assert error == {"kind": "save_failed", "where": "save", "block": None, "lane": None, "message": f"dpq: {said}"}


def test_a_failed_save_with_dpq_off_is_said_as_one(tmp_path):
    """Issue 42's sweep, M11: the same full disk with --parallel_quantization off gave a raw traceback and a
    report of kind "error", where null. Said as a failed save now, without claiming the folder is as it was
    (auto-round writes into it itself when dpq is off)."""
    prelude = ("import errno, safetensors.torch as st\n"
               "def full(*a, **k): raise OSError(errno.ENOSPC, 'No space left on device')\n"
               "st.save_file = full\n")
    report = tmp_path / "report.json"
    proc = _cli(tmp_path, "--iters", "1", "--batch_size", "4", "--parallel_report", str(report), prelude=prelude)
    said = refusals.save_failed(str(tmp_path / "out"), "OSError: [Errno 28] No space left on device", staged=False)
    assert proc.returncode == 1 and f"auto-round-dp: dpq: {said}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    error = json.loads(report.read_text())["error"]
    assert error["kind"] == "save_failed" and error["where"] == "save", error


def test_a_write_failure_is_told_from_other_errors():
    """What is said as a failed save (issue 42, item 4): a write refused for room or permission, as Python's
    OSError or safetensors' own error says it; not a read that fails, nor any other error."""
    import errno

    from safetensors import SafetensorError

    from dpq.autoround.ranks import is_write_failure

    assert is_write_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert is_write_failure(OSError(errno.EDQUOT, "Disk quota exceeded"))
    full = "Error while serializing: I/O error: No space left on device (os error 28)"  # its Rust writer's words
    assert is_write_failure(SafetensorError(full))
    assert not is_write_failure(FileNotFoundError(errno.ENOENT, "No such file or directory"))
    assert not is_write_failure(SafetensorError("Error while deserializing header: HeaderTooLarge"))
    assert not is_write_failure(RuntimeError("No space left on device"))
