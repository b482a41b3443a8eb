"""dpq.planning.plan on its own: every reason at once, lane 0 is home, device lists read as written."""

from __future__ import annotations

import pytest

import dpq.planning.lane_devices as lane_devices
import dpq.planning.plan as plan_mod
from dpq.planning.lane_devices import validate_world
from dpq.planning.plan import PlanRefused, PlanRequest, resolve
from dpq.planning.spec import ParallelSpec
from dpq.planning.spec import problems as check_arguments

NO_SUCH_GPU = "cuda:99"  # cannot exist here, nor on a lent GPU machine


def refusal(**kw) -> list[str]:
    with pytest.raises(PlanRefused) as e:
        resolve(PlanRequest(**kw))
    return e.value.reasons


def has(reasons: list[str], *needles: str) -> bool:
    return all(any(n in r for r in reasons) for n in needles)


def test_explicit_world_lists_every_reason_at_once():
    """The issue's example: a missing device used to hide the device count and min(world, devices)
    hid the samples per iteration: four reasons, one reported."""
    reasons = refusal(world=4, devices=f"cpu,{NO_SUCH_GPU}", samples_per_iter=1, home="cpu",
                      extra_reasons=["LFQ loss (--enable_lfq) needs the lm_head on every lane"])
    assert has(reasons, "LFQ", f"{NO_SUCH_GPU} does not exist", "world 4 needs 4 lane devices but 2 were given",
               "4 lanes but only 1 sample per iteration"), reasons
    assert all("Fix" in r for r in reasons[1:]), reasons


def test_lane0_must_be_the_blocks_device(monkeypatch):
    monkeypatch.setattr(lane_devices, "check_device_exists", lambda d: None)  # pretend cuda:0..1 exist
    reasons = refusal(world=2, devices="cuda:1,cuda:0", home="cuda:0")
    assert has(reasons, "lane 0 is cuda:1, but the block is on cuda:0", "list cuda:0 first"), reasons
    auto = resolve(PlanRequest(world="auto", devices="cuda:1,cuda:0", home="cuda:0"))
    assert auto.local_lanes == 1 and has(auto.reasons, "lane 0 is cuda:1"), auto
    assert resolve(PlanRequest(world=2, devices="cuda:0,cuda:1", home="cuda")).local_lanes == 2


def test_cpu_with_an_index_is_refused_not_taken_for_another_device():
    """'cpu:7,cpu' used to pass the plan and fail after wrapping with a wrong fix."""
    assert has(refusal(world=2, devices="cpu:7,cpu", home="cpu"), "cpu:7: the CPU is one device", "write cpu")
    auto = resolve(PlanRequest(world="auto", devices="cpu:7,cpu", home="cpu"))
    assert auto.local_lanes == 1 and has(auto.reasons, "cpu:7: the CPU is one device")
    assert resolve(PlanRequest(world=2, devices="cpu:0,cpu", home="cpu")).local_lanes == 2  # cpu:0 is cpu


@pytest.mark.parametrize("spec,needle", [
    ("gpu", "'gpu' is not a device"),
    ("cuda:x,cpu", "'cuda:x' is not a device"),
    ("\u00b2", "'\u00b2' is not a device"),
    ("", "the lane device list is empty"),
    ("cpu,,cpu", "an empty entry"),
])
def test_malformed_device_list_is_a_reason_not_a_crash(spec, needle):
    """Under auto it used to raise torch's RuntimeError (or int()'s ValueError) from inside the plan."""
    auto = resolve(PlanRequest(world="auto", devices=spec, home="cpu"))  # keeps the entries that are devices
    assert auto.local_lanes == (2 if spec == "cpu,,cpu" else 1) and has(auto.reasons, needle), auto
    assert has(refusal(world=2, devices=spec, home="cpu"), needle)
    assert has(check_arguments("auto", spec), needle)


def test_world_accepts_ascii_digits_only():
    with pytest.raises(ValueError, match="world must be 'off', 'auto' or an integer >= 1"):
        validate_world("\u00b2")
    assert validate_world(" 3 ") == 3


