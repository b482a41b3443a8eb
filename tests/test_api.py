"""parallel_tune's argument checks (every bad input raises before any work, naming the fix) and
its failure path (whatever fails, the caller's block comes back exactly as it was passed in)."""

from __future__ import annotations

import copy
import gc
import random
import re
import time
import weakref

import pytest
import torch

import dpq
import dpq.autoround.api as api
import dpq.autoround.tune as tune
import dpq.session as session
from dpq.demo.model import TinyLlamaConfig, build_tiny_llama, calibration_samples, capture_block_inputs
from tests.conftest import ForwardFault


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for these tiny blocks (several times faster on a busy 2-core machine),
    set per test (tests start from the session's baseline) and restored afterwards. Bitwise
    comparisons here are between runs under this same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_block():
    model = build_tiny_llama(TinyLlamaConfig(num_hidden_layers=1))
    inputs, others = capture_block_inputs(model, calibration_samples(8, 32))
    return model.model.layers[0], inputs[0], others[0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN-safe bitwise comparison); a meta tensor has none (empty)."""
    if t.device.type == "meta":
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def _ident(v):
    """What 'unchanged' means for one attribute: the same object; containers: the same contents."""
    if isinstance(v, dict):
        return ("dict", id(v), tuple((k, id(x)) for k, x in v.items()))
    if isinstance(v, set):
        return ("set", id(v), tuple(sorted(map(repr, v))))
    if isinstance(v, list):
        return ("list", id(v), tuple(map(id, v)))
    return id(v)


def _fingerprint(block: torch.nn.Module):
    modules = {n: (m, {k: _ident(v) for k, v in m.__dict__.items()}) for n, m in block.named_modules()}
    tensors = {k: (v, v.requires_grad, v.grad, _bits(v), v.dtype, tuple(v.shape), v.device)
               for k, v in block.state_dict(keep_vars=True).items()}
    return modules, tensors


def _assert_exactly_as_before(block: torch.nn.Module, before) -> None:
    """Same module objects, no attribute added, removed or replaced, every tensor bitwise equal."""
    modules, tensors = _fingerprint(block)
    assert modules.keys() == before[0].keys(), "the module tree changed"
    for n, (m, attrs) in modules.items():
        m0, attrs0 = before[0][n]
        assert m is m0, f"module {n!r} was replaced"
        assert attrs.keys() == attrs0.keys(), (
            f"module {n!r}: attributes added {sorted(attrs.keys() - attrs0.keys())}, "
            f"removed {sorted(attrs0.keys() - attrs.keys())}")
        changed = sorted(k for k in attrs if attrs[k] != attrs0[k])
        assert not changed, f"module {n!r}: attributes changed {changed}"
    assert tensors.keys() == before[1].keys()
    for k, (t, rg, grad, bits, dtype, shape, device) in tensors.items():
        t0, rg0, grad0, bits0, dtype0, shape0, device0 = before[1][k]
        assert t is t0 and rg == rg0 and grad is grad0, f"{k}: tensor object or its grad flags changed"
        assert (dtype, shape, device) == (dtype0, shape0, device0), k
        assert torch.equal(bits, bits0), f"{k} changed"


def _quantized_state(block: torch.nn.Module) -> dict:
    """Weights, plus the tensors auto-round's unwrap leaves on each layer (scale, zp), as bytes."""
    out = {k: _bits(v) for k, v in block.state_dict().items()}
    for n, m in block.named_modules():
        for k, v in m.__dict__.items():
            if isinstance(v, torch.Tensor):
                out[f"{n}:{k}"] = _bits(v)
    return out


def _call(tiny_block, block=None, **kw):
    fp_block, inputs, others = tiny_block
    block = copy.deepcopy(fp_block) if block is None else block
    args = dict(input_others=others, iters=2, batch_size=4)
    args.update(kw)
    inputs = args.pop("inputs", inputs)
    before = _fingerprint(block)
    try:
        return dpq.parallel_tune(block, inputs, **args)
    except ValueError:
        # every refusal happens before the block is touched
        _assert_exactly_as_before(block, before)
        raise


@pytest.mark.parametrize("world", [0, -1, "two", 1.5])
def test_bad_world(tiny_block, world):
    with pytest.raises(ValueError, match="world must be 'off', 'auto' or an integer >= 1"):
        _call(tiny_block, world=world)


def test_more_lanes_than_samples_per_iteration(tiny_block):
    with pytest.raises(ValueError, match="every lane needs at least one sample"):
        _call(tiny_block, world=3, devices="cpu,cpu,cpu", batch_size=2)


def test_mismatched_input_shapes(tiny_block):
    _, inputs, _ = tiny_block
    bad = list(inputs)
    bad[3] = bad[3][:, :16]
    with pytest.raises(ValueError, match=r"mismatched shapes.*samples \[3\]"):
        _call(tiny_block, inputs=bad)


def test_device_that_does_not_exist(tiny_block):
    # an index no machine has, so the refusal holds on GPU machines too (not >= 128: torch keeps
    # device indices in an int8, and torch.device("cuda:4096") is cuda:0)
    with pytest.raises(ValueError, match=r"cuda:99 does not exist"):
        _call(tiny_block, world=2, devices=["cpu", "cuda:99"])


def test_too_few_devices_for_world(tiny_block):
    with pytest.raises(ValueError, match=r"world 3 needs 3 (lane )?devices"):
        _call(tiny_block, world=3, devices="cpu,cpu")


def test_auto_on_cpu_runs_serial_and_applies_best(tiny_block):
    block, inputs, others = tiny_block
    block = copy.deepcopy(block)
    w_before = block.mlp.down_proj.weight.clone()
    res = dpq.parallel_tune(block, inputs, input_others=others, iters=3, batch_size=4, world="auto")
    assert res.world == 1 and res.communicator == "local"
    assert len(res.losses) == 3 and res.best_loss == min(res.losses)
    assert not any(hasattr(m, "orig_layer") for m in block.modules())
    assert not torch.equal(block.mlp.down_proj.weight, w_before)  # quantized weights applied


def test_world2_reports_lanes_and_bytes(tiny_block):
    block, inputs, others = tiny_block
    res = dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, iters=2, batch_size=4,
                            world=2, devices="cpu,cpu")
    assert res.world == 2 and res.devices == ["cpu", "cpu"]
    assert res.wire_bytes > 0 and res.communicator == "local"


