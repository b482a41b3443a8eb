"""The sign path's wire format and its buffers: two bit planes per element (negative, nonzero), 8 elements a byte.

Sign is three-valued and exact zeros are common, so one bit per element cannot carry it
(see :class:`dpq.engine.exchange.SignExchange`). :func:`pack_signs` turns rows of summed fp32
gradients into byte pairs, per octet of elements its negative byte then its nonzero byte;
:func:`unpack_signs` reads each pair as one little-endian uint16 and turns the gathered chunks
back into int8 signs in {-1, 0, +1}, exactly what ``torch.sign`` gives for the summed gradient.
:class:`SignBuffers` holds every buffer one group of lanes needs for it,
allocated once and reused for every bucket and iteration (the exchange's host work per
bucket is then a fixed, small number of ops, none of them an allocation).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from dpq.engine import phases
from dpq.streams import Lane

__all__ = [
    "SIGN_TABLE_BYTES",
    "PackViews",
    "SignBuffers",
    "UnpackViews",
    "bit_weights",
    "lanes_share_buffers",
    "pack_into",
    "pack_signs",
    "pack_views",
    "sign_groups",
    "sign_padded_length",
    "sign_table",
    "take",
    "unpack_into",
    "unpack_signs",
    "unpack_views",
]

# unpack_signs reads a table entry's 8 signs as one int64 word, sign b in byte b: that is the
# little-endian order. Every device torch runs on is little-endian; a big-endian host would need
# another table.
if sys.byteorder != "little":  # pragma: no cover - no such machine in CI
    raise ImportError("dpq: the sign exchange's bit unpacking assumes a little-endian host")


def sign_padded_length(n: int, world: int) -> int:
    """The sign path's bucket length: ``n`` rounded up to a multiple of 8*W (whole bytes per lane chunk)."""
    step = 8 * world
    return -(-n // step) * step


def take(buf: Tensor, *shape: int) -> Tensor:
    """The first ``prod(shape)`` elements of the flat buffer ``buf``, viewed as ``shape`` (contiguous)."""
    numel = 1
    for s in shape:
        numel *= s
    return buf[:numel].view(shape)


@dataclass(frozen=True)
class PackViews:
    """:func:`pack_signs`' operands as the views its ops write and read, made once (:func:`pack_views`):
    a bucket reuses them every iteration, so :func:`pack_into` issues only the five ops that compute,
    no view op (on an accelerator every op is host time on the one issuing thread)."""

    r: Tensor  # (L, c/8, 8) fp32 sums, an octet a row
    negative: Tensor  # planes[:, :, 0]
    nonzero: Tensor  # planes[:, :, 1]
    octets: Tensor  # the planes' bytes, 8 a row: (L*2c/8, 8) uint8, each octet's negative then nonzero
    weights: Tensor  # (8,) uint8: 1, 2, 4, ... 128 (bit_weights)
    weighted: Tensor  # (L*2c/8, 8) uint8 scratch: each byte times its bit's weight
    out: Tensor  # (L*2c/8,) uint8, flat


def bit_weights(device: torch.device | str = "cpu") -> Tensor:
    """uint8 (8,): byte b of an octet of 0/1 bytes weighs 2**b (made on ``device``, no copy)."""
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=device),
                                    torch.arange(8, dtype=torch.uint8, device=device))


def pack_views(r: Tensor, planes: Tensor, weights: Tensor, weighted: Tensor, out: Tensor) -> PackViews:
    """The views :func:`pack_into` works on (:func:`pack_signs` says what each operand is)."""
    octets = planes.view(-1).view(torch.uint8).view(-1, 8)
    return PackViews(r.view(r.shape[0], -1, 8), planes[:, :, 0], planes[:, :, 1], octets, weights,
                     weighted.view(-1, 8), out.view(-1))


def pack_into(v: PackViews) -> None:
    """:func:`pack_signs` on views made once: five ops, whatever the rows."""
    torch.lt(v.r, 0, out=v.negative)
    torch.gt(v.r, 0, out=v.nonzero)
    v.nonzero.logical_or_(v.negative)  # nonzero = negative or positive: NaN is neither
    torch.mul(v.octets, v.weights, out=v.weighted)  # bools are bytes holding 0 or 1: bit b's value or 0
    torch.sum(v.weighted, 1, dtype=torch.uint8, out=v.out)  # distinct bits: the sum is their OR, at most 255


