"""The sign path's wire format: two bit planes per element (negative, nonzero), 8 elements a byte.

Sign is three-valued and exact zeros are common, so one bit per element cannot carry it
(see :class:`dpq.exchange.SignExchange`). ``pack_bits`` packs one bool plane;
``unpack_signs`` turns the gathered [negative plane | nonzero plane] chunks back into int8
signs in {-1, 0, +1}, exactly what ``torch.sign`` gives for the summed gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_bits", "unpack_signs"]


def _bit_shifts(device: torch.device) -> Tensor:
    # Built on the device each call (one tiny kernel), never cached: a tensor cached per
    # device would be shared by lanes on different streams of one device.
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_bits(bits: Tensor) -> Tensor:
    """bool (8*k,) -> uint8 (k,); element 8*i + b is bit b of byte i."""
    b = bits.view(-1, 8).view(torch.uint8)  # bools are bytes holding 0 or 1
    out = b[:, 0].clone()
    for shift in range(1, 8):  # over bit positions, not elements
        out |= b[:, shift] << shift
    return out


def unpack_signs(packed: Tensor, world: int) -> Tensor:
    """uint8 (W * 2 * c/8,) of [negative plane | nonzero plane] per chunk -> int8 signs (W*c,)."""
    planes = packed.view(world, 2, -1, 1)
    if packed.device.type == "cpu":
        # One table lookup per 8 elements: (negative byte, nonzero byte) -> the 8 signs as one int64.
        # CPU only: the table lives in host memory (no stream to order), and the shifts below run
        # ~10x slower on CPU than this. The values are identical.
        idx = (planes[:, 0].to(torch.int64) << 8) | planes[:, 1]
        return _sign_table()[idx.view(-1)].view(torch.int8)
    shifts = _bit_shifts(packed.device)
    negative = ((planes[:, 0] >> shifts) & 1).view(torch.int8)
    nonzero = ((planes[:, 1] >> shifts) & 1).view(torch.int8)
    return nonzero.sub_(negative).sub_(negative).view(-1)  # negative implies nonzero: -1, +1 or 0


def _build_sign_table() -> Tensor:
    """int64 (65536,): entry ``neg << 8 | nz`` holds the int8 signs of the 8 elements of the
    (negative, nonzero) byte pair, element b in byte b (little-endian, as ``view(torch.int8)`` reads it)."""
    byte = torch.arange(256, dtype=torch.int64)
    bits = (byte.unsqueeze(1) >> torch.arange(8)) & 1  # (256, 8)
    signs = bits.unsqueeze(1) - 2 * bits.unsqueeze(0)  # [nz, neg, b]: nz - 2*neg
    signs = signs.transpose(0, 1).reshape(65536, 8).clamp_(-1, 1)  # [neg, nz]; neg without nz cannot occur
    return signs.to(torch.int8).contiguous().view(torch.int64).view(-1)


# Built once, at import, in host memory, and only read afterwards: a constant no lane writes
# (so no stream order applies to it), shared by every CPU lane.
_SIGN_TABLE = _build_sign_table()


def _sign_table() -> Tensor:
    return _SIGN_TABLE
