"""The race step (not core): a tiny Llama block on cuda:0: world 1 vs serial auto-round bitwise;
world 2 with sleeps (torch.cuda._sleep) on the producer streams (lane streams before backward, the
exchange's streams before each bucket, the default stream before the readback), debug_identical off,
bitwise the plain run; the same with --parallel_overlap (several buckets, every collective from the
calling thread); the readback's watchdog on a lane kept busy; the CUDA sanitizer on world 2
(debug_identical off), confirmed active by a planted race; local/p2p/host bitwise equal."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from dpqlab.gpu_check.common import (
    NOT_DRY,
    SKIP_DRY,
    bitwise,
    check,
    deterministic,
    hidden_step,
    params_equal,
    verdict,
)
from dpqlab.gpu_check.nccl import _data, _run_op

PROOFS = ["world 1 bitwise serial", "producer sleeps change no bit", "overlap: bitwise, issued by the calling thread",
          "overlap: buckets issued during the backward", "watchdog fires on a busy lane", "sanitizer: no race",
          "sanitizer active", "communicators bitwise equal"]

CYCLES = 50_000_000  # torch.cuda._sleep: ~25 ms at H200 clocks


@contextlib.contextmanager
def producer_sleeps(cycles: int = CYCLES):
    """torch.cuda._sleep on the streams that produce what another stream or the host reads next, so a
    missing wait shows as a changed bit: every lane's stream before the backward (the activations and
    losses it reads; the communication streams and the readback read its gradients and losses), the
    exchange's streams before each bucket (the step reads what they write), and the default stream
    before the readback (lane 0's; home's snapshot and the next iteration read it)."""
    import torch

    from dpq.engine import phases

    slept = {"backward": 0, "bucket": 0, "readback": 0}

    def on(lanes):
        for lane in lanes:
            with lane.issue():
                torch.cuda._sleep(cycles)

    class Sleeps(phases.Observer):  # Note [observers, not patches] in dpq.engine.phases
        def phase_begin(self, name, owner, lane):
            if name == "backward":
                on(owner.lanes)
                slept["backward"] += 1
            elif name == "readback":
                torch.cuda._sleep(cycles)  # the current stream: the default one, lane 0's
                slept["readback"] += 1

        def exchange_begin(self, policy, bucket, numel):
            on(policy.comm.lanes)  # the communication streams with --parallel_overlap, else the lanes'
            slept["bucket"] += 1

    with phases.observing(Sleeps()):
        yield slept


@contextlib.contextmanager
def issuing_threads():
    """Which threads issue the exchange's collectives, and how many buckets the overlap's issuer sent
    during the backward (with small buckets, so that a block has several)."""
    from dpq.engine import phases

    seen = {"threads": set(), "issued_in_backward": []}

    class Issuers(phases.Observer):  # Note [observers, not patches] in dpq.engine.phases
        def exchange_begin(self, policy, bucket, numel):  # a bucket's collectives come from this thread
            seen["threads"].add("main" if threading.current_thread() is threading.main_thread()
                                else threading.current_thread().name)

        def phase_end(self, name, owner, lane, error):
            if name == "issuer" and error is None:
                seen["issued_in_backward"].append(owner.issued_in_backward)

        def bucket_cap(self, sizes, cap):
            return 2**14  # several buckets per block

    with phases.observing(Issuers()):
        yield seen


SANITIZED = {"plain": (None, False), "overlap": (True, False),
             "overlap, each bucket waits for all its compute lane queued": (True, True)}
CONTROL = "CONTROL: a planted race follows"


@contextlib.contextmanager
def _diagnosis(marks_on: set, full_wait: bool):
    """While entered: each (lane, stream id) an overlapped backward's marks are recorded on, into
    ``marks_on`` (``Observer.bucket_marked``: on the device thread, the stream current there); with
    ``full_wait`` each bucket's communication streams wait for everything their compute lane queued
    instead of the marks (``Observer.bucket_waits`` answering None)."""
    import torch

    from dpq.engine import phases

    class Diagnosis(phases.Observer):  # Note [observers, not patches] in dpq.engine.phases
        def bucket_marked(self, exchange, bucket, lane, mark):
            lane = exchange.policy.comm.lanes[lane]
            marks_on.add((lane.index, torch.cuda.current_stream(lane.device).stream_id))

        def bucket_waits(self, policy, bucket, marks):
            return None if full_wait else marks

    with phases.observing(Diagnosis()):
        yield


def race_tune(args) -> dict:
    """Subprocess of step_race (TORCH_CUDA_SANITIZER=1), one per entry of SANITIZED (a fresh process
    each: the sanitizer keeps what it saw by address, and a later run reusing an address would meet
    an earlier run's accesses): world 2 with debug_identical off (a host sync every step would hide a
    race across iterations), plain, with --parallel_overlap, or with overlap whose communication
    streams wait for everything their compute lane queued before each bucket instead of the
    backward's marks (a diagnosis: a race the marks let through is gone there); the streams the
    marks were recorded on. ``--control``: then a planted race after the CONTROL line, which the
    sanitizer must report (it is on and reporting)."""
    import torch
    import torch.cuda._sanitizer as csan

    import dpq

    print(f"CSAN enabled: {csan.cuda_sanitizer.enabled}", flush=True)
    saved = torch.load(args.blob, weights_only=False)
    overlap, full_wait = SANITIZED[args.config]
    out = {"config": args.config, "sanitizer_enabled": bool(csan.cuda_sanitizer.enabled)}
    marks_on: set = set()
    try:
        with _diagnosis(marks_on, full_wait):
            res = dpq.parallel_tune(saved["block"], saved["inputs"], world=2, devices=["cuda:0", "cuda:0"],
                                    debug_identical=False, seed=None, overlap=overlap, **saved["kw"])
        torch.cuda.synchronize()
        out.update(world=res.world, best_loss=res.best_loss)
    except Exception as e:  # the sanitizer raises its report (printed whole: the run's text keeps it)
        print(e, flush=True)
        out["raised"] = type(e).__name__
    out["marks_on_streams"] = sorted(marks_on)
    out["default_stream"] = torch.cuda.default_stream(0).stream_id
    if args.control:
        print(CONTROL, flush=True)
        a = torch.rand(1 << 12, device="cuda:0")
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                torch.mul(a, 5, out=a)  # written on another stream without a wait: the sanitizer's own example
            torch.cuda.synchronize()
        except Exception as e:  # the sanitizer raises its report
            print(e, flush=True)
    return out


def sanitized(args, blob: str) -> dict:
    """Each SANITIZED run in its own sanitized process (the last also plants the control race); every
    report whole in ``$OUT/csan_report.txt``. Per run: its races, and the whole's verdict inputs."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    marker = "CSAN detected a possible data race"
    runs, texts, control_races, enabled = {}, [], 0, True
    names = list(SANITIZED)
    for name in names:
        extra = ["--control"] if name == names[-1] else []
        proc = hidden_step("race-tune", args.sanitizer_timeout, "--blob", blob, "--config", name, *extra, env=env)
        text = proc.pop("text", proc.get("tail", ""))
        texts.append(f"=== CSAN run: {name} (rc {proc.get('rc')})\n{text}")
        tune_part, _, control = text.partition(CONTROL)
        control_races += control.count(marker)
        enabled = enabled and "CSAN enabled: True" in tune_part
        runs[name] = {"races": tune_part.count(marker), "rc": proc.get("rc"), "result": proc.get("result"),
                      "error": proc.get("error")}
    Path(args.out, "csan_report.txt").write_text("\n".join(texts))
    return {"runs": runs, "races": sum(r["races"] for r in runs.values()), "control_races": control_races,
            "enabled": enabled, "complete": all(r["result"] is not None for r in runs.values())}


