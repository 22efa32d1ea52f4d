"""The Llama name table: each jaxllm parameter, the Hugging Face tensor it is (one per layer for
the stacked ones) and the transform each way. Conversion is this table and two loops:
`read_params` fills each device's shard from the tensors it needs, and `write_hf_weights` writes
one tensor at a time."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import jax
import numpy as np

from jaxllm.checkpoint.hf.config import ConversionError
from jaxllm.checkpoint.hf.files import WeightFiles, write_weights
from jaxllm.config import ModelConfig
from jaxllm.model.params import at_path, holds

LAYER = "model.layers.{layer}."
# Old checkpoints store RoPE's frequencies, which follow from config.json.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")

Transform = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]  # the path in the params dict
    hf: str  # the tensor's name, with {layer} for one per layer
    hf_shape: tuple[int, ...]
    to_ours: Transform  # one HF tensor → our array (one layer's, for a stacked parameter)
    to_hf: Transform
    stack: str = ""  # "layers": ours is [groups, sublayers, ...]; "groups": [groups, ...], applied by each layer


def _linear(inputs: tuple[int, ...], outputs: tuple[int, ...]) -> tuple[Transform, Transform]:
    """HF's [out, in] matrix ↔ ours [*inputs, *outputs] (we contract the leading dims)."""
    return (lambda a: a.T.reshape(*inputs, *outputs)), (lambda w: w.reshape(math.prod(inputs), -1).T)


def _same() -> tuple[Transform, Transform]:
    return (lambda a: a), (lambda w: w)


def rules(model: ModelConfig) -> list[Rule]:
    """The table for `model`: embedding, per-layer tensors, final norm, then the head if untied.
    Our vocab dim may be longer than HF's (padding): the rows past it import as zeros and are
    never exported."""
    s, h, m, vocab = model, model.hidden, model.mlp, model.vocab_size
    nh, kv, hd = model.num_heads, s.num_kv_heads, s.head_dim
    attention, mlp = LAYER + "self_attn.", LAYER + "mlp."
    table = [Rule(("embed",), "model.embed_tokens.weight", (vocab, h), (lambda a: a), lambda w: w[:vocab])]
    for n, heads in (("q", nh), ("k", kv), ("v", kv)):
        name, shape = f"{attention}{n}_proj.weight", (heads * hd, h)
        table.append(Rule(("groups", "qkv", n), name, shape, *_linear((h,), (heads, hd)), "groups"))
    layers = ("groups", "layers")
    table += [
        Rule((*layers, "attn_norm", "scale"), LAYER + "input_layernorm.weight", (h,), *_same(), "layers"),
        Rule((*layers, "o_proj"), attention + "o_proj.weight", (h, nh * hd), *_linear((nh, hd), (h,)), "layers"),
        Rule((*layers, "mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", (h,), *_same(), "layers"),
        Rule((*layers, "mlp", "gate"), mlp + "gate_proj.weight", (m, h), *_linear((h,), (m,)), "layers"),
        Rule((*layers, "mlp", "up"), mlp + "up_proj.weight", (m, h), *_linear((h,), (m,)), "layers"),
        Rule((*layers, "mlp", "down"), mlp + "down_proj.weight", (h, m), *_linear((m,), (h,)), "layers"),
        Rule(("final_norm", "scale"), "model.norm.weight", (h,), *_same()),
    ]
    if not model.tie_embeddings:
        table.append(Rule(("lm_head",), "lm_head.weight", (vocab, h), (lambda a: a.T), lambda w: w.T[:vocab]))
    return table


def hf_tensors(model: ModelConfig) -> list[tuple[str, Rule, int | None]]:
    """(HF name, rule, layer) of every tensor, in the usual file order."""
    table = rules(model)
    stacked, rest = [r for r in table if r.stack], [r for r in table if not r.stack]
    layers = [(r.hf.format(layer=i), r, i) for i in range(model.num_layers) for r in stacked]
    return [(rest[0].hf, rest[0], None), *layers, *((r.hf, r, None) for r in rest[1:])]


def _check_names(files: WeightFiles, model: ModelConfig) -> None:
    want = {name: rule.hf_shape for name, rule, _ in hf_tensors(model)}
    have = files.names()
    tied_head = {"lm_head.weight"} if model.tie_embeddings else set()  # some tied models store it anyway
    problems = [f"missing {n}" for n in sorted(want.keys() - have)]
    problems += [f"unexpected {n}" for n in sorted(have - want.keys() - tied_head) if not IGNORED.match(n)]
    problems += [f"{n} has shape {files.shape[n]}, config.json implies {want[n]}"
                 for n in sorted(want.keys() & have) if files.shape[n] != want[n]]  # fmt: skip
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise ConversionError(f"{files.directory}: the weights do not fit its config.json ({shown}); pass a Llama "
                              "directory whose config.json and weights belong together")  # fmt: skip


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _fill(out: np.ndarray, source: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]) -> None:
    """`out` = source[index] of an array of `shape`, which may exceed `source` (padding: zeros)."""
    ranges = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    ends = [min(stop, n) for (_, stop), n in zip(ranges, source.shape, strict=True)]
    taken = tuple(slice(start, max(start, end)) for (start, _), end in zip(ranges, ends, strict=True))
    out[tuple(slice(0, t.stop - t.start) for t in taken)] = source[taken]


