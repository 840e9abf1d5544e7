"""nn.Profiler: the traced window, the per-module table read back from the trace (against a
hand-written trace and HLO module), the roofline arithmetic, XLA's cost and memory analysis
against shapes, and that a disabled profiler does nothing."""

from __future__ import annotations

import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cairn import nn
from cairn.nn import _profile

PEAK = {"flops_per_s": 1e11, "bytes_per_s": 1e10, "device": "test"}


@pytest.mark.parametrize("op_name,want", [
    ("jit(step)/jit(main)/blocks/0/l1/dot_general", ("blocks/0/l1", False)),
    ("jit(pure)/transpose(jvp(blocks/1))/l2/dot_general", ("blocks/1/l2", True)),
    ("jit(pure)/jvp(norm)/rsqrt", ("norm", False)),
    ("jit(pure)/jvp()/reduce_sum", ("", False)),
    ("jit(pure)/vmap(remat(attn))/q/dot_general;jit(pure)/mul", ("attn/q", False)),
    ("keep[3]", ("", False)),
])
def test_scope_of(op_name, want):
    assert nn.scope_of(op_name) == want


HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %a = f32[4]{0} multiply(%p0, %p0), metadata={op_name="jit(step)/enc/l1/mul"}
  ROOT %b = f32[4]{0} add(%a, %p0), metadata={op_name="jit(step)/enc/l2/add"}
}

