"""The generation engine: continuous batching over a fixed number of KV-cache slots.

One engine thread loops: (1) drop cancelled requests; (2) when slots are free, prefill
waiting requests in groups of up to ``prefill_batch`` of one prompt bucket (16, 32, 48,
64, 96, ...: :func:`chunk_buckets`, at most 1.5 times the prompt above 32 tokens, capped
at ``max_length``; the oldest request's bucket first) at the fixed
shape ``(prefill_batch, bucket)``, until the free slots are full, scatter their cache
rows into the slots and sample their first token (while more than half the slots are
busy, a group that is not full waits until its oldest request has waited
``admission_delay_steps`` steps, so a busy engine does not prefill mostly padding every
step; a full group of another bucket goes ahead of it); (3) run one
decode step over all ``num_slots`` slots (idle slots decode a dummy row) and sample a
token for every active one, retiring finished requests at once. Every compiled shape is
fixed and rows never interact, and sampling uses a generator derived from ``(seed,
token index)`` alone, so a request gets exactly the tokens it would get alone.

``scheduler="static"`` is the baseline: it admits only when every slot is free (a batch
runs until its longest request finishes).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cairn.serving._batcher import QueueFull, Unavailable
from cairn.serving._genexport import GenerativeModel, detokenize
from cairn.serving._sampling import (
    SamplingParams,
    apply_penalties,
    log_softmax,
    sample_rows,
    top_logprobs,
)

__all__ = [
    "GenerationConfig",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationEvent",
    "GenerationResult",
    "chunk_buckets",
    "prompt_bucket",
]

log = logging.getLogger("cairn.serving")
_SCHEDULERS = ("continuous", "static")
_LAYOUTS = ("contiguous", "paged")


def _positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"GenerationConfig.{name} must be a positive integer, got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Engine settings (a repository model's ``config.json`` key ``"generation"``).

    Args:
      num_slots: KV-cache slots, the sequences decoded together (the decode batch is
        always ``num_slots``).
      prefill_batch: prompts prefilled per engine step (a fixed, padded batch).
      max_queue: requests waiting for a slot beyond this are refused with ``QueueFull``
        (a queued request that a free slot will take at the engine's next step is not
        waiting for one).
      max_new_tokens_limit: the largest ``max_new_tokens`` a request may ask for.
      scheduler: ``"continuous"`` or ``"static"`` (admit only when all slots are free).
      admission_delay_steps: while more than half the slots are busy, the continuous
        scheduler prefills a group of one prompt bucket that is not full (fewer than
        ``prefill_batch`` prompts or free slots) only once its oldest request has waited
        this many decode steps; full groups go at once (0: admit at every step).
      kv_layout: ``"contiguous"`` (one ``max_length`` cache row per slot) or ``"paged"``
        (a pool of ``num_blocks`` blocks shared by all slots, claimed as tokens arrive,
        with prefix caching and chunked prefill; the model needs a ``paged`` function,
        ``cairn.serving.PagedGenerationEngine``).
      num_blocks: paged: KV blocks in the pool (``None``: as many as ``num_slots``
        contiguous rows would take, ``num_slots * ceil(max_length / block_size)``).
      prefill_chunk: paged: prompt tokens per row prefilled per engine step (a long
        prompt is prefilled over several steps, between decode steps).
      enable_prefix_caching: paged: reuse the blocks of a common prompt prefix.

    Raises:
      ValueError: naming the field.

    >>> GenerationConfig.from_json({"num_slots": 8}).to_json()["num_slots"]
    8
    """

    num_slots: int = 16
    prefill_batch: int = 4
    max_queue: int = 256
    max_new_tokens_limit: int | None = None
    scheduler: str = "continuous"
    admission_delay_steps: int = 2
    kv_layout: str = "contiguous"
    num_blocks: int | None = None
    prefill_chunk: int = 256
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for k in ("num_slots", "prefill_batch", "max_queue", "prefill_chunk"):
            object.__setattr__(self, k, _positive(k, getattr(self, k)))
        if self.num_blocks is not None:
            object.__setattr__(self, "num_blocks", _positive("num_blocks", self.num_blocks))
        if self.kv_layout not in _LAYOUTS:
            raise ValueError(f"GenerationConfig.kv_layout must be one of {_LAYOUTS}, got {self.kv_layout!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"GenerationConfig.enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.max_new_tokens_limit is not None:
            object.__setattr__(self, "max_new_tokens_limit", _positive("max_new_tokens_limit", self.max_new_tokens_limit))
        d = self.admission_delay_steps
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise ValueError(f"GenerationConfig.admission_delay_steps must be an integer >= 0, got {d!r}")
        if self.scheduler not in _SCHEDULERS:
            raise ValueError(f"GenerationConfig.scheduler must be one of {_SCHEDULERS}, got {self.scheduler!r}")
        if self.prefill_batch > self.num_slots:
            raise ValueError(f"GenerationConfig.prefill_batch {self.prefill_batch} exceeds num_slots {self.num_slots}")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GenerationConfig:
        """From a JSON object; an unknown key raises ``ValueError`` naming it.

        Args:
          obj: a JSON object whose keys are this class's field names.

        Raises:
          ValueError: ``obj`` is not a mapping, or has an unknown key.
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"generation config must be a JSON object, got {type(obj).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for k in obj:
            if k not in known:
                raise ValueError(f"unknown generation config key {k!r}; known: {', '.join(known)}")
        return cls(**obj)

    def to_json(self) -> dict:
        """The fields as a JSON object."""
        return dataclasses.asdict(self)


_BATCH = threading.local()  # the engine thread's current batch of events: its deferred wake-ups


@contextlib.contextmanager
def event_batch(hold: list[Callable[[], None]] | None = None) -> Iterator[None]:
    """The events emitted inside are one batch (an engine step's rows): ``on_event`` runs
    for each as it comes, and what :func:`after_event_batch` defers runs once at the end
    (a listener wakes its event loop once per step, not once per event). Nests.

    With ``hold`` (a list), the deferred calls are appended to it instead, for the caller
    to run later (the engine: after its next device call is dispatched, so that waking a
    listener's thread, which takes the GIL, overlaps the device's work)."""
    if getattr(_BATCH, "hooks", None) is not None:
        yield
        return
    hooks: dict[Callable[[], None], None] = {}
    _BATCH.hooks = hooks
    try:
        yield
    finally:
        _BATCH.hooks = None
        if hold is not None:
            hold.extend(hooks)
            hooks = {}
        for fn in hooks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one listener's failure must not stop the engine
                log.exception("generation: a deferred event listener raised")


def after_event_batch(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the end of this thread's :func:`event_batch` (once however often it is
    deferred there), or now outside one."""
    hooks = getattr(_BATCH, "hooks", None)
    if hooks is None:
        fn()
    else:
        hooks[fn] = None


def chunk_buckets(chunk: int) -> tuple[int, ...]:
    """The prompt (or prefill chunk) lengths an engine compiles prefill for, up to ``chunk``
    (the model's ``max_length``, or a paged engine's ``prefill_chunk``).

    16, then each power of two ``b`` from 32 and ``3b/2`` below ``chunk``, then ``chunk``
    itself: a prompt of ``n > 32`` tokens runs at fewer than ``1.5 n`` (powers of two alone:
    up to ``2 n``). Prefill costs what its padded length costs (a 33-token prompt ran at 64
    tokens' cost with powers of two), and each length is one more program compiled at
    start-up (sixteen up to 4096, where powers of two from 1 take thirteen; eight up to
    256, where they take nine).

    Args:
      chunk: the longest length (at most the model's ``max_length``).

    >>> chunk_buckets(512)
    (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    >>> chunk_buckets(40), chunk_buckets(8)
    ((16, 32, 40), (8,))
    """
    sizes, b = [min(16, chunk)], 32
    while b < chunk:
        sizes += [b] + ([b * 3 // 2] if b * 3 // 2 < chunk else [])
        b *= 2
    return tuple(sorted({*sizes, chunk}))


@functools.lru_cache(maxsize=64)
def _buckets_of(max_length: int) -> tuple[int, ...]:
    return chunk_buckets(max_length)


def prompt_bucket(n: int, max_length: int) -> int:
    """The prefill length a prompt of ``n`` tokens is padded to: the first of
    :func:`chunk_buckets` (``max_length``) that holds it.

    >>> [prompt_bucket(n, 256) for n in (1, 16, 17, 33, 49, 65, 200)]
    [16, 16, 32, 48, 64, 96, 256]
    >>> [prompt_bucket(n, 12) for n in (1, 12)]
    [12, 12]
    """
    sizes = _buckets_of(int(max_length))
    return sizes[min(bisect.bisect_left(sizes, n), len(sizes) - 1)]


@dataclasses.dataclass
class GenerationEvent:
    """One streamed event: a token (``finished`` false) or the end (``token_id`` None).

    Args:
      token_id: the new token, or ``None`` on the final event.
      index: its position in the output (the final event's is the number of tokens).
      finished: whether this is the final event.
      finish_reason: on the final event.
      text: the text that became final with this event when the model has a tokenizer or
        a vocabulary (through the tokenizer's incremental decoder: often ``""``, never a
        split character; text that may begin a ``stop`` string is held back; the final
        event carries what is left).
      error: on a final event with ``finish_reason "error"``, the message.
      logprob: the token's log-probability, when the request asked for ``logprobs``.
      top_logprobs: ``[(id, logprob), ...]`` of the most likely tokens, likewise.
    """

    token_id: int | None
    index: int
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class GenerationResult:
    """A finished request.

    Args:
      prompt_len: the number of prompt tokens.
      token_ids: the generated tokens (a stop or EOS token is the last).
      finish_reason: ``"length"``, ``"stop"``, ``"cancelled"`` or ``"error"``.
      time_to_first_token: seconds from submission to the first token (``nan`` when none).
      latency: seconds from submission to the end (``nan`` when no token).
      text: the generated text when the model has a tokenizer or a vocabulary (ending
        before a matched ``stop`` string), else None.
      error: the message when ``finish_reason`` is ``"error"``, else None.
      logprobs: per token ``(logprob, [(id, logprob), ...])`` when asked for, else None.
    """

    prompt_len: int
    token_ids: list[int]
    finish_reason: str
    time_to_first_token: float
    latency: float
    text: str | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class _VocabDecoder:
    """The incremental-decoder interface over a plain vocabulary (token id -> text)."""

    def __init__(self, vocabulary: Sequence[str | None]) -> None:
        self._vocab = vocabulary

    def step(self, token_id: int) -> str:
        return self._vocab[token_id] or ""

    def flush(self) -> str:
        return ""


class TextState:
    """A request's generated text, kept final piece by piece: ``add`` takes the decoder's
    new text and returns what may be sent now, holding back a tail that could begin a
    ``stop`` string; when one matches, the text ends before it and :attr:`stopped` is set.

    >>> t = TextState(_VocabDecoder(["a", "b", "c"]), ("bc",))
    >>> [t.add(t.decoder.step(i)) for i in (0, 1)], t.add(t.decoder.step(2)), t.text, t.stopped
    (['a', ''], '', 'a', True)
    """

    def __init__(self, decoder: Any, stops: Sequence[str] = ()) -> None:
        self.decoder = decoder
        self.stops = tuple(stops)
        self._longest = max((len(x) for x in self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, piece: str) -> str:
        """Append ``piece``; the text that is now safe to send."""
        if not piece or self.stopped:
            return ""
        start = max(0, len(self.text) - self._longest + 1)  # where a match involving the new text may begin
        self.text += piece
        if not self.stops:
            return self._send(len(self.text))
        hits = [i for i in (self.text.find(x, start) for x in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            return self._send(len(self.text))
        tail = self.text[-self._longest :]
        hold = max((k for x in self.stops for k in range(1, min(len(x), len(tail) + 1)) if tail.endswith(x[:k])), default=0)
        return self._send(len(self.text) - hold)

    def finish(self) -> str:
        """The end of the stream: the decoder's last text and whatever was held back."""
        out = self.add(self.decoder.flush())
        return out if self.stopped else out + self._send(len(self.text))

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


class GenerationRequest:
    """A submitted request: :meth:`result` waits for it, :meth:`cancel` ends it early.

    Args:
      prompt: the prompt's token ids.
      params: the request's :class:`SamplingParams`.
      seed: the seed of its sampling.
      stops: token ids that end it (EOS and ``stop_token_ids``).
      on_event: called from the engine thread for every token and once at the end, or None.
      engine: the :class:`GenerationEngine` running it.
      text: the streamed-text state when the model has a tokenizer (or stop strings are set), else
        None.
    """

    _ids = itertools.count(1)

    def __init__(self, prompt: tuple[int, ...], params: SamplingParams, seed: int, stops: frozenset[int],
                 on_event: Callable[[GenerationEvent], None] | None, engine: GenerationEngine,
                 text: TextState | None = None) -> None:
        self.id = next(self._ids)
        self.prompt = prompt
        self.bucket = prompt_bucket(len(prompt), engine.model.max_length)  # its prefill length
        self.params = params
        self.seed = seed
        self.stops = stops
        self.token_ids: list[int] = []
        self.text = text  # the text as it becomes final (a tokenizer, streamed or with stop strings)
        self.counts: dict[int, int] = {}  # token -> times generated (for the penalties)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None if params.logprobs is None else []
        self._on_event = on_event
        self._engine = engine
        self._cancelled = False
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self.submitted = time.perf_counter()
        self._first: float | None = None
        self.queued_step = 0  # the engine's decode step count when it was queued

    @property
    def done(self) -> bool:
        """Whether the request has finished (for any reason)."""
        return self._done.is_set()

    def cancel(self) -> None:
        """End the request at the engine's next step (``finish_reason "cancelled"``);
        no effect once it has finished."""
        self._cancelled = True
        self._engine._wake()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the request to finish: once it returns, ``on_event`` has had every
        event, the final one included.

        Args:
          timeout: the most seconds to wait; None waits as long as it takes.

        Raises:
          TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"generation request {self.id} did not finish within {timeout} s")
        assert self._result is not None
        return self._result

    def _emit(self, event: GenerationEvent) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
            log.exception("generation request %d: on_event raised", self.id)

    def _add(self, token: int, vocab: Sequence[str | None] | None,
             logprob: tuple[float, list[tuple[int, float]]] | None = None) -> bool:
        """Record a token and stream it (its text through the request's :class:`TextState`,
        else from ``vocab`` when streamed); whether the request is now finished."""
        if self._first is None:
            self._first = time.perf_counter()
        self.token_ids.append(token)
        if self.params.penalized:
            self.counts[token] = self.counts.get(token, 0) + 1
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.text is not None:
            text: str | None = self.text.add(self.text.decoder.step(token))
        else:
            text = None if vocab is None or self._on_event is None else (vocab[token] or "")
        if self._on_event is not None:
            lp, top = logprob if logprob is not None else (None, None)
            self._emit(GenerationEvent(token, len(self.token_ids) - 1, text=text, logprob=lp, top_logprobs=top))
        stopped = self.text is not None and self.text.stopped
        return stopped or token in self.stops or len(self.token_ids) >= self.params.max_new_tokens

    def _finish(self, reason: str, text: str | None, error: str | None = None) -> None:
        if self._result is not None:
            return
        now = time.perf_counter()
        ttft = math.nan if self._first is None else self._first - self.submitted
        tail = None
        if self.text is not None:
            tail = self.text.finish() if reason in ("stop", "length") else ""
            text = self.text.text
        self._result = GenerationResult(len(self.prompt), list(self.token_ids), reason, ttft, now - self.submitted, text,
                                        error, self.logprobs)
        # the final event before waking result(): who waited sees every event delivered
        self._emit(GenerationEvent(None, len(self.token_ids), True, reason, text=tail, error=error))
        self._done.set()

    def __repr__(self) -> str:
        return f"GenerationRequest(id={self.id}, prompt_len={len(self.prompt)}, tokens={len(self.token_ids)}, done={self.done})"



# --- the engine ---


class GenerationEngine:
    """Continuous batching for a :class:`~cairn.serving.GenerativeModel` (module docstring).

    Args:
      model: the generative model (:class:`~cairn.serving.PythonGenerator` or a loaded one).
      config: :class:`GenerationConfig`.

    Raises:
      ValueError: a model that is not generative, or slots beyond its batch limit.

    Use it as a context manager, or call :meth:`start` and :meth:`stop`. With
    ``config.kv_layout == "paged"`` the engine is a
    :class:`~cairn.serving.PagedGenerationEngine`.
    """

    # the engine class of each ``kv_layout`` other than this one's: a subclass names its
    # layout (``class PagedGenerationEngine(GenerationEngine, kv_layout="paged")``), so this
    # module never imports the subclasses
    _by_layout: dict[str, type[GenerationEngine]] = {}

    def __init_subclass__(cls, kv_layout: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kv_layout is not None:
            GenerationEngine._by_layout[kv_layout] = cls

    def __new__(cls, model: GenerativeModel, config: GenerationConfig | None = None) -> GenerationEngine:
        if cls is GenerationEngine and isinstance(config, GenerationConfig):
            cls = GenerationEngine._by_layout.get(config.kv_layout, cls)
        return super().__new__(cls)

    def __init__(self, model: GenerativeModel, config: GenerationConfig | None = None) -> None:
        config = GenerationConfig() if config is None else config
        if not isinstance(model, GenerativeModel):
            raise ValueError(f"GenerationEngine needs a GenerativeModel, got {type(model).__name__}")
        if not isinstance(config, GenerationConfig):
            raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
        limit = getattr(model, "max_batch_size", 0) or 0
        if limit and config.num_slots > limit:
            raise ValueError(f"num_slots {config.num_slots} exceeds the model's max_batch_size {limit}")
        self.model = model
        self.config = config
        self._cond = threading.Condition()
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._slots: list[GenerationRequest | None] = [None] * config.num_slots
        self._tokens = np.zeros(config.num_slots, np.int32)
        self._positions = np.zeros(config.num_slots, np.int32)
        self._cache: dict[str, Any] = {}
        self._scatter: Callable | None = None
        self._thread: threading.Thread | None = None
        self._state = "new"
        self._seeds = np.random.default_rng()
        # a decode step's sampled rows whose events run while the device computes the next step
        self._pending: list[tuple[int, GenerationRequest, int, Any]] = []
        self._held: list[Callable[[], None]] = []  # listeners' wake-ups of rows recorded since the last device call
        self._flushes = 0  # _flush calls (one after each device call is dispatched)
        # the last decode step's logits on the host, not sampled yet (``_overlap_sampling``)
        self._unsampled: tuple[np.ndarray, list[tuple[int, GenerationRequest]]] | None = None
        self._counts = collections.Counter({k: 0 for k in (
            "requests", "finished", "cancelled", "errors", "prompt_tokens", "tokens", "steps", "prefills")})

    # --- lifecycle ---

    def start(self, precompile: bool = True) -> GenerationEngine:
        """Compile every shape (prefill per prompt bucket, the scatter, decode), then start
        the engine thread. Returns ``self``.

        Args:
          precompile: ``False`` compiles each shape at its first use instead (quicker to
            start in tests and notebooks; the first request of each bucket waits).
        """
        with self._cond:
            if self._state != "new":
                raise RuntimeError(f"GenerationEngine.start: the engine is {self._state}")
            self._state = "starting"
        try:
            self._reset_cache()
            if precompile:
                self._warm_up()
        except BaseException:
            with self._cond:
                self._state = "stopped"
            raise
        self._thread = threading.Thread(target=self._loop, name=f"cairn-generate-{self.model.name}", daemon=True)
        with self._cond:
            self._state = "running"
        self._thread.start()
        return self

    def _reset_cache(self) -> None:
        """A fresh (zero) KV cache: one ``max_length`` row per slot."""
        self._cache = self.model.init_cache(self.config.num_slots)
        self._scatter = _make_scatter()

    def buckets(self) -> tuple[int, ...]:
        """The prompt lengths prefill is compiled for."""
        return tuple(sorted({prompt_bucket(n, self.model.max_length) for n in range(1, self.model.max_length)}))

    def _warm_up(self) -> None:
        import jax
        import jax.numpy as jnp

        pb, s = self.config.prefill_batch, self.config.num_slots
        drop = jnp.full((pb,), s, jnp.int32)  # out of range: nothing is written
        for p in self.buckets():
            _logits, new = self.model.prefill(jnp.zeros((pb, p), jnp.int32), jnp.ones((pb,), jnp.int32))
            assert self._scatter is not None
            self._cache = self._scatter(self._cache, new, drop)
        logits, self._cache = self.model.decode(jnp.zeros((s,), jnp.int32), jnp.zeros((s,), jnp.int32), self._cache)
        jax.block_until_ready((logits, self._cache))

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Refuse new requests; with ``drain``, let queued and running ones finish (up to
        ``timeout`` seconds); cancel whatever is left and stop the thread.

        Args:
          drain: let queued and running requests finish first; False cancels them at once.
          timeout: the most seconds to wait for the drain.
        """
        with self._cond:
            if self._state in ("new", "starting", "stopped"):
                self._state = "stopped"
                return
            if self._state == "running":
                self._state = "draining" if drain else "stopping"
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._state == "draining" and (self._queue or any(self._slots)) and time.monotonic() < deadline:
                self._cond.wait(0.05)
            if self._state != "stopped":
                self._state = "stopping"
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():  # stop() from on_event
            self._thread.join(max(0.0, deadline - time.monotonic()) + 5.0)

    def __enter__(self) -> GenerationEngine:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.stop(drain=False)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # --- requests ---

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None,
               on_event: Callable[[GenerationEvent], None] | None = None) -> GenerationRequest:
        """Queue a request.

        Args:
          prompt: token ids (at least one).
          params: :class:`SamplingParams` (default greedy, 16 tokens).
          on_event: called from the engine thread for every token and once at the end
            (:class:`GenerationEvent`); it must not block.

        Raises:
          ValueError: an empty prompt, a token id out of range, a prompt that with
            ``max_new_tokens`` does not fit ``max_length``, or ``max_new_tokens`` above
            the limit; naming which.
          QueueFull: ``max_queue`` requests are waiting (``retry_after`` seconds).
          Unavailable: the engine is not running.
        """
        params = SamplingParams() if params is None else params
        toks, stops = self._validate(prompt, params)
        with self._cond:
            if self._state not in ("running",):
                raise Unavailable(f"generation engine for {self.model.name!r} is {self._state}; not taking requests")
            waiting = self._waiting()
            if waiting >= self.config.max_queue:
                raise QueueFull(f"model {self.model.name!r}: {waiting} generation requests waiting for a slot "
                                f"(max_queue {self.config.max_queue})", retry_after=self._retry_after())
            seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**63))
            req = GenerationRequest(toks, params, seed, stops, on_event, self, self._text_state(toks, params, on_event))
            req.queued_step = self._counts["steps"]  # its age in decode steps, for the admission delay
            self._queue.append(req)
            self._counts["requests"] += 1
            self._counts["prompt_tokens"] += len(toks)
            self._cond.notify_all()
        return req

    def _text_state(self, prompt: tuple[int, ...], params: SamplingParams, on_event: Any) -> TextState | None:
        """A request's text as it is generated: with the model's tokenizer (when streamed or
        with stop strings), or over its vocabulary (stop strings only)."""
        tok = getattr(self.model, "tokenizer", None)
        if tok is not None and (on_event is not None or params.stop):
            return TextState(tok.incremental_decoder(skip_special_tokens=True, prompt_ids=prompt), params.stop)
        if params.stop and self.model.vocabulary is not None:
            return TextState(_VocabDecoder(self.model.vocabulary), params.stop)
        return None

    def generate(self, prompt: Sequence[int], params: SamplingParams | None = None) -> GenerationResult:
        """Submit and wait: the blocking convenience.

        Args:
          prompt: token ids (at least one).
          params: :class:`SamplingParams` (None: greedy, 16 tokens).

        Returns:
          the finished :class:`GenerationResult`.
        """
        return self.submit(prompt, params).result()

    def _waiting(self) -> int:
        """Under the lock: queued requests that no free slot will take at the next step.

        Moving requests from the queue into free slots (the engine thread's ``_pick``)
        leaves this unchanged, so whether a request is refused never depends on how far
        the engine thread got (counting the whole queue refused a burst that the free
        slots could hold whenever it arrived before the engine's next step).
        """
        free = self._slots.count(None)
        if self.config.scheduler == "static" and free < len(self._slots):
            free = 0  # the static scheduler admits only into an empty engine
        return len(self._queue) - free

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._waiting() / max(1, self.config.num_slots)))

    def _validate(self, prompt: Sequence[int], params: SamplingParams) -> tuple[tuple[int, ...], frozenset[int]]:
        m, cfg = self.model, self.config
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            arr = np.asarray(prompt)
        except Exception as e:  # noqa: BLE001 - ragged or odd input
            raise ValueError(f"prompt must be a list of token ids ({e})") from None
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"prompt must be a flat list of integer token ids, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size == 0:
            raise ValueError("prompt is empty; give at least one token")
        bad = np.flatnonzero((arr < 0) | (arr >= m.vocab_size))
        if bad.size:
            raise ValueError(f"prompt token {int(arr[bad[0]])} at index {int(bad[0])} is outside the vocabulary (0..{m.vocab_size - 1})")
        n, k = int(arr.size), params.max_new_tokens
        if cfg.max_new_tokens_limit is not None and k > cfg.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens {k} exceeds this model's limit {cfg.max_new_tokens_limit}")
        if n >= m.max_length:
            raise ValueError(f"prompt of {n} tokens does not fit the KV cache (max_length {m.max_length}: at most "
                             f"{m.max_length - 1} prompt tokens)")
        if n + k > m.max_length:
            raise ValueError(f"prompt of {n} tokens + max_new_tokens {k} exceeds the model's max_length {m.max_length}; "
                             f"ask for at most {m.max_length - n} new tokens")
        if params.stop and getattr(m, "tokenizer", None) is None and m.vocabulary is None:
            raise ValueError(f"stop strings need a model with a tokenizer or a vocabulary; model {m.name!r} has neither "
                             "(use stop_token_ids)")
        bad_stop = [t for t in params.stop_token_ids if t >= m.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary (0..{m.vocab_size - 1})")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(m.eos_token_ids))
        return tuple(int(t) for t in arr), frozenset(stops)

    def stats(self) -> dict[str, Any]:
        """Counters: requests submitted / finished / cancelled / errors, prompt and
        generated tokens, decode steps, prefills; and now: active slots, queue length."""
        with self._cond:
            out: dict[str, Any] = dict(self._counts)
            out.update(active_slots=sum(r is not None for r in self._slots), queue=len(self._queue),
                       num_slots=self.config.num_slots, scheduler=self.config.scheduler, state=self._state)
        return out

    # --- the engine thread ---

    # A decode step's sampling (host work, ~1.5 ms at 64 rows) may wait for the next step's
    # prefill to be dispatched, and run while the device prefills; see _sample_decoded.
    _overlap_sampling = True

    def _loop(self) -> None:
        while True:
            with self._cond:
                stopping = self._state == "stopping"
                # sampled now when nothing can overlap it: no prompt waits, or none has a free slot
                now = stopping or not self._queue or all(r is not None for r in self._slots)
            if now and self._sample_decoded() and not any(self._slots):
                self._flush()  # no step follows: deliver what the sampling recorded
            with self._cond:
                if stopping:
                    break
                finished = self._drop_cancelled()
                groups = self._pick()
                idle = not groups and not any(self._slots) and not finished
                if idle:
                    self._cond.wait(0.5)
            for req, reason in finished:
                self._finish(req, reason)
            if idle:
                continue
            flushes = self._flushes
            try:
                for group in groups:
                    self._prefill(group)
                self._sample_decoded()  # (no-op after a prefill) the rows that go on feed this decode
                if any(self._slots):
                    self._decode()
            except Exception as e:  # noqa: BLE001 - the engine outlives a bad step
                log.exception("generation engine step failed")
                self._model_error(e, [r for r in self._slots if r is not None])
            if not any(self._slots) or flushes == self._flushes:
                self._flush()  # no step follows (or none ran) to hide the events behind: deliver them now
        self._flush(ended_only=True)  # the ended requests finish; the running ones are cancelled as they stand
        self._shutdown()

    def _drop_cancelled(self) -> list[tuple[GenerationRequest, str]]:
        """Under the lock: take cancelled requests out of the queue and the slots."""
        out = [(r, "cancelled") for r in self._queue if r._cancelled]
        if out:
            self._queue = collections.deque(r for r in self._queue if not r._cancelled)
        for i, r in enumerate(self._slots):
            if r is not None and r._cancelled:
                self._free(i)
                out.append((r, "cancelled"))
        return out

    def _free(self, slot: int) -> None:
        self._slots[slot] = None
        self._tokens[slot] = 0
        self._positions[slot] = 0

    def _pick(self) -> list[list[tuple[GenerationRequest, int]]]:
        """Under the lock: the prefill groups to run this step, each put in free slots.

        Groups are of one prompt bucket, the bucket of the oldest waiting request first.
        While more than half the slots are busy, the continuous scheduler runs a group
        only when it is full (``prefill_batch`` prompts, with as many free slots) or when
        its oldest request has waited ``admission_delay_steps`` decode steps; a partial
        group of one bucket waits without holding back a full group of another. A prefill
        row costs a few decode steps of an idle slot, so a busy engine fills its groups.
        """
        free = [i for i, r in enumerate(self._slots) if r is None]
        if not self._queue or not free:
            return []
        if self.config.scheduler == "static" and len(free) < len(self._slots):
            return []
        pb, delay, step = self.config.prefill_batch, self.config.admission_delay_steps, self._counts["steps"]
        hold = self.config.scheduler == "continuous" and (len(self._slots) - len(free)) * 2 > len(self._slots)
        by_bucket: dict[int, list[GenerationRequest]] = {}
        for r in self._queue:  # oldest first, so each list and the buckets' order are by age
            by_bucket.setdefault(r.bucket, []).append(r)
        groups: list[list[tuple[GenerationRequest, int]]] = []
        for members in by_bucket.values():
            while members and free:
                group = members[: min(pb, len(free))]
                if hold and len(group) < pb and step - group[0].queued_step < delay:
                    break  # a partial group: wait for more prompts of this bucket (or more free slots)
                del members[: len(group)]
                groups.append([(r, free.pop(0)) for r in group])
        taken = {id(r) for group in groups for r, _ in group}
        if taken:
            self._queue = collections.deque(r for r in self._queue if id(r) not in taken)
        for picked in groups:
            for r, slot in picked:
                self._slots[slot] = r
        return groups

    def _prefill(self, group: list[tuple[GenerationRequest, int]]) -> None:
        pb, s = self.config.prefill_batch, self.config.num_slots
        bucket = group[0][0].bucket  # one bucket per group (_pick)
        tokens = np.zeros((pb, bucket), np.int32)
        lengths = np.ones(pb, np.int32)
        dst = np.full(pb, s, np.int32)
        for i, (r, slot) in enumerate(group):
            tokens[i, : len(r.prompt)] = r.prompt
            lengths[i], dst[i] = len(r.prompt), slot
        try:
            # the jitted calls take the fresh host arrays and transfer them themselves (a
            # jax.device_put first cost ~30 us an array, more while the device computes)
            logits, new = self.model.prefill(tokens, lengths)
            assert self._scatter is not None
            self._cache = self._scatter(self._cache, new, dst)
        except Exception as e:  # noqa: BLE001 - fails this step's requests only
            self._prefill_failed(e, group)
            return
        self._sample_decoded()  # the last decode step's tokens, while the device prefills (its errors are the step's)
        try:
            self._flush()  # and its events
            host = np.asarray(logits)
        except Exception as e:  # noqa: BLE001 - fails this step's requests only
            self._prefill_failed(e, group)
            return
        self._counts["prefills"] += 1
        self._counts["tokens"] += len(group)  # counted as generated, so stats() shows a live rate
        for r, slot in group:
            self._positions[slot] = len(r.prompt)
        self._take(host, [(i, slot, r) for i, (r, slot) in enumerate(group)], defer=False)

    def _prefill_failed(self, e: Exception, group: list[tuple[GenerationRequest, int]]) -> None:
        log.exception("generation prefill failed")
        self._model_error(e, [r for r, _ in group])

    # --- the step's host work, shared by every KV layout ---

    def _decode_rows(self) -> list[tuple[int, GenerationRequest]]:
        """The ``(slot, request)`` rows that decode this step: every busy slot."""
        return [(slot, r) for slot, r in enumerate(self._slots) if r is not None]

    def _dispatch_decode(self, rows: list[tuple[int, GenerationRequest]]) -> Any:
        """Start one decode step over every slot on the device; its logits ``(num_slots, vocab)``, not waited for."""
        # copies: a row that finishes while the step runs zeroes its slot in the host arrays
        logits, self._cache = self.model.decode(self._tokens.copy(), self._positions.copy(), self._cache)
        return logits

    def _decoded(self, rows: list[tuple[int, GenerationRequest]]) -> list[tuple[int, GenerationRequest]]:
        """After a decode step (positions advanced): the rows whose next token is sampled."""
        return rows

    def _grow(self, rows: list[tuple[int, GenerationRequest, int, Any]]) -> None:
        """Room for the new tokens of the rows that go on (a contiguous row has it)."""

    def _decode(self) -> None:
        """One decode step. The device runs it while the previous step's rows are recorded
        and streamed (:meth:`_flush`); this step's tokens are sampled at once (the next step
        needs them), and a row that ends by a stop token or its ``max_new_tokens`` leaves
        its slot and gets its last events now (:meth:`_take`)."""
        active = self._decode_rows()
        if not active:
            return
        try:
            logits = self._dispatch_decode(active)
            self._flush()  # host work of the last step, overlapped with this one
            host = np.asarray(logits)
        except Exception as e:  # noqa: BLE001 - fails this step's requests only
            log.exception("generation decode step failed")
            self._model_error(e, [r for _, r in active])  # every active request was in it
            return
        self._counts["steps"] += 1
        for slot, _ in active:
            self._positions[slot] += 1
        rows = self._decoded(active)
        self._counts["tokens"] += len(rows)
        self._unsampled = (host, rows)
        if not self._overlap_sampling:
            self._sample_decoded()

    def _sample_decoded(self) -> bool:
        """Sample the last decode step's rows (:meth:`_take`), if not yet done (returns
        whether there were any).

        With ``_overlap_sampling`` (the contiguous layout) this waits for the next loop
        iteration: when a prompt waits for a free slot, the engine picks the prefill groups
        first and samples right after dispatching the first prefill, while the device
        computes it (a slot freed by a row ending here is taken one step later, when no
        free slot was left anyway). A row whose request left its slot meanwhile (cancelled)
        is dropped; every other row gets exactly the token it would have got at once."""
        if self._unsampled is None:
            return False
        host, rows = self._unsampled
        self._unsampled = None
        with self._cond:
            kept = [(slot, r) for slot, r in rows if self._slots[slot] is r]
        self._take(host, [(slot, slot, r) for slot, r in kept], defer=True)
        return True

    def _take(self, host: np.ndarray, rows: list[tuple[int, int, GenerationRequest]], defer: bool) -> None:
        """Sample the next token of ``rows`` (``(row of host, slot, request)``; one batched
        call: a row's token depends on its own logits, seed and index only). A row that ends
        by a stop token or its length leaves its slot and is recorded now; the others feed
        the next step and are recorded now, or with ``defer`` while the next step runs."""
        if not rows:
            return
        toks, lps = _sample(host[[row for row, _, _ in rows]], [r for _, _, r in rows])
        ended, going = [], []
        for (_, slot, r), tok, lp in zip(rows, toks.tolist(), lps):
            if tok in r.stops or len(r.token_ids) + 1 >= r.params.max_new_tokens:
                ended.append((slot, r, tok, lp))  # _add will say finished
            else:
                going.append((slot, r, tok, lp))
                self._tokens[slot] = tok
        if ended:  # now, not after the next step: a closed-loop client sends its next request sooner
            with self._cond:
                for slot, *_ in ended:
                    self._free(slot)
                self._cond.notify_all()
        if defer:
            self._pending.extend(going)
        self._grow(going)
        # recorded now (the slots are free, the results final), but the listeners are woken
        # by the next _flush, after the next device call is dispatched: a woken event loop
        # holds the GIL while it delivers, and here the device would wait for it
        self._flush_rows(ended if defer else ended + going, hold=True)

    def _flush(self, ended_only: bool = False) -> None:
        """Record and stream the pending rows of the last decode step (:meth:`_flush_rows`),
        and wake the listeners of rows recorded since the last device call."""
        self._flushes += 1
        pending, self._pending = self._pending, []
        held, self._held = self._held, []
        with event_batch():  # one batch: the held wake-ups and these rows' run once, at its end
            for fn in held:
                after_event_batch(fn)
            self._flush_rows(pending, ended_only)

    def _flush_rows(self, rows: list[tuple[int, GenerationRequest, int, Any]], ended_only: bool = False,
                    hold: bool = False) -> None:
        """Record and stream sampled rows (their text, stop strings and events); retire
        those that finished. A request cancelled or failed in between drops its token;
        with ``ended_only`` (the engine stopping), so does every request still in its slot.
        With ``hold``, the listeners' wake-ups wait for the next :meth:`_flush`."""
        with event_batch(self._held if hold else None):
            self._record_rows(rows, ended_only)

    def _record_rows(self, rows: list[tuple[int, GenerationRequest, int, Any]], ended_only: bool) -> None:
        vocab = self.model.vocabulary
        for slot, r, tok, lp in rows:
            if r.done or (ended_only and self._slots[slot] is r):
                continue
            error: str | None = None
            try:
                finished = r._add(tok, vocab, lp)
            except Exception as e:  # noqa: BLE001 - fails this request only, the rest are still delivered
                log.exception("generation request %d: recording a token failed", r.id)
                finished, error = True, f"{type(e).__name__}: {e}"
            if finished:
                with self._cond:
                    if self._slots[slot] is r:  # a stop string seen late: it decoded one more (discarded) row
                        self._free(slot)
                    elif r in self._queue:  # preempted (paged), waiting to resume
                        self._queue.remove(r)
                    self._cond.notify_all()
                stopped = tok in r.stops or (r.text is not None and r.text.stopped)
                self._finish(r, "error" if error else "stop" if stopped else "length", error)

    def _finish(self, r: GenerationRequest, reason: str, error: str | None = None) -> None:
        with self._cond:
            self._counts[{"cancelled": "cancelled", "error": "errors"}.get(reason, "finished")] += 1
        text = None
        if r.text is None:
            text = _detokenize(self.model, r.token_ids)
        r._finish(reason, text, error)

    def _model_error(self, e: Exception, reqs: list[GenerationRequest]) -> None:
        """Fail ``reqs`` (and every slot's request when the cache was lost)."""
        lost = not self._cache or any(getattr(x, "is_deleted", lambda: False)() for x in self._cache.values())
        failed = list(reqs)
        with self._cond:
            for i, r in enumerate(self._slots):
                if r is not None and (lost or r in reqs):
                    self._free(i)
                    if r not in failed:
                        failed.append(r)
            self._cond.notify_all()
        if lost:
            self._reset_cache()
        for r in failed:
            self._finish(r, "error", f"{type(e).__name__}: {e}")

    def _shutdown(self) -> None:
        with self._cond:
            left = list(self._queue) + [r for r in self._slots if r is not None]
            self._queue.clear()
            for i in range(len(self._slots)):
                self._free(i)
            self._state = "stopped"
            self._cond.notify_all()
        for r in left:
            self._finish(r, "cancelled")


def _detokenize(model: Any, ids: list[int]) -> str | None:
    """The text of ``ids``: the model's tokenizer (special tokens left out), else its vocabulary."""
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        return tok.decode(ids, skip_special_tokens=True)
    return None if model.vocabulary is None else detokenize(ids, model.vocabulary)


def _sample(logits: np.ndarray, reqs: Sequence[GenerationRequest]) -> tuple[np.ndarray, list[Any]]:
    """The next token of each request (row ``i`` of ``logits`` is ``reqs[i]``'s) and, for
    those that asked, its log-probability and the top alternatives (of the raw logits).
    Penalties are applied to a copy of a row; rows never interact."""
    lps: list[Any] = [None] * len(reqs)
    rows = logits
    for i, r in enumerate(reqs):
        if r.params.logprobs is not None:
            lps[i] = log_softmax(logits[i])
        if r.params.penalized and r.counts:
            if rows is logits:
                rows = np.array(logits, np.float64)
            rows[i] = apply_penalties(logits[i], r.counts, r.params.presence_penalty, r.params.frequency_penalty)
    toks = sample_rows(rows, [r.params for r in reqs], [r.seed for r in reqs], [len(r.token_ids) for r in reqs])
    for i, r in enumerate(reqs):
        if lps[i] is not None:
            lp, k = lps[i], r.params.logprobs
            lps[i] = (float(lp[toks[i]]), top_logprobs(lp, k) if k else [])
    return toks, lps


def _scatter_rows(cache: dict, new: dict, dst: Any) -> dict:
    """Rows of ``new`` into slots ``dst`` of ``cache`` (an out-of-range slot drops its row)."""
    return {n: cache[n].at[dst].set(new[n].astype(cache[n].dtype), mode="drop") for n in cache}


def _make_scatter() -> Callable:
    """``_scatter_rows`` jitted with the cache donated (one jit shared by all engines)."""
    global _SCATTER
    if _SCATTER is None:
        import jax

        _SCATTER = jax.jit(_scatter_rows, donate_argnums=(0,))
    return _SCATTER


_SCATTER: Callable | None = None
