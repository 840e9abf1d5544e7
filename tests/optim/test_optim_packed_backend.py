"""The packed backend against the plain tree-map references, on random trees.

Every optimizer and transformation with a float64 NumPy reference (the published update
equations applied leaf by leaf: ``test_optim_reference.py``,
``test_optim_transform_reference.py``) runs here under :func:`optim.pack`, so its
element-wise members keep their state in flat buffers, one per dtype, and update those
buffers instead of the per-parameter arrays. The tree is random per case (2 to 7 leaves of
rank 1 to 3, every dim 1 to 5), the protocol and the float32 tolerances are those of the
per-parameter tests (``run_against``: same gradients and params each step, errors
relative to the step's largest reference update).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import optim
from optim import _optim_refs as R
from optim import test_optim_reference as optimizers
from optim import test_optim_transform_reference as transforms

STEPS = 10
# Fixed trees: Shampoo keeps no packed state (it works per leaf) and its float32 eigh-based
# inverse roots are checked on the per-parameter tests' shapes only (random blocks are too
# ill-conditioned); the masked decay's mask names the leaves "w" and "k".
FIXED_SHAPES = {"optimizer-shampoo": optimizers.SHAPES,
                "transform-masked_weight_decay": transforms.SHAPES}


def _random_shapes(name: str) -> dict[str, tuple[int, ...]]:
    rng = np.random.default_rng(zlib.crc32(f"shapes/{name}".encode()))
    n = int(rng.integers(2, 8))
    return {f"p{i}": tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 4))))
            for i in range(n)}


def _cases():
    for name, (ours, ref) in optimizers.CASES.items():
        tol = None if name in optimizers.SIGN_BASED else optimizers.F32_TOL.get(name, 1e-3)
        yield pytest.param(ours, ref, tol, id=f"optimizer-{name}")
    for name, (ours, ref, tol) in transforms.CASES.items():
        yield pytest.param(ours, ref, tol, id=f"transform-{name}")


def _has_packed_buffers(state) -> bool:
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optim.Packed))
    return any(isinstance(x, optim.Packed) for x in leaves)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize(("ours", "ref", "tol"), list(_cases()))
def test_packed_path_matches_tree_map_reference(request, ours, ref, tol):
    name = request.node.callspec.id
    shapes = FIXED_SHAPES.get(name) or _random_shapes(name)
    tx = optim.pack(ours())
    errs = R.run_against(name, tx, ref(), jnp.float32, shapes, STEPS)
    if tol is None:  # sign-based: elements near 0 may flip
        assert np.mean(errs <= 1e-3) >= 0.99, f"{name}: {np.mean(errs <= 1e-3):.3f} close"
    else:
        assert errs.max() <= tol, f"{name}: max relative error {errs.max():.2e}"


@pytest.mark.parametrize("factory", [
    lambda: optim.adam(0.01), lambda: optim.rmsprop(0.01, centered=True),
    lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.adagrad(0.1),
    lambda: optim.lion(0.01), lambda: optim.rprop(0.01), lambda: optim.adadelta(1.0),
    lambda: optim.chain(optim.ema(0.9), optim.scale_by_amsgrad(), optim.scale_by_yogi()),
], ids=["adam", "rmsprop_centered", "sgd_momentum", "adagrad", "lion", "rprop", "adadelta",
        "ema_amsgrad_yogi"])
def test_pack_keeps_element_wise_moments_in_flat_buffers(factory):
    params = {k: jnp.ones(s) for k, s in _random_shapes("flat").items()}
    assert _has_packed_buffers(optim.pack(factory()).init(params))
    assert not _has_packed_buffers(factory().init(params))
