"""``update_context`` / ``split_context`` / ``merge_context`` (Flax NNX's protocol for
carrying structural changes out of a hand-written transform, issue 30)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn


class Bar(nn.Module):
    def __init__(self):
        self.x = 1
        self.w = nn.Param(jnp.ones(2))


class Foo(nn.Module):
    def __init__(self):
        self.a = Bar()

    def grow(self):
        self.b = Bar()
        self.a.y = 2


def test_structural_changes_inside_jit_come_back_in_place():
    m1 = Foo()
    w = m1.a.w
    with nn.update_context("t"):
        with nn.split_context("t") as ctx:
            gd, st = ctx.split(m1)

        @jax.jit
        def f(st):
            with nn.merge_context("t", inner=True) as ctx:
                m2 = ctx.merge(gd, st)
            m2.grow()
            m2.a.w.value = m2.a.w.value * 3
            with nn.split_context("t") as ctx:
                return ctx.split(m2)

        gd_out, st_out = f(st)
        with nn.merge_context("t", inner=False) as ctx:
            m3 = ctx.merge(gd_out, st_out)
    assert m3 is m1 and m1.a.w is w  # the caller's objects, updated
    np.testing.assert_allclose(np.asarray(m1.a.w[...]), [3.0, 3.0])
    assert m1.a.y == 2 and m1.b.x == 1 and isinstance(m1.b, Bar)


def test_without_a_tag_and_errors():
    m = Foo()
    with nn.split_context() as ctx:
        gd, st = ctx.split(m)
    with nn.merge_context() as ctx:
        m2 = ctx.merge(gd, st)
    assert m2 is not m and m2.a.w is m.a.w
    with pytest.raises(ValueError, match="inner= must be given"):
        with nn.update_context("u"), nn.merge_context("u"):
            pass
    with pytest.raises(ValueError, match="no update_context"):
        nn.current_update_context("never")

    @nn.update_context("deco")
    def inside():
        return nn.current_update_context("deco").tag

    assert inside() == "deco"
