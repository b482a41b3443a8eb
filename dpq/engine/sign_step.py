"""Pure SignSGD's update for every lane in one foreach op per device and learning rate.

The serial step (auto-round's ``SignSGD``, no momentum, no weight decay) runs, per tuned
tensor and per lane, ``-lr`` (an op on the lr tensor), ``torch.sign(grad)`` (an op and an
allocation) and ``param.add_(sign, alpha=-lr)``: three dispatches per tensor, 21 tensors per
Llama block, on the one issuing thread for every lane (the issue cost, ``benchmarks.issue_cost``).
:func:`foreach_sign_step` does the same update as one ``torch._foreach_add_`` per (device, lr):

* one op for every lane on a shared device without streams (CPU lanes);
* one op per lane, under the lane's ``issue()``, where lanes have streams (accelerators).

Why the result is bitwise the serial step's, on any device (the argument, since no GPU ran it):

1. What it adds are exact signs. Either an exchange left them so (``exact_signs`` on the
   policy, :class:`dpq.engine.exchange.SignExchange`: every element -1.0, +0.0 or +1.0, which
   ``torch.sign`` maps to itself bit for bit; or kept apart as int8 -1, 0, +1, ``signs``, which
   the add converts to exactly those fp32 values), or ``sign_first`` signs them in place with
   ``torch._foreach_sign_`` (world 1: no exchange): on CPU that runs ``sign_`` per tensor, the
   serial op's kernel; on CUDA its functor is ``c10::signum``, the function ``torch.sign``'s
   CUDA kernel applies (ATen ``ForeachUnaryOp.cu`` / ``UnarySignKernels.cu``).
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

from dpq.engine.sign_bits import lanes_share_buffers
from dpq.streams import Lane

__all__ = ["foreach_sign_step", "sign_step_unusable", "step_choice"]

_PURE = {"momentum": 0, "weight_decay": 0, "nesterov": False, "maximize": False, "differentiable": False}


def sign_step_unusable(optimizers: Sequence[torch.optim.Optimizer],
                       bucket_params: Sequence[Sequence[torch.nn.Parameter]] | None) -> str | None:
    """None when every param group of every optimizer is a pure sign step over parameters that
    have gradient slots (``bucket_params``: each lane's; None: no buckets, nothing exchanged) and
    no step hook would be skipped; else why not (a note)."""
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
    if bucket_params is None:
        return None
    slots = {id(p) for ps in bucket_params for p in ps}
    for k, opt in enumerate(optimizers):
        if any(id(p) not in slots for group in opt.param_groups for p in group["params"]):
            return f"lane {k}'s optimizer holds a parameter without a gradient slot"
    return None


def step_choice(asked: bool, optimizers: Sequence[torch.optim.Optimizer],
                bucket_params: Sequence[Sequence[torch.nn.Parameter]] | None) -> tuple[bool, str]:
    """(whether the one-op step runs, a note saying which step runs and why)."""
    why_not = sign_step_unusable(optimizers, bucket_params) if asked else None
    if asked and why_not is None:
        return True, "one foreach op per device and lr (dpq.engine.sign_step)"
    return False, "each lane's optimizer.step()" + (f" (one-op sign step not used: {why_not})" if why_not else "")


def foreach_sign_step(optimizers: Sequence[torch.optim.Optimizer], lanes: Sequence[Lane], *,
                      sign_first: bool = False, signs: Sequence[dict[int, torch.Tensor]] | None = None) -> None:
    """``p += -lr * grad`` for every tuned tensor of every lane whose grad is set. Call instead of
    each lane's ``optimizer.step()``. The grads must hold exact signs (module docstring), or
    ``sign_first``: they are signed in place first (``torch._foreach_sign_``); ``signs``: per lane,
    each parameter's (by ``id``) int8 signs to add instead of its grad (an exchange kept them apart)."""
    if lanes_share_buffers(list(lanes)):  # no streams, one device: one op per lr over all lanes
        _apply(_by_alpha(optimizers, signs), sign_first)
    else:
        for k, (lane, opt) in enumerate(zip(lanes, optimizers, strict=True)):
            with lane.issue():
                _apply(_by_alpha([opt], None if signs is None else [signs[k]]), sign_first)
    for opt in optimizers:
        # what the step wrapper of an lr scheduler records: the step ran (else its first
        # scheduler step warns that it came before the optimizer's)
        opt._opt_called = True


def _by_alpha(optimizers: Sequence[torch.optim.Optimizer],
              signs: Sequence[dict[int, torch.Tensor]] | None) -> dict[float, tuple[list, list]]:
    out: dict[float, tuple[list, list]] = {}
    for k, opt in enumerate(optimizers):
        for group in opt.param_groups:
            lr = group["lr"]
            alpha = -float(lr)  # exact: the value serial's ``alpha=-lr`` passes (docstring, 2.)
            params, grads = out.setdefault(alpha, ([], []))
            for p in group["params"]:
                if p.grad is not None:
                    params.append(p)
                    grads.append(p.grad if signs is None else signs[k][id(p)])
    return out


@torch.no_grad()
def _apply(groups: dict[float, tuple[list, list]], sign_first: bool) -> None:
    for alpha, (params, grads) in groups.items():
        if params:
            if sign_first:
                torch._foreach_sign_(grads)
            torch._foreach_add_(params, grads, alpha=alpha)
