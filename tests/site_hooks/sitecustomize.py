"""Test scaffolding applied in the test process and in every Python subprocess the tests start
(the CLI, torchrun workers, spawned processes): ``tests/conftest.py`` calls :func:`install` at
session start and prepends this directory to ``PYTHONPATH``, so that Python runs this file as
``sitecustomize`` when each subprocess starts. Three switches, all off unless set:

``DPQ_TEST_CPU_BF16=on|off`` forces auto-round's CPU bf16 detection. auto-round turns bf16
autocast (``amp``) on for a CPU only if CPUID reports AVX512-BF16
(``auto_round.utils.device.CpuInfo.bf16``, read once by the CPU device manager's
``supports_bf16``); otherwise the model runs fp32 ("amp is set to FALSE as the current cpu device
does not support the 'bf16' data type"). Which branch a machine takes must not decide whether the
suite passes, so the suite runs under both:

    off             CpuInfo.bf16 is False: the fp32 branch (CPUs without AVX512-BF16)
    on              CpuInfo.bf16 is True: bf16 autocast (emulated by torch, and slow, on a CPU
                    without AVX512-BF16)
    unset, "auto"   auto-round's own CPUID probe decides

``DPQ_TEST_MUTANT=<name>`` installs one of ``tests/mutants.py``'s bugs into dpq, for a test
that shows a subprocess's run (the CLI's) failing its statistical check.

``DPQ_TEST_FAULT=<exit|raise|hang>:<RANK>:<block>:<after>`` makes the process of that RANK (0
outside torchrun) fail in block ``<block>``'s lane loss from its call ``<after> + 1`` on (exit as
if killed, raise, or hang), for a test of torchrun's workers, which it cannot reach into: the
fault is injected through ``dpqlab.faults`` once ``dpq.session`` is imported.

Each patch is applied as its module is imported (an import hook: nothing is imported here, so no
auto-round object can read the detection before the patch); ``auto_round.utils.device`` is the
same module in auto-round 0.16 and 0.17. The runtime (``dpq/``) knows nothing of this. Standard
library only at import (subprocesses import it before anything else); a patch imports what it
applies when it runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

ENV = "DPQ_TEST_CPU_BF16"
MUTANT_ENV = "DPQ_TEST_MUTANT"
FAULT_ENV = "DPQ_TEST_FAULT"
_BF16_MODULE = "auto_round.utils.device"
_MUTANT_MODULE = "dpq.tune_loop"
_FAULT_MODULE = "dpq.session"
_VALUES = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False, "": None, "auto": None}
_HERE = os.path.dirname(os.path.abspath(__file__))


def forced() -> bool | None:
    """The forced CPU bf16 value from the environment, or None when auto-round's probe decides."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw not in _VALUES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected on, off or auto")
    return _VALUES[raw]


def _force_bf16(module) -> None:
    value = forced()
    module.CpuInfo.bf16 = property(lambda self: value, doc=f"forced to {value} by {ENV} (tests/site_hooks)")


def _install_mutant(module) -> None:
    spec = importlib.util.spec_from_file_location("dpq_tests_mutants", os.path.join(_HERE, "..", "mutants.py"))
    mutants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutants)
    mutants.apply(setattr, os.environ[MUTANT_ENV])


def _inject_fault(module) -> None:
    # dpq.session is loaded (the module faults replace a name in): the scaffolding may import now
    from dpqlab.faults import inject_from_environment

    inject_from_environment()


def _patches() -> dict:
    """{module name: patch} for what the environment asks for."""
    out = {}
    if forced() is not None:
        out[_BF16_MODULE] = _force_bf16
    if os.environ.get(MUTANT_ENV):
        out[_MUTANT_MODULE] = _install_mutant
    if os.environ.get(FAULT_ENV):
        out[_FAULT_MODULE] = _inject_fault
    return out


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the module it executed."""

    def __init__(self, loader, patch) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):  # get_resource_reader, get_filename, ...: the real loader's
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    dpq_site_hook = True  # marks this finder whichever copy of this file defined it

    def __init__(self, patches: dict) -> None:
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "dpq_site_hook", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> bool | None:
    """Apply the environment's switches to this process (once); returns the forced CPU bf16
    value (None: not forced)."""
    if not any(getattr(f, "dpq_site_hook", False) for f in sys.meta_path):
        patches = _patches()
        for name in [n for n in patches if n in sys.modules]:  # imported already: patch it now
            patches.pop(name)(sys.modules[name])
        if patches:
            sys.meta_path.insert(0, _Finder(patches))
    return forced()


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this file shadows on ``sys.path``, if there is one."""
    for entry in sys.path:
        if entry and os.path.abspath(entry) != _HERE:
            candidate = os.path.join(entry, "sitecustomize.py")
            if os.path.isfile(candidate):
                spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
                return


if __name__ == "sitecustomize":  # run by site at interpreter start (PYTHONPATH), not when conftest loads it
    install()
    _chain_next_sitecustomize()