# --- bad inputs: refused before work, every problem at once, each with its fix -----------------


def _refused(tiny_block, match: str, **kw) -> str:
    with pytest.raises(ValueError, match=match) as info:
        _call(tiny_block, **kw)
    msg = str(info.value)
    assert msg.startswith("dpq.parallel_tune: ") and "Fix:" in msg, msg
    return msg


def test_integer_inputs(tiny_block):
    _, inputs, _ = tiny_block
    ids = [torch.randint(0, 100, t.shape) for t in inputs]
    _refused(tiny_block, r"inputs are torch.int64.*hidden states", inputs=ids)


def test_float64_inputs(tiny_block):
    _, inputs, _ = tiny_block
    _refused(tiny_block, r"inputs are torch.float64.*Fix: cast", inputs=[t.double() for t in inputs])


def test_meta_inputs(tiny_block):
    _, inputs, _ = tiny_block
    _refused(tiny_block, r"inputs are on the meta device", inputs=[t.to("meta") for t in inputs])


def test_nonfinite_inputs_and_outputs(tiny_block):
    _, inputs, _ = tiny_block
    bad = [t.clone() for t in inputs]
    bad[2][0, 3, 7] = float("nan")
    bad[5][0, 0, 0] = float("inf")
    outputs = [t.clone() for t in inputs]
    outputs[1][0, 1, 1] = float("-inf")
    msg = _refused(tiny_block, r"inputs \[2, 5\] contain NaN or inf", inputs=bad, outputs=outputs)
    assert "outputs [1] contain NaN or inf" in msg


