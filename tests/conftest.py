"""Shared test settings: under CI, hypothesis draws the same examples every run, so a
result never depends on which random examples a run happened to draw (locally, every run
still explores new ones). The `run_on_cpu_devices` fixture runs a script on N virtual CPU
devices in a fresh interpreter."""

import os
import subprocess
import sys

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def run_on_cpu_devices():
    """``run(code, *args, devices=8)``: ``python -c code *args`` in a fresh interpreter with
    ``devices`` virtual CPU devices (the XLA flag must be set before jax is imported)."""

    def run(code: str, *args: str, devices: int = 8, timeout: float = 600) -> subprocess.CompletedProcess:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                   JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              env=env, timeout=timeout)

    return run
