"""``rngs.lecun_normal()((2, 3))``: the initializer constructors bound to a random stream
(Flax NNX's rngs_test, issue 30), against ``jax.nn.initializers`` with the stream's keys."""

import jax
import numpy as np
import pytest

from cairn import nn

NAMES = [
    "delta_orthogonal", "glorot_normal", "glorot_uniform", "he_normal", "he_uniform",
    "kaiming_normal", "kaiming_uniform", "lecun_normal", "lecun_uniform", "xavier_normal",
    "xavier_uniform",
]


@pytest.mark.parametrize("name", NAMES)
def test_stream_initializer_draws_the_next_key(name):
    shape = (3, 3, 4, 4) if name == "delta_orthogonal" else (4, 6)
    rngs = nn.Rngs(0, params=1)
    rngs.normal((2,))  # the default stream's first key is used here
    got_default = getattr(rngs, name)()(shape)
    got_params = getattr(rngs.params, name)()(shape)
    ref = getattr(jax.nn.initializers, name)()
    want_default = ref(jax.random.fold_in(jax.random.key(0), 1), shape)
    want_params = ref(jax.random.fold_in(jax.random.key(1), 0), shape)
    # jax.nn.initializers' own draws, bit for bit (as Flax NNX binds them)
    np.testing.assert_array_equal(np.asarray(got_default), np.asarray(want_default))
    np.testing.assert_array_equal(np.asarray(got_params), np.asarray(want_params))
    assert int(rngs.default.count.value) == 2 and int(rngs.params.count.value) == 1


def test_initializer_arguments_and_each_call_a_new_key():
    rngs = nn.Rngs(5)
    init = rngs.variance_scaling(2.0, "fan_out", "uniform")
    a, b = init((3, 5)), init((3, 5))
    ref = jax.nn.initializers.variance_scaling(2.0, "fan_out", "uniform")
    np.testing.assert_allclose(np.asarray(a), np.asarray(ref(jax.random.fold_in(jax.random.key(5), 0), (3, 5))),
                               rtol=1e-6)
    assert not np.allclose(np.asarray(a), np.asarray(b))
    assert init((2, 2), jax.numpy.bfloat16).dtype == jax.numpy.bfloat16