def test_block_without_parameters(tiny_block):
    _refused(tiny_block, r"the block has no parameters", block=torch.nn.Sequential(torch.nn.ReLU()))


def test_block_without_linear(tiny_block):
    _refused(tiny_block, r"the block has no Linear layer to quantize",
             block=torch.nn.Sequential(torch.nn.LayerNorm(256)))


def test_block_on_meta(tiny_block):
    block = copy.deepcopy(tiny_block[0]).to("meta")
    _refused(tiny_block, r"the block's weights are on the meta device", block=block)


def test_already_wrapped_block(tiny_block):
    from auto_round.wrapper import wrapper_block

    block = copy.deepcopy(tiny_block[0])
    api._mark_for_quantization(block, "W4A16", None, None, None)
    wrapper_block(block, True, False, enable_torch_compile=False, device="cpu")
    _refused(tiny_block, r"already wrapped for tuning \(self_attn.q_proj, ", block=block)


def test_already_quantized_block(tiny_block):
    block = copy.deepcopy(tiny_block[0])
    dpq.parallel_tune(block, tiny_block[1], input_others=tiny_block[2], iters=1, batch_size=4, world=1)
    _refused(tiny_block, r"already quantized \(self_attn.q_proj, .*scale", block=block)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_inputs_on_another_device(tiny_block):
    _, inputs, _ = tiny_block
    _refused(tiny_block, r"inputs are on cuda:0 but the block is on cpu", inputs=[t.cuda() for t in inputs])
    # the runner moves input_others along only when the inputs move: a CPU mask with GPU inputs breaks
    _refused(tiny_block, r"input_others\['position_ids'\] is on cpu but the inputs are on cuda:0",
             block=copy.deepcopy(tiny_block[0]).cuda(), inputs=[t.cuda() for t in inputs])


def test_every_problem_at_once(tiny_block):
    _, inputs, _ = tiny_block
    bad = [t.double() for t in inputs]
    bad[1] = bad[1][:, :16]
    bad[4][0, 0, 0] = float("nan")
    msg = _refused(tiny_block, r"problems", inputs=bad, iters=0, world=3, devices="cpu,cpu",
                   block=torch.nn.Sequential(torch.nn.LayerNorm(256)))
    for part in ("mismatched shapes", "float64", "[4] contain NaN or inf", "iters must be >= 1",
                 "world 3 needs 3", "no Linear layer"):
        assert part in msg, (part, msg)


# --- failures: the block comes back exactly as passed in, and a retry tunes the fp block ---------


WORLD_DEVICES = {1: "cpu", 2: "cpu,cpu"}
_clean: dict[int, tuple] = {}


def _tune(tiny_block, block, world):
    _, inputs, others = tiny_block
    return dpq.parallel_tune(block, inputs, input_others=others, iters=3, batch_size=4, world=world,
                             devices=WORLD_DEVICES[world])


def _clean_run(tiny_block, world):
    """A run that never failed (same process: the retry must match it bit for bit)."""
    if world not in _clean:
        block = copy.deepcopy(tiny_block[0])
        res = _tune(tiny_block, block, world)
        _clean[world] = (_quantized_state(block), res.losses, res.best_params)
    return _clean[world]


def _fail_lane_loss(monkeypatch, lane: int, after: int, exc: type[BaseException] = RuntimeError) -> None:
    """Lane ``lane``'s loss raises on its call number ``after + 1`` (mid-tune)."""
    real = tune.make_lane_loss

    def make(*a, **k):
        loss = real(*a, **k)
        calls = [0]

        def lane_loss(on, module, indices):
            if on.index == lane:
                calls[0] += 1
                if calls[0] > after:
                    raise exc("injected lane failure")
            return loss(on, module, indices)

        return lane_loss

    monkeypatch.setattr(tune, "make_lane_loss", make)


