"""Gradient buckets and the full-sum / sign exchange policies on CPU lanes."""

from __future__ import annotations

import pytest
import torch

from dpq.comm.communicators import select_communicator
from dpq.engine.exchange import Buckets, ExchangePlan, FullSumExchange, GradBuckets, SignExchange
from dpq.engine.sign_bits import sign_padded_length
from dpq.streams import make_lanes

WORLDS = [1, 2, 3, 4]
LENGTHS = [1, 7, 13, 1000, 4099]


def lane_params(world: int, shapes, dtype=torch.float32) -> list[list[torch.nn.Parameter]]:
    return [[torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes] for _ in range(world)]


def comm_for(world: int, name: str = "local"):
    return select_communicator(make_lanes(["cpu"] * world), prefer=name)[0]


def fill_grads(buckets: GradBuckets, seed: int) -> list[torch.Tensor]:
    """Random lane gradients with the zeros the sign path must keep: scattered exact zeros, an
    all-zero lane (W >= 3), elements zero on every lane, and elements whose lane sum cancels to 0."""
    gen = torch.Generator().manual_seed(seed)
    world, n = buckets.local_lanes, buckets.numel
    grads = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 3, (n,), generator=gen) for _ in range(world)]
    for g in grads:
        g[torch.rand(n, generator=gen) < 0.25] = 0.0
    all_zero = torch.rand(n, generator=gen) < 0.2
    for g in grads:
        g[all_zero] = 0.0
    if world >= 3:
        grads[1].zero_()
    if world >= 2 and n >= 3:
        grads[0][2], grads[-1][2] = 0.5, -0.5  # cancels exactly in fp32 (the lanes between hold 0 there)
        for g in grads[1:-1]:
            g[2] = 0.0
    for buf, g in zip(buckets.buffers, grads, strict=True):
        buf.copy_(g)
    return grads


def lane_order_sum(xs):
    acc = xs[0].clone()
    for x in xs[1:]:
        acc += x
    return acc


def wire_sign(xs, wire=torch.bfloat16):
    """What the sign exchange leaves: the sign of the lane-order sum of the gradients cast to ``wire``,
    each add rounded to ``wire`` (Note [the summed gradient in bf16 on the wire]), as fp32."""
    return torch.sign(lane_order_sum([x.to(wire) for x in xs])).float()


def assert_same_bits_everywhere(buckets: GradBuckets) -> None:
    for buf in buckets.buffers[1:]:
        assert torch.equal(buf.view(torch.int32), buckets.buffers[0].view(torch.int32))


# -- GradBuckets ------------------------------------------------------------------------------


def test_reverse_layout_and_buckets():
    params = lane_params(2, [(3,), (2, 2), (5,)])
    b = GradBuckets(params, bucket_cap_elems=9)
    assert b.numel == 12
    assert b.offsets == [9, 5, 0]  # last parameter first
    assert b.bucket_params == [[2, 1], [0]]
    assert b.bucket_ranges == [(0, 9), (9, 12)]
    one_each = GradBuckets(params, bucket_cap_elems=1)  # a parameter over the cap gets its own bucket
    assert one_each.bucket_ranges == [(0, 5), (5, 9), (9, 12)]
    assert GradBuckets(params).bucket_ranges == [(0, 12)]


def test_grads_are_views_and_backward_accumulates_in_place():
    params = lane_params(2, [(3,), (2, 2), (5,)])
    b = GradBuckets(params, bucket_cap_elems=9)
    b.attach()
    for buf, ps in zip(b.buffers, params, strict=True):
        for p, off in zip(ps, b.offsets, strict=True):
            assert p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            assert p.grad.data_ptr() == buf.data_ptr() + off * 4
            assert p.grad.shape == p.shape
    for k, ps in enumerate(params):
        for _ in range(2):  # two backwards accumulate into the same slots
            sum(((i + 1 + k) * p).sum() for i, p in enumerate(ps)).backward()
    for k, buf in enumerate(b.buffers):
        expected = torch.cat(
            [torch.full((5,), 2.0 * (3 + k)), torch.full((4,), 2.0 * (2 + k)), torch.full((3,), 2.0 * (1 + k))]
        )
        assert torch.equal(buf, expected)
    assert b.is_attached()


