"""The wheels carried to the H200 resolve completely against the image, offline (pip's resolver over
metadata stubs: dpqlab/gpu_check/wheels.py says how and why), and the check sees a pin removed,
a conflicting version and an image that breaks a requirement."""

from __future__ import annotations

import pytest

from dpqlab.gpu_check import wheels


@pytest.fixture(scope="module")
def wheel_set():
    return wheels.read_pins(), wheels.read_image(), wheels.read_snapshot()


def test_every_line_is_pinned_and_the_snapshot_matches(wheel_set, tmp_path):
    pins, _, snapshot = wheel_set
    assert pins and {n: m["version"] for n, m in snapshot.items()} == pins
    assert all(m["sha256"] and m["filename"].endswith(".whl") for m in snapshot.values())
    loose = tmp_path / "pins.txt"
    loose.write_text(wheels.PINS.read_text() + "tqdm>=4\n")
    with pytest.raises(wheels.WheelSetError, match="not 'name==version'"):
        wheels.read_pins(loose)


def test_gpu_wheels_resolve_offline_against_the_image(wheel_set, tmp_path):
    pins, image, snapshot = wheel_set
    result = wheels.resolve_offline(pins, image, snapshot, tmp_path)
    assert result["ok"], result["error"]
    assert not wheels.resolution_problems(result, pins, image)
    assert {n: result["install"][n] for n in pins} == pins  # every pin is needed and resolved as pinned
    assert result["install"]["torch"] == image["torch"].version == "2.11.0"  # the image's own, not carried


@pytest.mark.parametrize("removed", sorted(wheels.read_pins()))
def test_gpu_wheels_fail_with_a_pin_removed(wheel_set, tmp_path, removed):
    pins, image, snapshot = wheel_set
    less = {n: v for n, v in pins.items() if n != removed}
    problems = wheels.resolution_problems(wheels.resolve_offline(less, image, snapshot, tmp_path), less, image)
    assert problems and f"for {removed}" in problems[0].lower().replace("_", "-"), problems


def test_gpu_wheels_fail_on_a_conflict(wheel_set, tmp_path):
    """pydantic needs its exact pydantic-core; auto-round needs transformers >= 4.38 of the image."""
    pins, image, snapshot = wheel_set
    core = snapshot["pydantic-core"]
    other = dict(snapshot, **{"pydantic-core": dict(core, version="2.41.4",
                                                   filename=core["filename"].replace("2.41.5", "2.41.4"))})
    bad = dict(pins, **{"pydantic-core": "2.41.4"})
    result = wheels.resolve_offline(bad, image, other, tmp_path / "a")
    assert not result["ok"] and "Cannot install pydantic-core==2.41.4 and pydantic==2.12.5" in result["error"], result
    old = dict(image, transformers=wheels.ImagePackage("transformers", "4.30.0"))
    result = wheels.resolve_offline(pins, old, snapshot, tmp_path / "b")
    assert not result["ok"] and "transformers" in result["error"], result


def test_fits_installed_names_what_the_machine_breaks(wheel_set):
    """The versions step's check on the machine: the read versions against every carried wheel's needs."""
    pins, image, snapshot = wheel_set
    good = {n: p.stub_version for n, p in image.items()} | pins
    env = {"python_version": "3.12", "platform_machine": "x86_64", "sys_platform": "linux"}
    assert wheels.fits_installed(snapshot, good, env) == []
    broken = dict(good, pyarrow="19.0.1", dill=None)
    problems = wheels.fits_installed(snapshot, broken, env)
    assert any("pyarrow 19.0.1 is installed" in p for p in problems), problems
    assert any("dill" in p and "not installed" in p for p in problems), problems
