"""Tiny default: a ~2M-parameter model that trains on a laptop CPU in a few minutes, on the Python
standard library's own sources with a 2048-token BPE trained on them at the first run."""

from jaxllm.config import base_config


def get_config():
    cfg = base_config()
    cfg.model.update(
        num_layers=8, hidden=128, num_heads=4, mlp=384, vocab_size=2048, max_seq_len=256,
        qkv_share_every=4, dtype="float32",
    )
    cfg.train.update(
        steps=400, batch_size=16, seq_len=128, lr=6e-3, warmup_steps=30, log_every=10,
        sample_prompt="def read_config(path):\n    ",
    )
    cfg.data.update(inputs="stdlib", tokenizer="bpe", bpe_vocab_size=2048, dir="data/stdlib-bpe2048", eval_every=50)
    return cfg
