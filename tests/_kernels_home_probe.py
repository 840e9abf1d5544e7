"""Not collected by default: tests/kernels/test_kernels_cache.py runs this file in a pytest
subprocess whose ``$HOME`` is an empty temporary directory. Like any test could, it
autotunes and saves through the *default* cache location, in the test process and in a
subprocess it starts; the caller then checks that nothing appeared under ``$HOME``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp

import cairn.kernels as ck
from cairn.kernels import _cache

_TUNE_AND_SAVE = """
import jax, jax.numpy as jnp
import cairn.kernels as ck
q = jax.ShapeDtypeStruct((1, 16, 1, 8), jnp.float32)
print(ck.autotune(lambda q: ck.dot_product_attention(q, q, q), q, iterations=1).save())
"""


def test_tune_and_save_in_the_test_process():
    q = jax.ShapeDtypeStruct((1, 16, 1, 8), jnp.float32)
    path = ck.autotune(lambda q: ck.dot_product_attention(q, q, q), q, iterations=1).save()
    assert path.is_file() and path.parent == _cache.cache_dir()
    _report(path)


def test_tune_and_save_in_a_subprocess():
    out = subprocess.run([sys.executable, "-c", _TUNE_AND_SAVE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    _report(out.stdout.strip())


def _report(path: object) -> None:
    """Append where a cache file was written to the caller's ``$CAIRN_PROBE_REPORT``."""
    with open(os.environ["CAIRN_PROBE_REPORT"], "a") as f:
        f.write(f"{path}\n")