def _inject(monkeypatch, where: str, world: int) -> type[BaseException]:
    from auto_round.algorithms.block_runner import BlockForwardRunner
    from auto_round.wrapper import WrapperLinear

    if where == "reference outputs":
        real_forward = BlockForwardRunner.forward

        def forward(self, block, inputs, others, indices=None, **k):
            if indices is not None:  # parallel_tune's check of the first sample, before the run (issue 42)
                return real_forward(self, block, inputs, others, indices, **k)
            raise RuntimeError("injected reference-output failure")

        monkeypatch.setattr(BlockForwardRunner, "forward", forward)
    elif where == "wrapping":
        real_wrap = api.wrapper_block

        def wrap(block, *a, **k):
            real_wrap(block, *a, **k)
            raise RuntimeError("injected failure after wrapping")

        monkeypatch.setattr(api, "wrapper_block", wrap)
    elif where == "mirrors":
        def replicas(*a, **k):
            raise RuntimeError("injected mirror failure")

        monkeypatch.setattr(session, "ReplicaSet", replicas)
    elif where == "last lane, iteration 1":
        _fail_lane_loss(monkeypatch, lane=world - 1, after=1)
    elif where == "home lane, iteration 2":
        _fail_lane_loss(monkeypatch, lane=0, after=2)
    elif where == "interrupt":
        _fail_lane_loss(monkeypatch, lane=world - 1, after=1, exc=KeyboardInterrupt)
        return KeyboardInterrupt
    elif where == "final unwrap":
        real_unwrap = WrapperLinear.unwrapper
        calls = [0]

        def unwrapper(self, best):
            calls[0] += 1
            if calls[0] == 4:  # three layers already unwrapped with their tuned values
                raise RuntimeError("injected unwrap failure")
            return real_unwrap(self, best)

        monkeypatch.setattr(WrapperLinear, "unwrapper", unwrapper)
    return RuntimeError


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("where", ["reference outputs", "wrapping", "mirrors", "last lane, iteration 1",
                                   "home lane, iteration 2", "interrupt", "final unwrap"])
def test_failure_leaves_block_exactly_as_passed_and_retry_tunes_it(tiny_block, monkeypatch, where, world):
    clean_state, clean_losses, clean_best = _clean_run(tiny_block, world)
    block = copy.deepcopy(tiny_block[0])
    before = _fingerprint(block)
    exc = _inject(monkeypatch, where, world)
    with pytest.raises(exc, match="injected"):
        _tune(tiny_block, block, world)
    monkeypatch.undo()
    _assert_exactly_as_before(block, before)

    res = _tune(tiny_block, block, world)  # the retry tunes the fp block: the run that never failed
    assert res.losses == clean_losses
    state = _quantized_state(block)
    assert state.keys() == clean_state.keys()
    assert all(torch.equal(state[k], clean_state[k]) for k in state)
    assert res.best_params.keys() == clean_best.keys()


