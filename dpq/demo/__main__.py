"""``python -m dpq.demo``: the embedded default, quantized end to end with ``auto-round-dp``.

Runs the real CLI twice in subprocesses on the model that ships with dpq (``dpq/data``):
``--parallel_quantization 1`` (the engine at world 1: bitwise plain auto-round, see
tests/test_integration.py) and ``--parallel_quantization N`` on N lanes (CPU lanes here, GPUs
when present). Both save in auto-round's format. Then it loads both saved models and prints
serial vs parallel wall time, per-block best loss, and KL(fp || quantized) on held-out text;
writes the table as JSON (the keys of auto-round-dp's ``--parallel_report``: schema, versions,
devices, command, times, exit status; each run's own report under ``runs``) and a PNG of the
per-block loss curves beside each block's time, serial vs parallel. Needs matplotlib (the
``demo`` extra); without it the demo stops before any run and says what to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from dpq import refusals


def _run_cli(model_dir: Path, calib: Path, out: Path, world: str, devices: str | None, args) -> tuple[float, dict]:
    report = out / "dpq_report.json"
    cmd = [sys.executable, "-m", "dpq.autoround.cli", "--model", str(model_dir), "--dataset", str(calib),
           "--iters", str(args.iters), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
           "--batch_size", str(args.batch_size), "--device_map", args.device_map, "--disable_torch_compile",
           "--output_dir", str(out), "--parallel_quantization", world, "--parallel_report", str(report)]
    if devices:
        cmd += ["--parallel_devices", devices]
    print("$ auto-round-dp " + " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=not args.verbose, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write((proc.stderr or "")[-4000:])
        raise SystemExit(f"auto-round-dp failed (exit {proc.returncode}); rerun with --verbose to see its output")
    return wall, json.loads(report.read_text())


def _saved_model_dir(out: Path) -> Path:
    configs = sorted(out.rglob("quantization_config.json"))
    if not configs:
        raise SystemExit(f"no quantized model was saved under {out}")
    return configs[0].parent


def _kl(fp_model, q_dir: Path, samples) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    from dpq.demo.metrics import kl_fp_quantized

    q_model = AutoModelForCausalLM.from_pretrained(q_dir, device_map="cpu", local_files_only=True).eval()
    q_model = q_model.to(torch.float32) if all(p.dtype.is_floating_point for p in q_model.parameters()) else q_model
    return kl_fp_quantized(fp_model, q_model, samples)


def _plot(rows: list[dict], serial: dict, parallel: dict, world: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(serial["blocks"])
    fig, axes = plt.subplots(1, n + 1, figsize=(3.2 * (n + 1), 3.0), squeeze=False)
    for ax, s, p in zip(axes[0][:n], serial["blocks"], parallel["blocks"], strict=True):
        ax.plot(s["losses"], label="serial (world 1)", color="tab:blue")
        ax.plot(p["losses"], label=f"parallel (world {world})", color="tab:orange", linestyle="--")
        ax.set_title(s["name"], fontsize=9)
        ax.set_xlabel("iteration", fontsize=8)
        ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("block loss", fontsize=8)
    axes[0][0].legend(fontsize=7)
    _plot_block_seconds(axes[0][n], rows, world)
    fig.suptitle("dpq: per-block tuning loss and time, serial vs data-parallel (embedded model)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_block_seconds(ax, rows: list[dict], world: int) -> None:
    """Each block's seconds, serial beside parallel (on CPU lanes the parallel run is slower: they share
    the cores)."""
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["serial_block_s"] for r in rows], width=0.4, label="serial", color="tab:blue")
    ax.bar([i + 0.2 for i in x], [r["parallel_block_s"] for r in rows], width=0.4, label=f"world {world}",
           color="tab:orange")
    ax.set_xticks(list(x), [r["block"].rsplit(".", 1)[-1] for r in rows], fontsize=7)
    ax.set_xlabel("block", fontsize=8)
    ax.set_ylabel("seconds", fontsize=8)
    ax.set_title("time per block", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dpq.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="2", help="lanes for the parallel run (default 2)")
    ap.add_argument("--devices", default=None, help="lane devices (default: cpu x world on CPU, else visible GPUs)")
    ap.add_argument("--device_map", default=None, help="auto-round --device_map (default: 0 with a GPU, else cpu)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=16, help="held-out samples for KL")
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--verbose", action="store_true", help="show auto-round's own output")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # before minutes of runs, not after them
        print(f"python -m dpq.demo: {refusals.DEMO_NEEDS_MATPLOTLIB}", file=sys.stderr)
        return 2
    started = time.time()

    import torch

    from dpq.autoround.outputs import report_header, write_whole
    from dpq.demo.embedded import DATA_DIR, calibration_jsonl, heldout_samples, load_embedded_model

    has_gpu = torch.cuda.is_available()
    args.device_map = args.device_map or ("0" if has_gpu else "cpu")
    devices = args.devices or (None if has_gpu else ",".join(["cpu"] * int(args.world)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calib = calibration_jsonl(out / "calib.jsonl", args.nsamples * 2, args.seqlen)

    t_serial, serial = _run_cli(DATA_DIR, calib, out / "serial", "1", None, args)
    t_par, parallel = _run_cli(DATA_DIR, calib, out / f"world{args.world}", str(args.world), devices, args)

    fp_model, tok = load_embedded_model(torch.float32)
    samples = heldout_samples(tok, args.heldout, args.seqlen)
    kl_s = _kl(fp_model, _saved_model_dir(out / "serial"), samples)
    kl_p = _kl(fp_model, _saved_model_dir(out / f"world{args.world}"), samples)

    world = max(b["world"] for b in parallel["blocks"])
    rows = []
    for s, p in zip(serial["blocks"], parallel["blocks"], strict=True):
        rows.append({"block": s["name"], "serial_best_loss": s["best_loss"], "parallel_best_loss": p["best_loss"],
                     "rel_diff": (p["best_loss"] - s["best_loss"]) / s["best_loss"],
                     "serial_block_s": s["seconds"], "parallel_block_s": p["seconds"], "world": p["world"]})
    print()
    print(f"{'block':<18} {'serial best':>12} {'world ' + str(world) + ' best':>13} {'diff':>7} "
          f"{'serial s':>9} {'parallel s':>10}")
    for r in rows:
        print(f"{r['block']:<18} {r['serial_best_loss']:>12.4e} {r['parallel_best_loss']:>13.4e} "
              f"{r['rel_diff']:>+7.2%} {r['serial_block_s']:>9.2f} {r['parallel_block_s']:>10.2f}")
    print(f"{'whole run (wall)':<18} {'':>12} {'':>13} {'':>7} {t_serial:>9.2f} {t_par:>10.2f}")
    print(f"KL(fp || quantized) on {args.heldout} held-out samples x {args.seqlen} tokens: "
          f"serial {kl_s:.5f}  world {world} {kl_p:.5f}  ({(kl_p - kl_s) / kl_s:+.2%})")
    if not has_gpu:
        print("note: CPU lanes share the same cores, so no speedup is expected on CPU; the point here is parity.")
    command = ["python", "-m", "dpq.demo", *(sys.argv[1:] if argv is None else argv)]
    report = report_header(command, started, time.time(), 0, devices or args.device_map)
    report.update({"args": vars(args), "world": world, "wall_seconds": {"serial": t_serial, "parallel": t_par},
                   "kl": {"serial": kl_s, "parallel": kl_p}, "blocks": rows, "runs": {"serial": serial,
                                                                                     "parallel": parallel},
                   "curves": {"serial": [b["losses"] for b in serial["blocks"]],
                              "parallel": [b["losses"] for b in parallel["blocks"]]}})
    write_whole(str(out / "demo_report.json"), json.dumps(report, indent=1))
    _plot(rows, serial, parallel, world, out / "demo_losses.png")
    print(f"wrote {out / 'demo_report.json'}, {out / 'demo_losses.png'}; quantized models under {out}/serial and "
          f"{out}/world{args.world}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
