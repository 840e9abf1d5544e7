"""The generation engine over a paged KV cache: blocks claimed as tokens arrive, prefix
caching, chunked prefill.

``GenerationEngine(model, GenerationConfig(kv_layout="paged"))`` is a
:class:`PagedGenerationEngine`. It keeps one pool of ``num_blocks`` KV blocks of the
model's ``block_size`` tokens for all slots, and a :class:`~cairn.serving.PagedCache` for
the bookkeeping. Each engine step:

1. drops cancelled requests (their blocks go back to the pool);
2. admits waiting requests, oldest first, into free slots while the pool can hold them:
   a request's prompt blocks are claimed at once (full blocks found in the prefix cache are
   shared, not claimed), and it *reserves* the blocks its ``max_new_tokens`` could still
   take, which are claimed one by one as its tokens arrive. So a short request holds what
   it can use, never ``max_length``, and a running request never runs out of blocks (no
   preemption, no recomputation). A prompt whose cached prefix another request is still
   prefilling waits until those blocks are written;
3. prefills one chunk of up to ``prefill_chunk`` prompt tokens for up to ``prefill_batch``
   requests (all prefilling requests while none decodes) whose next chunks fall in one
   length bucket (powers of two from 16 up to ``prefill_chunk``: a suffix after a cached
   prefix costs what its own length costs), at the fixed shape ``(prefill_batch,
   bucket)``; a request whose prompt is done samples its first token. A long prompt takes
   several steps, and the decode steps run between them;
4. runs one decode step over all ``num_slots`` rows (rows not decoding write nothing).

Every compiled shape is fixed and rows never interact (each reads only its own block
table), and sampling depends on ``(seed, token index)`` alone, so a request gets the tokens
it would get alone, prefix hits included (a cached block holds what the request would have
computed itself).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from cairn.serving._generate import GenerationConfig, GenerationEngine, GenerationRequest, _sample
from cairn.serving._genexport import GenerativeModel
from cairn.serving._paged import OutOfBlocks, PagedCache

__all__ = ["PagedGenerationEngine"]

log = logging.getLogger("cairn.serving")


class PagedGenerationEngine(GenerationEngine, kv_layout="paged"):
    """:class:`~cairn.serving.GenerationEngine` over a paged KV cache (module docstring).

    Args:
      model: a generative model with a paged layout (``model.has_paged``: exported with
        ``paged=`` and ``block_size=``, e.g. ``cairn.llm.export_for_serving(...,
        block_size=16)``).
      config: :class:`GenerationConfig` with ``kv_layout="paged"``.

    Raises:
      ValueError: a model without a paged layout, or a pool too small for one sequence.
    """

    def __init__(self, model: GenerativeModel, config: GenerationConfig | None = None) -> None:
        config = GenerationConfig(kv_layout="paged") if config is None else config
        super().__init__(model, config)
        if not getattr(model, "has_paged", False):
            raise ValueError(f"kv_layout 'paged' needs a model with a paged function; model {model.name!r} has none "
                             "(export it with block_size=..., e.g. cairn.llm.export_for_serving(..., block_size=16))")
        self.block_size = int(model.block_size)  # type: ignore[attr-defined]
        self.max_blocks = -(-model.max_length // self.block_size)  # the block-table width
        self.num_blocks = config.num_blocks or config.num_slots * self.max_blocks
        self.chunk = min(config.prefill_chunk, model.max_length)
        sizes, b = [], min(16, self.chunk)
        while b < self.chunk:
            sizes.append(b)
            b *= 2
        self._buckets = (*sizes, self.chunk)
        n = config.num_slots
        self._prefilled = np.zeros(n, np.int64)  # prompt tokens of each slot's request already in the cache
        self._written = np.zeros(n, np.int64)  # tokens of each slot whose keys and values are written
        self._bound = np.zeros(n, np.int64)  # the most blocks each slot's request can come to hold
        self._paged = PagedCache(self.num_blocks, self.block_size, max_blocks_per_seq=self.max_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching)

    # --- state ---

    def _reset_cache(self) -> None:
        self._cache = self.model.init_pool(self.num_blocks)  # type: ignore[attr-defined]
        self._paged = PagedCache(self.num_blocks, self.block_size, max_blocks_per_seq=self.max_blocks,
                                 enable_prefix_caching=self.config.enable_prefix_caching)

    def _free(self, slot: int) -> None:
        r = self._slots[slot]
        if r is not None and r.id in self._paged:
            self._paged.free(r.id, written=int(self._written[slot]))
        super()._free(slot)
        self._prefilled[slot] = self._written[slot] = self._bound[slot] = 0

    def _blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def _reserved(self) -> int:
        """Blocks the running requests may still claim (their bound less what they hold)."""
        return sum(int(self._bound[i]) - len(self._paged.block_table(r.id))
                   for i, r in enumerate(self._slots) if r is not None)

    def _prefilling(self, slot: int) -> bool:
        r = self._slots[slot]
        return r is not None and self._prefilled[slot] < len(r.prompt)

    def buckets(self) -> tuple[int, ...]:
        """The prefill chunk lengths compiled (a chunk is padded to the first that holds it)."""
        return self._buckets

    def _bucket(self, slot: int) -> int:
        """The length the next prefill chunk of ``slot`` is padded to (its own tokens decide)."""
        r = self._slots[slot]
        assert r is not None
        n = min(len(r.prompt) - int(self._prefilled[slot]), self.chunk)
        return next(b for b in self._buckets if b >= n)

    def _warm_up(self) -> None:
        import jax

        pb, s = self.config.prefill_batch, self.config.num_slots
        for b, t in [*((pb, c) for c in self._buckets), (s, 1)]:
            logits, self._cache = self.model.paged_step(  # type: ignore[attr-defined]
                *jax.device_put((np.zeros((b, t), np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32),
                                 np.zeros((b, self.max_blocks), np.int32))), self._cache)
        jax.block_until_ready((logits, self._cache))

    # --- admission ---

    def _validate(self, prompt: Any, params: Any) -> tuple[tuple[int, ...], frozenset[int]]:
        toks, stops = super()._validate(prompt, params)
        need = self._blocks(len(toks) + params.max_new_tokens - 1)
        if need > self.num_blocks:
            raise ValueError(f"prompt of {len(toks)} tokens + max_new_tokens {params.max_new_tokens} needs {need} KV "
                             f"blocks of {self.block_size} tokens; the pool has {self.num_blocks}")
        return toks, stops

    def _pick(self) -> list[list[int]]:  # type: ignore[override]  # slots, not (request, slot) pairs
        """Under the lock: admit what fits, then the slots to prefill a chunk of this step."""
        free = [i for i, r in enumerate(self._slots) if r is None]
        if self.config.scheduler != "static" or len(free) == len(self._slots):
            self._admit(free)
        rows = [i for i in sorted(range(len(self._slots)), key=self._age) if self._prefilling(i)]
        groups = []
        while rows:  # the oldest row's bucket first, up to prefill_batch rows of that bucket
            bucket = self._bucket(rows[0])
            group = [i for i in rows if self._bucket(i) == bucket][: self.config.prefill_batch]
            groups.append(group)
            rows = [i for i in rows if i not in group]
        decoding = any(r is not None and not self._prefilling(i) for i, r in enumerate(self._slots))
        return groups[:1] if decoding else groups

    def _age(self, slot: int) -> int:
        r = self._slots[slot]
        return r.id if r is not None else 0

    def _admit(self, free: list[int]) -> None:
        pending = {b for i, r in enumerate(self._slots) if r is not None and self._prefilling(i)
                   for b in self._paged.block_table(r.id)[int(self._prefilled[i]) // self.block_size :]}
        room = self._paged.num_free_blocks - self._reserved()
        while self._queue and free:
            r = self._queue[0]
            if pending.intersection(self._paged.cached_prefix(r.prompt)):
                break  # its cached prefix is still being written: wait for it
            extra = r.params.max_new_tokens - 1  # the last token's keys are never written
            need = self._paged.blocks_needed(r.prompt, reserve_tokens=extra)
            if need > room:
                break  # oldest first: a big request is not starved by smaller ones behind it
            self._queue.popleft()
            slot = free.pop(0)
            self._slots[slot] = r
            cached = self._paged.add_sequence(r.id, r.prompt)
            self._prefilled[slot] = self._written[slot] = cached
            self._bound[slot] = self._blocks(len(r.prompt) + extra)
            room -= need
            pending.update(self._paged.block_table(r.id)[cached // self.block_size :])

    # --- steps ---

    def _step(self, tokens: np.ndarray, positions: np.ndarray, lengths: np.ndarray, seqs: list) -> np.ndarray:
        """One paged call; rows of ``seqs`` (a request or None) read their block tables."""
        import jax

        tables = np.zeros((len(seqs), self.max_blocks), np.int32)
        for i, r in enumerate(seqs):
            if r is not None:
                tables[i] = self._paged.block_tables([r.id])[0]
        logits, self._cache = self.model.paged_step(  # type: ignore[attr-defined]
            *jax.device_put((tokens, positions, lengths, tables)), self._cache)
        return np.asarray(logits)

    def _prefill(self, group: list[int]) -> None:  # type: ignore[override]
        pb = self.config.prefill_batch
        tokens = np.zeros((pb, self._bucket(group[0])), np.int32)
        positions, lengths = np.zeros(pb, np.int32), np.zeros(pb, np.int32)
        reqs: list[GenerationRequest | None] = [None] * pb
        for row, slot in enumerate(group):
            r = self._slots[slot]
            assert r is not None
            start = int(self._prefilled[slot])
            piece = r.prompt[start : start + self.chunk]
            tokens[row, : len(piece)] = piece
            positions[row], lengths[row], reqs[row] = start, len(piece), r
        try:
            host = self._step(tokens, positions, lengths, reqs)
        except Exception as e:  # noqa: BLE001 - fails this step's requests only
            if len(group) > 1 and not self._lost():  # one row at a time: only the request at fault fails
                for slot in group:
                    self._prefill([slot])
                return
            log.exception("generation prefill failed")
            self._model_error(e, [r for r in reqs if r is not None])
            return
        self._counts["prefills"] += 1
        done = []
        for row, slot in enumerate(group):
            self._prefilled[slot] += lengths[row]
            self._written[slot] = self._prefilled[slot]
            r = self._slots[slot]
            if r is not None and self._prefilled[slot] == len(r.prompt):
                done.append((row, slot, r))
        if not done:
            return
        self._counts["tokens"] += len(done)
        toks, lps = _sample(host[[row for row, _, _ in done]], [r for _, _, r in done])
        for (_, slot, r), tok, lp in zip(done, toks.tolist(), lps):
            self._positions[slot], self._tokens[slot] = len(r.prompt), tok
            self._advance(slot, r, tok, lp)

    def _lost(self) -> bool:
        """Whether the pool is gone (donated to a call that failed)."""
        return not self._cache or any(getattr(x, "is_deleted", lambda: False)() for x in self._cache.values())

    def _advance(self, slot: int, r: GenerationRequest, tok: int, lp: Any) -> None:
        """Record ``r``'s new token: retire it, or claim room for the token's keys."""
        if r._add(tok, self.model.vocabulary, lp):
            self._retire(slot)
            return
        try:
            self._paged.append_tokens(r.id, [tok])
        except OutOfBlocks as e:  # the reservation makes this a bug, not a load condition
            log.exception("generation: a running request ran out of KV blocks")
            self._model_error(e, [r])

    def _decode(self) -> None:
        active = [(slot, r) for slot, r in enumerate(self._slots) if r is not None and not self._prefilling(slot)]
        if not active:
            return
        s = self.config.num_slots
        lengths = np.zeros(s, np.int32)
        seqs: list[GenerationRequest | None] = [None] * s
        for slot, r in active:
            lengths[slot], seqs[slot] = 1, r
        try:
            host = self._step(self._tokens[:, None].copy(), self._positions.copy(), lengths, seqs)
        except Exception as e:  # noqa: BLE001 - fails this step's requests only
            log.exception("generation decode step failed")
            self._model_error(e, [r for _, r in active])
            return
        self._counts["steps"] += 1
        self._counts["tokens"] += len(active)
        toks, lps = _sample(host[[slot for slot, _ in active]], [r for _, r in active])
        for (slot, r), tok, lp in zip(active, toks.tolist(), lps):
            self._written[slot] = self._positions[slot] + 1
            self._positions[slot] += 1
            self._tokens[slot] = tok
            self._advance(slot, r, tok, lp)

    # --- views ---

    def stats(self) -> dict[str, Any]:
        """:meth:`GenerationEngine.stats` plus the paged cache's: ``kv_layout``,
        ``num_blocks``, ``block_size``, ``free_blocks``, ``kv_cache_usage`` (blocks held by
        running requests / all), and the prefix cache's ``prefix_cache_query_tokens`` (prompt
        tokens admitted), ``prefix_cache_hit_tokens`` (of those, reused from the cache),
        ``prefix_cache_hit_rate`` and ``prefix_cache_evictions``."""
        out = super().stats()
        with self._cond:
            pc = self._paged.stats()
            out.update(kv_layout="paged", num_blocks=self.num_blocks, block_size=self.block_size,
                       free_blocks=self._paged.num_free_blocks, kv_cache_usage=self._paged.usage,
                       prefix_cache_query_tokens=pc.query_tokens, prefix_cache_hit_tokens=pc.hit_tokens,
                       prefix_cache_hit_rate=pc.hit_tokens / pc.query_tokens if pc.query_tokens else 0.0,
                       prefix_cache_evictions=pc.evictions)
        return out
