"""`python -m jaxllm.train --config configs/X.py [--config.a.b=value ...] [--workdir DIR] [--dry-run]`;
with `--config.init.hf=DIR`, fine-tunes the Hugging Face Llama there (see `jaxllm/checkpoint/hf/config.py`).
`--prepare-only` prepares the run's data and tokenizer and exits (a job step of its own on a cluster);
`python -m jaxllm.train --goodput WORKDIR` prints where a run's wall-clock time went."""

from __future__ import annotations

import atexit
import pathlib
import sys

import jax
from absl import logging

from jaxllm import cli, logs
from jaxllm.checkpoint.hf.config import fine_tuning_config
from jaxllm.config import RunConfig, load_config
from jaxllm.errors import exit_on_error
from jaxllm.parallel.distributed import CacheCounts, initialize_from_environment, use_compile_cache
from jaxllm.train.dry_run import dry_run, ensure_fake_devices
from jaxllm.train.goodput import Ledger, account, format_account
from jaxllm.train.loop import Hooks, load_data, train

log = logs.get(__name__)


@exit_on_error
def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> None:
    """The command; `hooks` reach into the run between its steps (see `Hooks`)."""
    parser = cli.parser("python -m jaxllm.train", __doc__, [RunConfig])
    parser.add_argument("--config", help="a config file (configs/*.py)")
    parser.add_argument("--workdir", help="the run's directory (default: runs/<config name>)")
    parser.add_argument("--dry-run", action="store_true", help="compile the step on fake CPU devices, report, exit")
    parser.add_argument("--prepare-only", action="store_true", help="prepare the data and tokenizer, then exit")
    parser.add_argument("--goodput", metavar="WORKDIR", help="print where WORKDIR's wall-clock time went, then exit")
    cli.add_logging(parser)
    rest, texts = cli.split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(rest)
    cli.parse_logging(args)
    if args.goodput:
        try:
            print(format_account(account(args.goodput)))
        except FileNotFoundError as e:
            sys.exit(f"error: {e}")
        return
    if not args.config:
        parser.error("--config is required (or --goodput WORKDIR)")
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
    workdir = args.workdir or f"runs/{pathlib.Path(args.config).stem}"
    ledger = Ledger(workdir)
    # Registered before JAX's distributed shutdown is, so it runs after it: the process's exit counts.
    atexit.register(ledger.mark, "startup")
    if args.prepare_only:
        ledger.mark("startup")
        load_data(cfg, workdir)
        ledger.mark("data")
        return
    initialize_from_environment()
    cache = use_compile_cache(cfg.train.compile_cache, workdir)
    with CacheCounts() as programs:
        train(cfg, workdir, hooks=hooks, ledger=ledger)
    if cache is not None:
        log.info(f"compilation cache {cache}: {programs.read} programs read back, {programs.compiled} compiled")
    jax.distributed.shutdown()  # waits for every process: the ledger's last mark (at exit) follows the slowest


if __name__ == "__main__":
    main()
