"""Issue 29: what the command line and the machine reveal without the model is refused before the
model loads (exit 2, each reason once, nothing created); one parser, auto-round's, with a ``dpq``
group and one source of help texts that the README's flag table follows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpq import refusals
from dpq.autoround import cli
from dpq.demo.embedded import DATA_DIR
from dpq.planning.machine import Machine
from dpq.planning.spec import FLAGS, ParallelSpec, SpecError

ROOT = Path(__file__).resolve().parent.parent
CPU_TORCH_ON_A_GPU_BOX = Machine("2.13.0+cpu", frozenset(), {}, nvidia_driver=True)
CPU_MACHINE = Machine("2.13.0+cpu", frozenset(), {}, nvidia_driver=False)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _no_model(monkeypatch) -> None:
    """Any weight read, or auto-round's runner starting, fails the test."""
    import safetensors
    import safetensors.torch

    def read(*a, **k):
        raise AssertionError("a model weight was read")

    monkeypatch.setattr(safetensors, "safe_open", read)
    monkeypatch.setattr(safetensors.torch, "load_file", read)
    monkeypatch.setattr(cli, "runner_for", lambda recipe: read)


def _refused(capsys, monkeypatch, tmp_path, machine: Machine, *flags: str) -> str:
    """``flags`` on the embedded model, refused with exit 2 before any weight is read, nothing created
    under ``tmp_path`` (the working folder); returns the error as said (past auto-round's usage line)."""
    _no_model(monkeypatch)
    monkeypatch.setattr(Machine, "detect", classmethod(lambda cls: machine))
    monkeypatch.chdir(tmp_path)
    before = _listing(tmp_path)
    rc = cli.main(["--model", str(DATA_DIR), "--device_map", "cpu", "--output_dir", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert err.startswith("usage: auto-round-dp ") and err.count("usage:") == 1, err[:300]
    assert _listing(tmp_path) == before
    return err.partition("auto-round-dp: error: ")[2]


def _once(err: str, *texts: str) -> None:
    for text in texts:
        assert err.count(text) == 1, (text, err)


@pytest.mark.parametrize("case", ["world > devices", "missing type", "cpu torch, cuda lanes", "report", "timeout"])
def test_each_flag_only_refusal_stops_before_the_model(capsys, monkeypatch, tmp_path, case):
    if case == "world > devices":
        err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "3",
                       "--parallel_devices", "cpu,cpu")
        _once(err, refusals.too_few_devices(3, ["cpu", "cpu"], True))
    elif case == "missing type":
        err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "2",
                       "--parallel_devices", "xpu:0,xpu:1")
        _once(err, refusals.torch_lacks_type(["xpu:0", "xpu:1"], "xpu", "2.13.0+cpu", False, "cpu,cpu"))
        assert "Fix: lanes that exist here, e.g. --parallel_devices cpu,cpu" in err
    elif case == "cpu torch, cuda lanes":  # the driver is there: the install is what is wrong
        err = _refused(capsys, monkeypatch, tmp_path, CPU_TORCH_ON_A_GPU_BOX, "--parallel_quantization", "2",
                       "--parallel_devices", "cuda:0,cuda:1")
        _once(err, "this torch (2.13.0+cpu) is a build without cuda support")
        assert "Fix: install a CUDA build of torch: pip install torch --index-url" in err
    elif case == "report":
        (tmp_path / "afile").write_text("")
        err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "2",
                       "--parallel_devices", "cpu,cpu", "--parallel_report", str(tmp_path / "afile" / "new" / "r.json"))
        _once(err, f"{tmp_path / 'afile'} is a file, not a folder")
    else:
        err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "2",
                       "--parallel_devices", "cpu,cpu", "--parallel_timeout", "1")
        _once(err, refusals.timeout_out_of_range("1", 10, 604800))
        assert "not a number" not in err


def test_every_reason_at_once_each_once(capsys, monkeypatch, tmp_path):
    """``gpu,gpu`` said its line twice; a report folder was made for a refused run."""
    err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "auto",
                   "--parallel_devices", "gpu,gpu", "--parallel_timeout", "x", "--parallel_report",
                   str(tmp_path / "new" / "r.json"))
    assert err.startswith("2 problems, all listed:"), err
    _once(err, "'gpu' is not a device", refusals.timeout_not_a_number("x", 10, 604800))
    assert not (tmp_path / "new").exists()


def test_overlap_where_it_cannot_apply(capsys, monkeypatch, tmp_path):
    err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "2",
                   "--parallel_devices", "cpu,cpu", "--parallel_overlap")
    _once(err, refusals.OVERLAP_ON_CPU)
    err = _refused(capsys, monkeypatch, tmp_path, CPU_MACHINE, "--parallel_quantization", "1", "--parallel_overlap")
    _once(err, refusals.OVERLAP_ON_CPU)  # (the home is the CPU: --device_map cpu)


