"""Block shapes, and how a recorded tensor's size becomes the target block's (the role map).

The model records one small block and replays it as a large one. Every tensor an op touches is
sized by what it *is*: an activation (``lead`` samples x the sequence x a feature dimension: the
hidden size, the MLP's intermediate size, the key/value width, a head's width, the head count, ...)
or a weight-shaped tensor (one linear layer's ``[out, in]``, its ``[out, in / group_size]`` scales,
a norm's ``[hidden]`` ...). The recording's dimensions are chosen so that every role has its own
size (:data:`RECORDED`; :func:`RoleMap.collisions` proves it, ``tests/test_timeline_shapes.py``
checks it), and its sequence length is a prime no other size is a multiple of, so a tensor's
role is read off its element count: an activation's count is ``lead x seqlen^k x d`` (``lead``
from its shape, ``d`` one of the feature roles), a weight-shaped tensor's is one of the block's
weight-shaped counts. The target size is then the same role in the target block: bytes scale
tensor by tensor, a matmul's FLOPs by the tokens and the weight it multiplies, attention's by the
tokens squared and the width. A tensor of no role (a flat gradient bucket, a packed sign plane)
is *unmapped*; the replay prices it by the whole block's ratio and counts it
(:attr:`RoleMap.unmapped`), and the exchange's own tensors are re-laid out per target bucket by
:mod:`dpqlab.timeline.buckets` instead.

Invariants: the recording and the target use the same samples per iteration (auto-round's batch
8) and the same group size, so ``lead`` and the per-group work carry over unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

__all__ = ["BLOCKS", "RECORDED", "BlockShape", "RoleMap", "TensorMeta"]

# (element count, bytes, lead): lead = the samples an activation spans (from its shape), 0 = not an activation,
# -1 = a constant of fixed size whatever the block (a lookup table)
TensorMeta = tuple[int, int, int]


@dataclass(frozen=True)
class BlockShape:
    """A Llama-type decoder block (attention + gated MLP) and its tuning batch."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    seqlen: int = 2048
    batch: int = 8  # samples per iteration (auto-round's default batch_size)
    group_size: int = 128
    layers: int = 1  # blocks in the whole model: the compile is paid once per run, amortised over them
    dtype_bytes: int = 2  # the model's weights and activations: bf16

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def linears(self) -> dict[str, tuple[int, int]]:
        """Each tuned linear layer's weight shape ``(out, in)``."""
        h, i, kv, q = self.hidden, self.intermediate, self.kv_dim, self.q_dim
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    @property
    def linear_params(self) -> int:
        return sum(o * i for o, i in self.linears.values())

    def tuned_numels(self) -> list[int]:
        """Every tuned tensor auto-round's wrapper makes, in the wrapper's order per layer (``value``
        like the weight, ``min_scale`` and ``max_scale`` one per group): what dpq's buckets hold."""
        out = []
        for o, i in self.linears.values():
            out += [o * i, o * (i // self.group_size), o * (i // self.group_size)]
        return out

    @property
    def tokens(self) -> int:
        return self.seqlen * self.batch

    def matmul_flops(self) -> float:
        """Forward + backward of the block's linear layers at one iteration's batch: the forward
        (2 x tokens x params), the weight's gradient (the tuned values live in it) for every layer,
        the input's gradient for every layer but the three that read the block's input (nothing
        upstream of q/k/v needs a gradient)."""
        qkv = sum(o * i for name, (o, i) in self.linears.items() if name in ("q_proj", "k_proj", "v_proj"))
        return 2.0 * self.tokens * (2 * self.linear_params + (self.linear_params - qkv))

    def attention_flops(self) -> float:
        """Scaled-dot-product attention, forward (QK^T and PV: 4 x S^2 x width per sample) and
        backward (2.5x the forward: torch's flop formulas). Every score tile is computed: auto-round
        caches each sample's causal mask and passes it as ``attention_mask``, so transformers calls
        SDPA with an explicit mask and ``is_causal=False`` (no kernel skips the masked half)."""
        forward = 4.0 * self.batch * self.seqlen**2 * self.q_dim
        return forward * 3.5

    def weight_elems(self) -> int:
        """Elements of the weight-shaped tensors one lane quantizes per iteration (the weights)."""
        return self.linear_params


# The recorded block (scenarios.record_block): a tiny Llama whose every role has its own size (see
# RoleMap.collisions): head width 32, 12 heads, 3 key/value heads, hidden 384 (3 groups of 128),
# intermediate 896 (7 groups); 61 tokens per sample (prime).
RECORDED = BlockShape("the recorded tiny Llama block", hidden=384, intermediate=896, heads=12, kv_heads=3,
                      head_dim=32, seqlen=61, batch=8)

BLOCKS = {
    "8b": BlockShape("8B-class (Llama-3-8B block)", hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                     head_dim=128, layers=32),
    "32b": BlockShape("32B-class (Qwen2.5-32B block)", hidden=5120, intermediate=27648, heads=40, kv_heads=8,
                      head_dim=128, layers=64),
    "70b": BlockShape("70B-class (Llama-3-70B block)", hidden=8192, intermediate=28672, heads=64, kv_heads=8,
                      head_dim=128, layers=80),
}


@dataclass
class RoleMap:
    """Recorded tensor sizes -> the target block's (module docstring)."""

    recorded: BlockShape
    target: BlockShape
    unmapped: dict[int, int] = field(default_factory=dict)  # element count -> bytes met (for the report)

    def _feature_roles(self, b: BlockShape) -> list[int]:
        """An activation's feature width per role, in one fixed order (so recorded[k] <-> target[k])."""
        return [b.hidden, b.intermediate, b.kv_dim, b.q_dim, b.head_dim, b.hidden // 2, b.kv_dim // 2,
                b.head_dim // 2, b.heads, b.kv_heads, b.intermediate // 2, 1]

    def _weight_roles(self, b: BlockShape) -> list[int]:
        """A weight-shaped tensor's element count per role, same order for both blocks."""
        out = []
        for o, i in b.linears.values():
            out += [o * i, o * (i // b.group_size), o, i]
        out += [b.hidden, b.head_dim // 2, sum(b.tuned_numels())]
        return out

    @cached_property
    def features(self) -> dict[int, int]:
        return dict(zip(self._feature_roles(self.recorded), self._feature_roles(self.target), strict=True))

    @cached_property
    def weights(self) -> dict[int, int]:
        return dict(zip(self._weight_roles(self.recorded), self._weight_roles(self.target), strict=True))

    def collisions(self) -> list[str]:
        """Roles of the recorded block that share a size but not a target size (each would be
        priced as the wrong thing), and recorded sizes a multiple of the sequence length."""
        out = []
        for label, roles in (("feature", (self._feature_roles(self.recorded), self._feature_roles(self.target))),
                             ("weight", (self._weight_roles(self.recorded), self._weight_roles(self.target)))):
            seen: dict[int, int] = {}
            for r, t in zip(*roles, strict=True):
                if r in seen and seen[r] != t:
                    out.append(f"{label} size {r} stands for both {seen[r]} and {t} in {self.target.name}")
                seen.setdefault(r, t)
                if r % self.recorded.seqlen == 0:
                    out.append(f"{label} size {r} is a multiple of the recorded sequence length")
        return out

    # -- one tensor -----------------------------------------------------------------------------

    def _act_target(self, numel: int, lead: int) -> int | None:
        s = self.recorded.seqlen
        if lead <= 0 or numel % lead:
            return None
        rest, k = numel // lead, 0
        while rest % s == 0:
            rest, k = rest // s, k + 1
        d = self.features.get(rest)
        if k == 0 or d is None:
            return None
        return lead * self.target.seqlen**k * d

    def target_numel(self, numel: int, lead: int) -> int | None:
        """The target's element count for a recorded tensor, or None when it has no role."""
        if numel <= 1:
            return numel
        if lead:
            return self._act_target(numel, lead)
        return self.weights.get(numel)

    def ratio(self, meta: TensorMeta) -> float | None:
        numel, _, lead = meta
        if lead < 0:  # a constant (a lookup table): the same size for every block
            return 1.0
        t = self.target_numel(numel, lead)
        return None if t is None else t / numel

    def fallback_ratio(self) -> float:
        """For a tensor of no role: the whole block's weight ratio."""
        return self.target.linear_params / self.recorded.linear_params

    def scaled_bytes(self, metas: Iterable[TensorMeta]) -> float:
        total = 0.0
        for meta in metas:
            r = self.ratio(meta)
            if r is None:
                self.unmapped[meta[0]] = self.unmapped.get(meta[0], 0) + meta[1]
                r = self.fallback_ratio()
            total += meta[1] * r
        return total

    def matmul_scale(self, metas: Iterable[TensorMeta]) -> float:
        """A linear layer's matmul (forward, input gradient or weight gradient): FLOPs scale with the
        tokens and the weight it multiplies or produces (the one weight-shaped operand)."""
        tokens = self.target.seqlen / self.recorded.seqlen
        weights = [self.ratio(m) for m in metas if not m[2] and m[0] > 1]
        weights = [w for w in weights if w is not None]
        return tokens * (max(weights) if weights else self.fallback_ratio())

    def attention_scale(self) -> float:
        """Attention's FLOPs: tokens squared (per sample) x the width of all heads."""
        return (self.target.seqlen / self.recorded.seqlen) ** 2 * (self.target.q_dim / self.recorded.q_dim)
