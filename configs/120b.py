"""120B on 64 GPUs (8 nodes × 8): tensor 8 × stage 4 × fsdp 2.

Why these numbers:
- hidden 12288, 96 heads × 128, mlp 32768, vocab 50257 (padded to 50304), QKV shared by every 4 layers.
  80 layers store ≈119.0B parameters (117.8B in the layers); each layer still applies the shared QKV,
  so training costs 6 × 145.6B FLOPs per token, like Megatron's 145.6B GPT.
- The 1200 layers sometimes quoted for this model would be ≈1.77T parameters at this width.
- 80 layers = 20 QKV groups, and pipeline stages must fall on group boundaries: 4 stages of 5 groups.
  Pipeline 8 would need a multiple of 32 layers (8 stages × 4 layers per group).
- Tensor 8 stays inside one NVLink node; fsdp 2 shards params and optimizer state across the two replicas.
  Sequence parallelism splits the residual stream between tensor-parallel blocks 8 ways along the
  sequence, and with it each stage shift.
- Global batch 64 sequences = 32 pipeline microbatches × 1 per fsdp replica × 2 replicas;
  bubble (stages−1)/(microbatches+stages−1) = 3/35 ≈ 8.6 %. Group remat ("checkpoint every 4 layers").
- cuDNN flash attention: no [seq, seq] scores in memory. (`--dry-run` compiles XLA attention in its
  place, since XLA:CPU has no cuDNN, so its figures over-state attention.)
- Memory per 80 GB GPU (`--dry-run`): 21.4 GiB of params and Adam state; the stage's bf16 weights
  gathered for the step and their fp32 gradient sums, 20.6 GiB; a 56.3 GiB peak, 70 % of the GPU.
  The fp32 sums are what keeps gradients exact over 32 microbatches (Megatron's main_grad).
"""

from jaxllm.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(
        num_layers=80,
        hidden=12288,
        num_heads=96,
        num_kv_heads=96,
        head_dim=128,
        mlp=32768,
        vocab_size=50257,
        max_seq_len=2048,
        qkv_share_every=4,
        dtype="bfloat16",
        remat="group",
        attention="cudnn",
    )
    cfg.parallel.update(data=1, fsdp=2, stage=4, tensor=8, microbatches=32, repeats=1, sequence_parallel=True)
    cfg.train.update(steps=100_000, batch_size=64, seq_len=2048, lr=6e-5, warmup_steps=2000, log_every=10)
    cfg.data.update(tokenizer="gpt2", dir="data/stdlib-gpt2")  # point data.inputs at your corpus
    return cfg
