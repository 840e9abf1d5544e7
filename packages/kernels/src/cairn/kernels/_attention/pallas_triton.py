"""The ``pallas_triton`` implementation of ``dot_product_attention`` (flash attention).

Three ``pl.pallas_call`` kernels with Triton compiler params: the forward (online softmax
over key blocks, saving the log-sum-exp), and the backward as a ``dq`` kernel (one program
per query block) and a ``dk/dv`` kernel (one program per key block and query head; the
heads of a kv group are summed afterwards). Causal and window masks shrink each program's
loop to the blocks it can see. Lengths that are not multiples of the blocks are padded
(padded keys are masked by position, padded queries cropped); the head dim is padded to a
power of two (at least 16), as Triton's dot needs.

On a backend without a GPU the kernels run with ``interpret=True`` (the HLO interpreter).
Takes: causal, window, soft cap, lengths, segment ids, GQA. Not: ``bias``, a dense
``mask``, dropout (use ``xla``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cairn.kernels._attention.common import (
    AttentionSpec,
    position_mask,
    soft_cap_grad,
    transform_logits,
)
from cairn.kernels._registry import Implementation
from cairn.kernels._tiling import pad_axis, round_up

_POISON: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cairn_kernels_poison", default=False
)
_INF = float("inf")


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Test hook: kernels write into NaN-filled output buffers (``input_output_aliases``).

    Any output element a kernel fails to write stays NaN, so a test that sees no NaN
    proves every element was written on this run (not left over from an earlier one).
    """
    token = _POISON.set(True)
    try:
        yield
    finally:
        _POISON.reset(token)


def _pallas(
    kernel: Callable[..., None], n_in: int, out_shape: Sequence[jax.ShapeDtypeStruct], **kw: Any
) -> Any:
    """``pl.pallas_call`` whose outputs, under :func:`poisoned_outputs`, alias NaN-filled inputs."""
    if not _POISON.get():
        return pl.pallas_call(kernel, out_shape=list(out_shape), **kw)
    n_out = len(out_shape)

    def aliased(*refs: Any) -> None:
        kernel(*refs[:n_in], *refs[n_in + n_out :])

    in_specs = list(kw.pop("in_specs")) + list(kw["out_specs"])
    call = pl.pallas_call(
        aliased,
        out_shape=list(out_shape),
        in_specs=in_specs,
        input_output_aliases={n_in + i: i for i in range(n_out)},
        **kw,
    )

    def run(*args: Any) -> Any:
        poison = [
            jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -1, s.dtype)
            for s in out_shape
        ]
        return call(*args, *poison)

    return run


def _reach(spec: AttentionSpec) -> tuple[float, float]:
    """How far left and right of its position a query can see (``inf`` = unbounded)."""
    left = float(spec.window[0]) if spec.window is not None else _INF
    right = float(spec.window[1]) if spec.window is not None else _INF
    if spec.is_causal:
        right = min(right, 0.0)
    return left, right


def _block_range(
    start: Any, size: int, other: int, n_other: int, before: float, after: float
) -> tuple[Any, Any]:
    """Blocks of the other side (block size ``other``) within ``[start - before, start + size + after)``."""
    lo = 0 if before == _INF else jnp.maximum(0, (start - int(before)) // other)
    hi = (
        n_other
        if after == _INF
        else jnp.minimum(n_other, (start + size + int(after) + other - 1) // other)
    )
    return lo, hi


def _dot(a: Any, b: Any, trans_b: bool = False) -> Any:
    if trans_b:
        return jax.lax.dot_general(
            a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _visible(
    spec: AttentionSpec, q_pos: Any, k_pos: Any, s_len: int | None, qseg: Any, kseg: Any
) -> Any:
    vis = position_mask(spec, q_pos, k_pos, kv_len=s_len)
    if spec.use_segments:
        seg = qseg[:, None] == kseg[None, :]
        vis = seg if vis is None else vis & seg
    return vis


def _fwd_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    qs_ref: Any,
    ks_ref: Any,
    o_ref: Any,
    lse_ref: Any,
    *,
    spec: AttentionSpec,
    bq: int,
    bk: int,
    s_len: int | None,
    nk: int,
) -> None:
    i = pl.program_id(2)
    q = q_ref[...]
    qseg = qs_ref[...]
    q_pos = i * bq + jnp.arange(bq)[:, None]
    left, right = _reach(spec)
    lo, hi = _block_range(i * bq, bq, bk, nk, left, right)

    def body(j: Any, carry: Any) -> Any:
        m, l_sum, acc = carry
        start = pl.multiple_of(j * bk, bk)
        raw = _dot(q, k_ref[pl.ds(start, bk), :], trans_b=True)
        s = transform_logits(spec, raw)
        vis = _visible(
            spec, q_pos, start + jnp.arange(bk)[None, :], s_len, qseg, ks_ref[pl.ds(start, bk)]
        )
        if vis is not None:
            s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        acc = acc * alpha[:, None] + _dot(p.astype(v_ref.dtype), v_ref[pl.ds(start, bk), :])
        return m_new, l_sum * alpha + jnp.sum(p, axis=1), acc

    init = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
    )
    m, l_sum, acc = jax.lax.fori_loop(lo, hi, body, init)
    empty = l_sum == 0.0
    safe_l = jnp.where(empty, 1.0, l_sum)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, 0.0, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l))