def read_params(files: WeightFiles, model: ModelConfig, target: dict) -> dict:
    """Params shaped as `target` (abstract arrays, canonical group order, with shardings and
    dtypes) from a Llama's weight files. Each device's shard is filled from just the tensors it
    needs, read one at a time and copied once into place: host memory holds the params, one
    parameter's shard on its way to its device, and one tensor."""
    _check_names(files, model)
    share, params = model.qkv_share_every, {}
    wanted = [rule for rule in rules(model) if holds(target, rule.ours)]  # all, or a part (load_params's only=)
    # Largest first: their copies on the way to the device come while little else is held.
    for rule in sorted(wanted, key=lambda r: -math.prod(at_path(target, r.ours).shape)):
        want = at_path(target, rule.ours)

        def block(index: tuple[slice, ...], rule: Rule = rule, want=want) -> np.ndarray:
            out = np.zeros([len(range(*s.indices(n))) for s, n in zip(index, want.shape, strict=True)], want.dtype)
            if not rule.stack:
                _fill(out, rule.to_ours(files.read(rule.hf)), index, want.shape)
                return out
            within = index[1:] if rule.stack == "groups" else index[2:]
            for j, g in enumerate(range(*index[0].indices(want.shape[0]))):
                sublayers = [0] if rule.stack == "groups" else range(*index[1].indices(share))
                for k, i in enumerate(sublayers):
                    place = out[j] if rule.stack == "groups" else out[j, k]
                    _fill(place, rule.to_ours(files.read(rule.hf.format(layer=g * share + i))), within,
                          want.shape[len(want.shape) - place.ndim :])  # fmt: skip
            return out

        _put(params, rule.ours, jax.make_array_from_callback(want.shape, want.sharding, block, dtype=want.dtype))
    return params


def write_hf_weights(
    directory, parameter: Callable[[tuple[str, ...]], jax.Array], model: ModelConfig, dtype: str,
    max_shard_bytes: int,
) -> list:  # fmt: skip
    """Writes `model`'s params as a Llama's safetensors in `dtype`, one tensor at a time, a
    parameter at a time (every layer's q_proj, then every layer's k_proj, ...): `parameter(path)`
    gives one canonical parameter (any sharding), and is asked for each once. A shared QKV
    (`qkv_share_every` > 1) goes into every layer of its group."""
    share, order = model.qkv_share_every, {rule.ours: i for i, rule in enumerate(rules(model))}
    tensors = dict(sorted(((n, (r, layer)) for n, r, layer in hf_tensors(model)), key=lambda t: order[t[1][0].ours]))
    current: dict = {}  # the parameter being written

    def produce(name: str) -> np.ndarray:
        rule, layer = tensors[name]
        if rule.ours not in current:
            current.clear()
            current[rule.ours] = parameter(rule.ours)
        w = current[rule.ours]
        if rule.stack == "groups":
            w = w[layer // share]
        elif rule.stack == "layers":
            w = w[layer // share, layer % share]
        return rule.to_hf(np.asarray(jax.device_get(w)))

    shapes = [(name, rule.hf_shape) for name, (rule, _) in tensors.items()]
    return write_weights(directory, shapes, produce, dtype, max_shard_bytes)
