"""A forward and backward pass split in three, as zero-bubble pipelining needs ("Zero Bubble
Pipeline Parallelism", Qi et al., 2023): the forward now, the input gradient when the output's
gradient arrives, the weight gradients when there is room.

JAX computes a function's gradients in one pass. Tracing the forward and that pass once gives
their equations, and each output needs only some of them: the output needs the forward's; the
input gradient, beyond those, the chain of gradients back through the layers (and what the remat
policy recomputes); the weight gradients, beyond both, only the weight products (xᵀ·g of each
projection). So the equations split by what they feed, each part handing the later ones the
values they read: the forward's residuals (what the remat policy keeps) and the input gradient's
"taps" (each projection's input and output gradient). Nothing is computed twice.

The equations must be flat: a `lax.scan` computes both gradients in one equation, so a function
split this way applies its layers in a Python loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.extend import core

# Call-like equations whose insides are spliced into the flat list, so that a remat policy's
# recompute and a jitted helper's work land in the part that needs them.
INLINED = ("checkpoint", "remat2", "pjit", "jit", "closed_call")


class Op(NamedTuple):
    """One equation of the flat program, its values named by hashable references."""

    primitive: core.Primitive
    params: dict
    ins: tuple
    outs: tuple
    avals: tuple  # of outs


class Split(NamedTuple):
    """The three parts of one traced forward and backward pass."""

    ops: list[Op]
    consts: dict  # reference -> array
    invars: list  # references of (weights, x, rest, g)'s leaves
    known: list  # those of weights' and rest's: what the weight part may recompute from
    input_avals: list
    outvars: list  # references (or literals) of (y, weight grads, x grad)'s leaves
    parts: tuple[list, list, list]  # indices into ops: forward, input gradient, weight gradients
    residuals: list  # the values the forward hands on
    taps: list  # the values the input gradient hands on
    weights: jax.tree_util.PyTreeDef  # of the weight gradients
    inputs: jax.tree_util.PyTreeDef  # of the input gradient

    def forward(self, weights, x, rest) -> tuple:
        """(the output, the residuals)."""
        env = self._env(weights, x, rest)
        self._run(0, env)
        return _read(env, self.outvars[0]), [env[v] for v in self.residuals]

    def input_grad(self, weights, x, rest, g, residuals: list) -> tuple:
        """(the gradient of x for the output's cotangent `g`, the taps)."""
        env = self._env(weights, x, rest, g) | dict(zip(self.residuals, residuals, strict=True))
        self._run(1, env)
        grads = [_read(env, v) for v in self.outvars[1 + self.weights.num_leaves :]]
        return self.inputs.unflatten(grads), [env[v] for v in self.taps]

    def weight_grad(self, weights, rest, taps: list):
        """The weights' gradients from the taps of an `input_grad` (`weights` and `rest` for what
        does not depend on the unit's data)."""
        env = self.consts | dict(zip(self.known, jax.tree.leaves((weights, rest)), strict=True))
        env |= dict(zip(self.taps, taps, strict=True))
        self._run(2, env)
        return self.weights.unflatten([_read(env, v) for v in self.outvars[1 : 1 + self.weights.num_leaves]])

    def avals(self, values: list) -> list:
        """The abstract values (shape, dtype, varying axes) of `residuals` or `taps`."""
        avals = {r: a for op in self.ops for r, a in zip(op.outs, op.avals, strict=True)}
        avals |= dict(zip(self.invars, self.input_avals, strict=True))
        return [avals[v] for v in values]

    def _env(self, *args) -> dict:  # (weights, x, rest) or (weights, x, rest, g)
        return self.consts | dict(zip(self.invars, jax.tree.leaves(args), strict=False))

    def _run(self, part: int, env: dict) -> None:
        for i in self.parts[part]:
            op = self.ops[i]
            ins = [_read(env, v) for v in op.ins]
            if op.primitive.name == "pvary":  # values that already vary where the traced ones did not
                axes = _not_yet(ins[0], op.params["axes"])
                out = jax.lax.pcast(ins[0], axes, to="varying") if axes else ins[0]
            else:
                out = op.primitive.bind(*ins, **op.params)
            env.update(zip(op.outs, out if op.primitive.multiple_results else [out], strict=True))


def split_backward(fn, weights, x, rest) -> Split:
    """The forward and backward pass of `fn(weights, x, rest)` (an array), differentiated with
    respect to `weights` and `x`, traced at these arguments' shapes and split in three."""

    def forward_backward(weights, x, rest, g):
        y, vjp = jax.vjp(lambda w, x: fn(w, x, rest), weights, x)
        return y, *vjp(g)

    g = jax.eval_shape(fn, weights, x, rest)
    closed = jax.make_jaxpr(forward_backward)(weights, x, rest, g)
    ops, consts = [], {}
    names = {v: ("const", i) for i, v in enumerate(closed.jaxpr.constvars)}
    consts.update(zip(names.values(), closed.consts, strict=True))
    invars = [("input", i) for i in range(len(closed.jaxpr.invars))]
    names.update(zip(closed.jaxpr.invars, invars, strict=True))
    outvars = _flatten(closed.jaxpr, names, ops, consts)
    n, n_x = len(jax.tree.leaves(weights)), len(jax.tree.leaves(x))
    n_in = n + n_x + len(jax.tree.leaves(rest))
    # What depends on the unit's data (x or g) is computed once and handed on; the rest (a
    # weight's slice or cast, a rope table) each part recomputes from the weights and `rest`.
    data = set(invars[n : n + n_x]) | set(invars[n_in:])
    for op in ops:
        if any(not isinstance(v, core.Literal) and v in data for v in op.ins):
            data.update(op.outs)
    on_data = {i for i, op in enumerate(ops) if any(v in data for v in op.outs)}
    forward = _needed(ops, outvars[:1], set())
    grads = _needed(ops, outvars[1 + n :], on_data & set(forward))
    weight = _needed(ops, outvars[1 : 1 + n], on_data & set(forward + grads))

    def made_by(part):
        return {v for i in part for v in ops[i].outs} & data

    return Split(
        ops, consts, invars, invars[:n] + invars[n + n_x : n_in], [v.aval for v in closed.jaxpr.invars], outvars,
        (forward, grads, weight),
        _read_by(ops, grads + weight, outvars[1:], made_by(forward)),
        _read_by(ops, weight, outvars[1 : 1 + n], made_by(forward + grads) | set(invars[n : n + n_x] + invars[n_in:])),
        jax.tree.structure(weights), jax.tree.structure(x),
    )  # fmt: skip


def _flatten(jaxpr: core.Jaxpr, names: dict, ops: list, consts: dict) -> list:
    """Appends `jaxpr`'s equations to `ops`, splicing in those of `INLINED` calls; `names` maps
    its inputs to references. Returns its outputs' references."""
    scope = object()

    def ref(v):
        return v if isinstance(v, core.Literal) else names.get(v, (scope, v))

    for eqn in jaxpr.eqns:
        ins = tuple(ref(v) for v in eqn.invars)
        if eqn.primitive.name in INLINED:
            inner = eqn.params["jaxpr"]
            inner_consts = getattr(inner, "consts", [])
            inner = getattr(inner, "jaxpr", inner)
            inner_names = dict(zip(inner.invars, ins, strict=True))
            for v, c in zip(inner.constvars, inner_consts, strict=True):
                inner_names[v] = ("const", id(c))
                consts[inner_names[v]] = c
            for v, r in zip(eqn.outvars, _flatten(inner, inner_names, ops, consts), strict=True):
                names[v] = r
        else:
            outs = tuple(ref(v) for v in eqn.outvars)
            params = eqn.primitive.get_bind_params(eqn.params)
            ops.append(Op(eqn.primitive, params, ins, outs, tuple(v.aval for v in eqn.outvars)))
    return [ref(v) for v in jaxpr.outvars]


def _needed(ops: list, outputs, skip: set) -> list:
    """The indices of the ops `outputs` need, in order, leaving out those in `skip`."""
    wanted = {v for v in outputs if not isinstance(v, core.Literal)}
    found = []
    for i in reversed(range(len(ops))):
        if i not in skip and any(v in wanted for v in ops[i].outs):
            found.append(i)
            wanted.update(v for v in ops[i].ins if not isinstance(v, core.Literal))
    return found[::-1]


def _read_by(ops: list, later: list, outputs, made: set) -> list:
    """The values in `made` that the `later` ops (and `outputs`) read."""
    read = [v for i in later for v in ops[i].ins] + list(outputs)
    return list(dict.fromkeys(v for v in read if not isinstance(v, core.Literal) and v in made))


def _not_yet(x, axes) -> tuple:
    return tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)


def _read(env: dict, v):
    return v.val if isinstance(v, core.Literal) else env[v]
