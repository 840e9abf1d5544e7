"""The registry's dispatch rules, the override context, cross_compile, and tracing of kernel calls."""

from __future__ import annotations

import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cairn.kernels as ck
from cairn.kernels import _cache, _registry
from cairn.kernels._registry import Implementation

ALL = frozenset({"cpu", "gpu", "tpu"})


def toy_op(*, triton_supports=None):
    """A fresh op ``toy_<id>`` with xla (x * k) and pallas_triton (x * 3, GPU only) implementations."""
    op = f"toy_{uuid.uuid4().hex[:8]}"
    ck.register_op(op, bucket=lambda x: (x.shape[0],))
    ck.register(Implementation(op, "xla", lambda x, config, interpret: x * config["k"], ALL,
                               configs=lambda x: ({"k": 2}, {"k": 5}), default_config=lambda x: {"k": 2}))
    ck.register(Implementation(op, "pallas_triton", lambda x, config, interpret: x * (3 + 10 * interpret),
                               frozenset({"gpu"}), supports=triton_supports or (lambda x: None)))
    return op


X = jnp.ones(2)


@pytest.mark.cpu_dispatch
def test_default_on_cpu_is_xla_and_pallas_only_when_asked():
    op = toy_op()
    assert float(ck.call(op, X)[0]) == 2.0
    assert float(ck.call(op, X, implementation="pallas_triton")[0]) == 13.0  # interpret=True on the CPU


def test_registering_twice_raises():
    op = toy_op()
    with pytest.raises(ValueError, match="already registered"):
        ck.register(Implementation(op, "xla", lambda x, config, interpret: x, ALL))
    with pytest.raises(ValueError, match="already registered"):
        ck.register_op(op, bucket=lambda x: ())


def test_register_before_register_op():
    op = f"late_{uuid.uuid4().hex[:8]}"
    ck.register(Implementation(op, "xla", lambda x, config, interpret: x + 1, ALL))
    ck.register_op(op, bucket=lambda x: ())
    assert float(ck.call(op, X)[0]) == 2.0


@pytest.mark.cpu_dispatch
def test_unknown_names_raise_naming_op_and_valid_names():
    op = toy_op()
    with pytest.raises(ValueError, match=rf"unknown implementation 'cudnn' for op '{op}'.*\['pallas_triton', 'xla'\]"):
        ck.call(op, X, implementation="cudnn")
    with pytest.raises(ValueError, match="unknown kernel op 'no_such_op'"):
        ck.call("no_such_op", X)
    with pytest.raises(ValueError, match=r"config key\(s\) \['z'\] unknown to implementation 'xla'"):
        ck.call(op, X, config={"z": 1})


def test_supports_reason_raises_when_explicit_and_skips_otherwise():
    op = toy_op(triton_supports=lambda x: "x is too small")
    with pytest.raises(ValueError, match="pallas_triton: x is too small"):
        ck.call(op, X, implementation="pallas_triton")
    with ck.cross_compile("gpu"):  # preference order skips it on a "GPU" too
        assert _registry.resolve(op, X)[0].name == "xla"


@pytest.mark.cpu_dispatch
def test_sequence_prefers_a_compiled_implementation():
    op = toy_op()
    assert float(ck.call(op, X, implementation=("pallas_triton", "xla"))[0]) == 2.0
    with ck.cross_compile("gpu"):
        assert _registry.resolve(op, X, implementation=("pallas_triton", "xla"))[0].name == "pallas_triton"
    with pytest.raises(ValueError, match="empty"):
        ck.call(op, X, implementation=())


@pytest.mark.cpu_dispatch
def test_precedence_explicit_override_cache_preference():
    op = toy_op()
    key = _registry.bucket_key(op, X)
    _cache.put(_cache.device_kind(), op, key, {"implementation": "xla", "config": {"k": 5}, "time_ms": 1.0})
    assert float(ck.call(op, X)[0]) == 5.0  # cache
    with ck.override(config={"k": 7}):
        assert float(ck.call(op, X)[0]) == 7.0  # override beats cache
        assert float(ck.call(op, X, config={"k": 9})[0]) == 9.0  # explicit beats override
    with ck.override("pallas_triton", op=op):
        assert float(ck.call(op, X)[0]) == 13.0
        assert float(ck.call(op, X, implementation="xla")[0]) == 2.0
    assert float(ck.call(op, jnp.ones(3))[0]) == 2.0  # another bucket: the default


def test_override_nests_and_filters_by_op():
    op = toy_op()
    with ck.override("pallas_triton"):
        with ck.override(config={"k": 4}, op="other_op"):
            assert ck.active_override(op) == ("pallas_triton", None)
            assert ck.active_override("other_op") == ("pallas_triton", {"k": 4})
        with ck.override("xla", op=op):
            assert ck.active_override(op) == ("xla", None)
        assert ck.active_override(op) == ("pallas_triton", None)
    assert ck.active_override(op) == (None, None)
    with pytest.raises(ValueError, match="implementation= and/or config="):
        with ck.override():
            pass


def test_override_is_per_thread():
    op = toy_op()
    seen = {}
    entered = threading.Event()
    done = threading.Event()

    def inside():
        with ck.override("pallas_triton", op=op):
            entered.set()
            done.wait(5)
            seen["inside"] = ck.active_override(op)

    thread = threading.Thread(target=inside)
    thread.start()
    entered.wait(5)
    seen["outside"] = ck.active_override(op)
    done.set()
    thread.join()
    assert seen == {"inside": ("pallas_triton", None), "outside": (None, None)}


def test_cross_compile_rejects_unknown_platform():
    with pytest.raises(ValueError, match="cross_compile platform"):
        with ck.cross_compile("npu"):
            pass


@pytest.mark.cpu_dispatch
def test_named_scope_and_recording_through_transforms():
    op = toy_op()

    def step(x):
        y = jax.vmap(lambda r: ck.call(op, r))(x)
        z, _ = jax.lax.scan(lambda c, r: (c + ck.call(op, r, implementation="pallas_triton").sum(), None), 0.0, x)
        return y.sum() + z

    calls = ck.ops_in(jax.grad(step), jax.ShapeDtypeStruct((3, 2), jnp.float32))
    assert [(c.op, c.implementation, c.interpret) for c in calls] == [(op, "xla", False), (op, "pallas_triton", True)]
    assert calls[0].config == {"k": 2}
    assert calls[1].args[0].shape == (2,)
    assert op in calls[0].describe()
    from cairn.kernels._trace import scopes_in

    assert scopes_in(step, np.ones((3, 2), np.float32)) == [(op, "xla"), (op, "pallas_triton")]


def test_attention_is_registered_with_four_implementations():
    assert set(ck.implementations("dot_product_attention")) == {"xla", "pallas_triton", "pallas_mosaic_gpu", "cudnn"}
    assert "dot_product_attention" in _registry.ops()
