"""~8.4B model for one 8-GPU node: Llama-8B width with GQA, 40 layers (QKV is shared, so 32 would be
6.8B); tensor 2 × fsdp 4, full remat, 16 accumulation microsteps of 1 sequence per fsdp rank
(`--dry-run` peak 44.4 GiB with XLA attention)."""

from jaxllm.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(
        num_layers=40,
        hidden=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp=14336,
        vocab_size=50257,
        max_seq_len=4096,
        qkv_share_every=4,
        dtype="bfloat16",
        remat="full",
    )
    cfg.parallel.update(data=1, fsdp=4, tensor=2)
    cfg.train.update(
        steps=50_000, batch_size=64, seq_len=4096, grad_accum_steps=16, lr=3e-4, warmup_steps=1000, log_every=10
    )
    cfg.data.update(tokenizer="gpt2", dir="data/stdlib-gpt2")  # point data.inputs at your corpus
    return cfg
