"""GPU-only implementations load on first use: `import cairn.kernels` on a CPU imports no Pallas
Triton or Mosaic GPU code, and asking for such an implementation (interpreted here) loads and runs it.

The import checks run in fresh interpreters: this process has long imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import jax.numpy as jnp
import pytest

import cairn.kernels as ck
from cairn.kernels import _registry

# what the GPU backends bring in: JAX's Pallas GPU lowerings and our kernel modules for them
GPU_MODULES = (
    "jax.experimental.pallas.triton",
    "jax._src.pallas.triton",
    "jax.experimental.pallas.mosaic_gpu",
    "jax._src.pallas.mosaic_gpu",
    "jax.experimental.mosaic.gpu",
)

_PROBE = """
import json, sys
import numpy as np
GPU = {gpu!r}
def loaded():
    return sorted(m for m in sys.modules
                  if m.startswith(GPU) or (m.startswith("cairn.kernels._") and m.endswith((".pallas_triton", ".pallas_mosaic"))))
import cairn.kernels as ck
import jax.numpy as jnp
out = {{"after_import": loaded()}}
x = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
y = ck.rms_norm(jnp.asarray(x), None)  # default dispatch on the CPU: xla
out["xla_ok"] = bool(np.allclose(np.asarray(y), x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6),
                                 rtol=1e-5, atol=1e-5))
out["after_default_call"] = loaded()
y = ck.rms_norm(jnp.asarray(x), None, implementation="pallas_triton")  # interpreted on the CPU
out["triton_ok"] = bool(np.allclose(np.asarray(y), x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6),
                                    rtol=1e-5, atol=1e-5))
out["after_triton"] = loaded()
xb = jnp.asarray(x, jnp.bfloat16)
w = jnp.asarray(np.random.default_rng(1).normal(size=(32, 2, 32)) / 8, jnp.bfloat16)
g = ck.gated_linear_unit(xb, w, implementation="pallas_mosaic_gpu")
ref = (np.asarray(xb, np.float64) @ np.asarray(w[:, 0], np.float64)) * (np.asarray(xb, np.float64) @ np.asarray(w[:, 1], np.float64))
out["mosaic_ok"] = bool(np.allclose(np.asarray(g, np.float64), ref, rtol=2e-2, atol=2e-2))
out["after_mosaic"] = loaded()
print(json.dumps(out))
"""


def _probe() -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", _PROBE.format(gpu=GPU_MODULES)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probe() -> dict:
    return _probe()


def test_import_and_default_dispatch_load_no_gpu_backend(probe):
    assert probe["after_import"] == []
    assert probe["xla_ok"]
    assert probe["after_default_call"] == []


def test_asking_for_a_gpu_implementation_loads_and_runs_it(probe):
    assert probe["triton_ok"]
    assert "cairn.kernels._norms.pallas_triton" in probe["after_triton"]
    assert "jax.experimental.pallas.triton" in probe["after_triton"]
    # only what was asked for (JAX's own interpret-mode lowering of any pallas_call imports
    # its Mosaic interpreters, so only our Mosaic GPU kernel modules are checked)
    assert not any(m.startswith("cairn.kernels.") and m.endswith(".pallas_mosaic") for m in probe["after_triton"])
    assert probe["mosaic_ok"]
    assert "cairn.kernels._glu.pallas_mosaic" in probe["after_mosaic"]
    assert "jax.experimental.pallas.mosaic_gpu" in probe["after_mosaic"]


def test_every_gpu_implementation_is_deferred_and_loads_to_its_declaration():
    # cairn.kernels' own ops (other tests in this worker register toy ops of their own)
    own = [op for op in _registry.ops()
           if getattr(ck.implementations(op)["xla"].fn, "__module__", "").startswith("cairn.kernels.")]
    assert {"dot_product_attention", "ragged_dot", "gated_linear_unit", "layer_norm",
            "linear_softmax_cross_entropy_loss", "quantized_dot_general"} <= set(own)
    for op in own:
        for name, impl in ck.implementations(op).items():
            if name == "xla":
                continue
            assert isinstance(impl.fn, _registry._Forward), (op, name)
            real = impl.fn.where.load()
            assert (real.op, real.name, real.platforms) == (op, name, impl.platforms)


def test_deferred_that_names_the_wrong_thing_raises_on_first_use():
    op = f"lazy_{uuid.uuid4().hex[:8]}"
    ck.register_op(op, bucket=lambda x: ())
    # the module exists, but its IMPLEMENTATION is another op's
    ck.register(ck.deferred(op, "pallas_triton", "cairn.kernels._norms.pallas_triton", {"gpu"}))
    with pytest.raises(TypeError, match=rf"cairn.kernels._norms.pallas_triton.IMPLEMENTATION must be .*'{op}'"):
        ck.call(op, jnp.ones(2), implementation="pallas_triton")


def test_deferred_registers_idempotently_but_not_over_another_module():
    op = f"lazy_{uuid.uuid4().hex[:8]}"
    ck.register_op(op, bucket=lambda x: ())
    ck.register(ck.deferred(op, "pallas_triton", "cairn.kernels._norms.pallas_triton", {"gpu"}))
    ck.register(ck.deferred(op, "pallas_triton", "cairn.kernels._norms.pallas_triton", {"gpu"}))  # a re-import: fine
    with pytest.raises(ValueError, match="already registered"):
        ck.register(ck.deferred(op, "pallas_triton", "cairn.kernels._glu.pallas_triton", {"gpu"}))
