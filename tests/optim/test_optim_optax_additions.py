"""The Optax names added for issue 30, each against a float64 NumPy reference of its
published rule: adan, the optimistic methods, per-example and unit-wise clipping, the
sparsemax losses; plus tree.max/min on empty leaves, MaskedNode, and learning-rate
annotations Optax's own tests can inspect.

Tolerances: float64 (``jax.enable_x64``) rtol 1e-10; float32 rtol 2e-5, atol 1e-6 against
the float64 reference of the same (float32-rounded) inputs. Learning rates are powers of
two: the optimizer state keeps a float learning rate in float32, which rounds 0.1."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cairn.optim as optim

F64 = dict(rtol=1e-10, atol=1e-12)
F32 = dict(rtol=2e-5, atol=1e-6)


def rng(seed=0):
    return np.random.default_rng(seed)


def run(tx, grads, params):
    """The updates ``tx`` emits for a sequence of gradients (params held fixed)."""
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(np.asarray(u, np.float64))
    return out


# --- float64 references of the published rules ---


def np_adan(grads, params, lr, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, eps_root=1e-8, wd=0.0):
    """Xie et al. 2022, Algorithm 1, with beta_paper = 1 - b (so the paper's 1 - beta2 is
    b2), bias-corrected as the authors' code; decoupled weight decay (their no_prox form)."""
    m = v = n = np.zeros_like(params)
    prev = None
    out = []
    for t, g in enumerate(grads, start=1):
        diff = np.zeros_like(g) if prev is None else g - prev
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * diff
        n = b3 * n + (1 - b3) * (g + b2 * diff) ** 2
        mh, vh, nh = m / (1 - b1**t), v / (1 - b2**t), n / (1 - b3**t)
        direction = (mh + b2 * vh) / (np.sqrt(nh + eps_root) + eps)
        out.append(-lr * (direction + wd * params))
        prev = g
    return out


def np_optimistic(directions, lr, alpha, beta):
    """Mokhtari et al. 2019: u_t = -lr ((alpha + beta) d_t - beta d_{t-1}), d_0 = d_1."""
    out, prev = [], None
    for d in directions:
        prev = d if prev is None else prev
        out.append(-lr * ((alpha + beta) * d - beta * prev))
        prev = d
    return out


def np_nesterov_adam_directions(grads, b1=0.9, b2=0.999, eps=1e-8):
    """Adam's direction with Nesterov momentum (Dozat 2016, as Optax's nesterov=True)."""
    m = v = np.zeros_like(grads[0])
    out = []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        out.append(mh / (np.sqrt(v / (1 - b2**t)) + eps))
    return out


def _grads(seed, n=5, shape=(3, 4)):
    g = rng(seed)
    return [g.normal(size=shape) for _ in range(n)], g.normal(size=shape)


@pytest.mark.parametrize("kw", [{}, dict(weight_decay=0.125, eps_root=0.0, b2=0.5)])
def test_adan_matches_the_published_rule(kw):
    grads, params = _grads(1)
    ref_kw = {k.replace("weight_decay", "wd"): v for k, v in kw.items()}
    want = np_adan(grads, params, 0.0625, **ref_kw)
    got = run(optim.adan(0.0625, **kw), [jnp.float32(g) for g in grads], jnp.float32(params))
    ref32 = np_adan([np.float32(g).astype(float) for g in grads], np.float32(params).astype(float),
                    0.0625, **ref_kw)
    for a, b in zip(got, ref32):
        np.testing.assert_allclose(a, b, **F32)
    with jax.enable_x64(True):
        got = run(optim.adan(0.0625, **kw), grads, params)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **F64)


def test_adan_state_fields_and_schedule():
    grads, params = _grads(2, n=3)
    grads, params = [jnp.float32(g) for g in grads], jnp.float32(params)
    tx = optim.adan(optim.constant_schedule(0.05))
    assert set(optim.ScaleByAdanState._fields) == {"m", "v", "n", "g", "t"}
    for a, b in zip(run(tx, grads, params), run(optim.adan(0.05), grads, params)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(ValueError, match="adan: b3"):
        optim.adan(0.1, b3=1.0)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0)])
def test_optimistic_gradient_descent_matches_the_rule(alpha, beta):
    grads, params = _grads(3)
    with jax.enable_x64(True):
        got = run(optim.optimistic_gradient_descent(0.125, alpha, beta), grads, params)
    for a, b in zip(got, np_optimistic(grads, 0.125, alpha, beta)):
        np.testing.assert_allclose(a, b, **F64)


