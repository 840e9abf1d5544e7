"""Every kernels test gets its own empty autotune cache directory and a fresh in-process cache.

tests/conftest.py already keeps the whole session off the user's ``~/.cache/cairn/kernels``;
here, in addition, no test sees another test's autotune results (safe under pytest-xdist).
"""

import sys
from pathlib import Path

import pytest

from cairn.kernels import _cache

# this folder goes on sys.path so test modules can import their helpers under importlib mode
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def isolated_kernel_cache(tmp_path, monkeypatch):
    """``$CAIRN_KERNELS_CACHE_DIR`` points at a fresh temporary directory for the test."""
    monkeypatch.setenv("CAIRN_KERNELS_CACHE_DIR", str(tmp_path / "kernels-cache"))
    _cache.clear()
    yield tmp_path / "kernels-cache"
    _cache.clear()
