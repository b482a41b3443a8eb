"""Defects of the data path before it was made lane-local, re-introduced so that tests/test_timeline.py
shows that the timeline model's checks fail on each (more host syncs, or lanes waiting for each other).
They replace runtime and adapter attributes, which only tests do (tests/test_layout.py).

``apply(setattr, name)`` installs one with ``setattr(obj, attr, value)`` (pytest's ``monkeypatch.setattr``),
as tests/mutants.py does.
"""

from __future__ import annotations

from collections.abc import Callable

MUTATIONS = ("pageable-mask", "home-stream-pool", "item-in-iteration")


def _pageable_masks(setattr_: Callable) -> None:
    """The loss gets the host's masks (auto-round's ``_get_loss`` copies them with ``.to(device)``)."""
    from dpq.mirror import LaneData

    real = LaneData.once

    def once(self, lane, key, value):
        return value if key == "valid_token_mask" else real(self, lane, key, value)

    setattr_(LaneData, "once", once)


def _home_stream_pool(setattr_: Callable) -> None:
    """Each sample copied with ``.to(lane.device)`` from the lane's context: the copy queues on the
    pool device's current stream (lane 0's), as ``torch.cat(...).to(dev)`` did."""
    from dpq.streams import Lane

    real = Lane.bring

    def bring(self, t):
        return real(self, t) if self.backend.host_memory(t.device) else t.to(self.device)

    setattr_(Lane, "bring", bring)


def _item_in_iteration(setattr_: Callable) -> None:
    """Each lane's loss read on the host as soon as it is computed."""
    from dpq.autoround import tune

    real = tune.make_lane_loss

    def make(*a, **k):
        inner = real(*a, **k)

        def lane_loss(lane, module, indices):
            loss = inner(lane, module, indices)
            loss.item()
            return loss

        return lane_loss

    setattr_(tune, "make_lane_loss", make)


def apply(setattr_: Callable, mutation: str) -> None:
    installs = {"pageable-mask": _pageable_masks, "home-stream-pool": _home_stream_pool,
                "item-in-iteration": _item_in_iteration}
    if mutation not in installs:
        raise ValueError(f"unknown mutation {mutation!r}: one of {MUTATIONS}")
    installs[mutation](setattr_)
