"""PagedCache: block tables, prefix caching, LRU eviction, admission, errors.

A hypothesis state machine drives random add / append / free / reset sequences (prompts
drawn from a few shared prefixes so blocks are shared) against a model that writes each
token into the slot the cache gave it (after the block copies the cache asks for), and
checks after every step: no write lands in a block two live sequences hold (a shared
partial block is copied on write), a shared block holds the same tokens for every sharer
up to where each sees it, every cache hit holds exactly the prompt's tokens, refcounts
equal the live tables' references, free + used == total, and nothing leaks once every
sequence is freed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cairn.serving import OutOfBlocks, PagedCache, block_hash

BS = 4


class PagedCacheMachine(RuleBasedStateMachine):
    """The cache under random operations, against a model of what the engine would write."""

    def __init__(self):
        super().__init__()
        self.cache = PagedCache(num_blocks=12, block_size=BS, max_blocks_per_seq=6)
        self.tokens: dict[int, list[int]] = {}  # live sequence -> its tokens
        # block -> per slot, the whole prefix up to that token (what its key/value depends on)
        self.content: dict[int, list[tuple[int, ...] | None]] = {}
        self.ids = itertools.count()

    def _write(self, seq, start):
        """Copy the blocks the cache asks for, then write tokens ``start..`` of ``seq`` into
        their slots; shared blocks must never be written."""
        for src, dst in self.cache.take_copies():
            self.content[dst] = list(self.content[src])
        table = self.cache.block_table(seq)
        for j in range(start, len(self.tokens[seq])):
            block = table[j // BS]
            assert self.cache.refcount(block) == 1, f"write into block {block} shared by {self.cache.refcount(block)}"
            slots = self.content.setdefault(block, [None] * BS)
            slots[j % BS] = tuple(self.tokens[seq][: j + 1])
            slots[j % BS + 1 :] = [None] * (BS - j % BS - 1)  # a reused block's stale tail is not content

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2, 3, 4]]),
          suffix=st.lists(st.integers(0, 3), min_size=0, max_size=9))
    def add(self, prefix, suffix):
        prompt = prefix + suffix or [0]
        seq = next(self.ids)
        fits = self.cache.can_admit(prompt)
        free_before = self.cache.num_free_blocks
        try:
            cached = self.cache.add_sequence(seq, prompt)
        except OutOfBlocks:
            assert not fits and self.cache.num_free_blocks == free_before and seq not in self.cache
            return
        except ValueError:
            assert len(prompt) > 6 * BS and not fits
            return
        assert fits
        assert cached < len(prompt) and (cached % BS == 0 or cached == len(prompt) - 1)
        self.tokens[seq] = list(prompt)
        self._write(seq, cached)
        table = self.cache.block_table(seq)
        for j in range(cached):  # every reused slot holds exactly this prompt's prefix up to there
            assert self.content[table[j // BS]][j % BS] == tuple(prompt[: j + 1])

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1, 2, 3, 4]]),
          suffix=st.sampled_from([[], [0], [1, 2], [0, 1, 2, 3, 0]]))  # few, so a prompt is looked up again
    def lookup(self, prefix, suffix):
        """A lookup (remembered by the cache until a block name changes) holds exactly the
        prompt's prefix, whatever was named, evicted or reset since the last one."""
        prompt = prefix + suffix
        hits = self.cache.cached_prefix(prompt)
        assert self.cache.cached_prefix(list(prompt)) == hits
        cached = set(self.cache.eviction_order())  # a hit is held or cached, never a free block
        assert all(self.cache.refcount(b) > 0 or b in cached for b in hits), (hits, cached)
        for j in range(min(len(hits) * BS, len(prompt) - 1)):
            assert self.content[hits[j // BS]][j % BS] == tuple(prompt[: j + 1]), (prompt, hits, j)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data, new):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        start = len(self.tokens[seq])
        try:
            self.cache.append_tokens(seq, new)
        except (OutOfBlocks, ValueError):
            assert self.cache.num_tokens(seq) == start
            return
        self.tokens[seq] += new
        self._write(seq, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq)
        del self.tokens[seq]
        with pytest.raises(KeyError, match="already freed"):
            self.cache.free(seq)

    @rule()
    def reset_prefix_cache(self):
        self.cache.reset_prefix_cache()
        assert self.cache.num_cached_blocks == 0

    @invariant()
    def blocks_are_accounted_for(self):
        cache = self.cache
        refs = np.zeros(cache.num_blocks, int)
        for seq, toks in self.tokens.items():
            table = cache.block_table(seq)
            assert len(table) == -(-len(toks) // BS) and len(set(table)) == len(table)
            assert cache.num_tokens(seq) == len(toks)
            for block in table:
                refs[block] += 1
        assert [cache.refcount(b) for b in range(cache.num_blocks)] == refs.tolist()
        assert cache.num_used_blocks == int((refs > 0).sum())
        assert cache.num_free_blocks + cache.num_used_blocks == cache.num_blocks
        assert all(refs[b] == 0 for b in cache.eviction_order())

    @invariant()
    def shared_blocks_hold_the_same_prefix(self):
        owners: dict[int, list[tuple[int, int]]] = {}
        for seq in self.tokens:
            for i, block in enumerate(self.cache.block_table(seq)):
                owners.setdefault(block, []).append((seq, i))
        for block, users in owners.items():
            if len(users) < 2:
                continue
            seen = min(min(len(self.tokens[s]), (i + 1) * BS) - i * BS for s, i in users)
            prefixes = {tuple(self.tokens[s][: i * BS + seen]) for s, i in users}
            assert len(prefixes) == 1, f"block {block} shared by different prefixes {prefixes}"
            # what every sharer reads of it is what was written there
            assert all(self.content[block][k] == tuple(self.tokens[users[0][0]][: users[0][1] * BS + k + 1])
                       for k in range(seen)), block

    def teardown(self):
        for seq in list(self.tokens):
            self.cache.free(seq)
        assert self.cache.num_used_blocks == 0
        assert self.cache.num_free_blocks == self.cache.num_blocks
        assert len(self.cache) == 0


PagedCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestPagedCacheStateMachine = PagedCacheMachine.TestCase


# --- prefix sharing on constructed workloads ---


def test_shared_system_prompt_hit_rate():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32000, 512).tolist()
    cache = PagedCache(num_blocks=400, block_size=16)
    for i in range(8):
        cached = cache.add_sequence(i, system + rng.integers(0, 32000, 100).tolist())
        assert cached == (0 if i == 0 else 512)
    stats = cache.stats()
    per_request = (612 - 1) // 16  # full blocks before the last token
    assert (stats.queries, stats.hits, stats.hit_tokens) == (8 * per_request, 7 * 32, 7 * 512)
    assert stats.query_tokens == 8 * 612
    assert stats.hit_rate == pytest.approx(7 * 32 / (8 * per_request))
    # 8 prompts of 612 tokens in 32 shared + 8 * 7 own blocks instead of 8 * 39
    assert cache.num_used_blocks == 32 + 8 * 7
    assert cache.usage == pytest.approx((32 + 8 * 7) / 400)


def test_n_samples_share_the_partial_block_and_copy_it_on_first_write():
    prompt = list(range(50))  # 3 full blocks of 16 + 2 tokens
    cache = PagedCache(num_blocks=64, block_size=16)
    first = cache.add_sequence(("req", 0), prompt)
    tail = cache.block_table(("req", 0))[3]
    assert first == 0 and cache.take_copies() == []
    # each later sample reuses all but the last token: 3 full blocks and the first token of the
    # partial one, whose slot 1 it then writes: into a copy of the shared block
    cached = [cache.add_sequence(("req", i), prompt) for i in range(1, 4)]
    assert cached == [49, 49, 49]
    tables = [cache.block_table(("req", i)) for i in range(4)]
    assert all(t[:3] == tables[0][:3] for t in tables) and len({t[3] for t in tables}) == 4
    assert tables[0][3] == tail and cache.take_copies() == [(tail, t[3]) for t in tables[1:]]
    assert cache.refcount(tables[0][0]) == 4 and cache.refcount(tail) == 1
    stats = cache.stats()
    assert stats.copies == 3 and stats.hit_tokens == 3 * 49 and stats.hits == 3 * 3
    assert cache.blocks_needed(prompt) == 4 - 3  # the shared partial block is copied: it saves no block
    for i in range(4):  # each sample decodes into its own tail
        cache.append_tokens(("req", i), [1000 + i] * 20)
    assert cache.num_used_blocks == 3 + 4 * 2


def test_prompt_of_whole_blocks_recomputes_only_its_last_token():
    cache = PagedCache(num_blocks=8, block_size=4)
    cache.add_sequence("a", list(range(8)))
    # the block of the last token: its first 3 tokens are shared, then copied for the last one
    assert cache.add_sequence("b", list(range(8))) == 7
    assert cache.take_copies() == [(cache.block_table("a")[1], cache.block_table("b")[1])]
    assert cache.add_sequence("c", list(range(9))) == 8
    assert cache.stats().hits == 1 + 2 and cache.stats().hit_tokens == 7 + 8


def test_generated_tokens_enter_the_prefix_cache():
    cache = PagedCache(num_blocks=8, block_size=4)
    cache.add_sequence("turn1", [1, 2, 3])
    cache.append_tokens("turn1", [4, 5, 6, 7, 8])  # blocks [1 2 3 4] [5 6 7 8] full
    cache.free("turn1")
    assert cache.num_cached_blocks == 2
    assert cache.add_sequence("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 8


def test_prefix_caching_disabled_shares_nothing():
    cache = PagedCache(num_blocks=8, block_size=4, enable_prefix_caching=False)
    cache.add_sequence("a", list(range(9)))
    assert cache.add_sequence("b", list(range(9))) == 0
    cache.free("a")
    assert cache.num_cached_blocks == 0 and cache.stats().queries == 0


def test_equal_blocks_after_different_prefixes_are_not_shared():
    cache = PagedCache(num_blocks=8, block_size=2)
    cache.add_sequence("a", [1, 1, 5, 5, 0])
    assert cache.add_sequence("b", [2, 2, 5, 5, 0]) == 0  # [5, 5] follows another parent
    assert block_hash(block_hash(None, [1, 1]), [5, 5]) != block_hash(block_hash(None, [2, 2]), [5, 5])


# --- eviction ---


def test_eviction_is_least_recently_used_and_only_when_needed():
    cache = PagedCache(num_blocks=6, block_size=2)
    for name, tok in (("a", 1), ("b", 2), ("c", 3)):
        cache.add_sequence(name, [tok, tok, 0])  # one full named block + one partial
    blocks = {name: cache.block_table(name)[0] for name in "abc"}
    for name in "abc":
        cache.free(name)
    assert cache.num_cached_blocks == 3 and cache.num_free_blocks == 6
    assert cache.add_sequence("a2", [1, 1, 7]) == 2  # a hit takes "a" out of the evictable set
    cache.free("a2")  # ... and puts it back as the most recently used
    assert cache.eviction_order() == [blocks["b"], blocks["c"], blocks["a"]]
    cache.add_sequence("x", [9] * 5)  # 3 blocks: 3 unnamed free ones first, no eviction yet
    assert cache.stats().evictions == 0 and cache.num_cached_blocks == 3
    cache.append_tokens("x", [9] * 3)  # one more block: evicts "b", the least recently used
    assert cache.stats().evictions == 1 and cache.eviction_order() == [blocks["c"], blocks["a"]]
    assert cache.add_sequence("b2", [2, 2, 0]) == 0  # "b"'s prefix is gone


def test_a_freed_sequence_is_evicted_tail_first():
    cache = PagedCache(num_blocks=4, block_size=2)
    cache.add_sequence("a", [1, 2, 3, 4, 5, 6, 0])
    table = cache.block_table("a")
    cache.free("a")
    assert cache.eviction_order() == table[:3][::-1]  # the prefix's head is evicted last


# --- admission ---


def test_can_admit_counts_prefix_hits_and_lets_the_engine_queue():
    cache = PagedCache(num_blocks=5, block_size=4, max_blocks_per_seq=4)
    system = [7] * 8
    cache.add_sequence("a", system + [1, 2])  # 3 blocks
    assert cache.num_free_blocks == 2
    assert not cache.can_admit(11)  # 3 blocks by count alone
    assert cache.can_admit(system + [3, 4, 5])  # the 2 system blocks are shared: 1 new block
    assert cache.blocks_needed(system + [3, 4, 5]) == 1
    assert not cache.can_admit(system + [3], reserve_tokens=8)  # 1 + 2 reserved > 2 free
    assert not cache.can_admit(17)  # wider than max_blocks_per_seq
    cache.add_sequence("b", system + [3, 4, 5])
    assert cache.num_free_blocks == 1


def test_memory_grows_with_tokens_not_max_length():
    cache = PagedCache(num_blocks=100, block_size=16, max_blocks_per_seq=256)  # max_length 4096
    cache.add_sequence("a", [1] * 10)
    assert cache.num_used_blocks == 1
    for _ in range(30):
        cache.append_tokens("a", [2])
    assert cache.num_used_blocks == 3 and len(cache.block_table("a")) == 3


def test_block_tables_layout_for_the_kernels():
    cache = PagedCache(num_blocks=8, block_size=2, max_blocks_per_seq=4)
    cache.add_sequence("a", [1, 2, 3])
    cache.add_sequence("b", [4])
    tables = cache.block_tables(["b", "a"])
    assert tables.dtype == np.int32 and tables.shape == (2, 4)
    assert tables[0].tolist() == cache.block_table("b") + [0, 0, 0]
    assert tables[1, :2].tolist() == cache.block_table("a")
    assert cache.block_tables(["a"], width=2, pad=-1).tolist() == [cache.block_table("a")]
    with pytest.raises(ValueError, match="sequence 'a' has 2 blocks, more than width=1"):
        cache.block_tables(["a"], width=1)


# --- errors ---


def test_errors_name_what_was_wrong():
    cache = PagedCache(num_blocks=3, block_size=2, max_blocks_per_seq=2)
    with pytest.raises(KeyError, match="unknown sequence 'nope': it was never added"):
        cache.append_tokens("nope", [1])
    with pytest.raises(KeyError, match="unknown sequence 'nope'"):
        cache.free("nope")
    cache.add_sequence("a", [1, 2, 3])
    with pytest.raises(ValueError, match="sequence 'a' is already live"):
        cache.add_sequence("a", [1])
    with pytest.raises(ValueError, match="would hold 5 tokens, more than max_blocks_per_seq \\* block_size = 2 \\* 2 = 4"):
        cache.append_tokens("a", [4, 5])
    assert cache.num_tokens("a") == 3
    with pytest.raises(OutOfBlocks, match="sequence 'b' needs 2 new KV blocks for 4 tokens \\(0 cached\\), only 1 free of 3"):
        cache.add_sequence("b", [5, 6, 7, 8])
    assert "b" not in cache and cache.num_free_blocks == 1  # nothing claimed
    cache.add_sequence("c", [9])
    with pytest.raises(OutOfBlocks, match="sequence 'c' needs 1 more KV blocks to grow to 3 tokens, only 0 free"):
        cache.append_tokens("c", [9, 9])
    with pytest.raises(TypeError, match="token_ids\\[1\\] must be an integer token id, got 2.5"):
        cache.append_tokens("c", [1, 2.5])
    with pytest.raises(ValueError, match="the prompt is empty"):
        cache.add_sequence("d", [])
    cache.free("a")
    with pytest.raises(KeyError, match="sequence 'a' was already freed \\(double free\\?\\)"):
        cache.free("a")
    for bad in ({"num_blocks": 0, "block_size": 2}, {"num_blocks": 2, "block_size": True}):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            PagedCache(**bad)


def test_cached_prefix_looks_up_without_claiming_or_counting():
    cache = PagedCache(num_blocks=8, block_size=4)
    cache.add_sequence("a", list(range(10)))
    before = (cache.stats(), cache.num_free_blocks)
    # both full blocks and the partial block of its tokens before the last one
    assert cache.cached_prefix(list(range(9)) + [99]) == cache.block_table("a")
    assert cache.cached_prefix(list(range(8)) + [77, 99]) == cache.block_table("a")[:2]  # the partial differs
    assert cache.cached_prefix([5, 5, 5, 5, 5]) == []
    assert (cache.stats(), cache.num_free_blocks) == before


def test_a_repeated_lookup_sees_evictions_resets_and_new_names():
    """The cache remembers its last lookup; a block named, evicted or reset in between is seen."""
    cache = PagedCache(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    assert cache.cached_prefix(prompt) == []
    cache.add_sequence("a", prompt)
    hits = cache.cached_prefix(prompt)
    assert hits == cache.block_table("a")[:2] and cache.cached_prefix(prompt) == hits  # named since
    cache.free("a")
    assert cache.cached_prefix(prompt) == hits
    cache.add_sequence("b", [7, 7, 7, 7, 7, 7, 7])  # 4 blocks: evicts all of "a"'s
    assert cache.cached_prefix(prompt) == []
    cache.free("b")
    cache.add_sequence("c", prompt)
    cache.free("c")
    assert len(cache.cached_prefix(prompt)) == 2
    cache.reset_prefix_cache()
    assert cache.cached_prefix(prompt) == [] and cache.blocks_needed(prompt) == 3


def test_free_with_written_forgets_blocks_never_computed():
    # a sequence cancelled mid-prefill: its first 4 tokens were written, its next full block not
    cache = PagedCache(num_blocks=8, block_size=4)
    cache.add_sequence("a", list(range(10)))
    first, second = cache.block_table("a")[:2]
    cache.free("a", written=4)
    assert cache.cached_prefix(list(range(10))) == [first]  # the second block's name is gone
    assert cache.num_cached_blocks == 1 and cache.num_free_blocks == 8 and second not in cache.eviction_order()
    # written covers everything: both full blocks and the partial one stay cached
    cache.add_sequence("b", list(range(10)))
    cache.free("b", written=10)
    assert len(cache.cached_prefix(list(range(10)))) == 3