def test_overlap_at_world_1_is_a_setting_under_several_processes():
    """``enable(1, ..., parallel_overlap=True)`` on each of 2 torchrun processes is world 2: not refused."""
    assert ParallelSpec.build(1, "cuda:0", parallel_overlap=True).overlap is True


def test_a_machine_with_the_lanes_passes(monkeypatch):
    """The same flags on a machine that has the devices: no problem (the spec is built)."""
    gpus = Machine("2.13.0+cu128", frozenset({"cuda"}), {"cuda": 2}, True)
    spec = ParallelSpec.build(2, "cuda:0,cuda:1", parallel_overlap=True, machine=gpus)
    assert (spec.world, spec.devices, spec.overlap, spec.timeout) == (2, "cuda:0,cuda:1", True, 600.0)
    with pytest.raises(SpecError, match=r"cuda:2 does not exist: this machine has 2 cuda devices \(cuda:0..1\)"):
        ParallelSpec.build(2, "cuda:0,cuda:2", machine=gpus)


def test_the_command_refuses_without_reading_a_weight(tmp_path):
    """The real command in its own process, on a CPU build of torch: CUDA lanes stop before anything
    loads (a weight read would raise), nothing is created in the working folder."""
    if "+cpu" not in __import__("torch").__version__:
        pytest.skip("needs a CPU build of torch")
    prelude = ("import safetensors, safetensors.torch\n"
               "def read(*a, **k): raise SystemExit('a model weight was read')\n"
               "safetensors.safe_open = safetensors.torch.load_file = read\n")
    code = prelude + "from dpq.autoround.cli import main; raise SystemExit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "--model", str(DATA_DIR), "--parallel_quantization", "2",
                           "--parallel_devices", "cuda:0,cuda:1", "--parallel_report", "rep/r.json"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("is a build without cuda support") == 1 and "weight was read" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


# -- one parser --