def test_bare_indices_without_an_accelerator_are_said(monkeypatch):
    """'0,0' on a machine without GPUs silently became cpu twice."""
    monkeypatch.setattr(plan_mod, "default_accelerator_type", lambda: "cpu")
    monkeypatch.setattr(lane_devices, "default_accelerator_type", lambda: "cpu")
    reasons = refusal(world=2, devices="0,0", home="cpu")
    assert len(reasons) == 1 and has(reasons, "'0' names accelerator 0", "write cpu"), reasons
    auto = resolve(PlanRequest(world="auto", devices="0,0", home="cpu"))
    assert auto.local_lanes == 1 and has(auto.reasons, "names accelerator 0")


def test_unused_devices_are_noted():
    """'--parallel_quantization 2' with three devices silently ignored the third."""
    plan = resolve(PlanRequest(world=2, devices="cpu,cpu,cpu", home="cpu"))
    assert plan.local_lanes == 2 and has(plan.notes, "first 2 of the 3 lane devices", "--parallel_quantization 3")


def test_auto_says_why_each_lane_was_dropped():
    plan = resolve(PlanRequest(world="auto", devices=f"cpu,{NO_SUCH_GPU},cpu,cpu", samples_per_iter=2, home="cpu"))
    assert plan.local_lanes == 2 and has(plan.reasons, f"{NO_SUCH_GPU} does not exist", "3 lanes but only 2 samples")


def test_devices_with_parallel_quantization_off_are_an_error():
    assert has(check_arguments("off", "cpu,cpu"), "parallel quantization is off")
    assert check_arguments("off", None) == [] and check_arguments("2", "cpu,cpu") == []
    problems = check_arguments("zero", "gpu,cpu")
    assert has(problems, "world must be", "'gpu' is not a device"), problems


def test_exchange_price_covers_a_weight_larger_than_the_bucket_cap():
    """A parameter larger than the bucket cap gets a bucket of its own (dpq.engine.exchange), and the
    exchange's buffers are sized for the largest bucket: the price follows the largest weight."""
    import torch

    from dpq.engine.exchange import GradBuckets
    from dpq.engine.sign_bits import SIGN_TABLE_BYTES
    from dpq.planning.plan import price_mirror

    block = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 8, bias=False))
    cap = 1000  # below the first weight (4096 values)
    parts: dict = {}
    price_mirror(block, [], 8, bucket_cap_elems=cap, detail=parts)
    params = [p.detach().clone().requires_grad_(True) for p in block.parameters()]
    largest = max(b - a for a, b in GradBuckets([params], bucket_cap_elems=cap).bucket_ranges)
    assert largest == 4096
    tuned = 4096 + 512 + (4096 + 512) // 8
    # the buffers, the unpack's table and the signs kept apart (int8)
    assert parts["exchange"] == 3 * largest * 4 + SIGN_TABLE_BYTES + tuned
    small: dict = {}
    price_mirror(block, [], 8, bucket_cap_elems=2**22, detail=small)  # a cap above everything: all tuned values
    assert small["exchange"] == 3 * tuned * 4 + SIGN_TABLE_BYTES + tuned


