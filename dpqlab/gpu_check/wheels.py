"""The wheels carried to the H200 (``benchmarks/gpu_wheels.txt``), checked against the image.

Three files: ``gpu_wheels.txt`` pins every package the image lacks (``name==version``, one a line);
``gpu_image.txt`` is the image's own package list (a version where it was read, an assumed range
where a carried wheel needs one that was not read); ``gpu_wheels_metadata.json`` is a snapshot of
each pinned wheel's metadata as the index serves it for CPython 3.12 on manylinux x86_64 (the
wheel's file name, its sha256, ``Requires-Python`` and ``Requires-Dist``).

Offline resolution (:func:`resolve_offline`, ``tests/test_gpu_wheels.py``): pip's own resolver,
``pip install --dry-run --ignore-installed --no-index`` for Python 3.12 / cp / manylinux x86_64
with ``--only-binary=:all:``, over a folder of *stub* wheels: one per pinned wheel carrying its
snapshot metadata under its real file name (so its tags are checked), and one per image package
at its version with no requirements of its own (the image is installed as it is; what it needs is
its business). The roots are every pin and dpq's own requirements (pyproject: dependencies and the
``cuda13`` extra). A pin removed or conflicting (pydantic without its exact pydantic-core, datasets
beside a dill it excludes), a wheel without a CPython 3.12 manylinux build, or a requirement on the
image that its read version breaks, fails here in seconds, not on the GPU. Why a snapshot and not
a download at test time: the test then needs no network and no cache, and a wheel's metadata for
a given version never changes on the index; ``--fetch-wheels`` checks each downloaded file's
sha256 against the snapshot, so a snapshot that no longer matches the index fails loudly there.

What the snapshot cannot settle: the versions ``gpu_image.txt`` assumes. The GPU check's versions
step (:func:`fits_installed`) reads each on the machine and reports any that breaks a carried
wheel's requirement, with the versions read, before the first import.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "benchmarks" / "gpu_wheels.txt"
IMAGE = ROOT / "benchmarks" / "gpu_image.txt"
SNAPSHOT = ROOT / "benchmarks" / "gpu_wheels_metadata.json"
# The H200's interpreter and platform (KINDS.md: Python 3.12.3, x86-64, glibc manylinux)
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
          *(a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                        "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p))]


class WheelSetError(ValueError):
    """A pins, image or snapshot file that does not say what it must (the message names the line and the fix)."""


@dataclass(frozen=True)
class ImagePackage:
    """One package of the image: ``version`` where it was read (or inferred from a read pin),
    else ``assumed``: the range the carried wheels need of it (checked on the machine)."""

    name: str
    version: str | None = None
    assumed: str = ""

    @property
    def stub_version(self) -> str:
        """The version its stub wheel carries: the read one, else the lowest the assumption admits."""
        if self.version:
            return self.version
        floors = [s.version for s in SpecifierSet(self.assumed) if s.operator in (">=", "==", "~=")]
        return max(floors, key=Version) if floors else "0"


def read_pins(path: Path = PINS) -> dict[str, str]:
    """{canonical name: version} of ``gpu_wheels.txt``; every line must be ``name==version``."""
    pins: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version or req.marker or req.extras:
            raise WheelSetError(f"{path.name}:{n}: {line!r} is not 'name==version'. Fix: pin it exactly")
        name = canonicalize_name(req.name)
        if name in pins:
            raise WheelSetError(f"{path.name}:{n}: {name} is pinned twice. Fix: keep one version (two stop the "
                                f"install)")
        pins[name] = specs[0].version
    return pins


def read_image(path: Path = IMAGE) -> dict[str, ImagePackage]:
    out: dict[str, ImagePackage] = {}
    for line in path.read_text().splitlines():
        line, _, comment = line.partition("#")
        line = line.strip()
        if not line:
            continue
        req = Requirement(line)
        name = canonicalize_name(req.name)
        specs = list(req.specifier)
        read = len(specs) == 1 and specs[0].operator == "==" and "assumed" not in comment
        out[name] = ImagePackage(name, specs[0].version if read else None, "" if read else str(req.specifier))
    return out


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, dict]:
    return json.loads(path.read_text())["wheels"]


def dpq_requirements() -> list[str]:
    """dpq's own requirements on the GPU: pyproject's dependencies and its ``cuda13`` extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["cuda13"]]


