"""Gradients of every cairn.nn layer under ``jax.jit(jax.grad(...))`` against finite
differences.

Each case builds a layer with float64 parameters inside ``jax.enable_x64(True)`` (so the
flag does not leak into other tests), takes the scalar ``f(params, x) = sum(w * layer(x))``
(``w`` a fixed non-constant weight, so every output element counts differently) and
compares the jitted reverse-mode directional derivative ``<grad f, d>`` with the central
difference ``(f(p + h d) - f(p - h d)) / 2h`` (``f`` jitted as well) on three random
directions ``d`` over the parameters and the (float) inputs together.

Tolerance: float64, ``h = 1e-6``: the central difference is exact to O(h^2 f''') ~ 1e-12
plus rounding ~ 1e-16 / h ~ 1e-10 relative, so ``rtol = 1e-6`` (with ``atol = 1e-8`` for
directions that happen to be nearly orthogonal to the gradient) leaves a wide margin and
still catches any wrong derivative (those are off by O(1)). Max/min pooling and ReLU-like
functions are piecewise linear: random inputs sit away from ties and kinks by far more
than ``h``.

Before the pooling fix, every pooling case here failed with ``ValueError: Linearization
failed`` (the reduce-window init value was a ``jnp`` array, a tracer under ``jit``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn

F64 = jnp.float64
H = 1e-6
RTOL, ATOL = 1e-6, 1e-8


def _x(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape)


@dataclass(frozen=True)
class Case:
    """``make()`` builds the layer (float64 params), ``inputs`` are NumPy float64 arrays
    (or int arrays, not differentiated), ``call(layer, *inputs)`` returns any pytree of
    float outputs."""

    make: Callable[[], nn.Module | None]
    inputs: tuple
    call: Callable = staticmethod(lambda m, *xs: m(*xs))


def _rngs():
    return nn.Rngs(0, dropout=1)


def _cell_call(m, x):
    carry = m.initialize_carry(x.shape)
    carry = jax.tree.map(lambda c: c + 0.3, carry)  # a non-zero carry exercises U too
    return m(carry, x)


LAYER_CASES = {
    "Linear": Case(lambda: nn.Linear(3, 4, param_dtype=F64, rngs=_rngs()), (_x(2, 3),)),
    "LinearGeneral": Case(
        lambda: nn.LinearGeneral(4, (2, 3), param_dtype=F64, rngs=_rngs()), (_x(2, 5, 4),)
    ),
    "Einsum": Case(
        lambda: nn.Einsum("btd,dnh->btnh", (4, 2, 3), (2, 3), param_dtype=F64, rngs=_rngs()),
        (_x(2, 3, 4),),
    ),
    "Conv": Case(
        lambda: nn.Conv(2, 3, (3, 3), strides=(2, 1), param_dtype=F64, rngs=_rngs()),
        (_x(2, 5, 5, 2),),
    ),
    "Conv-grouped-dilated-causal": Case(
        lambda: nn.Conv(
            4, 2, 3, padding="CAUSAL", kernel_dilation=2, feature_group_count=2,
            param_dtype=F64, rngs=_rngs(),
        ),
        (_x(2, 7, 4),),
    ),
    "ConvTranspose": Case(
        lambda: nn.ConvTranspose(2, 3, (3, 3), strides=(2, 2), param_dtype=F64, rngs=_rngs()),
        (_x(1, 3, 3, 2),),
    ),
    "Embed": Case(
        lambda: nn.Embed(7, 3, param_dtype=F64, rngs=_rngs()), (np.array([[0, 3], [6, 3]]),)
    ),
    "Embed.attend": Case(
        lambda: nn.Embed(7, 3, param_dtype=F64, rngs=_rngs()), (_x(2, 3),),
        lambda m, q: m.attend(q),
    ),
    "LayerNorm": Case(lambda: nn.LayerNorm(4, param_dtype=F64, rngs=_rngs()), (_x(3, 4),)),
    "RMSNorm": Case(lambda: nn.RMSNorm(4, param_dtype=F64, rngs=_rngs()), (_x(3, 4),)),
    "GroupNorm": Case(
        lambda: nn.GroupNorm(4, num_groups=2, param_dtype=F64, rngs=_rngs()), (_x(2, 3, 4),)
    ),
    "InstanceNorm": Case(
        lambda: nn.InstanceNorm(3, param_dtype=F64, rngs=_rngs()), (_x(2, 4, 3),)
    ),
    "BatchNorm-train": Case(
        lambda: nn.BatchNorm(3, param_dtype=F64, rngs=_rngs()), (_x(5, 3),),
        lambda m, x: m(x, use_running_average=False),
    ),
    "BatchNorm-eval": Case(
        lambda: nn.BatchNorm(3, param_dtype=F64, rngs=_rngs()), (_x(5, 3),),
        lambda m, x: m(x, use_running_average=True),
    ),
    "Dropout": Case(lambda: nn.Dropout(0.3, rngs=_rngs()), (_x(4, 5),)),
    "MultiHeadAttention": Case(
        lambda: nn.MultiHeadAttention(
            2, 4, qkv_features=4, param_dtype=F64, deterministic=True, rngs=_rngs()
        ),
        (_x(2, 3, 4),),
        lambda m, x: m(x, mask=nn.make_causal_mask(jnp.ones((2, 3)))),
    ),
    "MultiHeadAttention-gqa-rope-qknorm": Case(
        lambda: nn.MultiHeadAttention(
            4, 8, num_kv_heads=2, use_rope=True, normalize_qk=True, param_dtype=F64,
            deterministic=True, rngs=_rngs(),
        ),
        (_x(1, 3, 8), _x(1, 4, 8, seed=2)),
        lambda m, q, kv: m(q, kv),
    ),
    "LSTMCell": Case(lambda: nn.LSTMCell(3, 4, param_dtype=F64, rngs=_rngs()), (_x(2, 3),), _cell_call),
    "GRUCell": Case(lambda: nn.GRUCell(3, 4, param_dtype=F64, rngs=_rngs()), (_x(2, 3),), _cell_call),
    "SimpleCell": Case(
        lambda: nn.SimpleCell(3, 4, param_dtype=F64, rngs=_rngs()), (_x(2, 3),), _cell_call
    ),
    "RNN(LSTMCell)": Case(
        lambda: nn.RNN(nn.LSTMCell(3, 4, param_dtype=F64, rngs=_rngs())), (_x(2, 5, 3),)
    ),
    "LoRA": Case(
        lambda: nn.LoRA(
            3, 2, 4, alpha=4.0, param_dtype=F64, b_initializer=nn.initializers.normal(0.5),
            rngs=_rngs(),
        ),
        (_x(2, 3),),
    ),
    "LoRALinear": Case(
        lambda: nn.LoRALinear(
            3, 4, lora_rank=2, param_dtype=F64, lora_param_dtype=F64,
            b_initializer=nn.initializers.normal(0.5), rngs=_rngs(),
        ),
        (_x(2, 3),),
    ),
    "PReLU": Case(lambda: nn.PReLU(0.2, param_dtype=F64), (_x(3, 4),)),
    "RotaryEmbedding": Case(lambda: nn.RotaryEmbedding(4), (_x(2, 3, 2, 4),)),
    "Sequential(Conv, avg_pool, Linear)": Case(
        lambda: nn.Sequential(
            nn.Conv(1, 2, (3, 3), param_dtype=F64, rngs=_rngs()),
            lambda x: nn.avg_pool(x, (2, 2), (2, 2)),
            lambda x: x.reshape(x.shape[0], -1),
            nn.Linear(8, 2, param_dtype=F64, rngs=_rngs()),
        ),
        (_x(2, 4, 4, 1),),
    ),
}

def _activation(name):
    fn = getattr(nn, name)
    return lambda _, x: fn(x)


FUNCTION_CASES = {
    "avg_pool": Case(lambda: None, (_x(2, 5, 5, 3),), lambda _, x: nn.avg_pool(x, (2, 2), (2, 1))),
    "avg_pool-SAME-exclude-pad": Case(
        lambda: None, (_x(2, 5, 3),),
        lambda _, x: nn.avg_pool(x, (3,), padding="SAME", count_include_pad=False),
    ),
    "max_pool": Case(lambda: None, (_x(2, 5, 5, 3),), lambda _, x: nn.max_pool(x, (2, 2), (2, 2))),
    "max_pool-SAME": Case(
        lambda: None, (_x(5, 5, 3),), lambda _, x: nn.max_pool(x, (3, 3), padding="SAME")
    ),
    "min_pool": Case(lambda: None, (_x(2, 6, 3),), lambda _, x: nn.min_pool(x, (3,), (1,))),
    "pool(lax.add, 0.0)": Case(
        lambda: None, (_x(2, 6, 3),),
        lambda _, x: nn.pool(x, 0.0, jax.lax.add, (2,), None, ((1, 0),)),
    ),
    "dot_product_attention": Case(
        lambda: None, (_x(2, 3, 2, 4), _x(2, 5, 2, 4, seed=2), _x(2, 5, 2, 4, seed=3)),
        lambda _, q, k, v: nn.dot_product_attention(q, k, v),
    ),
    "apply_rotary_embedding": Case(
        lambda: None, (_x(2, 3, 2, 4),), lambda _, x: nn.apply_rotary_embedding(x)
    ),
    **{
        name: Case(lambda: None, (_x(3, 4),), _activation(name))
        for name in [
            "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
            "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp", "mish", "relu", "relu6",
            "selu", "sigmoid", "silu", "soft_sign", "softmax", "softplus", "standardize",
            "swish", "tanh",
        ]
    },
}


def _weights(tree):
    """A fixed, non-constant weight per output element."""
    return jax.tree.map(lambda y: jnp.sin(jnp.arange(y.size, dtype=F64).reshape(y.shape) + 1.0), tree)


def _check_grad(case: Case):
    with jax.enable_x64(True):
        model = case.make()
        if model is not None:
            gd, params, rest = nn.split(model, nn.Param, ...)
        else:
            gd = params = rest = None
        inputs = [jnp.asarray(x) for x in case.inputs]
        diff = [jnp.issubdtype(x.dtype, jnp.floating) for x in inputs]
        fixed = [x for x, d in zip(inputs, diff) if not d]
        xs = [x for x, d in zip(inputs, diff) if d]

        def f(params, xs):
            it_x, it_f = iter(xs), iter(fixed)
            args = [next(it_x) if d else next(it_f) for d in diff]
            m = None if gd is None else nn.merge(gd, params, rest, copy=True)
            out = case.call(m, *args)
            w = _weights(out)
            return sum(jnp.sum(o * wo) for o, wo in zip(jax.tree.leaves(out), jax.tree.leaves(w)))

        primal = (params, xs)
        assert jax.tree.leaves(primal), "nothing to differentiate"
        f_jit = jax.jit(f)
        grads = jax.jit(jax.grad(f, argnums=(0, 1)))(params, xs)
        leaves, treedef = jax.tree.flatten(primal)
        g_leaves = treedef.flatten_up_to(grads)
        rng = np.random.default_rng(7)
        for _ in range(3):
            d = [jnp.asarray(rng.standard_normal(np.shape(x))) for x in leaves]
            plus = treedef.unflatten([x + H * di for x, di in zip(leaves, d)])
            minus = treedef.unflatten([x - H * di for x, di in zip(leaves, d)])
            fd = (float(f_jit(*plus)) - float(f_jit(*minus))) / (2 * H)
            ad = sum(float(jnp.vdot(jnp.asarray(g), di)) for g, di in zip(g_leaves, d))
            np.testing.assert_allclose(ad, fd, rtol=RTOL, atol=ATOL)
        return grads


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("name", sorted(LAYER_CASES))
def test_layer_gradient_under_jit_matches_finite_differences(name):
    grads = _check_grad(LAYER_CASES[name])
    # every parameter gets a gradient (a wrongly detached one would be all zeros)
    for path, g in jax.tree_util.tree_leaves_with_path(grads[0]):
        assert np.any(np.asarray(g) != 0), jax.tree_util.keystr(path)


@pytest.mark.parametrize("name", sorted(FUNCTION_CASES))
def test_function_gradient_under_jit_matches_finite_differences(name):
    _check_grad(FUNCTION_CASES[name])


@pytest.mark.parametrize("fn", [nn.avg_pool, nn.max_pool, nn.min_pool])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pooling_differentiates_under_jit_in_low_precision(fn, dtype):
    """The regression itself, in the dtypes a CNN trains in: ``jit(grad(pool))`` used to
    raise "Linearization failed"; each window's gradient is one (max/min) or 1/4 (mean)
    per covering window."""
    x = jnp.asarray(np.random.default_rng(0).permutation(16).reshape(1, 4, 4, 1), dtype)
    g = jax.jit(jax.grad(lambda x: fn(x, (2, 2), (2, 2)).astype(jnp.float32).sum()))(x)
    expect = 4 * [0.25] if fn is nn.avg_pool else [1.0]
    got = np.asarray(g.astype(jnp.float32)).reshape(2, 2, 2, 2).transpose(0, 2, 1, 3)
    for block in got.reshape(4, 4):
        np.testing.assert_allclose(sorted(block[block != 0]), expect)


def test_pooling_keeps_integer_inputs():
    x = jnp.arange(16, dtype=jnp.int8).reshape(1, 4, 4, 1)
    assert nn.max_pool(x, (2, 2), (2, 2))[0, :, :, 0].tolist() == [[5, 7], [13, 15]]
    assert nn.min_pool(x, (2, 2), (2, 2)).dtype == jnp.int8
    padded = nn.max_pool(x - 100, (2, 2), padding="SAME")
    assert int(padded.min()) == -95  # padding is the int8 minimum, never picked


@pytest.mark.parametrize("graph,graph_updates", [(True, False), (False, False)])
def test_tree_mode_grad_differentiates_every_floating_variable(graph, graph_updates):
    class M(nn.Module):
        def __init__(self):
            self.w = nn.Param(jnp.array(3.0))
            self.s = nn.BatchStat(jnp.array(2.0))
            self.n = nn.BatchStat(jnp.array(4, jnp.int32))  # integers are not differentiated

    m = M()
    f = lambda m: m.w.value * m.s.value + m.n.value  # noqa: E731
    g = nn.grad(f, graph=graph, graph_updates=graph_updates)(m)
    assert isinstance(g, M)  # tree mode: a module-shaped gradient
    assert float(g.w.value) == 2.0 and float(g.s.value) == 3.0 and int(g.n.value) == 0
    # full graph mode keeps Param as the default filter, and an explicit wrt wins everywhere
    gs = nn.grad(f, graph=True, graph_updates=True)(m)
    assert gs.flat_paths() == ["w"]
    g2 = nn.grad(f, wrt=nn.Param, graph=graph, graph_updates=graph_updates)(m)
    assert float(g2.w.value) == 2.0 and float(g2.s.value) == 0.0
