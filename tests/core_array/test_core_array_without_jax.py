"""Without JAX: everything NumPy-only works, JAX features raise a clear ImportError.

Runs in a subprocess whose import system refuses ``jax`` (so the test means the same in
the dev venv, which has JAX, and in ``tests_package(core_array)``, which has none).
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys

    class NoJax:
        def find_spec(self, name, path=None, target=None):
            if name == "jax" or name.startswith("jax."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
            return None

    sys.meta_path.insert(0, NoJax())
    import numpy as np
    import cairn.core_array as ca

    # NumPy-only features work
    q = ca.QArray(np.array([[2, -4]], np.int8), np.array([[0.5, 0.25]], np.float32),
                  layout=ca.QuantLayout.per_channel(1))
    assert q.dequantize().tolist() == [[1.0, -1.0]]
    # a dataclass without JAX: the same paths as the JAX pytree gives, and a round trip
    flat = ca.flatten_with_paths({"w": q})
    assert list(flat) == ["w/qvalue", "w/scale"]
    back = ca.unflatten({k: v * 2 for k, v in flat.items()}, like={"w": q})["w"]
    assert type(back) is ca.QArray and back.layout == q.layout and back.dequantize().tolist() == [[4.0, -4.0]]
    spec = ca.ArraySpec((2,), "bfloat16", sharding=("data",))
    assert ca.specs_from_json(ca.specs_to_json({"s": spec})) == {"s": spec}
    assert ca.LogicalAxisRules([("b", "data")]).mesh_axes(("b",)) == ("data",)

    calls = {
        "ArraySpec.partition_spec": lambda: spec.partition_spec(),
        "ArraySpec.to_shape_dtype_struct": lambda: spec.to_shape_dtype_struct(),
        "logical_to_partition_spec": lambda: ca.logical_to_partition_spec(("b",), [("b", "data")]),
        "named_sharding": lambda: ca.named_sharding(None, ("b",), [("b", "data")]),
    }
    for what, call in calls.items():
        try:
            call()
        except ImportError as e:
            assert str(e) == f"{what} needs JAX; install it with `pip install cairn-core-array[jax]`", e
        else:
            raise AssertionError(f"{what} did not raise")
    assert "jax" not in sys.modules
    print("OK")
    """
)


def test_numpy_features_work_and_jax_features_say_what_to_install():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr


def test_jax_blocked_through_sys_modules_none_counts_as_absent():
    # sys.modules["jax"] = None is the other common way to hide JAX: core_array must not
    # try `import jax.tree_util` because the key exists
    code = textwrap.dedent(
        """
        import sys
        sys.modules["jax"] = None
        import numpy as np
        import cairn.core_array as ca
        q = ca.QArray(np.array([[2, -4]], np.int8), np.array([[0.5, 0.25]], np.float32),
                      layout=ca.QuantLayout.per_channel(1))
        assert ca.flatten_with_paths({"w": q, "b": [1]}) == {"b/0": 1, "w/qvalue": q.qvalue, "w/scale": q.scale}
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