def test_help_is_auto_rounds_with_a_dpq_group(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: auto-round-dp ") and out.count("usage:") == 1
    assert "\ndpq:\n" in out and "--parallel_quantization {off,auto,N}" in out and "--model_name" in out
    assert cli.main(["quantize", "--help"]) == 0 and capsys.readouterr().out == out


def test_a_close_miss_gets_a_did_you_mean(capsys):
    assert cli.main(["--model", "m", "--parallel-quantization", "2"]) == 2
    err = capsys.readouterr().err
    assert "auto-round-dp: error: unrecognized arguments: --parallel-quantization" in err
    assert "Did you mean --parallel_quantization?" in err
    assert cli.main(["--model", "m", "--parallel_devcies=cpu,cpu"]) == 2
    assert "Did you mean --parallel_devices?" in capsys.readouterr().err


def _readme_flags() -> dict[str, str]:
    """The README's flag table: flag as shown -> meaning, markdown's backticks dropped."""
    rows = re.findall(r"^\| `(--parallel_[^`]+)` \| (.+) \|$", (ROOT / "README.md").read_text(), re.M)
    return {flag: meaning.replace("`", "") for flag, meaning in rows}


def test_the_readme_flag_table_is_the_parsers_help():
    readme = _readme_flags()
    assert readme == {f.usage: f.help for f in FLAGS}, set(readme) ^ {f.usage for f in FLAGS}


def test_the_api_takes_the_flags_names_and_defaults():
    import inspect

    from dpq.autoround.integration import enable

    params = inspect.signature(enable).parameters
    for flag in FLAGS:
        if flag.name in ("parallel_report", "parallel_plan"):
            continue  # the command's own: a report file, a screen
        assert flag.name in params, flag.name
        default = params[flag.name].default
        assert default is inspect.Parameter.empty if flag.name == "parallel_quantization" else \
            default == flag.default, (flag.name, default)


def test_enable_refuses_overlap_on_cpu_lanes_as_the_command_does():
    """Issue 42 (low): ``enable(2, "cpu,cpu", parallel_overlap="on")`` was accepted where the command refuses
    ``--parallel_overlap`` on CPU lanes; nothing is enabled."""
    from dpq.autoround import integration

    with pytest.raises(SpecError) as info:
        integration.enable(2, "cpu,cpu", parallel_overlap="on")
    assert info.value.problems == [refusals.overlap_on_cpu("enable")]
    assert integration.disable() is None  # nothing was enabled
    assert ParallelSpec.build(2, "cpu,cpu", parallel_overlap="auto").overlap is None  # auto stays a setting


@pytest.mark.parametrize("kwargs", [dict(timeout=-1), dict(timeout=0), dict(timeout=float("nan")),
                                    dict(timeout=float("inf")), dict(timeout=None), dict(timeout="abc"),
                                    dict(timeout=True), dict(overlap="maybe"), dict(world=0),
                                    dict(world=3, devices="cpu,cpu"), dict(devices=5.5)])
def test_a_spec_cannot_exist_invalid(kwargs):
    """Issue 42's third sweep, M6: ``dpq.parallel_tune`` built ``ParallelSpec(...)`` directly, skipping
    ``build``'s checks, so ``timeout=-1`` (or 0, nan) stopped the run mid-block as hung, ``timeout=None`` raised
    TypeError and ``timeout=inf`` ran with no watchdog. Every construction is checked now (Note [a spec
    cannot exist invalid]); the engine's own short watchdog (0.3 s in tests/test_watchdog.py) stays valid."""
    args = dict(world=2, devices="cpu,cpu")
    args.update(kwargs)
    with pytest.raises(SpecError) as info:
        ParallelSpec(**args)
    assert info.value.problems and all("Fix: " in p for p in info.value.problems), info.value.problems
    assert ParallelSpec(2, "cpu,cpu", timeout=0.3).timeout == 0.3
    spec = ParallelSpec("2", ["cpu", "cpu"], overlap="ON", timeout="60")  # the forms a setting may come in
    assert (spec.world, spec.overlap, spec.timeout) == (2, True, 60.0)


@pytest.mark.parametrize("kwargs, said", [
    (dict(parallel_timeout=-1), "parallel_timeout=-1 is outside 10 to 604800 seconds"),
    (dict(parallel_timeout="abc"), "parallel_timeout='abc' is not a number of seconds"),
    (dict(parallel_overlap="maybe"), "parallel_overlap='maybe' is not a setting"),
    (dict(parallel_quantization=0), "Fix: pass e.g. parallel_quantization=2"),
    (dict(parallel_quantization=3), "Fix: parallel_devices= with one device per lane"),
    (dict(parallel_devices="gpu,gpu"), "Fix: parallel_devices= with entries like"),
    (dict(parallel_quantization="off", parallel_debug=True), "parallel_debug has no effect with "
                                                             "parallel_quantization='off'"),
    (dict(parallel_quantization="off", parallel_timeout=60), "parallel_timeout has no effect"),
])
def test_enables_refusals_name_its_keywords(kwargs, said):
    """Issue 42's third sweep, M10: ``enable()``'s refusals named the command's flags
    (``--parallel_devices``) to a caller who typed keywords (``parallel_devices=``)."""
    from dpq.autoround import integration

    args = dict(parallel_quantization=2, parallel_devices="cpu,cpu")
    args.update(kwargs)
    if args["parallel_quantization"] == "off":
        del args["parallel_devices"]
    with pytest.raises(SpecError) as info:
        integration.enable(**args)
    text = str(info.value)
    assert said in text and "--parallel" not in text, text
    assert integration.disable() is None


@pytest.mark.parametrize("kwargs, said", [
    (dict(parallel_overlap="maybe"), "parallel_overlap='maybe' is not a setting"),
    (dict(parallel_devices="gpu"), "Fix: parallel_devices= with entries like"),
    (dict(parallel_devices="cuda:0,cuda:1"), "Fix: lanes that exist here, e.g. parallel_devices='cpu,cpu'"),
    (dict(parallel_quantization=0), "Fix: pass e.g. parallel_quantization=2"),
    (dict(home="gpu"), "home='gpu' is not a device"),
    (dict(home="cuda:0"), "home='cuda:0' is not a device of this machine"),
    (dict(seqlen=-5), "seqlen must be an integer >= 1, got -5"),
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(model=None), "model is a NoneType, not a model"),
    (dict(model="/nonexistent/model"), "model '/nonexistent/model' is a path, but nothing is there"),
])
def test_plan_for_refuses_in_its_keywords_before_reading_anything(monkeypatch, kwargs, said):
    """Issue 42's third sweep, M10 and M11: ``dpq.plan_for``'s refusals named the command's flags, and
    lanes or a home this machine lacks raised torch's AssertionError, home='gpu' a RuntimeError,
    seqlen=-5 a RuntimeError, model=None retried the network for half a minute: one ValueError now,
    every problem in plan_for's keywords, before any config is read."""
    import dpq
    import dpq.autoround.plan_screen as plan_screen

    if not CPU_MACHINE.built:
        monkeypatch.setattr(Machine, "detect", staticmethod(lambda: CPU_MACHINE))
    monkeypatch.setattr(plan_screen, "_meta_model", lambda *a: pytest.fail("read the model's config"))
    args = dict(model=str(DATA_DIR))
    args.update(kwargs)
    if "cuda" in str(kwargs) and Machine.detect().count("cuda"):
        pytest.skip("this machine has cuda devices")
    with pytest.raises(SpecError) as info:
        dpq.plan_for(args.pop("model"), **args)
    text = str(info.value)
    assert said in text and "--parallel" not in text, text


def test_plan_for_off_is_the_commands_screen():
    """``plan_for(parallel_quantization='off')`` raised "invalid literal for int()": the screen of every
    world, as ``auto-round-dp --parallel_plan`` without a world shows."""
    import dpq

    assert "auto would choose" in str(dpq.plan_for(str(DATA_DIR), parallel_quantization="off", nsamples=2,
                                                   batch_size=2, seqlen=32))
