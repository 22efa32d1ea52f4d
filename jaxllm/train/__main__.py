"""`python -m jaxllm.train --config configs/X.py [--config.a.b=value ...] [--workdir DIR] [--dry-run]`;
with `--config.init.hf=DIR`, fine-tunes the Hugging Face Llama there (see `jaxllm/checkpoint/hf/config.py`)."""

from __future__ import annotations

import pathlib
import sys

from absl import logging

from jaxllm import cli
from jaxllm.checkpoint.hf.config import fine_tuning_config
from jaxllm.config import RunConfig, load_config
from jaxllm.errors import exit_on_error
from jaxllm.parallel.distributed import initialize_from_environment
from jaxllm.train.dry_run import dry_run, ensure_fake_devices
from jaxllm.train.loop import Hooks, train


@exit_on_error
def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> None:
    """The command; `hooks` reach into the run between its steps (see `Hooks`)."""
    parser = cli.parser("python -m jaxllm.train", __doc__, [RunConfig])
    parser.add_argument("--config", required=True, help="a config file (configs/*.py)")
    parser.add_argument("--workdir", help="the run's directory (default: runs/<config name>)")
    parser.add_argument("--dry-run", action="store_true", help="compile the step on fake CPU devices, report, exit")
    rest, texts = cli.split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    cli.quiet_jax_logs()
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
    overrides = cli.typed_overrides(texts)
    cfg = load_config(args.config, overrides)
    if cfg.init.hf:
        cfg = fine_tuning_config(cfg, overrides)
    if args.dry_run:
        ensure_fake_devices(cfg)
        dry_run(cfg)
        return
    initialize_from_environment()
    train(cfg, args.workdir or f"runs/{pathlib.Path(args.config).stem}", hooks=hooks)


if __name__ == "__main__":
    main()
