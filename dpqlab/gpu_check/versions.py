"""The versions step (core, first): torch, CUDA, the card and its driver, NCCL, CuPy, auto-round and
what it imports; every carried wheel's requirements against the versions installed on the machine
(``wheels.fits_installed``: the image's versions that benchmarks/gpu_image.txt only assumed are
read here). A missing wheel stops the run here (the shell skips every later step)."""

from __future__ import annotations

import os
import platform
import subprocess

from dpqlab.gpu_check import wheels
from dpqlab.gpu_check.common import ROOT, check, verdict

PROOFS = ["wheels present", "wheels fit the image"]


def _version(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "unavailable (not installed)"


def _fit() -> tuple[dict, list[str]]:
    """The versions every carried wheel needs, as installed here, and what does not hold."""
    snapshot = wheels.read_snapshot()
    installed = wheels.installed_versions(wheels.required_names(snapshot))
    env = {"python_version": ".".join(platform.python_version_tuple()[:2]), "platform_machine": platform.machine(),
           "sys_platform": "linux" if platform.system() == "Linux" else platform.system().lower()}
    return installed, wheels.fits_installed(snapshot, installed, env)


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unavailable"
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"


def _dry(out: dict) -> dict:
    """On CPU (--dry-run): versions from the packages' metadata and each module found by its import
    spec, nothing imported (the real run imports each)."""
    import importlib.util

    missing = [f"{mod}: not found" for mod in ("torch", "auto_round", "transformers")
               if importlib.util.find_spec(mod) is None]
    if not (ROOT / "dpq" / "autoround" / "__init__.py").is_file():
        missing.append("dpq.autoround: not found")
    cupy = next((v for v in map(_version, ("cupy-cuda13x", "cupy-cuda12x", "cupy")) if not v.startswith("unavail")),
                "unavailable (not installed)")
    out.update(torch=_version("torch"), cuda="not read (dry run)", card="cpu (dry run)", driver="none (dry run)",
               torch_nccl="not read (dry run)", cupy=cupy, auto_round=_version("auto-round"), missing=missing)
    return out


def run(args, partial: dict) -> dict:
    out: dict = {"python": platform.python_version(),
                 "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    installed, unfit = _fit()
    out["installed"], out["unfit"] = installed, unfit
    if args.dry_run:
        _dry(out)
    else:
        _read(out)
    missing = out["missing"]
    # on this CPU machine the image is not what is installed: the fit is read, not judged
    out["proofs"] = {"wheels present": verdict(not missing, "; ".join(missing)),
                     "wheels fit the image": "not proven: the image's versions are read on the GPU machine"
                     if args.dry_run else verdict(not unfit, "; ".join(unfit))}
    check(not missing, f"missing wheels (bring them in .whl/: bash benchmarks/gpu_check.sh --fetch-wheels): {missing}")
    if not args.dry_run:
        check(out["cuda_available"], "torch sees no CUDA device")
        check(os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8",
              "CUBLAS_WORKSPACE_CONFIG is not set (the .sh sets it)")
    return out


def _read(out: dict) -> None:
    import torch

    out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               allocator_free_mutex=hasattr(torch._C, "_cuda_lock_mutex"), driver=_driver())
    if torch.cuda.is_available():
        out["card"] = torch.cuda.get_device_name(0)
    try:
        import torch.cuda.nccl as tnccl

        out["torch_nccl"] = ".".join(map(str, tnccl.version()))
    except Exception as e:  # CPU builds carry no NCCL
        out["torch_nccl"] = f"unavailable ({type(e).__name__})"
    try:
        import cupy

        from dpq.nccl_comm import cupy_nccl_version

        out["cupy"] = cupy.__version__
        v = cupy_nccl_version()
        out["cupy_nccl"] = ".".join(map(str, v)) if v else "unavailable"
    except Exception as e:
        out["cupy"] = f"unavailable ({type(e).__name__})"
    missing = []
    for mod in ("auto_round", "transformers", "datasets", "pydantic", "dpq.autoround"):
        try:
            __import__(mod)
        except Exception as e:  # a wheel the image lacks: name the module that failed to import
            missing.append(f"{mod}: {type(e).__name__}: {getattr(e, 'name', None) or e}")
    try:
        import auto_round
        from auto_round import AutoRound  # noqa: F401  (imports what a run imports)

        out["auto_round"] = auto_round.__version__
    except Exception as e:
        out["auto_round"] = f"unavailable ({type(e).__name__}: {e})"
        missing.append(f"auto_round.AutoRound: {type(e).__name__}: {getattr(e, 'name', None) or e}")
    out["missing"] = missing