def pip_env() -> dict[str, str]:
    """The environment for pip here: no configuration file and no PIP_* variable (a machine's own
    find-links, extra indexes or constraints must not decide what resolves)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _run_pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], env=pip_env(),
                          capture_output=True, text=True, timeout=300)


# -- stubs and the offline resolution ----------------------------------------------------------


def _dist(name: str) -> str:
    return canonicalize_name(name).replace("-", "_")


def write_stub(folder: Path, filename: str, name: str, version: str, requires_python: str | None = None,
               requires_dist: list[str] = ()) -> Path:
    """A wheel holding only its metadata: what pip's resolver reads of it."""
    info = f"{_dist(name)}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Python: {requires_python}"] if requires_python else []
    meta += [f"Requires-Dist: {r}" for r in requires_dist]
    tags = filename.removesuffix(".whl").split("-")[-3:]
    wheel = ["Wheel-Version: 1.0", "Generator: dpq-gpu-check (metadata stub)", "Root-Is-Purelib: true"]
    wheel += [f"Tag: {'-'.join(tags)}"]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", "\n".join(meta) + "\n")
        z.writestr(f"{info}/WHEEL", "\n".join(wheel) + "\n")
        z.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def write_stubs(folder: Path, pins: dict[str, str], image: dict[str, ImagePackage],
                snapshot: dict[str, dict]) -> None:
    """Stubs of every pinned wheel (snapshot metadata, real file name) and every image package."""
    for name, version in pins.items():
        meta = snapshot.get(name)
        if meta is None or meta["version"] != version:
            raise WheelSetError(f"{name}=={version} is not in {SNAPSHOT.name} (it has "
                                f"{meta and meta['version']}). Fix: python -m dpqlab.gpu_check.wheels snapshot")
        write_stub(folder, meta["filename"], name, version, meta.get("requires_python"), meta.get("requires_dist", []))
    for pkg in image.values():
        if pkg.name not in pins:
            write_stub(folder, f"{_dist(pkg.name)}-{pkg.stub_version}-py3-none-any.whl", pkg.name, pkg.stub_version)


def resolve_offline(pins: dict[str, str], image: dict[str, ImagePackage], snapshot: dict[str, dict],
                    work: Path, roots: list[str] | None = None) -> dict:
    """pip's resolver over the stubs, offline: {"ok", "install": {name: version}, "error"}."""
    stubs = work / "stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    write_stubs(stubs, pins, image, snapshot)
    roots = [f"{n}=={v}" for n, v in pins.items()] + dpq_requirements() if roots is None else roots
    report = work / "report.json"
    proc = _run_pip(["install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", str(stubs),
                     "--target", str(work / "target"), "--report", str(report), "--quiet", *TARGET, *roots])
    if proc.returncode != 0:
        return {"ok": False, "install": {}, "error": (proc.stderr or proc.stdout).strip()[-3000:]}
    installs = json.loads(report.read_text())["install"]
    return {"ok": True, "error": "",
            "install": {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}}


def resolution_problems(result: dict, pins: dict[str, str], image: dict[str, ImagePackage]) -> list[str]:
    """What is wrong with a resolution: it failed; a pinned wheel resolved to another version; a
    package neither carried nor in the image; a pin the image already has (carry one only for
    another version); a pin nothing needs."""
    if not result["ok"]:
        return [f"pip cannot resolve the set offline: {result['error']}"]
    problems = []
    for name, version in result["install"].items():
        if name in pins and pins[name] != version:
            problems.append(f"{name}: pinned {pins[name]}, resolved {version}")
        elif name not in pins and name not in image:
            problems.append(f"{name}=={version} is needed, neither carried nor in the image")
    problems += [f"{n} is pinned but the image has it" for n in pins if n in image]
    return problems


# -- on the GPU machine -------------------------------------------------------------------------


