"""What the suite needs from the machine, and the one rule for when it is missing: fail under CI, skip elsewhere.

CI runs ``scripts/test.sh`` with ``CI=true``. There a missing etcd, ``ip`` or network namespaces, or jax is a
broken machine, and a suite that skips what it cannot run would pass without testing it: every such test
fails instead, saying what is missing and how to get it. On a developer's machine the same tests skip, each
saying why, so the rest of the suite still runs.

Usage::

    if shutil.which("etcd") is None:
        require("etcd", "no `etcd` on PATH; install Debian's etcd-server (apt-get install -y etcd-server)")
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import pytest

CI_ENV = "CI"
CI_VALUES = ("true", "1", "yes")
"""Values of $CI that mean "running in CI" (compared without case), as scripts/test.sh reads them too."""


def in_ci() -> bool:
    """Whether the suite runs in CI (``CI=true``), where nothing it needs may be missing."""
    return os.environ.get(CI_ENV, "").strip().lower() in CI_VALUES


def require(what: str, reason: str) -> NoReturn:
    """Ends the calling test because ``what`` is missing: a failure under ``CI=true``, a skip otherwise.

    ``reason`` says why ``what`` cannot be had here and how to install it. Called at a module's top level, it
    fails or skips the whole module.
    """
    message = f"missing {what}: {reason}"
    if in_ci():
        pytest.fail(f"{message} ({CI_ENV}=true: a missing requirement fails the suite instead of skipping)",
                    pytrace=False)
    pytest.skip(message, allow_module_level=True)


JAX04_PYTHON_ENV = "IFRT_TEST_JAX04_PYTHON"
"""A Python with jax 0.4.30 (scripts/test.sh makes .venv-jax04): the older of XLA's coordination layouts."""


def jax04_python() -> str:
    """The interpreter with jax 0.4.30 (``JAX04_PYTHON_ENV``), or ``require``'s failure or skip."""
    python = os.environ.get(JAX04_PYTHON_ENV)
    if not python:
        require("jax 0.4.x", f"set {JAX04_PYTHON_ENV} to a Python with jax 0.4.30; scripts/test.sh makes one in "
                ".venv-jax04")
    return python


def jax_python(jaxlib: str) -> str:
    """The interpreter whose jaxlib speaks one of XLA's coordination layouts: this one for "0.10", ``jax04_python()``
    for "0.4.30"."""
    return sys.executable if jaxlib == "0.10" else jax04_python()
