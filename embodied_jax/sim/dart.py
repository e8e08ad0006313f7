"""DART noise calibration (Laskey et al. 2017), one rule for every simulator: the largest noise level
at which the noisy scripted expert still succeeds often enough.

``calibrate(success_rate, levels, target)`` tries ``levels`` in ascending order, measuring
``success_rate(level)`` (the fraction of calibration episodes the expert completes with that
noise on its actions), and stops at the first level below ``target``. The simulators supply the
measurement (``sim.collect``: batched MJX rollouts, noise in metres on the hand targets;
``sim.metaworld.collect``: Meta-World's environments, noise on its [-1, 1] actions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

DART_TARGET = 0.9  # the noisy expert's least success rate at the calibrated noise


def calibrate(
    success_rate: Callable[[float], float], levels: Sequence[float], target: float = DART_TARGET
) -> tuple[float, dict[float, float]]:
    """``(chosen, measured)``: the largest of ``levels`` (ascending; stops at the first miss) whose
    ``success_rate`` is at least ``target``, 0.0 if none; and the rate measured at each level tried."""
    chosen, measured = 0.0, {}
    for level in sorted(levels):
        measured[level] = float(success_rate(level))
        if measured[level] < target:
            break
        chosen = level
    return chosen, measured