def test_a_plan_is_frozen():
    """What a run does with its plan is the session's (dpq.session.LaneRun), never written back."""
    import dataclasses

    plan = resolve(PlanRequest(world=2, devices="cpu,cpu", home="cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.communicator = "pg-gloo"
    assert dataclasses.replace(plan, notes=["x"]).notes == ["x"] and plan.notes == []


def test_too_few_samples_names_the_limit_that_applies():
    """Issue 31, item 8: ``--nsamples 1`` at world 2 said "Fix: a smaller world or a larger --batch_size",
    although the batch was 4: the calibration data was the limit. Each fix now raises what limits."""
    (by_data,) = refusal(world=2, devices="cpu,cpu", home="cpu", samples_per_iter=1, pool_samples=1)
    assert by_data.startswith("2 lanes but only 1 sample per iteration (the calibration data has 1 sample)"), by_data
    assert "Fix: --nsamples 2 or more, or a smaller --parallel_quantization (at most 1)" in by_data
    assert "--batch_size" not in by_data
    (by_batch,) = refusal(world=4, devices="cpu,cpu,cpu,cpu", home="cpu", samples_per_iter=2, pool_samples=16)
    assert "(batch_size x gradient_accumulate_steps)" in by_batch and "Fix: --batch_size 4 or more" in by_batch


def test_a_task_without_home_is_planned_where_its_block_is(monkeypatch):
    """Seen on the H200 (2026-12-04): a BlockTask that names no home, its block on the CPU, lanes
    cpu,cpu, was planned with home = the machine's accelerator (cuda:0) and refused 'lane 0 is cpu,
    but the block is on cuda:0'. The block's own device is home."""
    from dpq.session import SessionConfig, block_plan
    from tests.test_distributed import make_task

    monkeypatch.setattr(plan_mod, "default_accelerator_type", lambda: "cuda")  # a machine with a GPU
    monkeypatch.setattr(lane_devices, "default_accelerator_type", lambda: "cuda")
    task = make_task("sign")
    assert task.home is None and next(task.block.parameters()).device.type == "cpu"
    plan = block_plan(SessionConfig(ParallelSpec(2, ["cpu", "cpu"])), task)
    assert [d.type for d in plan.devices] == ["cpu", "cpu"]


def test_overlap_auto_is_on_where_a_gpu_pair_has_no_peer_access():
    """Note [overlap where the wire is slow]: 'auto' turns overlap on for distinct CUDA lanes of which some
    pair has no peer access (GeForce cards on PCIe: the exchange goes through host memory), off where every
    pair has it (NVLink), off across processes and on CPU lanes; 'on' and 'off' are taken as said."""
    from dpq.planning.plan import overlap_choice

    gpus = ["cuda:0", "cuda:1", "cuda:2"]
    on, why = overlap_choice(None, gpus, peer=lambda a, b: {a.index, b.index} != {1, 2})
    assert on and why.startswith("auto: on, cuda:1 has no peer access to cuda:2"), why
    on, why = overlap_choice(None, gpus, peer=lambda a, b: True)
    assert not on and "every GPU pair has peer access" in why
    on, why = overlap_choice(None, gpus, processes=2, peer=lambda a, b: False)
    assert not on and "across processes" in why
    assert overlap_choice(None, ["cpu", "cpu"], peer=lambda a, b: False) == (False, "")
    assert overlap_choice(None, ["cuda:0", "cuda:0"], peer=lambda a, b: False) == (False, "")  # one GPU
    assert overlap_choice(True, ["cuda:0", "cuda:1"], peer=lambda a, b: True)[0] is True
    assert overlap_choice(False, ["cuda:0", "cuda:1"], peer=lambda a, b: False)[0] is False

    def broken(a, b):
        raise RuntimeError("no driver")

    on, why = overlap_choice(None, gpus, peer=broken)
    assert not on and "could not be queried" in why


def test_the_plan_carries_its_overlap_choice(monkeypatch):
    """resolve() asks the backend about peer access for the lanes it keeps, and the plan says the choice."""
    from tests.test_memory import _four_fake_gpus

    _four_fake_gpus(monkeypatch, lambda k: 2**40, total=2**40, peer=False)  # GeForce cards: no P2P
    plan = resolve(PlanRequest(world=2, devices="cuda:0,cuda:1", home="cuda:0"))
    assert plan.exchange.overlap and "no peer access" in plan.overlap_reason
    plan = resolve(PlanRequest(world=2, devices="cuda:0,cuda:1", home="cuda:0", overlap=False))
    assert not plan.exchange.overlap and plan.overlap_reason == "--parallel_overlap off"


def test_the_plan_says_cpu_lanes_exchange_during_the_backward():
    """CPU lanes exchange during the backward under auto (Note [host lanes exchange during the backward]):
    the plan says so, the session's communicator reason says it, and off says the other."""
    from dpq.planning.plan import HOST_LANES_OVERLAP
    from dpq.session import LaneRun

    plan = resolve(PlanRequest(world=2, devices="cpu,cpu"))
    assert plan.exchange.overlap and not plan.exchange.second_stream
    assert plan.overlap_reason == HOST_LANES_OVERLAP
    assert "the exchange during the backward (auto: CPU lanes" in LaneRun.planned(plan).communicator_reason
    off = resolve(PlanRequest(world=2, devices="cpu,cpu", overlap=False))
    assert not off.exchange.overlap and off.overlap_reason == "--parallel_overlap off"
    assert "the exchange after the backward (--parallel_overlap off)" in LaneRun.planned(off).communicator_reason
    assert resolve(PlanRequest(world=1, devices="cpu")).overlap_reason == ""  # no exchange to speak of


@pytest.mark.parametrize("value, held", [("auto", None), (None, None), ("on", True), (True, True), ("OFF", False),
                                         (False, False)])
def test_overlap_settings(value, held):
    assert ParallelSpec.build(2, "cuda:0,cuda:1", parallel_overlap=value).overlap is held


def test_an_unknown_overlap_setting_is_refused_with_the_fix():
    assert has(check_arguments(2, overlap="sometimes"), "--parallel_overlap 'sometimes' is not a setting",
               "Fix: auto")


def test_the_plan_decides_the_communicator_and_overlap_once(monkeypatch):
    """One resolve asks choose_communicator and overlap_choice once for its lanes: the memory check (twice:
    the whole block's bucket, then the lanes) prices the lanes with the same decision the plan then says."""
    import torch

    calls = {"communicator": 0, "overlap": 0}
    real_choose, real_overlap = plan_mod.choose_communicator, plan_mod.overlap_choice

    def choose(devices):
        calls["communicator"] += 1
        return real_choose(devices)

    def overlap(*args, **kwargs):
        calls["overlap"] += 1
        return real_overlap(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "choose_communicator", choose)
    monkeypatch.setattr(plan_mod, "overlap_choice", overlap)
    block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    price = plan_mod.BlockPrice(block, [torch.randn(1, 16, 64)], 8)
    plan = resolve(PlanRequest(world=2, devices="cpu,cpu", samples_per_iter=8, home="cpu", price=price))
    assert plan.local_lanes == 2 and plan.communicator == "local"
    assert calls == {"communicator": 1, "overlap": 1}


@pytest.mark.parametrize("order", ["canonical", "native"])
def test_the_plan_says_which_order_and_what_it_costs(monkeypatch, order):
    """--parallel_order (Note [canonical or native order]): with CuPy's NCCL on distinct GPUs the plan takes
    the order asked and its reason says what it costs; a communicator with one order keeps it and says so."""
    from dpq.nccl_comm import CupyNcclCommunicator
    from tests.test_memory import _four_fake_gpus

    _four_fake_gpus(monkeypatch, lambda k: 2**40, total=2**40, peer=True)
    monkeypatch.setattr(CupyNcclCommunicator, "available", classmethod(lambda cls: True))
    plan = resolve(PlanRequest(world=4, devices="cuda:0,cuda:1,cuda:2,cuda:3", home="cuda:0", order=order))
    assert plan.communicator == "cupy-nccl" and plan.order == order
    if order == "canonical":
        assert has([plan.communicator_reason], "the bits depend on the world alone", "6 NCCL send/recv calls",
                   "3 fold kernels", "--parallel_order native")
    else:
        assert has([plan.communicator_reason], "NCCL's own reduce-scatter", "depend on NCCL's algorithm")
    monkeypatch.setattr(CupyNcclCommunicator, "available", classmethod(lambda cls: False))
    monkeypatch.setattr(plan_mod, "choose_communicator", lambda devices: ("p2p", "copies"))
    plan = resolve(PlanRequest(world=4, devices="cuda:0,cuda:1,cuda:2,cuda:3", home="cuda:0", order=order))
    assert plan.order == "canonical"
    assert ("p2p has only the canonical order" in plan.communicator_reason) == (order == "native")


def test_an_unknown_order_is_refused_with_the_fix():
    assert has(check_arguments(2, order="fast"), "--parallel_order 'fast' is not a setting", "Fix: canonical")
    assert ParallelSpec.build(2, "cuda:0,cuda:1", parallel_order="Native").order == "native"
