"""The Optuna sampler a study asks: GP, TPE, random or grid, seeded per worker."""

from __future__ import annotations

import numpy as np
import optuna

from tuner.config import StudyConfig
from tuner.errors import TunerError


def gp_available() -> bool:
    try:
        import scipy  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def make_sampler(cfg: StudyConfig, name: str | None = None, worker: int = 0,
                 trials_before: int = 0) -> optuna.samplers.BaseSampler:
    """The study's sampler; worker k of a shared study draws with seed + k, so workers do not
    propose the same configs in the same order. A study resumed with `trials_before` trials draws
    from a seed of its own (still fixed by the study's seed and its history): with the first
    run's seed, a seeded sampler would propose the first run's configs again, each one a duplicate,
    until the run stopped on proposals that were all measured already."""
    name = name or cfg.sampler
    if name == "auto":
        name = "gp" if gp_available() else "tpe"
    seed = cfg.seed + worker if cfg.seed is not None else None
    if seed is not None and trials_before:
        seed = int(np.random.SeedSequence([cfg.seed, worker, trials_before]).generate_state(1)[0])
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=5)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        grid = {d.name: d.grid() for d in cfg.dimensions}
        # the seed shuffles the grid, and workers share its ids: one order for all, own picks
        return _AskTellGridSampler(grid, seed=cfg.seed, pick_seed=seed)
    raise TunerError(f"unknown sampler {name!r}")


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler stops the study when the grid is done, which only works inside optimize();
    with ask/tell an exhausted grid shows up as repeated configs, which the run loop stops on.
    `pick_seed` (worker k of a shared study) draws among the unvisited grid points on its own."""

    def __init__(self, search_space, seed: int | None = None, pick_seed: int | None = None):
        super().__init__(search_space, seed=seed)
        if pick_seed is not None and pick_seed != seed:
            self._rng.rng.seed(pick_seed)

    def after_trial(self, study, trial, state, values) -> None:
        pass
