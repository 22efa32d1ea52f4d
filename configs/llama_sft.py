"""Supervised fine-tuning of a Llama on one 80 GB GPU: full fine-tuning of a 1B (Llama 3.2 1B's
architecture, fp32 master weights, bf16 compute). `--config.init.hf=DIR` takes the architecture,
tokenizer and weights from your Llama directory; `data.inputs` must name your chat data
(`data.format=chat`: JSONL lines with `messages`). configs/llama_sft_8b.py is an 8B with LoRA."""

from jaxllm.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(
        num_layers=16, hidden=2048, num_heads=32, num_kv_heads=8, head_dim=64, mlp=8192, vocab_size=128256,
        max_seq_len=131072, qkv_share_every=1, tie_embeddings=True, rope_theta=500000.0, dtype="bfloat16",
        remat="full",
    )  # fmt: skip
    cfg.model.rope_scaling.update(type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_len=8192)  # fmt: skip
    cfg.parallel.update(data=-1, fsdp=1, tensor=1)
    # 32 conversations of up to 2048 tokens per step, 4 at a time: the fp32 logits over a 128k
    # vocabulary and their gradient are the largest temporaries (8 GiB per 8k tokens).
    cfg.train.update(
        steps=2000, batch_size=32, seq_len=2048, grad_accum_steps=8, lr=2e-5, min_lr_ratio=0.1, warmup_steps=50,
        weight_decay=0.0, log_every=10, sample_prompt="Here is a short summary of what I can help with:",
        sample_temperature=0.0,
    )  # fmt: skip
    cfg.data.update(inputs="", format="chat", dir="data/sft", val_fraction=0.02, eval_every=200, eval_batches=8)
    cfg.checkpoint.update(every_steps=500, keep=2)
    return cfg
