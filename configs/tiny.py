"""Tiny default: a ~2M-parameter model that trains on a laptop CPU in a few minutes."""

from jaxllm.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(
        num_layers=8,
        hidden=128,
        num_heads=4,
        mlp=384,
        vocab_size=257,
        max_seq_len=256,
        qkv_share_every=4,
        dtype="float32",
    )
    cfg.train.update(steps=300, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=30, log_every=10)
    return cfg
