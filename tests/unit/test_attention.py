"""The fused attention paths compute the model's attention: causal, within documents, GQA where the
kernel has it. On CPU the cuDNN path's call runs on JAX's XLA implementation and the Pallas kernel
in its interpreter; the GPU runs are in scripts/gpu_check.sh."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.runs import small_config

from jaxllm.config import ConfigError, validate
from jaxllm.model import layers
from jaxllm.model.decoder import Model
from jaxllm.parallel.mesh import make_mesh
from jaxllm.train.step import init_params


def _pallas_length() -> int:
    """A sequence of two of the Pallas kernel's 128-position blocks, in a config that validation
    accepts for it (as many kv heads as query heads, the length a multiple of 128)."""
    cfg = small_config(attention="pallas", num_heads=4, num_kv_heads=4, max_seq_len=256)
    cfg = cfg.updated(train=dict(seq_len=256))
    validate(cfg, 1)
    assert (cfg.model.num_heads, cfg.model.head_dim) == (4, 16)  # as `_inputs` makes them
    return cfg.train.seq_len


# name: (kernel, kv heads, sequence length)
FUSED = {
    "jax.nn.dot_product_attention (cudnn's call), GQA": (
        partial(layers.library_attention, implementation="xla"), 2, 64,
    ),
    "pallas kernel (interpreted), two blocks": (partial(layers.pallas_attention, interpret=True), 4, _pallas_length()),
}  # fmt: skip


def _inputs(kv_heads: int, batch: int = 2, t: int = 64):
    """Two rows of packed documents; at 256 positions they straddle the Pallas kernel's block edge."""
    heads, d = 4, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, t, heads, d))
    k, v = (jax.random.normal(key, (batch, t, kv_heads, d)) for key in keys[1:3])
    n = t // 64
    documents = [[1] * 40 * n + [2] * 24 * n, [1] * 10 * n + [2] * 30 * n + [3] * 24 * n]
    return q, k, v, jnp.array(documents * (batch // 2)), jax.random.normal(keys[3], q.shape)


def _value_and_grads(attend, q, k, v, segment_ids, cotangent):
    out, backward = jax.vjp(lambda q, k, v: attend(q, k, v, segment_ids), q, k, v)
    return out, backward(cotangent)


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("packed", [True, False], ids=["packed documents", "one document per row"])
def test_fused_paths_equal_xla_attention_and_its_gradients(name, packed):
    kernel, kv_heads, length = FUSED[name]
    q, k, v, segment_ids, cotangent = _inputs(kv_heads, t=length)
    segment_ids = segment_ids if packed else None
    got = _value_and_grads(kernel, q, k, v, segment_ids, cotangent)
    want = _value_and_grads(layers.self_attention, q, k, v, segment_ids, cotangent)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5), got, want)


def test_a_kernel_runs_on_each_devices_own_rows_and_heads():
    """Under a mesh, a kernel sees its device's batch rows and heads, and the result is the
    single-device one."""
    cfg = small_config()
    cfg = cfg.updated(parallel=dict(data=2, fsdp=2, tensor=2))
    q, k, v, segment_ids, _ = _inputs(kv_heads=2, batch=4)
    seen = []

    def kernel(q, k, v, segment_ids):
        seen.append((q.shape, k.shape, segment_ids.shape))
        return layers.library_attention(q, k, v, segment_ids, implementation="xla")

    with jax.set_mesh(make_mesh(cfg.parallel)):
        got = jax.jit(layers.per_device(kernel))(q, k, v, segment_ids)
    assert seen == [((1, 64, 2, 16), (1, 64, 1, 16), (1, 64))]
    np.testing.assert_allclose(got, layers.self_attention(q, k, v, segment_ids), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["cudnn", "pallas"])
def test_fused_kernels_are_refused_off_gpu(implementation):
    cfg = small_config()
    cfg = cfg.updated(
        parallel=dict(data=8),
        model=dict(attention=implementation, dtype="bfloat16", num_kv_heads=8, max_seq_len=128),
        train=dict(seq_len=128),
    )
    validate(cfg, 8)  # the shapes suit the kernel: only the backend is wrong
    with pytest.raises(ConfigError) as err:
        validate(cfg, 8, backend="cpu")
    assert f"model.attention={implementation!r} is a GPU kernel" in str(err.value)
    assert "'cpu'" in str(err.value) and "model.attention='xla'" in str(err.value)


def test_the_model_calls_the_configured_implementation():
    """Traced on CPU: `pallas` puts a Pallas kernel in the forward pass, `cudnn` asks JAX for
    cuDNN (absent here), `xla` neither."""
    tokens = jnp.zeros((2, 128), jnp.int32)

    def trace(attention):
        cfg = small_config(attention=attention, dtype="bfloat16", num_kv_heads=8)
        params = init_params(cfg)
        return str(jax.make_jaxpr(lambda p: Model(cfg.model).logits(p, tokens))(params))

    assert "pallas_call" in trace("pallas")
    assert "pallas_call" not in trace("xla") and "dot_product_attention" not in trace("xla")
    with pytest.raises(RuntimeError, match="cuDNN"):
        trace("cudnn")
