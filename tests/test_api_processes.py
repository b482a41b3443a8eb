"""The Python API under an initialised process group (README, "From Python" under torchrun):
``torch.distributed.init_process_group(...)`` on every rank, then ``dpq.autoround.enable(1)``
and auto-round as usual on every rank.

Two spawned gloo processes each quantize the embedded model in memory with ``enable(1)``
(world 2 = 2 processes x 1 lane); this process does the same job with ``enable(2)`` on
``cpu,cpu``. Every side runs at one intra-op thread (CPU kernels may round differently with
another thread count), so the models' tensors compare bitwise: both ranks' with the
one-process run's."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch

from tests.processes import worker_context
from tests.test_torchrun import same_bits

ITERS, NSAMPLES, BATCH, SEQLEN = 4, 8, 4, 32  # as tests/test_torchrun.py: every block keeps a tuned iteration
LAYERS = 2  # of the embedded model's 4
TIMEOUT_S = 360  # the whole spawn: a bound on a hang, not the expected time (120 cut a run at 121 s under load 7)


def quantize(calib: Path, world: int, devices: str) -> tuple[dict[str, torch.Tensor], list]:
    """The embedded model quantized in memory under ``enable(world, devices)``: (its tensors, the block records)."""
    from auto_round import AutoRound

    from dpq import autoround as dpq_ar
    from dpq.demo.embedded import load_embedded_model

    model, tok = load_embedded_model()
    model.model.layers = model.model.layers[:LAYERS]  # fewer blocks: the time of this test (2 cores)
    model.config.num_hidden_layers = LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:LAYERS]
    ar = AutoRound(model, tokenizer=tok, dataset=str(calib), device_map="cpu", enable_torch_compile=False,
                   iters=ITERS, nsamples=NSAMPLES, seqlen=SEQLEN, batch_size=BATCH, lr=0.02, seed=42)
    dpq_ar.enable(world, devices)
    try:
        ar.quantize()
    finally:
        dpq_ar.disable()
    return {k: v.detach().clone() for k, v in ar.model.state_dict().items()}, dpq_ar.run_summary()


def _worker(rank: int, store: str, calib: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        state, records = quantize(Path(calib), 1, "cpu")
        torch.save({"state": state, "worlds": [r.world for r in records], "best": [r.best_iter for r in records],
                    "communicators": [r.communicator for r in records]}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from dpq.demo.embedded import calibration_jsonl

    tmp = tmp_path_factory.mktemp("api_processes")
    calib = calibration_jsonl(tmp / "calib.jsonl", 16, SEQLEN)
    ctx = worker_context()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp / "store"), str(calib), str(tmp))) for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the one-process reference meanwhile (the spawned ranks wait on each other, not on it)
        ref, ref_records = quantize(calib, 2, "cpu,cpu")
    finally:
        torch.set_num_threads(threads)
    for p in procs:
        p.join(max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
        if p.is_alive():
            p.kill()
            p.join()
    print(f"2 processes x 1 lane + the reference: {time.monotonic() - t0:.1f} s")
    ranks = [torch.load(tmp / f"rank{r}.pt") if (tmp / f"rank{r}.pt").exists() else None for r in range(2)]
    return {"codes": [p.exitcode for p in procs], "ranks": ranks, "ref": ref, "ref_records": ref_records}


def test_enable_under_a_process_group_is_bitwise_the_one_process_world(runs):
    from dpq.demo.embedded import load_embedded_model

    assert runs["codes"] == [0, 0] and all(runs["ranks"])
    ref = runs["ref"]
    assert [r.world for r in runs["ref_records"]] == [2] * LAYERS
    assert all(r.best_iter > 0 for r in runs["ref_records"])  # tuned values kept: the exchange shaped them
    for got in runs["ranks"]:
        assert got["worlds"] == [2] * LAYERS  # world 2 = 2 processes x 1 lane
        assert got["best"] == [r.best_iter for r in runs["ref_records"]]
        assert set(got["communicators"]) == {"pg-gloo"}
        assert same_bits(got["state"], ref)
    before = load_embedded_model()[0].state_dict()
    assert not same_bits({k: before[k] for k in ref if k in before}, {k: ref[k] for k in ref if k in before})
