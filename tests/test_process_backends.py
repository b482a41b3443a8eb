"""The process group auto-round-dp starts under torchrun, per lane type (dpq.autoround.process_setup).

Only gloo runs here (tests/test_torchrun.py); NCCL has run with one rank only, HCCL (Gaudi) and
XCCL (Intel GPUs) never. Their call sequence is checked against a recording fake: a fake
``habana_frameworks.torch.distributed.hccl`` module whose import is recorded, and recording
``torch.distributed.init_process_group`` / ``torch.<type>.set_device``. The order is the point:
Habana's backend registers when its module is imported, so the import precedes
``init_process_group``; a rank binds to its device before its group starts."""

from __future__ import annotations

import datetime
import importlib
import sys
import types
from types import MappingProxyType

import pytest
import torch

from dpq.autoround import process_setup
from dpq.autoround.process_setup import process_lanes, start_group

HCCL = "habana_frameworks.torch.distributed.hccl"


class Recorder:
    """Records, in order, the import of Habana's HCCL module, set_device calls and init_process_group."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple] = []
        self._mp = monkeypatch
        real_import = importlib.import_module

        def import_module(name, package=None):
            if name == HCCL:
                self.calls.append(("import", name))
                return self._fake_hccl()
            return real_import(name, package)

        monkeypatch.setattr(process_setup.importlib, "import_module", import_module)
        monkeypatch.setattr(torch.distributed, "init_process_group",
                            lambda backend=None, timeout=None, **kw: self.calls.append(("init", backend, timeout)))
        for kind in ("cuda", "xpu"):
            mod = getattr(torch, kind, None) or types.SimpleNamespace()
            monkeypatch.setattr(mod, "set_device", lambda dev, kind=kind: self.calls.append(("set_device", str(dev))),
                                raising=False)

    def _fake_hccl(self) -> types.ModuleType:
        """The module Habana ships, faked; in sys.modules as a real import would leave it."""
        mod = types.ModuleType(HCCL)
        for name in ("habana_frameworks", "habana_frameworks.torch", "habana_frameworks.torch.distributed"):
            self._mp.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
        self._mp.setitem(sys.modules, HCCL, mod)
        return mod


def order_ok(calls: list[tuple], first: str, then: str) -> bool:
    """Whether every ``first`` call comes before the ``init`` call (and both happened)."""
    kinds = [c[0] for c in calls]
    return first in kinds and then in kinds and max(i for i, k in enumerate(kinds) if k == first) < kinds.index(then)


TIMEOUT = datetime.timedelta(seconds=42)


def test_hpu_imports_habanas_module_before_init_with_hccl(monkeypatch):
    rec = Recorder(monkeypatch)
    devices, rest, kind = process_lanes(1, None, ["--model", "m"], 3, "hpu")
    assert (devices, rest, kind) == (None, ["--model", "m"], "hpu")  # the bridge maps LOCAL_RANK to its Gaudi
    start_group(kind, 42, None)
    assert rec.calls == [("import", HCCL), ("init", "hccl", TIMEOUT)]
    assert order_ok(rec.calls, "import", "init") and HCCL in sys.modules


@pytest.mark.parametrize("kind, backend", [("xpu", "cpu:gloo,xpu:xccl"), ("cuda", "cpu:gloo,cuda:nccl")])
def test_gpus_bind_their_device_before_init(monkeypatch, kind, backend):
    rec = Recorder(monkeypatch)
    devices, rest, got = process_lanes(1, None, ["--model", "m"], 3, kind)
    assert (devices, rest[-2:], got) == (f"{kind}:3", ["--device_map", "3"], kind)  # LOCAL_RANK 3: its own GPU
    start_group(got, 42, devices.split(",")[0])
    assert rec.calls == [("set_device", f"{kind}:3"), ("init", backend, TIMEOUT)]
    two = process_lanes(2, None, [], 1, kind)[0]
    assert two == f"{kind}:2,{kind}:3"


def test_cpu_lanes_start_gloo_with_no_device_call(monkeypatch):
    rec = Recorder(monkeypatch)
    for devices, rest, acc in (("cpu", [], "xpu"), (None, ["--device_map", "cpu"], "hpu"), (None, [], "cpu")):
        rec.calls.clear()
        got = process_lanes(1, devices, rest, 1, acc)
        assert got == (devices, rest, "cpu")
        start_group(got[2], 42, devices)
        assert rec.calls == [("init", "gloo", TIMEOUT)]


def test_the_order_check_fails_when_the_import_comes_after_init(monkeypatch):
    """The fake can fail: a sequence that imported Habana's module after init_process_group (where
    the hccl backend would not be registered yet) is caught, as is one that never imported it."""
    rec = Recorder(monkeypatch)
    torch.distributed.init_process_group(backend="hccl", timeout=TIMEOUT)
    process_setup.importlib.import_module(HCCL)
    assert [c[0] for c in rec.calls] == ["init", "import"]
    assert not order_ok(rec.calls, "import", "init")
    assert not order_ok([("init", "hccl", TIMEOUT)], "import", "init")
    monkeypatch.setattr(process_setup, "SETUPS",  # a setup that forgot it
                        MappingProxyType({**process_setup.SETUPS, "hpu": process_setup.GroupSetup("hccl")}))
    rec.calls.clear()
    start_group("hpu", 42, None)
    assert not order_ok(rec.calls, "import", "init")


def test_explicit_device_lists_pick_the_backend_of_their_type():
    assert process_lanes(1, "xpu:1", [], 0, "cuda") == ("xpu:1", [], "xpu")
    assert process_lanes(1, "1", [], 0, "xpu") == ("1", [], "xpu")  # bare indices: the accelerator's
    assert process_lanes(1, "cpu,cpu", [], 0, "cuda")[2] == "cpu"
    assert process_lanes(2, None, ["--device_map", "0,1"], 1, "cuda") == (None, ["--device_map", "0,1"], "cuda")
    assert {k: s.backend for k, s in process_setup.SETUPS.items()} == {
        "cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "xpu": "cpu:gloo,xpu:xccl", "hpu": "hccl"}


def test_several_hpu_lanes_in_one_process_point_to_torchrun():
    from dpq import refusals

    text = refusals.HPU_MULTI_LANE
    assert "torchrun --nproc-per-node" in text and "--parallel_quantization 1" in text and "HCCL" in text
