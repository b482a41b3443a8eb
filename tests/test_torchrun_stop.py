"""A torchrun job stops whole (issue 18): auto-round-dp under torchrun, 2 processes x 1 lane on
gloo, on the embedded model, its shards small (``--max_shard_size``: auto-round writes them while
it quantizes, so a half-written output would show).

* cancel: SIGTERM to torchrun while rank 1 hangs in block 1 (``DPQ_TEST_FAULT=hang``) and rank 0
  waits for it in a gloo collective (block 0's shards are written by then, in the partial folder
  beside ``--output_dir``): every worker is gone within 10 s, nothing is in ``--output_dir``, no
  partial folder is left beside it, and each worker says it was cancelled;
* the launcher killed (SIGKILL) at the same point: no worker is alive 10 s later, and the same holds;
* a rank given another model (one weight's bit flipped), another dataset and another ``--iters``:
  every rank refuses before the model loads, naming the three settings with each rank's value;
* rank 1 raises in block 1 (block 0's shards written, as the hung runs see) while a model saved
  before sits in ``--output_dir``: that model is bitwise untouched, no partial folder is left,
  rank 1 prints its error with its traceback and rank 0 names rank 1.

The four runs are made once, two at a time (two cores; the longest first), and their times printed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dpq import refusals
from tests.test_cli import earlier_model, tree_bytes
from tests.test_torchrun import _args, _env, _torchrun

pytestmark = [pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the workers through /proc"),
              pytest.mark.torchrun_cli]  # its own .ci/run stage (pyproject's markers)

STOP_S = 10.0  # every worker gone this long after the launcher's SIGTERM or SIGKILL
SHARDS = ("--max_shard_size", "100KB")
HANG = "dpq test hook: rank 1 hangs in block 1"
REPORT = "report.json"  # the cancelled runs' report (rank 0's, written by its cancel watcher)
WORKER_TRACEBACK = re.compile(r'File ".*/(dpq|auto_round)/')  # a worker's traceback (torchrun prints its own)


def _cli(tmp: Path, *extra: str) -> list[str]:
    return [*_torchrun(2), "-m", "dpq.autoround.cli", *_args(tmp, str(tmp / "out"), "--parallel_quantization", "1",
                                                             "--parallel_timeout", "60", *SHARDS, *extra)]


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...); None: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) and int(st[1]) == pid]


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # an exited worker nobody reaped yet is a zombie


def _staged(tmp: Path) -> list[str]:
    """The shards in the partial folder beside ``tmp/out`` (dpq.staging), by name."""
    return sorted(p.name for p in tmp.glob(".out.dpq-partial-*/**/*.safetensors"))


def _run(cmd: list[str], env: dict[str, str], stop: signal.Signals | None = None, tmp: Path | None = None) -> dict:
    """Run ``cmd``; with ``stop``: once rank 1 hangs (and rank 0 waits in the collective), note what
    is staged in ``tmp``, send ``stop`` to torchrun and time how long its workers live on."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    hung = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if HANG in line:
                hung.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out: dict = {}
    try:
        if stop is not None:
            assert hung.wait(240), "".join(lines)[-4000:]
            time.sleep(1.0)  # rank 0 reaches the collective rank 1 never joins
            workers = _children(proc.pid)
            assert len(workers) == 2, workers
            out["staged"] = _staged(tmp)
            sent = time.monotonic()
            proc.send_signal(stop)
            while any(_alive(w) for w in workers) and time.monotonic() - sent < 30:
                time.sleep(0.05)
            out["workers_s"] = time.monotonic() - sent
            out["alive"] = [w for w in workers if _alive(w)]
        out["rc"] = proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in out.get("alive", []):
            os.kill(pid, signal.SIGKILL)  # what this test started, by its pid
    reader.join(30)
    out.update(text="".join(lines), seconds=time.monotonic() - t0)
    return out


def _report(tmp: Path) -> tuple[str, str]:
    return "--parallel_report", str(tmp / REPORT)


