"""The one base class of errors that the user can fix, and the one place a CLI turns them into a
message instead of a traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


class JaxllmError(ValueError):
    """Bad input (a config, data, a tokenizer, a checkpoint): the message names the problem and the fix."""


def exit_on_error(main: Callable) -> Callable:
    """Wraps a CLI entry point: a JaxllmError ends the process with `error: <message>` and status 1."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except JaxllmError as e:
            sys.exit(f"error: {e}")

    return run
