"""Comparing training runs parameter by parameter: each leaf's relative error, what a step's
optimizer state says its gradient was, and a train config whose updates carry the gradients'
scale."""

import jax
import numpy as np
import optax

from jaxllm.config import RunConfig


def leaf_errors(got, want) -> dict[str, float]:
    """‖got − want‖ / ‖want‖ of each leaf (in float64), by its path."""

    def error(g, w):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        return float(np.linalg.norm(g - w) / np.linalg.norm(w))

    flat = jax.tree_util.tree_leaves_with_path(jax.tree.map(error, got, want))
    return {jax.tree_util.keystr(path): e for path, e in flat}


def assert_leaves_within(got, want, bound: float, what: str) -> dict[str, float]:
    """Every leaf's relative error (`leaf_errors`) at most `bound`; returns the errors."""
    errors = leaf_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= bound, f"{what}: {worst} off by {errors[worst]:.3g} > {bound:.3g}; {errors}"
    return errors


def updates(params, initial):
    """What the steps changed: params − initial params, leaf by leaf."""
    return jax.tree.map(lambda p, p0: np.asarray(p, np.float64) - np.asarray(p0, np.float64), params, initial)


def first_moment(opt_state):
    """Adam's `mu` of every parameter: after the first step, (1 − b1) × that step's clipped gradient."""
    return optax.tree_utils.tree_get(opt_state, "mu")


def proportional_updates(cfg: RunConfig) -> RunConfig:
    """Adam whose updates are proportional to the gradients: an epsilon far above every gradient
    makes a step lr·m̂/(√v̂ + ε) ≈ lr·m̂ (no weight decay to hide it). Adam as configured normally
    moves each weight by ±lr at first whatever its gradient's size: a gradient off by a factor
    would not show in the params, and rounding noise on a near-zero gradient moves them by whole
    steps."""
    return cfg.updated(train=dict(lr=1.0, eps=1.0, weight_decay=0.0))
