"""Issue 29: the report says what ran and how it ended (a versioned schema), and a run killed while
writing it leaves the previous report or none, never half a file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dpq.autoround.outputs import SCHEMA, RunReport, error_of
from dpq.planning.plan import PlanRefused

HEADER = {"schema", "versions", "devices", "device_names", "command", "started", "ended", "wall_s", "exit_status"}


def _records():
    return [], {"collection": 0.5, "search": 0.0, "tune": 2.0}, []


def test_the_report_says_what_ran_and_how_it_ended(tmp_path):
    path = tmp_path / "r.json"
    report = RunReport(str(path), 2, "cpu,cpu", ["auto-round-dp", "--model", "m"], records=_records)
    assert report.write(error_of(PlanRefused(["no lanes"]), "model.layers.3"), 1) is None
    body = json.loads(path.read_text())
    assert HEADER <= set(body) and body["schema"] == SCHEMA == "dpq-report/1"
    assert set(body["versions"]) == {"dpq", "auto_round", "torch", "python"} and body["versions"]["torch"]
    assert body["devices"] == "cpu,cpu" and set(body["device_names"]) == {"cpu"} and body["device_names"]["cpu"]
    assert body["command"] == ["auto-round-dp", "--model", "m"] and body["exit_status"] == 1
    assert body["started"] <= body["ended"] and body["started"].endswith("+00:00") and body["wall_s"] >= 0
    assert body["error"] == {"kind": "refused", "where": "model.layers.3", "block": "model.layers.3", "lane": None,
                             "message": "dpq: the requested parallel quantization cannot run:\n  - no lanes"}
    ok = tmp_path / "ok.json"
    RunReport(str(ok), "auto", None, ["auto-round-dp"], records=_records).write(None, 0)
    body = json.loads(ok.read_text())
    assert body["error"] is None and body["exit_status"] == 0 and "cpu" in body["device_names"]


_KILLED = """
import os, signal, sys
from pathlib import Path
from dpq.autoround import outputs
where = sys.argv[2]
if where == "replace":  # the whole new report written beside, killed before it is moved into place
    outputs.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
else:  # killed halfway through writing the new report
    real = Path.write_text
    def half(self, text, *a, **k):
        real(self, text[: len(text) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    Path.write_text = half
report = outputs.RunReport(sys.argv[1], 2, "cpu,cpu", ["auto-round-dp"], records=lambda: ([], {"tune": 1.0}, []))
report.write(None, 0)
"""


@pytest.mark.parametrize("where", ["replace", "write"])
@pytest.mark.parametrize("previous", [True, False])
def test_a_run_killed_while_writing_leaves_the_previous_report_or_none(tmp_path, where, previous):
    path = tmp_path / "r.json"
    if previous:
        path.write_text(json.dumps({"schema": SCHEMA, "previous": True}))
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(path), where], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    if previous:
        assert json.loads(path.read_text()) == {"schema": SCHEMA, "previous": True}
    else:
        assert not path.exists()
