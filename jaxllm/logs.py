"""jaxllm's one logger: every module says what it does through `logging.getLogger(__name__)`, a
child of the `jaxllm` logger, whose handler writes plain lines to stdout (warnings and errors
prefixed `warning: ` and `error: `), above any progress bar (tqdm's external write mode), from
process 0 of a job only unless `--log-all-processes`, or as JSON lines (`--log-json`) for a log
collector. A command's own result (a plan, a report, a generated page) is printed, not logged.

Before JAX's distributed start-up the process index comes from the launcher's environment
(`JAX_PROCESS_ID`, `SLURM_PROCID`); after it, from JAX (`set_process`).
"""

from __future__ import annotations

import json
import logging
import os
import sys

from tqdm import tqdm

ROOT = "jaxllm"
PREFIX = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}
_settings = {"all_processes": False, "json": False, "process": None}


def get(name: str) -> logging.Logger:
    """The logger of module `name` (`__name__`): a child of jaxllm's, a command run with
    `python -m` included (its `__name__` is `__main__`; its spec has the module's name)."""
    if name == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        name = spec.name if spec is not None else ROOT
    return logging.getLogger(name)


def process_index() -> int:
    """This process's index in its job: JAX's once known, else the launcher's, else 0."""
    if _settings["process"] is not None:
        return _settings["process"]
    for variable in ("JAX_PROCESS_ID", "SLURM_PROCID"):
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return 0


def set_process(index: int) -> None:
    _settings["process"] = index


def configure(all_processes: bool = False, json_lines: bool = False) -> None:
    """Which processes log (all, or process 0 only) and in which form (plain or JSON lines)."""
    _settings.update(all_processes=all_processes, json=json_lines)


class _Lines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        error = self.formatException(record.exc_info) if record.exc_info else None
        if _settings["json"]:
            line = {"time": round(record.created, 3), "level": record.levelname.lower(), "process": process_index(),
                    "logger": record.name, "message": message}  # fmt: skip
            return json.dumps(line | ({"exception": error} if error else {}))
        return PREFIX.get(record.levelno, "") + message + (f"\n{error}" if error else "")


class _Stdout(logging.Handler):
    """To whatever `sys.stdout` is when a record comes (a test's capture included), above tqdm's bars."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (_settings["all_processes"] or process_index() == 0) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        # A record is one write of its whole line, after emptying the buffer: on a pipe that
        # processes share, another process's write cannot split a line of up to 4 KiB. What others
        # write in pieces still can: a local launch relays its workers' lines (`launch.Relay`).
        try:
            line = self.format(record) + "\n"
            with tqdm.external_write_mode(file=sys.stdout):
                sys.stdout.flush()
                sys.stdout.write(line)
                sys.stdout.flush()
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


def _install() -> None:
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stdout) for h in logger.handlers):
        handler = _Stdout()
        handler.setFormatter(_Lines())
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # its lines are written once, here


_install()
