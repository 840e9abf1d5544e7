"""Per-request sampling: :class:`SamplingParams` and a host-side NumPy sampler.

Sampling runs on the host from the float32 logits the decode step returns. Randomness
comes from ``(seed, token index)`` alone (:func:`uniform`: the ``index``-th output of a
SplitMix64 stream seeded by ``seed``, a counter-based generator, so no state is carried
between tokens), so a request's tokens depend on nothing but its own logits, seed and
position: never on the other requests in the batch, the slot it landed in or how many
steps the engine ran before it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["SamplingParams", "apply_penalties", "filtered_probs", "log_softmax", "sample_rows", "sample_token",
           "top_logprobs", "uniform", "uniforms"]

_MAX_SEED = 2**64
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound)


def _int_field(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v >= hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"SamplingParams.{name} must be {bound}, got {v}")
    return v


def _float_field(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Args:
      max_new_tokens: tokens to generate at most (>= 1).
      temperature: 0 decodes greedily (argmax); > 0 samples from ``softmax(logits / t)``.
      top_k: keep the ``k`` most likely tokens (0: off).
      top_p: keep the smallest set of most likely tokens whose probability reaches
        ``top_p`` (nucleus sampling), in ``(0, 1]``; 1 is off.
      seed: the request's seed; the same seed gives the same tokens. ``None``: the
        engine draws one.
      stop_token_ids: tokens that end the request (in addition to the model's EOS ids);
        the stop token is part of the output.
      ignore_eos: keep generating past the model's EOS tokens.
      presence_penalty: in ``[-2, 2]``; OpenAI's presence penalty, subtracted from the
        logit of every token generated so far: ``logit[j] - presence_penalty * (count[j] >
        0)``, ``count[j]`` the times token ``j`` was generated (the prompt does not count).
      frequency_penalty: in ``[-2, 2]``; OpenAI's frequency penalty, subtracted from the
        logits before sampling as ``logit[j] - frequency_penalty * count[j]``.
      logprobs: ``None`` for none; ``k`` >= 0 (at most 20) records each generated
        token's log-probability and the ``k`` most likely alternatives', from the
        model's own distribution (``log_softmax`` of the logits, before temperature,
        penalties, top-k and top-p).
      stop: strings that end the request when the generated text contains one; the
        text ends before it (needs a model with a tokenizer or a vocabulary).

    Raises:
      ValueError: naming the field and the allowed range.

    >>> SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5).top_k
    5
    >>> SamplingParams(max_new_tokens=0)
    Traceback (most recent call last):
    ...
    ValueError: SamplingParams.max_new_tokens must be >= 1, got 0
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "max_new_tokens", _int_field("max_new_tokens", self.max_new_tokens, 1))
        t = _float_field("temperature", self.temperature)
        if t < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 is greedy), got {t}")
        set_(self, "temperature", t)
        set_(self, "top_k", _int_field("top_k", self.top_k, 0))
        p = _float_field("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p}")
        set_(self, "top_p", p)
        if self.seed is not None:
            set_(self, "seed", _int_field("seed", self.seed, 0, _MAX_SEED))
        stops = self.stop_token_ids
        if isinstance(stops, str | bytes) or not isinstance(stops, Sequence | tuple | list):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids, got {stops!r}")
        set_(self, "stop_token_ids", tuple(_int_field("stop_token_ids[]", s, 0) for s in stops))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be true or false, got {self.ignore_eos!r}")
        for k in ("presence_penalty", "frequency_penalty"):
            v = _float_field(k, getattr(self, k))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"SamplingParams.{k} must be in [-2, 2], got {v}")
            set_(self, k, v)
        if self.logprobs is not None:
            set_(self, "logprobs", _int_field("logprobs", self.logprobs, 0, MAX_LOGPROBS + 1))
        set_(self, "stop", _stop_strings(self.stop))

    @property
    def penalized(self) -> bool:
        """Whether a presence or frequency penalty is set."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], vocabulary: Sequence[str | None] | None = None,
                  text_stops: bool = False) -> SamplingParams:
        """Parse the ``"parameters"`` of a generate request (Triton / vLLM names).

        Keys: ``max_new_tokens`` or its alias ``max_tokens``, ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``stop_token_ids``, ``stop``, ``ignore_eos``,
        ``presence_penalty``, ``frequency_penalty`` and ``logprobs``. ``null`` values mean
        the default. ``stop`` (a string or a list of them): with ``text_stops`` (a model
        with a tokenizer), text the output ends before; otherwise each must be the exact
        text of one token of ``vocabulary`` and becomes a stop token id.

        Args:
          obj: the JSON object.
          vocabulary: the model's token texts, for ``stop`` ids.
          text_stops: read ``stop`` as text stop strings.

        Raises:
          ValueError: an unknown key (naming it and listing the known ones), a bad value
            (naming the field), or a ``stop`` string that is not one token.

        >>> SamplingParams.from_json({"max_tokens": 3, "stop": ["b"]}, ["a", "b"]).stop_token_ids
        (1,)
        >>> SamplingParams.from_json({"beam_width": 2})
        Traceback (most recent call last):
        ...
        ValueError: unknown sampling parameter 'beam_width'; known: frequency_penalty, ignore_eos, logprobs, max_new_tokens, max_tokens, presence_penalty, seed, stop, stop_token_ids, temperature, top_k, top_p
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(obj).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | {"max_tokens", "stop"}
        for k in obj:
            if k not in known:
                raise ValueError(f"unknown sampling parameter {k!r}; known: {', '.join(sorted(known))}")
        kw = {k: v for k, v in obj.items() if v is not None and k not in ("max_tokens", "stop")}
        if obj.get("max_tokens") is not None:
            if "max_new_tokens" in kw:
                raise ValueError("give max_new_tokens or its alias max_tokens, not both")
            kw["max_new_tokens"] = obj["max_tokens"]
        if obj.get("stop") is not None and text_stops:
            kw["stop"] = [obj["stop"]] if isinstance(obj["stop"], str) else obj["stop"]
        elif obj.get("stop") is not None:
            stops = list(kw.get("stop_token_ids") or ())
            kw["stop_token_ids"] = stops + _stop_ids(obj["stop"], vocabulary)
        return cls(**kw)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str) or not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def _stop_ids(stop: Any, vocabulary: Sequence[str | None] | None) -> list[int]:
    """Token ids of the ``stop`` strings (a string or a list of them)."""
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError(f"SamplingParams.stop must be a string or a list of strings, got {stop!r}")
    if strings and vocabulary is None:
        raise ValueError("SamplingParams.stop needs a model with a vocabulary; use stop_token_ids")
    index = {s: i for i, s in reversed(list(enumerate(vocabulary or ()))) if s is not None}
    out = []
    for s in strings:
        if s not in index:
            raise ValueError(f"SamplingParams.stop: {s!r} is not the text of one token of the vocabulary")
        out.append(index[s])
    return out


# --- penalties and log-probabilities ---


def apply_penalties(logits: np.ndarray, counts: Mapping[int, int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties on one row of logits (a float64 copy):
    ``logits[j] - frequency * counts[j] - presence * (counts[j] > 0)``.

    Args:
      logits: ``(vocab,)`` logits. counts: ``{token id: times generated}``.
      presence, frequency: the penalties.

    >>> apply_penalties(np.zeros(3), {1: 2}, 0.5, 0.25).tolist()
    [0.0, -1.0, 0.0]
    """
    out = np.array(logits, np.float64)
    if counts:
        ids = np.fromiter(counts, np.int64, len(counts))
        c = np.fromiter(counts.values(), np.float64, len(counts))
        out[ids] -= frequency * c + presence * (c > 0)
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` of the last axis, in float64.

    Args:
      logits: float logits of any shape.

    >>> np.exp(log_softmax(np.array([0.0, 0.0]))).tolist()
    [0.5, 0.5]
    """
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token id, log-probability)`` of one row, most likely first
    (lower id first among ties).

    Args:
      logprobs: ``(vocab,)`` log-probabilities. k: how many (at most the vocabulary).

    >>> top_logprobs(np.log(np.array([0.2, 0.5, 0.3])), 2)
    [(1, -0.6931471805599453), (2, -1.2039728043259361)]
    """
    n = len(logprobs)
    k = min(k, n)
    if k <= 0:
        return []
    v = np.partition(logprobs, n - k)[n - k]  # the k-th largest
    above = np.flatnonzero(logprobs > v)
    idx = np.concatenate([above, np.flatnonzero(logprobs == v)[: k - len(above)]])  # ties at the cut: lower ids
    idx = np.sort(idx)
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in idx]


# --- the sampler ---


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution a token is sampled from, in float64: softmax of ``logits /
    temperature``, cut to the ``top_k`` most likely tokens, then to the smallest prefix
    of the rest (most likely first) whose mass reaches ``top_p``, renormalised.

    Ties at the cut are broken towards the lower token id.

    Args:
      logits: ``(vocab,)`` float logits. temperature: > 0. top_k: 0 for all.
      top_p: in ``(0, 1]``.

    >>> filtered_probs(np.log(np.array([0.5, 0.3, 0.2])), 1.0, top_p=0.7).round(3).tolist()
    [0.625, 0.375, 0.0]
    """
    z = np.asarray(logits, np.float64) / temperature
    n = len(z)
    if top_k and top_k < n:  # the k largest without sorting everything: ties at the cut go to lower ids
        v = np.partition(z, n - top_k)[n - top_k]
        above = np.flatnonzero(z > v)
        idx = np.concatenate([above, np.flatnonzero(z == v)[: top_k - len(above)]])
    else:
        idx = np.arange(n)
    if top_p < 1.0:
        idx = np.sort(idx)
        idx = idx[np.argsort(-z[idx], kind="stable")]  # most likely first, lower id first among ties
    p = np.exp(z[idx] - z[idx].max())
    p /= p.sum()
    if top_p < 1.0:
        before = np.cumsum(p) - p  # mass of the more likely tokens
        p[before >= top_p] = 0.0
        p /= p.sum()
    out = np.zeros(n)
    out[idx] = p
    return out


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (Stafford's mix 13): a bijection of 64-bit integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """A uniform draw in ``[0, 1)`` that is a pure function of ``(seed, index)``: output
    ``index`` of a SplitMix64 stream whose state starts at a mix of ``seed`` (53 bits).
    About 20x cheaper than building a NumPy generator per token.

    >>> uniform(7, 3) == uniform(7, 3) != uniform(7, 4)
    True
    """
    state = _mix64(seed & _M64)
    return (_mix64((state + (index + 1) * _GOLDEN) & _M64) >> 11) * 2.0**-53


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """:func:`_mix64` on a uint64 array (its products wrap modulo 2**64, as ``& _M64`` does)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(seeds: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """:func:`uniform` of each ``(seeds[i], indices[i])`` at once: the same values, in
    NumPy's wrapping uint64 arithmetic.

    Args:
      seeds: uint64 seeds. indices: uint64 token indices, as many.

    >>> float(uniforms(np.array([7], np.uint64), np.array([3], np.uint64))[0]) == uniform(7, 3)
    True
    """
    with np.errstate(over="ignore"):
        state = _mix64_array(np.asarray(seeds, np.uint64))
        z = _mix64_array(state + (np.asarray(indices, np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, index: int) -> int:
    """Token ``index`` of a request: argmax when greedy, else one draw from
    :func:`filtered_probs` with :func:`uniform` ``(seed, index)``. A one-row
    :func:`sample_rows`, so it gives exactly the engine's tokens.

    >>> sample_token(np.array([0.0, 2.0, 1.0]), SamplingParams(), seed=0, index=0)
    1
    """
    return int(sample_rows(np.asarray(logits)[None], [params], [seed], [index])[0])


_CANDIDATES = 32  # tokens ranked per row before falling back to ranking the whole vocabulary
_MAX_CANDIDATES = 256  # top-k rows below this rank k + 1 tokens
_CHUNK = 1 << 16  # logits per batched call (rows x vocabulary): float64 temporaries stay in cache


def sample_rows(
    logits: np.ndarray, params: Sequence[SamplingParams], seeds: Sequence[int], indices: Sequence[int]
) -> np.ndarray:
    """One token for each row of ``logits``, all rows in a few batched NumPy calls.

    Row ``i`` is token ``indices[i]`` of a request with ``params[i]`` and ``seeds[i]``:
    argmax when greedy, else the token at which the cumulative :func:`filtered_probs`
    (tokens in id order) first exceeds ``uniform(seeds[i], indices[i])`` times its total.
    Every operation is row-wise, so a row's token never depends on the other rows in the
    call. Top-k / top-p rows rank only the ``32`` most likely tokens (``k + 1`` when the
    batch has a top-k below 256); a row whose kept set is not provably among them (a
    larger top-k, a flat distribution, a tie with the last candidate) ranks its whole
    vocabulary, with the same arithmetic, hence the same token. The probabilities are
    normalised over the whole row, so a draw may differ from :func:`filtered_probs`'s
    only where ``u`` or the top-p cut lies within rounding of a boundary.

    Args:
      logits: ``(n, vocab)`` float logits.
      params: ``n`` :class:`SamplingParams`. seeds: ``n`` seeds. indices: ``n`` token
        indices (the draw's position in its request).

    Returns:
      ``(n,)`` int64 token ids.

    Raises:
      ValueError: ``logits`` is not 2-D or the lists do not have one entry per row.

    >>> p = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)]
    >>> sample_rows(np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]), p, [0, 1], [0, 0]).tolist()
    [1, 0]
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or not len(params) == len(seeds) == len(indices) == logits.shape[0]:
        raise ValueError(
            f"sample_rows needs (n, vocab) logits and n params, seeds and indices; got logits {logits.shape}, "
            f"{len(params)} params, {len(seeds)} seeds, {len(indices)} indices"
        )
    out = np.empty(logits.shape[0], np.int64)
    greedy = np.array([p.greedy for p in params], bool)
    if greedy.any():
        out[greedy] = np.argmax(logits[greedy], axis=1)  # the first maximum
    rows = np.flatnonzero(~greedy).tolist()
    step = max(1, _CHUNK // max(1, logits.shape[1]))  # rows per call: big vocabularies go in cache-sized chunks
    for lo in range(0, len(rows), step):
        chunk = rows[lo : lo + step]
        u = uniforms(np.array([seeds[i] for i in chunk], np.uint64), np.array([indices[i] for i in chunk], np.uint64))
        out[chunk] = _sample(logits[chunk], [params[i] for i in chunk], u)
    return out


def _sample(logits: np.ndarray, params: list[SamplingParams], u: np.ndarray) -> np.ndarray:
    """Draws for non-greedy rows; ``u``: their uniforms."""
    n, vocab = logits.shape
    temperature = np.array([p.temperature for p in params])
    top_k = np.array([p.top_k if p.top_k < vocab else 0 for p in params], np.int64)
    top_p = np.array([p.top_p for p in params])
    z = np.asarray(logits, np.float64) / temperature[:, None]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    total = e.sum(axis=1)
    out = np.empty(n, np.int64)
    plain = (top_k == 0) & (top_p >= 1.0)  # nothing cut: no ranking needed
    if plain.any():
        ids = np.broadcast_to(np.arange(vocab), (int(plain.sum()), vocab))
        out[plain] = _draw(e[plain], ids, u[plain])  # unnormalised: the draw scales by the total
    rest = np.flatnonzero(~plain)
    if len(rest):
        if len(rest) < n:
            z, e, total = z[rest], e[rest], total[rest]
        top_k, top_p, u = top_k[rest], top_p[rest], u[rest]
        # k + 1 candidates for the top-k rows (rank k must be cut); larger k ranks the whole row
        ks = top_k[top_k < _MAX_CANDIDATES]
        m = min(vocab, max(_CANDIDATES, int(ks.max()) + 1 if len(ks) else 0))
        ok = np.zeros(len(rest), bool)
        if m < vocab:
            # rows whose m most likely tokens hold less than top_p of the mass (a flat
            # distribution) cannot be drawn exactly from them: straight to the whole row
            # (the largest e is exp(0) = 1, so without ties the m most likely hold at most
            # m / total; a row skipped here only takes the whole-row path, which gives
            # the same token)
            idx = np.flatnonzero((top_k > 0) | (m / total >= top_p - 1e-9))
            if len(idx):
                zi, ei = z[idx], e[idx]
                kth = np.partition(zi, vocab - m, axis=1)[:, vocab - m : vocab - m + 1]
                head = np.where(zi >= kth, ei, 0.0).sum(axis=1) / total[idx]  # at least the candidates' mass
                idx = idx[(top_k[idx] > 0) | (head >= top_p[idx] - 1e-9)]
            if len(idx):
                out[rest[idx]], ok[idx] = _filtered_draw(z[idx], e[idx], total[idx], top_k[idx], top_p[idx], u[idx], m)
        if not ok.any():  # every row: no copies
            out[rest], _ = _filtered_draw(z, e, total, top_k, top_p, u, vocab)
        elif not ok.all():
            redo = ~ok
            out[rest[redo]], _ = _filtered_draw(z[redo], e[redo], total[redo], top_k[redo], top_p[redo], u[redo], vocab)
    return out


def _filtered_draw(
    z: np.ndarray, e: np.ndarray, total: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, u: np.ndarray, m: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k / top-p draws from the ``m`` most likely tokens of each row (``z``: scaled
    logits, ``e / total``: probabilities), and whether that was exact: every kept token
    is strictly more likely than the m-th, and top-k <= m. Always exact when ``m`` is
    the vocabulary.

    The kept set, its mass and the id-order cumulative sum at kept tokens do not depend
    on ``m`` (prefix sums of the same values; ``x + 0.0 == x``), so the token is the same
    for every ``m`` that is exact, the whole vocabulary included.
    """
    n, vocab = z.shape
    if m < vocab:  # the m largest, in id order
        cand = np.sort(np.argpartition(z, vocab - m, axis=1)[:, vocab - m :], axis=1)
        zc = np.take_along_axis(z, cand, 1)
        pc = np.take_along_axis(e, cand, 1) / total[:, None]
    else:
        cand, zc, pc = np.broadcast_to(np.arange(vocab), (n, vocab)), z, e / total[:, None]
    keep, ok = _kept_sorted(zc, pc, total, top_k, top_p, m, vocab)
    if keep is None:
        keep, ok = _kept_ranked(zc, pc, top_k, top_p, m, vocab)
    return _draw(np.where(keep, pc, 0.0), cand, u), ok


def _kept_rank(p_rank: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, m: int) -> np.ndarray:
    """Which ranks (most likely first) the top-k / top-p cut keeps, from the
    probabilities in rank order."""
    n = len(p_rank)
    cum = np.cumsum(p_rank, axis=1)
    has_k = top_k > 0
    if not has_k.any():  # top-p alone (the usual request): no top-k mass or rank limit
        return ((cum - p_rank) < top_p[:, None]) | (top_p >= 1.0)[:, None]
    mass = np.where(has_k & (top_k <= m), cum[np.arange(n), np.clip(top_k, 1, m) - 1], 1.0)  # top-k mass
    keep_rank = np.where(has_k[:, None], np.arange(m)[None, :] < top_k[:, None], True)
    keep_rank &= ((cum - p_rank) < (top_p * mass)[:, None]) | (top_p >= 1.0)[:, None]
    return keep_rank


def _kept_ranked(zc: np.ndarray, pc: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, m: int,
                 vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The kept tokens (in ``zc``'s order) and exactness, by a stable ranking of the row."""
    n = len(zc)
    order = np.argsort(-zc, axis=1, kind="stable")  # most likely first, lower id first among ties
    keep_rank = _kept_rank(np.take_along_axis(pc, order, 1), top_k, top_p, m)
    ok = np.ones(n, bool)
    if m < vocab:
        z_rank = np.take_along_axis(zc, order, 1)
        ok = ~(keep_rank & (z_rank == z_rank[:, -1:])).any(axis=1) & (top_k <= m)
    keep = np.empty_like(keep_rank)
    np.put_along_axis(keep, order, keep_rank, 1)
    return keep, ok


def _kept_sorted(zc: np.ndarray, pc: np.ndarray, total: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                 m: int, vocab: int) -> tuple[np.ndarray | None, np.ndarray]:
    """:func:`_kept_ranked`'s answer from sorted values alone (a stable argsort of the
    row costs several times a sort), or ``(None, ...)`` where that cannot be shown equal.

    The probabilities (``exp(z - max) / total``, ``total`` the row's) are a nondecreasing
    function of the scaled logits ``z`` (checked: the sorted logits map to the sorted
    probabilities), so sorting each alone
    gives the probabilities in rank order, hence the same cumulative sums and cut. When
    the kept ranks are the first ``R`` (the cut is monotone up to rounding; checked), the
    kept tokens are those above the ``R``-th largest logit plus, among the tokens equal
    to it, the lower ids: exactly the ranks a stable ranking would keep.
    """
    n = len(zc)
    z_rank = np.sort(zc, axis=1)[:, ::-1]  # views of ascending sorts: no negated copies
    p_rank = np.ascontiguousarray(np.sort(pc, axis=1)[:, ::-1])
    if not np.array_equal(p_rank, np.exp(z_rank - z_rank[:, :1]) / total[:, None]):
        return None, np.ones(n, bool)  # not provably the probabilities in rank order
    keep_rank = _kept_rank(p_rank, top_k, top_p, m)
    count = keep_rank.sum(axis=1)
    if not (keep_rank == (np.arange(m)[None, :] < count[:, None])).all():
        return None, np.ones(n, bool)
    v = z_rank[np.arange(n), count - 1][:, None]  # the smallest kept logit
    keep = zc >= v
    if not (keep.sum(axis=1) == count).all():  # ties at the cut that it splits: the lower ids
        above, tie = zc > v, zc == v
        keep = above | (tie & (np.cumsum(tie, axis=1) <= (count - above.sum(axis=1))[:, None]))
    ok = np.ones(n, bool)
    if m < vocab:
        ok = ~(keep_rank & (z_rank == z_rank[:, -1:])).any(axis=1) & (top_k <= m)
    return keep, ok


def _draw(p: np.ndarray, ids: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the token ``ids[k]`` where the cumulative ``p`` (in id order) first
    exceeds ``u`` times its total (never a zero-probability token)."""
    c = np.cumsum(p, axis=1)
    k = (c <= (u * c[:, -1])[:, None]).sum(axis=1)
    over = np.flatnonzero(k == p.shape[1])  # u * total rounded up to the total: the last likely token
    k[over] = p.shape[1] - 1 - np.argmax(p[over, ::-1] > 0, axis=1)
    return ids[np.arange(len(p)), k]
