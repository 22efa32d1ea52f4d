"""Tests of the hf extra: marked `hf` (CI installs the extra and runs `pytest -m hf`), skipped,
naming the extra, where its packages are missing."""

import importlib.util

import pytest


def hf_extra(*packages: str):
    """A decorator for tests that need `packages` from the hf extra."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    reason = f"needs the hf extra ({', '.join(packages)}): pip install -e '.[hf]'"

    def needs_hf(test):
        return pytest.mark.hf(pytest.mark.skipif(bool(missing), reason=reason)(test))

    return needs_hf
