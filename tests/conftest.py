"""Shared test settings: under CI, hypothesis draws the same examples every run, so a
result never depends on which random examples a run happened to draw (locally, every run
still explores new ones). The `run_on_cpu_devices` fixture runs a script on N virtual CPU
devices in a fresh interpreter. The whole session (xdist workers and the subprocesses
tests start included) uses a temporary cairn.kernels cache, never the user's."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
from hypothesis import settings

# tests/_cairn_testlib.py: helpers the tests of several packages share
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_SESSION_CACHE: list[str] = []


# the caches a test session would otherwise write under the user's home, each pointed at a
# folder of the session's temporary directory
_CACHE_VARIABLES = {
    "CAIRN_KERNELS_CACHE_DIR": "cairn-kernels",  # the autotune cache and the lm recipe's choices
    "XDG_CACHE_HOME": "xdg-cache",  # anything else that follows the XDG convention
    "MPLCONFIGDIR": "matplotlib",  # matplotlib's font cache (the main job's plots)
    "HF_HOME": "huggingface",  # tokenizers / hub caches, should anything ask for one
    "CUDA_CACHE_PATH": "cuda-compute-cache",  # the CUDA driver's JIT cache (~/.nv) on a GPU host
    "TRITON_CACHE_DIR": "triton",  # Triton's kernel cache (~/.triton) on a GPU host
}


def pytest_configure(config: pytest.Config) -> None:
    """Point every cache a test can reach at a fresh temporary directory for this session.

    The autotune cache (and the lm recipe's choice file beside it) would otherwise be the
    user's ``~/.cache/cairn/kernels``, shared with benchmarks and training runs, and
    matplotlib would write its font cache under ``~/.cache`` / ``~/.config``. Set in the
    controller before xdist starts its workers, so workers and subprocesses inherit it; a
    worker keeps the controller's directory. tests/kernels isolates each test further.
    """
    if hasattr(config, "workerinput"):
        return
    root = tempfile.mkdtemp(prefix="cairn-tests-cache-")
    _SESSION_CACHE.append(root)
    for name, folder in _CACHE_VARIABLES.items():
        os.environ[name] = os.path.join(root, folder)
        os.makedirs(os.environ[name], exist_ok=True)


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """`nox -s tests` collects the packages' doctests in the same run (``--doctest-modules``):
    under tests/, only test modules and conftests are collected then, never a helper
    (fixture writers, worker scripts that act when imported) as a doctest module."""
    if (config.getoption("doctestmodules", False) and collection_path.suffix == ".py"
            and not collection_path.name.startswith("test_") and collection_path.name != "conftest.py"):
        return True
    return None


def pytest_unconfigure(config: pytest.Config) -> None:
    while _SESSION_CACHE:
        shutil.rmtree(_SESSION_CACHE.pop(), ignore_errors=True)


@pytest.fixture
def run_on_cpu_devices():
    """``run(code, *args, devices=8)``: ``python -c code *args`` in a fresh interpreter with
    ``devices`` virtual CPU devices (the XLA flag must be set before jax is imported)."""

    def run(code: str, *args: str, devices: int = 8, timeout: float = 600) -> subprocess.CompletedProcess:
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              env=env, timeout=timeout)

    return run