def test_optimistic_adam_v2_and_v1_match_the_rule():
    grads, params = _grads(4)
    dirs = np_nesterov_adam_directions(grads)
    with jax.enable_x64(True):
        got = run(optim.optimistic_adam_v2(0.125, alpha=0.25, beta=0.75), grads, params)
        for a, b in zip(got, np_optimistic(dirs, 0.125, 0.25, 0.75)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
        with pytest.warns(DeprecationWarning, match="optimistic_adam_v2"):
            v1 = optim.optimistic_adam(0.125, optimism=0.25)
        for a, b in zip(run(v1, grads, params), np_optimistic(dirs, 1.0, 0.125, 0.25)):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="no schedule"):
            optim.optimistic_adam(optim.constant_schedule(0.1))


def test_optimistic_solves_a_bilinear_game():
    """min_x max_y x*y: simultaneous gradient descent-ascent spirals out, optimism converges."""
    def run_game(tx):
        params = (jnp.array(1.0), jnp.array(1.0))
        state = tx.init(params)
        for _ in range(300):
            gx, gy = params[1], params[0]
            u, state = tx.update((gx, -gy), state, params)
            params = optim.apply_updates(params, u)
        return float(jnp.hypot(*params))

    assert run_game(optim.optimistic_gradient_descent(0.1)) < 0.5      # from sqrt(2)
    assert run_game(optim.sgd(0.1)) > 2.0


# --- per-example and unit-wise clipping ---


def np_per_example_clip(leaves, c):
    norms = np.sqrt(sum((g.reshape(g.shape[0], -1) ** 2).sum(1) for g in leaves))
    scale = np.where(norms > 0, np.minimum(c / np.where(norms > 0, norms, 1), 1.0), 1.0)
    return [np.tensordot(scale, g, axes=1) for g in leaves], int((scale < 1).sum())


def test_per_example_global_norm_clip_matches_reference_and_optax():
    g = rng(5)
    grads = {"w": g.normal(size=(6, 3, 2)), "b": g.normal(size=(6, 2))}
    grads["w"][2] = 0.0
    grads["b"][2] = 0.0                                 # a zero example: kept, not NaN
    for c in (0.0, 0.5, 2.0, np.inf):
        with jax.enable_x64(True):
            total, n = optim.per_example_global_norm_clip(grads, c)
        (want_b, want_w), want_n = np_per_example_clip([grads["b"], grads["w"]], c)
        np.testing.assert_allclose(total["w"], want_w, **F64)
        np.testing.assert_allclose(total["b"], want_b, **F64)
        assert int(n) == want_n
        theirs = optax.per_example_global_norm_clip(jax.tree.map(jnp.float32, grads), c)
        ours = optim.per_example_global_norm_clip(jax.tree.map(jnp.float32, grads), c)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), ours, theirs)


@pytest.mark.parametrize("uniform", [True, False])
def test_per_example_layer_norm_clip_matches_reference(uniform):
    g = rng(6)
    grads = [g.normal(size=(5, 4)), g.normal(size=(5, 2, 3))]
    c = 1.5
    sizes = [4, 6]
    with jax.enable_x64(True):
        totals, counts = optim.per_example_layer_norm_clip(grads, c, uniform=uniform)
    for leaf, size, total, count in zip(grads, sizes, totals, counts):
        ck = c / np.sqrt(2) if uniform else c * np.sqrt(size / sum(sizes))
        (want,), n = np_per_example_clip([leaf], ck)
        np.testing.assert_allclose(total, want, **F64)
        assert int(count) == n


def test_per_example_clips_need_a_common_batch_axis():
    with pytest.raises(ValueError, match="same batch .* axis 0"):
        optim.per_example_global_norm_clip([jnp.ones((3, 2)), jnp.ones((4, 2))], 1.0)
    with pytest.raises(ValueError, match="per_example_layer_norm_clip"):
        optim.per_example_layer_norm_clip([jnp.ones(())], 1.0)


@pytest.mark.parametrize("shape,axes", [
    ((5,), None), ((1, 5), None), ((4, 3), (0,)), ((2, 4, 3), (0,)),
    ((3, 3, 2, 4), (0, 1, 2)), ((2, 3, 3, 2, 4), (0, 1, 2, 3)),
])
def test_unitwise_norm_units_follow_optax(shape, axes):
    x = rng(7).normal(size=shape)
    want = np.sqrt((x**2).sum(axis=axes, keepdims=True)) if axes else np.full(shape, np.linalg.norm(x))
    with jax.enable_x64(True):
        got = optim.transforms.unitwise_norm(x)
    np.testing.assert_allclose(got, np.broadcast_to(want, shape), **F64)
    np.testing.assert_allclose(optim.transforms.unitwise_norm(jnp.float32(x)),
                               optax.transforms.unitwise_norm(jnp.float32(x)), rtol=1e-6)