def fits_installed(snapshot: dict[str, dict], installed: dict[str, str | None],
                   environment: dict[str, str] | None = None) -> list[str]:
    """Every carried wheel's requirements (markers evaluated for ``environment``: the machine's)
    against the versions ``installed`` there ({canonical name: version, or None: absent}): what
    does not hold. On the machine before the first import, with ``importlib.metadata``'s versions."""
    problems = []
    for name, meta in snapshot.items():
        for line in meta.get("requires_dist", []):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**(environment or {}), "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            have = installed.get(dep)
            if have is None:
                problems.append(f"{name} needs {line}: not installed")
            elif not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {line}: {dep} {have} is installed")
    return problems


def installed_versions(names: list[str]) -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def required_names(snapshot: dict[str, dict]) -> list[str]:
    """Every carried wheel and every package one of them requires."""
    needed = {canonicalize_name(Requirement(r).name) for m in snapshot.values() for r in m.get("requires_dist", [])}
    return sorted(needed | set(snapshot))


# -- here, with the index: the snapshot and the download --------------------------------------


def take_snapshot(pins: dict[str, str]) -> dict[str, dict]:
    """Each pin's metadata as the index serves it for the H200 (pip's report: metadata only where
    the index offers it, no wheel downloaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = _run_pip(["install", "--dry-run", "--ignore-installed", "--no-deps", "--target", str(Path(tmp) / "t"),
                         "--report", str(report), "--quiet", *TARGET, *(f"{n}=={v}" for n, v in pins.items())])
        if proc.returncode != 0:
            raise WheelSetError(f"pip could not find every pin for CPython 3.12 manylinux x86_64:\n{proc.stderr}")
        installs = json.loads(report.read_text())["install"]
    out = {}
    for item in installs:
        meta, info = item["metadata"], item["download_info"]
        out[canonicalize_name(meta["name"])] = {
            "version": meta["version"], "filename": info["url"].rsplit("/", 1)[-1],
            "sha256": info.get("archive_info", {}).get("hashes", {}).get("sha256"),
            "requires_python": meta.get("requires_python"),
            "requires_dist": [r for r in meta.get("requires_dist", []) if "extra ==" not in r]}
    return dict(sorted(out.items()))


def fetch(dest: Path, pins: dict[str, str], snapshot: dict[str, dict]) -> list[str]:
    """Download every pin into ``dest`` (pip download --no-deps for the H200's Python and platform)
    and check each file against the snapshot; returns the problems."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = _run_pip(["download", "--no-deps", "-d", str(dest), *TARGET, *(f"{n}=={v}" for n, v in pins.items())])
    if proc.returncode != 0:
        return [f"pip download failed:\n{proc.stderr[-3000:]}"]
    problems = []
    for name, meta in snapshot.items():
        path = dest / meta["filename"]
        if not path.is_file():
            problems.append(f"{name}: {meta['filename']} was not downloaded")
        elif meta.get("sha256") and hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
            problems.append(f"{name}: {path.name} differs from the snapshot's sha256. Fix: python -m "
                            f"dpqlab.gpu_check.wheels snapshot, then rerun the wheel test")
    stale = sorted({p.name for p in dest.glob("*.whl")} - {m["filename"] for m in snapshot.values()})
    problems += [f"{dest}/{n} is not a pinned wheel (two versions stop the install). Fix: remove it" for n in stale]
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["snapshot", "fetch", "check"])
    p.add_argument("--dest", default=str(ROOT / ".whl"), help="fetch: where the wheels go")
    args = p.parse_args(argv)
    pins = read_pins()
    if args.command == "snapshot":
        SNAPSHOT.write_text(json.dumps({"source": "the package index, via pip's report (metadata only)",
                                        "target": "CPython 3.12, manylinux x86_64", "wheels": take_snapshot(pins)},
                                       indent=1) + "\n")
        print(f"wrote {SNAPSHOT}")
        return 0
    if args.command == "fetch":
        problems = fetch(Path(args.dest), pins, read_snapshot())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            problems = resolution_problems(resolve_offline(pins, read_image(), read_snapshot(), Path(tmp)), pins,
                                           read_image())
    for line in problems:
        print(line)
    print(f"{args.command}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
