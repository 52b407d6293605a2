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


def tie_margin(key: str, a: float, b: float, na: int, nb: int, noise: dict | None,
               tie_tolerance: float) -> float:
    """The difference between two configs' means of objective `key` that is still a tie."""
    margin = tie_tolerance * max(abs(a), abs(b))
    measured = (noise or {}).get(key, {})
    cv = measured.get("cv")
    if cv:
        z = noise_z(measured.get("dof"))
        margin = max(margin, z * cv * math.sqrt(a * a / max(na, 1) + b * b / max(nb, 1)))
    return margin