# --- a failed run's error does not keep the run's memory alive -------------------------------


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", ["lane loss", "lane forward"])
def test_error_does_not_keep_mirrors_wrappers_or_optimizers_alive(tiny_block, monkeypatch, world, how):
    refs: list[weakref.ref] = []

    class RecordingReplicas(session.ReplicaSet):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            refs.append(weakref.ref(self))
            refs.extend(weakref.ref(m) for m in self.modules[1:])
            refs.extend(weakref.ref(p) for k in range(self.local_lanes) for p in self.tuned_params(k))
            if how == "lane forward":
                self.modules[-1].register_forward_pre_hook(ForwardFault(after=2))

    class RecordingEngine(session.TuneEngine):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            refs.append(weakref.ref(self))
            refs.extend(weakref.ref(o) for o in self.optimizers)

    real_wrap = api.wrapper_block

    def recording_wrap(block, *a, **k):
        out = real_wrap(block, *a, **k)
        refs.extend(weakref.ref(m) for m in block.modules() if hasattr(m, "orig_layer"))
        return out

    monkeypatch.setattr(session, "ReplicaSet", RecordingReplicas)
    monkeypatch.setattr(session, "TuneEngine", RecordingEngine)
    monkeypatch.setattr(api, "wrapper_block", recording_wrap)
    if how == "lane loss":
        _fail_lane_loss(monkeypatch, lane=world - 1, after=2)
    block = copy.deepcopy(tiny_block[0])
    before = _fingerprint(block)
    with pytest.raises(RuntimeError, match="injected") as info:
        _tune(tiny_block, block, world)
    assert len(refs) > 7 + 2 * world
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    err = info.value  # the error is still alive ...
    assert not alive, f"{len(alive)} objects of the failed run still alive: {[type(o).__name__ for o in alive][:8]}"
    # ... and still says where it failed
    where = "\n".join(err.__notes__)
    assert "where it failed" in where and ("lane_loss" in where if how == "lane loss" else "__call__" in where)
    _assert_exactly_as_before(block, before)


def test_the_callers_own_error_is_left_alone(tiny_block, monkeypatch):
    """Called while the caller handles an error: that error (the new one's context) keeps its traceback."""
    _inject(monkeypatch, "mirrors", 2)
    try:
        raise KeyError("the caller's")
    except KeyError as caller:
        with pytest.raises(RuntimeError, match="injected") as info:
            _tune(tiny_block, copy.deepcopy(tiny_block[0]), 2)
        assert info.value.__context__ is caller
        assert caller.__traceback__ is not None and not getattr(caller, "__notes__", None)


@pytest.mark.parametrize("world", [1, 2])
def test_callers_weights_get_no_gradients(tiny_block, world):
    """Only the wrappers' values are tuned: the block's own (trainable) weights are frozen while it
    tunes (as in auto-round's frozen model) and come back trainable, without a ``.grad``."""
    block, inputs, others = tiny_block
    block = copy.deepcopy(block)
    block.requires_grad_(True)
    dpq.parallel_tune(block, inputs, input_others=others, iters=2, batch_size=4, world=world,
                      devices=",".join(["cpu"] * world))
    assert all(p.requires_grad for p in block.parameters())
    assert [n for n, p in block.named_parameters() if p.grad is not None] == []


# --- the caller's context and tensors (issue 18: each failed before its fix) ---------------------


@pytest.mark.parametrize("setting, value, want", [
    ("batch_size", "4", "batch_size must be an integer >= 1, got '4'"),
    ("iters", True, "iters must be an integer >= 1, got True"),
    ("gradient_accumulate_steps", 1.0, "gradient_accumulate_steps must be an integer >= 1, got 1.0"),
    ("lr", "0.01", "lr must be a finite number > 0, or None, got '0.01'"),
    ("momentum", float("nan"), "momentum must be a finite number >= 0, or None, got nan"),
    ("seed", 1.5, "seed must be an integer or None, got 1.5"),
    ("group_size", "128", "group_size must be -1 (one group per output channel), 0 (the whole tensor) or an integer "
                          ">= 1 (e.g. 128), or None for the scheme's, got '128'"),
])
def test_a_setting_of_the_wrong_type_is_a_value_error(tiny_block, setting, value, want):
    """Not a TypeError from deep inside the run: the promised ValueError naming the setting and the fix."""
    assert want in _refused(tiny_block, re.escape(want), **{setting: value})


@pytest.mark.parametrize("empty", [[], ()])
def test_empty_position_embeddings_are_refused(tiny_block, empty):
    others = dict(tiny_block[2], position_embeddings=empty)
    _refused(tiny_block, r"input_others\['position_embeddings'\] is empty\. Fix: ", input_others=others)
    pairs = dict(tiny_block[2], position_embeddings=[(t,) for t, _ in tiny_block[2]["position_embeddings"]])
    _refused(tiny_block, r"input_others\['position_embeddings'\] must hold \(cos, sin\) pairs", input_others=pairs)


