"""Shared pieces of the op test bases (ragged_dot, gated_linear_unit, norms, cross-entropy,
quantized_dot_general): tolerances per dtype, fresh random inputs, float64 comparison.

Every implementation's test class subclasses its op's base and sets ``IMPL``. Pallas
implementations run in interpret mode on the CPU, where Pallas fills uninitialized output
and scratch buffers with NaN (floats) or the integer minimum: the "poisoned buffers" every
kernel run here starts from, so an element a kernel forgets to write shows up as NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# max |actual - reference| <= TOL[dtype] * max(1, max |reference|): float32 accumulates
# in float32, the 16-bit types round their output (bf16 keeps 8 bits, fp16 11)
TOL = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3, "float8_e4m3fn": 6e-2, "int8": 0.0}
# gradients go through one more rounded dot (and, for 16-bit types, a rounded cotangent)
GRAD_TOL = {"float32": 5e-5, "bfloat16": 3e-2, "float16": 4e-3}

PALLAS = ("pallas_triton", "pallas_mosaic_gpu")


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A generator on a fresh seed (reported in failure messages)."""
    seed = int(np.random.SeedSequence().entropy % (2**31))
    return np.random.default_rng(seed), seed


def randn(rng: np.random.Generator, shape, dtype, scale: float = 1.0):
    """``(jax_array, float64 copy of exactly the values given to the kernel)``."""
    x = jnp.asarray(rng.normal(size=shape) * scale, dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def jit_value_and_vjp(fn):
    """``step(args, cotangent) -> (fn(*args), vjp(cotangent))`` as one jitted function (a
    rerun is the compiled program run again; eager interpret mode is several times slower)."""
    import jax

    @jax.jit
    def step(args, ct):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(ct)

    return step


def assert_close(actual, reference, dtype: str, what: str, seed: int, tol: dict | None = None) -> None:
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    r = np.asarray(reference, np.float64)
    assert a.shape == r.shape, f"{what}: shape {a.shape} != reference {r.shape} (seed {seed})"
    assert np.all(np.isfinite(a)), f"{what}: non-finite values (a poisoned element left unwritten?) (seed {seed})"
    bound = (tol or TOL)[dtype] * max(1.0, float(np.max(np.abs(r), initial=0.0)))
    err = float(np.max(np.abs(a - r), initial=0.0))
    assert err <= bound, f"{what} [{dtype}]: max error {err:.3g} > {bound:.3g} (seed {seed})"


def assert_bitwise_equal(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), f"{what}: a rerun on the same inputs differs bitwise"


def generate_cases(metafunc) -> None:
    """``pytest_generate_tests`` of the op test modules: a test taking ``case`` runs once per
    entry of its class's ``CASES`` (``(dtype, variant)``) that the class's ``DTYPES`` allows;
    cases its ``is_fast`` rejects carry the ``slow`` mark (``nox -s tests_slow`` runs them)."""
    import pytest

    if "case" not in metafunc.fixturenames or metafunc.cls is None:
        return
    cls = metafunc.cls
    params = [
        pytest.param(case, id="-".join(str(c) for c in case), marks=() if cls.is_fast(case) else (pytest.mark.slow,))
        for case in cls.CASES
        if case[0] in cls.DTYPES
    ]
    metafunc.parametrize("case", params)
