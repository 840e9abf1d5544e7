"""The generation engine over a paged KV cache: blocks claimed as tokens arrive, prefix
caching, chunked prefill.

``GenerationEngine(model, GenerationConfig(kv_layout="paged"))`` is a
:class:`PagedGenerationEngine`. It keeps one pool of ``num_blocks`` KV blocks of the
model's ``block_size`` tokens for all slots, and a :class:`~cairn.serving.PagedCache` for
the bookkeeping. Each engine step:

1. drops cancelled requests (their blocks go back to the pool);
2. admits waiting requests, oldest first (a preempted one ahead of all), into free slots
   while the pool holds what they need now: a request's prompt blocks are claimed at once
   (blocks found in the prefix cache are shared, not claimed; a shared partial block is
   copied on the request's first write into it), and nothing is reserved for its
   ``max_new_tokens``: it claims a block as its tokens arrive. A prompt whose cached prefix
   another request is still writing waits until those tokens are written;
3. prefills one chunk of up to ``prefill_chunk`` prompt tokens for up to ``prefill_batch``
   requests (all prefilling requests while none decodes) whose next chunks fall in one
   length bucket (:func:`~cairn.serving._generate.chunk_buckets`: 16, 32, 48, 64, 96, 128, ... up to
   ``prefill_chunk``, so a chunk of ``n > 32`` tokens runs at fewer than ``1.5 n``, and a
   suffix after a cached prefix costs what its own length costs), at the fixed shape
   ``(prefill_batch, bucket)``; a request whose prompt is done samples its first token. A
   long prompt takes several steps, and the decode steps run between them;
4. runs one decode step over all ``num_slots`` rows (rows not decoding write nothing). As
   in the contiguous engine (the shared ``GenerationEngine`` code), the previous step's
   per-row host work (recording tokens, detokenizing, stop strings, events) runs while the
   device computes this one, and a request's events arrive one step later.

When a running request needs a block and the pool has none, the youngest running request
(maybe that one) is preempted: its blocks go back (those it wrote keep their prefix-cache
names) and it waits at the head of the queue. It resumes like a new request whose prompt is
its prompt plus what it generated: cached blocks are reused, the rest of the prompt is
prefilled in chunks as before, and its generated tokens are fed again through decode steps
(its own row, the computation that first produced them) until it samples its next token.
Nothing is sampled or streamed twice.

Every compiled shape is fixed and rows never interact (each reads only its own block
table), and sampling depends on ``(seed, token index)`` alone, so a request gets the tokens
it would get alone, prefix hits and preemptions included (a cached block holds what the
request would have computed itself).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from cairn.serving._generate import (
    GenerationConfig,
    GenerationEngine,
    GenerationRequest,
    chunk_buckets,
)
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

    # a decode step's rows claim their next blocks as they are sampled; admitting new prompts
    # first could preempt them: sampled at once, as before
    _overlap_sampling = False

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
        self._buckets = chunk_buckets(self.chunk)
        n = config.num_slots
        self._prefilled = np.zeros(n, np.int64)  # prompt tokens of each slot's request already in the cache
        self._written = np.zeros(n, np.int64)  # tokens of each slot whose keys and values are written
        self._replay = np.full(n, -1, np.int64)  # a resumed request's next known token to feed (-1: none)
        self._watermark = max(1, self.num_blocks // 100)  # blocks admission leaves for the running requests' growth
        self._copy: Any = None
        self._paged = PagedCache(self.num_blocks, self.block_size, max_blocks_per_seq=self.max_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching)

    # --- state ---

    def _reset_cache(self) -> None:
        self._cache = self.model.init_pool(self.num_blocks)  # type: ignore[attr-defined]
        self._paged = PagedCache(self.num_blocks, self.block_size, max_blocks_per_seq=self.max_blocks,
                                 enable_prefix_caching=self.config.enable_prefix_caching)
        self._copy = _copier()

    def _free(self, slot: int) -> None:
        r = self._slots[slot]
        if r is not None and r.id in self._paged:
            self._paged.free(r.id, written=int(self._written[slot]))
        super()._free(slot)
        self._prefilled[slot] = self._written[slot] = 0
        self._replay[slot] = -1

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
        none = np.full(s, self.num_blocks, np.int32)  # out of range: nothing is copied
        self._cache = self._copy(self._cache, *jax.device_put((none, none)))
        jax.block_until_ready((logits, self._cache))

    # --- admission ---

    def _validate(self, prompt: Any, params: Any) -> tuple[tuple[int, ...], frozenset[int]]:
        toks, stops = super()._validate(prompt, params)
        need = -(-(len(toks) + params.max_new_tokens - 1) // self.block_size)
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

    def _unwritten(self) -> dict[int, int]:
        """Blocks of live sequences not yet fully written -> how many of their leading
        tokens are (the least over the sequences holding them)."""
        bs, out = self.block_size, dict[int, int]()
        for i, r in enumerate(self._slots):
            if r is None:
                continue
            w = int(self._written[i])
            for j, b in enumerate(self._paged.block_table(r.id)[w // bs :], start=w // bs):
                out[b] = min(out.get(b, bs), max(0, w - j * bs))
        return out

    def _admit(self, free: list[int]) -> None:
        """Admit queued requests, oldest (or preempted) first, while a slot is free and the
        pool holds their tokens now (a request grows block by block as it generates; when
        the pool runs out, the youngest running request is preempted, :meth:`_grow`). A
        prompt whose cached prefix is still being written waits for it."""
        unwritten = self._unwritten()
        bs = self.block_size
        while self._queue and free:
            r = self._queue[0]
            seq = r.prompt + tuple(r.token_ids)  # a preempted request resumes with what it generated
            hits, looked = self._paged.cached_prefix(seq), len(seq) - 1
            if any(unwritten.get(b, bs) < min(bs, looked - j * bs) for j, b in enumerate(hits)):
                break  # its cached prefix is still being written: wait for it
            keep = self._watermark if any(x is not None for x in self._slots) else 0
            if self._paged.blocks_needed(seq) > self._paged.num_free_blocks - keep:
                break  # oldest first: a big request is not starved by smaller ones behind it
            self._queue.popleft()
            slot = free.pop(0)
            self._slots[slot] = r
            cached = self._paged.add_sequence(r.id, seq)
            self._written[slot] = cached
            self._prefilled[slot] = min(cached, len(r.prompt))
            if r.token_ids and cached >= len(r.prompt):
                self._resume(slot, r, cached)
            unwritten = self._unwritten()

    def _resume(self, slot: int, r: GenerationRequest, pos: int) -> None:
        """A preempted request whose keys and values up to ``pos`` are back: it replays its
        generated tokens from there through decode steps (its own rows, as when it first
        generated them, so its next logits are those it would have had), then samples on."""
        self._tokens[slot] = r.token_ids[pos - len(r.prompt)]
        self._positions[slot] = pos
        self._replay[slot] = pos - len(r.prompt) + 1

    # --- steps ---

    def _dispatch(self, tokens: np.ndarray, positions: np.ndarray, lengths: np.ndarray, seqs: list) -> Any:
        """Start one paged call (after the blocks copied on write); rows of ``seqs`` (a
        request or None) read their block tables. Its logits, not waited for."""
        copies = self._paged.take_copies()
        while copies:
            part, copies = copies[: len(self._slots)], copies[len(self._slots) :]
            src = np.full(len(self._slots), self.num_blocks, np.int32)
            dst = src.copy()
            src[: len(part)], dst[: len(part)] = zip(*part)
            self._cache = self._copy(self._cache, src, dst)
        tables = np.zeros((len(seqs), self.max_blocks), np.int32)
        for i, r in enumerate(seqs):
            if r is not None:
                tables[i] = self._paged.block_tables([r.id])[0]
        # the call takes the host arrays (fresh here, never written again) and transfers
        # them itself: a jax.device_put of the four first cost ~0.1 ms more per step
        logits, self._cache = self.model.paged_step(tokens, positions, lengths, tables, self._cache)  # type: ignore[attr-defined]
        return logits

    def _prefill(self, group: list[int]) -> None:  # type: ignore[override]
        group = [slot for slot in group if self._prefilling(slot)]  # a row preempted since _pick left
        if not group:
            return
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
            logits = self._dispatch(tokens, positions, lengths, reqs)
            self._flush()  # the last decode step's events, while the device prefills
            host = np.asarray(logits)
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
            if r is None or self._prefilled[slot] < len(r.prompt):
                continue
            if r.token_ids:  # resumed: its first token is known
                self._resume(slot, r, len(r.prompt))
            else:
                self._positions[slot] = len(r.prompt)
                done.append((row, slot, r))
        self._counts["tokens"] += len(done)
        self._take(host, done, defer=False)

    def _lost(self) -> bool:
        """Whether the pool is gone (donated to a call that failed)."""
        return not self._cache or any(getattr(x, "is_deleted", lambda: False)() for x in self._cache.values())

    def _decode_rows(self) -> list[tuple[int, GenerationRequest]]:
        return [(slot, r) for slot, r in enumerate(self._slots) if r is not None and not self._prefilling(slot)]

    def _dispatch_decode(self, rows: list[tuple[int, GenerationRequest]]) -> Any:
        s = self.config.num_slots
        lengths = np.zeros(s, np.int32)
        seqs: list[GenerationRequest | None] = [None] * s
        for slot, r in rows:
            lengths[slot], seqs[slot] = 1, r
        return self._dispatch(self._tokens[:, None].copy(), self._positions.copy(), lengths, seqs)

    def _decoded(self, rows: list[tuple[int, GenerationRequest]]) -> list[tuple[int, GenerationRequest]]:
        """Rows that replay a resumed request's known tokens feed the next one instead of sampling."""
        out = []
        for slot, r in rows:
            self._written[slot] = self._positions[slot]  # the fed token's keys and values are in
            k = int(self._replay[slot])
            if 0 <= k < len(r.token_ids):
                self._tokens[slot], self._replay[slot] = r.token_ids[k], k + 1
            else:
                self._replay[slot] = -1
                out.append((slot, r))
        return out

    def _grow(self, rows: list[tuple[int, GenerationRequest, int, Any]]) -> None:
        """Claim the blocks the rows' new tokens go into, oldest request first; when the pool
        is out of blocks, preempt the youngest running request (maybe the row's own) until
        it fits: its blocks go back, and it waits at the head of the queue to resume."""
        for slot, r, tok, _ in sorted(rows, key=lambda row: row[1].id):
            while self._slots[slot] is r:
                try:
                    self._paged.append_tokens(r.id, [tok])
                    break
                except OutOfBlocks:
                    self._preempt(max((i for i, x in enumerate(self._slots) if x is not None), key=self._age))

    def _preempt(self, slot: int) -> None:
        """Free ``slot``'s blocks and put its request back at the head of the queue; its
        sampled but unrecorded token is recorded first (it resumes with every token)."""
        r = self._slots[slot]
        assert r is not None
        rows = [row for row in self._pending if row[1] is r]
        self._pending = [row for row in self._pending if row[1] is not r]
        log.info("generation: KV pool full, request %d preempted after %d tokens", r.id, len(r.token_ids) + len(rows))
        with self._cond:
            self._free(slot)
            self._queue.appendleft(r)
            self._counts["preemptions"] += 1
        self._flush_rows(rows)  # a stop string found here takes it out of the queue

    # --- views ---

    def stats(self) -> dict[str, Any]:
        """:meth:`GenerationEngine.stats` plus the paged cache's: ``kv_layout``,
        ``num_blocks``, ``block_size``, ``free_blocks``, ``kv_cache_usage`` (blocks held by
        running requests / all), and the prefix cache's ``prefix_cache_query_tokens`` (prompt
        tokens admitted), ``prefix_cache_hit_tokens`` (of those, reused from the cache),
        ``prefix_cache_hit_rate``, ``prefix_cache_evictions`` and ``prefix_cache_copies``
        (shared partial blocks copied on write); ``preemptions`` (running requests sent back
        to the queue for want of blocks)."""
        out = super().stats()
        with self._cond:
            pc = self._paged.stats()
            out.update(kv_layout="paged", num_blocks=self.num_blocks, block_size=self.block_size,
                       free_blocks=self._paged.num_free_blocks, kv_cache_usage=self._paged.usage,
                       prefix_cache_query_tokens=pc.query_tokens, prefix_cache_hit_tokens=pc.hit_tokens,
                       prefix_cache_hit_rate=pc.hit_tokens / pc.query_tokens if pc.query_tokens else 0.0,
                       prefix_cache_evictions=pc.evictions, prefix_cache_copies=pc.copies,
                       preemptions=self._counts["preemptions"])
        return out


def _copy_blocks(pool: dict, src: Any, dst: Any) -> dict:
    """Blocks ``src`` of every pool array into blocks ``dst`` (an out-of-range ``dst`` copies nothing)."""
    return {n: a.at[dst].set(a[src], mode="drop") for n, a in pool.items()}


def _copier() -> Any:
    """``_copy_blocks`` jitted with the pool donated (one jit shared by all engines)."""
    global _COPY
    if _COPY is None:
        import jax

        _COPY = jax.jit(_copy_blocks, donate_argnums=(0,))
    return _COPY


_COPY: Any = None