def _probs(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    q_pos: Any,
    k_pos: Any,
    s_len: int | None,
    qseg: Any,
    kseg: Any,
    lse: Any,
) -> tuple[Any, Any]:
    raw = _dot(q, k, trans_b=True)
    s = transform_logits(spec, raw)
    vis = _visible(spec, q_pos, k_pos, s_len, qseg, kseg)
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    return raw, jnp.exp(s - lse[:, None])


def _dq_kernel(
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    qs_ref: Any,
    ks_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    dq_ref: Any,
    *,
    spec: AttentionSpec,
    bq: int,
    bk: int,
    s_len: int | None,
    nk: int,
) -> None:
    i = pl.program_id(2)
    q, do, lse, delta, qseg = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], qs_ref[...]
    q_pos = i * bq + jnp.arange(bq)[:, None]
    left, right = _reach(spec)
    lo, hi = _block_range(i * bq, bq, bk, nk, left, right)

    def body(j: Any, dq: Any) -> Any:
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        raw, p = _probs(
            spec,
            q,
            k,
            q_pos,
            start + jnp.arange(bk)[None, :],
            s_len,
            qseg,
            ks_ref[pl.ds(start, bk)],
            lse,
        )
        dp = _dot(do, v_ref[pl.ds(start, bk), :], trans_b=True)
        draw = soft_cap_grad(spec, raw, p * (dp - delta[:, None]))
        return dq + _dot(draw.astype(k.dtype), k)

    dq = jax.lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    k_ref: Any,
    v_ref: Any,
    ks_ref: Any,
    q_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    qs_ref: Any,
    dk_ref: Any,
    dv_ref: Any,
    *,
    spec: AttentionSpec,
    bq: int,
    bk: int,
    s_len: int | None,
    nq: int,
) -> None:
    j = pl.program_id(2)
    k, v, kseg = k_ref[...], v_ref[...], ks_ref[...]
    k_pos = j * bk + jnp.arange(bk)[None, :]
    left, right = _reach(spec)
    lo, hi = _block_range(j * bk, bk, bq, nq, right, left)

    def body(i: Any, carry: Any) -> Any:
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(start, bq), :]
        do = do_ref[pl.ds(start, bq), :]
        raw, p = _probs(
            spec,
            q,
            k,
            start + jnp.arange(bq)[:, None],
            k_pos,
            s_len,
            qs_ref[pl.ds(start, bq)],
            kseg,
            lse_ref[pl.ds(start, bq)],
        )
        dv = dv + _dot(p.astype(do.dtype).T, do)
        dp = _dot(do, v, trans_b=True)
        draw = soft_cap_grad(spec, raw, p * (dp - delta_ref[pl.ds(start, bq)][:, None]))
        return dk + _dot(draw.astype(q.dtype).T, q), dv

    dk, dv = jax.lax.fori_loop(
        lo, hi, body, (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    )
    dk_ref[...] = dk
    dv_ref[...] = dv


# --- the differentiable flash attention ---


def _params(cfg: Mapping[str, Any]) -> Any:
    return pl_triton.CompilerParams(
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"])
    )


def _forward(
    q: Any,
    k: Any,
    v: Any,
    qseg: Any,
    kseg: Any,
    spec: AttentionSpec,
    cfg: Mapping[str, Any],
    s_len: int,
    interpret: bool,
) -> tuple[Any, Any]:
    b, tp, n, d = q.shape
    sp, kh, dv = k.shape[1], k.shape[2], v.shape[3]
    g, bq, bk = n // kh, cfg["block_q"], cfg["block_k"]
    kernel = functools.partial(
        _fwd_kernel, spec=spec, bq=bq, bk=bk, s_len=s_len if s_len < sp else None, nk=sp // bk
    )
    return _pallas(
        kernel,
        5,
        [
            jax.ShapeDtypeStruct((b, tp, n, dv), q.dtype),
            jax.ShapeDtypeStruct((b, n, tp), jnp.float32),
        ],
        grid=(b, n, tp // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, d), lambda b_, h, i: (b_, i, h, 0)),
            pl.BlockSpec((None, sp, None, d), lambda b_, h, i: (b_, 0, h // g, 0)),
            pl.BlockSpec((None, sp, None, dv), lambda b_, h, i: (b_, 0, h // g, 0)),
            pl.BlockSpec((None, bq), lambda b_, h, i: (b_, i)),
            pl.BlockSpec((None, sp), lambda b_, h, i: (b_, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, dv), lambda b_, h, i: (b_, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b_, h, i: (b_, h, i)),
        ],
        compiler_params=_params(cfg),
        interpret=interpret,
        name="cairn_attention_fwd",
    )(q, k, v, qseg, kseg)


def _backward(
    res: Any, do: Any, spec: AttentionSpec, cfg: Mapping[str, Any], s_len: int, interpret: bool
) -> Any:
    q, k, v, qseg, kseg, out, lse = res
    b, tp, n, d = q.shape
    sp, kh, dv = k.shape[1], k.shape[2], v.shape[3]
    g, bq, bk = n // kh, cfg["block_q"], cfg["block_k"]
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    kv_len = s_len if s_len < sp else None

    def row(width):
        return pl.BlockSpec((None, bq, None, width), lambda b_, h, i: (b_, i, h, 0))

    dq = _pallas(
        functools.partial(_dq_kernel, spec=spec, bq=bq, bk=bk, s_len=kv_len, nk=sp // bk),
        8,
        [jax.ShapeDtypeStruct(q.shape, q.dtype)],
        grid=(b, n, tp // bq),
        in_specs=[
            row(d),
            pl.BlockSpec((None, sp, None, d), lambda b_, h, i: (b_, 0, h // g, 0)),
            pl.BlockSpec((None, sp, None, dv), lambda b_, h, i: (b_, 0, h // g, 0)),
            pl.BlockSpec((None, bq), lambda b_, h, i: (b_, i)),
            pl.BlockSpec((None, sp), lambda b_, h, i: (b_, 0)),
            row(dv),
            pl.BlockSpec((None, None, bq), lambda b_, h, i: (b_, h, i)),
            pl.BlockSpec((None, None, bq), lambda b_, h, i: (b_, h, i)),
        ],
        out_specs=[row(d)],
        compiler_params=_params(cfg),
        interpret=interpret,
        name="cairn_attention_dq",
    )(q, k, v, qseg, kseg, do, lse, delta)[0]

    def col(width):
        return pl.BlockSpec((None, bk, None, width), lambda b_, h, j: (b_, j, h, 0))

    def full(width):
        return pl.BlockSpec((None, tp, None, width), lambda b_, h, j: (b_, 0, h, 0))

    dk, dvv = _pallas(
        functools.partial(_dkv_kernel, spec=spec, bq=bq, bk=bk, s_len=kv_len, nq=tp // bq),
        8,
        [
            jax.ShapeDtypeStruct((b, sp, n, d), jnp.float32),
            jax.ShapeDtypeStruct((b, sp, n, dv), jnp.float32),
        ],
        grid=(b, n, sp // bk),
        in_specs=[
            pl.BlockSpec((None, bk, None, d), lambda b_, h, j: (b_, j, h // g, 0)),
            pl.BlockSpec((None, bk, None, dv), lambda b_, h, j: (b_, j, h // g, 0)),
            pl.BlockSpec((None, bk), lambda b_, h, j: (b_, j)),
            full(d),
            full(dv),
            pl.BlockSpec((None, None, tp), lambda b_, h, j: (b_, h, 0)),
            pl.BlockSpec((None, None, tp), lambda b_, h, j: (b_, h, 0)),
            pl.BlockSpec((None, tp), lambda b_, h, j: (b_, 0)),
        ],
        out_specs=[col(d), col(dv)],
        compiler_params=_params(cfg),
        interpret=interpret,
        name="cairn_attention_dkv",
    )(k, v, kseg, q, do, lse, delta, qseg)

    def group_sum(x, like):
        return x.reshape(b, sp, kh, g, -1).sum(axis=3).astype(like.dtype)

    return dq, group_sum(dk, k), group_sum(dvv, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(
    q: Any,
    k: Any,
    v: Any,
    qseg: Any,
    kseg: Any,
    spec: AttentionSpec,
    cfg: tuple[Any, ...],
    s_len: int,
    interpret: bool,
) -> Any:
    return _forward(q, k, v, qseg, kseg, spec, dict(cfg), s_len, interpret)[0]


def _flash_fwd(
    q: Any,
    k: Any,
    v: Any,
    qseg: Any,
    kseg: Any,
    spec: AttentionSpec,
    cfg: tuple[Any, ...],
    s_len: int,
    interpret: bool,
) -> Any:
    out, lse = _forward(q, k, v, qseg, kseg, spec, dict(cfg), s_len, interpret)
    return out, (q, k, v, qseg, kseg, out, lse)


def _flash_bwd(
    spec: AttentionSpec, cfg: tuple[Any, ...], s_len: int, interpret: bool, res: Any, do: Any
) -> Any:
    dq, dk, dv = _backward(res, do, spec, dict(cfg), s_len, interpret)

    def zero(x):
        return jnp.zeros(x.shape, jax.dtypes.float0)

    return dq, dk, dv, zero(res[3]), zero(res[4])


_flash.defvjp(_flash_fwd, _flash_bwd)


def padded_call(
    flash: Callable[..., Any],
    q: Any,
    k: Any,
    v: Any,
    kw: Mapping[str, Any],
    cfg: Mapping[str, Any],
    interpret: bool,
    *,
    head_multiple: int = 16,
) -> Any:
    """Pads lengths to the blocks and the head dims, runs ``flash``, crops the result."""
    spec: AttentionSpec = kw["spec"]
    b, t, _n, d = q.shape
    s_len, dv = k.shape[1], v.shape[3]
    bq, bk = cfg["block_q"], cfg["block_k"]
    tp, sp = round_up(t, bq), round_up(s_len, bk)
    dp = max(head_multiple, 1 << (d - 1).bit_length())
    dvp = max(head_multiple, 1 << (dv - 1).bit_length())
    qseg = kw.get("q_segments")
    kseg = kw.get("kv_segments")
    qseg = jnp.zeros((b, t), jnp.int32) if qseg is None else qseg
    kseg = jnp.zeros((b, s_len), jnp.int32) if kseg is None else kseg
    qp = pad_axis(pad_axis(q, 1, tp), 3, dp)
    kp = pad_axis(pad_axis(k, 1, sp), 3, dp)
    vp = pad_axis(pad_axis(v, 1, sp), 3, dvp)
    out = flash(
        qp,
        kp,
        vp,
        pad_axis(qseg, 1, tp, -1),
        pad_axis(kseg, 1, sp, -2),
        spec,
        tuple(sorted(cfg.items())),
        s_len,
        interpret,
    )
    return out[:, :t, :, :dv]


def check_config(cfg: Mapping[str, Any], name: str) -> None:
    """Raises ``ValueError`` naming the config key whose block size is not a power of two >= 16."""
    for key in ("block_q", "block_k"):
        val = cfg.get(key)
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"{name} config {key} must be a power of two >= 16, got {val!r}")


def run(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    config: Mapping[str, Any],
    interpret: bool,
    **kw: Any,
) -> jax.Array:
    """``Implementation.fn`` of ``pallas_triton``."""
    check_config(config, "pallas_triton")
    return padded_call(_flash, q, k, v, kw, config, interpret)


def supports(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> str | None:
    """``None``, or why ``pallas_triton`` cannot take these arguments."""
    if kw.get("bias") is not None:
        return "bias is not supported (use implementation='xla')"
    if kw.get("mask") is not None:
        return "a dense mask is not supported (pass is_causal, local_window_size, *_seq_lengths or segment_ids, or use 'xla')"
    if kw.get("dropout_rate", 0.0) > 0.0:
        return "dropout is not supported (use implementation='xla')"
    if max(q.shape[-1], v.shape[-1]) > 256:
        return f"head_dim {max(q.shape[-1], v.shape[-1])} > 256 is not supported"
    return None


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, 1 << max(0, (n - 1).bit_length())))


def default_config(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> Mapping[str, Any]:
    """Blocks of 64 (smaller for short sequences), 4 warps, 2 stages."""
    return {
        "block_q": _block(q.shape[1], 64),
        "block_k": _block(k.shape[1], 64),
        "num_warps": 4,
        "num_stages": 2,
    }


def configs(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> Sequence[Mapping[str, Any]]:
    """Block sizes 32..128 that fit the lengths, with 4 or 8 warps."""
    out = []
    for bq in (32, 64, 128):
        for bk in (32, 64, 128):
            if bq > _block(q.shape[1], 128) or bk > _block(k.shape[1], 128):
                continue
            for warps in (4, 8):
                out.append({"block_q": bq, "block_k": bk, "num_warps": warps, "num_stages": 2})
    return out or [dict(default_config(q, k, v))]


IMPLEMENTATION = Implementation(
    op="dot_product_attention",
    name="pallas_triton",
    fn=run,
    platforms=frozenset({"gpu"}),
    configs=configs,
    default_config=default_config,
    supports=supports,
)
