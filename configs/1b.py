"""~1.2B model for one 8-GPU node: FSDP over all 8 devices, selective remat, 4 accumulation
microsteps of 2 sequences per GPU (`--dry-run` peak 14.3 GiB with XLA attention)."""

from jaxllm.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(
        num_layers=24,
        hidden=2048,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        mlp=5632,
        vocab_size=50257,
        max_seq_len=2048,
        qkv_share_every=4,
        dtype="bfloat16",
        remat="selective",
    )
    cfg.parallel.update(data=1, fsdp=8, tensor=1)
    cfg.train.update(
        steps=50_000, batch_size=64, seq_len=2048, grad_accum_steps=4, lr=3e-4, warmup_steps=1000, log_every=10
    )
    cfg.data.update(tokenizer="gpt2", dir="data/stdlib-gpt2")  # point data.inputs at your corpus
    return cfg
