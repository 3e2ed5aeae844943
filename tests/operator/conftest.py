"""Fixtures of the operator tests; helpers live in op_testlib.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from op_testlib import make_settings  # noqa: E402


@pytest.fixture
def settings():
    return make_settings()