def test_inference_tensors_are_refused_with_the_fix(tiny_block):
    block, inputs, _ = tiny_block
    with torch.inference_mode():
        frozen = [t.clone() for t in inputs]
        frozen_block = copy.deepcopy(block)
    msg = _refused(tiny_block, r"inputs hold inference tensors .* Fix: capture them under torch.no_grad\(\)",
                   inputs=frozen)
    assert "Inference tensors cannot be saved" not in msg
    _refused(tiny_block, r"the block's weights hold inference tensors", block=frozen_block)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_the_callers_grad_mode_does_not_matter(tiny_block, mode):
    block, inputs, others = tiny_block
    plain = dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, iters=2, batch_size=4, world=2,
                              devices="cpu,cpu")
    block = copy.deepcopy(block)  # made outside the mode (under inference_mode a copy's weights are inference tensors)
    with mode():
        res = dpq.parallel_tune(block, inputs, input_others=others, iters=2, batch_size=4, world=2, devices="cpu,cpu")
    assert res.losses == plain.losses


def test_inputs_that_require_grad_get_no_grad(tiny_block):
    block, inputs, others = tiny_block
    plain = dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, iters=2, batch_size=4, world=1)
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    pe = [tuple(t.clone().requires_grad_(True) for t in pair) for pair in others["position_embeddings"]]
    res = dpq.parallel_tune(copy.deepcopy(block), leaves, input_others=dict(others, position_embeddings=pe), iters=2,
                            batch_size=4, world=1)
    assert res.losses == plain.losses
    assert all(t.grad is None for t in leaves) and all(t.grad is None for pair in pe for t in pair)


def test_the_private_sampler_draws_auto_rounds_serial_indices():
    from auto_round.compressors.utils import IndexSampler

    random.seed(42)
    serial = IndexSampler(8, 3)
    want = [serial.next_batch() for _ in range(7)]  # several reshuffles
    state = random.getstate()
    private = api._private_sampler(random.Random(42))(8, 3)
    assert [private.next_batch() for _ in range(7)] == want
    assert random.getstate() == state  # the global generator neither read nor advanced