def pack_signs(r: Tensor, planes: Tensor, weighted: Tensor, out: Tensor, weights: Tensor | None = None) -> None:
    """Rows of fp32 sums ``r`` (L, c), c a multiple of 8 -> ``out`` (L, c/4) uint8: per row and octet
    i of elements, byte 2i its negative bits and byte 2i+1 its nonzero bits, element 8*i + b in bit b.

    (negative, nonzero): 0 and NaN -> (0, 0), +x -> (0, 1), -x -> (1, 1), as ``torch.sign``.
    Scratch: ``planes`` bool (L, c/8, 2, 8), ``weighted`` uint8 (L*2c,). Five ops whatever L is: the two
    planes (three comparisons), then each octet of 0/1 bytes times (1, 2, ..., 128) and summed in
    uint8 (``weights``: :func:`bit_weights` on the device, made here when not given). Integer
    arithmetic on distinct bits: the bytes are exact, on every device and CPU capability.
    """
    w = bit_weights(r.device) if weights is None else weights
    pack_into(pack_views(r, planes, w, weighted, out))


@dataclass(frozen=True)
class UnpackViews:
    """:func:`unpack_signs`' operands as views made once (:func:`unpack_views`): :func:`unpack_into`
    then issues its two ops and no view op."""

    pairs: Tensor  # the gathered byte pairs as uint16 (W*c/8,): nonzero << 8 | negative
    idx: Tensor  # int32 (W*c/8,): the table's index
    table: Tensor
    out: Tensor  # int64 (W*c/8,)
    signs: Tensor  # ``out`` as int8 (W*c,): the result


def unpack_views(packed: Tensor, world: int, table: Tensor, idx: Tensor | None = None,
                 out: Tensor | None = None) -> UnpackViews:
    """The views :func:`unpack_into` works on; ``idx`` (int32) and ``out`` (int64), at least W*c/8
    each, are allocated here when not given (``world``: the chunks gathered, for the caller's
    reading; the pairs need no shape)."""
    pairs = packed.view(-1).view(torch.uint16)
    n = pairs.numel()
    idx = torch.empty(n, dtype=torch.int32, device=packed.device) if idx is None else idx[:n]
    out = torch.empty(n, dtype=torch.int64, device=packed.device) if out is None else out[:n]
    return UnpackViews(pairs, idx, table, out, out.view(torch.int8))


def unpack_into(v: UnpackViews) -> Tensor:
    """:func:`unpack_signs` on views made once: the index (each pair widened), the gather."""
    v.idx.copy_(v.pairs)  # uint16 -> int32: index_select takes int32 or int64 indices
    torch.index_select(v.table, 0, v.idx, out=v.out)
    return v.signs


def unpack_signs(packed: Tensor, world: int, table: Tensor, idx: Tensor | None = None,
                 out: Tensor | None = None) -> Tensor:
    """uint8 (W * c/4,) of byte pairs (negative, nonzero) per octet -> int8 signs (W*c,).

    One table lookup per 8 elements: the pair read as one little-endian uint16 (``nonzero << 8 |
    negative``) -> the 8 signs as one int64 (``table``: :func:`sign_table` on the device of
    ``packed``). Two ops whatever the bucket (the index widened to int32, the gather), reading 2
    bytes and writing 8 per 8 elements, where a shift per bit position reads and writes every
    element several times. ``idx`` (int32) and ``out`` (int64), W*c/8 each, may be given to reuse
    their memory."""
    return unpack_into(unpack_views(packed, world, table, idx, out))


SIGN_TABLE_BYTES = 65536 * 8  # :func:`sign_table`'s memory on each lane's device (what the plan prices)