def _per_rank(tmp: Path) -> list[str]:
    """Rank 1 given another model (a bit of one weight flipped), another dataset and another --iters."""
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl

    for r in (0, 1):
        shutil.copytree(DATA_DIR, tmp / f"model{r}")
        calibration_jsonl(tmp / f"calib{r}.jsonl", 16 + r, 32)
    weights = tmp / "model1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 1
    weights.write_bytes(data)
    args = _args(tmp, "OUT", "--parallel_quantization", "1", "--parallel_timeout", "60")
    for flag, value in (("--model", "MODEL"), ("--dataset", "DATA"), ("--iters", "ITERS")):
        args[args.index(flag) + 1] = value
    line = shlex.join([sys.executable, "-m", "dpq.autoround.cli", *args])
    line = (line.replace(" MODEL ", f' {shlex.quote(str(tmp))}/model"$RANK" ')
            .replace(" DATA ", f' {shlex.quote(str(tmp))}/calib"$RANK".jsonl ')
            .replace(" ITERS ", ' "$((4 + RANK))" ').replace(" OUT ", f" {shlex.quote(str(tmp / 'out'))} "))
    return [*_torchrun(2), "--no-python", "bash", "-c", f"exec {line}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("sigterm", "sigkill", "mismatch", "raised")}
    before = earlier_model(dirs["raised"] / "out")
    jobs = {  # the longest first: the pool of two ends with the short one
        "raised": (_cli(dirs["raised"]), _env(DPQ_TEST_FAULT="raise:1:1:1"), None, None),
        "sigterm": (_cli(dirs["sigterm"], *_report(dirs["sigterm"])), _env(DPQ_TEST_FAULT="hang:1:1:0"),
                    signal.SIGTERM, dirs["sigterm"]),
        "sigkill": (_cli(dirs["sigkill"], *_report(dirs["sigkill"])), _env(DPQ_TEST_FAULT="hang:1:1:0"),
                    signal.SIGKILL, dirs["sigkill"]),
        "mismatch": (_per_rank(dirs["mismatch"]), _env(), None, None),
    }
    with ThreadPoolExecutor(2) as pool:  # threads only wait on the subprocesses
        futures = {name: pool.submit(_run, *job) for name, job in jobs.items()}
        done = {name: f.result() for name, f in futures.items()}
    for name, r in done.items():
        r["dir"] = dirs[name]
        print(f"{name}: rc {r['rc']}, {r['seconds']:.1f} s" + (f", workers gone {r['workers_s']:.2f} s after the "
                                                             "signal" if "workers_s" in r else ""))
    done["raised"]["before"] = before
    return done


def _left(tmp: Path) -> list[str]:
    """What a run left in its folder besides its inputs."""
    inputs = {"calib.jsonl", "calib0.jsonl", "calib1.jsonl", "model0", "model1", REPORT}
    return sorted(p.name for p in tmp.iterdir() if p.name not in inputs)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_stopping_the_launcher_mid_block_stops_every_worker(runs, how):
    r = runs[how]
    assert r["staged"], "block 0's shards were not staged yet: nothing here could be half-written"
    assert not r["alive"] and r["workers_s"] < STOP_S, (r["workers_s"], r["text"][-4000:])
    assert _left(r["dir"]) == [], _left(r["dir"])  # no --output_dir (no shard, no config.json), no partial folder
    cause = "SIGTERM" if how == "sigterm" else "its launcher is gone"
    assert r["text"].count(f"dpq: {refusals.cancelled(cause)}") >= 2, r["text"][-4000:]  # each worker said why
    assert not WORKER_TRACEBACK.search(r["text"]), r["text"][-4000:]
    # rank 0's report: written on the way out by its cancel watcher (its main thread waits in a collective),
    # or by the main thread when the collective failed first (rank 1 left): a cancel, which one, where
    error = json.loads((r["dir"] / REPORT).read_text())["error"]
    assert error["kind"] == "cancelled" and error["where"] == "model.layers.1", error
    assert f"cancelled ({cause})" in error["message"] or f"cancelled: {cause}" in error["message"], error
    assert [b["name"] for b in json.loads((r["dir"] / REPORT).read_text())["blocks"]] == ["model.layers.0"]


def test_a_rank_with_another_job_is_refused_before_the_model_loads(runs):
    r = runs["mismatch"]
    text = r["text"]
    assert r["rc"] != 0 and not WORKER_TRACEBACK.search(text), text[-4000:]
    assert text.count("the ranks were given different jobs, so every rank stops before any work") == 2, text[-4000:]
    tmp = str(r["dir"])
    assert f"--model differs (rank 0: {tmp}/model0 (content " in text and f"rank 1: {tmp}/model1 (content " in text
    assert f"--dataset differs (rank 0: {tmp}/calib0.jsonl (content " in text
    assert "--iters differs (rank 0: 4; rank 1: 5)" in text
    assert "--output_dir" not in text.partition("different jobs")[2].partition("Fix:")[0]  # the same here anyway
    assert "start to quantize" not in text  # auto-round's first line after the model's name
    assert _left(r["dir"]) == []


def test_a_failed_run_leaves_an_earlier_model_untouched_and_names_the_rank(runs):
    r = runs["raised"]
    text = r["text"]
    assert r["rc"] != 0
    assert tree_bytes(r["dir"] / "out") == r["before"]  # bitwise, and no stray shard beside it
    assert _left(r["dir"]) == ["out"]  # no partial folder
    assert "auto-round-dp: dpq: rank 1 raised:\nTraceback (most recent call last):" in text, text[-4000:]
    assert "RuntimeError: injected lane failure (dpq test hook)" in text
    assert "dpq: the run failed on rank 1: RuntimeError: injected lane failure" in text and "this is rank 0" in text
    assert "the rank that raised printed its error with its traceback" in text