def test_unitwise_norm_axis_and_errors():
    x = rng(8).normal(size=(2, 2, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="rank 6 .* pass `axis`"):
        optim.transforms.unitwise_norm(x)
    got = optim.transforms.unitwise_norm(x, axis=(0, 5))
    np.testing.assert_allclose(got, np.broadcast_to(np.sqrt((x**2).sum((0, 5), keepdims=True)),
                                                    x.shape), rtol=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        optim.transforms.unitwise_clip(jnp.ones(3), jnp.ones(2), jnp.ones(3))


def test_unitwise_clip_and_agc_match_the_rule():
    g = rng(9)
    grad, param = g.normal(size=(4, 3)), g.normal(size=(4, 3)) * 0.1
    g_norm = np.sqrt((grad**2).sum(0, keepdims=True))
    max_norm = 0.5 * np.maximum(np.sqrt((param**2).sum(0, keepdims=True)), 1e-3)
    want = np.where(g_norm < max_norm, grad, grad * max_norm / np.maximum(g_norm, 1e-6))
    with jax.enable_x64(True):
        u, _ = optim.adaptive_grad_clip(0.5).update(grad, optim.adaptive_grad_clip(0.5).init(param), param)
        clip = optim.transforms.unitwise_clip(np.broadcast_to(g_norm, grad.shape),
                                              np.broadcast_to(max_norm, grad.shape), grad)
    np.testing.assert_allclose(u, want, **F64)
    np.testing.assert_allclose(clip, want, **F64)


# --- sparsemax losses ---


def np_sparsemax(s):
    """Projection onto the simplex by bisection on the threshold (independent of sorting)."""
    lo, hi = s.min(-1, keepdims=True) - 1, s.max(-1, keepdims=True)
    for _ in range(200):
        mid = (lo + hi) / 2
        too_much = np.maximum(s - mid, 0).sum(-1, keepdims=True) > 1
        lo, hi = np.where(too_much, mid, lo), np.where(too_much, hi, mid)
    return np.maximum(s - (lo + hi) / 2, 0)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_multiclass_sparsemax_loss_value_and_gradient():
    g = rng(10)
    s = g.normal(size=(4, 3, 5)) * 2
    y = g.integers(0, 5, size=(4, 3))
    p = np_sparsemax(s)
    sy = np.take_along_axis(s, y[..., None], -1)[..., 0]
    want = (p * s).sum(-1) - sy + 0.5 * (1 - (p * p).sum(-1))
    with jax.enable_x64(True):
        got = optim.losses.multiclass_sparsemax_loss(s, y)
        grad = jax.grad(lambda a: optim.losses.multiclass_sparsemax_loss(a, y).sum())(s)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(grad, p - np.eye(5)[y], rtol=1e-9, atol=1e-12)
    # the Hessian is sparsemax's Jacobian: diag(1_S) - 1_S 1_S^T / |S| on the support S
    with jax.enable_x64(True):
        hess = jax.hessian(lambda a: optim.losses.multiclass_sparsemax_loss(a, y[0, 0]))(s[0, 0])
    support = (p[0, 0] > 0).astype(float)
    np.testing.assert_allclose(hess, np.diag(support) - np.outer(support, support) / support.sum(),
                               atol=1e-12)
    flat32 = jnp.float32(s.reshape(-1, 5))
    np.testing.assert_allclose(optim.losses.multiclass_sparsemax_loss(flat32, y.reshape(-1)),
                               optax.losses.multiclass_sparsemax_loss(flat32, y.reshape(-1)),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got) >= -1e-12)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        optim.losses.multiclass_sparsemax_loss(s, np.full((4, 3), 5))


def test_sparsemax_loss_value_and_gradient():
    x = np.linspace(-3, 3, 25)
    for label in (0, 1):
        z = -x if label else x
        want = np.where(z <= -1, 0.0, np.where(z >= 1, z, (z + 1) ** 2 / 4))
        with jax.enable_x64(True):
            got = optim.losses.sparsemax_loss(x, np.full_like(x, label))
            grad = jax.grad(lambda a, y=label: optim.losses.sparsemax_loss(a, y).sum())(x)
        np.testing.assert_allclose(got, want, **F64)
        dz = np.where(z <= -1, 0.0, np.where(z >= 1, 1.0, (z + 1) / 2))
        np.testing.assert_allclose(grad, -dz if label else dz, **F64)
        np.testing.assert_allclose(optim.losses.sparsemax_loss(jnp.float32(x), label),
                                   optax.losses.sparsemax_loss(jnp.float32(x), label), rtol=1e-6)


# --- tree, masking, annotations ---


def test_tree_max_min_skip_empty_leaves_as_optax():
    tree = {"a": jnp.zeros((0,)), "b": jnp.array([1.0, -2.0]), "c": jnp.array(3.0)}
    assert float(optim.tree.max(tree)) == float(optax.tree.max(tree)) == 3.0
    assert float(optim.tree.min(tree)) == float(optax.tree.min(tree)) == -2.0
    empty = {"a": jnp.zeros((0, 2))}
    assert float(optim.tree.max(empty)) == float(optax.tree.max(empty)) == -np.inf
    assert float(optim.tree.min({})) == float(optax.tree.min({})) == np.inf
    assert optim.tree.max({"i": jnp.array([1, 5])}).dtype == jnp.int32


def test_masked_inner_state_holds_masked_nodes():
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    tx = optim.masked(optim.adam(0.1), {"a": True, "b": False})
    state = tx.init(params)
    mu = state.inner_state[0].mu
    assert isinstance(mu["b"], optim.MaskedNode) and optim.MaskedNode is optim.transforms.MaskedNode
    assert len(jax.tree.leaves(mu)) == 1
    found = jax.tree.leaves(mu, is_leaf=lambda x: isinstance(x, optim.MaskedNode))
    assert sum(isinstance(x, optim.MaskedNode) for x in found) == 1
    u, _ = tx.update(params, state, params)
    np.testing.assert_array_equal(u["b"], params["b"])


def test_learning_rate_annotations_are_optax_types():
    """Optax's own tests run a schedule through every optimizer whose ``learning_rate`` is
    annotated ``ScalarOrSchedule``; ours must carry the same (evaluated) annotation wherever
    Optax's does."""
    checked = 0
    for name in dir(optax):
        theirs, ours = getattr(optax, name), getattr(optim, name, None)
        if not (inspect.isfunction(theirs) and callable(ours)):
            continue
        t_lr = inspect.signature(theirs).parameters.get("learning_rate")
        o_lr = inspect.signature(ours).parameters.get("learning_rate")
        if t_lr is None or o_lr is None:
            continue
        t_is = t_lr.annotation in (optax.ScalarOrSchedule, optax.Schedule)
        o_is = o_lr.annotation in (optim.ScalarOrSchedule, optim.Schedule)
        assert o_is or not t_is, (name, t_lr.annotation, o_lr.annotation)
        checked += 1
    assert checked >= 25


@pytest.mark.parametrize("op", [
    lambda t, m: t.add_scale(None, 1.0, m), lambda t, m: t.update_moment(None, m, 0.9, 1),
    lambda t, m: t.update_moment_per_elem_norm(None, m, 0.9, 2),
    lambda t, m: t.update_infinity_moment(None, m, 0.9, 1e-8),
])
def test_moment_helpers_keep_none_like_optax(op):
    m = {"a": jnp.array([1.0, 2.0]), "b": None}
    g = {"a": jnp.array([0.5, -1.0]), "b": None}
    assert op(optim.tree, jnp.ones(3)) is None and op(optax.tree, jnp.ones(3)) is None
    got = optim.tree.add_scale(g, 2.0, m)
    assert got["b"] is None
    np.testing.assert_allclose(got["a"], [2.5, 3.0])


def test_bias_correction_with_a_python_count_in_bfloat16():
    m = jnp.logspace(-10, 10, num=21, dtype=jnp.bfloat16)
    for decay in (0.9, 0.9995):
        out = optim.tree.bias_correction(m, decay, 1)
        assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out)))
        np.testing.assert_allclose(np.float64(out), np.float64(m) / (1 - decay), rtol=1e-2)


def test_masked_reads_a_callable_pytree_mask_as_a_tree():
    """An Equinox-style module is callable and a pytree: as a mask it is a tree of bools."""
    import dataclasses

    @dataclasses.dataclass
    class Module:
        w: object

        def __call__(self, x):
            return self.w.dot(x)

    jax.tree_util.register_pytree_node(Module, lambda m: ((m.w,), None), lambda _, c: Module(*c))
    params = Module(jnp.array([1.0, 2.0, 3.0]))
    for mask, scale in ((Module(False), 1.0), (Module(True), -0.1)):
        tx = optim.masked(optim.sgd(0.1), mask)
        out, _ = tx.update(params, tx.init(params))
        np.testing.assert_allclose(out.w, scale * params.w)