def sign_table(device: torch.device | str = "cpu") -> Tensor:
    """int64 (65536,) on ``device``, made there by a few ops (no host-to-device copy, no larger
    temporary): entry ``nz << 8 | neg`` (a byte pair read as a little-endian uint16) holds the int8
    signs of the 8 elements of the (negative, nonzero) pair, element b in byte b (little-endian, as
    ``view(torch.int8)`` reads it)."""
    byte = torch.arange(256, dtype=torch.int16, device=device)
    bits = ((byte.unsqueeze(1) >> torch.arange(8, dtype=torch.int16, device=device)) & 1).to(torch.int8)
    table = bits.unsqueeze(1) - 2 * bits.unsqueeze(0)  # [nz, neg, b]: nz - 2*neg
    table.clamp_(-1, 1)  # neg without nz cannot occur
    table = table.view(65536, 8).view(torch.int64).view(-1)
    phases.notify.constant_made(table)
    return table


class SignBuffers:
    """Every buffer of the sign path for one group of ``rows`` lanes, sized for the largest
    bucket (padded length ``m_max``; ``pad_max``: the largest padded length of a bucket that
    needs padding, 0 if none does) of a ``world``-rank exchange.

    A bucket of padded length m uses the leading part of each buffer (:func:`take`). A group
    is either one lane (its own buffers, allocated under its ``issue()``: they belong to its
    stream, where every use is queued; reuse from bucket to bucket and iteration to iteration
    is ordered by that stream and by the collectives' joins) or every lane when no lane has a
    stream (CPU: one op then covers all lanes' rows, a view instead of a per-lane loop).
    """

    def __init__(self, lane: Lane, rows: int, world: int, m_max: int, pad_max: int,
                 wire: torch.dtype = torch.float32) -> None:
        c = m_max // world
        dev = lane.device
        with lane.issue():
            # the reduce-scatter's send and receive buffers, in the dtype the sums travel in (``wire``)
            self.pad = torch.empty(rows * pad_max, dtype=wire, device=dev)
            self.recv = torch.empty(rows * c, dtype=wire, device=dev)
            self.planes = torch.empty(rows * 2 * c, dtype=torch.bool, device=dev)
            self.weighted = torch.empty(rows * 2 * c, dtype=torch.uint8, device=dev)
            self.weights = bit_weights(dev)  # a constant, like the table below
            self.packed = torch.empty(rows * c // 4, dtype=torch.uint8, device=dev)
            self.gathered = torch.empty(rows * m_max // 4, dtype=torch.uint8, device=dev)
            # the unpack's table (a constant: written here on the lane's stream, only read after), its
            # index and its result
            self.table = sign_table(dev)
            self.idx = torch.empty(m_max // 8, dtype=torch.int32, device=dev)
            self.signs = torch.empty(m_max // 8, dtype=torch.int64, device=dev)


def lanes_share_buffers(lanes: list[Lane]) -> bool:
    """True when no lane has a stream and all are on one device: one op may then cover every lane."""
    return all(lane.stream is None for lane in lanes) and len({lane.device for lane in lanes}) == 1


def sign_groups(lanes: list[Lane], world: int, lengths: list[int],
                wire: torch.dtype = torch.float32) -> list[tuple[list[int], SignBuffers, Lane]]:
    """(lane indices, their :class:`SignBuffers`, the lane to issue under) per group, for buckets
    of ``lengths`` elements exchanged over ``world`` ranks, their sums in ``wire`` (other than fp32:
    every bucket is copied into the send buffer, cast).

    Lanes without streams on one device (CPU lanes) form one group: their ops then run once
    over all lanes' rows, on the one issuing thread, with nothing to order. Otherwise (streams:
    accelerators, or the CPU stream-order checker's logical streams) each lane is a group.
    """
    padded = [(sign_padded_length(n, world), n) for n in lengths]
    m_max = max(m for m, _ in padded)
    pad_max = m_max if wire != torch.float32 else max((m for m, n in padded if m != n), default=0)
    parts = [list(range(len(lanes)))] if lanes_share_buffers(lanes) else [[k] for k in range(len(lanes))]
    return [(ks, SignBuffers(lanes[ks[0]], len(ks), world, m_max, pad_max, wire), lanes[ks[0]]) for ks in parts]
