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


class Counting(nn.Module):
    def __init__(self):
        self.count = nn.BatchStat(jnp.zeros((), jnp.int32))
        self.w = nn.Param(jnp.arange(3.0))

    def __call__(self, x):
        self.count.value += 1
        return x * self.w[...]

    def bump(self, k):
        self.count.value += k
        return k


def test_call_on_a_pure_pair_inside_jit():
    m = Counting()
    pure: nn.PureState[Counting] = nn.split(m)

    @jax.jit
    def step(pure, x):
        return nn.call(pure)(x)

    y, pure = step(pure, jnp.ones(3))
    y, pure = step(pure, jnp.ones(3))
    np.testing.assert_allclose(np.asarray(y), [0.0, 1.0, 2.0])
    assert int(m.count.value) == 0  # the call ran on a copy
    assert int(nn.merge(*pure).count.value) == 2
    both = nn.split({"a": Counting(), "b": Counting()})
    k, both = nn.call(both)["b"].bump(5)
    merged = nn.merge(*both)
    assert k == 5 and int(merged["b"].count.value) == 5 and int(merged["a"].count.value) == 0
    with pytest.raises(TypeError, match="expected the \\(graphdef, state\\) tuple"):
        nn.call(m)
