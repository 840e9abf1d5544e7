"""Flax NNX's own scan-over-layers and view snippets, run unmodified except for the
import line, each also run with the installed Flax and the numbers compared.

Sources (flax 0.12.8): the docstring of ``nnx.scan`` (flax/nnx/transforms/iteration.py:
blocks built with ``nnx.split_rngs`` + ``nnx.vmap``, applied with ``nnx.scan`` and
``nnx.Carry``) and the docstring of ``nnx.view`` (flax/nnx/module.py).

Both libraries split the same keys and run the same layers, so parameters agree to
float32 rounding and the scanned output to 1e-5 (the dropout masks draw the same keys).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax.nnx")

FLAX_IMPORT = "from flax import nnx"
CAIRN_IMPORT = "from cairn import nn as nnx"


def run_both(src: str) -> tuple[dict, dict]:
    """Run ``src`` with Flax NNX and with cairn.nn (import line changed only)."""
    assert FLAX_IMPORT in src
    ref: dict = {}
    exec(compile(src, "<flax snippet>", "exec"), ref)
    ours: dict = {}
    exec(compile(src.replace(FLAX_IMPORT, CAIRN_IMPORT), "<cairn snippet>", "exec"), ours)
    assert ours["nnx"].__name__ == "cairn.nn"
    return ref, ours


# the nnx.scan docstring example (print calls kept as they are)
SCAN_OVER_LAYERS = '''
import jax
import jax.numpy as jnp
from flax import nnx

class Block(nnx.Module):
  def __init__(self, input_dim, features, *, rngs):
    self.linear = nnx.Linear(input_dim, features, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x: jax.Array):
    x = self.linear(x)
    x = self.dropout(x)
    x = jax.nn.relu(x)
    return x

class Model(nnx.Module):
  def __init__(self, num_layers, features, *, rngs):
    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs: nnx.Rngs):
      return Block(features, features, rngs=rngs)

    self.blocks = create_block(rngs)
    self.num_layers = num_layers

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, model):
      x = model(x)
      return x

    return forward(x, self.blocks)

model = Model(2, 4, rngs=nnx.Rngs(0))
_, params, _ = nnx.split(model, nnx.Param, ...)
print(params)  # kernel of shape: (2, 4, 4)

x = jnp.arange(5 * 4, dtype="float32").reshape((5, 4))
y = model(x)
print(y.shape)  # shape: (5, 4)
'''


@pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
def test_scan_over_layers_matches_flax(capsys):
    ref, ours = run_both(SCAN_OVER_LAYERS)
    capsys.readouterr()
    assert ours["model"].blocks.linear.kernel.shape == (2, 4, 4)
    np.testing.assert_allclose(
        np.asarray(ref["model"].blocks.linear.kernel[...]),
        np.asarray(ours["model"].blocks.linear.kernel[...]),
        rtol=1e-6, atol=1e-6,
    )
    assert ours["y"].shape == (5, 4)
    np.testing.assert_allclose(np.asarray(ref["y"]), np.asarray(ours["y"]), rtol=1e-5, atol=1e-5)


# the nnx.view docstring example
VIEW = '''
from flax import nnx

class Block(nnx.Module):
  def __init__(self, din, dout, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(din, dout, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)
    self.batch_norm = nnx.BatchNorm(10, rngs=rngs)

block = Block(2, 5, rngs=nnx.Rngs(0))
before = (block.dropout.deterministic, block.batch_norm.use_running_average)
new_block = nnx.view(block, deterministic=True, use_running_average=True)
after = (new_block.dropout.deterministic, new_block.batch_norm.use_running_average)

block = Block(2, 5, rngs=nnx.Rngs(0))
new_block = nnx.view(block, only=nnx.Dropout, deterministic=True)
# Only the dropout will be modified
only = (new_block.dropout.deterministic, new_block.batch_norm.use_running_average)
'''


def test_view_matches_flax():
    ref, ours = run_both(VIEW)
    for name in ("before", "after", "only"):
        assert ref[name] == ours[name], name
    assert ours["after"] == (True, True)
    assert ours["new_block"].linear.kernel is ours["block"].linear.kernel
