"""paged_attention and paged_kv_write: one test base that every implementation subclasses.

Values are checked against a float64 NumPy reference that walks each row's block table
itself (random non-contiguous tables, blocks shared between rows, ragged lengths, GQA,
soft cap, sliding window, decode and chunked-prefill queries), against the contiguous
``dot_product_attention`` when the pages are laid out contiguously, and by a hypothesis
property over shapes. Tolerances (max abs and rel error vs float64): float32 2e-5,
bfloat16 3e-2 (the ``dot_product_attention`` table in docs/kernels.md). The Pallas kernel
runs with ``interpret=True`` on the CPU, into NaN-poisoned output buffers.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cairn.kernels as ck
from cairn.kernels._attention import pallas_triton as _attention_triton

TOLERANCES = {"float32": 2e-5, "bfloat16": 3e-2}
_SEEDS = itertools.count(1)


def reference(q, kp, vp, tables, lengths, *, scale=None, soft_cap=None, window=None):
    """float64 NumPy: each row's keys read through its block table, bottom-right causal."""
    q, kp, vp = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, kp, vp))
    b, t, n, h = q.shape
    bs, kh = kp.shape[1], kp.shape[2]
    scale = 1.0 / np.sqrt(h) if scale is None else scale
    out = np.zeros((b, t, n, vp.shape[-1]))
    for row in range(b):
        length = int(lengths[row])
        slots = [(int(tables[row][j // bs]), j % bs) for j in range(length)]
        for i in range(t):
            pos = length - t + i
            keys = [j for j in range(length) if j <= pos and (window is None or j >= pos - window)]
            if pos < 0 or not keys:
                continue
            for head in range(n):
                kv = head // (n // kh)
                k = np.stack([kp[slots[j][0], slots[j][1], kv] for j in keys])
                v = np.stack([vp[slots[j][0], slots[j][1], kv] for j in keys])
                s = k @ q[row, i, head] * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                out[row, i, head] = (p / p.sum()) @ v
    return out


def workload(b, t, n, kh, h, bs, dtype, *, lengths=None, shared=True, num_blocks=None, max_blocks=None):
    """Random pages and queries; tables of distinct random blocks, rows 0 and 1 sharing their first blocks."""
    rng = np.random.default_rng(next(_SEEDS))
    if lengths is None:
        lengths = rng.integers(t, 5 * bs, size=b)
    lengths = np.asarray(lengths)
    need = [-(-int(x) // bs) for x in lengths]
    max_blocks = max_blocks or max(max(need), 1) + 1
    num_blocks = num_blocks or sum(need) + 3
    perm = list(rng.permutation(num_blocks))
    tables = np.full((b, max_blocks), -1, np.int32)  # -1 past the used blocks: never read
    for row in range(b):
        tables[row, : need[row]] = [perm.pop() for _ in range(need[row])]
    if shared and b > 1 and min(need[:2]) > 1:
        common = min(need[0], need[1]) - 1  # full blocks only: a prefix shared by reference
        tables[1, :common] = tables[0, :common]
    keys = jax.random.split(jax.random.key(next(_SEEDS)), 3)
    kp = jax.random.normal(keys[0], (num_blocks, bs, kh, h), jnp.float32).astype(dtype)
    vp = jax.random.normal(keys[1], (num_blocks, bs, kh, h), jnp.float32).astype(dtype)
    q = jax.random.normal(keys[2], (b, t, n, h), jnp.float32).astype(dtype)
    return q, kp, vp, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


class PagedTestBase:
    implementation = "xla"
    config: dict | None = None
    block_size = 4
    head_dim = 8

    def run(self, q, kp, vp, tables, lengths, **kw):
        """One jitted call (one compile instead of one per eager op)."""
        fn = functools.partial(ck.paged_attention, implementation=self.implementation, config=self.config, **kw)
        return jax.jit(fn)(q, kp, vp, tables, lengths)

    def check(self, dtype, b=3, t=1, n=4, kh=2, *, lengths=None, ref_kw=None, **kw):
        args = workload(b, t, n, kh, self.head_dim, self.block_size, dtype, lengths=lengths)
        with _attention_triton.poisoned_outputs():
            got = self.run(*args, **kw)
        want = reference(*args, **(ref_kw or {}))
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert not np.isnan(got).any()
        tol = TOLERANCES[dtype]
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{self.implementation} {dtype}")
        return got, args

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_decode_matches_reference(self, dtype):
        self.check(dtype)

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_chunked_prefill_after_cached_prefix(self):
        self.check("float32", b=2, t=5, n=4, kh=1, lengths=[3 * self.block_size + 2, 7])

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_softcap_window_gqa(self):
        self.check("float32", t=3, n=6, kh=2, logits_soft_cap=2.0, local_window_size=5,
                   ref_kw={"soft_cap": 2.0, "window": 5})

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_scale_and_window_pair(self):
        self.check("float32", t=2, scale=0.3, local_window_size=(2 * self.block_size, 0),
                   ref_kw={"scale": 0.3, "window": 2 * self.block_size})

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_padding_rows_and_short_rows_are_zero(self):
        got, _ = self.check("float32", b=3, t=3, lengths=[0, 2, 9])
        assert np.all(got[0] == 0.0)
        assert np.all(got[1, 0] == 0.0)  # the query at position -1 sees nothing

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_stale_and_nan_slots_never_leak(self):
        q, kp, vp, tables, lengths = workload(2, 2, 4, 2, self.head_dim, self.block_size, "float32",
                                              lengths=[self.block_size + 1, 2 * self.block_size - 1])
        want = reference(q, kp, vp, tables, lengths)
        used = np.zeros(kp.shape[:2], bool)
        for row, length in enumerate(np.asarray(lengths)):
            for j in range(int(length)):
                used[int(tables[row, j // self.block_size]), j % self.block_size] = True
        mask = jnp.asarray(used)[:, :, None, None]
        kp, vp = jnp.where(mask, kp, jnp.nan), jnp.where(mask, vp, jnp.inf)
        got = np.asarray(self.run(q, kp, vp, tables, lengths))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)

    @pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
    def test_jitted_with_traced_tables(self):
        q, kp, vp, tables, lengths = workload(2, 1, 4, 2, self.head_dim, self.block_size, "float32")
        fn = jax.jit(lambda *a: self.run(*a))
        got = fn(q, kp, vp, tables, lengths)
        np.testing.assert_allclose(got, reference(q, kp, vp, tables, lengths), atol=2e-5, rtol=2e-5)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fn(q, kp, vp, tables, lengths)))


class TestXlaPlain(PagedTestBase):
    config = {"pages_per_chunk": None}

    @pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
    def test_differentiable_in_query_and_pages(self):
        q, kp, vp, tables, lengths = workload(2, 2, 2, 1, 8, 4, "float32")
        grads = jax.jit(jax.grad(lambda q, k, v: self.run(q, k, v, tables, lengths).sum(), (0, 1, 2)))(q, kp, vp)
        assert all(bool(jnp.isfinite(g).all()) for g in grads)


class TestXlaChunkedOnePage(PagedTestBase):
    config = {"pages_per_chunk": 1}


class TestXlaChunkedThreePages(PagedTestBase):
    config = {"pages_per_chunk": 3}


class TestPallasTriton(PagedTestBase):
    implementation = "pallas_triton"
    config = {"block_rows": 16}  # chunked prefill (5 tokens x 4 heads) spans two row blocks
    block_size = 16
    head_dim = 16

    def test_lowers_for_cuda(self):
        q = jax.ShapeDtypeStruct((2, 1, 8, 64), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((32, 16, 2, 64), jnp.bfloat16)
        tables, lengths = jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)

        def fn(q, k, v, t, n):
            return ck.paged_attention(q, k, v, t, n, implementation="pallas_triton", logits_soft_cap=30.0,
                                      local_window_size=20)

        checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        with ck.cross_compile("gpu"):
            exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
                q, pages, pages, tables, lengths)
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()

    @pytest.mark.slow  # over 2 s in the default run: keeping nox -s tests under 10 minutes
    def test_refuses_sizes_triton_cannot_take(self):
        q, kp, vp, tables, lengths = workload(1, 1, 2, 1, 8, 4, "float32")
        with pytest.raises(ValueError, match="pallas_triton: block_size must be a power of two >= 16"):
            self.run(q, kp, vp, tables, lengths)


class TestPallasTritonSplitPages(PagedTestBase):
    """Flash decoding: each row's pages in three runs (some empty for short rows), merged."""

    implementation = "pallas_triton"
    config = {"block_rows": 16, "partitions": 3}
    block_size = 16
    head_dim = 16

    def test_refuses_zero_partitions(self):
        q, kp, vp, tables, lengths = workload(1, 1, 2, 1, 16, 16, "float32")
        with pytest.raises(ValueError, match="partitions must be >= 1, got 0"):
            ck.paged_attention(q, kp, vp, tables, lengths, implementation="pallas_triton",
                               config={"block_rows": 16, "partitions": 0})


def test_pallas_triton_splits_the_pages_only_when_few_programs_would_run():
    from cairn.kernels._paged_attention import pallas_triton as pt

    def parts(b, width, t=1, n=32, kh=8):
        q = jax.ShapeDtypeStruct((b, t, n, 128), jnp.bfloat16)
        pages = jax.ShapeDtypeStruct((b * width, 16, kh, 128), jnp.bfloat16)
        return pt.default_config(q, pages, pages, jax.ShapeDtypeStruct((b, width), jnp.int32))["partitions"]

    assert parts(64, 256) == 1  # 512 programs already: one run of pages each
    assert parts(4, 2048) == 16  # 32 programs over 2048 pages: split 16 ways
    assert parts(1, 2048) == 32  # at most 32 runs
    assert parts(16, 256) == 4
    assert parts(4, 40) == 2  # runs of at least 16 pages
    assert parts(4, 8) == 1


def _jit(fn, **static):
    return jax.jit(functools.partial(fn, **static))


# --- the contiguous layout: paged_attention == dot_product_attention ---


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
@pytest.mark.parametrize("config", [{"pages_per_chunk": None}, {"pages_per_chunk": 2}])
def test_contiguous_pages_equal_dot_product_attention(config):
    b, s, n, kh, h, bs = 3, 24, 4, 2, 8, 4
    keys = jax.random.split(jax.random.key(11), 3)
    k = jax.random.normal(keys[0], (b, s, kh, h))
    v = jax.random.normal(keys[1], (b, s, kh, h))
    tables = jnp.arange(b * s // bs, dtype=jnp.int32).reshape(b, s // bs)  # row b: pages b*6 .. b*6+5
    kp, vp = k.reshape(-1, bs, kh, h), v.reshape(-1, bs, kh, h)
    lengths = jnp.array([24, 13, 1], jnp.int32)
    q1 = jax.random.normal(keys[2], (b, 1, n, h))
    decode = _jit(ck.paged_attention, config=config)(q1, kp, vp, tables, lengths)
    want = _jit(ck.dot_product_attention)(q1, k, v, key_value_seq_lengths=lengths)
    np.testing.assert_allclose(decode, want, atol=1e-5, rtol=1e-5)
    qs = jax.random.normal(keys[2], (b, s, n, h))
    full = jnp.full((b,), s, jnp.int32)
    prefill = _jit(ck.paged_attention, config=config, local_window_size=5, logits_soft_cap=3.0)(
        qs, kp, vp, tables, full)
    want = _jit(ck.dot_product_attention, is_causal=True, local_window_size=(5, 0), logits_soft_cap=3.0)(qs, k, v)
    np.testing.assert_allclose(prefill, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=4, deadline=None)  # one compile per example: kept under ~7 s quiet
@given(
    b=st.integers(1, 3), t=st.integers(1, 4), kh=st.integers(1, 2), g=st.integers(1, 3),
    bs=st.sampled_from([1, 2, 4, 8]), chunk=st.sampled_from([None, 1, 2]), window=st.sampled_from([None, 0, 3]),
    data=st.data(),
)
@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_property_matches_reference_over_shapes(b, t, kh, g, bs, chunk, window, data):
    lengths = data.draw(st.lists(st.integers(0, 20), min_size=b, max_size=b))
    args = workload(b, t, kh * g, kh, 4, bs, "float32", lengths=lengths)
    fn = functools.partial(ck.paged_attention, local_window_size=window, config={"pages_per_chunk": chunk})
    got = jax.jit(fn)(*args)
    np.testing.assert_allclose(got, reference(*args, window=window), atol=2e-5, rtol=2e-5)


# --- dispatch, autotune ---


@pytest.mark.cpu_dispatch
@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_default_dispatch_on_cpu_is_xla_and_autotune_caches_a_winner():
    narrow = workload(2, 1, 4, 2, 8, 4, "float32", lengths=[30, 61], max_blocks=16)  # 64 keys wide
    wide = workload(2, 1, 4, 2, 8, 4, "float32", lengths=[30, 61], max_blocks=128)  # 512 keys wide
    with ck.recording() as calls:
        _jit(ck.paged_attention)(*narrow)
        _jit(ck.paged_attention)(*wide)
    assert [(c.op, c.implementation, c.source) for c in calls] == [("paged_attention", "xla", "default")] * 2
    assert [c.config for c in calls] == [{"pages_per_chunk": None}, {"pages_per_chunk": 64}]
    entry = ck.autotune_op("paged_attention", *wide, spec=calls[1].kwargs["spec"], iterations=1)
    assert {m.implementation for m in entry.candidates} == {"xla"}  # Pallas is GPU-only, not timed here
    assert {m.config["pages_per_chunk"] for m in entry.candidates} == {None, 32, 64}
    with ck.recording() as calls:
        _jit(ck.paged_attention)(*wide)
    assert (calls[0].source, calls[0].config) == ("autotune", dict(entry.config))


@pytest.mark.cpu_dispatch
def test_cpu_default_takes_shorter_key_chunks_for_a_short_query_chunk():
    """A decode step (one query per row) reads chunks of 256 keys; a prefill chunk of 2..64
    queries after a cached prefix chunks of 128 (its last chunk's padding is what it pays)."""
    from cairn.kernels._paged_attention import xla

    def chunk(t):
        q = jax.ShapeDtypeStruct((1, t, 4, 8), jnp.float32)
        pages = jax.ShapeDtypeStruct((64, 4, 2, 8), jnp.float32)
        return xla.default_config(q, pages, pages, jax.ShapeDtypeStruct((1, 128), jnp.int32), None)["pages_per_chunk"]

    assert [chunk(t) for t in (1, 2, 32, 64, 65, 512)] == [64, 32, 32, 32, 64, 64]


# --- bad input ---


def test_bad_input_names_the_argument():
    q, kp, vp, tables, lengths = workload(2, 1, 4, 2, 8, 4, "float32", lengths=[5, 9], num_blocks=6)
    run = ck.paged_attention
    with pytest.raises(ValueError, match="query must be"):
        run(q[0], kp, vp, tables, lengths)
    with pytest.raises(ValueError, match="key_pages and value_pages must be"):
        run(q, kp[0], vp, tables, lengths)
    with pytest.raises(ValueError, match="must agree on all but the last axis"):
        run(q, kp, vp[:, :2], tables, lengths)
    with pytest.raises(ValueError, match="num_kv_heads \\(3\\) must divide num_heads \\(4\\)"):
        run(q, jnp.zeros((6, 4, 3, 8)), jnp.zeros((6, 4, 3, 8)), tables, lengths)
    with pytest.raises(ValueError, match="head_dim 8 != key_pages head_dim 4"):
        run(q, kp[..., :4], vp[..., :4], tables, lengths)
    with pytest.raises(ValueError, match="block_tables must be \\[batch=2"):
        run(q, kp, vp, tables[:1], lengths)
    with pytest.raises(ValueError, match="lengths must be \\[batch=2\\]"):
        run(q, kp, vp, tables, lengths[:1])
    with pytest.raises(TypeError, match="block_tables must be an integer array"):
        run(q, kp, vp, tables.astype(jnp.float32), lengths)
    with pytest.raises(TypeError, match="share one dtype"):
        run(q.astype(jnp.bfloat16), kp, vp, tables, lengths)
    with pytest.raises(TypeError, match="lengths must be an integer array"):
        run(q, kp, vp, tables, lengths.astype(jnp.float32))
    with pytest.raises(ValueError, match="lengths of row 1 is 99, outside \\[0, max_blocks_per_seq"):
        run(q, kp, vp, tables, jnp.array([5, 99]))
    bad = tables.at[1, 1].set(6)
    with pytest.raises(ValueError, match="block_tables\\[1, 1\\] = 6 is not a block id in \\[0, num_blocks=6\\)"):
        run(q, kp, vp, bad, lengths)
    with pytest.raises(ValueError, match="block_tables\\[0, 0\\] = -1"):
        run(q, kp, vp, tables.at[0, 0].set(-1), lengths)
    with pytest.raises(ValueError, match="local_window_size must be an int w or a pair \\(w, 0\\)"):
        run(q, kp, vp, tables, lengths, local_window_size=(3, 2))
    with pytest.raises(ValueError, match="local_window_size must be a non-negative int"):
        run(q, kp, vp, tables, lengths, local_window_size=-1)
    with pytest.raises(ValueError, match="logits_soft_cap must be > 0"):
        run(q, kp, vp, tables, lengths, logits_soft_cap=0.0)
    with pytest.raises(ValueError, match="config key.*unknown to implementation 'xla'"):
        run(q, kp, vp, tables, lengths, config={"chunk_size": 4})
    with pytest.raises(ValueError, match="pages_per_chunk must be None or an int >= 1"):
        run(q, kp, vp, tables, lengths, config={"pages_per_chunk": 0})
    with pytest.raises(ValueError, match="unknown implementation 'nope' for op 'paged_attention'"):
        run(q, kp, vp, tables, lengths, implementation="nope")


def test_unused_table_entries_are_never_checked_or_read():
    q, kp, vp, tables, lengths = workload(2, 1, 4, 2, 8, 4, "float32", lengths=[5, 9])
    junk = tables.at[0, 2:].set(10**6)  # row 0 uses 2 blocks; the rest is never read
    got = ck.paged_attention(q, kp, vp, junk, lengths)  # eager: the used ids are checked, not the rest
    np.testing.assert_allclose(got, reference(q, kp, vp, tables, lengths), atol=2e-5, rtol=2e-5)


# --- paged_kv_write ---


def _write_reference(kp, vp, nk, nv, tables, positions):
    kp, vp = np.array(kp), np.array(vp)
    bs = kp.shape[1]
    for b, t in np.ndindex(*np.shape(positions)):
        p = int(positions[b, t])
        if p >= 0:
            page = int(tables[b, p // bs])
            kp[page, p % bs], vp[page, p % bs] = nk[b, t], nv[b, t]
    return kp, vp


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_paged_kv_write_matches_reference_and_skips_negative_positions():
    _, kp, vp, tables, _ = workload(3, 1, 4, 2, 8, 4, "float32", lengths=[6, 11, 3], shared=False)
    nk = jax.random.normal(jax.random.key(5), (3, 3, 2, 8))
    nv = jax.random.normal(jax.random.key(6), (3, 3, 2, 8))
    positions = jnp.array([[3, 4, 5], [8, 9, 10], [-1, -1, 2]], jnp.int32)  # a chunk, a chunk, one + padding
    got = jax.jit(ck.paged_kv_write)(kp, vp, nk, nv, tables, positions)
    want = _write_reference(kp, vp, nk, nv, tables, positions)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.slow  # over 3 s in the default run: keeping nox -s tests under 10 minutes
def test_paged_kv_write_then_attention_equals_contiguous_decode():
    """Tokens written one decode step at a time into scattered pages read back as the contiguous cache."""
    s, kh, h, bs = 11, 2, 8, 4
    k = jax.random.normal(jax.random.key(1), (1, s, kh, h))
    v = jax.random.normal(jax.random.key(2), (1, s, kh, h))
    q = jax.random.normal(jax.random.key(3), (1, 1, 4, h))
    kp, vp = jnp.zeros((7, bs, kh, h)), jnp.zeros((7, bs, kh, h))
    tables = jnp.array([[6, 2, 4]], jnp.int32)
    write = jax.jit(ck.paged_kv_write, donate_argnums=(0, 1))
    for pos in range(s):
        kp, vp = write(kp, vp, k[:, pos : pos + 1], v[:, pos : pos + 1], tables, jnp.array([[pos]], jnp.int32))
    got = ck.paged_attention(q, kp, vp, tables, jnp.array([s], jnp.int32))
    np.testing.assert_allclose(got, ck.dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_paged_kv_write_updates_donated_pages_in_place():
    kp, vp = jnp.zeros((4, 2, 1, 8)), jnp.zeros((4, 2, 1, 8))
    new = jnp.ones((1, 1, 1, 8))
    args = (new, new, jnp.array([[1, 3]], jnp.int32), jnp.array([[2]], jnp.int32))
    write = jax.jit(ck.paged_kv_write, donate_argnums=(0, 1))
    hlo = write.lower(kp, vp, *args).compile().as_text()
    assert "input_output_alias" in hlo  # both page arrays alias an output: updated in place
    out_k, _ = write(kp, vp, *args)
    assert kp.is_deleted() and float(out_k[3, 0, 0, 0]) == 1.0


def test_paged_kv_write_bad_input():
    kp = vp = jnp.zeros((4, 2, 1, 8))
    new = jnp.ones((1, 2, 1, 8))
    tables = jnp.array([[1, 3]], jnp.int32)
    write = ck.paged_kv_write
    with pytest.raises(ValueError, match="new_keys \\(1, 2, 1, 4\\)"):
        write(kp, vp, new[..., :4], new, tables, jnp.array([[0, 1]]))
    with pytest.raises(ValueError, match="positions must be \\[batch=1, q_len=2\\]"):
        write(kp, vp, new, new, tables, jnp.array([0, 1]))
    with pytest.raises(TypeError, match="must match the pages"):
        write(kp, vp, new.astype(jnp.bfloat16), new, tables, jnp.array([[0, 1]]))
    with pytest.raises(TypeError, match="positions must be an integer array"):
        write(kp, vp, new, new, tables, jnp.array([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="the last position \\+ 1 of row 0 is 5, outside"):
        write(kp, vp, new, new, tables, jnp.array([[3, 4]]))
    with pytest.raises(ValueError, match="block_tables\\[0, 1\\] = 9 is not a block id"):
        write(kp, vp, new, new, tables.at[0, 1].set(9), jnp.array([[2, 3]]))


def test_autotune_from_shapes_times_full_rows_not_empty_ones():
    """``ck.autotune`` over abstract shapes: the op's example hook gives valid tables and full lengths."""
    from cairn.kernels import _registry

    q = jax.ShapeDtypeStruct((2, 1, 4, 8), jnp.float32)
    pages = jax.ShapeDtypeStruct((40, 4, 2, 8), jnp.float32)
    tables, lengths = jax.ShapeDtypeStruct((2, 16), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    args = _registry.example_args("paged_attention", (q, pages, pages, tables, lengths), {})
    assert args[3].tolist() == (np.arange(32).reshape(2, 16) % 40).tolist() and args[4].tolist() == [64, 64]
    result = ck.autotune(lambda *a: ck.paged_attention(*a), q, pages, pages, tables, lengths, iterations=1)
    (entry,) = result.entries
    assert entry.op == "paged_attention" and all(m.error is None for m in entry.candidates)


def test_bfloat16_write_and_read_never_convert_the_whole_pool():
    """XLA:CPU has no bfloat16 gather/scatter: done naively it converts every page to float32 each step."""
    pages = jax.ShapeDtypeStruct((512, 16, 2, 64), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((4, 1, 2, 64), jnp.bfloat16)
    tables, ints = jax.ShapeDtypeStruct((4, 32), jnp.int32), jax.ShapeDtypeStruct((4, 1), jnp.int32)
    write = jax.jit(ck.paged_kv_write, donate_argnums=(0, 1)).lower(pages, pages, new, new, tables, ints)
    q, lengths = jax.ShapeDtypeStruct((4, 1, 8, 64), jnp.bfloat16), jax.ShapeDtypeStruct((4,), jnp.int32)
    texts = [write.compile().as_text()] + [
        _jit(ck.paged_attention, implementation="xla", config={"pages_per_chunk": c}).lower(q, pages, pages, tables, lengths).compile().as_text()
        for c in (None, 4)]
    for text in texts:
        assert "f32[512,16,2,64]" not in text and "f32[8192," not in text
    assert "input_output_alias" in texts[0]


def test_paged_kv_write_bfloat16_is_exact():
    kp, vp = jnp.zeros((4, 2, 1, 8), jnp.bfloat16), jnp.ones((4, 2, 1, 8), jnp.bfloat16)
    nk = jax.random.normal(jax.random.key(1), (1, 3, 1, 8)).astype(jnp.bfloat16)
    tables, positions = jnp.array([[3, 0]], jnp.int32), jnp.array([[0, 1, 2]], jnp.int32)
    got = ck.paged_kv_write(kp, vp, nk, nk, tables, positions)
    want = _write_reference(np.asarray(kp, np.float32), np.asarray(vp, np.float32), np.asarray(nk, np.float32),
                            np.asarray(nk, np.float32), tables, positions)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32), w)


@pytest.mark.parametrize("pages_per_chunk", [None, 4])
def test_a_decode_step_reads_the_gathered_pages_without_a_transposed_copy(pages_per_chunk):
    """One query row: the products are a multiply and a reduction; as dots, XLA:CPU copied the
    gathered keys and values into a transposed layout on every step (a quarter of a decode step)."""
    pages = jax.ShapeDtypeStruct((128, 16, 2, 64), jnp.float32)
    tables, lengths = jax.ShapeDtypeStruct((8, 16), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32)
    q = jax.ShapeDtypeStruct((8, 1, 4, 64), jnp.float32)
    text = _jit(ck.paged_attention, implementation="xla", config={"pages_per_chunk": pages_per_chunk}).lower(
        q, pages, pages, tables, lengths).compile().as_text()
    width = 256 if pages_per_chunk is None else 64
    transposed = [ln for ln in text.splitlines() if "transpose" in ln and f"f32[8,2,64,{width}]" in ln]
    assert not transposed, transposed
