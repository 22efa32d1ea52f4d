"""`python -m jaxllm.serve (--workdir RUN | --checkpoint EXPORT | --hf DIR) [--quantize int8] [--config.serve.X=...]`:
serves the model over HTTP (OpenAI's API) on serve.host:serve.port. The server answers at once (/health
is 503 until every step has compiled). With `--prompt`, completes the prompts and exits instead."""

import os
import pathlib
import socket
import sys
import threading
import time

import uvicorn
from absl import logging

from jaxllm import cli, logs
from jaxllm.checkpoint.hf.config import require_hf_dir
from jaxllm.config import ConfigError, RunConfig, step_range
from jaxllm.data.chat import ChatTemplate, special_tokens
from jaxllm.data.tokenizer import prompt_ids
from jaxllm.errors import exit_on_error
from jaxllm.parallel.distributed import use_compile_cache
from jaxllm.profile import StepProfiler
from jaxllm.serve.api import create_app
from jaxllm.serve.generation import Limits, Request
from jaxllm.serve.guards import DenyList, load_api_keys
from jaxllm.serve.load import serving_setup, start_engine
from jaxllm.serve.metrics import Metrics
from jaxllm.serve.server import Server
from jaxllm.serve.settings import ServeConfig, Serving

log = logs.get(__name__)


def _parser():
    parser = cli.parser("python -m jaxllm.serve", __doc__, [ServeConfig, RunConfig])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training run: serve its latest readable checkpoint")
    source.add_argument("--checkpoint", help="an export (python -m jaxllm.export or jaxllm.convert)")
    source.add_argument("--hf", help="a Hugging Face Llama directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--quantize", choices=["int8"], help="int8 weights, per-output-channel scales, quantized at "
                        "load (an int8 export: as is)")  # fmt: skip
    parser.add_argument("--tokenizer", help="'gpt2' or a tokenizer.json instead of the saved one (must match)")
    parser.add_argument("--api-keys", help="a file of API keys, one per line (also: JAXLLM_API_KEYS=k1,k2)")
    parser.add_argument("--deny", help="a file of regexes, one per line, refused in any request's text")
    parser.add_argument("--chat-template", help="a Jinja chat template instead of the model's own (its "
                        "tokenizer_config.json) or the built-in one")  # fmt: skip
    parser.add_argument("--prompt", action="append", default=[], help="complete this prompt and exit instead of "
                        "serving (repeatable)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64, help="with --prompt: tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="with --prompt: 0 is greedy")
    parser.add_argument("--seed", type=int, default=0, help="with --prompt: the sampling seed")
    parser.add_argument("--profile-steps", default="", help="'A:B': trace engine steps A to B (inclusive) with "
                        "jax.profiler into --profile-dir and print a summary")  # fmt: skip
    parser.add_argument("--profile-dir", help="where --profile-steps writes its trace (default: WORKDIR/profile "
                        "with --workdir, else ./profile)")  # fmt: skip
    cli.add_logging(parser)
    return parser


def profiler(args) -> StepProfiler | None:
    """The --profile-steps profiler (None without it); it prints its summary when it ends."""
    steps = step_range(args.profile_steps, "--profile-steps")
    if steps is None:
        return None
    logdir = args.profile_dir or (pathlib.Path(args.workdir) / "profile" if args.workdir else "profile")
    return StepProfiler(steps, logdir, on_summary=lambda s: log.info(s.format()))


def complete_prompts(path: str, serving: Serving, tokenizer, args, compile_cache) -> None:
    engine = start_engine(path, serving, tokenizer)
    engine.profiler = profiler(args)
    requests = [
        Request(prompt_ids(tokenizer, p), args.max_tokens, args.temperature, seed=args.seed) for p in args.prompt
    ]
    for generation, prompt in zip(engine.generate(requests), args.prompt, strict=True):
        choice = generation.choices()[0]
        print(f"--- {prompt!r} ({choice.finish_reason}, {len(choice.tokens)} tokens)\n{prompt}{choice.text}")


def serve_http(path: str, serving: Serving, tokenizer, args, compile_cache: pathlib.Path | None) -> None:
    """Listens at once; loads and compiles in a thread that then steps the engine until shutdown."""
    started, s = time.perf_counter(), serving.settings
    name = s.model_name or pathlib.Path(path).absolute().name
    server = Server(
        s, Limits.of(serving, tokenizer), name, tokenizer,
        ChatTemplate.chosen(args.chat_template, tokenizer.chat_template, special_tokens(tokenizer)),
        DenyList.from_file(args.deny), load_api_keys(args.api_keys), Metrics(s.slots, name),
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
            engine = start_engine(path, serving, tokenizer, lambda *progress: setattr(server, "compiled", progress))
            engine.profiler = profiler(args)
            server.engine, startup = engine, time.perf_counter() - started
            server.metrics.startup.set(startup)
            log.info(f"serve: {server.model_name!r} ready at http://{s.host}:{s.port}/v1 in {startup:.1f} s")
            server.engine.serve_forever(stop, server.metrics.step_slots.observe)
        except Exception as e:
            log.exception("the engine stopped")
            if server.engine is None:  # nothing to serve: shut down and report why
                failure.append(e)
                http.should_exit = True

    threading.Thread(target=run_engine, name="engine", daemon=True).start()
    auth = f"{len(server.api_keys)} API keys" if server.api_keys else "no API keys (authentication off)"
    cache = f"compilation cache {compile_cache}" if compile_cache else "no compilation cache"
    log.info(f"serve: listening on http://{s.host}:{s.port} with {auth}; compiling ({cache})")
    http.run(sockets=[listening])
    stop.set()
    if failure:
        raise failure[0]


@exit_on_error
def main(argv: list[str] | None = None) -> None:
    rest, texts = cli.split_overrides(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(rest)
    cli.parse_logging(args)
    step_range(args.profile_steps, "--profile-steps")  # refused before anything loads
    cli.quiet_jax_logs()
    logging.set_verbosity(logging.WARNING)
    if args.hf is not None:
        require_hf_dir(args.hf, "--hf")
    path = args.workdir or args.checkpoint or args.hf
    overrides = cli.typed_overrides(texts, [ServeConfig, RunConfig])
    if args.quantize:
        overrides["model.quantize"] = args.quantize
    serving, tokenizer = serving_setup(path, overrides, args.tokenizer)
    compile_cache = use_compile_cache(serving.settings.compile_cache, args.workdir)
    (complete_prompts if args.prompt else serve_http)(path, serving, tokenizer, args, compile_cache)


if __name__ == "__main__":
    main()
