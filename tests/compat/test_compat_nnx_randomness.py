"""Flax NNX's own randomness / transforms / view snippets, run unmodified except for the
import line (``from flax import nnx`` -> ``from cairn import nn as nnx``), each also run
with the installed Flax and the numbers compared.

Sources (google/flax, flax 0.12.8): docs_nnx/guides/randomness.md (the first cell, the
jax.random shorthand cell, the "Split random state" cells, the "Reseeding" cell), the
docstring of ``nnx.scan`` (flax/nnx/transforms/iteration.py: scan over layers built
with ``split_rngs`` + ``vmap``) and the docstring of ``nnx.view`` (flax/nnx/module.py).

Where both libraries draw the same keys and do the same math (parameter init, the
``rngs.normal`` shorthands, linear layers) the numbers must agree to float32 rounding
(rtol 1e-6); the dropout masks are compared too, since both keep
``bernoulli(key, 1 - rate)`` of the same key.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax.nnx")

FLAX_IMPORT = "from flax import nnx"
CAIRN_IMPORT = "from cairn import nn as nnx"


def run_both(src: str) -> tuple[dict, dict]:
    """Run ``src`` once with Flax NNX and once with cairn.nn (only the import line
    changed); return both namespaces."""
    assert FLAX_IMPORT in src
    ref: dict = {}
    exec(compile(src, "<flax snippet>", "exec"), ref)
    ours: dict = {}
    exec(compile(src.replace(FLAX_IMPORT, CAIRN_IMPORT), "<cairn snippet>", "exec"), ours)
    assert ours["nnx"].__name__ == "cairn.nn"
    return ref, ours


def close(a, b, rtol=1e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# docs_nnx/guides/randomness.md, first cell
RANDOMNESS_INTRO = '''
import jax
from flax import nnx
import jax.numpy as jnp

class Model(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(20, 10, rngs=rngs)
    self.drop = nnx.Dropout(0.1)

  def __call__(self, x, *, rngs):
    return nnx.relu(self.drop(self.linear(x), rngs=rngs))

rngs = nnx.Rngs(0)
model = Model(rngs=rngs)  # pass rngs to initialize parameters
x = rngs.normal((32, 20))  # convenient jax.random methods
y = model(x, rngs=rngs)  # pass rngs for dropout masks
'''


def test_randomness_intro_matches_flax():
    ref, ours = run_both(RANDOMNESS_INTRO)
    close(ref["x"], ours["x"])
    close(ref["model"].linear.kernel[...], ours["model"].linear.kernel[...])
    close(ref["y"], ours["y"], rtol=1e-5, atol=1e-5)
    assert int(ref["rngs"].default.count[...]) == int(ours["rngs"].default.count[...])


# docs_nnx/guides/randomness.md, "jax.random shorthand methods"
SHORTHAND = '''
import jax
from flax import nnx
rngs = nnx.Rngs(0, params=1)

# using jax.random
z1 = jax.random.normal(rngs(), (2, 3))
z2 = jax.random.bernoulli(rngs.params(), 0.5, (10,))

# shorthand methods
z1 = rngs.normal((2, 3))                 # generates key from rngs.default
z2 = rngs.params.bernoulli(0.5, (10,)) # generates key from rngs.params
'''


def test_random_shorthands_match_flax_bit_for_bit():
    ref, ours = run_both(SHORTHAND)
    np.testing.assert_array_equal(np.asarray(ref["z1"]), np.asarray(ours["z1"]))
    np.testing.assert_array_equal(np.asarray(ref["z2"]), np.asarray(ours["z2"]))


# docs_nnx/guides/randomness.md, "Split random state" (explicit rngs through nnx.vmap)
SPLIT_EXPLICIT = '''
import jax
from flax import nnx
import jax.numpy as jnp

class Model(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(20, 10, rngs=rngs)
    self.drop = nnx.Dropout(0.1)

  def __call__(self, x, rngs):
    return nnx.relu(self.drop(self.linear(x), rngs=rngs))

model =  Model(rngs=nnx.Rngs(0))

@nnx.vmap(in_axes=(None, 0, 0), out_axes=0)
def model_forward(model, x, rngs):
  return model(x, rngs=rngs)

dropout_rngs = nnx.Rngs(1)
split_rngs = dropout_rngs.split(5)
(dropout_rngs, split_rngs)

out = model_forward(model, jnp.ones((5, 20)), split_rngs)
'''


def test_split_rngs_through_vmap_matches_flax():
    ref, ours = run_both(SPLIT_EXPLICIT)
    assert ours["out"].shape == ref["out"].shape == (5, 10)
    assert ours["split_rngs"].default.key.shape == (5,)
    close(ref["out"], ours["out"], rtol=1e-5, atol=1e-5)


# docs_nnx/guides/randomness.md, "Implicit Random State" + "Reseeding"
RESEED = '''
import jax
from flax import nnx
import jax.numpy as jnp

class Model(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(20, 10, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return nnx.relu(self.drop(self.linear(x)))

model = Model(nnx.Rngs(params=0, dropout=1))
x = jnp.ones((1, 20))

y1 = model(x)
y2 = model(x)

nnx.reseed(model, dropout=1) # reset dropout RngState
y3 = model(x)

assert not jnp.allclose(y1, y2) # different
assert jnp.allclose(y1, y3)     # same
'''


def test_reseed_matches_flax():
    ref, ours = run_both(RESEED)
    for name in ("y1", "y2", "y3"):
        close(ref[name], ours[name], rtol=1e-5, atol=1e-5)
