"""The paged KV cache's bookkeeping: blocks, block tables, prefix caching, LRU eviction.

:class:`PagedCache` owns no arrays. It hands out ids of fixed-size blocks (pages of
``block_size`` tokens in ``cairn.kernels``' ``[num_blocks, block_size, heads, dim]``
key/value pages) and keeps one block table per sequence; the engine writes keys and
values with ``cairn.kernels.paged_kv_write`` and reads them with
``cairn.kernels.paged_attention`` through :meth:`PagedCache.block_tables`.

* A sequence claims blocks as its tokens arrive (:meth:`~PagedCache.add_sequence` for the
  prompt, :meth:`~PagedCache.append_tokens` per generated token), never ``max_length``
  up front, and gives them back on :meth:`~PagedCache.free` (finish or cancel).
* Prefix caching: a *full* block is named by a hash chained over (its parent block's
  hash, its token ids), so the name covers the whole prefix up to it. A new prompt walks
  its full blocks through the index and reuses every block already there (reference
  counted), so a shared system prompt or the prompt of ``n`` samples is stored, and
  prefilled, once.
* A block whose last reference goes away keeps its contents and its name (evictable);
  it is reused as is by a later hit, or evicted, least recently used first, only when a
  new block is needed and no never-named block is free.

* Copy-on-write of a partial block: a prompt also names the partial block holding its
  tokens before the last one (the ``n`` samples of one prompt, or a prompt repeated, share
  it whole: only the last token, whose logits the engine needs, is computed anew). A
  sequence never writes into a block another sequence holds: its first write into a shared
  block claims a new one, and the engine copies the shared block's contents into it
  (:meth:`~PagedCache.take_copies`) before its next step. A full block is never written
  again (a sequence writes only past its last full block).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

_ROOT = b"cairn-paged-kv-root"
_FREED_MEMORY = 4096  # recently freed ids remembered to name a double free


class OutOfBlocks(RuntimeError):
    """Not enough free KV-cache blocks for the request; nothing was claimed."""


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups since construction (or :meth:`PagedCache.reset_stats`).

    Args:
      queries: full prompt blocks looked up (those before the prompt's last token).
      hits: of those, found in the cache and reused.
      hit_tokens: tokens whose keys and values were reused (full blocks, and the tokens of
        partial blocks shared).
      query_tokens: tokens of all prompts added.
      evictions: cached blocks evicted to make room.
      copies: shared partial blocks copied on a sequence's first write into them.
    """

    queries: int
    hits: int
    hit_tokens: int
    query_tokens: int
    evictions: int
    copies: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclasses.dataclass
class _Seq:
    blocks: list[int]
    num_tokens: int
    cached_tokens: int
    parent_hash: bytes  # the hash of the last full block (the chain's tail)
    tail: list[int]  # token ids of the partial last block


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The name of a full block: BLAKE2b-128 over the parent block's name and the token ids.

    ``parent`` is ``None`` for a sequence's first block. Equal names mean equal prefixes
    (up to a 2**-128 collision chance), so a name identifies the block's whole prefix.

    Args:
      parent: the previous block's name, or None for a sequence's first block.
      token_ids: the block's token ids.

    >>> a = block_hash(None, [1, 2]); block_hash(a, [3, 4]) == block_hash(block_hash(None, [1, 2]), [3, 4])
    True
    >>> block_hash(None, [3, 4]) == block_hash(a, [3, 4])
    False

    Returns:
      16 bytes.
    """
    return _chain(parent, np.asarray(token_ids, dtype=np.int64).tobytes())


def _chain(parent: bytes | None, raw: bytes) -> bytes:
    """:func:`block_hash` of token ids already as (native) int64 bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT if parent is None else parent)
    h.update(raw)
    return h.digest()