def test_attach_after_zero_grad_set_to_none():
    params = lane_params(1, [(4,), (6,)])
    b = GradBuckets(params)
    b.attach()
    opt = torch.optim.SGD(params[0], lr=0.1)
    (params[0][0].sum() + params[0][1].sum()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert params[0][0].grad is None and not b.is_attached()
    b.attach()
    assert b.is_attached()
    assert torch.equal(b.buffers[0], torch.zeros(10))  # attach zeroes
    (3 * params[0][1].sum()).backward()
    assert torch.equal(b.buffers[0], torch.cat([torch.full((6,), 3.0), torch.zeros(4)]))


def test_refusals():
    with pytest.raises(TypeError, match="fp32"):
        GradBuckets(lane_params(2, [(3,)], dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="fp32"):
        GradBuckets(lane_params(1, [(3,)], dtype=torch.float16))
    mismatched = lane_params(2, [(3,)])
    mismatched[1][0] = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        GradBuckets(mismatched)
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="twice"):
        GradBuckets([[p, p]])
    with pytest.raises(ValueError, match="1 tuned parameters, lane 0 has 2"):
        GradBuckets([lane_params(1, [(3,), (3,)])[0], lane_params(1, [(3,)])[0]])
    with pytest.raises(ValueError, match="2 gradient buffers for 3 lanes"):
        FullSumExchange(comm_for(3)).exchange(GradBuckets(lane_params(2, [(3,)])))


# -- exchanges ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("comm_name", ["local", "p2p", "host"])
def test_full_sum(world, comm_name):
    comm = comm_for(world, comm_name)
    ex = FullSumExchange(comm)
    for n in LENGTHS:
        b = GradBuckets(lane_params(world, [(n,), (n // 3 + 1,)]), bucket_cap_elems=max(n // 2, 1))
        b.attach()
        grads = fill_grads(b, seed=n + world)
        ex.exchange(b)
        assert_same_bits_everywhere(b)
        total = lane_order_sum(grads)
        assert torch.equal(b.buffers[0], total)
        ref64 = sum(g.double() for g in grads)
        # any-order bound of a W-term fp32 sum: (W - 1) 2**-24 sum|g| (tests/numerics.py); W 2**-23 covers it
        bound = world * 2.0**-23 * sum(g.double().abs() for g in grads)
        assert bool(((b.buffers[0].double() - ref64).abs() <= bound).all())
        # Counted: per bucket of n_b fp32 elements, 2*(W-1)*n_b*4 // W (the ring all-reduce).
        expected = sum(2 * (world - 1) * (e - s) * 4 // world for s, e in b.bucket_ranges)
        assert ex.last_wire_bytes == expected
        assert abs(expected - (world - 1) / world * 8 * b.numel) <= len(b.bucket_ranges)
        for ps in b.params:  # the grads seen by an optimizer are the sum
            assert torch.equal(ps[0].grad, total[b.offsets[0] : b.offsets[0] + n])


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("comm_name", ["local", "p2p", "host"])
def test_sign(world, comm_name, wire):
    comm = comm_for(world, comm_name)
    ex = SignExchange(comm, ExchangePlan("sign", wire_dtype=wire))
    total_before = 0
    for n in LENGTHS:
        b = GradBuckets(lane_params(world, [(n,), (5,)]), bucket_cap_elems=n)
        b.attach()
        grads = fill_grads(b, seed=n + 10 * world)
        ex.exchange(b)
        assert_same_bits_everywhere(b)
        expected_sign = wire_sign(grads, wire)  # sign of the sum in lane order, in the wire's dtype
        assert torch.equal(b.buffers[0], expected_sign)
        assert set(b.buffers[0].unique().tolist()) <= {-1.0, 0.0, 1.0}
        everywhere_zero = torch.stack([g == 0 for g in grads]).all(0)
        assert bool((b.buffers[0][everywhere_zero] == 0).all()), "a zero sum must stay 0, not become +-1"
        if world >= 2 and n >= 3:
            assert b.buffers[0][2] == 0  # lanes cancel exactly: 0, although no lane was 0
        # Counted on the padded length m of each bucket: (W-1)/W * (2 or 4 + 0.25) bytes per element, exact.
        padded = [sign_padded_length(e - s, world) for s, e in b.bucket_ranges]
        per, quarters = (2.25, 9) if wire == torch.bfloat16 else (4.25, 17)
        assert ex.last_wire_bytes == sum(round((world - 1) / world * per * m) for m in padded)
        assert ex.last_wire_bytes == sum(quarters * (world - 1) * m // (4 * world) for m in padded)
        assert ex.total_wire_bytes == total_before + ex.last_wire_bytes
        total_before = ex.total_wire_bytes
        if world == 1:
            assert ex.last_wire_bytes == 0


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world", WORLDS)
def test_sign_matches_torch_sign_on_nan_and_inf(world, wire):
    """Serial SignSGD applies torch.sign(grad), which maps NaN to 0 and +-inf to +-1: so must the
    sign path. Overflowing min/max-scale gradients under sum-reduced losses make this real."""
    assert torch.sign(torch.tensor(float("nan"))) == 0  # the semantics this path reproduces
    n = 53
    b = GradBuckets(lane_params(world, [(n,)]))
    b.attach()
    grads = fill_grads(b, seed=7 + world)
    grads[0][5] = float("nan")  # NaN on one lane: the sum is NaN
    grads[-1][9] = float("inf")
    grads[0][11] = float("-inf")
    if world >= 2:
        grads[0][13], grads[1][13] = float("inf"), float("-inf")  # inf + -inf = NaN
    for buf, g in zip(b.buffers, grads, strict=True):
        buf.copy_(g)
    SignExchange(comm_for(world), ExchangePlan("sign", wire_dtype=wire)).exchange(b)
    expected = wire_sign(grads, wire)
    assert expected[5] == 0 and expected[9] == 1 and expected[11] == -1
    assert_same_bits_everywhere(b)
    assert torch.equal(b.buffers[0], expected)


def test_sign_padding():
    assert sign_padded_length(1, 1) == 8
    assert sign_padded_length(16, 2) == 16
    assert sign_padded_length(17, 2) == 32
    assert sign_padded_length(4099, 3) == 4104


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32])
def test_sign_handles_bucket_already_aligned(wire):
    world, n = 2, 32  # m == n: fp32 sums send the grads themselves, bf16 ones a cast copy
    b = GradBuckets(lane_params(world, [(n,)]))
    b.attach()
    grads = fill_grads(b, seed=3)
    ex = SignExchange(comm_for(world), ExchangePlan("sign", wire_dtype=wire))
    ex.exchange(b)
    assert torch.equal(b.buffers[1], wire_sign(grads, wire))
    (copies,) = [g.pad_copies for g in ex._plan(b, 0).groups]
    assert (copies == []) == (wire == torch.float32)


def test_bf16_sums_differ_from_fp32_only_where_the_lanes_nearly_cancel():
    """Note [the summed gradient in bf16 on the wire]: a sign the bf16 sums change is one whose fp32 sum
    is within a few bf16 roundings of zero (2^-7 of the largest lane gradient there)."""
    world, n = 4, 4096
    b = GradBuckets(lane_params(world, [(n,)]))
    b.attach()
    grads = fill_grads(b, seed=11)
    grads[1][:512] = -grads[0][:512] * (1 + 2.0 ** -torch.randint(6, 12, (512,)))  # near-cancelling pairs
    for buf, g in zip(b.buffers, grads, strict=True):
        buf.copy_(g)
    SignExchange(comm_for(world)).exchange(b)
    exact = lane_order_sum(grads)
    changed = b.buffers[0] != torch.sign(exact)
    assert changed.any()  # the near-cancelling pairs do move some signs
    scale = torch.stack([g.abs() for g in grads]).amax(0)
    assert bool((exact[changed].abs() <= 2.0 ** -7 * scale[changed]).all())


def test_exchange_after_real_backward():
    """Mirrors of one Linear on 3 lanes, a backward each, one exchange: every lane holds the summed grads."""
    world = 3
    torch.manual_seed(0)
    home = torch.nn.Linear(6, 4)
    mirrors = [home] + [torch.nn.Linear(6, 4) for _ in range(world - 1)]
    for m in mirrors[1:]:
        m.load_state_dict(home.state_dict())
    b = GradBuckets([list(m.parameters()) for m in mirrors], bucket_cap_elems=5)
    b.attach()
    xs = [torch.randn(2, 6) for _ in range(world)]
    for m, x in zip(mirrors, xs, strict=True):
        m(x).square().sum().backward()
    singles = []
    for x in xs:
        ref = torch.nn.Linear(6, 4)
        ref.load_state_dict(home.state_dict())
        ref(x).square().sum().backward()
        singles.append([p.grad.clone() for p in ref.parameters()])
    FullSumExchange(comm_for(world)).exchange(b)
    for m in mirrors:
        for i, p in enumerate(m.parameters()):
            assert torch.equal(p.grad, lane_order_sum([s[i] for s in singles]))


def test_buckets_with_lanes():
    lanes = make_lanes(["cpu"] * 2)
    b = GradBuckets(lane_params(2, [(3,)]), lanes=lanes)
    b.attach()
    assert b.is_attached() and b.buffers[1].device.type == "cpu"
    with pytest.raises(ValueError, match="2 lanes for 3 parameter lists"):
        GradBuckets(lane_params(3, [(3,)]), lanes=lanes)
    cuda_lane = make_lanes(["cpu"])[0]
    cuda_lane.device = torch.device("cuda", 1)  # placement check only; nothing runs on it
    with pytest.raises(ValueError, match="parameters are on cpu but the lane is on cuda:1"):
        GradBuckets(lane_params(1, [(3,)]), lanes=[cuda_lane])


# -- the sign path's buffers and kernels (dpq.engine.sign_bits) ----------------------------------

# Buckets of several padded lengths, aligned (m == n) and not: cap 40 -> [23 | 17+5 | 40 | 31 | 9]
MIXED = [(9,), (31,), (40,), (5,), (17,), (23,)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sign_buffers_reused_across_iterations_and_bucket_sizes(world):
    """One set of buffers serves every bucket (sizes differ, some padded) and every iteration:
    each exchange is still exactly sign(lane-order sum), with nothing reallocated."""
    ex = SignExchange(comm_for(world))
    b = GradBuckets(lane_params(world, MIXED), bucket_cap_elems=40)
    assert len({sign_padded_length(e - s, world) for s, e in b.bucket_ranges}) >= 2
    assert any(sign_padded_length(e - s, world) != e - s for s, e in b.bucket_ranges)
    ptrs = None
    for it in range(3):
        b.attach()
        grads = fill_grads(b, seed=100 * world + it)
        ex.exchange(b)
        assert_same_bits_everywhere(b)
        assert torch.equal(b.buffers[0], wire_sign(grads))
        groups = b.scratch["sign"][1]
        assert len(groups) == 1 and groups[0][0] == list(range(world))  # CPU lanes: one shared group
        now = [t.data_ptr() for t in vars(groups[0][1]).values() if isinstance(t, torch.Tensor)]
        assert ptrs is None or now == ptrs  # the same memory every iteration
        ptrs = now


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sign_per_lane_buffers_give_the_shared_bits(world, monkeypatch):
    """Lanes with streams get their own buffers and unpack each their own gathered bytes: the
    same bits as CPU lanes sharing one group."""
    import dpq.engine.sign_bits as sb

    def exchanged():
        out = []
        for sizes, cap in ((MIXED, 40), (MIXED, 2**22), ([(4099,), (7,)], 1000)):
            b = GradBuckets(lane_params(world, sizes), bucket_cap_elems=cap)
            for it in range(2):
                b.attach()
                fill_grads(b, seed=7 * world + it)
                SignExchange(comm_for(world)).exchange(b)
                out.append([t.clone() for t in b.buffers])
        return out, len(b.scratch["sign"][1])

    shared, n_shared = exchanged()
    monkeypatch.setattr(sb, "lanes_share_buffers", lambda lanes: False)
    own, n_own = exchanged()
    assert (n_shared, n_own) == (1, world)
    for xs, ys in zip(shared, own, strict=True):
        assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(xs, ys, strict=True))


def test_sign_buffers_follow_the_lanes():
    """Buckets exchanged over other lanes get buffers of their own (the entry is keyed by the lanes)."""
    b = GradBuckets(lane_params(2, [(40,)]))
    b.attach()
    fill_grads(b, seed=1)
    SignExchange(comm_for(2)).exchange(b)
    first = b.scratch["sign"]
    grads = fill_grads(b, seed=2)
    SignExchange(comm_for(2)).exchange(b)  # new lanes
    assert b.scratch["sign"] is not first
    assert torch.equal(b.buffers[1], wire_sign(grads))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pack_and_unpack_signs_are_torch_sign(world):
    """pack_signs over rows, then the table and, as a cross-check of it, the bit-by-bit shifts: both
    exactly torch.sign (NaN -> 0, +-inf -> +-1, -0.0 -> 0, subnormals -> +-1)."""
    from dpq.engine.sign_bits import pack_signs, sign_table, take, unpack_signs

    c = 8 * 37
    gen = torch.Generator().manual_seed(world)
    r = torch.randn(world, c, generator=gen)
    r[torch.rand(world, c, generator=gen) < 0.3] = 0.0
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-45, -1e-45, 0.0, 3.0])
    r[:, :8] = special
    planes = torch.empty(2 * world * c, dtype=torch.bool)
    weighted = torch.empty(world * 2 * c, dtype=torch.uint8)
    packed = torch.empty(world, c // 4, dtype=torch.uint8)
    pack_signs(r, take(planes, world, c // 8, 2, 8), weighted, packed)
    expected = torch.sign(r).view(-1).to(torch.int8)
    table = sign_table()
    assert torch.equal(unpack_signs(packed.view(-1), world, table), expected)
    assert torch.equal(unpack_by_shifts(packed.view(-1)), expected)
    idx = torch.empty(world * c // 8 + 5, dtype=torch.int32)  # reused memory, longer than needed
    out = torch.empty(world * c // 8 + 5, dtype=torch.int64)
    assert torch.equal(unpack_signs(packed.view(-1), world, table, idx, out), expected)


def test_pack_gives_every_byte_and_issues_five_ops():
    """Every octet pattern packs to its byte in both planes (bit b from element 8*i + b), each
    octet's negative byte then its nonzero byte, in the five ops pack_into names: three comparisons,
    the weights, the uint8 sum (the int64-word packing it replaced issued ten)."""
    from dpq.engine.sign_bits import bit_weights, pack_into, pack_views, take

    octet = torch.arange(256).unsqueeze(1)
    bits = ((octet >> torch.arange(8)) & 1).view(1, -1).float()  # octet i: element b is bit b of i
    r = torch.cat([bits, -bits])  # row 0 positive where set, row 1 negative where set
    c = r.shape[1]
    planes, weighted = torch.empty(2 * 2 * c, dtype=torch.bool), torch.empty(2 * 2 * c, dtype=torch.uint8)
    packed = torch.empty(2, c // 4, dtype=torch.uint8)
    v = pack_views(r, take(planes, 2, c // 8, 2, 8), bit_weights(), weighted, packed)
    views, others = _ops_of(lambda: pack_into(v))
    names = [op.split(" at ")[0] for op in others]
    assert views == [] and names == ["aten::lt", "aten::gt", "aten::logical_or_", "aten::mul", "aten::sum"], others
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(packed[0].view(-1, 2), torch.stack([torch.zeros_like(every), every], 1))  # (negative, nonzero)
    assert torch.equal(packed[1].view(-1, 2), torch.stack([every, every], 1))


def test_unpack_looks_up_each_pair_in_two_ops():
    """unpack_into: the byte pairs widened to int32 indices, the table's gather; every (negative,
    nonzero) pair that can occur gives torch.sign's values (the unpack it replaced issued four ops)."""
    from dpq.engine.sign_bits import sign_table, unpack_into, unpack_views

    neg, nz = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    possible = (neg & nz) == neg  # negative implies nonzero
    pairs = torch.stack([neg[possible], nz[possible]], 1).to(torch.uint8).view(-1)
    v = unpack_views(pairs, 1, sign_table())
    views, others = _ops_of(lambda: unpack_into(v))
    assert views == [] and [op.split(" at ")[0] for op in others] == ["aten::copy_", "aten::index_select"], others
    assert torch.equal(v.signs, unpack_by_shifts(pairs))
    assert set(v.signs.tolist()) == {-1, 0, 1}


def unpack_by_shifts(packed: torch.Tensor) -> torch.Tensor:
    """The same values as :func:`dpq.engine.sign_bits.unpack_signs` computed bit position by bit position (a cross-check
    of the table): uint8 (W * c/4,) byte pairs -> int8 (W*c,)."""
    pairs = packed.view(-1, 2)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    negative = ((pairs[:, 0].unsqueeze(-1) >> shifts) & 1).view(torch.int8)
    nonzero = ((pairs[:, 1].unsqueeze(-1) >> shifts) & 1).view(torch.int8)
    return nonzero.sub_(negative).sub_(negative).view(-1)  # negative implies nonzero: -1, +1 or 0


def _ops_of(fn) -> tuple[list[str], list[str]]:
    """(view ops, other ops) that ``fn`` issues through the dispatcher from dpq's exchange and sign
    bits themselves (the communicator's own ops are its own)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    views, others = [], []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            schema = func._schema
            own = [f for f in traceback.extract_stack() if "/dpq/" in f.filename.replace("\\", "/")]
            if own and own[-1].filename.endswith(("exchange.py", "sign_bits.py")):
                is_view = bool(schema.returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                                        for r in schema.returns)
                (views if is_view else others).append(f"{schema.name} at {own[-1].lineno}")
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return views, others


@pytest.mark.parametrize("apart", [False, True])
def test_an_exchange_after_the_first_issues_no_view_op(apart):
    """Note [views made once] (dpq/engine/exchange.py): the second and later exchanges of a bucket issue
    only ops that compute or move data. The H200 run's trace: of the sign exchange's 968 host-issued
    ops per iteration (world 2, 8 buckets), 592 were slices, views and selects."""
    params = lane_params(2, [(40,), (7, 3), (64,)])
    b = GradBuckets(params, bucket_cap_elems=40)
    assert len(b.bucket_ranges) >= 2
    ex = SignExchange(comm_for(2))
    if apart:
        ex.keep_signs_apart()
    fill_grads(b, 1)
    ex.exchange(b)
    fill_grads(b, 2)
    views, others = _ops_of(lambda: ex.exchange(b))
    assert views == [], views
    assert others  # it did issue the exchange's ops
    reference = SignExchange(comm_for(2))
    if apart:
        reference.keep_signs_apart()
    fresh = GradBuckets(lane_params(2, [(40,), (7, 3), (64,)]), bucket_cap_elems=40)
    fill_grads(fresh, 2)
    reference.exchange(fresh)  # a first exchange (views made then) gives the same bits
    got = ex.signs_apart(b) if apart else None
    want = reference.signs_apart(fresh) if apart else None
    if apart:
        for g, w in zip(got, want, strict=True):
            assert all(torch.equal(g[i], w[j]) for i, j in zip(g, w, strict=True))
    else:
        for x, y in zip(b.buffers, fresh.buffers, strict=True):
            assert torch.equal(x, y)


def test_buckets_without_overlap_are_as_large_as_the_largest_tensor():
    """Note [buckets as large as the largest tensor]: an exchange that overlaps the backward keeps
    a share of the block (at least the 2^22 cap); one that does not (accelerator lanes' default) asks
    for buckets up to the largest tensor, so the engine's GradBuckets issue fewer buckets, none larger
    than that tensor."""
    from dpq.engine.exchange import OVERLAP_BUCKET_CAP, bucket_cap

    comm = comm_for(2)
    assert SignExchange(comm).plan.buckets is Buckets.SHARE  # CPU lanes: overlap on
    assert SignExchange(comm, ExchangePlan.overlapped("sign", False)).plan.buckets is Buckets.LARGEST
    sizes = [5 * 2**20, 2**20, 2**20, 3 * 2**22, 7]
    assert bucket_cap(sizes, Buckets.LARGEST) == 3 * 2**22 and bucket_cap([7], Buckets.LARGEST) == OVERLAP_BUCKET_CAP
    small = GradBuckets(lane_params(1, [(n,) for n in sizes]), bucket_cap_elems=OVERLAP_BUCKET_CAP)
    large = GradBuckets(lane_params(1, [(n,) for n in sizes]), bucket_cap_elems=Buckets.LARGEST)
    assert len(small.bucket_ranges) == 4 and len(large.bucket_ranges) == 3
    assert [e - s for s, e in large.bucket_ranges] == [7, 3 * 2**22, 7 * 2**20]  # the three smaller together


def test_overlapped_buckets_are_a_share_of_the_block():
    """Note [overlap buckets as a share of the block]: an overlapped exchange lays a large block out in
    about eight buckets (a parameter larger than the share still gets one of its own), a small one with
    buckets of the 2^22 floor; the plan prices the scratch of such a bucket."""
    from dpq.engine.exchange import OVERLAP_BUCKET_CAP, OVERLAP_BUCKETS, bucket_cap, bucket_layout

    even = [2**22] * 32  # 2^27 elements: an eighth is 2^24, four tensors per bucket
    assert bucket_cap(even, Buckets.SHARE) == 2**24 and len(bucket_layout(even, bucket_cap(even, Buckets.SHARE))) == 8
    mlp_heavy = [2**24, 2**21, 2**21, 2**24, 2**26, 2**26, 2**26]  # q, k, v, o, gate, up, down
    layout = bucket_layout(mlp_heavy, bucket_cap(mlp_heavy, Buckets.SHARE))
    assert layout == [[6], [5], [4], [3, 2, 1], [0]] and OVERLAP_BUCKETS == 8  # o, v, k together
    assert bucket_cap([7, 2**20], Buckets.SHARE) == OVERLAP_BUCKET_CAP
    with pytest.raises(ValueError, match="must be positive"):
        GradBuckets(lane_params(1, [(4,)]), bucket_cap_elems=-2)
    with pytest.raises(TypeError, match=r"a dpq\.engine\.exchange\.Buckets or a number of elements"):
        GradBuckets(lane_params(1, [(4,)]), bucket_cap_elems=None)  # no sentinel stands for a policy
    from dpq.planning.plan import (
        price_mirror,  # 64 equal weights: the share (9.4M elements) is above 2^22 and every weight
    )

    block = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False, device="meta") for _ in range(64)))
    inputs = [torch.empty(1, 8, 1024, device="meta")]
    detail_share, detail_floor = {}, {}
    price_mirror(block, inputs, 8, 2, bucket_cap_elems=Buckets.SHARE, detail=detail_share)
    price_mirror(block, inputs, 8, 2, bucket_cap_elems=OVERLAP_BUCKET_CAP, detail=detail_floor)
    assert detail_share["exchange"] - detail_floor["exchange"] == 3 * 4 * (-(-(64 * 2**20 * 9 // 8) // 8) - 2**22)


def test_one_bucket_for_the_whole_block_where_the_plan_says_so():
    """Note [one bucket where it fits] (dpq.planning.plan): an exchange after the backward whose plan found the
    memory lays the whole block out as one bucket; one that overlaps keeps its small cap whatever the
    plan said; an exchange plan that is not one is refused on construction, by name."""
    comm = comm_for(2)
    after = SignExchange(comm, ExchangePlan.overlapped("sign", False, Buckets.BLOCK))
    assert after.plan.buckets is Buckets.BLOCK and not after.overlap
    assert ExchangePlan.overlapped("sign", True, Buckets.BLOCK).buckets is Buckets.SHARE
    sizes = [5 * 2**20, 2**20, 2**20, 3 * 2**22, 7]
    one = GradBuckets(lane_params(1, [(n,) for n in sizes]), bucket_cap_elems=Buckets.BLOCK)
    assert one.bucket_ranges == [(0, sum(sizes))]
    with pytest.raises(TypeError, match=r"a dpq\.engine\.exchange\.Buckets or a number of elements.*'all'"):
        ExchangePlan("sign", buckets="all")
    with pytest.raises(TypeError, match="overlap is a bool"):
        ExchangePlan("sign", overlap=None)  # decided before it reaches the exchange
    with pytest.raises(ValueError, match="policy is one of"):
        ExchangePlan("signs")
    with pytest.raises(ValueError, match=r"full exchange's sums travel in torch\.float32"):
        ExchangePlan("full", wire_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a full exchange plan given to the sign exchange"):
        SignExchange(comm, ExchangePlan("full"))
    assert ExchangePlan("sign").wire_dtype == torch.bfloat16 and ExchangePlan("full").wire_dtype == torch.float32


@pytest.mark.parametrize("backwards", [1, 2])
def test_one_copy_per_lane_gives_the_hooks_bits(backwards):
    """Note [one copy per lane]: without hooks each lane's gradients reach their slots in one
    ``_foreach_copy_`` after the backward (and a zero for a parameter that got none), the same bits as
    the hooks' copy per parameter, with gradient accumulation over several backwards too; no hook is
    registered."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def run(hooks: bool):
        params = lane_params(2, [(5, 3), (7,), (4,)])
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in (p for lane in params for p in lane):
                p.copy_(torch.randn(p.shape, generator=gen))
        b = GradBuckets(params, bucket_cap_elems=Buckets.LARGEST)
        b.attach_by_copy(hooks=hooks)
        for step in range(backwards):
            for k, (w, v, _unused) in enumerate(params):  # the third parameter gets no gradient
                ((w * w).sum() * (k + 1.3 + step) + (v.sin() * w[0, 0]).sum()).backward()
        with Ops() as ops:
            b.finalize()
        assert b.is_attached()
        return [buf.clone() for buf in b.buffers], ops.names, len(b._copy_hooks)

    hooked, hooked_ops, hooks = run(True)
    copied, copied_ops, none = run(False)
    assert hooks == 6 and none == 0
    assert all(torch.equal(a.view(torch.int32), c.view(torch.int32)) for a, c in zip(hooked, copied, strict=True))
    assert hooked_ops == ["zero_.default"] * 2  # per lane: the slot without a gradient
    assert copied_ops == ["_foreach_copy_.default", "zero_.default"] * 2, copied_ops
    assert any(buf.abs().sum() > 0 for buf in copied)
