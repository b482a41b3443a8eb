"""Shared fixtures: a tiny Llama and the real blocks auto-round tunes, recorded mid-run."""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dpqlab.autoround_blocks import record_autoround_blocks


def _load_site_hooks():
    """tests/site_hooks: ``DPQ_TEST_CPU_BF16=on|off`` forces auto-round's CPU bf16 detection,
    applied here before any auto-round object is built; the directory goes first on PYTHONPATH (the
    repository root next: dpqlab, which no install provides) so
    that every subprocess applies it too (and ``DPQ_TEST_MUTANT`` and ``DPQ_TEST_FAULT``,
    which tests set for a subprocess of their own)."""
    hooks_dir = Path(__file__).parent / "site_hooks"
    spec = importlib.util.spec_from_file_location("dpq_tests_site_hooks", hooks_dir / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(hooks_dir)]
    root = str(Path(__file__).resolve().parent.parent)  # dpqlab (the tools) for subprocesses: not installed
    path = [p for p in path if p != root]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hooks_dir), root, *path])
    return module


SITE_HOOKS = _load_site_hooks()


def cpu_bf16_expected() -> bool:
    """What auto-round decides for a CPU in this session: the forced value, else its CPUID probe."""
    forced = SITE_HOOKS.forced()
    if forced is not None:
        return forced
    from auto_round.utils.device import CpuInfo

    return bool(CpuInfo().bf16)


def pytest_terminal_summary(terminalreporter):
    """Which of auto-round's CPU precision branches this session ran (shown also under -q)."""
    forced = SITE_HOOKS.forced()
    how = f"forced by {SITE_HOOKS.ENV}" if forced is not None else "auto-round's CPUID probe"
    terminalreporter.write_line(f"auto-round CPU bf16 autocast: {cpu_bf16_expected()} ({how})")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``, ``--dist loadgroup``): the tests that share a module-scoped
    fixture of their own module go to one worker, so that the fixture (a set of CLI or torchrun
    runs, a recorded block) is built once; every other test is scheduled on its own."""
    if not getattr(config.option, "numprocesses", None):
        return
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shared = sorted(name for name, fixturedefs in defs.items()
                        if fixturedefs and fixturedefs[-1].scope == "module"
                        and fixturedefs[-1].baseid.split("::")[0] == item.nodeid.split("::")[0])
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.nodeid.split('::')[0]}:{shared[0]}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """auto-round calls ``gc.collect()`` several times per block and dpq once per block's teardown;
    in one long pytest process each walked everything alive (the imported libraries and every
    fixture and cache made so far): about two thirds of an in-process auto-round test's time. The
    CLI freezes its imported heap for the same reason (``dpq.autoround.cli._freeze_imported_heap``).
    Here everything alive once a test's fixtures are set up is frozen, so that the collections the
    test triggers walk only what the test makes. Frozen objects are still freed by reference counting;
    cycles among them wait for the next module's first test, where everything is unfrozen and
    collected before freezing again. (``gc.get_objects()`` lists only what is not frozen: a census
    inside a test sees what the test made.)"""
    import gc

    module = getattr(item, "module", None)
    if item.session.stash.get(_LAST_MODULE, None) is not module:
        item.session.stash[_LAST_MODULE] = module
        gc.unfreeze()
        gc.collect()
    try:
        return (yield)
    finally:
        gc.freeze()


_LAST_MODULE = pytest.StashKey[object]()  # the module of the test set up last (its first test unfreezes, collects)


def cast_floating(value, dtype: torch.dtype):
    """``value`` with every floating tensor in it (lists, tuples, dicts too) cast to ``dtype``: a
    recorded block's pool in the other precision branch."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value



class ForwardFault:
    """A forward pre-hook that raises from its call ``after + 1`` on: a lane running out of memory
    in its forward. An object, not a closure, so that the error's traceback holds nothing of the
    test's own (tests check that a caught error keeps no mirror alive)."""

    def __init__(self, after: int) -> None:
        self.after, self.calls = after, 0

    def __call__(self, module, args):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("injected lane failure")


@dataclass
class GlobalState:
    """The process-global state a test can change and a later test's numbers depend on."""

    threads: int  # intra-op threads: they change CPU reduction order, so results
    torch_rng: torch.Tensor
    cuda_rng: list | None
    py_rng: object
    grad: bool
    default_dtype: torch.dtype
    autocast: dict  # device type -> (enabled, dtype)
    autocast_cache: bool

    @classmethod
    def capture(cls) -> GlobalState:
        cuda = torch.cuda.is_available()
        amp_types = ["cpu"] + (["cuda"] if cuda else [])
        return cls(
            threads=torch.get_num_threads(),
            torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if cuda else None,
            py_rng=random.getstate(),
            grad=torch.is_grad_enabled(),
            default_dtype=torch.get_default_dtype(),
            autocast={d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in amp_types},
            autocast_cache=torch.is_autocast_cache_enabled(),
        )

    def apply(self) -> None:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        torch.set_grad_enabled(self.grad)
        torch.set_default_dtype(self.default_dtype)
        for d, (enabled, amp_dtype) in self.autocast.items():
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, amp_dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)


@pytest.fixture(scope="session", autouse=True)
def _baseline_state() -> GlobalState:
    """Captured before any other session or module fixture runs (autouse, session scope)."""
    return GlobalState.capture()


@pytest.fixture(autouse=True)
def same_global_state_for_every_test(_baseline_state):
    """No result may depend on which tests ran before: every test starts from the session's
    baseline global state (threads, torch/python RNG, grad mode, default dtype, autocast), and
    whatever it or a module/session fixture set up for it changed is put back afterwards. A test
    (or a function-scoped fixture) sets what it needs itself."""
    _baseline_state.apply()
    yield
    _baseline_state.apply()


@pytest.fixture(scope="session")
def recorded_blocks():
    return record_autoround_blocks()
