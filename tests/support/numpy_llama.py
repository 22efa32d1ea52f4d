"""An independent Llama in numpy (float64) that reads Hugging Face tensor names, layouts and
config.json fields as they are: what a converted model must compute. Written from the Llama
architecture (RMSNorm, rotate-half RoPE with Llama 3.1's frequency scaling, grouped-query
attention, SwiGLU), sharing no code with jaxllm."""

import math

import numpy as np


def _rms_norm(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _inverse_frequencies(config, head_dim):
    rope = config.get("rope_parameters") or {**(config.get("rope_scaling") or {}), "rope_theta": config["rope_theta"]}
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return inv / rope["factor"]
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv
        scaled = np.where(wavelength > old / low, inv / factor, inv)
        smooth = (old / wavelength - low) / (high - low)
        medium = (wavelength >= old / high) & (wavelength <= old / low)
        return np.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)
    assert kind == "default", kind
    return inv


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def logits(tensors: dict, config: dict, tokens: np.ndarray) -> np.ndarray:
    """[batch, seq, vocab] logits of the Llama whose weights are `tensors` (HF names) for `tokens`."""
    w = {name: np.asarray(t, np.float64) for name, t in tensors.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    eps, (batch, seq) = config["rms_norm_eps"], tokens.shape
    angles = np.arange(seq)[:, None] * _inverse_frequencies(config, head_dim)[None]
    cos = np.cos(np.concatenate([angles, angles], -1))[None, :, None]
    sin = np.sin(np.concatenate([angles, angles], -1))[None, :, None]
    causal = np.tril(np.ones((seq, seq), bool))
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(batch, seq, heads, head_dim)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(batch, seq, kv_heads, head_dim)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(batch, seq, kv_heads, head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = (np.repeat(t, heads // kv_heads, axis=2) for t in (k, v))  # query head j reads kv head j // group
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, heads * head_dim)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        m = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


def greedy(tensors: dict, config: dict, prompt: list[int], count: int) -> list[int]:
    """`count` tokens after `prompt`, each the argmax of a full recompute."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(logits(tensors, config, np.array([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]
