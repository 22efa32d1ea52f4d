"""A traced forward and backward pass split in three (`parallel/split_backward.py`): the parts give
what `jax.vjp` gives, nothing is computed twice, and a remat policy decides what the forward keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.parallel.split_backward import split_backward

LAYERS, ROWS, WIDTH, INNER = 3, 4, 8, 16


def _layers(remat: bool):
    def fn(weights, x, scale):
        for up, down in weights:
            cast = 2 * up  # as the projections cast their weights: an op on a weight alone

            def layer(x, up=cast, down=down):
                return jax.jit(jnp.tanh)(x @ up) @ down * scale

            x = jax.checkpoint(layer)(x) if remat else layer(x)
        return x

    return fn


def _arguments():
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    weights = [
        (jax.random.normal(keys[2 * i], (WIDTH, INNER)), jax.random.normal(keys[2 * i + 1], (INNER, WIDTH)) / 4)
        for i in range(LAYERS)
    ]
    x, g = (jax.random.normal(k, (ROWS, WIDTH)) for k in keys[-2:])
    return weights, x, jnp.float32(0.5), g


@pytest.mark.parametrize("remat", [False, True])
def test_the_three_parts_give_what_vjp_gives(remat):
    fn, (weights, x, scale, g) = _layers(remat), _arguments()
    split = split_backward(fn, weights, x, scale)
    y, residuals = jax.jit(split.forward)(weights, x, scale)
    dx, taps = jax.jit(split.input_grad)(weights, x, scale, g, residuals)
    dweights = jax.jit(split.weight_grad)(weights, scale, taps)
    want_y, vjp = jax.vjp(lambda w, x: fn(w, x, scale), weights, x)
    want_dweights, want_dx = vjp(g)
    np.testing.assert_allclose(y, want_y, rtol=1e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(dweights), jax.tree.leaves(want_dweights), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", [False, True])
def test_each_product_runs_once_in_the_part_that_needs_it(remat):
    """Two matmuls a layer forward, four backward: the weight part runs the 2 per layer that make
    weight gradients, and no other part runs them; the forward's are not run again unless the
    remat policy recomputes them (then in the input gradient's part: the one product a layer's
    backward reads, x·up under the tanh)."""
    split = split_backward(_layers(remat), *_arguments()[:3])

    def dots(part):
        return sum(split.ops[i].primitive.name == "dot_general" for i in part)

    forward, grads, weight = split.parts
    assert dots(forward) == 2 * LAYERS
    assert dots(weight) == 2 * LAYERS
    products = [split.ops[i] for i in weight if split.ops[i].primitive.name == "dot_general"]
    assert all(op.avals[0].shape in {(WIDTH, INNER), (INNER, WIDTH)} for op in products)
    assert dots(grads) == 2 * LAYERS + (LAYERS if remat else 0)


def test_the_forward_keeps_what_the_remat_policy_keeps_and_no_weight():
    """With each layer rematerialised the forward hands on only the later layers' inputs; without,
    every activation the backward reads. Neither hands on a weight's cast, and the taps are each
    product's input and output gradient: activations, never weights."""
    args = _arguments()[:3]
    splits = {remat: split_backward(_layers(remat), *args) for remat in (False, True)}
    kept = {remat: [a.shape for a in s.avals(s.residuals)] for remat, s in splits.items()}
    assert kept[True] == [(ROWS, WIDTH)] * (LAYERS - 1)
    assert len(kept[False]) > LAYERS and all(shape[0] == ROWS for shape in kept[False])
    assert all(a.shape[0] == ROWS for a in splits[False].avals(splits[False].taps))
