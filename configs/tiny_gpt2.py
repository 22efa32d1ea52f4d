"""The tiny model with the real GPT-2 tokenizer (50,257 tokens, the 120B config's vocabulary)."""

from configs.tiny import get_config as tiny


def get_config():
    cfg = tiny()
    cfg.model.vocab_size = 50257
    cfg.data.update(tokenizer="gpt2", dir="data/stdlib-gpt2")
    return cfg
