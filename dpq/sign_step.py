"""Pure SignSGD's update for every lane in one foreach op per device and learning rate.

The serial step (auto-round's ``SignSGD``, no momentum, no weight decay) runs, per tuned
tensor and per lane, ``-lr`` (an op on the lr tensor), ``torch.sign(grad)`` (an op and an
allocation) and ``param.add_(sign, alpha=-lr)``: three dispatches per tensor, 21 tensors per
Llama block, on the one issuing thread for every lane (the issue cost, ``benchmarks.issue_cost``).
:func:`foreach_sign_step` does the same update as one ``torch._foreach_add_`` per (device, lr):

* one op for every lane on a shared device without streams (CPU lanes);
* one op per lane, under the lane's ``issue()``, where lanes have streams (accelerators).

Why the result is bitwise the serial step's, on any device (the argument, since no GPU ran it):

1. It runs only after an exchange whose output is exact signs (``exact_signs`` on the policy,
   :class:`dpq.exchange.SignExchange`): every gradient element is -1.0, +0.0 or +1.0. ``torch.sign``
   maps each of those to itself (bit for bit: ``sign(+0.0)`` is +0.0), so ``sign(grad)`` is
   ``grad`` and the step may read ``grad`` directly.
2. ``alpha`` is ``-lr`` read from the same param group at the same moment; ``-x`` and the
   fp32 -> double -> fp32 trip of a Scalar are exact, so both paths use the same fp32 alpha.
3. Per element both compute ``p + alpha * g`` in fp32: ``alpha * g`` is exact (g is -1, 0 or 1),
   so there is one rounding, of the same exact sum, whether the kernel fuses a multiply-add or
   not (CPU: ``_foreach_add_`` runs ``add_`` per tensor; CUDA: one multi-tensor kernel).

Eligible optimizers are checked once (:func:`sign_step_unusable`): every param group pure (no
momentum, weight decay, nesterov, maximize, differentiable). Which optimizer *class* is pure
SignSGD, and that its upstream source is the one this reproduces, is the adapter's to say
(``dpq.autoround.tune``); the runtime knows nothing of auto-round.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpq.sign_bits import lanes_share_buffers
from dpq.streams import Lane

__all__ = ["foreach_sign_step", "sign_step_unusable"]

_PURE = {"momentum": 0, "weight_decay": 0, "nesterov": False, "maximize": False, "differentiable": False}


def sign_step_unusable(optimizers: Sequence[torch.optim.Optimizer],
                       bucket_params: Sequence[Sequence[torch.nn.Parameter]]) -> str | None:
    """None when every param group of every optimizer is a pure sign step over parameters that
    have gradient slots (``bucket_params``: each lane's) and no step hook would be skipped; else
    why not (a note)."""
    from torch.optim import optimizer as optim_module

    if optim_module._global_optimizer_pre_hooks or optim_module._global_optimizer_post_hooks:
        return "global optimizer step hooks are registered"
    for k, opt in enumerate(optimizers):
        if getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None):
            return f"lane {k}'s optimizer has step hooks"
        for g, group in enumerate(opt.param_groups):
            for key, pure in _PURE.items():
                if group.get(key, pure) != pure:
                    return f"lane {k}'s param group {g} has {key}={group[key]!r}"
    slots = {id(p) for ps in bucket_params for p in ps}
    for k, opt in enumerate(optimizers):
        if any(id(p) not in slots for group in opt.param_groups for p in group["params"]):
            return f"lane {k}'s optimizer holds a parameter without a gradient slot"
    return None


def foreach_sign_step(optimizers: Sequence[torch.optim.Optimizer], lanes: Sequence[Lane]) -> None:
    """``p += -lr * grad`` for every tuned tensor of every lane whose grad is set (grads hold exact
    signs: module docstring). Call instead of each lane's ``optimizer.step()``."""
    if lanes_share_buffers(list(lanes)):  # no streams, one device: one op per lr over all lanes
        _apply(_by_alpha(optimizers))
    else:
        for lane, opt in zip(lanes, optimizers, strict=True):
            with lane.issue():
                _apply(_by_alpha([opt]))
    for opt in optimizers:
        # what the step wrapper of an lr scheduler records: the step ran (else its first
        # scheduler step warns that it came before the optimizer's)
        opt._opt_called = True


def _by_alpha(optimizers: Sequence[torch.optim.Optimizer]) -> dict[float, tuple[list, list]]:
    out: dict[float, tuple[list, list]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            lr = group["lr"]
            alpha = -float(lr)  # exact: the value serial's ``alpha=-lr`` passes (docstring, 2.)
            params, grads = out.setdefault(alpha, ([], []))
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    grads.append(p.grad)
    return out


@torch.no_grad()
def _apply(groups: dict[float, tuple[list, list]]) -> None:
    for alpha, (params, grads) in groups.items():
        if params:
            torch._foreach_add_(params, grads, alpha=alpha)
