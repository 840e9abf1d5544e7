"""Every kernels test gets its own empty autotune cache directory and a fresh in-process cache.

tests/conftest.py already keeps the whole session off the user's ``~/.cache/cairn/kernels``;
here, in addition, no test sees another test's autotune results (safe under pytest-xdist).
"""

import sys
from pathlib import Path

import jax
import pytest

from cairn.kernels import _cache


def pytest_configure(config: pytest.Config) -> None:
    """On a GPU, float32 matmuls default to TF32 (about 3 decimal digits) in XLA and in Pallas
    Triton kernels alike; the tests' float32 tolerances are float32's, so there they run at
    full float32 precision (a user gets the same with ``jax_default_matmul_precision``)."""
    if jax.default_backend() == "gpu":
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.cpu_dispatch`` tests pin the CPU's default dispatch (xla by default,
    Pallas only when named, interpreted); on a GPU, dispatch prefers the Pallas kernels."""
    if jax.default_backend() == "cpu":
        return
    skip = pytest.mark.skip(reason="pins the CPU's default dispatch; a GPU prefers its own kernels")
    for item in items:
        if item.get_closest_marker("cpu_dispatch") is not None:
            item.add_marker(skip)


# this folder goes on sys.path so test modules can import their helpers under importlib mode
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def isolated_kernel_cache(tmp_path, monkeypatch):
    """``$CAIRN_KERNELS_CACHE_DIR`` points at a fresh temporary directory for the test."""
    monkeypatch.setenv("CAIRN_KERNELS_CACHE_DIR", str(tmp_path / "kernels-cache"))
    _cache.clear()
    yield tmp_path / "kernels-cache"
    _cache.clear()
