"""Writes docs/configuration.md, the reference of every config field, from the typed sections of a
run and of the server: `python -m jaxllm.reference > docs/configuration.md`. A test regenerates it
and compares, so the page cannot drift from the code. It lives above `jaxllm.serve` because it
needs the server's `ServeConfig`; the page's machinery is `jaxllm.config.reference`."""

from __future__ import annotations

from jaxllm.config import RunConfig
from jaxllm.config.reference import page as reference_page
from jaxllm.serve.settings import ServeConfig

COMMAND = "python -m jaxllm.reference > docs/configuration.md"


def page() -> str:
    return reference_page([RunConfig, ServeConfig], COMMAND)


if __name__ == "__main__":
    print(page(), end="")
