"""`python -m jaxllm.serve (--workdir RUN | --checkpoint EXPORT) [--config.serve.X=...]`: loads a
model for serving (every step compiled) and completes each `--prompt`, all decoded together."""

from absl import app, flags, logging
from ml_collections import config_flags

from jaxllm.config import ConfigError, base_config
from jaxllm.errors import exit_on_error
from jaxllm.serve.engine import Request
from jaxllm.serve.load import load_engine

CONFIG = config_flags.DEFINE_config_dict("config", base_config(), "Overrides of the checkpoint's config.")
WORKDIR = flags.DEFINE_string("workdir", None, "A training run: serve its latest readable checkpoint.")
CHECKPOINT = flags.DEFINE_string("checkpoint", None, "An export (python -m jaxllm.export).")
TOKENIZER = flags.DEFINE_string("tokenizer", None, "'gpt2' or a tokenizer.json instead of the saved one (must match).")
PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt to complete (repeatable).")
MAX_TOKENS = flags.DEFINE_integer("max-tokens", 64, "Tokens to generate per prompt.")
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.")
SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


@exit_on_error
def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    if (WORKDIR.value is None) == (CHECKPOINT.value is None):
        raise ConfigError("pass exactly one of --workdir RUN (a training run) or --checkpoint EXPORT")
    if not PROMPT.value:
        raise ConfigError("pass at least one --prompt")
    overrides = config_flags.get_override_values(flags.FLAGS["config"])
    engine = load_engine(WORKDIR.value or CHECKPOINT.value, overrides, TOKENIZER.value)
    tokenizer = engine.tokenizer
    requests = [
        Request(tokenizer.encode(p), MAX_TOKENS.value, TEMPERATURE.value, seed=SEED.value) for p in PROMPT.value
    ]
    for generation, prompt in zip(engine.generate(requests), PROMPT.value, strict=True):
        choice = generation.choices()[0]
        print(f"--- {prompt!r} ({choice.finish_reason}, {len(choice.tokens)} tokens)\n{prompt}{choice.text}")


if __name__ == "__main__":
    app.run(main)