%fused_computation.1 (p1: f32[4]) -> f32[4] {
  %p1 = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} multiply(%p1, %p1), metadata={op_name="jit(step)/transpose(jvp(enc))/l1/mul"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x"}
  %fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %fusion.1 = f32[4]{0} fusion(%fusion), kind=kLoop, calls=%fused_computation.1
  %dot = f32[4]{0} multiply(%fusion.1, %x), metadata={op_name="jit(step)/dec/mul"}
  ROOT %upd = f32[4]{0} add(%dot, %x), metadata={op_name="jit(step)/add"}
}
"""


def test_parse_hlo_charges_a_fusion_to_its_ops():
    module, ops = _profile.parse_hlo(HLO)
    assert module == "jit_step"
    assert ops["fusion"] == ["jit(step)/enc/l1/mul", "jit(step)/enc/l2/add"]
    assert ops["fusion.1"] == ["jit(step)/transpose(jvp(enc))/l1/mul"]
    assert ops["dot"] == ["jit(step)/dec/mul"]


class _FakeCompiled:
    def as_text(self):
        return HLO

    def cost_analysis(self):
        return {"flops": 8e8, "bytes accessed": 4e8}

    def memory_analysis(self):
        return None


def _write_trace(log_dir, events):
    run = os.path.join(log_dir, "plugins", "profile", "2026_01_01_00_00_00")
    os.makedirs(run)
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    with gzip.open(os.path.join(run, "host.trace.json.gz"), "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_module_table_from_a_hand_written_trace(tmp_path):
    prof = nn.Profiler(tmp_path, start_step=0, num_steps=2, peak=PEAK)
    prof.add_compiled("step", _FakeCompiled())
    prof._step_s, prof._done = {0: 0.01, 1: 0.012}, True  # the window, as if traced

    def ev(op, us, module="jit_step"):
        return {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": us, "name": op,
                "args": {"hlo_op": op, "hlo_module": module}}

    # two steps: fusion (enc/l1 + enc/l2 -> enc), fusion.1 (backward of enc/l1), dot (dec), upd (top)
    events = [ev("fusion", 3000), ev("fusion", 1000), ev("fusion.1", 2000), ev("fusion.1", 2000),
              ev("dot", 500), ev("dot", 1500), ev("upd", 1000), ev("upd", 1000),
              ev("fusion", 9999, module="jit_other"), {"ph": "X", "pid": 1, "name": "train", "dur": 5}]
    _write_trace(str(tmp_path), events)
    s = prof.summary(print_fn=None)
    rows = {r["path"]: r for r in s["functions"]["step"]["modules"]}
    assert list(rows) == ["(no module)", "dec", "enc", "enc/l1"]
    assert rows["enc"]["forward_ms"] == pytest.approx(2.0) and rows["enc"]["backward_ms"] == 0
    assert rows["enc"]["total_ms"] == pytest.approx(4.0)  # enc itself plus enc/l1
    assert rows["enc/l1"]["backward_ms"] == pytest.approx(2.0) and rows["enc/l1"]["forward_ms"] == 0
    assert rows["dec"]["forward_ms"] == pytest.approx(1.0) and rows["dec"]["ops"] == 1
    assert rows["(no module)"]["forward_ms"] == pytest.approx(1.0)
    assert rows["(no module)"]["total_ms"] == pytest.approx(6.0) and rows["(no module)"]["percent"] == 100
    assert rows["enc"]["percent"] == pytest.approx(100 * 4 / 6)
    line = s["functions"]["step"]["roofline"]  # 6 ms per step measured in the trace
    assert line["time_from"] == "trace" and line["seconds"] == pytest.approx(6e-3)
    assert line["roofline_s"] == pytest.approx(max(8e8 / 1e11, 4e8 / 1e10))
    assert line["bound"] == "memory" and line["intensity"] == pytest.approx(2.0) and line["ridge"] == 10.0
    assert s["step_time_s"]["mean"] == pytest.approx(0.011)
    assert json.load(open(tmp_path / nn.SUMMARY_FILE)) == json.loads(json.dumps(s))


class Block(nn.Module):
    def __init__(self, rngs):
        self.l1 = nn.Linear(32, 64, rngs=rngs)
        self.l2 = nn.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


class Model(nn.Module):
    def __init__(self, rngs):
        self.blocks = nn.List([Block(rngs), Block(rngs)])

    def __call__(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_real_trace_of_a_cairn_nn_model(tmp_path):
    model = Model(nn.Rngs(0))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    step = nn.jit(lambda m, x: nn.grad(loss)(m, x))
    x = jnp.ones((16, 32))
    prof = nn.Profiler(tmp_path, start_step=3, num_steps=2, peak=PEAK)
    compiled = step.lower(model, x).compile()
    prof.add_compiled("step", compiled)
    printed = []
    for s in range(6):
        with prof.step(s):
            jax.block_until_ready(step(model, x))
        assert prof.done == (s >= 4)
    summary = prof.summary(print_fn=printed.append)
    assert summary["steps"] == [3, 4]
    fn = summary["functions"]["step"]
    paths = {r["path"] for r in fn["modules"]}
    assert "blocks" in paths and paths <= {"(no module)", "blocks", *(f"blocks/{i}{s}" for i in (0, 1) for s in ("", "/l1", "/l2"))}
    assert fn["modules"][0]["path"] == "(no module)" and fn["modules"][0]["percent"] == pytest.approx(100)
    files = os.listdir(summary["trace_dir"])
    assert any(f.endswith(".xplane.pb") for f in files) and any(f.endswith(".trace.json.gz") for f in files)
    # XLA's cost analysis against the shapes: 4 forward matmuls, 4 weight gradients and 3 input
    # gradients (x itself needs none), each 2*16*32*64 FLOPs; elementwise ops add a little
    matmul = 2 * 16 * 32 * 64
    assert 11 * matmul <= fn["cost"]["flops"] <= 11.5 * matmul
    params = sum(x.size * 4 for x in jax.tree.leaves(nn.state(model)))
    assert fn["memory"]["argument_bytes"] == params + x.size * 4
    assert "roofline:" in printed[0] and "memory:" in printed[0]


def test_disabled_profiler_does_nothing(tmp_path):
    prof = nn.Profiler(tmp_path / "p", start_step=0, num_steps=3, enabled=False)
    ctx = prof.step(0)
    assert ctx is prof.step(1)  # one shared nullcontext
    with ctx:
        pass
    prof.add_compiled("f", jax.jit(lambda x: x).lower(np.ones(2)).compile())
    assert not os.path.exists(tmp_path / "p") and not prof.done
    with pytest.raises(RuntimeError, match="disabled"):
        prof.summary()


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        nn.Profiler(tmp_path, start_step=0, num_steps=0)
    prof = nn.Profiler(tmp_path, start_step=5, num_steps=2, peak=PEAK)
    with pytest.raises(TypeError, match=r"add_compiled\('f', ...\) needs a jax.stages.Compiled"):
        prof.add_compiled("f", jax.jit(lambda x: x))
    with pytest.raises(RuntimeError, match=r"window \(steps 5..6\) was not reached"):
        prof.summary()
    prof._done = True
    with pytest.raises(FileNotFoundError, match="no jax.profiler trace"):
        prof.summary()


def test_roofline_and_measured_peak():
    r = nn.roofline({"flops": 1e9, "bytes_accessed": 1e9}, 0.05, {"flops_per_s": 1e11, "bytes_per_s": 1e10})
    assert r["bound"] == "memory" and r["roofline_s"] == pytest.approx(0.1) and r["efficiency"] == pytest.approx(2.0)
    peak = nn.measure_peak(repeats=1)
    assert peak["platform"] == "cpu" and peak["flops_per_s"] > 1e8 and peak["bytes_per_s"] > 1e7
