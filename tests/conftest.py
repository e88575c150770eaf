"""Shared pytest setup.

* Puts the repository root on ``sys.path`` so tests (and the rank processes, which inherit
  or receive ``sys.path``) can ``import examples.llama`` and ``import fsdp2`` without an
  install.
* Shuts the persistent rank pools of ``_launcher`` down at the end of the session.
* ``run_ranks`` fixture: the launcher function, for tests that prefer fixtures.

If every multi-rank test fails at once, run ``pytest tests/test_launcher.py`` first: a
broken launcher (process start, gloo rendezvous) shows up there with the least noise.
"""

from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
for _path in (REPO_ROOT, TESTS_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import _launcher  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _launcher.shutdown_pools()


@pytest.fixture
def run_ranks():
    """The multi-process launcher, see ``tests/_launcher.py``."""
    return _launcher.run_ranks
