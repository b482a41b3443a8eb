"""Floating-point error bounds for the tests, derived from the computation (not measured).

Standard model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 2-4): a correctly
rounded op is off by at most ``u * |result|``, ``u`` the unit roundoff (2**-24 for fp32, 2**-8
for bf16). A sum of n terms evaluated in *any* order (any summation tree: serial, pairwise, lane
partials then an exchange) is within ``(n - 1) * u * sum|terms|`` of the exact sum, to first
order; two evaluations of one sum in different orders differ by at most twice that. Second-order
terms are below ``n**2 u**2`` relative, ~1e-6 of the first-order ones at the sizes used here; the
``SECOND_ORDER`` factor covers them with room to spare.
"""

from __future__ import annotations

import torch

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SECOND_ORDER = 1.01


def reassociation_bound(n_terms: int, abs_sum: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Max difference between two evaluation orders of a sum of ``n_terms`` terms whose absolute
    values sum to ``abs_sum`` (pass it in float64)."""
    return 2 * max(n_terms - 1, 0) * U[dtype] * abs_sum * SECOND_ORDER


def assert_reassociated_nonneg_sum(actual: torch.Tensor, expected: torch.Tensor, n_terms: int) -> None:
    """``actual`` and ``expected`` are one sum of ``n_terms`` non-negative fp32 terms (e.g. sums of
    squares), evaluated in two orders. Non-negative terms: sum|terms| is the sum itself, known
    to within its own rounding, so the bound needs nothing but ``expected``."""
    assert bool((expected >= 0).all()) and bool((actual >= 0).all()), "bound derived for non-negative terms"
    exp64 = expected.double()
    abs_sum = exp64 / (1 - max(n_terms - 1, 0) * U[expected.dtype])  # the exact sum is at most this
    err = (actual.double() - exp64).abs()
    bound = reassociation_bound(n_terms, abs_sum, expected.dtype)
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3e} over bound {float((err - bound).max()):.3e}"
