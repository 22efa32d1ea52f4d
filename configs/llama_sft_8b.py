"""LoRA fine-tuning of an 8B Llama (Llama 3.1 8B's architecture) on one 80 GB GPU: rank-16
adapters on every projection train in fp32, the base weights stay frozen in bf16
(`--config.model.quantize=int8` holds them in int8 instead). Otherwise as configs/llama_sft.py
(`--config.init.hf=DIR`, `data.inputs` required)."""

import pathlib
import runpy


def get_config():
    cfg = runpy.run_path(str(pathlib.Path(__file__).with_name("llama_sft.py")))["get_config"]()
    cfg.model.update(
        num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp=14336, tie_embeddings=False,
        param_dtype="bfloat16",
    )  # fmt: skip
    cfg.model.rope_scaling.update(factor=8.0)
    cfg.model.lora.update(rank=16, alpha=32.0)
    cfg.train.update(lr=2e-4)  # adapters start at zero and take a larger step than full fine-tuning
    return cfg
