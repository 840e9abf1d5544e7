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

__all__ = ["SamplingParams", "filtered_probs", "sample_token", "greedy_tokens", "uniform"]

_MAX_SEED = 2**64


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

    Attributes:
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

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], vocabulary: Sequence[str | None] | None = None) -> SamplingParams:
        """Parse the ``"parameters"`` of a generate request (Triton / vLLM names).

        Keys: ``max_new_tokens`` or its alias ``max_tokens``, ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``stop_token_ids``, ``stop`` (strings, each the exact text of
        one token of ``vocabulary``) and ``ignore_eos``. ``null`` values mean the default.

        Raises:
          ValueError: an unknown key (naming it and listing the known ones), a bad value
            (naming the field), or a ``stop`` string that is not one token.

        >>> SamplingParams.from_json({"max_tokens": 3, "stop": ["b"]}, ["a", "b"]).stop_token_ids
        (1,)
        >>> SamplingParams.from_json({"beam_width": 2})
        Traceback (most recent call last):
        ...
        ValueError: unknown sampling parameter 'beam_width'; known: ignore_eos, max_new_tokens, max_tokens, seed, stop, stop_token_ids, temperature, top_k, top_p
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
        if obj.get("stop") is not None:
            stops = list(kw.get("stop_token_ids") or ())
            kw["stop_token_ids"] = stops + _stop_ids(obj["stop"], vocabulary)
        return cls(**kw)


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


def sample_token(logits: np.ndarray, params: SamplingParams, seed: int, index: int) -> int:
    """Token ``index`` of a request: argmax when greedy, else one draw from
    :func:`filtered_probs` with :func:`uniform` ``(seed, index)``.

    >>> sample_token(np.array([0.0, 2.0, 1.0]), SamplingParams(), seed=0, index=0)
    1
    """
    if params.greedy:
        return int(np.argmax(logits))
    p = filtered_probs(logits, params.temperature, params.top_k, params.top_p)
    u = uniform(seed, index)
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(p) - 1))


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """Argmax of every row of ``(n, vocab)`` logits (the first maximum)."""
    return np.argmax(np.asarray(logits), axis=-1)