class PagedCache:
    """Block allocator with per-sequence block tables and prefix caching (see the module docstring).

    Not thread-safe: the engine's scheduler owns it.

    Args:
      num_blocks: blocks in the KV memory (the pages' first axis).
      block_size: tokens per block.
      max_blocks_per_seq: the block-table width (``ceil(max_length / block_size)``); a
        sequence may not grow past it. ``None``: ``num_blocks``.
      enable_prefix_caching: name full blocks and reuse them across sequences.

    Raises:
      ValueError: a size below 1.

    Example:
      >>> cache = PagedCache(num_blocks=8, block_size=4)
      >>> cache.add_sequence("a", [7, 7, 7, 7, 1, 2])       # 2 blocks, nothing cached yet
      0
      >>> cache.add_sequence("b", [7, 7, 7, 7, 5])          # shares "a"'s first block
      4
      >>> cache.block_table("a")[0] == cache.block_table("b")[0], cache.refcount(cache.block_table("a")[0])
      (True, 2)
      >>> cache.append_tokens("b", [6, 6, 6, 6])            # fills b's tail, claims one more
      >>> cache.num_free_blocks, cache.stats().hit_rate
      (4, 0.5)
      >>> cache.free("a"); cache.free("b"); cache.num_free_blocks
      8
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_blocks_per_seq: int | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        for name, val in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        width = num_blocks if max_blocks_per_seq is None else max_blocks_per_seq
        if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width < 1:
            raise ValueError(f"max_blocks_per_seq must be an int >= 1 or None, got {max_blocks_per_seq!r}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.max_blocks_per_seq = int(width)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref = [0] * self.num_blocks
        self._free: collections.deque[int] = collections.deque(range(self.num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        # partial blocks named by their leading tokens: block -> (name, how many tokens it names)
        self._partial_of: dict[int, tuple[bytes, int]] = {}
        self._by_partial: dict[bytes, int] = {}
        # the last prefix lookup (the engine asks up to three times per admission):
        # (names version, token ids, hits); valid while no name is added or dropped
        self._names_version = 0
        self._last_hits: tuple[int, tuple[int, ...], list[int]] | None = None
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks the engine has yet to copy
        self._seqs: dict[Hashable, _Seq] = {}
        self._freed: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.reset_stats()

    # --- views ---

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new token may claim: never-named free blocks plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence references that still hold a named prefix (evictable, LRU)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """``num_used_blocks / num_blocks``."""
        return self.num_used_blocks / self.num_blocks

    @property
    def sequences(self) -> list[Hashable]:
        """The live sequence ids, in the order they were added."""
        return list(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def refcount(self, block: int) -> int:
        """How many live sequences reference ``block``.

        Args:
          block: a block id.
        """
        return self._ref[block]

    def eviction_order(self) -> list[int]:
        """The evictable cached blocks, the next to be evicted first."""
        return list(self._evictable)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The block ids of ``seq_id``, in position order (token ``j`` is in entry ``j // block_size``).

        Args:
          seq_id: a live sequence's key.

        Raises:
          KeyError: ``seq_id`` is not live.
        """
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` (prompt and appended).

        Args:
          seq_id: a live sequence's key.
        """
        return self._seq(seq_id).num_tokens

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """Leading prompt tokens of ``seq_id`` whose keys and values came from the prefix cache.

        The engine prefills only the tokens after these (always fewer than the prompt's
        length; a multiple of ``block_size`` unless a partial block was shared).

        Args:
          seq_id: a live sequence's key.
        """
        return self._seq(seq_id).cached_tokens

    def block_tables(self, seq_ids: Sequence[Hashable], width: int | None = None, pad: int = 0) -> np.ndarray:
        """``int32 [len(seq_ids), width]`` block tables, padded with ``pad`` (``cairn.kernels``' layout).

        ``width`` defaults to ``max_blocks_per_seq``; ``paged_attention`` never reads the
        padding, so any valid id (the default 0) keeps jitted gathers in range.

        Args:
          seq_ids: the live sequences, one row each.
          width: the columns; None uses ``max_blocks_per_seq``.
          pad: the block id written past each sequence's blocks.

        Raises:
          KeyError: a sequence is not live.
          ValueError: a sequence has more than ``width`` blocks.
        """
        width = self.max_blocks_per_seq if width is None else int(width)
        out = np.full((len(seq_ids), width), pad, np.int32)
        for row, seq_id in enumerate(seq_ids):
            blocks = self._seq(seq_id).blocks
            if len(blocks) > width:
                raise ValueError(f"sequence {seq_id!r} has {len(blocks)} blocks, more than width={width}")
            out[row, : len(blocks)] = blocks
        return out

    def stats(self) -> PrefixCacheStats:
        """Prefix-cache counters (hit rate for metrics)."""
        return PrefixCacheStats(self._queries, self._hits, self._hit_tokens, self._query_tokens, self._evictions,
                                self._copy_count)

    def reset_stats(self) -> None:
        """Zero the prefix-cache counters."""
        self._queries = self._hits = self._hit_tokens = self._query_tokens = self._evictions = self._copy_count = 0

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(source, destination)`` block copies owed since the last call (copy-on-write
        of shared partial blocks), oldest first; the engine copies each block's keys and
        values before its next step writes. The list is handed over once."""
        out, self._copies = self._copies, []
        return out

    # --- admission ---

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _prefix_hits(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the prompt's tokens before its last one: its leading full
        blocks, then (when all of those hit) the partial block of the rest, if named."""
        if not self.enable_prefix_caching:
            return []
        key = tuple(token_ids)
        last = self._last_hits
        if last is not None and last[0] == self._names_version and last[1] == key:
            return list(last[2])
        found = self._walk_prefix(token_ids)
        self._last_hits = (self._names_version, key, found)
        return list(found)

    def _walk_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """:meth:`_prefix_hits` without the memo: the chain of block names, looked up in turn."""
        found: list[int] = []
        parent, n, bs = None, len(token_ids) - 1, self.block_size
        raw = np.asarray(token_ids[:n], dtype=np.int64).tobytes()  # converted once, hashed block by block
        width = bs * 8
        for i in range(n // bs):
            parent = _chain(parent, raw[i * width : (i + 1) * width])
            block = self._by_hash.get(parent)
            if block is None:
                return found
            found.append(block)
        if n % bs:
            block = self._by_partial.get(_chain(parent, raw[(n - n % bs) * 8 :]))
            if block is not None:
                found.append(block)
        return found

    def _cached_tokens(self, hits: list[int], num_tokens: int) -> int:
        return min(len(hits) * self.block_size, num_tokens - 1)

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks :meth:`add_sequence` of ``token_ids`` would reuse (nothing is claimed
        or counted); the engine holds a prompt back while one of them is still being written.

        Args:
          token_ids: the prompt's token ids.
        """
        return self._prefix_hits(_token_list(token_ids))

    def blocks_needed(self, prompt: int | Sequence[int], *, reserve_tokens: int = 0) -> int:
        """Free blocks admitting ``prompt`` (+ ``reserve_tokens`` more) would take, prefix hits counted.

        ``prompt`` is the token ids, or just their count (no prefix lookup). A hit on an
        evictable cached block takes that block out of the free pool too, so it counts.

        Args:
          prompt: the prompt's token ids, or just their count (then no prefix lookup).
          reserve_tokens: tokens to be appended later, counted too.
        """
        n = prompt if isinstance(prompt, (int, np.integer)) else len(prompt)
        total = self._blocks_for(int(n) + int(reserve_tokens))
        if isinstance(prompt, (int, np.integer)):
            return total
        tokens = _token_list(prompt)
        hits = self._prefix_hits(tokens)
        if self._cached_tokens(hits, len(tokens)) % self.block_size:
            hits = hits[:-1]  # a shared partial block is copied on write: it saves no block
        return total - sum(1 for b in hits if self._ref[b] > 0)

    def can_admit(self, prompt: int | Sequence[int], *, reserve_tokens: int = 0) -> bool:
        """Whether :meth:`add_sequence` of ``prompt`` (then ``reserve_tokens`` appends) fits now.

        The engine queues a request while this is ``False`` instead of failing it.

        Args:
          prompt: the prompt's token ids, or just their count.
          reserve_tokens: tokens to be appended later, counted too.
        """
        n = prompt if isinstance(prompt, (int, np.integer)) else len(prompt)
        if self._blocks_for(int(n) + int(reserve_tokens)) > self.max_blocks_per_seq:
            return False
        return self.blocks_needed(prompt, reserve_tokens=reserve_tokens) <= self.num_free_blocks

    # --- sequence life cycle ---

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Claim blocks for a new sequence's prompt; returns how many leading tokens were cached.

        Leading full blocks found in the prefix cache are shared (reference counted); the
        rest are claimed from the free pool (evicting LRU cached blocks if needed). The
        engine computes keys and values for tokens ``num_cached_tokens ..`` and writes them
        into :meth:`block_table`'s blocks.

        Args:
          seq_id: a key for the new sequence (any hashable).
          token_ids: the prompt's token ids (at least one).

        Raises:
          ValueError: ``seq_id`` already live, an empty prompt, or one longer than
            ``max_blocks_per_seq * block_size``.
          TypeError: token ids that are not integers.
          OutOfBlocks: not enough free blocks (nothing is claimed; see :meth:`can_admit`).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already live; free it before adding it again")
        tokens = _token_list(token_ids)
        if not tokens:
            raise ValueError(f"sequence {seq_id!r}: the prompt is empty (at least one token is needed)")
        self._check_width(seq_id, len(tokens))
        hits = self._prefix_hits(tokens)
        cached = self._cached_tokens(hits, len(tokens))
        partial = cached % self.block_size != 0
        need = self._blocks_for(len(tokens)) - len(hits) + (1 if partial and self._ref[hits[-1]] > 0 else 0)
        available = self.num_free_blocks - sum(1 for b in hits if self._ref[b] == 0)
        if need > available:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} new KV blocks for {len(tokens)} tokens "
                f"({len(hits)} cached), only {available} free of {self.num_blocks}"
            )
        for block in hits:
            self._ref_up(block)
        queried = (len(tokens) - 1) // self.block_size if self.enable_prefix_caching else 0
        full = hits[:-1] if partial else hits
        self._queries += queried
        self._hits += len(full)
        self._hit_tokens += cached
        self._query_tokens += len(tokens)
        parent = self._hash_of[full[-1]] if full else _ROOT
        seq = _Seq(list(hits), cached, cached, parent, tokens[len(full) * self.block_size : cached])
        self._seqs[seq_id] = seq
        self._freed.pop(seq_id, None)
        self._extend(seq, tokens[cached:], mark=len(tokens) - 1)
        return seq.cached_tokens

    def append_tokens(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Extend a live sequence by generated tokens, claiming a block each ``block_size`` tokens.

        A block that fills up is named and enters the prefix cache (a later prompt that
        repeats this sequence's text, e.g. the next chat turn, reuses it).

        Args:
          seq_id: a live sequence's key.
          token_ids: the generated token ids to add.

        Raises:
          KeyError: ``seq_id`` is not live (never added, or freed).
          ValueError: the sequence would outgrow ``max_blocks_per_seq``.
          TypeError: token ids that are not integers.
          OutOfBlocks: not enough free blocks (nothing is claimed).
        """
        seq = self._seq(seq_id)
        tokens = _token_list(token_ids)
        total = seq.num_tokens + len(tokens)
        self._check_width(seq_id, total)
        need = self._blocks_for(total) - len(seq.blocks) + self._copy_needed(seq, len(tokens))
        if need > self.num_free_blocks:
            raise OutOfBlocks(
                f"sequence {seq_id!r} needs {need} more KV blocks to grow to {total} tokens, "
                f"only {self.num_free_blocks} free of {self.num_blocks}"
            )
        self._extend(seq, tokens)

    def free(self, seq_id: Hashable, *, written: int | None = None) -> None:
        """Release a finished or cancelled sequence's blocks.

        Named blocks stay cached (evictable); the sequence's blocks are released tail
        first, so a prefix's head is evicted last. Unnamed (partial) blocks return to the
        free pool.

        Args:
          seq_id: a live sequence's key.
          written: how many of its leading tokens have their keys and values written (a
            request cancelled mid-prefill); blocks holding later tokens lose their names, so
            no later prompt reuses contents that were never computed. ``None``: all of them.

        Raises:
          KeyError: ``seq_id`` is not live (naming a double free).
        """
        seq = self._seq(seq_id)
        if written is not None:
            w, bs = max(0, int(written)), self.block_size
            for j, block in enumerate(seq.blocks[w // bs :], start=w // bs):
                if self._ref[block] != 1:
                    continue
                if block in self._hash_of and (j + 1) * bs > w:
                    self._unname(block)
                elif block in self._partial_of and j * bs + self._partial_of[block][1] > w:
                    self._unname(block)
        del self._seqs[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > _FREED_MEMORY:
            self._freed.popitem(last=False)
        for block in reversed(seq.blocks):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if block in self._hash_of or block in self._partial_of:
                self._evictable[block] = None  # most recently used: evicted last
            else:
                self._free.append(block)

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block (e.g. after new weights); returns how many.

        Blocks in use keep their names until released.
        """
        n = len(self._evictable)
        for block in list(self._evictable):
            self._unname(block)
            self._free.append(block)
        self._evictable.clear()
        return n

    # --- internals ---

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            if seq_id in self._freed:
                raise KeyError(f"sequence {seq_id!r} was already freed (double free?)") from None
            raise KeyError(f"unknown sequence {seq_id!r}: it was never added") from None

    def _check_width(self, seq_id: Hashable, num_tokens: int) -> None:
        limit = self.max_blocks_per_seq * self.block_size
        if num_tokens > limit:
            raise ValueError(
                f"sequence {seq_id!r} would hold {num_tokens} tokens, more than max_blocks_per_seq * "
                f"block_size = {self.max_blocks_per_seq} * {self.block_size} = {limit}"
            )

    def _ref_up(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _claim(self) -> int:
        """A block with no reference: a never-named free one, else the LRU cached one (evicted)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._unname(block)
            self._evictions += 1
        self._ref[block] = 1
        return block

    def _unname(self, block: int) -> None:
        """Forget ``block``'s names (full and partial)."""
        self._names_version += 1
        name = self._hash_of.pop(block, None)
        if name is not None and self._by_hash.get(name) == block:
            del self._by_hash[name]
        named = self._partial_of.pop(block, None)
        if named is not None and self._by_partial.get(named[0]) == block:
            del self._by_partial[named[0]]

    def _copy_needed(self, seq: _Seq, num_new: int) -> int:
        """1 when appending ``num_new`` tokens starts by writing into a partial block another
        sequence holds (copied on write), else 0."""
        return int(num_new > 0 and seq.num_tokens % self.block_size != 0 and self._ref[seq.blocks[-1]] > 1)

    def _before_write(self, seq: _Seq) -> None:
        """The sequence is about to write into its partial last block: copy it if shared;
        else drop the names its new contents would contradict."""
        block, offset = seq.blocks[-1], seq.num_tokens % self.block_size
        if self._ref[block] > 1:
            new = self._claim()
            self._ref[block] -= 1
            seq.blocks[-1] = new
            self._copies.append((block, new))
            self._copy_count += 1
            return
        if block in self._hash_of or (block in self._partial_of and self._partial_of[block][1] > offset):
            self._unname(block)  # another sequence filled it (a partial hit): its full name no longer holds

    def _extend(self, seq: _Seq, tokens: list[int], mark: int = -1) -> None:
        """Append ``tokens`` (room already checked), claiming blocks (copying a shared partial
        one) and naming the ones that fill; after ``mark`` tokens, name the partial block."""
        bs = self.block_size
        for i, token in enumerate(tokens):
            if seq.num_tokens % bs == 0:
                seq.blocks.append(self._claim())
            elif i == 0:
                self._before_write(seq)
            seq.tail.append(token)
            seq.num_tokens += 1
            if seq.num_tokens == mark and mark % bs and self.enable_prefix_caching:
                self._name_partial(seq)
            if len(seq.tail) == bs:
                name = block_hash(None if seq.parent_hash == _ROOT else seq.parent_hash, seq.tail)
                seq.parent_hash, seq.tail = name, []
                if self.enable_prefix_caching and name not in self._by_hash:
                    self._by_hash[name] = seq.blocks[-1]
                    self._names_version += 1
                    self._hash_of[seq.blocks[-1]] = name

    def _name_partial(self, seq: _Seq) -> None:
        """Name the partial last block by its tokens so far (a prompt's tokens before its last)."""
        name = block_hash(None if seq.parent_hash == _ROOT else seq.parent_hash, seq.tail)
        block = seq.blocks[-1]
        if name not in self._by_partial and block not in self._partial_of:
            self._by_partial[name] = block
            self._names_version += 1
            self._partial_of[block] = (name, len(seq.tail))


def _token_list(token_ids: Iterable[int]) -> list[int]:
    """Token ids as Python ints; raises ``TypeError`` naming the first that is not an integer."""
    if isinstance(token_ids, (list, tuple)) and all(type(tok) is int for tok in token_ids):
        return list(token_ids)  # the common case, checked in one pass (bool is not int here)
    out = []
    for i, tok in enumerate(token_ids):
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise TypeError(f"token_ids[{i}] must be an integer token id, got {tok!r}")
        out.append(int(tok))
    return out
