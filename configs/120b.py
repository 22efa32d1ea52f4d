"""120B on 64 GPUs (8 nodes × 8): tensor 8 × fsdp 8.

Why these numbers:
- hidden 12288, 96 heads × 128, mlp 32768, vocab 50257 (padded to 50304), QKV shared by every 4 layers.
  80 layers store ≈119.0B parameters (117.8B in the layers); each layer still applies the shared QKV,
  so training costs 6 × 145.6B FLOPs per token, like Megatron's 145.6B GPT.
- The 1200 layers sometimes quoted for this model would be ≈1.77T parameters at this width.
- Layout: tensor 8 inside each NVLink node, fsdp 8 across the nodes, no pipeline. Of the 108 layouts that
  fit (`python -m jaxllm.plan --config configs/120b.py --search --gpus 64 --device a100-80gb`), it is 5th,
  within 1 % of the fastest estimate: 11.7 s a step, 49.5 % MFU, against 16.3 s and 35.6 % for
  tensor 8 × stage 4 × fsdp 2 with 32 microbatches. The pipeline pays its 3/35 bubble and runs at
  one sequence per microbatch; this layout has neither, and the smallest planned memory of the seven
  fastest: 50.8 GiB with group remat and sequence parallelism, against 53.6 with full remat and
  62.6 without sequence parallelism.
- Its cost is the network: fsdp gathers each layer's bf16 weights for the forward and again for the
  backward and reduce-scatters fp32 gradients, 168 GB sent per GPU per step (8.4 s at 80 % of one
  200 Gb/s NIC per GPU), hidden behind 10.3 s of compute. On a fabric under ~56 % of that bandwidth
  the pipelined layout (15 GB per GPU per step) is faster: `--config.parallel.stage=4
  --config.parallel.fsdp=2 --config.parallel.microbatches=32`. 80 layers = 20 QKV groups, so stages
  of 5 groups; pipeline 8 would need a multiple of 32 layers.
- Sequence parallelism splits the residual stream between tensor-parallel blocks 8 ways along the
  sequence. Global batch 64 sequences, 8 per fsdp rank; group remat ("checkpoint every 4 layers").
- cuDNN flash attention: no [seq, seq] scores in memory. (`--dry-run` compiles XLA attention in its
  place, since XLA:CPU has no cuDNN, so its figures over-state attention.)
- Memory per 80 GB GPU (`--dry-run`): 20.8 GiB of params and Adam state; a 62.1 GiB peak, 78 % of the
  GPU, of which the XLA attention scores that cuDNN does not keep are ~15 GiB (the planner's
  temporaries with and without them: 33.0 and 18.0 GiB).
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
    cfg.parallel.update(data=1, fsdp=8, stage=1, tensor=8, microbatches=1, repeats=1, sequence_parallel=True)
    cfg.train.update(steps=100_000, batch_size=64, seq_len=2048, lr=6e-5, warmup_steps=2000, log_every=10)
    cfg.data.update(tokenizer="gpt2", dir="data/stdlib-gpt2")  # point data.inputs at your corpus
    return cfg
