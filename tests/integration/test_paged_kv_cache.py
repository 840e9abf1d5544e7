"""cairn.serving.PagedCache + cairn.kernels.paged_kv_write / paged_attention, as an engine composes them.

One attention layer whose keys and values depend on the token and its position: request A
prefills a shared system prompt and its own suffix; request B, admitted later, reuses A's
system-prompt blocks (prefix cache), prefills only its suffix (a chunked prefill after a
cached prefix), then both decode together in one batch, claiming blocks as they grow.
Every output equals contiguous causal attention over the request's whole sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import cairn.kernels as ck
from cairn.serving import PagedCache

VOCAB, HEADS, KV_HEADS, DIM, BS = 50, 4, 2, 8, 4
_W = jax.random.normal(jax.random.key(0), (3, VOCAB, KV_HEADS * DIM + HEADS * DIM))


def project(tokens, positions, xp=jnp):
    """(q, k, v) of tokens at positions: ``[len, heads, dim]`` each (``xp``: jax.numpy or numpy)."""
    w = _W if xp is jnp else np.asarray(_W, np.float64)
    angle = xp.asarray(positions)[:, None] * 0.1

    def part(i, heads):
        x = w[i, xp.asarray(tokens)][:, : heads * DIM] + xp.sin(angle + i)
        return x.reshape(-1, heads, DIM)

    return part(0, HEADS), part(1, KV_HEADS), part(2, KV_HEADS)


def contiguous_last(tokens, t):
    """float64 causal attention over the whole contiguous sequence, its last ``t`` rows (the reference)."""
    q, k, v = project(tokens, np.arange(len(tokens)), xp=np)
    n = len(tokens)
    out = np.zeros((t, HEADS, DIM))
    for row, i in enumerate(range(n - t, n)):
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            s = k[: i + 1, kv] @ q[i, h] / np.sqrt(DIM)
            p = np.exp(s - s.max())
            out[row, h] = p / p.sum() @ v[: i + 1, kv]
    return out


@functools.partial(jax.jit, donate_argnums=(0, 1))
def step(kp, vp, tokens, positions, tables, lengths):
    """Project the new tokens, write their keys/values into their pages, attend over the tables."""
    q, k, v = jax.vmap(project)(tokens, positions)
    kp, vp = ck.paged_kv_write(kp, vp, k, v, tables, positions)
    return kp, vp, ck.paged_attention(q, kp, vp, tables, lengths)


def test_prefix_shared_prefill_then_batched_decode_equals_contiguous():
    cache = PagedCache(num_blocks=16, block_size=BS, max_blocks_per_seq=8)
    kp, vp = jnp.zeros((16, BS, KV_HEADS, DIM)), jnp.zeros((16, BS, KV_HEADS, DIM))
    system = [3, 1, 4, 1, 5, 9, 2, 6]  # two full blocks
    seqs = {"a": system + [7, 7, 7], "b": system + [8, 2, 8, 1, 8]}

    for name, tokens in seqs.items():
        cached = cache.add_sequence(name, tokens)
        new = np.arange(cached, len(tokens))
        tables = cache.block_tables([name])
        kp, vp, out = step(kp, vp, jnp.asarray([tokens[cached:]]), jnp.asarray([new], jnp.int32),
                           jnp.asarray(tables), jnp.asarray([len(tokens)], jnp.int32))
        np.testing.assert_allclose(out[0], contiguous_last(tokens, len(new)), atol=1e-4, rtol=1e-4)
    assert cache.num_cached_tokens("b") == 8 and cache.stats().hits == 2
    assert cache.block_table("a")[:2] == cache.block_table("b")[:2]

    for i in range(6):  # both decode together; b's tail block fills and a new one is claimed
        order = ["a", "b"]
        nxt = [[10 + i], [20 + i]]
        for name, tok in zip(order, nxt):
            cache.append_tokens(name, tok)
            seqs[name] = seqs[name] + tok
        positions = jnp.asarray([[len(seqs[n]) - 1] for n in order], jnp.int32)
        lengths = jnp.asarray([len(seqs[n]) for n in order], jnp.int32)
        kp, vp, out = step(kp, vp, jnp.asarray(nxt), positions, jnp.asarray(cache.block_tables(order)), lengths)
        for row, name in enumerate(order):
            np.testing.assert_allclose(out[row], contiguous_last(seqs[name], 1), atol=1e-4, rtol=1e-4)
    assert cache.num_used_blocks == 2 + 3 + 3  # shared system prompt + a's and b's own blocks
    cache.free("a")
    cache.free("b")
    assert cache.num_used_blocks == 0
