"""Fixtures shared by every test module."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The tests run from a plain checkout too, without `pip install -e .`.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kernelgen import env  # noqa: E402  (needs the path above)

_SWITCHES = ("KERNELGEN_NO_COMPILE", "KERNELGEN_ALWAYS_COMPILE", "KERNELGEN_DUMP_SOURCES",
             "KERNELGEN_DEBUG", "KERNELGEN_AUTOTUNE")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty cache directory for this test, with every KERNELGEN_* switch off."""
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    for name in _SWITCHES:
        monkeypatch.delenv(name, raising=False)
    env.reload_settings()
    yield tmp_path / "cache"
    monkeypatch.undo()
    env.reload_settings()
