"""Float64 NumPy attention (values and gradients), the independent reference of the tests."""

import numpy as np


def visible(t, s, *, is_causal=False, window=None, q_lens=None, kv_lens=None, q_seg=None, kv_seg=None,
            mask=None, batch=1, heads=1):
    """Boolean [B, N, T, S]: which keys each query sees."""
    i = np.arange(t)[:, None]
    j = np.arange(s)[None, :]
    vis = np.ones((batch, heads, t, s), bool)
    if is_causal:
        vis &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (j >= i - left) & (j <= i + right)
    if q_lens is not None:
        vis &= (np.arange(t)[None, :] < np.asarray(q_lens)[:, None])[:, None, :, None]
    if kv_lens is not None:
        vis &= (np.arange(s)[None, :] < np.asarray(kv_lens)[:, None])[:, None, None, :]
    if q_seg is not None:
        vis &= (np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :])[:, None]
    if mask is not None:
        vis &= np.broadcast_to(np.asarray(mask, bool), vis.shape)
    return vis


def attention(q, k, v, do, *, scale=None, bias=None, soft_cap=None, **mask_kw):
    """(out, dq, dk, dv) in float64 for q [B,T,N,H], k/v [B,S,K,H], cotangent do [B,T,N,Hv]."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = 1.0 / np.sqrt(h) if scale is None else scale
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = np.einsum("btnh,bsnh->bnts", q, kr)
    logits = raw * scale
    if bias is not None:
        logits = logits + np.broadcast_to(np.asarray(bias, np.float64), logits.shape)
    pre_cap = logits
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    vis = visible(t, s, batch=b, heads=n, **mask_kw)
    z = np.where(vis, logits, -np.inf)
    m = np.max(z, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(vis, np.exp(z - m), 0.0)
    denom = e.sum(-1, keepdims=True)
    p = e / np.where(denom == 0, 1.0, denom)
    out = np.einsum("bnts,bsnh->btnh", p, vr)
    dp = np.einsum("btnh,bsnh->bnts", do, vr)
    dvr = np.einsum("bnts,btnh->bsnh", p, do)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    if soft_cap is not None:
        ds = ds * (1.0 - np.tanh(pre_cap / soft_cap) ** 2)
    ds = ds * scale
    dq = np.einsum("bnts,bsnh->btnh", ds, kr)
    dkr = np.einsum("bnts,btnh->bsnh", ds, q)
    dk = dkr.reshape(b, s, kh, g, h).sum(3)
    dv = dvr.reshape(b, s, kh, g, -1).sum(3)
    return out, dq, dk, dv
