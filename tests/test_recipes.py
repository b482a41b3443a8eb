"""auto-round's recipe entry points (auto-round-best, -light, -rtn, -opt-rtn, -mllm) have dpq twins."""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import distributions
from pathlib import Path

import pytest

from dpq import cancel
from dpq.autoround import cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["best", "light", "rtn", "opt-rtn", "mllm"]


def _auto_round_scripts() -> dict[str, str]:
    for dist in distributions():
        if (dist.metadata["Name"] or "").lower() in ("auto-round", "auto-round-nightly", "auto_round"):
            return {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    pytest.skip("auto-round's distribution metadata not found")


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_maps_to_auto_rounds_runner(recipe):
    import importlib

    target = _auto_round_scripts()[f"auto-round-{recipe}"]  # e.g. auto_round.__main__:run_best
    module, _, name = target.partition(":")
    assert cli.runner_for(recipe) is getattr(importlib.import_module(module), name)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entry = scripts[f"auto-round-dp-{recipe}"]
    assert entry == f"dpq.autoround.cli:main_{recipe.replace('-', '_')}"
    assert callable(getattr(cli, entry.partition(":")[2]))
    assert cli.runner_for(None) is importlib.import_module(module).run


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_accepts_the_dp_flags(monkeypatch, recipe):
    from dpq.autoround import patches

    seen = {}

    def fake_runner():
        seen["argv"] = list(sys.argv)
        seen["world"] = patches.enabled_run().world
        seen["devices"] = patches.enabled_run().devices
        seen["active"] = (patches.enabled_run() is not None)

    monkeypatch.setattr(cli, "runner_for", lambda r: seen.setdefault("recipe", r) and fake_runner)
    # run as the command, main installs cancel handling: recorded, not installed in pytest's process
    # (its signal handlers and watcher thread would outlive the test)
    monkeypatch.setattr(cancel, "install", lambda **kw: seen.setdefault("cancel", kw))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    fn = getattr(cli, f"main_{recipe.replace('-', '_')}")
    monkeypatch.setattr(sys, "argv", ["auto-round-dp-" + recipe, "--model", "m", "--parallel_quantization", "2",
                                      "--parallel_devices", "cpu,cpu", "--iters", "0"])
    assert fn() == 0
    assert seen["recipe"] == recipe and seen["active"]
    assert seen["world"] == 2 and seen["devices"] == "cpu,cpu"
    assert seen["argv"][1:] == ["--model", "m", "--iters", "0"]  # ours taken out, the rest for auto-round
    assert patches.enabled_run() is None  # disabled at the end
    assert seen["cancel"] == {"watch_parent": False} and not cancel.installed()
