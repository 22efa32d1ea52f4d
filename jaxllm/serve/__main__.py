"""`python -m jaxllm.serve (--workdir RUN | --checkpoint EXPORT | --hf DIR) [--quantize int8] [--config.serve.X=...]`:
serves the model over HTTP (OpenAI's API) on serve.host:serve.port. The server answers at once (/health
is 503 until every step has compiled). With `--prompt`, completes the prompts and exits instead."""

import logging as std_logging
import os
import pathlib
import socket
import threading

import uvicorn
from absl import app, flags, logging
from ml_collections import config_flags

from jaxllm.config import ConfigError, base_config
from jaxllm.data.tokenizer import prompt_ids
from jaxllm.errors import exit_on_error
from jaxllm.hf.config import require_hf_dir
from jaxllm.serve.api import create_app
from jaxllm.serve.chat import ChatTemplate
from jaxllm.serve.generation import Limits, Request
from jaxllm.serve.guards import DenyList, load_api_keys
from jaxllm.serve.load import serving_setup, start_engine
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.server import Server

CONFIG = config_flags.DEFINE_config_dict("config", base_config(), "Overrides of the checkpoint's config.")
WORKDIR = flags.DEFINE_string("workdir", None, "A training run: serve its latest readable checkpoint.")
CHECKPOINT = flags.DEFINE_string("checkpoint", None, "An export (python -m jaxllm.export or jaxllm.convert).")
HF = flags.DEFINE_string("hf", None, "A Hugging Face Llama directory (config.json, safetensors, tokenizer.json).")
QUANTIZE = flags.DEFINE_enum(
    "quantize", None, ["int8"], "int8 weights, per-output-channel scales, quantized at load (an int8 export: as is)."
)
TOKENIZER = flags.DEFINE_string("tokenizer", None, "'gpt2' or a tokenizer.json instead of the saved one (must match).")
API_KEYS = flags.DEFINE_string("api-keys", None, "A file of API keys, one per line (also: JAXLLM_API_KEYS=k1,k2).")
DENY = flags.DEFINE_string("deny", None, "A file of regexes, one per line, refused in any request's text.")
CHAT_TEMPLATE = flags.DEFINE_string(
    "chat-template",
    None,
    "A Jinja chat template instead of the model's own (its tokenizer_config.json) or the built-in one.",
)
PROMPT = flags.DEFINE_multi_string("prompt", [], "Complete this prompt and exit instead of serving (repeatable).")
MAX_TOKENS = flags.DEFINE_integer("max-tokens", 64, "With --prompt: tokens to generate per prompt.")
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "With --prompt: 0 is greedy.")
SEED = flags.DEFINE_integer("seed", 0, "With --prompt: the sampling seed.")


def complete_prompts(path: str, cfg, tokenizer) -> None:
    engine = start_engine(path, cfg, tokenizer)
    requests = [
        Request(prompt_ids(tokenizer, p), MAX_TOKENS.value, TEMPERATURE.value, seed=SEED.value) for p in PROMPT.value
    ]
    for generation, prompt in zip(engine.generate(requests), PROMPT.value, strict=True):
        choice = generation.choices()[0]
        print(f"--- {prompt!r} ({choice.finish_reason}, {len(choice.tokens)} tokens)\n{prompt}{choice.text}")


def special_tokens(tokenizer) -> dict[str, str]:
    return {"bos_token": tokenizer.decode([tokenizer.bos_id]), "eos_token": tokenizer.decode([tokenizer.eos_id])}


def serve_http(path: str, cfg, tokenizer) -> None:
    """Listens at once; loads and compiles in a thread that then steps the engine until shutdown."""
    s = cfg.serve
    server = Server(
        s, Limits.of(cfg, tokenizer), s.model_name or pathlib.Path(path).absolute().name, tokenizer,
        ChatTemplate.chosen(CHAT_TEMPLATE.value, tokenizer.chat_template, special_tokens(tokenizer)),
        DenyList.from_file(DENY.value), load_api_keys(API_KEYS.value), Metrics(s.slots),
    )  # fmt: skip
    try:
        listening = socket.create_server((s.host, s.port))
    except OSError as e:
        raise ConfigError(
            f"cannot listen on {s.host}:{s.port} ({os.strerror(e.errno)}); free the port or choose another with "
            "--config.serve.port (and --config.serve.host)"
        ) from e
    http = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
    stop, failure = threading.Event(), []

    def run_engine() -> None:
        try:
            server.engine = start_engine(path, cfg, tokenizer)
            print(f"serve: {server.model_name!r} ready at http://{s.host}:{s.port}/v1", flush=True)
            server.engine.serve_forever(stop, server.metrics.step_slots.observe)
        except Exception as e:
            std_logging.getLogger("jaxllm.serve").exception("the engine stopped")
            if server.engine is None:  # nothing to serve: shut down and report why
                failure.append(e)
                http.should_exit = True

    engine = threading.Thread(target=run_engine, name="engine", daemon=True)
    engine.start()
    auth = f"{len(server.api_keys)} API keys" if server.api_keys else "no API keys (authentication off)"
    print(f"serve: listening on http://{s.host}:{s.port} with {auth}; compiling", flush=True)
    http.run(sockets=[listening])
    stop.set()
    if failure:
        raise failure[0]


@exit_on_error
def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    sources = [s for s in (WORKDIR.value, CHECKPOINT.value, HF.value) if s is not None]
    if len(sources) != 1:
        raise ConfigError("pass exactly one of --workdir RUN (a training run), --checkpoint EXPORT or --hf DIR")
    if HF.value is not None:
        require_hf_dir(HF.value, "--hf")
    path = sources[0]
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    if QUANTIZE.value:
        overrides["model.quantize"] = QUANTIZE.value
    cfg, tokenizer = serving_setup(path, overrides, TOKENIZER.value)
    (complete_prompts if PROMPT.value else serve_http)(path, cfg, tokenizer)


if __name__ == "__main__":
    app.run(main)