def run(args, partial: dict) -> dict:
    if args.dry_run:
        return {"status": SKIP_DRY, "proofs": dict.fromkeys(PROOFS, NOT_DRY)}
    import tempfile

    import torch
    from auto_round.algorithms.quantization.sign_round.sign_sgd import SignSGD

    from dpq.autoround import tune
    from dpq.comm.communicators import select_communicator
    from dpq.streams import make_lanes
    from dpq.tune_loop import LanesHung
    from dpqlab.autoround_blocks import record_autoround_blocks

    out = partial  # what ran is kept if a later part raises (run_step writes it)
    proofs: dict = out.setdefault("proofs", {})
    recs = record_autoround_blocks(device_map="cuda:0")
    rec = recs[0]
    q = rec.quantizer
    q.iters = 6
    with deterministic() as nondeterministic:
        # world 1 on GPU == serial auto-round on GPU, bitwise
        rec.restore_rng()
        serial = rec.serial_quantize_block(rec.fresh_block())
        rec.restore_rng()
        one = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0"])
        out["world1_vs_serial"] = params_equal(serial, one.best_params) or "bitwise equal"
        proofs["world 1 bitwise serial"] = verdict(out["world1_vs_serial"] == "bitwise equal", out["world1_vs_serial"])

        # world 2 on one GPU with the identical-state check: the reference
        rec.restore_rng()
        base = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True)
        # the same with sleeps on the producer streams, no per-step check: only the stream order keeps it
        with producer_sleeps() as slept:
            rec.restore_rng()
            torch.cuda._sleep(CYCLES * 4)  # the default stream is busy when the block starts...
            block = rec.fresh_block()  # ...and the block's copy is queued behind the sleep
            slow = rec.dpq_parallel_tune(block, ["cuda:0", "cuda:0"], debug_identical=False)
        out["sleeps"] = {"slept": slept, "losses_equal": base.losses == slow.losses,
                         "vs_plain": params_equal(base.best_params, slow.best_params) or "bitwise equal"}
        proofs["producer sleeps change no bit"] = verdict(
            out["sleeps"]["vs_plain"] == "bitwise equal" and out["sleeps"]["losses_equal"] and all(slept.values()),
            out["sleeps"])

        # --parallel_overlap (communication streams, the issuer): the same bits, the calling thread issues
        with producer_sleeps(), issuing_threads() as seen:
            rec.restore_rng()
            ov = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=False, overlap=True)
        out["overlap"] = {"communicator": ov.communicator, "threads": sorted(seen["threads"]),
                          "issued_in_backward": seen["issued_in_backward"],
                          "vs_plain": params_equal(base.best_params, ov.best_params) or "bitwise equal",
                          "losses_equal": base.losses == ov.losses}
        proofs["overlap: bitwise, issued by the calling thread"] = verdict(
            out["overlap"]["vs_plain"] == "bitwise equal" and out["overlap"]["losses_equal"]
            and out["overlap"]["threads"] == ["main"] and ov.communicator.endswith("+comm-streams"), out["overlap"])
        issued = seen["issued_in_backward"]
        proofs["overlap: buckets issued during the backward"] = (
            "passed" if issued and all(n > 0 for n in issued) else
            f"not proven: the issuer sent {issued} buckets before backward returned (the rest after it)")

        # the one-op sign step (dpq.engine.sign_step, used above) vs each lane's SignSGD.step: bitwise, on CUDA
        orig_choice = tune.one_op_sign_step
        tune.one_op_sign_step = lambda *a: False
        try:
            rec.restore_rng()
            per_lane = rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], debug_identical=True)
        finally:
            tune.one_op_sign_step = orig_choice
        out["one_op_vs_per_lane_step"] = params_equal(base.best_params, per_lane.best_params) or "bitwise equal"
        out["one_op_step_used"] = orig_choice(SignSGD, None)

        # local, p2p and host communicators: bitwise the same sums
        lanes = make_lanes(["cuda:0", "cuda:0"])
        xs = [_data(torch.float32, 4099, seed=k) for k in range(2)]
        by_name = {}
        for name in ("local", "p2p", "host"):
            comm, _ = select_communicator(lanes, prefer=name)
            by_name[name] = [_run_op(comm, op, xs, 4099) for op in ("all_reduce", "reduce_scatter", "all_gather")]
        out["communicators_equal"] = all(
            bitwise(a, b) for name in ("p2p", "host") for ra, rb in zip(by_name["local"], by_name[name], strict=True)
            for a, b in zip(ra, rb, strict=True))
        proofs["communicators bitwise equal"] = verdict(out["communicators_equal"], "local / p2p / host differ")
    out["nondeterministic_ops"] = nondeterministic

    # the readback's watchdog (R8) on a real GPU: lane 1's stream kept busy (3 s) past a 1 s timeout
    real_loss, calls = tune.make_lane_loss, []

    def make(*a, **kw):
        inner = real_loss(*a, **kw)

        def lane_loss(lane, module, indices):
            calls.append(lane.index)
            if lane.index == 1 and calls.count(1) == 3:
                torch.cuda._sleep(CYCLES * 120)  # on lane 1's stream (the loss runs under its issue())
            return inner(lane, module, indices)
        return lane_loss

    tune.make_lane_loss = make
    t0 = time.monotonic()
    try:
        rec.restore_rng()
        rec.dpq_parallel_tune(rec.fresh_block(), ["cuda:0", "cuda:0"], timeout=1.0)
        out["watchdog"] = {"raised": None}
    except LanesHung as e:
        out["watchdog"] = {"raised": str(e)[:600], "stuck": e.stuck, "after_s": round(time.monotonic() - t0, 2)}
    finally:
        tune.make_lane_loss = real_loss
        torch.cuda.synchronize()  # the sleep ends on its own
    wd = out["watchdog"]
    proofs["watchdog fires on a busy lane"] = verdict(wd["raised"] is not None and "lane(s) 1 had not finished"
                                                      in wd["raised"], wd)

    # the world-2 tunes under the CUDA sanitizer, in a subprocess (it must be on from the start)
    with tempfile.TemporaryDirectory() as tmp:
        blob = os.path.join(tmp, "rec.pt")
        inputs = rec.q_inputs if (rec.q_inputs is not None and q.enable_quanted_input) else rec.fp_inputs
        kw = dict(outputs=list(rec.fp_outputs), input_others=dict(rec.input_others), iters=q.iters,
                  batch_size=q.calibration_context.batch_size, lr=q.lr, minmax_lr=q.minmax_lr,
                  amp=q.model_context.amp, amp_dtype=q.model_context.amp_dtype,
                  valid_token_mask=rec.valid_token_mask)
        torch.save({"block": rec.fresh_block(), "block2": rec.fresh_block(), "inputs": list(inputs), "kw": kw}, blob)
        out["sanitizer"] = san = sanitized(args, blob)
    print(f"sanitizer active: {san['enabled']} (planted race reported: {san['control_races'] > 0}); races by run: "
          f"{ {n: r['races'] for n, r in san['runs'].items()} }")
    proofs["sanitizer active"] = verdict(san["enabled"] and san["control_races"] > 0, san)
    proofs["sanitizer: no race"] = verdict(san["enabled"] and san["races"] == 0 and san["complete"], san)
    check(out["one_op_step_used"] and out["one_op_vs_per_lane_step"] == "bitwise equal",
          f"one-op sign step: used {out['one_op_step_used']}, vs per-lane {out['one_op_vs_per_lane_step']}")
    check(not any(v.startswith("failed") for v in proofs.values()), f"race proofs failed: {proofs}")
    return out
