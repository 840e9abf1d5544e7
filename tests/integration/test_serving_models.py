"""cairn.serving exports cairn.nn and cairn.quant models; a process that cannot import
cairn.nn, cairn.quant or the model code loads and runs them with the same outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn, quant, serving
from cairn.core_array import ArraySpec, QArray, read_checksummed_json

HERMETIC = textwrap.dedent('''
    import importlib.abc, json, sys
    import numpy as np
    BLOCKED = ("cairn.nn", "cairn.quant", "cairn.kernels", "cairn.optim", "flax")

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.startswith(BLOCKED):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    for name in BLOCKED:
        sys.modules[name] = None
    from cairn.serving import load

    results = {}
    for path, inputs in json.loads(open(sys.argv[1]).read()).items():
        m = load(path)
        arrays = {k: np.array(v["data"], dtype=v["dtype"]) for k, v in inputs.items()}
        results[path] = {k: v.tolist() for k, v in m(arrays).items()}
    print(json.dumps({"results": results, "blocked_loaded": [k for k in sys.modules if k.startswith(BLOCKED)
                                                              and sys.modules[k] is not None]}))
''')


def _run_hermetic(cases: dict, tmp_path) -> dict:
    """Load and run every ``{path: {input: array}}`` in one fresh, hermetic process."""
    spec = {str(p): {k: {"data": v.tolist(), "dtype": str(v.dtype)} for k, v in inp.items()} for p, inp in cases.items()}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    (tmp_path / "hermetic.py").write_text(HERMETIC)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(tmp_path / "hermetic.py"), str(tmp_path / "cases.json")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["blocked_loaded"] == []
    return {p: {k: np.array(v) for k, v in out.items()} for p, out in doc["results"].items()}


class _Mlp(nn.Module):
    def __init__(self, rngs: nn.Rngs) -> None:
        self.l1 = nn.Linear(32, 64, rngs=rngs)
        self.l2 = nn.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _mlp_fn(p, x):
    return jax.nn.relu(x @ p["l1"]["kernel"]) @ p["l2"]["kernel"]


def _plain_params():
    k = jax.random.split(jax.random.key(0), 2)
    return {"l1": {"kernel": jax.random.normal(k[0], (64, 128)) / 8}, "l2": {"kernel": jax.random.normal(k[1], (128, 16)) / 11}}


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.xdist_group("serving_subprocess")
def test_nn_and_quant_models_load_hermetically(tmp_path):
    x32 = np.asarray(jax.random.normal(jax.random.key(5), (3, 32)), np.float32)
    x64 = np.asarray(jax.random.normal(jax.random.key(6), (5, 64)), np.float32)
    expected, cases = {}, {}

    # cairn.nn: split the module; the exported function merges it back around the weights
    model = _Mlp(nn.Rngs(0))
    graphdef, state = nn.split(model)

    def nn_forward(params, inputs):
        return {"y": nn.merge(graphdef, params)(inputs["x"])}

    p = serving.export(nn_forward, state, {"x": ArraySpec(("b", 32), "float32")}, tmp_path / "nn_mlp", max_batch_size=8)
    expected[p], cases[p] = {"y": np.asarray(model(x32))}, {"x": x32}

    # cairn.quant: int8 per-channel and packed int4 per-tile weights through quantize()
    params = _plain_params()
    for qtype, kw, pack in (("int8", {}, False), ("int4", {"tile_size": 32}, True)):
        provider = quant.PtqProvider([quant.QuantizationRule(weight_qtype=qtype, **kw)])
        qp = quant.quantize_params(params, provider, _mlp_fn, x64, pack=pack)
        assert isinstance(qp["l1"]["kernel"], QArray)
        f = quant.quantize(_mlp_fn, provider)
        p = serving.export(lambda prm, inp, f=f: f(prm, inp["x"]), qp, {"x": ArraySpec(("b", 64), "float32")},
                           tmp_path / f"q_{qtype}", max_batch_size=8)
        man = read_checksummed_json(os.path.join(p, "manifest.json"))
        assert man["weights"]["qarrays"]["l1/kernel"]["qtype"] == qtype
        sizes = {e["path"]: np.prod(e["shape"]) * (1 if e["dtype"] in ("int8", "uint8") else 4)
                 for e in man["weights"]["arrays"]}
        assert sizes["l1/kernel/qvalue"] == 64 * 128 // (2 if qtype == "int4" else 1)  # small on disk
        loaded = serving.load(p)
        assert loaded.weights["l1/kernel/qvalue"].nbytes == sizes["l1/kernel/qvalue"]  # and on the device
        expected[p], cases[p] = {"output_0": np.asarray(f(qp, x64))}, {"x": x64}
        ref = np.asarray(_mlp_fn(params, x64), np.float64)
        rel = np.linalg.norm(expected[p]["output_0"] - ref) / np.linalg.norm(ref)
        assert rel < (0.02 if qtype == "int8" else 0.2), rel  # quantized, and close

    got = _run_hermetic(cases, tmp_path)
    for p, want in expected.items():
        for k, v in want.items():
            np.testing.assert_allclose(got[str(p)][k], v, rtol=1e-5, atol=1e-5)


def test_nn_model_holding_qarrays_exports(tmp_path):
    """A cairn.nn model updated with quantize_params (QArray inside nn state) exports, and
    its loaded outputs equal the model's eager ones."""
    model = _Mlp(nn.Rngs(1))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 32)), jnp.float32)
    provider = quant.PtqProvider([quant.QuantizationRule(module_path="l1|l2", weight_qtype="int8")])
    nn.update(model, nn.state(quant.quantize_params(model, provider, lambda m, t: m(t), x)))
    assert isinstance(model.l1.kernel.value, QArray)
    graphdef, state = nn.split(model)
    p = serving.export(lambda prm, inp: nn.merge(graphdef, prm)(inp["x"]), state,
                       {"x": ArraySpec(("b", 32), "float32")}, tmp_path / "m", max_batch_size=4)
    man = read_checksummed_json(os.path.join(p, "manifest.json"))
    assert any(k.startswith("l1/") for k in man["weights"]["qarrays"])
    np.testing.assert_allclose(serving.load(p)({"x": np.asarray(x)})["output_0"], np.asarray(model(x)), rtol=1e-5, atol=1e-5)