def test_two_threads_tune_as_they_would_one_after_the_other(tiny_block):
    """Each seeded call draws from its own generator: two at once in two threads give what each gives
    alone, and the global generator is left as it was."""
    import threading

    block, inputs, others = tiny_block

    def tune_one(seed: int):
        return dpq.parallel_tune(copy.deepcopy(block), inputs, input_others=others, iters=3, batch_size=4, world=1,
                                 seed=seed)

    alone = {seed: tune_one(seed) for seed in (1, 2)}
    assert alone[1].indices != alone[2].indices
    state = random.getstate()
    results: dict = {}
    threads = [threading.Thread(target=lambda s=seed: results.__setitem__(s, tune_one(s))) for seed in (1, 2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        random.random()  # a third party drawing from the global generator meanwhile
        time.sleep(0.001)  # between draws: a spinning loop holds the GIL the two tuning threads need
    for t in threads:
        t.join()
    for seed in (1, 2):
        assert results[seed].indices == alone[seed].indices and results[seed].losses == alone[seed].losses
    random.setstate(state)
    tune_one(1)
    assert random.getstate() == state


def test_too_few_inputs_names_parallel_tunes_arguments(tiny_block):
    """Issue 31, item 8: ``parallel_tune`` with 2 inputs at world 4 said "Fix: a smaller world or a larger
    --batch_size": a CLI flag, and not the limit (the 2 inputs, with batch_size 4)."""
    _, inputs, _ = tiny_block
    msg = _refused(tiny_block, r"every lane needs at least one sample", inputs=list(inputs[:2]), world=4,
                   devices="cpu,cpu,cpu,cpu")
    assert "4 lanes but only 2 samples per iteration (inputs holds 2 samples)" in msg, msg
    assert "Fix: at least 4 inputs (one tensor each), or a smaller world= (at most 2)" in msg
    assert "--" not in msg, msg  # no command-line flag in an API error
    msg = _refused(tiny_block, r"world 3 needs 3", world=3, devices="cpu,cpu")
    assert "Fix: devices= with one device per lane" in msg and "a smaller world=" in msg and "--" not in msg, msg


def test_inputs_that_do_not_fit_the_block_are_refused_before_work(tiny_block):
    """Issue 31, item 15: inputs of another hidden size raised torch's "The size of tensor a (256) must
    match the size of tensor b (100)" from inside the run, not the list of problems with their fixes."""
    _, inputs, _ = tiny_block
    msg = _refused(tiny_block, r"inputs have hidden size 100", inputs=[torch.randn(*t.shape[:-1], 100) for t in inputs])
    assert "none of the block's Linear layers takes 100 features (they take 256, " in msg, msg
    short = [t[:, :16] for t in inputs]  # the rotary embeddings were computed for 32 positions
    msg = _refused(tiny_block, r"position_embeddings'\] cover 32 positions but the inputs have 16", inputs=short)
    assert "Fix: pass the (cos, sin) pairs computed for these inputs' sequence length" in msg


def test_world_and_device_errors_name_parallel_tunes_arguments(tiny_block):
    """Issue 31 ("API errors name API arguments"): a bad world and a lane device that does not exist said
    "--parallel_quantization" and "--parallel_devices" to a Python caller."""
    msg = _refused(tiny_block, r"world must be 'off', 'auto' or an integer >= 1", world=0)
    assert "Fix: pass e.g. world=2 (or 'auto')" in msg and "--" not in msg, msg
    msg = _refused(tiny_block, r"cuda:99 does not exist", world=2, devices=["cpu", "cuda:99"])
    assert "Fix: devices= with entries like" in msg and "--" not in msg, msg
    msg = _refused(tiny_block, r"'gpu' is not a device", world=2, devices="cpu,gpu")
    assert "--" not in msg, msg


def test_a_block_that_needs_input_others_says_so_before_work(tiny_block):
    """Issue 42, item 5: ``input_others`` is optional, but a Llama layer called without its rotary
    ``position_embeddings`` raised transformers' "TypeError: cannot unpack non-iterable NoneType object"
    from inside the run instead of the ValueError naming what the block needs. The block's forward now
    runs on the first sample before any work, and its failure is said with what input_others lacks."""
    msg = _refused(tiny_block, r"the block's forward fails on inputs\[0\] with no input_others: TypeError",
                   input_others=None)
    assert "LlamaDecoderLayer.forward also takes " in msg and "(position_embeddings: the rotary (cos, sin) pair" in msg
    assert "Fix: pass input_others as the model hands them to this block" in msg, msg
    _, _, others = tiny_block
    msg = _refused(tiny_block, r"with input_others gives attention_mask", input_others={
        k: v for k, v in others.items() if k != "position_embeddings"})
    assert "also takes " in msg and "position_embeddings" in msg.split("also takes ")[1], msg


@pytest.mark.parametrize("setting, value, said", [
    ("bits", 0, "bits must be an integer >= 1"), ("bits", -1, "bits must be an integer >= 1"),
    ("group_size", -7, r"group_size must be -1 \(one group per output channel\)"),
])
def test_settings_that_would_wreck_the_block_are_refused(tiny_block, setting, value, said):
    """Issue 42's sweep, H2 and M7: ``bits=0`` (or -1) returned 'OK' with every weight non-finite, and
    ``group_size=-7`` raised torch's "invalid shape dimension" from inside the run. Refused before work now."""
    msg = _refused(tiny_block, said, **{setting: value})
    assert f"got {value}" in msg and "Fix: pass" in msg, msg


def test_outputs_of_another_hidden_size_are_refused_before_work(tiny_block):
    """Issue 42's sweep, M7: outputs with another hidden size than their inputs raised "The size of tensor a
    (256) must match" from inside the run; an output has its input's whole shape."""
    _, inputs, _ = tiny_block
    msg = _refused(tiny_block, r"outputs \[0, 1, 2, 3, 4\] do not have their inputs' shape",
                   outputs=[torch.randn(*t.shape[:-1], 99) for t in inputs])
    assert "hidden size" in msg, msg


@pytest.mark.parametrize("kwargs, said", [
    (dict(timeout=-1), r"timeout=-1 is not more than 0 and at most 604800 seconds"),
    (dict(timeout=0), r"timeout=0 is not more than 0"),
    (dict(timeout=float("nan")), r"timeout=nan is not more than 0"),
    (dict(timeout=float("inf")), r"timeout=inf is not more than 0"),
    (dict(timeout=None), r"timeout=None is not a number of seconds"),
    (dict(timeout="abc"), r"timeout='abc' is not a number of seconds"),
    (dict(timeout=True), r"timeout=True is not a number of seconds"),
    (dict(overlap="maybe"), r"overlap='maybe' is not a setting. Fix: 'auto'"),
    (dict(world=2, devices=5), r"world 2 needs 2 lane devices but 1 was given \(5\)"),
    (dict(world=2, devices=[]), r"the lane device list is empty. Fix: devices="),
    (dict(world=2, devices=5.5), r"lane device list 5.5: 5.5 is not a device"),
])
def test_lane_settings_are_refused_before_work_in_its_own_names(tiny_block, kwargs, said):
    """Issue 42's third sweep, M6 and M10: ``parallel_tune`` built its ``ParallelSpec`` directly, skipping
    the checks: ``timeout=-1``, 0 or nan stopped the tune mid-block as hung (nan also with a watchdog
    thread's OverflowError), ``timeout=None`` raised TypeError, ``inf`` ran with no watchdog; ``overlap='maybe'``
    was refused naming ``--parallel_overlap``; ``devices=5`` raised "'int' object is not iterable"."""
    msg = _refused(tiny_block, said, **kwargs)
    assert "--parallel" not in msg, msg


def test_a_timeout_under_the_commands_floor_is_the_callers(tiny_block):
    """One process, one block: no process group to wait for, so any positive timeout is a setting
    (the GPU check's race probe runs one of 1 s)."""
    assert _call(tiny_block, timeout=5).best_iter >= 0


@pytest.mark.parametrize("kwargs, said", [
    (dict(block=None), r"block is a NoneType, not a torch.nn.Module"),
    (dict(block=torch.nn.Linear(256, 256)), r"the block is itself a Linear"),
    (dict(input_others="x"), r"input_others is a str, not a dict"),
    (dict(scheme=None), r"unknown scheme None"),
    (dict(valid_token_mask=[torch.ones(3)]), r"valid_token_mask is 1 masks, but there are 8 inputs"),
])
def test_arguments_of_the_wrong_kind_are_refused_before_work(tiny_block, kwargs, said):
    """Issue 42's third sweep, M12: ``block=None`` raised AttributeError, a bare ``Linear`` block auto-round's
    "Cannot set the submodule without a target name!", ``input_others='x'`` "dictionary update sequence element
    #0", ``scheme=None`` AttributeError, a short ``valid_token_mask`` IndexError from inside the run."""
    if "block" in kwargs and kwargs["block"] is None:
        _, inputs, others = tiny_block
        with pytest.raises(ValueError, match=said):
            dpq.parallel_tune(None, inputs, input_others=others, iters=2)
        return
    _refused(tiny_block, said, **kwargs)
