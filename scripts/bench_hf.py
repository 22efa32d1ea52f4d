"""Hugging Face interop at a real model's shapes: a random LlamaForCausalLM shaped like Llama 3.2 1B
(128,256-token vocab, GQA 32/8, tied head, llama3 RoPE scaling), built and saved in bf16 by
transformers, converted both ways by `python -m jaxllm.convert`, and run by jaxllm beside
transformers on the same device.

    python scripts/bench_hf.py [--small]      # needs the hf extra; --small: 4 narrow layers, for a CPU

Prints, per direction, the conversion's wall time and its process's peak resident memory (on the
CPU backend, so the params are in host memory) against the model's bytes, and whether to-hf gives
back every tensor bit for bit; then logits of jaxllm and transformers on the same tokens in fp32
(max |difference| over the logits' spread) and in bf16 (max |difference|, top-1 agreement), and
how many of 32 greedy tokens (fp32) agree.
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

from jaxllm.checkpoint import load_params  # noqa: E402
from jaxllm.data.tokenizer import train_bpe  # noqa: E402
from jaxllm.model.decoder import Model  # noqa: E402
from jaxllm.model.generate import generate  # noqa: E402

LLAMA_3_2_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
)  # fmt: skip
SMALL = {**LLAMA_3_2_1B, "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 1024,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip


PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")  # fmt: skip


def convert(*arguments) -> tuple[float, float]:
    """(seconds, peak resident GB) of `python -m jaxllm.convert ARGUMENTS` on the CPU backend, the
    only child of a fresh process."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-c", PEAK, sys.executable, "-m", "jaxllm.convert", *map(str, arguments)]
    start = time.perf_counter()
    done = subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    print(done.stdout.strip().rsplit("\n", 1)[0])
    return time.perf_counter() - start, int(done.stdout.split()[-1]) * 1024 / 1e9


def same_tensors(a: pathlib.Path, b: pathlib.Path) -> bool:
    def tensors(directory):
        return {name: file for file in directory.glob("*.safetensors") for name in safe_open(file, "np").keys()}

    left, right = tensors(a), tensors(b)
    return left.keys() == right.keys() and all(
        np.array_equal(safe_open(left[n], "np").get_tensor(n), safe_open(right[n], "np").get_tensor(n)) for n in left
    )


def ours(path: pathlib.Path, dtype: str, tokens: np.ndarray):
    cfg, params, _ = load_params(path, dtype=dtype)
    cfg = cfg.updated(model=dict(dtype=dtype))
    logits = np.asarray(jax.jit(lambda p, t: Model(cfg.model).logits(p, t))(params, tokens))
    return logits[..., : cfg.model.vocab_size], cfg, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a 4-layer, 256-wide model with a 32k vocab")
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__} on {device}, transformers {transformers.__version__}, jax {jax.__version__} "
          f"on {jax.devices()[0].platform}")  # fmt: skip
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench_hf_"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(SMALL if args.small else LLAMA_3_2_1B)))
    model.to(torch.bfloat16).save_pretrained(work / "hf")
    train_bpe(iter(pathlib.Path(__file__).read_text().split("\n\n")), 300, work / "hf")  # a tokenizer.json to carry
    size = sum(p.numel() * 2 for p in model.parameters()) / 1e9
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, {size:.2f} GB in bf16")

    for direction, source, out in (("from-hf", ("--hf", work / "hf"), "export"),
                                   ("to-hf", ("--checkpoint", work / "export"), "back")):  # fmt: skip
        seconds, peak = convert(direction, *source, "--out", work / out)
        print(f"{direction}: {seconds:.1f} s, peak resident {peak:.2f} GB = {peak / size:.2f}× the model "
              "(the interpreter and JAX included)")  # fmt: skip
    print(f"round trip bit-exact: {same_tensors(work / 'hf', work / 'back')}")

    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, args.seq))
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        theirs_model = model.to(device=device, dtype=torch_dtype).eval()
        with torch.no_grad():
            theirs = theirs_model(torch.tensor(tokens, device=device)).logits.float().cpu().numpy()
        mine, cfg, params = ours(work / "hf", dtype, tokens)
        diff = np.abs(mine - theirs).max()
        agree = (mine.argmax(-1) == theirs.argmax(-1)).mean()
        print(f"logits {dtype}: max |ours - transformers| {diff:.3g} (logits' std {theirs.std():.3g}), "
              f"top-1 agreement {agree:.2%}")  # fmt: skip
        if dtype == "float32":
            prompt = tokens[0, :16]
            with torch.no_grad():
                want = theirs_model.generate(torch.tensor(prompt[None], device=device), max_new_tokens=32,
                                             min_new_tokens=32, do_sample=False)[0, 16:].tolist()  # fmt: skip
            got = generate(params, Model(cfg.model), list(prompt), 48)[16:]
            same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
            print(f"greedy fp32: the first {same} of {len(want)} tokens agree")
        del params


if __name__ == "__main__":
    main()
