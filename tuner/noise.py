"""Launch-to-launch noise: its estimate from replicate launches, and the margin within which two
configs' figures are a tie (pure, standard library only)."""

from __future__ import annotations

import math

# A difference counts only beyond noise_z(dof) standard errors of the difference of two means,
# each from the launch-to-launch noise measured on replicate launches: Student's t two-sided 95 %
# quantile for the degrees of freedom the noise was estimated from. A noise read off two replicate
# pairs is itself uncertain, so ties stay wide until replicates (`--confirm`) pin it down.
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 30: 2.04, 60: 2.00}
NOISE_Z = 1.96   # the limit of many degrees of freedom


def noise_z(dof: int | None) -> float:
    """Student's t 97.5 % quantile at `dof` degrees of freedom (the table's next lower entry)."""
    if not dof or dof < 1:
        return _T975[1]
    below = [d for d in _T975 if d <= dof]
    return _T975[max(below)] if dof <= 60 else NOISE_Z


def noise_estimate(groups: dict[str, list[list[float]]]) -> dict:
    """Launch-to-launch noise per objective: the pooled coefficient of variation over every config
    measured more than once, with its degrees of freedom. {} when nothing was launched twice."""
    out = {}
    for k, sets in groups.items():
        num = dof = 0.0
        for values in sets:
            m = sum(values) / len(values)
            if m == 0:
                continue
            num += sum((v - m) ** 2 for v in values) / m ** 2
            dof += len(values) - 1
        if dof:
            out[k] = {"cv": math.sqrt(num / dof), "dof": int(dof), "configs": len(sets)}
    return out


def log_margin(key: str, na: int, nb: int, noise: dict | None) -> float:
    """The largest |ln(a / b)| between two configs' means of `key` (of na and nb launches) that
    the measured noise cannot tell apart: noise_z standard errors of the difference of two log
    means, a launch's log having a standard deviation of about its CV. 0 without a noise figure."""
    measured = (noise or {}).get(key, {})
    cv = measured.get("cv")
    if not cv:
        return 0.0
    return noise_z(measured.get("dof")) * cv * math.sqrt(1 / max(na, 1) + 1 / max(nb, 1))


def tie_margin(key: str, a: float, b: float, na: int, nb: int, noise: dict | None,
               tie_tolerance: float) -> float:
    """The difference between two configs' means of objective `key` that is still a tie.

    The noise is multiplicative (a CV), so the test is on the ratio: |ln(a / b)| within
    `log_margin`, written as a difference: |a - b| <= sqrt(ab) * 2 sinh(L / 2). For close values
    that is z * cv * a * sqrt(1/na + 1/nb), as on a linear scale; for far ones it does not grow
    with the larger value, so a wide noise still tells 107 ms from 2,141 ms."""
    margin = tie_tolerance * max(abs(a), abs(b))
    L = log_margin(key, na, nb, noise)
    if L and a > 0 and b > 0:
        margin = max(margin, math.sqrt(a * b) * 2 * math.sinh(L / 2))
    elif L:   # a zero or negative figure has no ratio: the linear form
        margin = max(margin, L * max(abs(a), abs(b)))
    return margin
